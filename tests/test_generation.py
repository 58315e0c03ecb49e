"""Speech generation: golden greedy run, the sampling rules, RAS, seeds, batching, streaming, stopping, bad inputs."""

import pytest
import torch

from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.streaming import Drama3AudioStreamer
from transformers_drama3.sampling import RepetitionAwareLogitsProcessor, TopKTopPWarper, draw
from transformers_drama3.testing import write_tiny_checkpoint

from .conftest import golden_generation_model, left_padded


@pytest.fixture(scope="module")
def model():
    return golden_generation_model()


@pytest.fixture(scope="module")
def prompt(expected):
    return expected["prompt_a_rows"][None]


# ---------------------------------------------------------------------------------------------------------------
# Golden
# ---------------------------------------------------------------------------------------------------------------


def test_greedy_generation_reproduces_golden(model, prompt, expected):
    out = model.generate(prompt, do_sample=False, max_new_tokens=16)
    assert out.finish_reason == ["eos"]
    assert torch.equal(out.codes[0].T, expected["greedy_codes"])
    generated = out.sequences[0, prompt.shape[1] :]
    assert torch.equal(generated, expected["greedy_frames"])
    assert out.audio[0].shape == (expected["greedy_codes"].shape[0] * 2048,) and out.audio[0].dtype == torch.float32
    assert out.sampling_rate == 44100


@pytest.mark.parametrize(
    "case", ["main_default", "main_t07_p07", "main_ras_redraw", "head_default", "head_flat_topk_binds", "head_t15_p08"]
)
def test_sampling_rule_keeps_the_golden_sets(expected, cases, case):
    settings = next(c for c in cases["sampling"] if c["name"] == case)
    warper = TopKTopPWarper(settings["temperature"], settings["top_k"], settings["top_p"], settings["keep_crossing"])
    logits = expected[f"sampling_{case}_logits"][None]
    kept = warper(None, logits)[0] > float("-inf")
    assert torch.equal(kept, expected[f"sampling_{case}_kept"])


def test_draws_follow_the_kept_and_renormalised_distribution():
    """20 000 draws; each frequency within 5 standard deviations of its probability (a fair test fails ~1e-6)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    warper = TopKTopPWarper(temperature=0.8, top_k=5, top_p=0.9, keep_crossing=False)
    expected = warper(None, logits).softmax(-1)[0]
    samples = draw(warper(None, logits).expand(20_000, -1), torch.Generator().manual_seed(0))
    frequency = torch.bincount(samples, minlength=8).double() / samples.numel()
    sigma = (expected.double() * (1 - expected.double()) / samples.numel()).sqrt()
    assert ((frequency - expected).abs() <= 5 * sigma + 1e-12).all()
    assert frequency[expected == 0].sum() == 0


# ---------------------------------------------------------------------------------------------------------------
# Repetition-aware sampling
# ---------------------------------------------------------------------------------------------------------------


def _ras(window=16):
    return RepetitionAwareLogitsProcessor(
        TopKTopPWarper(1.0, None, 0.9, keep_crossing=True), TopKTopPWarper(1.0, 3, 0.95, keep_crossing=True), window
    )


def _peaked_logits(peak=5):
    """Column `peak` takes 92 % of the mass: the first rule (top_p 0.9, crossing kept) keeps it alone, the
    second (top_p 0.95, top_k 3) keeps it and the two next ones."""
    probs = torch.tensor([0.001, 0.02, 0.02, 0.01, 0.009, 0.0, 0.01, 0.01, 0.0])
    probs[peak] = 0.92
    return (probs / probs.sum()).clamp(min=1e-6).log()[None]  # [1, V + 1] with V = 8


def test_ras_redraws_a_repeated_semantic_token_with_its_own_settings():
    ras, logits = _ras(), _peaked_logits()
    history = torch.tensor([[-1, -1, 2, 5, 7]])  # column 5 was drawn recently
    probs = ras(history, logits).exp()[0]
    second = ras.second(None, logits).softmax(-1)[0]
    torch.testing.assert_close(probs, second)  # the first draw is the repeat: all mass moves to the second draw
    assert (probs > 0).sum() == 3 and (ras.first(None, logits) > float("-inf")).sum() == 1


def test_ras_keeps_the_first_draw_when_not_repeated():
    ras, logits = _ras(), _peaked_logits()
    probs = ras(torch.tensor([[-1, 2, 7]]), logits).exp()[0]
    torch.testing.assert_close(probs, ras.first(None, logits).softmax(-1)[0])


def test_ras_window_slides_and_eos_never_triggers():
    ras, logits = _ras(window=3), _peaked_logits()
    old_repeat = torch.tensor([[5, 1, 2, 3]])  # column 5 is 4 draws back: outside a window of 3
    torch.testing.assert_close(ras(old_repeat, logits).exp()[0], ras.first(None, logits).softmax(-1)[0])
    eos_logits = _peaked_logits(peak=0)
    torch.testing.assert_close(ras(torch.tensor([[0, 0, 0]]), eos_logits).exp()[0], ras.first(None, eos_logits).softmax(-1)[0])


def test_ras_mixture_matches_two_draws_statistically():
    """The single-draw mixture has the law of the official two-draw procedure (draw, redraw on a repeat)."""
    logits = torch.tensor([[0.2, 1.0, 1.3, 0.1, 0.8, 0.0, -0.3, 0.6, 0.4]])
    ras, history = _ras(), torch.tensor([[2, 4]])
    generator, n = torch.Generator().manual_seed(1), 20_000
    first = draw(ras.first(None, logits).expand(n, -1), generator)
    second = draw(ras.second(None, logits).expand(n, -1), generator)
    two_draws = torch.where((first == 2) | (first == 4), second, first)
    frequency = torch.bincount(two_draws, minlength=9).double() / n
    expected = ras(history, logits).exp()[0].double()
    assert ((frequency - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-12).all()


# ---------------------------------------------------------------------------------------------------------------
# Seeds, batching, streaming
# ---------------------------------------------------------------------------------------------------------------


def test_seeded_runs_are_identical(model, prompt):
    a = model.generate(prompt, seed=7, max_new_tokens=12)
    b = model.generate(prompt, seed=7, max_new_tokens=12)
    c = model.generate(prompt, generator=torch.Generator().manual_seed(7), max_new_tokens=12)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences, c.sequences)
    assert torch.equal(a.audio[0], b.audio[0])
    d = model.generate(prompt, seed=8, max_new_tokens=12)
    assert not torch.equal(a.sequences, d.sequences)


def test_greedy_batch_equals_single_and_finished_sequences_leave_the_batch(model, expected):
    a, b = expected["prompt_a_rows"], expected["prompt_b_rows"]
    batch, mask = left_padded(a, b)
    sizes = []
    original = model.tower.decode_frame

    def spy(hidden, *args, **kwargs):
        sizes.append(hidden.shape[0])
        return original(hidden, *args, **kwargs)

    model.tower.decode_frame = spy
    try:
        together = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=18, stop_check_interval=1)
    finally:
        del model.tower.decode_frame
    alone = [model.generate(p[None], do_sample=False, max_new_tokens=18) for p in (a, b)]
    for index, single in enumerate(alone):
        assert torch.equal(together.codes[index], single.codes[0])
        assert together.finish_reason[index] == single.finish_reason[0]
        torch.testing.assert_close(together.audio[index], single.audio[0])
    assert together.finish_reason[0] == "eos"  # prompt a stops after 12 frames (golden run)
    assert sizes[:13] == [2] * 13 and set(sizes[13:]) == {1}  # after its EOS step, only one sequence runs


def test_streamed_audio_equals_the_one_shot_audio(model, prompt):
    streamer = Drama3AudioStreamer(model.codec, chunk_frames=3, first_chunk_frames=1)
    out = model.generate(prompt, seed=3, max_new_tokens=11, streamer=streamer)
    chunks = list(streamer)
    assert [c.numel() // 2048 for c in chunks] == [1, 3, 3, 3, 1]
    # Same codes, same codec: the streaming decoder only sums in another order. 5e-5 is the bound the codec's own
    # streaming tests use (float32 rounding through ~30 conv layers, measured ~1e-5), far below audibility.
    torch.testing.assert_close(torch.cat(chunks), out.audio[0], atol=5e-5, rtol=0)


def test_streaming_needs_batch_one(model, expected):
    batch, mask = left_padded(expected["prompt_a_rows"], expected["prompt_b_rows"])
    with pytest.raises(ValueError, match="one sequence at a time"):
        model.generate(batch, attention_mask=mask, streamer=Drama3AudioStreamer(model.codec), max_new_tokens=2)


# ---------------------------------------------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------------------------------------------


def test_length_stop_keeps_the_audio(model, prompt):
    # The golden tiny model draws EOS often; take the first seed whose run reaches the limit.
    runs = (model.generate(prompt, seed=seed, max_new_tokens=5, output_audio=True) for seed in range(20))
    out = next(run for run in runs if run.finish_reason != ["eos"])
    assert out.finish_reason == ["length"]
    assert out.codes[0].shape == (10, 5) and out.audio[0].shape == (5 * 2048,)


def test_context_limit_stop_keeps_the_audio(tmp_path, expected):
    """A prompt of 59 rows in a context of 64 rows: 5 frames fit (the last is kept but not fed back)."""
    small = FishOmniForSpeech.from_pretrained(
        write_tiny_checkpoint(tmp_path, seed=2, text_config={"max_position_embeddings": 64}), dtype=torch.float32
    )
    out = small.generate(expected["prompt_a_rows"][None], seed=0, max_new_tokens=50)
    assert out.finish_reason == ["context"]
    assert out.codes[0].shape == (10, 64 - 59 + 1)
    assert out.audio[0].shape == (out.codes[0].shape[1] * 2048,)


def test_greedy_needs_no_positive_temperature(model, prompt):
    out = model.generate(prompt, do_sample=False, temperature=0.0, max_new_tokens=3, output_audio=False)
    assert out.audio is None and out.codes[0].shape[1] == 3


def test_settings_live_on_the_generation_config(model, prompt):
    assert model.generation_config.ras_window == 16 and model.generation_config.codebook_top_k == 30
    assert model.generation_config.top_k is None and model.generation_config.top_p == 0.9
    sequences = model.generate(prompt, do_sample=False, max_new_tokens=2, return_dict_in_generate=False)
    assert sequences.shape == (1, prompt.shape[1] + 2, 11)


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,needle",
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"codebook_temperature": -1.0}, ValueError, "codebook_temperature"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"ras_top_p": 1.5}, ValueError, "ras_top_p"),
        ({"temprature": 0.5}, TypeError, "temprature"),
        ({"num_beams": 4}, TypeError, "num_beams"),
    ],
)
def test_bad_settings(model, prompt, kwargs, error, needle):
    with pytest.raises(error, match=needle):
        model.generate(prompt, **kwargs)


def test_bad_input_rows(model):
    with pytest.raises(ValueError, match=r"frame rows \[batch, rows, 11\]"):
        model.generate(torch.zeros(1, 4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one prompt row"):
        model.generate(torch.zeros(1, 0, 11, dtype=torch.long))


@pytest.mark.parametrize("fast_decode", [False, True])
def test_overlapped_streaming_gives_the_same_chunks(model, prompt, fast_decode):
    """`overlap=True` decodes in a worker thread: the same chunks in the same order as decoding in line."""
    inline = Drama3AudioStreamer(model.codec, chunk_frames=3, first_chunk_frames=1)
    overlapped = Drama3AudioStreamer(model.codec, chunk_frames=3, first_chunk_frames=1, overlap=True)
    a = model.generate(prompt, seed=3, max_new_tokens=11, streamer=inline, fast_decode=fast_decode)
    b = model.generate(prompt, seed=3, max_new_tokens=11, streamer=overlapped, fast_decode=fast_decode)
    assert torch.equal(a.sequences, b.sequences)
    assert [c.shape for c in overlapped.chunks] == [c.shape for c in inline.chunks] and len(inline.chunks) > 2
    assert all(torch.equal(x, y) for x, y in zip(overlapped.chunks, inline.chunks))
    assert [c.shape for c in overlapped] == [c.shape for c in inline.chunks]  # the iterator ends after the last


def test_overlapped_streaming_reraises_a_codec_error(model, prompt, monkeypatch):
    streamer = Drama3AudioStreamer(model.codec, chunk_frames=2, overlap=True)

    def broken(codes):
        raise RuntimeError("codec failed")

    monkeypatch.setattr(streamer.decoder, "decode", broken)
    with pytest.raises(RuntimeError, match="codec failed"):
        model.generate(prompt, seed=3, max_new_tokens=6, streamer=streamer)
    assert list(streamer) == []  # a consumer still sees the end of the stream
