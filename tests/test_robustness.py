"""Hostile input at the public entry points: random shapes, dtypes, value ranges and settings.

Every call must either return a well-formed result or raise one of the documented errors (`ValueError` or
`TypeError`, with a message) before any heavy work: never an `IndexError`, a `RuntimeError` from deep inside torch,
an allocator error, a hang or a silently malformed output. Bounded in time: few examples per entry point, frames
capped at 3, the tiny golden checkpoint.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformers_drama3 import Drama3Voice, synthesize


EXAMPLES = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FINISH_REASONS = {"eos", "length", "context", "stop"}


@pytest.fixture(scope="module")
def model(golden_model):
    return golden_model  # the session's (conftest.py): these tests change nothing in it


@pytest.fixture(scope="module")
def processor(golden_processor):
    return golden_processor


def cleanly(call):
    """`call()`'s result, or None when it raised a documented error (ValueError/TypeError) with a message."""
    try:
        return call()
    except (ValueError, TypeError) as error:
        assert len(str(error)) > 10, f"an error without a useful message: {error!r}"
        return None


# Values of every kind a caller might pass: valid ones, off-by-one, wrong types, NaN and infinities.
ANY_NUMBER = st.one_of(
    st.integers(-3, 40), st.sampled_from([0.0, 0.5, 1.0, 1.5, -0.1, math.nan, math.inf, -math.inf, 2**70, None, "1", True]),
)
SETTINGS = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.integers(-2, 3), st.sampled_from([None, 2.5, "2", True])),
    "temperature": ANY_NUMBER, "top_p": ANY_NUMBER, "top_k": ANY_NUMBER,
    "ras_window": ANY_NUMBER, "ras_top_k": ANY_NUMBER, "codebook_top_p": ANY_NUMBER,
    "do_sample": st.sampled_from([True, False, 1, None, "yes"]),
    "stop_check_interval": ANY_NUMBER,
    "seed": st.one_of(st.integers(-(2**64), 2**65), st.sampled_from([None, 1.5, "7", [1, 2], []])),
})


@st.composite
def frame_rows(draw):
    """Frame rows: mostly well-formed prompts (text rows, audio rows) with random damage, sometimes anything."""
    dtype = draw(st.sampled_from([torch.long, torch.long, torch.long, torch.int32, torch.float32, torch.bool]))
    if draw(st.booleans()):  # a free shape
        shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
        values = draw(st.integers(-5, 600))
        return torch.full(shape, values).to(dtype)
    batch, rows = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    frames = torch.zeros(batch, rows, 11, dtype=torch.long)
    frames[..., 0] = draw(st.integers(0, 400))  # text ids below the semantic band (421..484)
    audio_rows = draw(st.integers(0, rows))
    if audio_rows:
        codes = torch.randint(0, 64, (batch, audio_rows, 10), generator=torch.Generator().manual_seed(rows))
        frames[:, -audio_rows:, 1:], frames[:, -audio_rows:, 0] = codes, 421 + codes[..., 0]
    if draw(st.booleans()):  # damage one entry
        b, t, c = draw(st.integers(0, batch - 1)), draw(st.integers(0, rows - 1)), draw(st.integers(0, 10))
        frames[b, t, c] = draw(st.sampled_from([-7, -1, 64, 421, 483, 511, 512, 10**6]))
    return frames.to(dtype)


@st.composite
def masks(draw, frames):
    if frames.dim() < 2 or draw(st.booleans()):
        return None
    shape = tuple(frames.shape[:2]) if draw(st.integers(0, 4)) else (frames.shape[0], frames.shape[1] + 1)
    kind = draw(st.sampled_from(["left", "ones", "random", "float", "twos"]))
    if kind == "ones":
        return torch.ones(shape, dtype=torch.long)
    if kind == "twos":
        return torch.full(shape, 2)
    if kind == "float":
        return torch.ones(shape) * draw(st.sampled_from([1.0, 0.5]))
    mask = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    if kind == "left":
        mask = mask.sort(dim=-1).values  # zeros first
    return mask


def assert_well_formed(out, frames):
    batch, rows = frames.shape[:2]
    assert out.sequences.dtype == torch.long and out.sequences.shape[:2] == (batch, out.sequences.shape[1])
    assert out.sequences.shape[1] >= rows and out.sequences.shape[2] == 11
    for codes, reason in zip(out.codes, out.finish_reason):
        assert codes.shape[0] == 10 and reason in FINISH_REASONS
        assert codes.numel() == 0 or (codes.min() >= 0 and codes.max() < 64)
    for audio in out.audio or ():
        assert audio.dtype == torch.float32 and bool(torch.isfinite(audio).all())


@EXAMPLES
@given(data=st.data(), kwargs=SETTINGS)
def test_generate_returns_well_formed_frames_or_a_clear_error(model, data, kwargs):
    frames = data.draw(frame_rows())
    mask = data.draw(masks(frames))
    kwargs.setdefault("max_new_tokens", 2)
    if isinstance(kwargs["max_new_tokens"], int) and kwargs["max_new_tokens"] > 3:
        kwargs["max_new_tokens"] = 3
    out = cleanly(lambda: model.generate(frames, attention_mask=mask, **kwargs))
    if out is not None:
        assert_well_formed(out, frames)


@EXAMPLES
@given(data=st.data())
def test_forward_returns_finite_logits_or_a_clear_error(model, data):
    frames = data.draw(frame_rows())
    mask = data.draw(masks(frames))
    labels = frames if data.draw(st.booleans()) else data.draw(frame_rows())
    with torch.no_grad():
        out = cleanly(lambda: model(frames, attention_mask=mask, labels=labels if data.draw(st.booleans()) else None))
    if out is not None:
        assert out.main_logits.shape[:2] == frames.shape[:2] and bool(torch.isfinite(out.main_logits).all())
        assert out.loss is None or bool(torch.isfinite(out.loss))


@EXAMPLES
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    value=st.sampled_from([-4, 0, 3, 63, 64, 1023, 4096, 10**6]),
    dtype=st.sampled_from([torch.long, torch.int32, torch.float32, torch.bool]),
)
def test_codec_decode_returns_finite_audio_or_a_clear_error(model, shape, value, dtype):
    audio = cleanly(lambda: model.codec.decode(torch.full(shape, value).to(dtype)).audio_values[:, 0])
    if audio is not None:
        assert audio.dtype == torch.float32 and bool(torch.isfinite(audio).all()) and audio.abs().max() <= 1


@EXAMPLES
@given(
    samples=st.integers(0, 5000),
    channels=st.sampled_from([None, 1, 2]),
    value=st.sampled_from([0.0, 0.3, -1.5, 7.0, math.nan, math.inf]),
    rate=st.sampled_from([44100, 48000, 16000, 8000, 0, -1, 1, 10**9, 44100.5, "44100", None]),
)
def test_codec_encode_returns_codes_or_a_clear_error(model, samples, channels, value, rate):
    shape = (1, samples) if channels is None else (1, channels, samples)
    codes = cleanly(lambda: model.codec.encode(torch.full(shape, value), rate).audio_codes)
    if codes is not None:
        assert codes.dtype == torch.long and codes.shape[:2] == (1, 10) and codes.min() >= 0


@EXAMPLES
@given(
    text=st.one_of(st.text(max_size=40), st.sampled_from(["", "  ", "<|im_end|>", "<|speaker:99|> hi", "<|semantic:3|>"])),
    codes=st.sampled_from([None, "bad", torch.zeros(10, 2, dtype=torch.long), -torch.ones(10, 2, dtype=torch.long),
                           torch.zeros(2, 10, dtype=torch.long), torch.zeros(10, 0, dtype=torch.long), torch.zeros(10, 3)]),
)
def test_processor_returns_prompt_rows_or_a_clear_error(processor, text, codes):
    references = None if codes is None else [{"transcript": "Hello.", "codes": codes}]
    inputs = cleanly(lambda: processor(text, references=references))
    if inputs is not None:
        assert inputs["input_ids"].dim() == 3 and inputs["input_ids"].shape[-1] == 11


@EXAMPLES
@given(content=st.binary(max_size=200))
def test_voice_load_reads_a_voice_or_gives_a_clear_error(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("voice") / "voice.safetensors"
    path.write_bytes(content)
    assert cleanly(lambda: Drama3Voice.load(path)) is None  # random bytes are never a voice file


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=30), st.sampled_from(["Hi.", "", "<|voice|>"])), kwargs=SETTINGS)
def test_synthesize_returns_audio_or_a_clear_error(model, processor, text, kwargs):
    kwargs["max_new_tokens"] = 2 if not isinstance(kwargs.get("max_new_tokens"), int) else min(kwargs["max_new_tokens"], 2)
    speech = cleanly(lambda: synthesize(model, processor, text, show_progress=False, **kwargs))
    if speech is not None:
        assert speech.audio.dtype == torch.float32 and bool(torch.isfinite(speech.audio).all())
