"""Ray Data across machines (`pip install transformers-drama3[ray]`, docs/scaling.md): `Drama3Predictor`, a callable
class for `Dataset.map_batches` that loads the model once per actor and turns a batch of text rows into audio rows,
and `drama3-ray`, the command that builds the pipeline read -> generate (actors) -> write parquet.

    ds = ray.data.read_parquet("texts/")
    ds = ds.map_batches(Drama3Predictor, fn_constructor_kwargs={"model": "fishaudio/drama-3", "columns": {...}},
                        batch_format="pyarrow", batch_size=16, concurrency=8, num_gpus=1)
    ds.write_parquet("speech/")

A row is an item as in every other job (`jobs_items.row_entry`, `checked_items`) and is spoken by the same batch
code (`jobs.run_batch`, each row's file written as the plain job writes it, then stored as bytes), so a row gets the
same audio bytes as in `drama3-tts --dataset` for the same id, seed and settings. Rows need an id column (seeds come
from ids, and Ray gives a row no stable index). A row that cannot be spoken (bad text, a missing file, a recording
that cannot be decoded) gets its `error` and no audio: it is recorded, not retried. Ray itself retries what dies: an
actor that is killed is restarted and its batch is run again.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .jobs_dataset import OUTPUT_COLUMNS
from .jobs_items import ManifestError, checked_items, row_entry

RAY_HINT = "Ray Data is not installed: pip install 'transformers-drama3[ray]'"


class Drama3Predictor:
    """`map_batches` callable: pyarrow batches of rows in, the same rows plus `audio` ({"bytes", "path"}: the file a
    plain job writes), `frames`, `finish_reason`, `seed` and `error` out.

    `model`: a checkpoint directory or Hub id, loaded once per actor (on `device`, "auto": the GPU Ray gave the
    actor, else the CPU). `columns` maps item fields to columns and must map `id`; `dialogue_column`, `folder`,
    `seed` (the base seed), `batch_size` (sequences generated together), `chunk_bytes` and `generate_kwargs` (the
    default sampling settings) are those of `run_dataset`.
    """

    def __init__(self, model: str, *, columns: dict, dialogue_column: str | None = None,
                 folder: str | os.PathLike = ".", seed: int = 0, batch_size: int = 8, chunk_bytes: int = 300,
                 device: str = "auto", dtype: str = "auto", **generate_kwargs):
        from .checkpoint_location import checkpoint_directory
        from .loading import load_model, resolve_device_and_dtype
        from .processing_drama3 import Drama3Processor

        if "id" not in columns:
            raise ValueError("Drama3Predictor needs an id column (columns={'id': ..., 'text': ...}): seeds and file "
                             "names come from ids, and Ray gives rows no stable index")
        path = checkpoint_directory(model)
        device, dtype = resolve_device_and_dtype(device, dtype)
        self.model = load_model(path, device, dtype)
        self.processor = Drama3Processor.from_pretrained(path)
        self.columns, self.dialogue_column, self.folder = dict(columns), dialogue_column, Path(folder)
        self.seed, self.batch_size, self.chunk_bytes, self.defaults = seed, batch_size, chunk_bytes, generate_kwargs

    def __call__(self, batch):
        import pyarrow as pa

        from .jobs import JobPlan, batches_of, read_item, run_batch

        if not isinstance(batch, pa.Table):
            raise TypeError("Drama3Predictor takes pyarrow batches: map_batches(Drama3Predictor, "
                            f"batch_format=\"pyarrow\", ...); got {type(batch).__name__}")
        rows, items, prepared, errors, records = batch.to_pylist(), [], {}, {}, {}
        for index, row in enumerate(rows):
            try:
                entry = row_entry(row, self.columns, self.dialogue_column, "")
                item = checked_items([(f"id {entry['id']}", index, entry)], self.folder, self.seed, self.defaults)[0]
                prepared[len(items)] = read_item(item, self.processor, self.chunk_bytes)
                items.append(item)
            except (ManifestError, OSError, ValueError, TypeError) as error:
                errors[index] = str(error)
        with tempfile.TemporaryDirectory(prefix="drama3-ray-") as folder:
            plan = JobPlan(items, Path(folder), "ray", self.chunk_bytes, [], prepared, 0)
            for members in batches_of(items, prepared, self.batch_size):
                run_batch(self.model, self.processor, plan, members,
                          lambda index, **fields: records.__setitem__(items[index].id, fields))
            files = {item.id: (Path(folder) / item.file_name).read_bytes() for item in items
                     if records.get(item.id, {}).get("status") == "done"}
        columns = {name: [] for name in OUTPUT_COLUMNS}
        by_id = {item.id: item for item in items}
        for index, row in enumerate(rows):
            item = by_id.get(str(row.get(self.columns["id"])))
            record = records.get(item.id, {}) if item is not None and index not in errors else {}
            done = record.get("status") == "done"
            columns["audio"].append({"bytes": files[item.id], "path": item.file_name} if done else None)
            columns["frames"].append(record.get("frames"))
            columns["finish_reason"].append(record.get("finish_reason"))
            columns["seed"].append(item.seed if item is not None and index not in errors else None)
            columns["error"].append(None if done else errors.get(index) or record.get("error"))
        types = {"audio": pa.struct([("bytes", pa.binary()), ("path", pa.string())]), "frames": pa.int32(),
                 "finish_reason": pa.string(), "seed": pa.int64(), "error": pa.string()}
        kept = batch.drop_columns([name for name in OUTPUT_COLUMNS if name in batch.column_names])
        for name in OUTPUT_COLUMNS:
            kept = kept.append_column(name, pa.array(columns[name], type=types[name]))
        return kept


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
        prog="drama3-ray", description="Speak every row of a dataset on a Ray cluster: read -> generate on actors "
        "(each loads the model once) -> parquet (docs/scaling.md).")
    parser.add_argument("source", help="parquet or JSON Lines files (a file or folder), or hf:ID for a Hub dataset")
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id")
    parser.add_argument("--output", required=True, help="the folder of parquet files to write")
    parser.add_argument("--address", help="the Ray cluster (ray start --head ...); default: a local one")
    parser.add_argument("--id-column", required=True, metavar="NAME", help="a column of unique row ids")
    parser.add_argument("--text-column", metavar="NAME", help="the text column (default text)")
    parser.add_argument("--dialogue-column", metavar="NAME", help="a column of turns instead of a text column")
    parser.add_argument("--column", action="append", default=[], metavar="FIELD=NAME",
                        help="an item field from a column, as in drama3-tts --column")
    parser.add_argument("--concurrency", type=int, default=1, help="generating actors (model copies)")
    parser.add_argument("--num-gpus", type=float, default=0, help="GPUs per actor (1 on a GPU cluster)")
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
    try:
        import ray
        import ray.data
    except ImportError:
        print(f"drama3-ray: error: {RAY_HINT}", file=sys.stderr)
        return 1
    settings = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    threads = {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]} if "OMP_NUM_THREADS" in os.environ else {}
    ray.init(address=args.address, runtime_env={"env_vars": threads})  # the actors' thread count, on every node
    source = read_source(args.source, ray.data, rows_per_block=args.batch_size)
    folder = Path(args.source).parent if Path(args.source).is_file() else Path(args.source)
    made = source.map_batches(
        Drama3Predictor, batch_format="pyarrow", batch_size=args.batch_size, concurrency=args.concurrency,
        num_gpus=args.num_gpus, fn_constructor_kwargs={"model": args.model, "columns": columns,
                                                       "dialogue_column": args.dialogue_column,
                                                       "folder": str(folder.resolve()), "seed": args.seed,
                                                       **settings})
    made.write_parquet(args.output)
    import pyarrow.parquet as pq

    written = pq.read_table(args.output, columns=[args.id_column, "error"]).to_pylist()
    failed = [str(row[args.id_column]) for row in written if row["error"] is not None]
    print(f"drama3-ray: {len(written) - len(failed)} rows spoken, {len(failed)} failed, in {args.output}",
          file=sys.stderr)
    if failed:
        shown = ", ".join(failed[:20]) + (f" and {len(failed) - 20} more" if len(failed) > 20 else "")
        print(f"drama3-ray: error: rows {shown} failed; their errors are in the error column", file=sys.stderr)
        return 1
    return 0


__all__ = ["Drama3Predictor", "build_parser", "main", "read_source"]
