"""The job flags of `drama3-tts` (docs/scaling.md): a manifest or a 🤗 dataset in, loose files or an audio dataset
out. `cli.py` runs the job; this module holds the flags, their usage rules and the reading of the input (nothing heavy
is imported until a job runs).

    drama3-tts --model DIR --manifest jobs.jsonl --output-dir out/
    drama3-tts --model DIR --dataset texts.parquet --text-column text --output-dataset out/
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

FAILED_IDS_SHOWN = 20  # failed item ids named in the final message; the rest are counted
ONE_ACCELERATE_PROCESS = (
    "accelerate launch started one process, though several were asked for: on a machine without GPUs it starts one "
    "unless told --multi_gpu (accelerate launch --multi_gpu --num_processes N -m transformers_drama3.cli ...); this "
    "job runs in this one process")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    jobs = parser.add_argument_group(
        "jobs", "many texts into many files or an audio dataset, resumable (docs/scaling.md); under torchrun or "
        "accelerate launch each rank holds a whole model and takes the next batch (--parallel: one model split "
        "over all ranks)")
    jobs.add_argument("--manifest", type=Path, metavar="JOBS.jsonl", help="speak every item of this JSON Lines file")
    jobs.add_argument("--dataset", metavar="SOURCE",
                      help="speak every row of a 🤗 dataset (the [datasets] extra): a .parquet/.json/.jsonl/.csv "
                      "file, a dataset folder (save_to_disk) or a Hub id owner/name")
    jobs.add_argument("--split", default="train", help="the dataset's split (default train)")
    jobs.add_argument("--text-column", metavar="NAME", help="the dataset's text column (default text)")
    jobs.add_argument("--dialogue-column", metavar="NAME",
                      help='a column of turns [{"speaker": N, "text": T}, ...] instead of a text column')
    jobs.add_argument("--id-column", metavar="NAME", help="a column of unique row ids (default: row + index)")
    jobs.add_argument("--column", action="append", default=[], metavar="FIELD=NAME",
                      help="take an item field (voice, references, reference_audio, reference_transcript, seed, "
                      "speaker, format, temperature, top_p, top_k, max_new_tokens, greedy, text_file) from a column; "
                      "repeatable")
    jobs.add_argument("--output-dir", type=Path, metavar="DIR", help="write each item as DIR/ID.FORMAT, with "
                      "DIR/results.jsonl")
    jobs.add_argument("--output-dataset", type=Path, metavar="DIR",
                      help="write an audio dataset to DIR: the input columns + audio, frames, finish_reason, seed, "
                      "error")
    jobs.add_argument("--dataset-format", choices=["arrow", "parquet"], default="arrow",
                      help="--output-dataset as save_to_disk shards (default) or parquet shards in DIR/data/")
    jobs.add_argument("--num-shards", type=int, metavar="N", help="shards of --output-dataset (default: by size)")
    jobs.add_argument("--batch-size", type=int, default=8, metavar="N",
                      help="items generated together, grouped by length (default 8)")


def is_job(args: argparse.Namespace) -> bool:
    return any(value is not None for value in (args.manifest, args.dataset, args.output_dir, args.output_dataset))


def check_job_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A job takes its texts, voices and outputs from its input: refuse the flags of a single run, and mixed-up job
    flags (exit status 2); nothing is read."""
    if (args.manifest is None) == (args.dataset is None):
        parser.error("a job reads either --manifest JOBS.jsonl or --dataset SOURCE: give one of them")
    if (args.output_dir is None) == (args.output_dataset is None):
        parser.error(f"--{'manifest' if args.manifest else 'dataset'} needs one output: --output-dir DIR (files) or "
                     "--output-dataset DIR (an audio dataset)")
    single = (("TEXT", args.text), ("--text-file", args.text_file), ("--output", args.output),
              ("--reference", args.reference), ("--voice", args.voice), ("--save-voice", args.save_voice),
              ("--stream", args.stream), ("--summary", args.summary))
    given = [flag for flag, value in single if value]
    if given:
        parser.error(f"a job takes its texts, voices and formats from its input: leave out {', '.join(given)}")
    dataset_flags = (("--text-column", args.text_column), ("--dialogue-column", args.dialogue_column),
                     ("--id-column", args.id_column), ("--column", args.column), ("--output-dataset",
                     args.output_dataset), ("--split", args.split != "train"))
    given = [flag for flag, value in dataset_flags if value]
    if args.manifest is not None and given:
        parser.error(f"{', '.join(given)} belong to --dataset jobs; a manifest names its fields itself")
    if args.text_column and args.dialogue_column:
        parser.error("give --text-column or --dialogue-column, not both")
    try:
        dataset_columns(args)
    except ValueError as error:
        parser.error(str(error))
    for flag, folder in (("--output-dir", args.output_dir), ("--output-dataset", args.output_dataset)):
        if folder is not None and folder.exists() and not folder.is_dir():
            parser.error(f"{flag} {str(folder)!r} is a file: give a folder (it is created if missing)")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1; got {args.batch_size}")
    if args.num_shards is not None and (args.num_shards < 1 or args.output_dataset is None):
        parser.error(f"--num-shards is the number (>= 1) of --output-dataset shards; got {args.num_shards}")


def dataset_columns(args: argparse.Namespace) -> dict[str, str]:
    """Item field -> column, from --text-column, --id-column and --column FIELD=NAME."""
    from .jobs_items import FIELDS

    columns = {} if args.dialogue_column else {"text": args.text_column or "text"}
    if args.id_column:
        columns["id"] = args.id_column
    for given in args.column:
        field, equals, name = given.partition("=")
        if not equals or not name or field not in FIELDS - {"id", "text"}:
            raise ValueError(f"--column takes FIELD=NAME with FIELD one of {sorted(FIELDS - {'id', 'text'})} "
                             f"(--text-column and --id-column name those); got {given!r}")
        columns[field] = name
    return columns


class JobInput:
    """A job's input as the command line gives it: `read` (rank 0, before the model is even downloaded) checks every
    line or row and returns the items; `finish` (rank 0) writes the audio dataset when one is asked for."""

    def __init__(self, args: argparse.Namespace, flags: dict):
        self.args, self.flags, self.dataset = args, flags, None

    @property
    def name(self) -> str:
        """How errors name the input: the manifest's file name, or the dataset as given."""
        return self.args.manifest.name if self.args.manifest is not None else str(self.args.dataset)

    @property
    def files_dir(self) -> Path:
        """Where the items' files and results.jsonl go."""
        from .jobs_dataset import AUDIO_FOLDER

        args = self.args
        return args.output_dir if args.output_dir is not None else args.output_dataset / AUDIO_FOLDER

    def read(self) -> tuple[list, list[str]]:
        """(the items, the problems of lines or rows that made none): every line or row checked."""
        from .jobs_dataset import OUTPUT_COLUMNS, read_dataset_job
        from .jobs_items import read_manifest

        args, base_seed, problems = self.args, self.args.seed or 0, []
        if args.manifest is not None:
            return read_manifest(args.manifest, base_seed, self.flags, problems), problems
        self.dataset, items = read_dataset_job(
            args.dataset, split=args.split, columns=dataset_columns(args), dialogue_column=args.dialogue_column,
            base_seed=base_seed, defaults=self.flags, added=OUTPUT_COLUMNS if args.output_dataset else None,
            problems=problems)
        return items, problems

    def finish(self, items: list, processor) -> Path:
        """Write the audio dataset (with `--output-dataset`); the folder with the results."""
        if self.args.output_dataset is None:
            return self.files_dir
        from .jobs_dataset import audio_dataset, file_results, save_audio_dataset

        made = audio_dataset(self.dataset, items, file_results(self.files_dir), processor.sampling_rate)
        save_audio_dataset(made, self.args.output_dataset, self.args.dataset_format, self.args.num_shards)
        return self.args.output_dataset


def one_accelerate_process() -> bool:
    """Whether this is the single process that `accelerate launch --num_processes N` (N > 1) starts without
    `--multi_gpu` on a machine without GPUs: accelerate's simple launcher sets MASTER_ADDR when several processes
    are asked for, but no torch.distributed WORLD_SIZE (a launch of several processes sets one)."""
    return all(name in os.environ for name in ("ACCELERATE_MIXED_PRECISION", "MASTER_ADDR")) and (
        "WORLD_SIZE" not in os.environ)


def failed_message(summary) -> str:
    """The final error of a job with failed items, naming them."""
    ids = summary.failed_ids[:FAILED_IDS_SHOWN]
    more = f" and {len(summary.failed_ids) - len(ids)} more" if len(summary.failed_ids) > len(ids) else ""
    return (f"{summary.failed} item(s) failed ({', '.join(ids)}{more}); their errors are in {summary.results} "
            "(rerun the same command to retry them)")


__all__ = ["ONE_ACCELERATE_PROCESS", "JobInput", "add_job_arguments", "check_job_usage", "dataset_columns",
           "failed_message", "is_job", "one_accelerate_process"]
