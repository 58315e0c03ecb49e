"""The items of a job, checked whole before any model loads: from a JSON Lines manifest (`read_manifest`) or from the
rows of a 🤗 `datasets.Dataset` with a column mapping (`dataset_items`). Both turn each line or row into the same
entry (the manifest's fields) and check every entry by the same rules (`checked_items`), so a job runs the same way
whatever it was read from (docs/scaling.md).

Every problem of every line is collected and reported in one `ManifestError`, each naming its line (or row).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .speaker_tags import MAX_SPEAKER_ID, WHITE_SPACE

ITEM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FORMATS = ("wav", "flac", "ogg", "mp3", "opus")  # every file format `drama3-tts -o FILE` writes
SAMPLING_FIELDS = {"temperature": ((int, float), "a number"), "top_p": ((int, float), "a number"),
                   "top_k": (int, "an integer"), "max_new_tokens": (int, "an integer"),
                   "greedy": (bool, "true or false")}
REFERENCE_FIELDS = ("reference_audio", "reference_transcript")  # one recording and its transcript, e.g. two columns
FIELDS = {"id", "text", "text_file", "voice", "references", *REFERENCE_FIELDS, "speaker", "seed", "format",
          *SAMPLING_FIELDS}
MAX_SEED = 2**63
EXACT_FLOAT_INTEGERS = 2**53  # a float holds every whole number up to this exactly
DATASETS_HINT = "reading a dataset needs 🤗 datasets: pip install 'transformers-drama3[datasets]'"
MAX_LISTED = 50  # problems spelled out in one error; the rest are counted


class ManifestError(ValueError):
    """A job's input that cannot be run: every problem found, each with the file and line (or row) it is about."""


def problems_error(problems: list[str], what: str) -> ManifestError:
    """One error listing `problems` (at most `MAX_LISTED` of them, the rest counted)."""
    if len(problems) == 1:
        return ManifestError(problems[0])
    listed = problems[:MAX_LISTED]
    more = f"\n  ... and {len(problems) - len(listed)} more" if len(problems) > len(listed) else ""
    return ManifestError(f"{len(problems)} problems in {what}; nothing was run (fix them all and run again):\n  "
                         + "\n  ".join(listed) + more)


@dataclass
class JobItem:
    """One manifest line or dataset row, checked. `settings` are `generate` keywords; `fingerprint` changes with
    the line (or the row's mapped values)."""

    id: str
    line: int  # the manifest's line number, or the dataset's row index
    seed: int
    format: str
    settings: dict
    fingerprint: str
    where: str = ""  # "jobs.jsonl line 3", "row 7": how errors name the item
    text: str | None = None
    text_file: Path | None = None
    voices: list[Path] = field(default_factory=list)
    references: list[dict] = field(default_factory=list)  # {"audio": Path or a file's bytes, "transcript": str}
    speaker: int | None = None

    @property
    def file_name(self) -> str:
        return f"{self.id}.{self.format}"


def item_seed(item_id: str, base_seed: int = 0) -> int:
    """The seed of an item without its own `seed`: from its id (and the job's base seed), never from a rank."""
    digest = hashlib.sha256(f"{base_seed}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % MAX_SEED


def read_manifest(path: str | os.PathLike, base_seed: int = 0, defaults: dict | None = None,
                  problems: list[str] | None = None) -> list[JobItem]:
    """The items of a JSON Lines manifest, every line checked (`checked_items`). Raises one `ManifestError` naming
    every bad line and every missing file (or, given a list `problems`, adds them to it and returns the good items);
    reads no text, voice or audio file."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ManifestError(f"cannot read the manifest {str(path)!r}: {error}") from error
    entries, found = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            entries.append((where, number, json.loads(line)))
        except json.JSONDecodeError as error:
            found.append(f"{where}: not valid JSON ({error.msg} at column {error.colno})")
    if not entries and not found:
        raise ManifestError(f"the manifest {str(path)!r} has no items: write one JSON object per line")
    items = checked_items(entries, path.parent, base_seed, defaults, path.name, found)
    return reported(items, found, problems, path.name)


def reported(items: list[JobItem], found: list[str], problems: list[str] | None, what: str) -> list[JobItem]:
    """`items`, once the `found` problems are raised (one `ManifestError`), or added to the caller's `problems`."""
    if problems is not None:
        problems.extend(found)
    elif found:
        raise problems_error(found, what)
    return items


def checked_items(entries: Iterable[tuple[str, int, object]], folder: Path, base_seed: int = 0,
                  defaults: dict | None = None, what: str = "the job",
                  problems: list[str] | None = None) -> list[JobItem]:
    """`(where, line, entry)` -> items: fields, types, unique ids, sampling settings (by the rules of `generate`)
    and that the files named exist, of every entry; paths are relative to `folder`. Raises one `ManifestError`
    with every problem, or, given a list `problems`, adds them to it and returns the items without any."""
    from transformers import GenerationConfig

    from .generation import DRAMA3_GENERATION_DEFAULTS, generation_settings

    found: list[str] = []
    items, seen = [], {}
    base = GenerationConfig(**DRAMA3_GENERATION_DEFAULTS)
    for where, number, entry in entries:
        try:
            item = _checked_item(entry, where, number, folder, base_seed, dict(defaults or {}))
            generation_settings(base, **item.settings)
        except (ManifestError, TypeError, ValueError) as error:
            found.append(str(error) if isinstance(error, ManifestError) else f"{where}: {error}")
            continue
        if item.id in seen:
            found.append(f"{where}: id {item.id!r} is used on {seen[item.id]} too; ids must be unique")
            continue
        seen[item.id] = where
        items.append(item)
    return reported(items, found, problems, what)


def _checked_item(entry, where: str, number: int, folder: Path, base_seed: int, settings: dict) -> JobItem:
    if not isinstance(entry, Mapping):
        raise ManifestError(f"{where}: each line must be a JSON object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise ManifestError(f"{where}: unknown field(s) {unknown}; an item takes {sorted(FIELDS)}")

    def value(name, kinds, what):
        found = entry.get(name)
        if kinds is int and isinstance(found, float) and found.is_integer() and abs(found) <= EXACT_FLOAT_INTEGERS:
            return int(found)  # a whole number read as a float: a CSV column of numbers with empty cells is float
        if found is not None and (not isinstance(found, kinds) or (kinds is not bool and isinstance(found, bool))):
            raise ManifestError(f"{where}: {name} must be {what}, got {found!r}")
        return found

    item_id = value("id", str, "a string")
    if item_id is None or not ITEM_ID.fullmatch(item_id):
        raise ManifestError(f"{where}: id must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or "
                            f"digit (it names the output file); got {item_id!r}")
    text, text_file = value("text", str, "a string"), value("text_file", str, "a file path")
    if "text" in entry and text_file is None and not (text or "").strip(WHITE_SPACE):
        raise ManifestError(f"{where}: text is empty{' (only white space)' if text else ''}")
    if (text is None) == (text_file is None):
        raise ManifestError(f"{where}: give exactly one of text and text_file")
    voices = entry.get("voice") or []
    voices = [voices] if isinstance(voices, str) else voices
    if not isinstance(voices, list) or not all(isinstance(each, str) for each in voices):
        raise ManifestError(f"{where}: voice must be a voice file path or a list of them")
    references = entry.get("references") or []
    if not isinstance(references, list) or not all(
            isinstance(each, Mapping) and set(each) == {"audio", "transcript"}
            and all(isinstance(each[key], str) for key in each) for each in references):
        raise ManifestError(f"{where}: references must be a list of {{\"audio\": FILE, \"transcript\": TEXT}}")
    recorded = row_reference(entry, where)
    speaker = value("speaker", int, f"a speaker number 0..{MAX_SPEAKER_ID}")
    if speaker is not None and not 0 <= speaker <= MAX_SPEAKER_ID:
        raise ManifestError(f"{where}: speaker must be 0..{MAX_SPEAKER_ID}, got {speaker}")
    seed = value("seed", int, "an integer")
    if seed is not None and not 0 <= seed < MAX_SEED:
        raise ManifestError(f"{where}: seed must be in [0, 2**63), got {seed}")
    audio_format = value("format", str, f"one of {list(FORMATS)}") or "wav"
    if audio_format not in FORMATS:
        raise ManifestError(f"{where}: format must be one of {list(FORMATS)}, got {audio_format!r}")
    for name, (kinds, what) in SAMPLING_FIELDS.items():
        if value(name, kinds, what) is not None:
            settings[name] = value(name, kinds, what)
    if settings.pop("greedy", False):
        settings["do_sample"] = False
    files = [("text_file", text_file)] if text_file else []
    files += [("voice", each) for each in voices] + [("references audio", each["audio"]) for each in references]
    files += [("reference_audio", each["audio"]) for each in recorded if not isinstance(each["audio"], bytes)]
    missing = [f"{name} {str(folder / path)!r}" for name, path in files if not (folder / path).is_file()]
    if missing:
        raise ManifestError(f"{where}: no such file: {', '.join(missing)}")
    fingerprint = hashlib.sha256(canonical_json([dict(entry), settings, base_seed]).encode())
    return JobItem(
        id=item_id, line=number, seed=item_seed(item_id, base_seed) if seed is None else seed, format=audio_format,
        settings=settings, fingerprint=fingerprint.hexdigest()[:16], where=where, text=text,
        text_file=None if text_file is None else folder / text_file, voices=[folder / each for each in voices],
        speaker=speaker,
        references=[{"audio": each["audio"] if isinstance(each["audio"], bytes) else folder / each["audio"],
                     "transcript": each["transcript"]} for each in [*references, *recorded]],
    )


def row_reference(entry: Mapping, where: str) -> list[dict]:
    """The reference of `reference_audio` and `reference_transcript` (`[]` without them): `{"audio": a file path
    or the bytes of an audio file, "transcript"}`. The audio is a path, or a `datasets.Audio` value undecoded
    (`{"bytes", "path"}`: its bytes, or its file when it has no bytes)."""
    audio, transcript = (entry.get(name) for name in REFERENCE_FIELDS)
    if audio is None and transcript is None:
        return []
    if audio is None or transcript is None:
        raise ManifestError(f"{where}: reference_audio and reference_transcript go together (a recording and what is "
                            "said in it); give both or neither")
    if not isinstance(transcript, str):
        raise ManifestError(f"{where}: reference_transcript must be a string, got {transcript!r:.80}")
    if isinstance(audio, Mapping) and set(audio) <= {"bytes", "path"}:
        audio = audio.get("bytes") if audio.get("bytes") is not None else audio.get("path")
    if not isinstance(audio, (str, bytes)):
        raise ManifestError(f"{where}: reference_audio must be an audio file path or a datasets.Audio value "
                            f"({{\"bytes\", \"path\"}}), got {type(audio).__name__}")
    return [{"audio": audio, "transcript": transcript}]


def canonical_json(value) -> str:
    """`value` as JSON with sorted keys, the bytes in it (an audio file in a row) as their SHA-256: what a
    fingerprint or a content id hashes."""
    def digest(data):
        if isinstance(data, bytes):
            return hashlib.sha256(data).hexdigest()
        raise TypeError(f"a value of type {type(data).__name__} is not JSON")

    return json.dumps(value, sort_keys=True, default=digest)


# ----------------------------------------------------------------------------------------------------------------
# 🤗 datasets
# ----------------------------------------------------------------------------------------------------------------


def load_input_dataset(source: str | os.PathLike, split: str = "train"):
    """A `datasets.Dataset` from a local parquet / JSON / JSON Lines / CSV file, a folder written by `save_to_disk`
    (or of such files), or a Hub id `owner/name` (online); `split` picks one of several. A source that looks local
    (a bare name, a path, a file suffix) and does not exist is never looked up on the Hub. Raises `ManifestError`
    saying why not."""
    try:
        import datasets
    except ImportError:
        raise ManifestError(DATASETS_HINT) from None

    path = Path(source)
    builders = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
    if not path.exists() and looks_local(str(source), builders):
        raise ManifestError(f"no such file or folder {str(source)!r} (a Hub dataset is named owner/name, e.g. "
                            "'user/texts')")
    try:
        if path.is_file():
            if path.suffix.lower() not in builders:
                raise ManifestError(f"cannot tell the format of {str(path)!r}: give a .parquet, .json, .jsonl or .csv "
                                    "file, or a dataset folder")
            loaded = datasets.load_dataset(builders[path.suffix.lower()], data_files=str(path), split="train")
        elif path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(str(source), split=split)
    except ManifestError:
        raise
    except Exception as error:  # noqa: BLE001  (datasets raises many kinds; each is the user's input)
        raise ManifestError(f"cannot read the dataset {str(source)!r}: {type(error).__name__}: {error}") from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ManifestError(f"the dataset {str(source)!r} has no split {split!r}; it has {sorted(loaded)}")
        loaded = loaded[split]
    return loaded


def looks_local(source: str, suffixes) -> bool:
    """Is `source` meant as a local file or folder rather than a Hub dataset id? Hub ids are `owner/name`; a bare
    name, a path (`./x`, `/x`, `~/x`, `a/b/c`), a name with a data file's suffix, or `a/b` where the folder `a`
    exists here is local."""
    from .checkpoint_location import looks_like_a_path

    parent = Path(source).parent
    return ("/" not in source or looks_like_a_path(source) or Path(source).suffix.lower() in suffixes
            or (parent != Path(".") and parent.is_dir()))


def dataset_items(dataset, columns: Mapping[str, str] | None = None, *, dialogue_column: str | None = None,
                  folder: str | os.PathLike = ".", base_seed: int = 0, defaults: dict | None = None,
                  what: str = "the dataset", problems: list[str] | None = None) -> list[JobItem]:
    """The items of a `datasets.Dataset`: `columns` maps item fields (`text`, `id`, `voice`, `references`, `seed`,
    `speaker`, `format`, `text_file`, sampling settings) to column names (`{"text": "text"}` by default).

    `dialogue_column`: a column of turns `[{"speaker": N, "text": T}, ...]`, spoken as one speaker-tagged text
    instead of a text column. Without an `id` column a row's id is `row` and its index (`row00042`), so a rerun
    finds it as long as the rows keep their order. Relative paths are relative to `folder`; an audio column
    (`datasets.Audio`) is read undecoded, as the bytes or path of each row's file. Every row is checked
    (`checked_items`); one `ManifestError` names every bad row (or, given a list `problems`, they are added to it
    and the good rows' items returned).
    """
    columns = item_columns(columns, dialogue_column)
    found = [f"columns: {name!r} is not an item field; map one of {sorted(FIELDS)}" for name in columns
             if name not in FIELDS]
    wanted = [*columns.values(), *([dialogue_column] if dialogue_column else [])]
    found += [f"the dataset has no column {name!r}; its columns are {dataset.column_names}" for name in wanted
              if name not in dataset.column_names]
    if dialogue_column and ("text" in columns or "text_file" in columns):
        found.append("give a text column or a dialogue column, not both")
    if found:
        return reported([], found, problems, what)
    width = len(str(max(len(dataset) - 1, 0)))
    selected = undecoded(dataset.select_columns(list(dict.fromkeys(wanted))))

    checked = []
    for index, row in enumerate(selected):
        try:
            checked.append((f"row {index}", index, row_entry(row, columns, dialogue_column, f"row{index:0{width}d}")))
        except ValueError as error:
            found.append(f"row {index}: {error}")
    items = checked_items(checked, Path(folder), base_seed, defaults, what, found)
    return reported(items, found, problems, what)


def undecoded(dataset):
    """`dataset` with its audio columns read as stored (`{"bytes", "path"}`), not decoded (which needs torchcodec):
    the job reads the files itself, with soundfile."""
    import datasets

    for name, feature in dataset.features.items():
        if isinstance(feature, datasets.Audio) and feature.decode:
            dataset = dataset.cast_column(name, datasets.Audio(sampling_rate=feature.sampling_rate, decode=False))
    return dataset


def item_columns(columns: Mapping[str, str] | None, dialogue_column: str | None) -> dict:
    """The column mapping of a dataset job: `columns`, or by default `{"text": "text"}` (nothing with a dialogue
    column)."""
    return dict(columns) if columns is not None else ({} if dialogue_column else {"text": "text"})


def row_entry(row: Mapping, columns: Mapping[str, str], dialogue_column: str | None, default_id: str) -> dict:
    """A row -> the entry of its item (the manifest's fields): mapped columns (None left out, but an empty text cell
    kept as None: the text is empty), `default_id` without an id column, the dialogue column's turns as the
    text."""
    entry = {name: row[column] for name, column in columns.items()
             if row[column] is not None or (name == "text" and row.get(columns.get("text_file"), None) is None)}
    if isinstance(entry.get("id"), float) and entry["id"].is_integer():
        entry["id"] = int(entry["id"])  # an integer id column with empty cells is read as floats
    if isinstance(entry.get("id"), int) and not isinstance(entry["id"], bool):
        entry["id"] = str(entry["id"])  # an integer id column names files as well as a string one
    entry.setdefault("id", default_id)
    if dialogue_column:
        try:
            entry["text"] = dialogue_text(row[dialogue_column])
        except ValueError as error:
            raise ValueError(f"{dialogue_column}: {error}") from None
    return entry


def dialogue_text(turns) -> str:
    """Turns `[{"speaker": N, "text": T}, ...]` -> `<|speaker:N|> T <|speaker:M|> U ...`."""
    if not isinstance(turns, list) or not turns or not all(
            isinstance(turn, Mapping) and isinstance(turn.get("text"), str) and isinstance(turn.get("speaker"), int)
            and not isinstance(turn.get("speaker"), bool) and 0 <= turn["speaker"] <= MAX_SPEAKER_ID
            for turn in turns):
        raise ValueError(f"a dialogue is a non-empty list of {{\"speaker\": 0..{MAX_SPEAKER_ID}, \"text\": TEXT}}; "
                         f"got {turns!r:.120}")
    return " ".join(f"<|speaker:{turn['speaker']}|> {turn['text']}" for turn in turns)


__all__ = ["DATASETS_HINT", "FIELDS", "FORMATS", "ITEM_ID", "MAX_SEED", "REFERENCE_FIELDS", "JobItem", "ManifestError",
           "canonical_json", "checked_items", "dataset_items", "dialogue_text", "item_columns", "item_seed",
           "load_input_dataset", "looks_local", "problems_error", "read_manifest", "reported", "row_entry",
           "row_reference", "undecoded"]
