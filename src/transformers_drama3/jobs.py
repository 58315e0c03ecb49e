"""Jobs: many texts spoken into many files, resumable, batched by length, over any number of ranks
(docs/scaling.md). The items come from a manifest or a 🤗 dataset (`jobs_items.py`); this module runs them.

    drama3-tts --model DIR --manifest jobs.jsonl --output-dir out/
    drama3-tts --model DIR --dataset texts.parquet --text-column text --output-dataset out/
    accelerate launch --num_processes 8 -m transformers_drama3.cli --model DIR --manifest jobs.jsonl --output-dir out/

What a run does:
- `plan_job` (no model needed) reads and checks every pending item's text, voice files and recordings, all of them,
  and raises one `ManifestError` naming every bad item; then it cuts the items into batches;
- `run_job`: each item becomes `DIR/ID.FORMAT`, written atomically, and one record (frames, seconds, finish reason,
  time) in `DIR/results.jsonl`; an item whose record says done, whose file exists and whose line is unchanged is
  skipped on a rerun;
- an item that fails while it runs (a recording that cannot be decoded, text the model refuses, out of memory) gets
  a record with its error; the job goes on, and a rerun tries it again;
- items of one chunk are batched by length (the same sampling settings in a batch) through `generate` with one seed
  per sequence, so each item gets the audio it gets alone; text of several chunks goes through `synthesize`;
- under torch.distributed (`torchrun`, `accelerate launch`) rank 0 reads the items and forms the batches; ranks with
  a whole model each claim the next unclaimed batch (a file created atomically per batch), so work follows speed; a
  model split over all ranks runs every batch. An item's seed comes from its id (or its `seed`), never from the rank,
  so its audio is the same whatever the number of ranks;
- every finished item is appended at once to this process's record file in `DIR/.drama3-jobs/`, so a crash or a kill
  loses only the batches in flight; at the end rank 0 merges the record files into `results.jsonl`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from tqdm.auto import tqdm

from . import parallel
from .audio_io import write_atomically, write_audio
from .chunking import MIN_CHUNK_BYTES
from .jobs_items import JobItem, problems_error, read_manifest
from .speaker_tags import SPEAKER_TAG, WHITE_SPACE
from .synthesis import synthesize
from .voice import Drama3Voice

RESULTS_FILE = "results.jsonl"
RECORDS_FOLDER = ".drama3-jobs"  # per-process record files of runs not merged yet, and the runs' claim folders
# How long a rank waits for the others at the end of a job (torch's default, 30 minutes, is shorter than the last
# batch of a rank can take on a big job): give it to `torch.distributed.init_process_group(timeout=...)`.
JOB_COLLECTIVE_TIMEOUT = timedelta(hours=24)


@dataclass
class JobPlan:
    """What every rank runs: the batches of pending items (indices into `items`), made the same way everywhere."""

    items: list[JobItem]
    output_dir: Path
    run_id: str
    chunk_bytes: int
    batches: list[list[int]]
    prepared: dict  # item index -> (text, its chunks, references) of the pending items
    skipped: int  # items done by an earlier run

    @property
    def claims(self) -> Path:
        """The folder where the ranks of this run claim batches (one empty file per batch, made atomically)."""
        return self.output_dir / RECORDS_FOLDER / f"{self.run_id}.claims"


def plan_job(items: list[JobItem], output_dir: str | os.PathLike, processor, *, batch_size: int = 8,
             chunk_bytes: int = 300, sort_by_length: bool = True, shares: int = 1, problems=()) -> JobPlan:
    """Read every pending item's text and voice files, check them with `processor` (every problem of every item in
    one `ManifestError`, with the `problems` of lines or rows that made no item), and cut the items of one chunk
    into batches (by length unless `sort_by_length=False`, never mixing sampling settings); an item of several
    chunks is a batch of its own. With `shares` model copies (data parallel ranks) a group's batches are made small
    enough that every copy gets one. Done items are left out. No model is needed (run it before loading one)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be >= {MIN_CHUNK_BYTES}, got {chunk_bytes}")
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"the output folder {str(output_dir)!r} is a file: give a folder (it is created if "
                                 "missing)")
    done = {record["id"]: record for record in read_records(output_dir) if record.get("status") == "done"}
    pending = [index for index, item in enumerate(items) if not (
        done.get(item.id, {}).get("fingerprint") == item.fingerprint and (output_dir / item.file_name).is_file())]
    prepared = read_items(items, pending, processor, chunk_bytes, problems)
    skipped = len(items) - len(pending)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / RECORDS_FOLDER).mkdir(exist_ok=True)
    for index in prepared:
        for leftover in output_dir.glob(f".{items[index].file_name}.*.tmp"):  # a write cut short by a kill
            leftover.unlink(missing_ok=True)
    batches = batches_of(items, prepared, batch_size, sort_by_length, shares)
    now = time.time_ns()  # run ids sort in time order, so the newest record of an item is read last
    run_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now // 10**9))}.{now % 10**9:09d}-{secrets.token_hex(3)}"
    return JobPlan(items, output_dir, run_id, chunk_bytes, batches, prepared, skipped)


def batches_of(items: list[JobItem], prepared: dict, batch_size: int, sort_by_length: bool = True,
               shares: int = 1) -> list[list[int]]:
    """The prepared items (index -> `read_item`'s result) cut into batches: an item of several chunks alone; items
    of one chunk by length (unless `sort_by_length=False`), at most `batch_size` and only the same sampling
    settings together, and small enough that each of `shares` model copies gets a batch."""
    short = [index for index, (_, chunks, _) in prepared.items() if len(chunks) == 1]
    if sort_by_length:
        short.sort(key=lambda index: (len(prepared[index][1][0].encode()), index))
    groups: dict[str, list[int]] = {}
    for index in short:
        groups.setdefault(json.dumps(items[index].settings, sort_keys=True), []).append(index)
    batches = [[index] for index, (_, chunks, _) in prepared.items() if len(chunks) > 1]
    for members in groups.values():
        size = min(batch_size, math.ceil(len(members) / shares))
        batches += [members[start : start + size] for start in range(0, len(members), size)]
    return batches


def read_items(items: list[JobItem], pending, processor, chunk_bytes: int, problems=(),
               what: str = "the job's items") -> dict:
    """`read_item` of each pending item (indices into `items`): index -> (text, its chunks, references). Raises
    one `ManifestError` with every item's problem and the earlier `problems` (of lines or rows that made no item,
    in `what`)."""
    prepared, found = {}, list(problems)
    for index in pending:
        try:
            prepared[index] = read_item(items[index], processor, chunk_bytes)
        except (OSError, ValueError, TypeError) as error:
            found.append(f"{items[index].where} (id {items[index].id}): {error}")
    if found:
        raise problems_error(found, what)
    return prepared


def read_item(item: JobItem, processor, chunk_bytes: int) -> tuple[str, list[str], list]:
    """(text, its chunks, references) of an item: the text read and checked (no control tokens), voice files
    loaded, recordings checked (their headers read)."""
    text = item.text if item.text_file is None else item.text_file.read_text(encoding="utf-8")
    if item.speaker is not None and not SPEAKER_TAG.match(text.lstrip(WHITE_SPACE)):
        text = f"<|speaker:{item.speaker}|> {text}"
    chunks = processor.split_text(text, max_bytes=chunk_bytes)
    references = [Drama3Voice.load(path) for path in item.voices]
    for number, reference in enumerate(item.references):
        processor.check_text(reference["transcript"], f"references[{number}].transcript")
        processor.check_audio(reference["audio"], where=f"references[{number}]")
    return text, chunks, references + item.references


def read_records(output_dir: Path) -> list[dict]:
    """The records of `results.jsonl` and then of every unmerged record file (later ones win)."""
    files = [output_dir / RESULTS_FILE, *sorted((output_dir / RECORDS_FOLDER).glob("*.jsonl"))]  # [] if missing
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
    failed_ids: list[str]


def copies_of_model(model) -> int:
    """How many processes hold a whole copy of `model` and share a job's batches: the world size under
    torch.distributed (torchrun, `accelerate launch`), 1 alone or with a model split over the ranks."""
    distributed = dist.is_available() and dist.is_initialized()
    return dist.get_world_size() if distributed and not parallel.is_sharded(model) else 1


def claim(path: Path) -> bool:
    """Whether this process is the first to claim `path` (made with O_CREAT | O_EXCL: atomic, also on NFS >= 3)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def run_job(model, processor, plan: JobPlan, show_progress: bool = True) -> JobSummary:
    """Run `plan` with `model`, then merge the records into `results.jsonl` (on rank 0).

    Under torch.distributed every rank calls it with the same plan. Ranks holding a whole model share the batches
    dynamically: rank r starts with batch r, then each takes the next batch no other rank has claimed (`claim`, a
    file per batch in `plan.claims`), so a fast rank takes more and a slow one fewer. A model split over all ranks
    runs every batch on every rank, and rank 0 writes. The ranks meet at the start and the end: start the process
    group with `timeout=JOB_COLLECTIVE_TIMEOUT` (the CLI does).
    """
    distributed = dist.is_available() and dist.is_initialized()
    copies = copies_of_model(model)
    shared = copies > 1
    writer = shared or not parallel.is_sharded(model) or parallel.is_main_process()
    progress = JobProgress(plan, enabled=show_progress and parallel.is_main_process())
    records = plan.output_dir / RECORDS_FOLDER / f"{plan.run_id}-rank{parallel.rank()}.jsonl"
    if parallel.is_main_process():
        plan.claims.mkdir(exist_ok=True)
    if distributed:
        dist.barrier()  # every rank loaded and ready: none takes every batch while another is still loading
    sink = open(records, "a", encoding="utf-8") if writer else open(os.devnull, "w")
    with contextlib.closing(progress), sink as file:  # the bar closed on the way out, an interrupted run's too

        def record(index: int, **fields) -> None:
            item = plan.items[index]
            entry = {"id": item.id, "line": item.line, "fingerprint": item.fingerprint, "seed": item.seed,
                     "run": plan.run_id, "rank": parallel.rank(), **fields}
            file.write(json.dumps(entry) + "\n")
            file.flush()  # on disk at once: a kill loses only the batch in flight
            progress.add(entry)
            progress.show()

        for number, batch in enumerate(plan.batches):
            # Batch r is rank r's first (every rank starts at once, however late it got here); then each takes the
            # next one nobody has claimed.
            mine = not shared or (number == parallel.rank() if number < copies else claim(plan.claims / str(number)))
            if not mine:
                continue
            run_batch(model, processor, plan, batch, record, writer, show_progress=progress.enabled)
            progress.count_other_ranks()
        if distributed:
            dist.barrier()
        progress.count_other_ranks()
    return parallel.run_on_main_process(merge_records, plan)


def run_batch(model, processor, plan: JobPlan, batch: list[int], record, write: bool = True,
              show_progress: bool = False) -> None:
    """Speak the items of `batch`, write their files (when `write`) and `record(index, **fields)` each; with
    `show_progress`, an item of several chunks has a progress bar over its chunks.

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
        spoken = speak_batch(model, processor, [plan.items[index] for index in members],
                             [plan.prepared[index] for index in members], references, plan.chunk_bytes, show_progress)
    except (RuntimeError, ValueError, TypeError) as error:  # torch.OutOfMemoryError is a RuntimeError
        if len(members) == 1:
            record(members[0], status="failed", error=f"{type(error).__name__}: {error}")
        else:
            for index in members:
                run_batch(model, processor, plan, [index], record, write, show_progress)
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
    """Recordings among `references` (dicts with an audio path) encoded to codes with `codec`; voices and references
    already encoded (dicts with `codes`, as a Ray job's CPU stage makes them) as they are."""
    processor = processor.with_codec(codec)
    return [reference if isinstance(reference, Drama3Voice) or "codes" in reference else
            {"transcript": reference["transcript"],
             "codes": processor.encode_audio(reference["audio"], where="reference audio")}
            for reference in references]


def speak_batch(model, processor, items: list[JobItem], prepared: list[tuple], references: list,
                chunk_bytes: int, show_progress: bool = False) -> list[tuple]:
    """(audio `[samples]`, frames, finish reason, chunks) of each item (`prepared`: `read_item`'s results,
    `references`: `encoded_references`'): one batched `generate` with a seed per sequence for items of one chunk
    and the same settings, `synthesize` for an item of several (a batch of its own; with `show_progress`, a bar
    over its chunks)."""
    text, chunks, _ = prepared[0]
    settings = items[0].settings  # the same for every item of a batch (plan_job groups them)
    if len(chunks) > 1:
        speech = synthesize(model, processor, text, references[0], chunk_bytes=chunk_bytes,
                            seed=items[0].seed, show_progress=show_progress, **settings)
        cut = [reason for reason in speech.finish_reasons if reason != "eos"]
        return [(speech.audio, speech.num_frames, (cut or ["eos"])[0], len(speech.texts))]
    inputs = processor([each[1][0] for each in prepared], references=references)
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
        self.bar = tqdm(total=len(plan.prepared), unit="item", disable=not enabled)
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
    shutil.rmtree(plan.claims, ignore_errors=True)
    this_run = [record for record in merged if record.get("run") == plan.run_id]
    done = [record for record in this_run if record["status"] == "done"]
    failed = [record["id"] for record in merged if record["status"] == "failed"]
    return JobSummary(done=len(done), skipped=plan.skipped, failed=len(failed),
                      seconds=sum(record["seconds"] for record in done), results=results, failed_ids=failed)


def run_items(model, processor, items, output_dir: str | os.PathLike, *, batch_size: int = 8,
              chunk_bytes: int = 300, sort_by_length: bool = True, show_progress: bool = True) -> JobSummary:
    """Plan (`plan_job`, on rank 0) and run (`run_job`) a job's items into `output_dir`: what every kind of job
    does once its items are read. `items`: a list of `JobItem`, or a function making it (run on rank 0 only)."""
    shares = copies_of_model(model)

    def plan() -> JobPlan:
        listed = items() if callable(items) else items
        return plan_job(listed, output_dir, processor, batch_size=batch_size, chunk_bytes=chunk_bytes,
                        sort_by_length=sort_by_length, shares=shares)

    return run_job(model, processor, parallel.run_on_main_process(plan), show_progress=show_progress)


def run_manifest(model, processor, manifest: str | os.PathLike, output_dir: str | os.PathLike, *, seed: int = 0,
                 batch_size: int = 8, chunk_bytes: int = 300, sort_by_length: bool = True, show_progress: bool = True,
                 **generate_kwargs) -> JobSummary:
    """Speak every item of the manifest file into `output_dir`: the Python form of `drama3-tts --manifest`.

    `seed`: the job's base seed, from which each item without its own `seed` gets one (with its id).
    `generate_kwargs`: sampling settings for every item that does not set its own. Under torch.distributed, call it
    on every rank (rank 0 reads and plans). Every problem of the manifest and of its items' files is raised at once
    (`ManifestError`) before any model work. Returns a `JobSummary`; items that failed while running are in
    `results.jsonl` with their errors, and a rerun retries them.
    """
    return run_items(model, processor, lambda: read_manifest(manifest, seed, generate_kwargs), output_dir,
                     batch_size=batch_size, chunk_bytes=chunk_bytes, sort_by_length=sort_by_length,
                     show_progress=show_progress)


__all__ = ["JOB_COLLECTIVE_TIMEOUT", "RECORDS_FOLDER", "RESULTS_FILE", "JobPlan", "JobProgress", "JobSummary",
           "batches_of", "claim", "copies_of_model", "encoded_references", "merge_records", "plan_job", "read_item",
           "read_items", "read_records", "records_in", "run_batch", "run_items", "run_job", "run_manifest",
           "speak_batch"]
