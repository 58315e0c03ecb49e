"""`pipeline("text-to-speech")` on a tiny checkpoint: Auto classes, the processor's prompt, generate_kwargs, voices."""

import copy

import numpy as np
import pytest
import torch
from transformers import pipeline
from transformers.pipelines.base import pad_collate_fn

import transformers_drama3  # noqa: F401  (registers the Drama 3 classes)
from transformers_drama3 import Drama3Processor, FishOmniForSpeech
from transformers_drama3.generation import DRAMA3_GENERATION_DEFAULTS
from transformers_drama3.processing_drama3 import left_pad_rows
from transformers_drama3.voice import Drama3Voice

from .conftest import GOLDEN_TINY

GREEDY = {"do_sample": False, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def tts():
    return pipeline("text-to-speech", model=str(GOLDEN_TINY), dtype=torch.float32)


class _Stop(Exception):
    pass


def _spy(tts, monkeypatch, stop=False):
    """Record the keyword arguments of `model.generate`; with `stop`, end the call there."""
    calls = []
    generate = tts.model.generate

    def spy(**kwargs):
        calls.append(kwargs)
        if stop:
            raise _Stop
        return generate(**kwargs)

    monkeypatch.setattr(tts.model, "generate", spy)
    return calls


def test_pipeline_loads_the_drama3_classes(tts):
    assert isinstance(tts.model, FishOmniForSpeech)
    assert isinstance(tts.processor, Drama3Processor)  # not the raw tokenizer: prompts get the Drama 3 template
    assert tts.sampling_rate == 44100


def test_one_text_gives_the_audio_of_the_processor_prompt(tts, monkeypatch):
    calls = _spy(tts, monkeypatch)
    out = tts("Hello there.", generate_kwargs=GREEDY)

    assert set(out) == {"audio", "sampling_rate"} and out["sampling_rate"] == 44100
    assert isinstance(out["audio"], np.ndarray) and out["audio"].dtype == np.float32
    assert out["audio"].shape == (3 * 2048,)
    expected = tts.processor("Hello there.")
    assert torch.equal(calls[0]["input_ids"], expected["input_ids"])
    direct = tts.model.generate(**expected, **GREEDY)
    np.testing.assert_array_equal(out["audio"], direct.audio[0].numpy())


def test_a_list_gives_one_output_per_text_and_seeds_repeat(tts):
    texts = ["Hello there.", "<|speaker:1|> Good morning, everyone."]
    sampled = {"generate_kwargs": {"max_new_tokens": 2}, "forward_params": {"seed": 7}}
    first, second = tts(texts, **sampled), tts(texts, **sampled)
    assert [o["audio"].shape for o in first] == [(2 * 2048,), (2 * 2048,)]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a["audio"], b["audio"])


def test_the_pipeline_keeps_the_drama3_frame_limit(tts, monkeypatch):
    """transformers' pipelines default to max_new_tokens=256 unless the model's generation config sets it."""
    calls = _spy(tts, monkeypatch, stop=True)
    with pytest.raises(_Stop):
        tts("Hello there.")
    kwargs = calls[0]
    config = kwargs.get("generation_config") or tts.model.generation_config
    assert kwargs.get("max_new_tokens", config.max_new_tokens) == DRAMA3_GENERATION_DEFAULTS["max_new_tokens"]
    assert kwargs.get("do_sample", config.do_sample) is True


def test_voice_references_through_preprocess_params(tts, monkeypatch):
    codes = torch.randint(0, 64, (10, 4), generator=torch.Generator().manual_seed(0))
    voice = Drama3Voice(codes=codes, transcript="This is my voice.")
    calls = _spy(tts, monkeypatch)
    # the pipeline passes the text as a batch of one: references hold one entry for it
    out = tts("Hello there.", preprocess_params={"references": [voice]}, generate_kwargs=GREEDY)
    assert out["audio"].shape == (3 * 2048,)
    expected = tts.processor("Hello there.", references=[voice])["input_ids"]
    assert torch.equal(calls[0]["input_ids"], expected)


def test_bad_settings_are_errors(tts):
    with pytest.raises(TypeError, match="unknown"):
        tts("Hello there.", generate_kwargs={"temprature": 0.5, "max_new_tokens": 1})
    with pytest.raises(ValueError, match="top_p"):
        tts("Hello there.", generate_kwargs={"top_p": 1.5, "max_new_tokens": 1})
    with pytest.raises(ValueError, match="empty"):
        tts("  ")


def test_a_bad_reference_fails_in_preprocessing_before_generate(tts, monkeypatch, tmp_path):
    calls = _spy(tts, monkeypatch)
    good = Drama3Voice(codes=torch.zeros(10, 2, dtype=torch.long), transcript="Mine.")
    missing = {"transcript": "Mine.", "audio": str(tmp_path / "missing.wav")}
    monkeypatch.setattr(tts.processor, "codec", tts.model.codec)  # what docs/usage.md says to do once
    with pytest.raises(FileNotFoundError, match=r"references\[0\]\[1\]: audio file .* does not exist"):
        tts("Hello there.", preprocess_params={"references": [[good, missing]]})
    assert calls == []


def test_rows_padded_by_the_pipeline_collator_become_the_processors_batch(tts):
    """transformers' batching collator pads frame rows on the tokenizer's side with its pad id in all 11 columns;
    `left_pad_rows` turns that into the processor's left-padded batch (what `generate` reads)."""
    texts = ["Hello there.", "Hi.", "<|speaker:1|> Good morning, everyone."]
    tokenizer = copy.deepcopy(tts.tokenizer)
    tokenizer.pad_token = tokenizer.eos_token  # the checkpoint's tokenizer has no pad token; batching needs one
    collated = pad_collate_fn(tokenizer, None)([dict(tts.preprocess(text)) for text in texts])
    assert tokenizer.padding_side == "right" and bool((collated["input_ids"][1, -1] == tokenizer.pad_token_id).all())
    input_ids, attention_mask = left_pad_rows(collated["input_ids"], collated["attention_mask"])
    expected = tts.processor(texts)
    assert torch.equal(input_ids, expected["input_ids"]) and torch.equal(attention_mask, expected["attention_mask"])


def test_batch_size_two_gives_one_result_per_text_equal_to_single_calls(tts):
    """`pipeline(..., batch_size=2)` on 3 texts: the collator's right-padded rows are realigned by `generate`, and the
    pipeline splits the batched output into one result per text, each equal to the text alone (greedy)."""
    texts = ["Hello there.", "Hi.", "<|speaker:1|> Good morning, everyone."]
    tts.tokenizer.pad_token = tts.tokenizer.eos_token  # the checkpoint's tokenizer has no pad token (docs/usage.md)
    batched = tts(texts, batch_size=2, generate_kwargs={"do_sample": False, "max_new_tokens": 6})
    single = [tts(text, generate_kwargs={"do_sample": False, "max_new_tokens": 6}) for text in texts]
    assert len(batched) == 3
    for together, alone in zip(batched, single):
        assert together["sampling_rate"] == alone["sampling_rate"] == 44100
        np.testing.assert_array_equal(together["audio"], alone["audio"])
