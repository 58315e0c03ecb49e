"""Manifest jobs: many texts spoken into many files, resumable, batched by length, over any number of ranks
(docs/scaling.md).

    drama3-tts --model DIR --manifest jobs.jsonl --output-dir out/
    torchrun --nnodes 2 --nproc-per-node 8 ... -m transformers_drama3.cli --model DIR --manifest jobs.jsonl \
        --output-dir /shared/out/

A manifest is JSON Lines, one item a line: `id`, `text` or `text_file`, and optionally `voice` (voice files),
`references` (`[{"audio": FILE, "transcript": TEXT}]`), `speaker`, `seed`, `format` (wav, flac, ogg) and sampling
settings (`temperature`, `top_p`, `top_k`, `max_new_tokens`, `greedy`). Paths are relative to the manifest's folder.
The manifest is checked whole before any model loads (`read_manifest`: errors name the line).

What a run does (`run_job`):
- each item becomes `DIR/ID.FORMAT`, written atomically, and one record (frames, seconds, finish reason, time) in
  `DIR/results.jsonl`; an item whose record says done, whose file exists and whose manifest line is unchanged is
  skipped on a rerun;
- an item that fails (unreadable reference, refused text, ...) gets a record with its error; the job goes on, and a
  rerun tries it again;
- items of one chunk are batched by length (the same sampling settings in a batch) through `generate` with one seed
  per sequence, so each item gets the audio it gets alone; text of several chunks goes through `synthesize`;
- under torch.distributed (`torchrun`, `accelerate launch`) rank 0 reads the manifest and forms the batches of the
  pending items as one process would (`plan_job`), and the batches are dealt out round-robin, one share per model (a
  rank with a whole model, or all ranks when the model is split over them): an item's seed comes from its id (or its
  `seed`), never from the rank, so its audio is the same whatever the number of ranks;
- every finished item is appended at once to this process's record file in `DIR/.drama3-jobs/`, so a crash or a kill
  loses only the batches in flight; at the end rank 0 merges the record files into `results.jsonl`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from . import parallel
from .audio_io import write_atomically, write_audio
from .chunking import MIN_CHUNK_BYTES
from .speaker_tags import MAX_SPEAKER_ID, SPEAKER_TAG, WHITE_SPACE
from .synthesis import synthesize
from .voice import Drama3Voice

RESULTS_FILE = "results.jsonl"
RECORDS_FOLDER = ".drama3-jobs"  # per-process record files of runs not merged yet
ITEM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FORMATS = ("wav", "flac", "ogg")
SAMPLING_FIELDS = {"temperature": ((int, float), "a number"), "top_p": ((int, float), "a number"),
                   "top_k": (int, "an integer"), "max_new_tokens": (int, "an integer"),
                   "greedy": (bool, "true or false")}
FIELDS = {"id", "text", "text_file", "voice", "references", "speaker", "seed", "format", *SAMPLING_FIELDS}
MAX_SEED = 2**63
# How long a rank waits for the others at the end of a job (torch's default, 30 minutes, is shorter than the last
# batch of a rank can take on a big job): give it to `torch.distributed.init_process_group(timeout=...)`.
JOB_COLLECTIVE_TIMEOUT = timedelta(hours=24)


class ManifestError(ValueError):
    """A manifest that cannot be run, with the file and line it is about."""


@dataclass
class JobItem:
    """One manifest line, checked. `settings` are `generate` keywords; `fingerprint` changes with the line."""

    id: str
    line: int
    seed: int
    format: str
    settings: dict
    fingerprint: str
    text: str | None = None
    text_file: Path | None = None
    voices: list[Path] = field(default_factory=list)
    references: list[dict] = field(default_factory=list)  # {"audio": Path, "transcript": str}
    speaker: int | None = None

    @property
    def file_name(self) -> str:
        return f"{self.id}.{self.format}"


def item_seed(item_id: str, base_seed: int = 0) -> int:
    """The seed of an item without its own `seed`: from its id (and the job's base seed), never from a rank."""
    digest = hashlib.sha256(f"{base_seed}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % MAX_SEED


def read_manifest(path: str | os.PathLike, base_seed: int = 0, defaults: dict | None = None) -> list[JobItem]:
    """The items of a manifest, every line checked (fields, types, ids unique, sampling settings by the rules of
    `generate`). Raises `ManifestError` naming the line; reads no text, voice or audio file."""
    from transformers import GenerationConfig

    from .generation_drama3 import DRAMA3_GENERATION_DEFAULTS, generation_settings

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ManifestError(f"cannot read the manifest {str(path)!r}: {error}") from error
    items, seen = [], {}
    base = GenerationConfig(**DRAMA3_GENERATION_DEFAULTS)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ManifestError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        item = _checked_item(entry, where, number, path.parent, base_seed, dict(defaults or {}))
        if item.id in seen:
            raise ManifestError(f"{where}: id {item.id!r} is used on line {seen[item.id]} too; ids must be unique")
        seen[item.id] = number
        try:
            generation_settings(base, **item.settings)
        except (TypeError, ValueError) as error:
            raise ManifestError(f"{where}: {error}") from None
        items.append(item)
    if not items:
        raise ManifestError(f"the manifest {str(path)!r} has no items: write one JSON object per line")
    return items


def _checked_item(entry, where: str, number: int, folder: Path, base_seed: int, settings: dict) -> JobItem:
    if not isinstance(entry, dict):
        raise ManifestError(f"{where}: each line must be a JSON object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise ManifestError(f"{where}: unknown field(s) {unknown}; an item takes {sorted(FIELDS)}")

    def value(name, kinds, what):
        found = entry.get(name)
        if found is not None and (not isinstance(found, kinds) or (kinds is not bool and isinstance(found, bool))):
            raise ManifestError(f"{where}: {name} must be {what}, got {found!r}")
        return found

    item_id = value("id", str, "a string")
    if item_id is None or not ITEM_ID.fullmatch(item_id):
        raise ManifestError(f"{where}: id must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or "
                            f"digit (it names the output file); got {item_id!r}")
    text, text_file = value("text", str, "a string"), value("text_file", str, "a file path")
    if (text is None) == (text_file is None):
        raise ManifestError(f"{where}: give exactly one of text and text_file")
    voices = entry.get("voice") or []
    voices = [voices] if isinstance(voices, str) else voices
    if not isinstance(voices, list) or not all(isinstance(each, str) for each in voices):
        raise ManifestError(f"{where}: voice must be a voice file path or a list of them")
    references = entry.get("references") or []
    if not isinstance(references, list) or not all(
            isinstance(each, dict) and set(each) == {"audio", "transcript"}
            and all(isinstance(each[key], str) for key in each) for each in references):
        raise ManifestError(f"{where}: references must be a list of {{\"audio\": FILE, \"transcript\": TEXT}}")
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
            settings[name] = entry[name]
    if settings.pop("greedy", False):
        settings["do_sample"] = False
    return JobItem(
        id=item_id, line=number, seed=item_seed(item_id, base_seed) if seed is None else seed, format=audio_format,
        settings=settings, fingerprint=hashlib.sha256(json.dumps([entry, settings, base_seed], sort_keys=True).encode())
        .hexdigest()[:16], text=text, text_file=None if text_file is None else folder / text_file,
        voices=[folder / each for each in voices], speaker=speaker,
        references=[{"audio": folder / each["audio"], "transcript": each["transcript"]} for each in references],
    )


@dataclass
class JobPlan:
    """What every rank runs: the batches of pending items (indices into `items`), made the same way everywhere."""

    items: list[JobItem]
    output_dir: Path
    run_id: str
    chunk_bytes: int
    batches: list[list[int]]
    prepared: dict  # item index -> (text, its chunks, references) of the items whose text and voices were read
    failures: dict  # item index -> error of the items that failed before any model work
    skipped: int  # items done by an earlier run


def plan_job(items: list[JobItem], output_dir: str | os.PathLike, processor, *, batch_size: int = 8,
             chunk_bytes: int = 300, sort_by_length: bool = True) -> JobPlan:
    """Read every pending item's text and voice files, check them with `processor`, and cut the items of one chunk
    into batches (by length unless `sort_by_length=False`, never mixing sampling settings); an item of several
    chunks is a batch of its own. Done items are left out. No model is needed (run it before loading one)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be >= {MIN_CHUNK_BYTES}, got {chunk_bytes}")
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"the output folder {str(output_dir)!r} is a file: give a folder (it is created if "
                                 "missing)")
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / RECORDS_FOLDER).mkdir(exist_ok=True)
    done = {record["id"]: record for record in read_records(output_dir) if record.get("status") == "done"}
    prepared, failures, skipped = {}, {}, 0
    for index, item in enumerate(items):
        record = done.get(item.id)
        if record and record.get("fingerprint") == item.fingerprint and (output_dir / item.file_name).is_file():
            skipped += 1
            continue
        for leftover in output_dir.glob(f".{item.file_name}.*.tmp"):  # a write cut short by a kill
            leftover.unlink(missing_ok=True)
        try:
            prepared[index] = _read_item(item, processor, chunk_bytes)
        except (OSError, ValueError, TypeError) as error:
            failures[index] = str(error)
    short = [index for index, (_, chunks, _) in prepared.items() if len(chunks) == 1]
    if sort_by_length:
        short.sort(key=lambda index: (len(prepared[index][1][0].encode()), index))
    groups: dict[str, list[int]] = {}
    for index in short:
        groups.setdefault(json.dumps(items[index].settings, sort_keys=True), []).append(index)
    batches = [[index] for index, (_, chunks, _) in prepared.items() if len(chunks) > 1]
    batches += [members[start : start + batch_size] for members in groups.values()
                for start in range(0, len(members), batch_size)]
    now = time.time_ns()  # run ids sort in time order, so the newest record of an item is read last
    run_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now // 10**9))}.{now % 10**9:09d}-{secrets.token_hex(3)}"
    return JobPlan(items, output_dir, run_id, chunk_bytes, batches, prepared, failures, skipped)


def _read_item(item: JobItem, processor, chunk_bytes: int) -> tuple[str, list[str], list]:
    """(text, its chunks, references) of an item: the text read and checked, voices loaded, recordings checked."""
    text = item.text if item.text_file is None else item.text_file.read_text(encoding="utf-8")
    if item.speaker is not None and not SPEAKER_TAG.match(text.lstrip(WHITE_SPACE)):
        text = f"<|speaker:{item.speaker}|> {text}"
    chunks = processor.split_text(text, max_bytes=chunk_bytes)
    references = [Drama3Voice.load(path) for path in item.voices]
    for number, reference in enumerate(item.references):
        processor.check_text(reference["transcript"], f"references[{number}].transcript")
        processor.check_audio(str(reference["audio"]), where=f"references[{number}]")
    return text, chunks, references + item.references


def read_records(output_dir: Path) -> list[dict]:
    """The records of `results.jsonl` and then of every unmerged record file (later ones win)."""
    files = [output_dir / RESULTS_FILE, *sorted((output_dir / RECORDS_FOLDER).glob("*.jsonl"))]
    return [record for path in files if path.is_file() for record in records_in(path)]


def records_in(path: Path) -> list[dict]:
    """The records of one JSON Lines file; a line cut short (its writer was killed mid-write) is left out."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


@dataclass
class JobSummary:
    """What a run did: items done now, skipped (done before) and failed (their records in results.jsonl say why)."""

    done: int
    skipped: int
    failed: int
    seconds: float
    results: Path


def run_job(model, processor, plan: JobPlan, show_progress: bool = True) -> JobSummary:
    """Run this process's share of `plan` with `model`, then merge the records into `results.jsonl` (on rank 0).

    Under torch.distributed every rank calls it with the same plan: a rank holding a whole model takes every
    world-size-th batch; a model split over all ranks runs every batch on every rank, and rank 0 writes. The ranks
    meet at the end: start the process group with `timeout=JOB_COLLECTIVE_TIMEOUT` (the CLI does).
    """
    distributed = dist.is_available() and dist.is_initialized()
    sharded = parallel.is_sharded(model)
    shares = dist.get_world_size() if distributed and not sharded else 1
    share = dist.get_rank() if shares > 1 else 0
    writer = not sharded or parallel.is_main_process()
    progress = JobProgress(plan, enabled=show_progress and parallel.is_main_process())
    records = plan.output_dir / RECORDS_FOLDER / f"{plan.run_id}-rank{parallel.rank()}.jsonl"
    with open(records, "a", encoding="utf-8") if writer else open(os.devnull, "w") as file:

        def record(index: int, **fields) -> None:
            item = plan.items[index]
            entry = {"id": item.id, "line": item.line, "fingerprint": item.fingerprint, "seed": item.seed,
                     "run": plan.run_id, "rank": parallel.rank(), **fields}
            file.write(json.dumps(entry) + "\n")
            file.flush()  # on disk at once: a kill loses only the batch in flight
            progress.add(entry)
            progress.show()

        if parallel.is_main_process():
            for index, error in plan.failures.items():
                record(index, status="failed", error=error)
        for batch in plan.batches[share::shares]:
            run_batch(model, processor, plan, batch, record, writer)
            progress.count_other_ranks()
    if distributed:
        dist.barrier()
    progress.count_other_ranks()
    progress.close()
    return parallel.run_on_main_process(merge_records, plan)


def run_batch(model, processor, plan: JobPlan, batch: list[int], record, write: bool = True) -> None:
    """Speak the items of `batch`, write their files (when `write`) and `record(index, **fields)` each.

    Reference recordings are encoded first (an item whose encoding fails is recorded as failed); a batch whose
    generation fails is retried item by item, so that a bad item fails alone.
    """
    started = time.perf_counter()
    members, references = [], []
    for index in batch:
        try:
            references.append(encoded_references(processor, plan.prepared[index][2], model.codec))
            members.append(index)
        except (OSError, ValueError, TypeError) as error:
            record(index, status="failed", error=str(error))
    if not members:
        return
    try:
        spoken = speak_batch(model, processor, plan, members, references)
    except (RuntimeError, ValueError, TypeError) as error:  # torch.OutOfMemoryError is a RuntimeError
        if len(members) == 1:
            record(members[0], status="failed", error=f"{type(error).__name__}: {error}")
        else:
            for index in members:
                run_batch(model, processor, plan, [index], record, write)
        return
    taken = (time.perf_counter() - started) / len(members)
    rate = model.config.sampling_rate
    for index, (audio, frames, reason, chunks) in zip(members, spoken):
        item = plan.items[index]
        if write:
            write_audio(plan.output_dir / item.file_name, audio, rate)
        record(index, status="done", file=item.file_name, frames=frames, chunks=chunks, finish_reason=reason,
               seconds=round(audio.shape[0] / rate, 4), time_s=round(taken, 3), batch_size=len(members))


def encoded_references(processor, references: list, codec) -> list:
    """Recordings among `references` (dicts with an audio path) encoded to codes with `codec`; voices as they are."""
    processor = processor.with_codec(codec)
    return [reference if isinstance(reference, Drama3Voice) else
            {"transcript": reference["transcript"],
             "codes": processor.encode_audio(str(reference["audio"]), where=str(reference["audio"]))}
            for reference in references]


def speak_batch(model, processor, plan: JobPlan, members: list[int], references: list) -> list[tuple]:
    """(audio `[samples]`, frames, finish reason, chunks) of each member: one batched `generate` with a seed per
    sequence for items of one chunk, `synthesize` for an item of several (a batch of its own)."""
    items = [plan.items[index] for index in members]
    text, chunks, _ = plan.prepared[members[0]]
    settings = items[0].settings  # the same for every item of a batch (plan_job groups them)
    if len(chunks) > 1:
        speech = synthesize(model, processor, text, references[0], chunk_bytes=plan.chunk_bytes,
                            seed=items[0].seed, show_progress=False, **settings)
        cut = [reason for reason in speech.finish_reasons if reason != "eos"]
        return [(speech.audio, speech.num_frames, (cut or ["eos"])[0], len(speech.texts))]
    inputs = processor([plan.prepared[index][1][0] for index in members], references=references)
    device = model.input_device
    output = model.generate(inputs["input_ids"].to(device), inputs["attention_mask"].to(device),
                            seed=[item.seed for item in items], **settings)
    return [(audio.float().cpu(), codes.shape[1], reason, 1)
            for audio, codes, reason in zip(output.audio, output.codes, output.finish_reason)]


class JobProgress:
    """One bar for the whole job on rank 0: the items every rank of this run has recorded (the other ranks' are read
    from their record files after each batch, each file from where the last read stopped), the seconds of audio
    made, and tqdm's ETA."""

    def __init__(self, plan: JobPlan, enabled: bool):
        self.plan, self.enabled = plan, enabled
        self.bar = tqdm(total=len(plan.prepared) + len(plan.failures), unit="item", disable=not enabled)
        self.items, self.seconds = 0, 0.0
        self.read_to: dict[Path, int] = {}  # another rank's record file -> the bytes of it counted so far

    def add(self, entry: dict) -> None:
        self.items, self.seconds = self.items + 1, self.seconds + entry.get("seconds", 0.0)

    def count_other_ranks(self) -> None:
        if not self.enabled:
            return
        mine = f"{self.plan.run_id}-rank{parallel.rank()}.jsonl"
        for path in (self.plan.output_dir / RECORDS_FOLDER).glob(f"{self.plan.run_id}-rank*.jsonl"):
            if path.name == mine:
                continue
            with open(path, "rb") as file:
                file.seek(self.read_to.get(path, 0))
                complete = file.read().rpartition(b"\n")[0]  # whole lines only: a rank may be writing one
            if complete:
                self.read_to[path] = self.read_to.get(path, 0) + len(complete) + 1
                for line in complete.decode("utf-8").splitlines():
                    self.add(json.loads(line))
        self.show()

    def show(self) -> None:
        self.bar.n = self.items
        self.bar.set_postfix_str(f"{self.seconds:.1f} s of audio", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def merge_records(plan: JobPlan) -> JobSummary:
    """Write `results.jsonl` (atomically): the latest record of each manifest item, in manifest order; then remove
    the record files merged into it. Counts what this run did."""
    latest = {record["id"]: record for record in read_records(plan.output_dir)}
    merged = [latest[item.id] for item in plan.items if item.id in latest]
    folder = plan.output_dir / RECORDS_FOLDER
    parts = sorted(folder.glob("*.jsonl"))
    results = plan.output_dir / RESULTS_FILE
    write_atomically(results, lambda file: file.write("".join(json.dumps(r) + "\n" for r in merged).encode()))
    for path in parts:
        path.unlink(missing_ok=True)
    this_run = [record for record in merged if record.get("run") == plan.run_id]
    done = [record for record in this_run if record["status"] == "done"]
    failed = sum(record["status"] == "failed" for record in merged)
    return JobSummary(done=len(done), skipped=plan.skipped, failed=failed,
                      seconds=sum(record["seconds"] for record in done), results=results)


def run_manifest(model, processor, manifest: str | os.PathLike, output_dir: str | os.PathLike, *, seed: int = 0,
                 batch_size: int = 8, chunk_bytes: int = 300, sort_by_length: bool = True, show_progress: bool = True,
                 **generate_kwargs) -> JobSummary:
    """Speak every item of the manifest file into `output_dir`: the Python form of `drama3-tts --manifest`.

    `seed`: the job's base seed, from which each item without its own `seed` gets one (with its id).
    `generate_kwargs`: sampling settings for every item that does not set its own. Under torch.distributed, call it
    on every rank (rank 0 reads and plans). Returns a `JobSummary`; failed items are in `results.jsonl` with their
    errors, and a rerun retries them.
    """
    def plan() -> JobPlan:
        items = read_manifest(manifest, seed, generate_kwargs)
        return plan_job(items, output_dir, processor, batch_size=batch_size, chunk_bytes=chunk_bytes,
                        sort_by_length=sort_by_length)

    return run_job(model, processor, parallel.run_on_main_process(plan), show_progress=show_progress)


__all__ = ["JOB_COLLECTIVE_TIMEOUT", "JobItem", "JobPlan", "JobProgress", "JobSummary", "ManifestError", "encoded_references", "item_seed",
           "merge_records", "plan_job", "read_manifest", "read_records", "records_in", "run_batch", "run_job",
           "run_manifest", "speak_batch"]
