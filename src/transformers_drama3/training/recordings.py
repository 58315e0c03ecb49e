"""Finding the recordings of a training folder and their transcripts.

Two layouts are read (docs/finetuning.md):

- **clip + transcript files**: every audio file under the folder (`.wav`, `.flac`, `.ogg`, `.mp3`, searched
  recursively) with a transcript next to it of the same stem, `clip.txt` or `clip.lab` (UTF-8);
- **`metadata.csv`** at the top of the folder (LJSpeech): one clip per line, `file|text` or `file|text|normalized
  text` (the last non-empty text column is used). `file` is a path relative to the folder, or a name without a
  suffix looked up as `wavs/<name>.wav`, `<name>.wav` and the other suffixes.

Nothing here reads audio samples: clips without a usable transcript or audio file are reported as `SkippedClip`s.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")
TRANSCRIPT_SUFFIXES = (".txt", ".lab")
METADATA_FILE = "metadata.csv"


@dataclass(frozen=True)
class Recording:
    """One clip: `name` (its id: the audio path relative to the data folder, `/`-separated, or the metadata.csv
    entry), the audio file and its transcript."""

    name: str
    audio_path: Path
    transcript: str


@dataclass(frozen=True)
class SkippedClip:
    """A clip left out of the dataset and why (`reason` is one line a person can act on)."""

    name: str
    reason: str


def find_recordings(data_dir: str | os.PathLike) -> tuple[list[Recording], list[SkippedClip]]:
    """The recordings of `data_dir` (sorted by name) and the clips that cannot be used (no transcript, an empty
    transcript, a metadata line without an audio file).

    `metadata.csv` decides the layout when it exists; otherwise every audio file needs a `.txt` or `.lab` transcript.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data folder {str(data_dir)!r} does not exist or is not a folder")
    metadata = data_dir / METADATA_FILE
    found = _from_metadata(data_dir, metadata) if metadata.is_file() else _from_transcript_files(data_dir)
    recordings, skipped, names = [], [], set()
    for item in found:
        if isinstance(item, Recording) and item.name in names:
            item = SkippedClip(item.name, f"listed twice in {METADATA_FILE}: the first line is used")
        if isinstance(item, Recording):
            names.add(item.name)
            recordings.append(item)
        else:
            skipped.append(item)
    recordings.sort(key=lambda recording: recording.name)
    skipped.sort(key=lambda clip: clip.name)
    if not recordings and not skipped:
        raise ValueError(
            f"no recordings in {str(data_dir)!r}: put audio files ({', '.join(AUDIO_SUFFIXES)}) with a .txt or .lab "
            f"transcript of the same name there, or a {METADATA_FILE} in the LJSpeech layout (file|text)"
        )
    return recordings, skipped


def _relative_name(data_dir: Path, path: Path) -> str:
    return path.relative_to(data_dir).as_posix()


def _from_transcript_files(data_dir: Path) -> list[Recording | SkippedClip]:
    found: list[Recording | SkippedClip] = []
    for path in sorted(data_dir.rglob("*")):
        if path.suffix.lower() not in AUDIO_SUFFIXES or not path.is_file():
            continue
        name = _relative_name(data_dir, path)
        transcripts = [path.with_suffix(suffix) for suffix in TRANSCRIPT_SUFFIXES if path.with_suffix(suffix).is_file()]
        if not transcripts:
            found.append(SkippedClip(name, f"no transcript: expected {path.stem}.txt or {path.stem}.lab next to it"))
            continue
        try:
            text = transcripts[0].read_text(encoding="utf-8").strip()
        except UnicodeDecodeError as error:
            found.append(SkippedClip(name, f"transcript {transcripts[0].name} is not UTF-8 text: {error.reason}"))
            continue
        found.append(_recording_or_skip(name, path, text, transcripts[0].name))
    return found


def _from_metadata(data_dir: Path, metadata: Path) -> list[Recording | SkippedClip]:
    found: list[Recording | SkippedClip] = []
    try:
        lines = metadata.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"{metadata} is not UTF-8 text: {error.reason}") from error
    # LJSpeech quotes nothing: a '"' is part of the text, so quoting is off.
    for number, fields in enumerate(csv.reader(lines, delimiter="|", quoting=csv.QUOTE_NONE), start=1):
        if not fields or not "".join(fields).strip():
            continue
        where = f"{METADATA_FILE} line {number}"
        if len(fields) < 2:
            found.append(SkippedClip(f"{where}: {fields[0].strip()}", "no transcript: expected file|text"))
            continue
        audio = _metadata_audio_path(data_dir, fields[0].strip())
        if audio is None:
            found.append(SkippedClip(f"{where}: {fields[0].strip()}", "audio file not found"))
            continue
        texts = [text.strip() for text in fields[1:] if text.strip()]
        found.append(_recording_or_skip(fields[0].strip(), audio, texts[-1] if texts else "", where))
    return found


def _metadata_audio_path(data_dir: Path, entry: str) -> Path | None:
    """The audio file a metadata entry names, or None."""
    if not entry:
        return None
    candidates = [data_dir / entry, data_dir / "wavs" / entry]
    if Path(entry).suffix.lower() not in AUDIO_SUFFIXES:
        candidates = [Path(f"{base}{suffix}") for base in candidates for suffix in AUDIO_SUFFIXES]
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def _recording_or_skip(name: str, audio: Path, text: str, source: str) -> Recording | SkippedClip:
    if not text:
        return SkippedClip(name, f"transcript missing: {source} is empty")
    return Recording(name, audio, text)


__all__ = ["AUDIO_SUFFIXES", "METADATA_FILE", "TRANSCRIPT_SUFFIXES", "Recording", "SkippedClip", "find_recordings"]
