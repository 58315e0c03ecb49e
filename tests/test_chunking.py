"""`split_text` in every script: property-based text per script family (random code points of the family, real
sentences, white space or none, speaker tags, `<|name|>` tokens, cues).

Each test runs hypothesis' default number of examples in the suite; `--hypothesis-profile=stress` (registered in
conftest.py, run by `.ci/run` as its own stage) runs 10,000 per family.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transformers_drama3.chunking import MIN_CHUNK_BYTES, split_text
from transformers_drama3.speaker_tags import SPEAKER_TAG, WHITE_SPACE


def _chars(low: int, high: int) -> st.SearchStrategy[str]:
    return st.characters(min_codepoint=low, max_codepoint=high, exclude_categories=("Cs",))


# Real text (written for these tests) per family, so that real clusters and punctuation appear, not only random ones.
_SAMPLES = {
    "cjk": ["今天天气很好我们去公园散步吧", "昨日は雨でしたが今日は晴れです。", "저는 학생입니다", "你好，世界！", "「はい」と言った"],
    "thai": ["สวัสดีครับวันนี้อากาศดีมาก", "ผมชอบกินข้าวผัด", "น้ำ", "กำลังไป"],
    "emoji": ["👩‍👩‍👧‍👦", "🧑🏽‍🚀", "🇯🇵🇫🇷", "👍🏽", "1️⃣", "❤️‍🔥", "🏳️‍🌈", "😀😃😄"],
    "combining": ["Tiếng Việt có dấu", "नमस्ते दुनिया", "ḁ̵̢̛̗̹̯͔̺͍̻͈̫̦̲͇̑̌͌̃̈́̄̓͑̑̀͘͠", "e\u0301" * 5, "ক্ষ্ম"],
    "rtl": ["مرحبا بالعالم", "שלום עולם", "\u200fسلام\u200e", "كيف حالك؟", "الكتاب، القلم"],
    "any": ["Hello there.", "a\u00a0b", "tab\tand\nnewline"],
}
_LETTERS = {
    "cjk": st.one_of(_chars(0x4E00, 0x9FFF), _chars(0x3040, 0x30FF), _chars(0xAC00, 0xD7A3), st.sampled_from("。、！？，")),
    "thai": _chars(0x0E01, 0x0E5B),
    "emoji": st.one_of(_chars(0x1F300, 0x1FAFF), st.sampled_from(["\u200d", "\ufe0f", "\U0001F3FD"])),
    "combining": st.one_of(st.sampled_from("aeiouy"), _chars(0x0300, 0x036F), _chars(0x0900, 0x097F)),
    "rtl": st.one_of(_chars(0x0590, 0x05FF), _chars(0x0600, 0x06FF), st.sampled_from("\u200f\u200e،؟")),
    # Anything but the three characters that make markup, which the strategy adds on purpose.
    "any": st.characters(exclude_categories=("Cs",), exclude_characters="<|>"),
}
_MARKUP = ["<|speaker:0|>", "<|speaker:7|>", "<|speaker:15|>", "<|x|>", "<|semantic:4095|>"]
_GAPS = ["", "", "", " ", " ", "\n", "\u3000", ". ", ", "]


def _family_text(family: str) -> st.SearchStrategy[str]:
    letters = st.lists(_LETTERS[family], min_size=1, max_size=60).map("".join)
    inner = st.lists(st.one_of(letters, st.sampled_from(_MARKUP)), min_size=1, max_size=4).map("".join)
    unit = st.one_of(
        letters, letters, st.sampled_from(_SAMPLES[family]), st.sampled_from(_MARKUP),
        inner.map(lambda cue: f"[{cue}]"), inner.map(lambda span: f"<whisper>{span}</whisper>"),
    )
    return st.lists(st.tuples(unit, st.sampled_from(_GAPS)), min_size=1, max_size=12).map(
        lambda parts: "".join(unit + gap for unit, gap in parts)
    )


def _content(text: str) -> str:
    """What must survive splitting: everything but speaker tags and white space (line breaks become spaces)."""
    return re.sub(f"[{re.escape(WHITE_SPACE)}]", "", SPEAKER_TAG.sub("", text))


@pytest.mark.parametrize("family", sorted(_LETTERS))
def test_split_text_bound_every_script(family):
    @settings(deadline=None)
    @given(text=_family_text(family), max_bytes=st.integers(MIN_CHUNK_BYTES, 200))
    def check(text, max_bytes):
        try:
            chunks = split_text(text, max_bytes=max_bytes)
        except ValueError:  # nothing to speak: tags and white space only
            assert not _content(text)
            return
        for chunk in chunks:
            assert len(chunk.encode("utf-8")) <= max_bytes, (chunk, max_bytes)
            assert SPEAKER_TAG.match(chunk), chunk
            # Every "|" of the input is part of a `<|name|>` token: a token cut in two would leave one behind.
            assert "|" not in re.sub(r"<\|[A-Za-z0-9_:.-]+\|>", "", chunk), chunk
        assert _content("".join(chunks)) == _content(text)

    check()


def test_split_text_unspaced_cjk_and_emoji(golden_processor):
    """The reported cases: unpunctuated Chinese and 4,096 emoji are split, at character and cluster boundaries."""
    chunks = golden_processor.split_text("你好世界" * 500)
    assert max(len(chunk.encode()) for chunk in chunks) <= 300
    assert "".join(chunk.removeprefix("<|speaker:0|> ") for chunk in chunks) == "你好世界" * 500
    family = "👩‍👩‍👧‍👦"  # one grapheme cluster of 7 code points, 25 bytes
    chunks = golden_processor.split_text(family * 4096)
    assert max(len(chunk.encode()) for chunk in chunks) <= 300
    assert all(chunk.removeprefix("<|speaker:0|> ") == family * 11 for chunk in chunks[:-1])
    assert "".join(chunk.removeprefix("<|speaker:0|> ") for chunk in chunks) == family * 4096


def test_split_text_long_cluster_and_long_cue():
    """A cluster longer than the budget is cut between code points; a long cue at its spaces; tags never."""
    zalgo = "e" + "\u0301" * 40  # one grapheme cluster of 81 bytes
    chunks = split_text(f"<|speaker:12|> {zalgo}", max_bytes=32)
    assert [len(chunk.encode()) for chunk in chunks] == [32, 31, 31, 31, 31]  # the tag and its space take 15
    assert "".join(chunk.removeprefix("<|speaker:12|> ") for chunk in chunks) == zalgo
    cue = "[" + "very long cue " * 10 + "]"
    assert split_text(f"Before. {cue} After.", max_bytes=64) == [
        "<|speaker:0|> Before.",
        "<|speaker:0|> [very long cue very long cue very long cue very",
        "<|speaker:0|> long cue very long cue very long cue very long cue",
        "<|speaker:0|> very long cue very long cue very long cue ] After.",
    ]
    chunks = split_text("x" * 10 + "<|semantic:4095|>" + "y" * 30, max_bytes=32)  # 18 bytes after the tag
    assert chunks[:2] == ["<|speaker:0|> " + "x" * 10, "<|speaker:0|> <|semantic:4095|>y"]
