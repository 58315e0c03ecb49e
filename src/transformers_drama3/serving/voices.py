"""The server's saved voices: `Drama3Voice` files `NAME.safetensors` in the `--voices` directory.

A client names a voice, never a path: names are letters, digits, `_` and `-` (no dots, no slashes), so a name can
only ever mean a file directly inside the voices directory. The name `default` means no reference voice.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..voice import Drama3Voice
from .errors import APIError

DEFAULT_VOICE = "default"
VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
VOICE_SUFFIX = ".safetensors"


class VoiceLibrary:
    """Saved voices in `directory` (None: no saved voices, only `default`)."""

    def __init__(self, directory: Path | None):
        if directory is not None and not Path(directory).is_dir():
            raise FileNotFoundError(f"the voices directory {str(directory)!r} does not exist; create it first")
        self.directory = None if directory is None else Path(directory)

    def names(self) -> list[str]:
        """`default` and the names of the voice files, sorted."""
        if self.directory is None:
            return [DEFAULT_VOICE]
        found = {path.name[: -len(VOICE_SUFFIX)] for path in self.directory.glob(f"*{VOICE_SUFFIX}")}
        return [DEFAULT_VOICE] + sorted(name for name in found if VOICE_NAME.fullmatch(name) and name != DEFAULT_VOICE)

    def path(self, name: str, param: str = "voice") -> Path:
        """The file of voice `name`; 400 for a name that is not a plain voice name."""
        if not isinstance(name, str) or not VOICE_NAME.fullmatch(name):
            raise APIError(400, f"invalid voice name {name!r}: use 1-64 letters, digits, '_' or '-', starting with a "
                           "letter or digit (a name, not a path)", param, "invalid_voice")
        if self.directory is None:
            raise APIError(400, f"unknown voice {name!r}: this server has no voices directory (start it with "
                           f"--voices DIR); use {DEFAULT_VOICE!r} or send references", param, "voice_not_found")
        return self.directory / f"{name}{VOICE_SUFFIX}"

    def load(self, name: str) -> Drama3Voice | None:
        """The voice called `name` (None for `default`); 400 if there is no such voice."""
        if name == DEFAULT_VOICE:
            return None
        path = self.path(name)
        if not path.is_file():
            raise APIError(400, f"unknown voice {name!r}; available voices: {', '.join(self.names())} "
                           "(GET /v1/voices lists them)", "voice", "voice_not_found")
        try:
            return Drama3Voice.load(path)
        except (OSError, ValueError) as error:
            raise APIError(500, f"the saved voice {name!r} cannot be read: {error}", "voice",
                           "voice_unreadable") from error

    def save(self, name: str, voice: Drama3Voice) -> None:
        """Store `voice` as `name`; 409 if that name is taken."""
        if name == DEFAULT_VOICE:
            raise APIError(409, f"{DEFAULT_VOICE!r} is reserved (it means no reference voice); choose another name",
                           "name", "voice_exists")
        path = self.path(name, "name")
        if path.exists():
            raise APIError(409, f"a voice called {name!r} already exists; choose another name", "name", "voice_exists")
        voice.save(path)

    def describe(self, name: str) -> dict:
        """The `GET /v1/voices` entry of voice `name`."""
        voice = self.load(name)
        if voice is None:
            return {"id": DEFAULT_VOICE, "object": "voice", "transcript": None, "frames": 0}
        return {"id": name, "object": "voice", "transcript": voice.transcript, "frames": int(voice.codes.shape[1])}
