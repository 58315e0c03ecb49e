"""Saved voices.

A `Drama3Voice` is a voice reference that has already been through the codec encoder: its codes `[10, frames]`
plus the transcript of what is said in it. Saving it once means later requests reuse the voice without loading
the codec encoder or re-reading the audio. The file is a safetensors file holding one `codes` tensor, with the
transcript, an optional name and a SHA-256 of the content (`content_hash`: codes and transcript) in its metadata;
`load` refuses a file whose content does not match its hash. The one name for voice files, used by `drama3-tts
--save-voice` and `drama3-serve --voices DIR`, is `NAME.voice.safetensors` (`VOICE_FILE_SUFFIX`).

Voice files are written atomically (`audio_io.write_atomically`): an error never leaves a half-written file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors_bytes

from .audio_io import write_atomically
from .codes import check_codes

VOICE_FORMAT = "drama3-voice"
VOICE_FORMAT_VERSION = "1"
VOICE_FILE_SUFFIX = ".voice.safetensors"


@dataclass(eq=False, repr=False)  # codes are a tensor: no elementwise-ambiguous __eq__, no dump of all the codes
class Drama3Voice:
    """A reusable voice: codec codes `[num_codebooks, frames]` and the transcript spoken in them.

    Pass it anywhere a reference is accepted (`processor(text, references=[voice])`). Make one from audio with
    `Drama3Processor.create_voice`, store it with `save`, read it back with `Drama3Voice.load`.
    """

    codes: torch.Tensor  # [num_codebooks, frames] int64
    transcript: str
    name: str | None = None

    def __post_init__(self):
        codes = check_codes(self.codes, None, "Drama3Voice.codes")
        if not isinstance(self.transcript, str):
            raise TypeError(f"Drama3Voice.transcript must be a string; got {type(self.transcript).__name__}")
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"Drama3Voice.name must be a string or None; got {type(self.name).__name__}")
        self.codes = codes.cpu().contiguous()

    def __repr__(self) -> str:
        transcript = self.transcript if len(self.transcript) <= 60 else self.transcript[:57] + "..."
        name = "" if self.name is None else f"name={self.name!r}, "
        codes = f"[{self.codes.shape[0]}, {self.codes.shape[1]} frames]"
        return f"Drama3Voice({name}transcript={transcript!r}, codes={codes})"

    @property
    def content_hash(self) -> str:
        """SHA-256 (hex) of what the voice is: its codes (shape and int64 values) and its transcript."""
        digest = hashlib.sha256(str(tuple(self.codes.shape)).encode())
        digest.update(self.codes.numpy().tobytes())
        digest.update(self.transcript.encode("utf-8"))
        return digest.hexdigest()

    def to_bytes(self) -> bytes:
        """The voice file's bytes (what `save` writes)."""
        metadata = {"format": VOICE_FORMAT, "version": VOICE_FORMAT_VERSION, "transcript": self.transcript,
                    "sha256": self.content_hash}
        if self.name is not None:
            metadata["name"] = self.name
        return save_safetensors_bytes({"codes": self.codes}, metadata=metadata)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the voice to a safetensors file (atomically) and return its path."""
        data = self.to_bytes()
        return write_atomically(path, lambda file: file.write(data))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Drama3Voice:
        """Read a voice written by `save`; raises ValueError if the file is not a Drama 3 voice file."""
        try:
            with safe_open(str(path), framework="pt") as file:
                metadata = file.metadata() or {}
                names = set(file.keys())
                codes = file.get_tensor("codes") if names == {"codes"} else None
        except SafetensorError as error:
            raise ValueError(f"{str(path)!r} is not a Drama 3 voice file (not safetensors: {error})") from error
        if metadata.get("format") != VOICE_FORMAT or codes is None or "transcript" not in metadata:
            raise ValueError(
                f"{str(path)!r} is not a Drama 3 voice file: expected format {VOICE_FORMAT!r}, one `codes` tensor "
                f"and a transcript in the metadata"
            )
        if metadata.get("version") != VOICE_FORMAT_VERSION:
            raise ValueError(
                f"{str(path)!r} is a voice file of version {metadata.get('version')!r}; this package reads "
                f"version {VOICE_FORMAT_VERSION!r}"
            )
        voice = cls(codes=codes, transcript=metadata["transcript"], name=metadata.get("name"))
        if "sha256" in metadata and metadata["sha256"] != voice.content_hash:  # files saved before the hash have none
            raise ValueError(f"{str(path)!r} is damaged: its codes and transcript do not match the SHA-256 it was "
                             "saved with; save the voice again")
        return voice
