"""Prefix caches (`PromptCache`, `generate(prompt_cache=...)`, `PromptCacheStore`) against generation without one.

A prefill from a cached voice prefix computes the same sums as a prefill over all rows, split at another row (the
cached attention rows and the recurrent state carried over instead of one pass), so hidden states differ by rounding
only: tests/tolerances.py bounds it by 2 * u * R * max|reference|, R the backbone's reduction lengths; transformers'
reference gated-delta kernels compute in float32 whatever the dtype, so u is float32's although the model runs in
float64 (as in tests/test_frame_step.py). Frames are compared exactly: greedy and seeded sampled draws change only
when two candidates' logits lie within that rounding, which a float64 model makes vanishingly unlikely.
"""

import pytest
import torch

from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.generation.prompt_cache import PromptCache, PromptCacheStore, prefill
from transformers_drama3.voice import Drama3Voice

from .conftest import GOLDEN_TINY
from .tolerances import backbone_reductions, unit_roundoff

FRAMES = 6


@pytest.fixture(scope="module")
def model64():
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float64)
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model


def random_voice(model, frames: int, seed: int) -> Drama3Voice:
    codes = torch.randint(0, model.config.audio_decoder_config.vocab_size, (model.config.num_codebooks, frames),
                          generator=torch.Generator().manual_seed(seed))
    return Drama3Voice(codes, "This is how I sound.")


@pytest.fixture(scope="module")
def voice(model64):
    return random_voice(model64, 40, seed=0)


@pytest.fixture(scope="module")
def voice_cache(model64, golden_processor, voice):
    return PromptCache.build(model64, golden_processor.reference_prefix_rows([voice]))


def test_the_voice_prefix_is_the_first_rows_of_every_prompt_with_it(golden_processor, voice):
    prefix = golden_processor.reference_prefix_rows([voice])
    assert prefix.shape[0] > voice.codes.shape[1]
    other = random_voice_like(voice)
    for text, history, extra in (("Hello.", None, []), ("A longer line to say.", [("Before.", voice.codes[:, :5])],
                                                        [other])):
        rows = golden_processor.build_prompt_rows(text, references=[voice, *extra], history=history)
        assert torch.equal(rows[: prefix.shape[0]], prefix)


def random_voice_like(voice: Drama3Voice) -> Drama3Voice:
    return Drama3Voice(voice.codes.flip(1), "Someone else.")


def test_prefill_from_the_cache_equals_the_full_prefill(model64, golden_processor, voice, voice_cache):
    inputs = golden_processor("Good morning to you.", references=[voice])
    mask, _ = model64.checked_inputs(inputs["input_ids"], inputs["attention_mask"])  # what generate prefills with
    full = prefill(model64, inputs["input_ids"], mask, None)
    cached = prefill(model64, inputs["input_ids"], mask, voice_cache)
    rows = inputs["input_ids"].shape[1]
    assert cached.last_hidden_state.shape[1] == rows - voice_cache.length
    assert cached.cache.get_seq_length() == full.cache.get_seq_length() == rows
    reference = full.last_hidden_state[:, -1]
    atol = 2 * unit_roundoff(torch.float32) * backbone_reductions(model64.config.text_config, rows)
    torch.testing.assert_close(cached.last_hidden_state[:, -1], reference,
                               atol=atol * reference.abs().max().item(), rtol=0)


@pytest.mark.parametrize("sampling", [{"do_sample": False}, {"seed": [5, 6]}], ids=["greedy", "seeded"])
def test_generate_with_the_cache_gives_the_frames_without_it(model64, golden_processor, voice, voice_cache, sampling):
    # Two prompts of the same length: the cached prefix is repeated for the batch.
    inputs = golden_processor(["Good morning to you.", "Good evening to you."], references=[[voice], [voice]])
    assert bool(inputs["attention_mask"].all())
    plain = model64.generate(**inputs, max_new_tokens=FRAMES, output_audio=False, **sampling)
    cached = model64.generate(**inputs, max_new_tokens=FRAMES, output_audio=False, prompt_cache=voice_cache, **sampling)
    again = model64.generate(**inputs, max_new_tokens=FRAMES, output_audio=False, prompt_cache=voice_cache, **sampling)
    assert plain.codes[0].shape[1] > 0
    assert torch.equal(cached.sequences, plain.sequences)
    assert torch.equal(again.sequences, plain.sequences)  # the cache is copied, never extended in place
    assert cached.finish_reason == plain.finish_reason


def test_a_cache_that_does_not_fit_the_prompt_is_refused(model64, golden_processor, voice, voice_cache):
    other = golden_processor("Good morning to you.", references=[random_voice_like(voice)])
    with pytest.raises(ValueError, match="differs from the prompt cache's prefix"):
        model64.generate(**other, max_new_tokens=2, prompt_cache=voice_cache)
    padded = golden_processor(["Good morning to you, and a good day.", "Hi."], references=[[voice], [voice]])
    with pytest.raises(ValueError, match="sequence 1 of the batch is left-padded inside the cached prefix"):
        model64.generate(**padded, max_new_tokens=2, prompt_cache=voice_cache)
    prefix = voice_cache.rows[None]
    with pytest.raises(ValueError, match="at least one row after the cached prefix"):
        model64.generate(prefix, max_new_tokens=2, prompt_cache=voice_cache)
    with pytest.raises(TypeError, match="prompt_cache must be a PromptCache"):
        model64.generate(**other, max_new_tokens=2, prompt_cache=voice_cache.cache)
    with pytest.raises(ValueError, match="frame rows of one prefix"):
        PromptCache.build(model64, prefix)


def fake_cache(nbytes: int) -> PromptCache:
    return PromptCache(torch.zeros(1, 11, dtype=torch.long), None, None, nbytes)


def test_the_store_evicts_the_least_recently_used_within_its_bound():
    store = PromptCacheStore(max_bytes=250)
    built = []

    def build(nbytes):
        def make():
            built.append(nbytes)
            return fake_cache(nbytes)
        return make

    a = store.get("a", build(100))
    store.get("b", build(100))
    assert store.get("a", build(999)) is a  # a hit: not rebuilt, and now the most recently used
    store.get("c", build(100))  # 300 > 250: "b", the least recently used, goes
    assert list(store.entries) == ["a", "c"] and store.nbytes == 200
    store.get("huge", build(1000))  # larger than the bound: returned, never stored
    assert list(store.entries) == ["a", "c"]
    assert built == [100, 100, 100, 1000]
    assert store.stats() == {"entries": 2, "bytes": 200, "max_bytes": 250, "hits": 1, "misses": 4, "evictions": 1}
    with pytest.raises(ValueError, match="max_bytes must be an integer >= 0"):
        PromptCacheStore(-1)


def test_the_cache_reports_the_memory_its_caches_hold(voice_cache):
    cache, tower = voice_cache.cache, voice_cache.tower_cache
    attention = [layer for layer in cache.layers if hasattr(layer, "keys")]
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in attention)
    assert kv > 0 and voice_cache.nbytes > kv + sum(layer.keys.nbytes for layer in tower.layers)
