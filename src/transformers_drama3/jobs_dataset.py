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
from .jobs import RESULTS_FILE, JobSummary, read_items, records_in, run_items
from .jobs_items import JobItem, ManifestError, dataset_items, load_input_dataset, reported

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


def read_dataset_job(source: str | os.PathLike, *, split: str = "train", columns: dict | None = None,
                     dialogue_column: str | None = None, base_seed: int = 0, defaults: dict | None = None,
                     added=OUTPUT_COLUMNS, problems: list[str] | None = None) -> tuple:
    """(the dataset at `source`, its rows' items): read (`load_input_dataset`: a parquet / JSON / JSON Lines / CSV
    file, a `save_to_disk` folder, a Hub id) and checked (`checked_rows`), as `drama3-tts --dataset` and
    `drama3-ray` both check their input. Relative paths in the rows are relative to the source's folder (the
    working directory for a Hub dataset)."""
    dataset = load_input_dataset(source, split)
    items = checked_rows(dataset, columns=columns, dialogue_column=dialogue_column, folder=source_folder(source),
                         base_seed=base_seed, defaults=defaults, added=added, what=str(source), problems=problems)
    return dataset, items


def checked_rows(dataset, *, columns: dict | None = None, dialogue_column: str | None = None,
                 folder: str | os.PathLike = ".", base_seed: int = 0, defaults: dict | None = None,
                 added=OUTPUT_COLUMNS, what: str = "the dataset", problems: list[str] | None = None) -> list[JobItem]:
    """The items of `dataset`'s rows, every row checked (`dataset_items`), and its columns: `added`, the output
    columns the rows must not have (`check_output_columns`; None: no check). One `ManifestError` names every problem
    (or, given a list `problems`, they are added to it and the good rows' items returned)."""
    found: list[str] = []
    if added is not None:
        try:
            check_output_columns(dataset.column_names, columns, added)
        except ManifestError as error:
            found.append(str(error))
    items = dataset_items(dataset, columns, dialogue_column=dialogue_column, folder=folder, base_seed=base_seed,
                          defaults=defaults, what=what, problems=found)
    return reported(items, found, problems, what)


def source_folder(source: str | os.PathLike) -> Path:
    """Where relative paths in the rows of the dataset at `source` point: its folder (the folder itself for a
    `save_to_disk` one), or the working directory for a Hub dataset."""
    local = Path(source)
    return (local if local.is_dir() else local.parent) if local.exists() else Path.cwd()


def file_results(job_dir: Path):
    """The results of a job that wrote files (`run_items`) into `job_dir`, as `audio_dataset` takes them: item ->
    (its record in results.jsonl, the bytes of its file or None)."""
    records = {record["id"]: record for record in records_in(job_dir / RESULTS_FILE)}

    def result(item: JobItem) -> tuple[dict, bytes | None]:
        record = records.get(item.id, {"error": "not run"})
        done = record.get("status") == "done"
        return record, (job_dir / item.file_name).read_bytes() if done else None

    return result


def audio_dataset(dataset, items: list[JobItem], results, sampling_rate: int):
    """`dataset` (the job's rows, `items` made from them in order) with the job's results added: `audio` (the
    row's file, as written), `frames`, `finish_reason`, `seed`, and `error` (None when done). `results(item)` ->
    (a record with `frames`, `finish_reason` and `error`, the file's bytes or None): `file_results`, or a Ray job's
    (`jobs_ray`)."""
    import datasets

    def add(batch, indices):
        columns = {name: [] for name in OUTPUT_COLUMNS}
        for index in indices:
            item = items[index]
            record, audio = results(item)
            done = audio is not None
            columns["audio"].append({"bytes": audio, "path": item.file_name} if done else None)
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
        problems: list[str] = []
        listed = checked_rows(dataset, columns=columns, dialogue_column=dialogue_column, folder=folder,
                              base_seed=seed, defaults=generate_kwargs, problems=problems)
        if problems:  # one message with what reading the other rows' texts finds
            read_items(listed, range(len(listed)), processor, chunk_bytes, problems, "the dataset")
        return listed

    listed = parallel.run_on_main_process(items)
    summary = run_items(model, processor, listed, output / AUDIO_FOLDER, batch_size=batch_size,
                        chunk_bytes=chunk_bytes, sort_by_length=sort_by_length, show_progress=show_progress)
    if parallel.is_main_process():
        made = audio_dataset(dataset, listed, file_results(output / AUDIO_FOLDER), processor.sampling_rate)
        save_audio_dataset(made, output, dataset_format, num_shards)
    return summary


__all__ = ["AUDIO_FOLDER", "DATASET_FORMATS", "OUTPUT_COLUMNS", "audio_dataset", "check_output_columns",
           "checked_rows", "file_results", "read_dataset_job", "run_dataset", "save_audio_dataset", "source_folder"]
