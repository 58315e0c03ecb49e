"""The server's saved voices: `Drama3Voice` files `NAME.voice.safetensors` in the `--voices` directory.

A client names a voice, never a path: names are letters, digits, `_` and `-` (no dots, no slashes), so a name can
only ever mean a file directly inside the voices directory. The name `default` means no reference voice. Files named
`NAME.safetensors` (the name of earlier versions) are read too; new voices are written as `NAME.voice.safetensors`,
the name `drama3-tts --save-voice` and the docs use.

The directory is the only truth, so replicas of the server can share it (on shared storage): every request looks at
the file, a voice enrolled, replaced or deleted by one replica is seen by the others at their next request, and a
voice kept in memory is reused only while its file is the same one (inode, size, modification time; a replacement is
a new file, renamed over the old one). Writes are atomic: a new voice is linked into place only if the name is still
free (two replicas enrolling one name at once: one gets 409), a replacement is renamed over the old file. Files are
content-checked when read (their SHA-256, `Drama3Voice.load`). A file in the directory that is not a usable voice (a
name that is not a voice name, a damaged or foreign file) is reported in the log, once per version of the file.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
from pathlib import Path

from ..voice import VOICE_FILE_SUFFIX, Drama3Voice
from .errors import APIError

logger = logging.getLogger("transformers_drama3.serving")

DEFAULT_VOICE = "default"
VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
LEGACY_SUFFIX = ".safetensors"  # NAME.safetensors: read, never written


def file_version(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is replaced or rewritten: (inode, size, mtime in ns); None if it is gone."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


class VoiceLibrary:
    """Saved voices in `directory` (None: no saved voices, only `default`)."""

    def __init__(self, directory: Path | None):
        if directory is not None and not Path(directory).is_dir():
            raise FileNotFoundError(f"the voices directory {str(directory)!r} does not exist; create it first")
        self.directory = None if directory is None else Path(directory)
        self.cache: dict[str, tuple[Path, tuple, Drama3Voice]] = {}  # name -> (file, its version, the voice)
        self.reported: dict[str, tuple] = {}  # file name -> the version whose problem was logged
        self.lock = threading.Lock()  # requests run in several threads

    # -- reading -------------------------------------------------------------------------------------------------

    def files(self) -> dict[str, Path]:
        """Voice name -> file, for every file of the directory that names a voice (NAME.voice.safetensors wins over
        NAME.safetensors); files that end in .safetensors but name no voice are reported in the log."""
        if self.directory is None:
            return {}
        found: dict[str, Path] = {}
        paths = sorted(self.directory.glob(f"*{LEGACY_SUFFIX}"),
                       key=lambda path: (not path.name.endswith(VOICE_FILE_SUFFIX), path.name))
        for path in paths:
            suffix = VOICE_FILE_SUFFIX if path.name.endswith(VOICE_FILE_SUFFIX) else LEGACY_SUFFIX
            name = path.name[: -len(suffix)]
            if not VOICE_NAME.fullmatch(name) or name == DEFAULT_VOICE:
                self.report(path, f"{name!r} is not a voice name (1-64 letters, digits, '_' or '-', not "
                            f"{DEFAULT_VOICE!r}): rename it to NAME{VOICE_FILE_SUFFIX}")
            elif name in found:
                self.report(path, f"the voice {name!r} is read from {found[name].name}; remove one of the two")
            else:
                found[name] = path
        return found

    def report(self, path: Path, problem: str) -> None:
        """Log a problem with a file in the directory, once per version of the file."""
        version = file_version(path)
        if self.reported.get(path.name) != version:
            self.reported[path.name] = version
            logger.warning("voices directory: %s is not used: %s", path, problem)

    def names(self) -> list[str]:
        """`default` and the names of the voice files, sorted."""
        return [DEFAULT_VOICE] + sorted(self.files())

    def check_name(self, name: str, param: str = "voice") -> None:
        """400 for a name that is not a plain voice name, or when the server has no voices directory."""
        if not isinstance(name, str) or not VOICE_NAME.fullmatch(name):
            raise APIError(400, f"invalid voice name {name!r}: use 1-64 letters, digits, '_' or '-', starting with a "
                           "letter or digit (a name, not a path)", param, "invalid_voice")
        if self.directory is None:
            raise APIError(400, f"unknown voice {name!r}: this server has no voices directory (start it with "
                           f"--voices DIR); use {DEFAULT_VOICE!r} or send references", param, "voice_not_found")

    def path_of(self, name: str) -> Path | None:
        """The file of voice `name` (NAME.voice.safetensors, else NAME.safetensors), None if there is none."""
        for suffix in (VOICE_FILE_SUFFIX, LEGACY_SUFFIX):
            path = self.directory / f"{name}{suffix}"
            if path.is_file():
                return path
        return None

    def exists(self, name: str) -> bool:
        return self.path_of(name) is not None

    def get(self, name: str, missing_status: int = 400) -> Drama3Voice | None:
        """The voice called `name` (None for `default`), read again when its file changed; `missing_status` (400 for
        a speech request, 404 for `/v1/voices/NAME`) if there is no such voice, 500 if its file is damaged."""
        if name == DEFAULT_VOICE:
            return None
        self.check_name(name)
        path = self.path_of(name)
        version = None if path is None else file_version(path)
        if version is None:
            with self.lock:
                self.cache.pop(name, None)
            raise APIError(missing_status, f"unknown voice {name!r}; available voices: {', '.join(self.names())} "
                           "(GET /v1/voices lists them)", "voice", "voice_not_found")
        with self.lock:
            cached = self.cache.get(name)
        if cached is not None and cached[:2] == (path, version):
            return cached[2]
        try:
            voice = Drama3Voice.load(path)
        except (OSError, ValueError) as error:
            self.report(path, str(error))
            raise APIError(500, f"the saved voice {name!r} cannot be read: {error}", "voice",
                           "voice_unreadable") from error
        with self.lock:
            self.cache[name] = (path, version, voice)
        return voice

    def describe(self, name: str, missing_status: int = 400) -> dict:
        """The `GET /v1/voices` entry of voice `name`."""
        voice = self.get(name, missing_status)
        if voice is None:
            return {"id": DEFAULT_VOICE, "object": "voice", "transcript": None, "frames": 0}
        return {"id": name, "object": "voice", "transcript": voice.transcript, "frames": int(voice.codes.shape[1]),
                "sha256": voice.content_hash}

    def describe_all(self) -> list[dict]:
        """Every usable voice's entry; damaged files are reported in the log and left out."""
        entries = []
        for name in self.names():
            try:
                entries.append(self.describe(name))
            except APIError:  # reported by `get`; a voice deleted meanwhile is simply gone
                continue
        return entries

    def scan(self) -> int:
        """Read every voice file once (the server does it at start), so that bad files are in the log at once."""
        return len(self.describe_all()) - 1

    # -- writing -------------------------------------------------------------------------------------------------

    def check_new_name(self, name: str, replace: bool = False) -> None:
        """400 for a bad name, 409 for `default` or (unless `replace`) a name that is taken."""
        if name == DEFAULT_VOICE:
            raise APIError(409, f"{DEFAULT_VOICE!r} is reserved (it means no reference voice); choose another name",
                           "name", "voice_exists")
        self.check_name(name, "name")
        if not replace and self.exists(name):
            raise APIError(409, f"a voice called {name!r} already exists; choose another name, or replace it with "
                           f"PUT /v1/voices/{name}", "name", "voice_exists")

    def save(self, name: str, voice: Drama3Voice, replace: bool = False) -> bool:
        """Store `voice` as `name` (atomically); 409 if the name is taken and not `replace`. True if it replaced a
        voice."""
        self.check_new_name(name, replace)
        path = self.directory / f"{name}{VOICE_FILE_SUFFIX}"
        temporary = self.directory / f".{name}.{secrets.token_hex(6)}.tmp"
        existed = self.exists(name)
        try:  # written beside its place, then moved there: readers see no voice, the old one or the new one
            with open(temporary, "xb") as file:
                file.write(voice.to_bytes())
                file.flush()
                os.fsync(file.fileno())
            if replace:
                os.replace(temporary, path)
            else:
                os.link(temporary, path)  # fails if another replica took the name meanwhile
        except FileExistsError:
            raise APIError(409, f"a voice called {name!r} already exists; choose another name", "name",
                           "voice_exists") from None
        finally:
            temporary.unlink(missing_ok=True)
        (self.directory / f"{name}{LEGACY_SUFFIX}").unlink(missing_ok=True)  # the new file is the one
        return existed

    def delete(self, name: str) -> None:
        """Remove voice `name`; 404 if there is none."""
        self.check_new_name(name, replace=True)
        removed = False
        for suffix in (VOICE_FILE_SUFFIX, LEGACY_SUFFIX):
            try:
                (self.directory / f"{name}{suffix}").unlink()
                removed = True
            except FileNotFoundError:
                continue
        with self.lock:
            self.cache.pop(name, None)
        if not removed:
            raise APIError(404, f"unknown voice {name!r}; GET /v1/voices lists the voices", "name", "voice_not_found")
