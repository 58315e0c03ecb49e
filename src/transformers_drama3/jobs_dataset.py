"""🤗 datasets in and out: a job over the rows of a `datasets.Dataset` whose result is an audio dataset, the input
columns plus `audio` (`datasets.Audio` at 44.1 kHz), `frames`, `finish_reason`, `seed` and `error`
(docs/scaling.md).

    drama3-tts --model DIR --dataset texts.parquet --text-column text --output-dataset out/

The job itself is the one of every input (`jobs.run_items`): each row's file is written to `OUT/audio/` with its
record in `OUT/audio/results.jsonl`, which makes the job resumable row by row (a row's fingerprint is its mapped
values); then rank 0 assembles the dataset from those files, in row order, and writes it in shards:
`save_to_disk(OUT)` (read it with `datasets.load_from_disk`) or parquet files `OUT/data/train-*.parquet` (read them
with `load_dataset("parquet", data_dir=OUT/data)`, or push the folder to the Hub).
"""

from __future__ import annotations

import os
from pathlib import Path

from . import parallel
from .jobs import RESULTS_FILE, JobSummary, records_in, run_items
from .jobs_items import JobItem, ManifestError, dataset_items

AUDIO_FOLDER = "audio"  # OUT/audio/: the rows' files and results.jsonl, what a rerun resumes from
OUTPUT_COLUMNS = ("audio", "frames", "finish_reason", "seed", "error")
DATASET_FORMATS = ("arrow", "parquet")


def check_output_columns(column_names: list[str], columns: dict | None, added=OUTPUT_COLUMNS) -> None:
    """Refuse an input (with `column_names`) whose columns would be overwritten by the `added` ones of the output
    (its own `seed` column mapped as the rows' seeds is kept: the output's `seed` is the same value)."""
    taken = [name for name in added if name in column_names
             and not (name == "seed" and (columns or {}).get("seed") == "seed")]
    if taken:
        raise ManifestError(f"the dataset has column(s) {taken}, which the audio dataset adds: rename them first "
                            "(dataset.rename_column)")


def audio_dataset(dataset, items: list[JobItem], job_dir: Path, sampling_rate: int):
    """`dataset` (the job's rows, `items` made from them in order) with the job's results from `job_dir` added:
    `audio` (the row's file, as written), `frames`, `finish_reason`, `seed`, and `error` (None when done)."""
    import datasets

    records = {record["id"]: record for record in records_in(job_dir / RESULTS_FILE)}

    def add(batch, indices):
        columns = {name: [] for name in OUTPUT_COLUMNS}
        for index in indices:
            item = items[index]
            record = records.get(item.id, {"error": "not run"})
            done = record.get("status") == "done"
            columns["audio"].append({"bytes": (job_dir / item.file_name).read_bytes(), "path": item.file_name}
                                    if done else None)
            columns["frames"].append(record.get("frames"))
            columns["finish_reason"].append(record.get("finish_reason"))
            columns["seed"].append(item.seed)
            columns["error"].append(None if done else record.get("error"))
        return columns

    features = dataset.features.copy()
    # The audio is stored as the file's bytes and cast to `Audio` afterwards: `Audio`'s encoder needs torchcodec
    # (and FFmpeg) even for bytes, which decoding with soundfile does not.
    features.update({"audio": {"bytes": datasets.Value("binary"), "path": datasets.Value("string")},
                     "frames": datasets.Value("int32"), "finish_reason": datasets.Value("string"),
                     "seed": datasets.Value("int64"), "error": datasets.Value("string")})
    made = dataset.map(add, with_indices=True, batched=True, batch_size=64, features=features,
                       desc="assembling the audio dataset")
    return made.cast_column("audio", datasets.Audio(sampling_rate=sampling_rate))


def save_audio_dataset(made, output: Path, dataset_format: str = "arrow", num_shards: int | None = None) -> None:
    """Write an audio dataset to `output`: `save_to_disk` in shards (500 MB each unless `num_shards`), or parquet
    shards `output/data/train-NNNNN-of-NNNNN.parquet` (the Hub's layout; 1,000 rows each unless `num_shards`)."""
    if dataset_format == "arrow":
        made.save_to_disk(str(output), num_shards=num_shards)
        return
    if dataset_format != "parquet":
        raise ValueError(f"dataset_format must be one of {list(DATASET_FORMATS)}, got {dataset_format!r}")
    shards = num_shards or max(1, -(-len(made) // 1000))
    folder = output / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("train-*.parquet"):  # an earlier run's shards, perhaps of another count
        stale.unlink()
    for number in range(shards):
        shard = made.shard(shards, number, contiguous=True)
        shard.to_parquet(str(folder / f"train-{number:05d}-of-{shards:05d}.parquet"))


def run_dataset(model, processor, dataset, output: str | os.PathLike, *, columns: dict | None = None,
                dialogue_column: str | None = None, folder: str | os.PathLike = ".", dataset_format: str = "arrow",
                num_shards: int | None = None, seed: int = 0, batch_size: int = 8, chunk_bytes: int = 300,
                sort_by_length: bool = True, show_progress: bool = True, **generate_kwargs) -> JobSummary:
    """Speak every row of `dataset` (a `datasets.Dataset`) and write the audio dataset to `output`: the Python form
    of `drama3-tts --dataset ... --output-dataset OUT`.

    `columns` maps item fields to columns (`{"text": "text"}` by default; `id`, `voice`, `references`, `seed`,
    `speaker`, `format`, sampling settings), `dialogue_column` a column of turns (`jobs_items.dataset_items`);
    relative paths are relative to `folder`. `dataset_format`: "arrow" (`save_to_disk`) or "parquet". `seed` and
    `generate_kwargs` as in `run_manifest`. Under torch.distributed, call it on every rank with the same dataset.
    Every bad row is raised at once (`ManifestError`) before any model work; rows that fail while running have
    their `error` set and no audio, and a rerun retries them.
    """
    output = Path(output)
    if dataset_format not in DATASET_FORMATS:
        raise ValueError(f"dataset_format must be one of {list(DATASET_FORMATS)}, got {dataset_format!r}")

    def items() -> list[JobItem]:
        check_output_columns(dataset.column_names, columns)
        return dataset_items(dataset, columns, dialogue_column=dialogue_column, folder=folder, base_seed=seed,
                             defaults=generate_kwargs)

    listed = parallel.run_on_main_process(items)
    summary = run_items(model, processor, listed, output / AUDIO_FOLDER, batch_size=batch_size,
                        chunk_bytes=chunk_bytes, sort_by_length=sort_by_length, show_progress=show_progress)
    if parallel.is_main_process():
        made = audio_dataset(dataset, listed, output / AUDIO_FOLDER, processor.sampling_rate)
        save_audio_dataset(made, output, dataset_format, num_shards)
    return summary


__all__ = ["AUDIO_FOLDER", "DATASET_FORMATS", "OUTPUT_COLUMNS", "audio_dataset", "check_output_columns",
           "run_dataset", "save_audio_dataset"]
