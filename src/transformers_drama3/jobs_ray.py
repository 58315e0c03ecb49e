"""Ray Data across machines (`pip install transformers-drama3[ray]`, docs/scaling.md): a job in two stages, each a
callable class for `Dataset.map_batches`, and `drama3-ray`, the command that builds the pipeline
read -> encode references (CPU actors) -> generate (GPU actors) -> write parquet, and resumes it.

    ds = ray.data.read_parquet("texts/")
    ds = ds.map_batches(ReferenceEncoder, fn_constructor_kwargs=settings, batch_format="pyarrow", batch_size=16,
                        concurrency=4, num_cpus=1)
    ds = ds.map_batches(Drama3Predictor, fn_constructor_kwargs=settings, batch_format="pyarrow", batch_size=16,
                        concurrency=8, num_gpus=1)
    ds.write_parquet("speech/")

A row is an item as in every other job (`row_item`: `jobs_items.row_entry`, `checked_items`) and is spoken by the
same batch code (`jobs.run_batch`, each row's file written as the plain job writes it, then stored as bytes), so a
row gets the same audio bytes as in `drama3-tts --dataset` for the same id, seed and settings. Its reference
recordings are encoded by the plain job's own function (`jobs.encoded_references`), once, on a CPU worker: the GPU
actors get codes and hold no codec encoder. A row without an id column is named by its content (`row-` and a hash of
its mapped values), which Ray cannot reorder. A row that cannot be spoken (bad text, a missing file, a recording that
cannot be decoded) gets its `error` and no audio: it is recorded, not retried. Ray itself retries what dies: an actor
that is killed is restarted and its batch is run again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from .jobs_dataset import OUTPUT_COLUMNS, check_output_columns
from .jobs_items import JobItem, ManifestError, checked_items, item_columns, row_entry

RAY_HINT = "Ray Data is not installed: pip install 'transformers-drama3[ray]'"
FINGERPRINT = "fingerprint"  # an output column: the row's fingerprint, by which a rerun finds rows already made
RAY_COLUMNS = (*OUTPUT_COLUMNS, FINGERPRINT)
REFERENCE_CODES = "reference_codes"  # ReferenceEncoder -> Drama3Predictor: [{"transcript", "codes" [K][frames]}]
STAGE_COLUMNS = (FINGERPRINT, REFERENCE_CODES, "error")  # what ReferenceEncoder adds
ROW_ERROR = (ManifestError, OSError, ValueError, TypeError)  # what a row's own input can raise


def row_item(row: dict, columns: dict, dialogue_column: str | None, folder: Path, seed: int,
             defaults: dict) -> JobItem:
    """A row -> its checked item (`ManifestError` if it cannot be one). Without an `id` column the id is `row-` and
    16 hex digits of the hash of the row's mapped values, so the same row gets the same id, seed and fingerprint
    in every run, wherever Ray puts it."""
    entry = row_entry(row, columns, dialogue_column, "")
    if "id" not in columns:
        content = json.dumps({name: value for name, value in entry.items() if name != "id"}, sort_keys=True)
        entry["id"] = "row-" + hashlib.sha256(content.encode()).hexdigest()[:16]
    return checked_items([(f"row {entry['id'] or '(no id)'}", 0, entry)], folder, seed, defaults)[0]


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
    coded = rows.map_batches(ReferenceEncoder, batch_format="pyarrow", batch_size=batch_size, concurrency=encoders,
                             num_cpus=encoder_cpus, fn_constructor_kwargs={"model": model, "done": done, **settings})
    return coded.map_batches(Drama3Predictor, batch_format="pyarrow", batch_size=batch_size, concurrency=concurrency,
                             num_gpus=num_gpus, num_cpus=1,
                             fn_constructor_kwargs={"model": model, "device": device, "batch_size": batch_size,
                                                    **settings})


def written_fingerprints(output: Path) -> set[str]:
    """The fingerprints of the rows an earlier run spoke into `output` (parquet files), after tidying it so that a
    rerun makes each row once: a file cut short (a kill mid-write) is removed, and rows that failed are taken out of
    their file (rewritten atomically), so they are tried again. Raises `ManifestError` for a folder whose parquet
    files are not a drama3-ray output."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    done: set[str] = set()
    for path in sorted(output.glob("*.parquet")) if output.is_dir() else []:
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


def read_source(source: str, ray_data, rows_per_block: int | None = None):
    """A Ray dataset from parquet or JSON Lines files (a file or a folder of them), or `hf:ID` (a Hub dataset through
    🤗 datasets), cut into blocks of `rows_per_block` rows (streaming): an actor takes a block at a time, so a file
    read as one block would keep every actor but one idle."""
    if source.startswith("hf:"):
        import datasets

        read = ray_data.from_huggingface(datasets.load_dataset(source[3:], split="train"))
    else:
        path = Path(source)
        suffixes = {each.suffix for each in path.iterdir()} if path.is_dir() else {path.suffix}
        read = ray_data.read_json(source) if suffixes & {".json", ".jsonl"} else ray_data.read_parquet(source)
    return read if rows_per_block is None else read.repartition(target_num_rows_per_block=rows_per_block)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drama3-ray", description="Speak every row of a dataset on a Ray cluster: read -> encode references "
        "(CPU actors) -> generate (actors that load the model once each) -> parquet; a rerun into the same output "
        "makes only the rows missing or failed (docs/scaling.md).")
    parser.add_argument("source", help="parquet or JSON Lines files (a file or folder), or hf:ID for a Hub dataset")
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id")
    parser.add_argument("--output", required=True, type=Path, help="the folder of parquet files to write")
    parser.add_argument("--address", help="the Ray cluster (ray start --head ...); default: a local one")
    parser.add_argument("--id-column", metavar="NAME",
                        help="a column of unique row ids (default: rows are named by a hash of their values)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    from .cli_jobs import dataset_columns

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        columns = dataset_columns(args)  # the same mapping flags as drama3-tts --dataset
    except ValueError as error:
        parser.error(str(error))
    for flag, value in (("--concurrency", args.concurrency), ("--encoders", args.encoders),
                        ("--batch-size", args.batch_size)):
        if value < 1:
            parser.error(f"{flag} must be at least 1; got {value}")
    try:
        import pyarrow.parquet as pq
        import ray
        import ray.data
    except ImportError:
        print(f"drama3-ray: error: {RAY_HINT}", file=sys.stderr)
        return 1
    try:
        done = written_fingerprints(args.output)
    except ManifestError as error:
        print(f"drama3-ray: error: {error}", file=sys.stderr)
        return 1
    settings = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    threads = {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]} if "OMP_NUM_THREADS" in os.environ else {}
    if not ray.is_initialized():  # (a caller may have started Ray with its own settings)
        ray.init(address=args.address, runtime_env={"env_vars": threads})  # the actors' thread count, on every node
    rows = read_source(args.source, ray.data, rows_per_block=args.batch_size)
    try:
        check_output_columns(rows.columns(), columns, (*RAY_COLUMNS, REFERENCE_CODES))
    except ManifestError as error:
        print(f"drama3-ray: error: {error}", file=sys.stderr)
        return 1
    folder = Path(args.source).parent if Path(args.source).is_file() else Path(args.source)
    made = speech_pipeline(
        rows, args.model, done=done,
        batch_size=args.batch_size, concurrency=args.concurrency, num_gpus=args.num_gpus, encoders=args.encoders,
        columns=columns, dialogue_column=args.dialogue_column, folder=str(folder.resolve()), seed=args.seed,
        **settings)
    made.write_parquet(str(args.output))

    written = pq.read_table(args.output, columns=["audio", "error"]).to_pylist()
    failed = [row["error"] for row in written if row["error"] is not None]
    print(f"drama3-ray: {len(written) - len(failed)} rows spoken ({len(done)} by earlier runs), {len(failed)} failed, "
          f"in {args.output}", file=sys.stderr)
    if failed:
        shown = "\n  ".join(failed[:20]) + (f"\n  ... and {len(failed) - 20} more" if len(failed) > 20 else "")
        print(f"drama3-ray: error: {len(failed)} row(s) failed (rerun to retry them):\n  {shown}", file=sys.stderr)
        return 1
    return 0


__all__ = ["FINGERPRINT", "RAY_COLUMNS", "REFERENCE_CODES", "Drama3Predictor", "ReferenceEncoder", "RowSettings",
           "build_parser", "main", "read_source", "row_item", "speech_pipeline", "written_fingerprints"]
