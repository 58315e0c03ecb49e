"""Speaker tags and white space: the text rules shared by prompt building (`processing_drama3`) and long-text
splitting (`chunking`).

Text to speak and reference transcripts start with a speaker tag `<|speaker:N|>` (N in 0..15, no leading zero);
text without one gets `<|speaker:0|> ` in front. "White space" means the Unicode White_Space property.
"""

from __future__ import annotations

import re

# Characters with the Unicode White_Space property (str.isspace() also accepts U+001C..U+001F, which would
# change the empty-text check and the speaker-tag rule).
WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    + "".join(chr(code) for code in range(0x2000, 0x200B))
    + "\u2028\u2029\u202f\u205f\u3000"
)
WHITE_SPACE_CLASS = "[" + re.escape(WHITE_SPACE) + "]"  # a regular-expression class of those characters

MAX_SPEAKER_ID = 15
SPEAKER_TAG = re.compile(r"<\|speaker:(?:1[0-5]|[0-9])\|>")
DEFAULT_SPEAKER_PREFIX = "<|speaker:0|> "


def tag_text(text: str) -> str:
    """Put `<|speaker:0|> ` in front of `text` unless a speaker tag leads it (after white space)."""
    if SPEAKER_TAG.match(text.lstrip(WHITE_SPACE)):
        return text
    return DEFAULT_SPEAKER_PREFIX + text


def tag_transcript(transcript: str) -> str:
    """Like `tag_text`, and a leading tag behind white space moves in front of it.

    In a reference the tag must follow `"Text: "` directly: `"  <|speaker:1|>Hi"` becomes `"<|speaker:1|>  Hi"`.
    """
    tagged = tag_text(transcript)
    body = tagged.lstrip(WHITE_SPACE)
    lead = tagged[: len(tagged) - len(body)]
    tag = SPEAKER_TAG.match(body)
    return tag.group(0) + lead + body[tag.end() :]


__all__ = ["DEFAULT_SPEAKER_PREFIX", "MAX_SPEAKER_ID", "SPEAKER_TAG", "WHITE_SPACE", "WHITE_SPACE_CLASS", "tag_text",
           "tag_transcript"]
