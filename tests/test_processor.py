"""Drama3Processor: golden prompt rows, safe text, speaker tags, references, voices, long text, audio files."""

import os
import re

import numpy as np
import pytest
import soundfile
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import AutoProcessor, AutoTokenizer

from transformers_drama3 import FishOmniConfig
from transformers_drama3.chunking import split_text
from transformers_drama3.modeling_codec import FishDACDecoderOutput, FishDACEncoderOutput
from transformers_drama3.audio_io import AudioFileWriter, ogg_crc, write_atomically
from transformers_drama3.processing_drama3 import Drama3Processor, left_pad_rows
from transformers_drama3.speaker_tags import SPEAKER_TAG, WHITE_SPACE, tag_text, tag_transcript
from transformers_drama3.voice import Drama3Voice

from .conftest import GOLDEN_TINY
from .tolerances import reordering_tolerance

WIDTH = 11  # 1 + 10 codebooks


@pytest.fixture(scope="module")
def processor():
    return Drama3Processor.from_pretrained(GOLDEN_TINY)


def _references(case, expected):
    return [{"transcript": ref["transcript"], "codes": expected[ref["codes"]]} for ref in case["references"]]


def _codes(frames, seed=0, high=64):
    return torch.randint(0, high, (10, frames), generator=torch.Generator().manual_seed(seed))


class StandInCodec:
    """A small stand-in for `model.codec` (not the real codec): `encode` returns deterministic codes derived from
    the input length and records every call; `decode` returns one ramp of 2048 samples per frame."""

    def __init__(self):
        self.encode_calls = []
        self.decode_calls = []

    def encode(self, audio, sampling_rate):  # [1, L] -> [1, 10, frames]
        self.encode_calls.append((audio.clone(), sampling_rate))
        frames = -(-audio.shape[-1] // 2048)
        return FishDACEncoderOutput((torch.arange(10 * frames).reshape(1, 10, frames) % 64).long())

    def decode(self, codes):  # [1, 10, T] -> [1, 1, 2048 * T]
        self.decode_calls.append(codes.clone())
        return FishDACDecoderOutput(torch.linspace(-0.5, 0.5, 2048 * codes.shape[-1])[None, None])


# ------------------------------------------------------------------------------------------------------------
# Golden prompt rows and loading
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_golden_prompt_rows(processor, cases, expected, name):
    case = cases["prompts"][name]
    out = processor(case["text"], references=_references(case, expected))
    rows = expected[case["rows"]]
    assert out["input_ids"].dtype == torch.long
    assert torch.equal(out["input_ids"][0], rows)
    assert torch.equal(out["attention_mask"][0], torch.ones(rows.shape[0], dtype=torch.long))


def test_batch_is_left_padded(processor, cases, expected):
    names = ["a", "b", "c", "d"]
    prompts = [cases["prompts"][n] for n in names]
    out = processor([p["text"] for p in prompts], references=[_references(p, expected) for p in prompts])
    length = max(expected[p["rows"]].shape[0] for p in prompts)
    assert out["input_ids"].shape == (4, length, WIDTH) and out["attention_mask"].shape == (4, length)
    for index, prompt in enumerate(prompts):
        rows = expected[prompt["rows"]]
        pad = length - rows.shape[0]
        assert torch.equal(out["input_ids"][index, pad:], rows)
        assert not out["input_ids"][index, :pad].any()
        assert out["attention_mask"][index].tolist() == [0] * pad + [1] * rows.shape[0]


def test_pipeline_style_call(processor, cases, expected):
    """pipeline("text-to-speech") calls processor([text], return_tensors="pt") and casts floats to the model dtype."""
    out = processor([cases["prompts"]["a"]["text"]], return_tensors="pt").to(dtype=torch.bfloat16)
    assert out["input_ids"].dtype == torch.long
    assert torch.equal(out["input_ids"][0], expected["prompt_a_rows"])


def test_numpy_output(processor, expected):
    out = processor("Hello there, how are you today?", return_tensors="np")
    assert isinstance(out["input_ids"], np.ndarray)
    assert np.array_equal(out["input_ids"][0], expected["prompt_a_rows"].numpy())


def test_token_ids_come_from_the_tokenizer(processor, cases):
    ids = cases["token_ids"]
    assert processor.semantic_start_id == ids["semantic_start"]
    assert processor.semantic_start_id + processor.semantic_vocab_size - 1 == ids["semantic_end"]
    assert processor.eos_token_id == ids["eos"]
    assert processor.num_codebooks == 10


def test_save_pretrained_and_auto_processor_round_trip(processor, tmp_path, cases, expected):
    changed = Drama3Processor(processor.tokenizer, max_reference_seconds=30.0, max_prompt_rows=4096)
    changed.save_pretrained(tmp_path)
    assert (tmp_path / "processor_config.json").is_file()
    loaded = AutoProcessor.from_pretrained(tmp_path)  # registered by `import transformers_drama3`
    assert isinstance(loaded, Drama3Processor)
    assert (loaded.max_reference_seconds, loaded.max_prompt_rows, loaded.num_codebooks) == (30.0, 4096, 10)
    case = cases["prompts"]["d"]
    rows = loaded(case["text"], references=_references(case, expected))["input_ids"][0]
    assert torch.equal(rows, expected["prompt_d_rows"])
    assert isinstance(AutoProcessor.from_pretrained(GOLDEN_TINY), Drama3Processor)


def test_the_codec_is_a_component_that_is_never_saved(processor, tmp_path):
    """`codec` reaches the processor through `from_pretrained` or `with_codec` (a copy), and stays out of its config:
    the codec's weights belong to the model's checkpoint."""
    codec = StandInCodec()
    coding = processor.with_codec(codec)  # the processor holding a codec
    bound = Drama3Processor.from_pretrained(GOLDEN_TINY, codec=codec)
    assert bound.codec is codec and coding.codec is codec and processor.codec is None
    bound.save_pretrained(tmp_path)
    assert "codec" not in (tmp_path / "processor_config.json").read_text() and "StandInCodec" not in repr(bound)
    assert Drama3Processor.from_pretrained(tmp_path).codec is None


def test_loads_from_golden_directory_without_processor_config():
    assert not (GOLDEN_TINY / "processor_config.json").exists()
    loaded = Drama3Processor.from_pretrained(GOLDEN_TINY)
    assert (loaded.num_codebooks, loaded.sampling_rate, loaded.max_reference_seconds) == (10, 44100, 60.0)
    assert loaded.max_prompt_rows == 8192


# ------------------------------------------------------------------------------------------------------------
# Speaker tags
# ------------------------------------------------------------------------------------------------------------


def test_speaker_tag_rules():
    assert tag_text("Hello") == "<|speaker:0|> Hello"
    assert tag_text("<|speaker:3|> Hi") == "<|speaker:3|> Hi"
    assert tag_text("  <|speaker:1|> Hi") == "  <|speaker:1|> Hi"  # text keeps its leading white space
    assert tag_transcript("\u3000<|speaker:1|>Nice") == "<|speaker:1|>\u3000Nice"  # golden case d
    assert tag_transcript("Good morning.") == "<|speaker:0|> Good morning."
    # U+001C is not Unicode White_Space (str.isspace() says it is): the tag behind it does not lead.
    assert tag_text("\x1c<|speaker:2|> Hi") == "<|speaker:0|> \x1c<|speaker:2|> Hi"


_WS = st.sampled_from(list(WHITE_SPACE))
_TAGS = st.integers(0, 15).map(lambda n: f"<|speaker:{n}|>")
_PLAIN = st.text(st.characters(blacklist_characters="<|>"), max_size=20)


@settings(max_examples=200, deadline=None)
@given(lead=st.lists(_WS, max_size=3).map("".join), tag=st.one_of(st.none(), _TAGS), rest=_PLAIN)
def test_speaker_tag_normalisation_property(lead, tag, rest):
    text = lead + (tag or "") + rest
    tagged, transcript = tag_text(text), tag_transcript(text)
    assert SPEAKER_TAG.match(tagged.lstrip(WHITE_SPACE))
    assert tagged == (text if tag else "<|speaker:0|> " + text)
    leading = SPEAKER_TAG.match(transcript)
    assert leading and leading.group(0) == (tag or "<|speaker:0|>")
    assert transcript == leading.group(0) + tagged[: len(tagged) - len(tagged.lstrip(WHITE_SPACE))] + (
        rest if tag else " " + text
    )


# ------------------------------------------------------------------------------------------------------------
# Safe text
# ------------------------------------------------------------------------------------------------------------

_STRUCTURAL = ["<|im_start|>", "<|im_end|>", "<|voice|>", "<|text|>", "<|interleave|>"]


@pytest.mark.parametrize(
    "text, quoted",
    [
        ("Hi <|im_start|> there", "<|im_start|>"),
        ("Hi <|im_end|>", "<|im_end|>"),
        ("<|voice|>", "<|voice|>"),
        ("a <|text|> b", "<|text|>"),
        ("a <|interleave|> b", "<|interleave|>"),
        ("a <|semantic:5|> b", "<|semantic:5|>"),
        ("a <|semantic:99999|> b", "<|semantic:99999|>"),
        ("<|speaker:16|> hi", "<|speaker:16|>"),
        ("<|speaker:01|> hi", "<|speaker:01|>"),
        ("<|speaker:x|> hi", "<|speaker:x|>"),
    ],
)
def test_control_tokens_are_refused_with_a_quote(processor, text, quoted):
    with pytest.raises(ValueError, match=re.escape(repr(quoted))):
        processor(text)


@pytest.mark.parametrize("text", ["", "   ", "\u3000\n\t", "\u2028\u00a0"])
def test_empty_or_white_space_text_is_refused(processor, text):
    with pytest.raises(ValueError, match="empty or only white space"):
        processor(text)


def test_other_special_tokens_of_the_tokenizer_are_refused():
    tokenizer = AutoTokenizer.from_pretrained(GOLDEN_TINY)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra_control|>"]})
    with pytest.raises(ValueError, match=re.escape("'<|extra_control|>'")):
        Drama3Processor(tokenizer)("hello <|extra_control|>")
    Drama3Processor(tokenizer)("hello <|not_a_token|>")  # not a token of this tokenizer: plain text


def test_token_level_check_backs_up_the_string_check(processor):
    """If the string check missed something, the ids are checked again after tokenization."""
    refused = processor._refused_strings
    processor._refused_strings = []
    try:
        with pytest.raises(ValueError, match="tokenizes to the control token"):
            processor._caller_rows("<|speaker:0|> hi <|im_end|>", "text")
    finally:
        processor._refused_strings = refused


_FRAGMENTS = [
    "<|", "|>", "<", ">", "|", "im_start", "im_end", "voice", "text", "interleave", "semantic:", "speaker:",
    "0", "1", "15", "16", "01", ":", " ", "\u3000", "\n", "a", "Hello", "[soft]", "<whisper>", "</whisper>",
    "<|speaker:3|>", "<|speaker:15|>", "<|im_end|>", "<|semantic:5|>", "<|foo|>", "<|endoftext|>",
]


def _acceptable(processor, text):
    """Independent oracle of the rules: non-blank, no control-token string, every speaker marker a valid tag."""
    if not text.strip(WHITE_SPACE):
        return False
    if any(marker in text for marker in (*_STRUCTURAL, "<|semantic:", *processor._refused_strings)):
        return False
    return all(SPEAKER_TAG.match(text, m.start()) for m in re.finditer(re.escape("<|speaker"), text))


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.lists(st.sampled_from(_FRAGMENTS), max_size=12).map("".join), st.text(max_size=30)))
def test_injection_guard_property(processor, text):
    try:
        rows = processor.build_prompt_rows(text)
    except ValueError:
        assert not _acceptable(processor, text)
        return
    assert _acceptable(processor, text)
    ids = processor.tokenizer.encode(tag_text(text), add_special_tokens=False)
    assert not set(ids) & processor._refused_ids
    # The whole prompt holds exactly the template's control tokens plus the text's own speaker tags.
    template = processor.build_prompt_rows("x")[:, 0].tolist()
    controls = [i for i in rows[:, 0].tolist() if i in processor._refused_ids]
    assert controls == [i for i in template if i in processor._refused_ids]


# ------------------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [123, None, b"bytes", ["ok", 5]])
def test_non_string_text(processor, text):
    with pytest.raises(TypeError, match="must be a string"):
        processor(text)


def test_empty_batch(processor):
    with pytest.raises(ValueError, match="empty batch"):
        processor([])


def test_reference_with_transcript_only(processor):
    with pytest.raises(ValueError, match="no 'audio' or 'codes'"):
        processor("Hi", references=[{"transcript": "Hello."}])


def test_reference_without_transcript(processor):
    with pytest.raises(ValueError, match="no 'transcript'"):
        processor("Hi", references=[{"codes": _codes(3)}])


def test_reference_with_codes_and_audio(processor):
    with pytest.raises(ValueError, match="both 'codes' and 'audio'"):
        processor("Hi", references=[{"transcript": "x", "codes": _codes(3), "audio": np.zeros(10), "sampling_rate": 8}])


def test_reference_with_unknown_key(processor):
    with pytest.raises(ValueError, match="unknown keys"):
        processor("Hi", references=[{"text": "Hello.", "codes": _codes(3)}])


def test_reference_transcript_is_checked(processor):
    with pytest.raises(ValueError, match="references\\[0\\].transcript contains the control token"):
        processor("Hi", references=[{"transcript": "a <|im_end|>", "codes": _codes(3)}])


@pytest.mark.parametrize(
    "codes, message",
    [
        (torch.zeros(9, 4, dtype=torch.long), "must have shape \\[10, frames\\]"),
        (torch.zeros(4, 10, dtype=torch.long), "transposed"),
        (torch.zeros(10, 0, dtype=torch.long), "at least one frame"),
        (torch.zeros(10, 4, 1, dtype=torch.long), "must have shape"),
        (torch.zeros(10, 4), "integer ids"),
        (torch.full((10, 4), 64), "out of range \\[0, 64\\)"),
        (torch.full((10, 4), -1), "out of range"),
        (torch.zeros(10, 1300, dtype=torch.long), "at most 60 s"),
    ],
)
def test_bad_reference_codes(processor, codes, message):
    with pytest.raises(ValueError, match=message):
        processor("Hi", references=[{"transcript": "Hello.", "codes": codes}])


def test_sixty_seconds_of_codes_are_accepted(processor):
    """60 s of audio pads to 1292 frames; that many frames must still be accepted."""
    processor("Hi", references=[{"transcript": "Hello.", "codes": torch.zeros(10, 1292, dtype=torch.long)}])


def test_batch_references_must_match_the_batch(processor):
    with pytest.raises(ValueError, match="one entry per text"):
        processor(["a", "b"], references=[[{"transcript": "x", "codes": _codes(2)}]])


def test_audio_without_codec(processor):
    reference = {"transcript": "Hello.", "audio": np.zeros(44100, dtype=np.float32), "sampling_rate": 44100}
    with pytest.raises(ValueError, match="codec=model.codec"):
        processor("Hi", references=[reference])


def test_audio_over_sixty_seconds_is_refused_before_encoding(processor, tmp_path):
    codec = StandInCodec()
    coding = processor.with_codec(codec)  # the processor holding a codec
    long_audio = np.zeros(16000 * 61, dtype=np.float32)
    with pytest.raises(ValueError, match="at most 60 s"):
        coding("Hi", references=[{"transcript": "x", "audio": long_audio, "sampling_rate": 16000}])
    path = tmp_path / "long.wav"
    soundfile.write(path, np.zeros(8000 * 61, dtype=np.float32), 8000)
    with pytest.raises(ValueError, match="at most 60 s"):
        coding("Hi", references=[{"transcript": "x", "audio": str(path)}])
    assert codec.encode_calls == []


@pytest.mark.parametrize(
    "reference, message",
    [
        ({"audio": np.zeros(100, dtype=np.float32)}, "needs its 'sampling_rate'"),
        ({"audio": np.zeros(100, dtype=np.int16), "sampling_rate": 8000}, "float array"),
        ({"audio": np.zeros((100, 2), dtype=np.float32), "sampling_rate": 8000}, "\\[channels, samples\\]"),
        ({"audio": np.array([0.0, np.nan], dtype=np.float32), "sampling_rate": 8000}, "NaN"),
        ({"audio": np.zeros(0, dtype=np.float32), "sampling_rate": 8000}, "not empty"),
        ({"audio": np.zeros(100, dtype=np.float32), "sampling_rate": 0}, "positive integer"),
        ({"audio": "/nonexistent/voice.wav"}, "does not exist"),
    ],
)
def test_bad_reference_audio(processor, reference, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        processor.with_codec(StandInCodec())("Hi", references=[{"transcript": "x", **reference}])


def test_every_reference_is_checked_before_any_is_encoded(processor, tmp_path):
    codec = StandInCodec()
    coding = processor.with_codec(codec)  # the processor holding a codec
    good = {"transcript": "Fine.", "audio": np.zeros(4000, dtype=np.float32), "sampling_rate": 16000}
    (tmp_path / "notes.wav").write_text("not audio")
    soundfile.write(tmp_path / "silence.wav", np.zeros(0, dtype=np.float32), 44100)
    for bad, message in ((str(tmp_path / "notes.wav"), "cannot read audio file"),
                         (str(tmp_path / "silence.wav"), "holds no samples")):
        with pytest.raises(ValueError, match=rf"references\[1\]: .*{message}"):
            coding("Hi", references=[good, {"transcript": "Bad.", "audio": bad}])
        with pytest.raises(ValueError, match=message):  # the same check alone, without a codec
            processor.check_reference({"transcript": "Bad.", "audio": bad})
    with pytest.raises(ValueError, match=r"references\[1\].transcript contains the control token"):
        coding("Hi", references=[good, {"transcript": "<|im_end|>", "codes": _codes(2)}])
    assert codec.encode_calls == []
    processor.check_reference(good)  # a good reference passes without a codec


def test_converted_references_are_said_once(processor, tmp_path, caplog):
    codec = StandInCodec()
    coding = processor.with_codec(codec)  # the processor holding a codec
    stereo = tmp_path / "phone.wav"
    soundfile.write(stereo, np.zeros((4000, 2), dtype=np.float32), 8000)
    with caplog.at_level("WARNING", logger="transformers_drama3"):
        coding("Hi", references=[{"transcript": "Mine.", "audio": str(stereo)}])
        coding("Hi", references=[{"transcript": "Mine.", "audio": np.zeros(44100, dtype=np.float32),
                                     "sampling_rate": 48000}])  # mono, 48 kHz: nothing to say
    assert [record.getMessage() for record in caplog.records] == [
        "references[0]: its 2 channels are averaged to mono; its 8000 Hz are resampled to 44100 Hz, which cannot "
        "restore the high frequencies it lacks (the cloned voice may sound muffled: use a recording of 44.1 kHz or "
        "more if you have one)."
    ]


def test_a_prompt_over_max_prompt_rows_is_refused(processor):
    plain = processor.build_prompt_rows("Hi").shape[0]
    small = Drama3Processor(processor.tokenizer, max_prompt_rows=plain)
    rows = processor.build_prompt_rows("Hi", references=[{"transcript": "Mine.", "codes": _codes(8)}]).shape[0]
    small.build_prompt_rows("Hi")  # exactly at the limit: accepted
    with pytest.raises(ValueError, match=rf"the prompt of text\[1\] has {rows} rows; Drama 3 reads at most {plain}"):
        small(["Hi", "Hi"], references=[None, [{"transcript": "Mine.", "codes": _codes(8)}]])


def test_bad_history_turn(processor):
    with pytest.raises(TypeError, match="history\\[0\\]"):
        processor("Hi", history=["just text"])
    with pytest.raises(ValueError, match="history\\[0\\] codes"):
        processor("Hi", history=[("Earlier.", torch.zeros(3, 3, dtype=torch.long))])


def test_unknown_keyword_is_an_error(processor):
    with pytest.raises(TypeError):
        processor("Hi", padding="max_length")


# ------------------------------------------------------------------------------------------------------------
# References from audio, voices, history
# ------------------------------------------------------------------------------------------------------------


def test_audio_file_reference_is_averaged_to_mono_and_encoded(processor, tmp_path):
    left = np.linspace(-0.5, 0.5, 5000, dtype=np.float32)
    path = tmp_path / "voice.wav"
    soundfile.write(path, np.stack([left, -left * 0.5], axis=1), 22050, subtype="FLOAT")
    codec = StandInCodec()
    coding = processor.with_codec(codec)  # the processor holding a codec
    out = coding("Hi", references=[{"transcript": "Hello.", "audio": path}])
    (audio, rate), = codec.encode_calls
    assert rate == 22050 and audio.shape == (1, 5000) and audio.dtype == torch.float32
    mono = torch.from_numpy(left * 0.25)
    torch.testing.assert_close(audio[0], mono, **reordering_tolerance(mono, 2))  # a float32 mean of two channels
    expected = processor("Hi", references=[{"transcript": "Hello.", "codes": codec.encode(audio, rate).audio_codes[0]}])
    assert torch.equal(out["input_ids"], expected["input_ids"])


def test_array_reference_channels_first(processor):
    codec = StandInCodec()
    coding = processor.with_codec(codec)  # the processor holding a codec
    stereo = torch.stack([torch.ones(3000), torch.zeros(3000)])  # [channels, samples]
    coding("Hi", references={"transcript": "Hello.", "audio": stereo, "sampling_rate": 16000})
    (audio, rate), = codec.encode_calls
    assert rate == 16000 and torch.equal(audio, torch.full((1, 3000), 0.5))


def test_voice_file_round_trip(processor, tmp_path):
    voice = Drama3Voice(codes=_codes(7, seed=3), transcript="\u3000<|speaker:2|>It's me.", name="narrator")
    path = voice.save(tmp_path / "narrator.voice.safetensors")
    loaded = Drama3Voice.load(path)
    assert torch.equal(loaded.codes, voice.codes) and loaded.codes.dtype == torch.long
    assert (loaded.transcript, loaded.name) == (voice.transcript, voice.name)
    assert sorted(os.listdir(tmp_path)) == ["narrator.voice.safetensors"]  # no temporary file left
    as_dict = processor("Hi", references=[{"transcript": voice.transcript, "codes": voice.codes}])
    assert torch.equal(processor("Hi", references=[loaded])["input_ids"], as_dict["input_ids"])
    assert torch.equal(processor("Hi", references=loaded)["input_ids"], as_dict["input_ids"])


def test_a_voice_prints_briefly():
    transcript = "A long transcript. " * 10
    voice = Drama3Voice(codes=_codes(700), transcript=transcript, name="me")
    assert repr(voice) == f"Drama3Voice(name='me', transcript={transcript[:57] + '...'!r}, codes=[10, 700 frames])"
    assert repr(Drama3Voice(codes=_codes(2), transcript="Hi.")) == "Drama3Voice(transcript='Hi.', codes=[10, 2 frames])"


def test_voice_load_rejects_other_files(tmp_path):
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match="not a Drama 3 voice file"):
        Drama3Voice.load(other)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a Drama 3 voice file"):
        Drama3Voice.load(garbage)


def test_create_voice(processor):
    codec = StandInCodec()
    coding = processor.with_codec(codec)  # the processor holding a codec
    voice = coding.create_voice("Hello.", np.zeros(5000, dtype=np.float32), 44100, name="v")
    assert voice.codes.shape == (10, 3) and voice.transcript == "Hello." and voice.name == "v"
    with pytest.raises(ValueError, match="contains the control token"):
        coding.create_voice("<|voice|>", np.zeros(5000, dtype=np.float32), 44100)


def test_history_turns_follow_the_system_turn(processor):
    first, previous = _codes(3, seed=1), _codes(2, seed=2)
    rows = processor("Now this.", history=[("First.", first), {"text": "<|speaker:1|> Then.", "codes": previous}])
    rows = rows["input_ids"][0]

    def text(segment):
        ids = processor.tokenizer.encode(segment, add_special_tokens=False)
        return torch.cat([torch.tensor(ids)[:, None], torch.zeros(len(ids), 10, dtype=torch.long)], dim=1)

    def audio(codes):
        return torch.cat([codes[:1] + processor.semantic_start_id, codes]).T

    turn_end, user, voice = "<|im_end|>\n", "<|im_start|>user\n", "<|im_start|>assistant\n<|voice|>"
    parts = [
        text("<|im_start|>system\n"), text("convert the provided text to speech"), text(turn_end),
        text(user), text("<|speaker:0|> First."), text(turn_end), text(voice), audio(first), text(turn_end),
        text(user), text("<|speaker:1|> Then."), text(turn_end), text(voice), audio(previous), text(turn_end),
        text(user), text("<|speaker:0|> Now this."), text(turn_end), text(voice),
    ]
    assert torch.equal(rows, torch.cat(parts))


# ------------------------------------------------------------------------------------------------------------
# Long text
# ------------------------------------------------------------------------------------------------------------


def test_split_text_example(processor):
    text = (
        "<|speaker:0|> First sentence here. Second one, with a clause; and more words to fill the line.\n"
        "<|speaker:1|> [laughing] Oh <whisper>do not tell anyone, please.</whisper> Fine!"
    )
    chunks = processor.split_text(text, max_bytes=64)
    assert chunks == [
        "<|speaker:0|> First sentence here.",
        "<|speaker:0|> Second one, with a clause;",
        "<|speaker:0|> and more words to fill the line.",
        "<|speaker:1|> [laughing] Oh",
        "<|speaker:1|> <whisper>do not tell anyone, please.</whisper>",
        "<|speaker:1|> Fine!",
    ]


def test_split_text_keeps_short_text_whole(processor):
    assert processor.split_text("Hello there.") == ["<|speaker:0|> Hello there."]
    assert processor.split_text("  <|speaker:2|> Hi\nthere.") == ["<|speaker:2|> Hi there."]


def test_split_text_limits_speakers_per_chunk():
    text = " ".join(f"<|speaker:{n}|> Line {n}." for n in range(5))
    chunks = split_text(text, max_bytes=300, max_speakers=3)
    assert chunks == [" ".join(f"<|speaker:{n}|> Line {n}." for n in range(3)),
                      " ".join(f"<|speaker:{n}|> Line {n}." for n in range(3, 5))]


def test_split_text_cjk():
    text = "一二三四五六七八九十。" * 12
    chunks = split_text(text, max_bytes=100)
    assert all(len(c.encode()) <= 100 for c in chunks)
    assert "".join(c.removeprefix("<|speaker:0|> ") for c in chunks) == text


def test_split_text_bad_arguments(processor):
    with pytest.raises(ValueError, match="max_bytes"):
        split_text("Hi", max_bytes=10)
    with pytest.raises(ValueError, match="max_speakers"):
        split_text("Hi", max_speakers=0)
    with pytest.raises(ValueError, match="nothing to speak"):
        split_text("<|speaker:1|> <|speaker:2|>")
    with pytest.raises(ValueError, match="control token"):
        processor.split_text("Hi <|im_end|> there")


_WORDS = st.sampled_from(["Hello", "world", "a", "quick", "brown", "fox", "día", "über", "日本語", "ok"])
_PUNCTUATION = st.sampled_from([".", ",", "!", "?", ";", ":", "…", "。"])
_UNIT = st.one_of(
    _WORDS,
    st.tuples(_WORDS, _PUNCTUATION).map("".join),
    st.lists(_WORDS, min_size=1, max_size=3).map(lambda ws: "[" + " ".join(ws) + "]"),
    st.lists(_WORDS, min_size=1, max_size=4).map(lambda ws: "<whisper>" + " ".join(ws) + ". </whisper>"),
)
_SEPARATOR = st.sampled_from([" ", " ", " ", "\n", "  ", "\u3000"])
_TURN = st.tuples(_TAGS, st.lists(st.tuples(_UNIT, _SEPARATOR), min_size=1, max_size=25))


def _speaker_words(chunks_or_text):
    """(speaker tag, word) pairs of tagged text, with cues and paired tags kept as single words."""
    pairs = []
    for text in chunks_or_text:
        for match in re.finditer(r"(<\|speaker:\d+\|>)((?:(?!<\|speaker).)*)", text, re.DOTALL):
            for word in re.findall(r"\[[^\]]*\]|<whisper>.*?</whisper>|\S+", match.group(2).replace("\u3000", " ")):
                pairs.append((match.group(1), word))
    return pairs


@settings(max_examples=150, deadline=None)
@given(turns=st.lists(_TURN, min_size=1, max_size=6), max_bytes=st.integers(120, 400), max_speakers=st.integers(1, 3))
def test_split_text_property(turns, max_bytes, max_speakers):
    text = " ".join(tag + " " + "".join(unit + sep for unit, sep in units) for tag, units in turns)
    chunks = split_text(text, max_bytes=max_bytes, max_speakers=max_speakers)
    for chunk in chunks:
        assert SPEAKER_TAG.match(chunk), chunk
        assert len(chunk.encode()) <= max_bytes  # every unbreakable unit here is shorter than the budget
        assert len(set(SPEAKER_TAG.findall(chunk))) <= max_speakers
        assert chunk.count("[") == chunk.count("]") and re.sub(r"\[[^\[\]]*\]", "", chunk).count("[") == 0
        assert chunk.count("<whisper>") == chunk.count("</whisper>")
        assert re.sub(r"<whisper>.*?</whisper>", "", chunk).count("whisper>") == 0
        assert "\n" not in chunk
    flat = text
    for line_break in ("\r\n", "\n"):
        flat = flat.replace(line_break, " ")
    assert _speaker_words(chunks) == _speaker_words([flat])


_ROUGH = ["[", "]", "<whisper>", "</whisper>", "<b>", "<|speaker:1|>", "<|speaker:12|>", "<|x|>", ".", ",", "!",
          " ", " ", "\n", "\u3000", "word", "longerword", "日本", "é", "a"]


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from(_ROUGH), min_size=1, max_size=80), max_bytes=st.integers(32, 90))
# Cues nested in a paired tag too long to keep whole (found by this test): the cut falls between them, not inside one.
@example(parts=["[", "<whisper>", "日本", "]", "[", "]", "</whisper>"], max_bytes=32)
@example(parts=["[", "<whisper>", "]", "<whisper>", "</whisper>"], max_bytes=34)
def test_split_text_rough_input_property(parts, max_bytes):
    """Any mix of tags, brackets and marks: spans that fit stay whole, tags lead, nothing is lost or reordered."""
    text = "".join(parts)
    try:
        chunks = split_text(text, max_bytes=max_bytes)
    except ValueError:
        assert not re.sub(rf"{SPEAKER_TAG.pattern}|[{re.escape(WHITE_SPACE)}]", "", text)
        return
    assert all(SPEAKER_TAG.match(chunk) for chunk in chunks)
    flat = text.replace("\n", " ")
    for span in re.finditer(r"\[[^\[\]]*\]|<whisper>.*?</whisper>|<\|x\|>|<b>", flat):
        if not SPEAKER_TAG.search(span.group(0)) and len(span.group(0).encode()) <= max_bytes - 15:
            assert any(span.group(0) in chunk for chunk in chunks), span.group(0)

    def content(s):
        return re.sub(rf"{SPEAKER_TAG.pattern}|[{re.escape(WHITE_SPACE)}]", "", s)

    assert content("".join(chunks)) == content(text)


# ------------------------------------------------------------------------------------------------------------
# Frames -> audio -> files
# ------------------------------------------------------------------------------------------------------------


def test_decode_uses_audio_rows_only(processor):
    codes = _codes(4, seed=5)
    audio_rows = torch.cat([codes[:1] + processor.semantic_start_id, codes]).T  # [4, 11]
    text_row = torch.zeros(1, WIDTH, dtype=torch.long)
    text_row[0, 0] = 300
    frames = torch.cat([torch.zeros(2, WIDTH, dtype=torch.long), text_row, audio_rows])
    codec = StandInCodec()
    coding = processor.with_codec(codec)  # the processor holding a codec
    audio = coding.frames_to_audio(frames)
    assert audio.shape == (4 * 2048,) and audio.dtype == torch.float32
    assert torch.equal(codec.decode_calls[0], codes[None])
    batch = coding.batch_frames_to_audio(torch.stack([frames, torch.cat([audio_rows, audio_rows[:3]])]))
    assert [a.shape[0] for a in batch] == [4 * 2048, 7 * 2048]
    assert coding.frames_to_audio(frames[:3]).shape == (0,)


def test_decode_without_codec(processor):
    with pytest.raises(ValueError, match="codec=model.codec"):
        processor.frames_to_audio(torch.zeros(3, WIDTH, dtype=torch.long))
    with pytest.raises(ValueError, match="frames must have shape"):
        processor.with_codec(StandInCodec()).frames_to_audio(torch.zeros(3, 10, dtype=torch.long))


@pytest.mark.parametrize("suffix, file_format, subtype", [(".wav", "WAV", "PCM_16"), (".flac", "FLAC", "PCM_16"),
                                                          (".ogg", "OGG", "VORBIS")])
def test_save_audio_formats(processor, tmp_path, suffix, file_format, subtype):
    audio = 0.5 * torch.sin(torch.arange(4410) / 10.0)
    path = processor.save_audio(audio, tmp_path / f"out{suffix}")
    info = soundfile.info(path)
    assert (info.format, info.subtype, info.samplerate, info.channels) == (file_format, subtype, 44100, 1)
    assert info.frames == 4410
    if suffix != ".ogg":  # lossless: within 16-bit rounding
        read, _ = soundfile.read(path, dtype="float32")
        np.testing.assert_allclose(read, audio.numpy(), atol=1 / 32768)
    one_channel = processor.save_audio(audio[None], tmp_path / f"channels{suffix}")  # [1, samples]: the same bytes
    assert one_channel.read_bytes() == path.read_bytes()


def test_save_audio_header_and_clipping(processor, tmp_path):
    path = processor.save_audio(np.array([2.0, -2.0, 0.25], dtype=np.float64), tmp_path / "clip.wav", sampling_rate=16000)
    header = path.read_bytes()[:44]
    assert header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt "
    assert int.from_bytes(header[24:28], "little") == 16000 and int.from_bytes(header[34:36], "little") == 16
    read, _ = soundfile.read(path, dtype="int16")
    assert read.tolist() == [32767, -32768, 8192]


def test_save_audio_bad_paths(processor, tmp_path):
    with pytest.raises(ValueError, match="cannot tell the audio format"):
        processor.save_audio(np.zeros(10), tmp_path / "out.xyz")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        processor.save_audio(np.zeros(10), tmp_path / "missing" / "out.wav")
    with pytest.raises(ValueError, match="NaN"):
        processor.save_audio(np.array([np.nan]), tmp_path / "nan.wav")


def test_save_audio_is_atomic(processor, tmp_path, monkeypatch):
    target = tmp_path / "speech.wav"
    target.write_bytes(b"previous complete file")

    def failing_write(sound, samples):  # the header is already in the file when the samples fail
        raise OSError("disk full")

    monkeypatch.setattr(soundfile.SoundFile, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        processor.save_audio(np.zeros(100), target)
    with pytest.raises(OSError, match="disk full"):
        processor.save_audio(np.zeros(100), tmp_path / "new.wav")
    assert target.read_bytes() == b"previous complete file"
    assert sorted(os.listdir(tmp_path)) == ["speech.wav"]


def test_save_audio_refuses_a_list_of_waveforms(processor, tmp_path):
    for audio in ([torch.zeros(2048), torch.zeros(4096)], [np.zeros(100), np.zeros(100)]):
        with pytest.raises(ValueError, match=r"one waveform .* got a list of 2 arrays .*out\.audio\[0\]"):
            processor.save_audio(audio, tmp_path / "out.wav")
    assert os.listdir(tmp_path) == []
    processor.save_audio([0.0, 0.5, -0.5], tmp_path / "numbers.wav")  # a plain list of samples is one waveform


@pytest.mark.parametrize("suffix", [".wav", ".flac", ".ogg"])
def test_audio_files_depend_on_the_samples_only(processor, tmp_path, suffix):
    """The same samples give the same bytes: written twice, or in pieces as a stream writes them."""
    t = torch.arange(2048 * 9 + 100) / 44100
    audio = (0.3 * torch.sin(2 * torch.pi * 220 * t) * torch.sin(2 * torch.pi * 3 * t)).numpy()
    once = processor.save_audio(audio, tmp_path / f"once{suffix}").read_bytes()
    assert processor.save_audio(audio, tmp_path / f"twice{suffix}").read_bytes() == once

    def write_in_pieces(file):
        with AudioFileWriter(file, f"x{suffix}", 44100) as writer:
            for piece in np.split(audio, [2048, 2048 * 8, 2048 * 8 + 1]):  # a frame, 7 frames, a sample, the rest
                writer.write(piece)

    assert write_atomically(tmp_path / f"streamed{suffix}", write_in_pieces).read_bytes() == once


def test_ogg_crc_matches_libsndfile(tmp_path):
    """The page checksum recomputed after the serial is set equals libsndfile's own on every page it wrote."""
    path = tmp_path / "plain.ogg"
    soundfile.write(path, np.sin(np.arange(44100) / 9).astype(np.float32), 44100, format="OGG", subtype="VORBIS")
    data, position, pages = bytearray(path.read_bytes()), 0, 0
    while position < len(data):
        segments = data[position + 26]
        end = position + 27 + segments + sum(data[position + 27 : position + 27 + segments])
        stored = int.from_bytes(data[position + 22 : position + 26], "little")
        data[position + 22 : position + 26] = bytes(4)
        assert ogg_crc(bytes(data[position:end])) == stored
        position, pages = end, pages + 1
    assert pages >= 3  # identification, comment and setup headers, then audio


def test_left_pad_rows():
    rows = torch.arange(1, 4 * 3 * WIDTH + 1).reshape(4, 3, WIDTH)  # [B, T, 11], no zero anywhere
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 1, 1], [0, 1, 0]])  # full, right-, left-, both-padded
    padded, new_mask = left_pad_rows(rows, mask)
    assert new_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1], [0, 0, 1]] and new_mask.dtype == mask.dtype
    assert torch.equal(padded[0], rows[0]) and torch.equal(padded[2], rows[2] * mask[2, :, None])
    assert torch.equal(padded[1, 2], rows[1, 0]) and torch.equal(padded[3, 2], rows[3, 1])
    assert int(padded[1, :2].abs().sum()) == int(padded[3, :2].abs().sum()) == 0


# ------------------------------------------------------------------------------------------------------------
# With the real codec module (tiny codec.pth)
# ------------------------------------------------------------------------------------------------------------


def _tiny_codec():
    from transformers_drama3.modeling_codec import FishDACCodec

    config = FishOmniConfig.from_pretrained(GOLDEN_TINY)
    return FishDACCodec.from_codec_file(GOLDEN_TINY / "codec.pth", config.codec_config)


def test_with_fish_dac_codec(processor, expected, tmp_path):
    codec = _tiny_codec()
    coding = processor.with_codec(codec)  # the processor holding a codec
    path = tmp_path / "reference.wav"
    soundfile.write(path, expected["codec_input_audio"].numpy(), 44100, subtype="FLOAT")
    voice = coding.create_voice("A chirp.", path)
    assert torch.equal(voice.codes, expected["codec_encoded"])
    codes = expected["codec_codes"]
    frames = torch.cat([codes[:1] + processor.semantic_start_id, codes]).T
    audio = coding.frames_to_audio(frames)
    torch.testing.assert_close(audio, expected["codec_audio"], atol=1e-4, rtol=0)
