"""Ray Data across machines (`pip install transformers-drama3[ray]`, docs/scaling.md): a job in two stages, each a
callable class for `Dataset.map_batches`, and `drama3-ray`, the command that checks every row on the driver, then
runs read -> encode references (CPU actors) -> generate (GPU actors) -> write parquet for the rows not made yet, and
assembles the audio dataset in the rows' order.

    ds = ray.data.read_parquet("texts/")
    ds = ds.map_batches(ReferenceEncoder, fn_constructor_kwargs=settings, batch_format="pyarrow", batch_size=16,
                        compute=ActorPoolStrategy(size=4), num_cpus=1)
    ds = ds.map_batches(Drama3Predictor, fn_constructor_kwargs=settings, batch_format="pyarrow", batch_size=16,
                        compute=ActorPoolStrategy(size=8), num_gpus=1)
    ds.write_parquet("speech/")

A row is an item as in every other job (`row_item`: `jobs_items.row_entry`, `checked_items`) and is spoken by the
same batch code (`jobs.run_batch`, each row's file written as the plain job writes it, then stored as bytes), so a
row gets the same audio bytes as in `drama3-tts --dataset` for the same id, seed and settings. Its reference
recordings are encoded by the plain job's own function (`jobs.encoded_references`), once, on a CPU worker: the GPU
actors get codes and hold no codec encoder. In the stages alone, a row without an id column is named by its content
(`row-` and a hash of its mapped values), which Ray cannot reorder; `drama3-ray` gives such rows the ids of
`drama3-tts --dataset` (`row` and the index) before they reach Ray. A row that cannot be spoken (bad text, a missing
file, a recording that cannot be decoded) gets its `error` and no audio: it is recorded, not retried. Ray itself
retries what dies: an actor that is killed is restarted and its batch is run again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from .jobs_dataset import OUTPUT_COLUMNS
from .jobs_items import JobItem, ManifestError, canonical_json, checked_items, item_columns, row_entry

RAY_HINT = "Ray Data is not installed: pip install 'transformers-drama3[ray]'"
FINGERPRINT = "fingerprint"  # an output column: the row's fingerprint, by which a rerun finds rows already made
RAY_COLUMNS = (*OUTPUT_COLUMNS, FINGERPRINT)
REFERENCE_CODES = "reference_codes"  # ReferenceEncoder -> Drama3Predictor: [{"transcript", "codes" [K][frames]}]
STAGE_COLUMNS = (FINGERPRINT, REFERENCE_CODES, "error")  # what ReferenceEncoder adds
RAY_FOLDER = "ray"  # OUT/ray/: the rows as Ray wrote them (parquet), what a rerun resumes from
ROW_ID = "drama3_row_id"  # the ids drama3-ray gives rows without an id column (those of drama3-tts --dataset)
ROW_ERROR = (ManifestError, OSError, ValueError, TypeError)  # what a row's own input can raise


def row_item(row: dict, columns: dict, dialogue_column: str | None, folder: Path, seed: int,
             defaults: dict) -> JobItem:
    """A row -> its checked item (`ManifestError` if it cannot be one). Without an `id` column the id is `row-` and
    16 hex digits of the hash of the row's mapped values, so the same row gets the same id, seed and fingerprint
    in every run, wherever Ray puts it."""
    entry = row_entry(row, columns, dialogue_column, "")
    if "id" not in columns:
        content = canonical_json({name: value for name, value in entry.items() if name != "id"})
        entry["id"] = "row-" + hashlib.sha256(content.encode()).hexdigest()[:16]
    return checked_items([(f"id {entry['id'] or '(none)'}", 0, entry)], folder, seed, defaults)[0]


class RowSettings:
    """The settings both stages read rows by (those of `run_dataset`): `columns` maps item fields to columns
    (`{"text": "text"}` by default), `dialogue_column` a column of turns, relative paths are relative to `folder`,
    `seed` is the base seed and `generate_kwargs` the default sampling settings."""

    def __init__(self, columns: dict | None, dialogue_column: str | None, folder, seed: int, chunk_bytes: int,
                 generate_kwargs: dict):
        self.columns = item_columns(columns, dialogue_column)
        self.dialogue_column, self.folder, self.seed = dialogue_column, Path(folder), seed
        self.chunk_bytes, self.defaults = chunk_bytes, generate_kwargs

    def item(self, row: dict) -> JobItem:
        return row_item(row, self.columns, self.dialogue_column, self.folder, self.seed, self.defaults)


class ReferenceEncoder:
    """Stage 1, on CPU workers (`map_batches(..., num_cpus=1)`): each row checked as an item (its text, voice files
    and recordings, as `plan_job` checks them), rows whose fingerprint is in `done` left out, and the row's reference
    recordings encoded to codec codes. Adds `fingerprint`, `reference_codes` and `error` (why the row cannot be
    spoken, or None). The codec is loaded once per worker, on the CPU in float32, from the checkpoint's `codec.pth`
    alone (no backbone); `model` and the row settings are those of `Drama3Predictor`."""

    def __init__(self, model: str, *, columns: dict | None = None, dialogue_column: str | None = None,
                 folder: str | os.PathLike = ".", seed: int = 0, chunk_bytes: int = 300, done=(), **generate_kwargs):
        from transformers import AutoConfig

        from .checkpoint_location import checkpoint_directory
        from .codec_file import CODEC_FILE
        from .modeling_codec import FishDACCodec
        from .processing_drama3 import Drama3Processor

        path = checkpoint_directory(model)
        self.codec = FishDACCodec.from_codec_file(os.path.join(path, CODEC_FILE),
                                                  AutoConfig.from_pretrained(path).codec_config)
        self.processor = Drama3Processor.from_pretrained(path)
        self.rows = RowSettings(columns, dialogue_column, folder, seed, chunk_bytes, generate_kwargs)
        self.done = frozenset(done)

    def __call__(self, batch):
        import pyarrow as pa

        from .jobs import encoded_references, read_item

        check_pyarrow(batch, type(self).__name__)
        kept, fingerprints, codes, errors = [], [], [], []
        for index, row in enumerate(batch.to_pylist()):
            try:
                item = self.rows.item(row)
            except ROW_ERROR as error:
                item, problem = None, str(error)
            else:
                if item.fingerprint in self.done:
                    continue
                try:
                    read_item(item, self.processor, self.rows.chunk_bytes)  # the checks of plan_job
                    encoded = encoded_references(self.processor, item.references, self.codec)
                    problem = None
                except ROW_ERROR as error:
                    encoded, problem = [], f"{item.where}: {error}"
            kept.append(index)
            fingerprints.append(None if item is None else item.fingerprint)
            codes.append([{"transcript": each["transcript"], "codes": each["codes"].tolist()} for each in encoded]
                         if problem is None else None)
            errors.append(problem)
        reference = pa.struct([("transcript", pa.string()), ("codes", pa.list_(pa.list_(pa.int32())))])
        made = batch.take(pa.array(kept, type=pa.int64())).drop_columns(
            [name for name in STAGE_COLUMNS if name in batch.column_names])
        made = made.append_column(FINGERPRINT, pa.array(fingerprints, type=pa.string()))
        made = made.append_column(REFERENCE_CODES, pa.array(codes, type=pa.list_(reference)))
        return made.append_column("error", pa.array(errors, type=pa.string()))


class Drama3Predictor:
    """Stage 2, on GPU actors (`map_batches(..., num_gpus=1)`): the rows `ReferenceEncoder` made in; the same rows
    plus `audio` ({"bytes", "path"}: the file a plain job writes), `frames`, `finish_reason`, `seed`, `error` and
    `fingerprint` out (`reference_codes` left out).

    `model`: a checkpoint directory or Hub id, loaded once per actor (on `device`, "auto": the GPU Ray gave the
    actor, else the CPU), without keeping the codec's encoder. `columns`, `dialogue_column`, `folder`, `seed`,
    `chunk_bytes` and `generate_kwargs` are those of `run_dataset` (and of `ReferenceEncoder`); `batch_size`:
    sequences generated together.
    """

    def __init__(self, model: str, *, columns: dict | None = None, dialogue_column: str | None = None,
                 folder: str | os.PathLike = ".", seed: int = 0, batch_size: int = 8, chunk_bytes: int = 300,
                 device: str = "auto", dtype: str = "auto", **generate_kwargs):
        from .checkpoint_location import checkpoint_directory
        from .loading import load_model, resolve_device_and_dtype
        from .processing_drama3 import Drama3Processor

        path = checkpoint_directory(model)
        device, dtype = resolve_device_and_dtype(device, dtype)
        self.model = load_model(path, device, dtype)
        self.model.codec.encoder = None  # references come as codes from ReferenceEncoder: the encoder is not kept
        self.processor = Drama3Processor.from_pretrained(path)
        self.rows = RowSettings(columns, dialogue_column, folder, seed, chunk_bytes, generate_kwargs)
        self.batch_size = batch_size

    def __call__(self, batch):
        import pyarrow as pa

        from .jobs import JobPlan, batches_of, read_item, run_batch

        check_pyarrow(batch, type(self).__name__)
        if REFERENCE_CODES not in batch.column_names:
            raise ValueError("Drama3Predictor takes the rows ReferenceEncoder made: map_batches(ReferenceEncoder, ...) "
                             "checks them and encodes their recordings on CPU workers, then map_batches("
                             "Drama3Predictor, ...) (or speech_pipeline, which builds both)")
        rows, items, prepared, errors, records = batch.to_pylist(), {}, {}, {}, {}
        for index, row in enumerate(rows):
            if row["error"] is not None:  # ReferenceEncoder found it bad
                errors[index] = row["error"]
                continue
            try:
                item = self.rows.item(row)
                text, chunks, voices = read_item(replace(item, references=[]), self.processor, self.rows.chunk_bytes)
                prepared[index] = (text, chunks, voices + row[REFERENCE_CODES])
                items[index] = item
            except ROW_ERROR as error:
                errors[index] = str(error)
        listed = [items.get(index) for index in range(len(rows))]  # run_batch names items by their row index
        with tempfile.TemporaryDirectory(prefix="drama3-ray-") as folder:
            plan = JobPlan(listed, Path(folder), "ray", self.rows.chunk_bytes, [], prepared, 0)
            for members in batches_of(listed, prepared, self.batch_size):
                run_batch(self.model, self.processor, plan, members,
                          lambda index, **fields: records.__setitem__(index, fields))
            files = {index: (Path(folder) / items[index].file_name).read_bytes() for index in items
                     if records.get(index, {}).get("status") == "done"}
        columns = {name: [] for name in RAY_COLUMNS}
        for index, row in enumerate(rows):
            item, record = items.get(index), records.get(index, {})
            done = index in files
            columns["audio"].append({"bytes": files[index], "path": item.file_name} if done else None)
            columns["frames"].append(record.get("frames"))
            columns["finish_reason"].append(record.get("finish_reason"))
            columns["seed"].append(None if item is None else item.seed)
            columns["error"].append(None if done else errors.get(index) or record.get("error"))
            columns[FINGERPRINT].append(row.get(FINGERPRINT) if item is None else item.fingerprint)
        types = {"audio": pa.struct([("bytes", pa.binary()), ("path", pa.string())]), "frames": pa.int32(),
                 "finish_reason": pa.string(), "seed": pa.int64(), "error": pa.string(), FINGERPRINT: pa.string()}
        kept = batch.drop_columns([name for name in (*RAY_COLUMNS, REFERENCE_CODES) if name in batch.column_names])
        for name in RAY_COLUMNS:
            kept = kept.append_column(name, pa.array(columns[name], type=types[name]))
        return kept


def check_pyarrow(batch, stage: str) -> None:
    import pyarrow as pa

    if not isinstance(batch, pa.Table):
        raise TypeError(f"{stage} takes pyarrow batches: map_batches({stage}, batch_format=\"pyarrow\", ...); got "
                        f"{type(batch).__name__}")


def speech_pipeline(rows, model: str, *, done=(), batch_size: int = 16, concurrency: int = 1,
                    num_gpus: float = 0, encoders: int = 1, encoder_cpus: float = 1, device: str = "auto",
                    **settings):
    """The Ray dataset of a job's results: `rows` -> `ReferenceEncoder` on `encoders` CPU actors (`encoder_cpus`
    each; rows whose fingerprint is in `done` left out) -> `Drama3Predictor` on `concurrency` actors with `num_gpus`
    GPUs and one CPU each (the CPU that drives its GPU). `settings`: the row settings of both stages."""
    from ray.data import ActorPoolStrategy

    coded = rows.map_batches(ReferenceEncoder, batch_format="pyarrow", batch_size=batch_size,
                             compute=ActorPoolStrategy(size=encoders), num_cpus=encoder_cpus,
                             fn_constructor_kwargs={"model": model, "done": done, **settings})
    return coded.map_batches(Drama3Predictor, batch_format="pyarrow", batch_size=batch_size,
                             compute=ActorPoolStrategy(size=concurrency), num_gpus=num_gpus, num_cpus=1,
                             fn_constructor_kwargs={"model": model, "device": device, "batch_size": batch_size,
                                                    **settings})


def written_fingerprints(parts: Path) -> set[str]:
    """The fingerprints of the rows earlier runs spoke into `parts` (parquet files), after tidying it so that a
    rerun makes each row once: a file cut short (a kill mid-write) is removed, and rows that failed are taken out of
    their file (rewritten atomically), so they are tried again. Raises `ManifestError` for a folder whose parquet
    files are not a drama3-ray output."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    done: set[str] = set()
    for path in sorted(parts.glob("*.parquet")) if parts.is_dir() else []:
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError):  # no footer: its writer was killed
            path.unlink()
            continue
        if FINGERPRINT not in table.column_names:
            raise ManifestError(f"{str(path)!r} has no {FINGERPRINT} column: --output must be a new folder or one "
                                "that drama3-ray wrote")
        spoken = table.filter(pc.is_null(table["error"]))
        if spoken.num_rows < table.num_rows:
            temporary = path.with_name(f".{path.name}.tmp")
            pq.write_table(spoken, temporary)
            os.replace(temporary, path)
        done.update(spoken[FINGERPRINT].to_pylist())
    return done


def part_results(parts: Path, cache_dir: Path):
    """The results in `parts` (a drama3-ray output's parquet files), as `jobs_dataset.audio_dataset` takes them:
    item -> (its row: `frames`, `finish_reason`, `error`; the audio file's bytes or None), found by the item's
    fingerprint. The files are read through 🤗 datasets into `cache_dir` (memory-mapped, so the audio of a big
    job need not fit in memory)."""
    import datasets

    files = sorted(str(path) for path in parts.glob("*.parquet"))
    if not files:
        return lambda item: ({"error": "not run"}, None)
    table = datasets.Dataset.from_parquet(files, columns=[FINGERPRINT, "audio", "frames", "finish_reason", "error"],
                                          cache_dir=str(cache_dir))
    position = {fingerprint: index for index, fingerprint in enumerate(table[FINGERPRINT])}

    def result(item: JobItem) -> tuple[dict, bytes | None]:
        if item.fingerprint not in position:
            return {"error": "not run"}, None
        row = table[position[item.fingerprint]]
        return row, None if row["audio"] is None else row["audio"]["bytes"]

    return result


def local_cluster_cpus(actors: int) -> int:
    """The CPUs of a local Ray cluster for a job with `actors` actors of one CPU each: the machine's cores, and at
    least one more than the actors hold, so that reading and writing always get one (Ray's CPUs are scheduling
    slots: with every slot held by an actor, the read task waits forever)."""
    return max(os.cpu_count() or 1, actors + 1)


def start_ray(ray, args: argparse.Namespace) -> bool:
    """Join the cluster at --address (or RAY_ADDRESS), or start a local one sized by `local_cluster_cpus`; a local
    one without the GPUs the actors ask for is refused before it starts (they would wait for them forever). Whether
    Ray was started here (and is to be shut down)."""
    import torch

    threads = {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]} if "OMP_NUM_THREADS" in os.environ else {}
    runtime = {"env_vars": threads}  # the actors' thread count, on every node
    if ray.is_initialized():  # a caller started Ray with its own settings
        return False
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=runtime)
        return True
    gpus, wanted = torch.cuda.device_count(), args.concurrency * args.num_gpus
    if gpus < wanted:
        raise ManifestError(f"--concurrency {args.concurrency} x --num-gpus {args.num_gpus:g} asks for {wanted:g} "
                            f"GPUs, and this machine has {gpus}: ask for fewer, or give --address of a cluster")
    cpus = local_cluster_cpus(args.encoders + args.concurrency)
    ray.init(address="local", num_cpus=cpus, runtime_env=runtime)
    print(f"drama3-ray: a local Ray cluster of {cpus} CPUs ({args.encoders + args.concurrency} for the actors, the "
          "rest for reading and writing)", file=sys.stderr)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drama3-ray", description="Speak every row of a dataset on a Ray cluster: every row checked here "
        "first, then read -> encode references (CPU actors) -> generate (actors that load the model once each) -> "
        "an audio dataset in the rows' order; a rerun into the same output makes only the rows missing or failed "
        "(docs/scaling.md).")
    parser.add_argument("source", help="a .parquet/.json/.jsonl/.csv file, a dataset folder (save_to_disk) or a Hub "
                        "id, as drama3-tts --dataset reads")
    parser.add_argument("--split", default="train", help="the dataset's split (default train)")
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id")
    parser.add_argument("--output", required=True, type=Path,
                        help=f"the output folder: the audio dataset, and the rows as Ray wrote them in "
                        f"OUT/{RAY_FOLDER}/")
    parser.add_argument("--dataset-format", choices=["arrow", "parquet"], default="parquet",
                        help="the audio dataset as parquet shards in OUT/data/ (default) or save_to_disk shards")
    parser.add_argument("--num-shards", type=int, metavar="N", help="shards of the audio dataset (default: by size)")
    parser.add_argument("--address", help="the Ray cluster (ray start --head ...; default: RAY_ADDRESS, else a local "
                        "one, with a CPU more than the actors take)")
    parser.add_argument("--id-column", metavar="NAME", help="a column of unique row ids (default: row + index)")
    parser.add_argument("--text-column", metavar="NAME", help="the text column (default text)")
    parser.add_argument("--dialogue-column", metavar="NAME", help="a column of turns instead of a text column")
    parser.add_argument("--column", action="append", default=[], metavar="FIELD=NAME",
                        help="an item field from a column, as in drama3-tts --column")
    parser.add_argument("--concurrency", type=int, default=1, help="generating actors (model copies)")
    parser.add_argument("--num-gpus", type=float, default=0, help="GPUs per generating actor (1 on a GPU cluster)")
    parser.add_argument("--encoders", type=int, default=1, help="CPU actors encoding reference recordings")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per actor call")
    parser.add_argument("--seed", type=int, default=0, help="the base seed of rows without their own")
    parser.add_argument("--max-new-tokens", type=int, help="most frames per chunk")
    parser.add_argument("--chunk-bytes", type=int, default=300, help="longest chunk of text, in UTF-8 bytes "
                        "(default 300)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`drama3-ray`: every row checked on the driver (as `drama3-tts --dataset` checks them), then only the
    pending ones sent through the two stages, then the audio dataset assembled in the input's order. Errors are
    one line and exit status 1; Ctrl-C is one line and 130."""
    from .chunking import MIN_CHUNK_BYTES
    from .cli_jobs import dataset_columns

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        columns = dataset_columns(args)  # the same mapping flags as drama3-tts --dataset
    except ValueError as error:
        parser.error(str(error))
    for flag, value, least in (("--concurrency", args.concurrency, 1), ("--encoders", args.encoders, 1),
                               ("--batch-size", args.batch_size, 1), ("--num-gpus", args.num_gpus, 0),
                               ("--chunk-bytes", args.chunk_bytes, MIN_CHUNK_BYTES)):
        if value < least:
            parser.error(f"{flag} must be at least {least}; got {value:g}")
    if args.num_shards is not None and args.num_shards < 1:
        parser.error(f"--num-shards must be at least 1; got {args.num_shards}")
    if args.output.exists() and not args.output.is_dir():
        parser.error(f"--output {str(args.output)!r} is a file: give a folder (it is created if missing)")
    with interrupts_recorded() as interrupted:
        try:
            try:
                import ray
                import ray.data  # noqa: F401
            except ImportError:
                print(f"drama3-ray: error: {RAY_HINT}", file=sys.stderr)
                return 1
            return run_ray_job(ray, args, columns)
        except BaseException as error:  # noqa: BLE001  (Ctrl-C may surface as another error from inside Ray)
            if interrupted or isinstance(error, KeyboardInterrupt):
                print("drama3-ray: interrupted", file=sys.stderr)
                return 130
            if not isinstance(error, (ManifestError, OSError, ValueError)):
                raise
            print(f"drama3-ray: error: {error}", file=sys.stderr)
            return 1


@contextlib.contextmanager
def interrupts_recorded():
    """While running, Ctrl-C (SIGINT) raises KeyboardInterrupt once and is recorded in the list yielded; later ones
    are ignored while the first unwinds (Ray shutting down its workers). Whatever error Ray turns the interrupt
    into, `main` then reports one line and status 130."""
    interrupted: list[int] = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) in (
            signal.SIG_IGN, None):  # handlers belong to the main thread; an ignored Ctrl-C (nohup, &) stays so
        yield interrupted
        return

    def interrupt(number, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        interrupted.append(number)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def run_ray_job(ray, args: argparse.Namespace, columns: dict) -> int:
    """What `main` runs once the command line is checked: the exit status."""
    from .jobs import read_items
    from .jobs_dataset import audio_dataset, read_dataset_job, save_audio_dataset, source_folder

    settings = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    processor = driver_processor(args.model)
    problems: list[str] = []
    dataset, items = read_dataset_job(
        args.source, split=args.split, columns=columns, dialogue_column=args.dialogue_column, base_seed=args.seed,
        defaults=settings, added=(*RAY_COLUMNS, REFERENCE_CODES, ROW_ID), problems=problems)
    parts = args.output / RAY_FOLDER
    done = written_fingerprints(parts)
    pending = [index for index, item in enumerate(items) if item.fingerprint not in done]
    read_items(items, pending, processor, args.chunk_bytes, problems, args.source)  # every problem in one error
    if pending:
        rows = dataset.select(pending)
        if "id" not in columns:  # the ids drama3-tts --dataset gives, so a row's seed and audio are the same
            rows, columns = rows.add_column(ROW_ID, [items[index].id for index in pending]), {**columns, "id": ROW_ID}
        speak_rows(ray, args, rows, parts, columns=columns, dialogue_column=args.dialogue_column,
                   folder=str(source_folder(args.source).resolve()), seed=args.seed, chunk_bytes=args.chunk_bytes,
                   **settings)
    else:
        print(f"drama3-ray: nothing to speak: the {len(items)} rows were made by earlier runs", file=sys.stderr)
    args.output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".drama3-ray-", dir=args.output) as cache:
        made = audio_dataset(dataset, items, part_results(parts, Path(cache)), processor.sampling_rate)
        save_audio_dataset(made, args.output, args.dataset_format, args.num_shards)
        failed = [f"{items[index].where}: {error}" for index, error in enumerate(made["error"]) if error is not None]
    written = args.output / "data" if args.dataset_format == "parquet" else args.output
    print(f"drama3-ray: {len(pending) - len(failed)} rows spoken now, {len(items) - len(pending)} by earlier runs, "
          f"{len(failed)} failed: the audio dataset is in {written}", file=sys.stderr)
    if failed:
        shown = "\n  ".join(failed[:20]) + (f"\n  ... and {len(failed) - 20} more" if len(failed) > 20 else "")
        print(f"drama3-ray: error: {len(failed)} row(s) failed (rerun to retry them):\n  {shown}", file=sys.stderr)
        return 1
    return 0


def speak_rows(ray, args: argparse.Namespace, rows, parts: Path, **settings) -> None:
    """Send `rows` (a `datasets.Dataset`) through the two stages on the Ray cluster, into parquet files in `parts`.
    The rows go to Ray as a parquet file beside `parts` (on the storage every node sees, as the output must be)."""
    started = start_ray(ray, args)
    pending = parts.parent / ".drama3-ray-pending.parquet"
    try:
        rows.to_parquet(str(pending))
        read = ray.data.read_parquet(str(pending)).repartition(target_num_rows_per_block=args.batch_size)
        made = speech_pipeline(read, args.model, batch_size=args.batch_size, concurrency=args.concurrency,
                               num_gpus=args.num_gpus, encoders=args.encoders, **settings)
        made.write_parquet(str(parts))
    finally:
        pending.unlink(missing_ok=True)
        if started:
            stop_ray(ray)


def stop_ray(ray, timeout: float = 30) -> None:
    """`ray.shutdown()`, once Ray Data's scheduling threads have stopped (for at most `timeout` seconds): one still
    running when the driver's Ray worker shuts down ends the process at once, with status 1 (Ray's core worker
    exits it). After a Ctrl-C mid-job Ray Data waits only 2 s for them. They are found by the name Ray Data gives
    them (`StreamingExecutor-DATASET`); under another name they are not waited for."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name.startswith("StreamingExecutor") and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    ray.shutdown()


def driver_processor(model: str):
    """The processor of `model`, for the driver's checks: a local checkpoint's, or a Hub repository's processor
    files alone (the driver loads no model)."""
    from .checkpoint_location import checkpoint_directory, looks_like_a_path
    from .processing_drama3 import Drama3Processor

    local = os.path.isdir(os.path.expanduser(model)) or looks_like_a_path(model)
    try:
        return Drama3Processor.from_pretrained(checkpoint_directory(model) if local else model)
    except (OSError, ValueError) as error:
        raise ManifestError(f"cannot load the processor of {model!r}: {error}") from error


__all__ = ["FINGERPRINT", "RAY_COLUMNS", "RAY_FOLDER", "REFERENCE_CODES", "ROW_ID", "Drama3Predictor",
           "ReferenceEncoder", "RowSettings", "build_parser", "local_cluster_cpus", "main", "part_results",
           "row_item", "run_ray_job", "speech_pipeline", "written_fingerprints"]
