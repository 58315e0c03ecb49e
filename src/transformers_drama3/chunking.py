"""Long text -> chunks that are spoken one after another (`split_text`).

Each chunk has at most `max_bytes` UTF-8 bytes and `max_speakers` distinct speakers and starts with its speaker tag.
Cuts fall after sentence ends, else after clause marks, else at white space, else between grapheme clusters, never
inside `<|...|>` tags, `[cues]` or `<tag>...</tag>` spans that fit. `synthesize` generates the chunks with earlier ones as history turns (docs/usage.md).
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Sequence

import regex

from .speaker_tags import SPEAKER_TAG, WHITE_SPACE, WHITE_SPACE_CLASS, tag_text

MIN_CHUNK_BYTES = 32  # the smallest `max_bytes`: room for a speaker tag and a few words
LINE_BREAKS = ("\r\n", "\n", "\r", "\x0b", "\x0c", "\x85", "\u2028", "\u2029")
_CLOSERS = "\"'”’)»」』"
_SENTENCE_END = re.compile(
    rf"[.!?…‼⁇⁈⁉]+[{re.escape(_CLOSERS)}]*(?={WHITE_SPACE_CLASS}|$)|[。！？]+[{re.escape(_CLOSERS)}]*"
)
_CLAUSE_END = re.compile(rf"[,;:—–]+(?={WHITE_SPACE_CLASS}|$)|[，、；：]+")
_WHITE_SPACE_RUN = re.compile(rf"{WHITE_SPACE_CLASS}+")
# Spans a cut must not fall inside: control-like tags, [cues], paired tags <x ...>...</x>, lone <tags>.
_SPEAKER_TAG_LIKE = re.compile(r"<\|.*?\|>", re.DOTALL)
_BRACKET_CUE = re.compile(r"\[[^\[\]]*\]")
_PAIRED_TAG = re.compile(r"<([A-Za-z][\w:-]*)(?:\s[^<>]*)?>.*?</\1\s*>", re.DOTALL)
_LONE_TAG = re.compile(r"</?[A-Za-z][^<>]*>")
# The spans a cut should not fall inside: speaker tags and tokens, bracket cues, paired and lone tags.
_KEPT_WHOLE = (_SPEAKER_TAG_LIKE, _BRACKET_CUE, _PAIRED_TAG, _LONE_TAG)
# `<|name|>` tokens that no cut may split: speaker tags and the processor's own tokens. At most 17 bytes, so one
# fits the smallest piece budget (MIN_CHUNK_BYTES less the longest speaker tag and its space).
_TOKEN = re.compile(r"<\|[A-Za-z0-9_:.-]{1,13}\|>")
_GRAPHEME = regex.compile(r"\X", regex.DOTALL)


def _utf8_length(text: str) -> int:
    return len(text.encode("utf-8"))


def _utf8_offsets(text: str) -> list[int]:
    """`offsets[i]` = UTF-8 byte length of `text[:i]`."""
    return [0, *itertools.accumulate(len(char.encode("utf-8")) for char in text)]


def _protected(text: str, patterns: Sequence[re.Pattern], max_bytes: int | None = None) -> Callable[[int], bool]:
    """A test `inside(position)`: does a cut at `position` fall strictly inside a span matched by `patterns`?

    With `max_bytes`, only spans of at most `max_bytes` UTF-8 bytes count, and every match counts, overlapping ones
    too (a paired tag nested in a longer one of the same name is a span of its own). Their lazy `.*?` parts are
    bounded to `max_bytes` characters, so that matching from every start stays linear in the text."""
    if max_bytes is None:
        spans = sorted(match.span() for pattern in patterns for match in pattern.finditer(text))
    else:
        bounded = [regex.compile(pattern.pattern.replace(".*?", f".{{0,{max_bytes}}}?"), pattern.flags)
                   for pattern in patterns]
        spans = sorted(match.span() for pattern in bounded for match in pattern.finditer(text, overlapped=True)
                       if _utf8_length(match.group(0)) <= max_bytes)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = [start for start, _ in merged]

    def inside(position: int) -> bool:
        index = bisect.bisect_left(starts, position) - 1
        return index >= 0 and position < merged[index][1]

    return inside


def _cut_candidates(text: str, max_bytes: int) -> list[list[int]]:
    """Sorted allowed cut positions in `text`, best kind first.

    Outside every protected span: after sentence ends, after clause marks, at white space, between grapheme clusters.
    Then inside spans too long to keep whole, but outside every cue and tag of at most `max_bytes` (nested ones
    included): at white space, between grapheme clusters. Then inside any cue or tag: at white space, between grapheme
    clusters; last between code points (one grapheme cluster, such as a letter with many combining marks, can outgrow
    the budget). No kind ever cuts a `<|name|>` token.
    """
    inside = _protected(text, _KEPT_WHOLE)
    inside_fitting = _protected(text, _KEPT_WHOLE, max_bytes)
    inside_token = _protected(text, (_TOKEN,))
    spaces = [match.start() for match in _WHITE_SPACE_RUN.finditer(text)]
    # Grapheme clusters by the third-party `regex` module (a transformers dependency): Python's `re` has no `\X`,
    # and the rules (emoji ZWJ sequences, flags, Indic and Thai clusters) are Unicode's, not ours to rewrite.
    graphemes = [match.end() for match in _GRAPHEME.finditer(text)]
    levels = [
        [match.end() for match in _SENTENCE_END.finditer(text)],
        [match.end() for match in _CLAUSE_END.finditer(text)],
        spaces,
        graphemes,
    ]
    strict = [[p for p in level if 0 < p < len(text) and not inside(p)] for level in levels]
    within_spans = [[p for p in positions if 0 < p < len(text) and not inside_fitting(p)]
                    for positions in (spaces, graphemes)]
    loose = [[p for p in positions if 0 < p < len(text) and not inside_token(p)]
             for positions in (spaces, graphemes, range(1, len(text)))]
    return strict + within_spans + loose


def _best_cut(levels: list[list[int]], offsets: list[int], start: int, max_bytes: int) -> int:
    """The cut after `start` whose piece fits `max_bytes`, preferring better kinds, then longer pieces.

    The last kind (code points outside `<|...|>` tokens) always has one: a token fits the smallest budget.
    """
    limit = bisect.bisect_right(offsets, offsets[start] + max_bytes) - 1  # last position that fits
    for level in levels[:-1]:
        index = bisect.bisect_right(level, limit) - 1
        if index >= 0 and level[index] > start:
            return level[index]
    return levels[-1][bisect.bisect_right(levels[-1], limit) - 1]


def _split_turn(body: str, max_bytes: int) -> list[str]:
    """Split one speaker's turn (without its tag) into pieces of at most `max_bytes` UTF-8 bytes."""
    body = body.strip(WHITE_SPACE)
    offsets = _utf8_offsets(body)
    if offsets[-1] <= max_bytes:  # fits: no cut, so no cut positions to find
        return [body]
    levels = _cut_candidates(body, max_bytes)
    pieces, start = [], 0
    while offsets[-1] - offsets[start] > max_bytes:
        cut = _best_cut(levels, offsets, start, max_bytes)
        pieces.append(body[start:cut].rstrip(WHITE_SPACE))
        start = len(body) - len(body[cut:].lstrip(WHITE_SPACE))
    return pieces + [body[start:]]


def _speaker_turns(text: str) -> list[tuple[str, str]]:
    """`(tag, body)` for every speaker turn of tagged text; tags inside cues or paired tags do not start turns."""
    inside = _protected(text, (_BRACKET_CUE, _PAIRED_TAG))
    starts = [match for match in SPEAKER_TAG.finditer(text) if not inside(match.start())]
    turns = []
    for index, match in enumerate(starts):
        end = starts[index + 1].start() if index + 1 < len(starts) else len(text)
        body = text[match.end() : end].strip(WHITE_SPACE)
        if body:
            turns.append((match.group(0), body))
    return turns


def split_text(text: str, max_bytes: int = 300, max_speakers: int = 3) -> list[str]:
    """Split long text into chunks for generation one after another (docs/format.md#long-text).

    Line breaks become spaces. Each chunk has at most `max_bytes` UTF-8 bytes and at most `max_speakers` distinct
    speakers, and starts with its speaker tag (a turn split over chunks repeats its tag). Cuts fall after sentence
    ends, else after clause marks, else at spaces, else between grapheme clusters (text in any script, with or
    without spaces); never inside `<|...|>`, `[cues]` or `<tag>...</tag>` spans that fit the limit. A longer cue or
    tag span is cut inside, at white space where it has some; a speaker tag or other `<|name|>` token never is.

    This function only splits; `Drama3Processor.split_text` also refuses unsafe text.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string; got {type(text).__name__}")
    if not isinstance(max_bytes, int) or max_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"max_bytes must be an integer >= {MIN_CHUNK_BYTES}; got {max_bytes!r}")
    if not isinstance(max_speakers, int) or max_speakers < 1:
        raise ValueError(f"max_speakers must be a positive integer; got {max_speakers!r}")
    for line_break in LINE_BREAKS:
        text = text.replace(line_break, " ")
    turns = _speaker_turns(tag_text(text).lstrip(WHITE_SPACE))
    if not turns:
        raise ValueError(f"text has nothing to speak besides speaker tags: {text!r}")
    pieces = [f"{tag} {piece}" for tag, body in turns for piece in _split_turn(body, max_bytes - len(tag) - 1)]
    chunks: list[list[str]] = []
    for piece in pieces:
        current = chunks[-1] if chunks else None
        if current is not None and _fits(current + [piece], max_bytes, max_speakers):
            current.append(piece)
        else:
            chunks.append([piece])
    return [" ".join(chunk) for chunk in chunks]


def complete_sentences_end(text: str) -> int:
    """Where the complete sentences of text that is still being written end (0 if none is complete yet): after the
    last sentence end that more text follows (a "." at the very end may still become "3.5" or "..."), never inside
    `<|...|>`, `[cues]` or `<tag>...</tag>` spans. Used to speak text sentence by sentence as it arrives."""
    inside = _protected(text, _KEPT_WHOLE)
    ends = [match.end() for match in _SENTENCE_END.finditer(text) if match.end() < len(text)]
    return max((end for end in ends if not inside(end)), default=0)


def _fits(pieces: list[str], max_bytes: int, max_speakers: int) -> bool:
    speakers = {SPEAKER_TAG.match(piece).group(0) for piece in pieces}
    return len(speakers) <= max_speakers and _utf8_length(" ".join(pieces)) <= max_bytes


__all__ = ["MIN_CHUNK_BYTES", "complete_sentences_end", "split_text"]
