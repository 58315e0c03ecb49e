"""`synthesize`: long text in chunks with history turns (docs/format.md, "Long text"), one continuous waveform, voice cloning end to end."""

import numpy as np
import pytest
import soundfile
import torch
from transformers.generation.streamers import BaseStreamer

from transformers_drama3.streaming import Drama3AudioStreamer
from transformers_drama3.synthesis import history_turns, synthesize
from transformers_drama3.voice import Drama3Voice

from .tolerances import codec_decode_reductions, reordering_tolerance

FRAME = 2048
# Four one-sentence chunks at chunk_bytes=40 ("<|speaker:0|> " is 14 bytes).
SENTENCES = [
    "Hello there, how are you?", "The quick brown fox jumps.", "Did you hear that now?", "Good morning, everyone."
]
TEXT = " ".join(SENTENCES)


@pytest.fixture(scope="module")
def model(golden_model):
    return golden_model  # the session's (conftest.py); these tests only monkeypatch it


@pytest.fixture(scope="module")
def processor(golden_processor):
    return golden_processor


@pytest.fixture
def prompts(model, monkeypatch):
    """Records the prompt rows `[T, 11]` of every `model.generate` call."""
    seen = []
    generate = model.generate

    def spy(input_ids, attention_mask=None, **kwargs):
        seen.append(input_ids[0].clone())
        return generate(input_ids, attention_mask, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    return seen


def _contains(rows: torch.Tensor, block: torch.Tensor) -> bool:
    """Does `block` `[n, 11]` appear as consecutive rows of `rows` `[T, 11]`?"""
    return any(torch.equal(rows[i : i + len(block)], block) for i in range(len(rows) - len(block) + 1))


def _audio_rows(processor, codes):
    return torch.cat([codes[:1] + processor.semantic_start_id, codes]).T


def test_history_turns_are_the_first_and_the_previous_chunk():
    codes = [torch.zeros(10, n, dtype=torch.long) for n in (2, 3, 0, 4)]
    texts = ["a", "b", "c", "d"]
    assert history_turns([], []) == []
    assert [t for t, _ in history_turns(texts[:1], codes[:1])] == ["a"]
    assert [t for t, _ in history_turns(texts[:2], codes[:2])] == ["a", "b"]
    assert [t for t, _ in history_turns(texts, codes)] == ["a", "d"]
    assert [t for t, _ in history_turns(texts[:3], codes[:3])] == ["a"]  # a chunk without frames is no turn


def test_long_text_chunks_carry_history_and_join_into_one_waveform(model, processor, prompts):
    speech = synthesize(model, processor, TEXT, chunk_bytes=40, seed=0, max_new_tokens=2, show_progress=False)

    assert speech.texts == [f"<|speaker:0|> {s}" for s in SENTENCES]
    assert len(prompts) == 4 and speech.finish_reasons == ["length"] * 4
    first, second, third = ((speech.texts[i], speech.codes[i]) for i in range(3))
    # chunk 2 holds chunk 1's text and generated codes; chunk 3 holds chunks 1 and 2; chunk 4 holds 1 and 3 only
    for index, history in enumerate(([], [first], [first, second], [first, third])):
        assert torch.equal(prompts[index], processor.build_prompt_rows(speech.texts[index], history=history))
    assert _contains(prompts[1], _audio_rows(processor, speech.codes[0]))
    assert _contains(prompts[2], _audio_rows(processor, speech.codes[0]))
    assert _contains(prompts[2], _audio_rows(processor, speech.codes[1]))
    assert not _contains(prompts[3], _audio_rows(processor, speech.codes[1]))

    assert speech.audio.dtype == torch.float32 and speech.audio.dim() == 1
    assert speech.num_frames == sum(c.shape[1] for c in speech.codes) == 8
    assert speech.audio.shape[0] == speech.num_frames * FRAME
    assert speech.sampling_rate == 44100 and speech.duration == pytest.approx(8 * FRAME / 44100)
    # one continuous decode: the codec carries its state across chunks
    whole = model.codec.decode(torch.cat(speech.codes, dim=1)[None]).audio_values[0, 0]
    torch.testing.assert_close(speech.audio, whole, **reordering_tolerance(whole, codec_decode_reductions(model.codec)))


def test_seeded_runs_and_streaming_give_the_same_audio(model, processor):
    kwargs = dict(chunk_bytes=40, seed=3, max_new_tokens=2, show_progress=False)
    text = " ".join(SENTENCES[:2])

    class Counter(BaseStreamer):
        frames, ends = 0, 0

        def put(self, value):
            assert value.shape == (1, 10)
            self.frames += 1

        def end(self):
            self.ends += 1

    audio_stream, counter = Drama3AudioStreamer(model.codec), Counter()
    streamed = synthesize(model, processor, text, streamer=audio_stream, **kwargs)
    plain = synthesize(model, processor, text, streamer=counter, **kwargs)  # audio decoded as without a streamer

    assert len(plain.codes) == 2 and all(torch.equal(a, b) for a, b in zip(plain.codes, streamed.codes))
    assert torch.equal(torch.cat(list(audio_stream)), plain.audio)  # the stream ends once, after the last chunk
    assert torch.equal(streamed.audio, plain.audio)
    assert (counter.frames, counter.ends) == (plain.num_frames, 1)


def test_bad_input_raises_before_generating(model, processor, prompts):
    with pytest.raises(ValueError, match="empty"):
        synthesize(model, processor, "   ", show_progress=False)
    with pytest.raises(ValueError, match="control token"):
        synthesize(model, processor, "Hi <|im_end|>", show_progress=False)
    assert prompts == []  # text errors come from the processor, before any generation
    with pytest.raises(ValueError, match="temperature"):
        synthesize(model, processor, "Hi.", temperature=0.0, show_progress=False)
    with pytest.raises(TypeError, match="unknown"):
        synthesize(model, processor, "Hi.", temprature=0.5, show_progress=False)


# -- voice cloning ------------------------------------------------------------------------------------------------


def _tone(path, seconds=0.25, rate=22050):
    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(path, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate)
    return path


def test_voice_cloning_with_codes_an_audio_file_and_a_voice_file(model, processor, prompts, tmp_path, monkeypatch):
    transcript = "This is my voice."
    wav = _tone(tmp_path / "me.wav")
    calls = []
    encode = model.codec.encode
    monkeypatch.setattr(model.codec, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    greedy = dict(chunk_bytes=40, do_sample=False, max_new_tokens=1, show_progress=False)

    reference = {"transcript": transcript, "audio": str(wav)}
    from_audio = synthesize(model, processor, " ".join(SENTENCES[:2]), reference, **greedy)
    assert len(calls) == 1  # encoded once for both chunks
    codes = processor.with_codec(model.codec).encode_audio(str(wav))
    assert codes.shape == (10, 6)  # 0.25 s -> 11025 samples at 44.1 kHz -> 6 frames of 2048
    for prompt in prompts:
        assert _contains(prompt, _audio_rows(processor, codes))
    assert from_audio.audio.shape[0] == from_audio.num_frames * FRAME > 0

    voice_path = processor.with_codec(model.codec).create_voice(transcript, str(wav)).save(tmp_path / "me.voice.safetensors")
    prompts.clear()
    with_codes = [{"transcript": transcript, "codes": codes}]
    from_codes = synthesize(model, processor, SENTENCES[0], with_codes, **greedy)
    from_voice = synthesize(model, processor, SENTENCES[0], Drama3Voice.load(voice_path), **greedy)
    assert torch.equal(prompts[0], prompts[1])
    assert torch.equal(prompts[0], processor.build_prompt_rows(SENTENCES[0], references=with_codes))
    assert torch.equal(from_codes.audio, from_voice.audio) and from_voice.audio.numel() == FRAME
    assert torch.equal(from_codes.codes[0], from_audio.codes[0])  # greedy: same prompt, same first chunk


def test_reference_errors_surface_from_the_processor(model, processor, tmp_path):
    with pytest.raises(FileNotFoundError):
        missing = {"transcript": "x", "audio": str(tmp_path / "missing.wav")}
        synthesize(model, processor, "Hi.", missing, show_progress=False)
    with pytest.raises(ValueError, match="no 'transcript'"):
        synthesize(model, processor, "Hi.", {"codes": torch.zeros(10, 2, dtype=torch.long)}, show_progress=False)


def test_every_reference_is_checked_before_any_is_encoded(model, processor, prompts, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(model.codec, "encode", lambda *args, **kwargs: calls.append(1))
    good = {"transcript": "Fine.", "audio": str(_tone(tmp_path / "good.wav"))}
    too_long = {"transcript": "Long.", "audio": np.zeros(44100 * 61, dtype=np.float32), "sampling_rate": 44100}
    with pytest.raises(ValueError, match=r"references\[1\] is 61.0 s long"):
        synthesize(model, processor, "Hi.", [good, too_long], show_progress=False)
    assert calls == [] and prompts == []


def test_progress_is_one_bar_over_the_chunks_of_long_text(model, processor, monkeypatch):
    shown = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *args, show_progress, **kwargs: shown.append(show_progress)
                        or generate(*args, show_progress=False, **kwargs))
    greedy = dict(chunk_bytes=40, do_sample=False, max_new_tokens=1)
    synthesize(model, processor, " ".join(SENTENCES[:2]), **greedy)
    synthesize(model, processor, SENTENCES[0], **greedy)
    synthesize(model, processor, SENTENCES[0], show_progress=False, **greedy)
    assert shown == [False, False, True, False]  # frame bars only for text of one chunk
