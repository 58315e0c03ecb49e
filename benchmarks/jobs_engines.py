"""The engines of an offline job side by side, in one run (docs/scaling.md, docs/performance.md#jobs-on-three-engines):
a `--rows`-row parquet file of texts spoken into an audio dataset by

1. the plain job: `drama3-tts --dataset X --output-dataset OUT` in one process;
2. `accelerate launch --num_processes 1` of the same command (accelerate's start-up, against 1);
3. `accelerate launch --multi_gpu --num_processes 2` (two processes with a whole model each, on the CPU);
4. Ray Data: `ray.init(num_cpus=4)` (timed: Ray's start-up), then `map_batches(Drama3Predictor, concurrency=1)` and
   `concurrency=2` -> `write_parquet` (the file cut into blocks of a batch: an actor takes a block at a time). Ray's CPUs are scheduling slots, not cores: each actor takes one, and the
   reading and writing tasks need slots of their own (with 2 slots, 2 actors would starve them and never finish).

Each command's wall time is measured whole (imports, start-up, loading, the job, writing); the three commands run
alternately `--repeats` times and the best of each is kept. Every output is checked
against the plain job's: the datasets' audio decodes (with soundfile, from the stored bytes) to the same samples, row
for row, and `datasets.load_from_disk` reads the plain and accelerate outputs.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/jobs_engines.py --output engines.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import datasets
import soundfile

from transformers_drama3.testing import default_tiny_checkpoint

WORDS = ("the harbour woke to a clean sky while fishermen counted their nets and argued about the weather and the "
         "price of cod at the market").split()


def write_rows(path: Path, rows: int) -> None:
    """Texts of 3 to 12 words, reproducible."""
    texts = [" ".join(WORDS[(index * 7) % 10 : (index * 7) % 10 + 3 + index % 10]).capitalize() + "."
             for index in range(rows)]
    datasets.Dataset.from_dict({"key": [f"r{index:04d}" for index in range(rows)], "text": texts}).to_parquet(str(path))


def timed(command: list[str], environment: dict) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - started


def samples_by_key(rows) -> dict:
    return {row["key"]: soundfile.read(io.BytesIO(row["audio"]["bytes"]), dtype="float32")[0].tolist()
            for row in rows}


def from_disk(folder: Path) -> dict:
    made = datasets.load_from_disk(str(folder)).cast_column("audio", datasets.Audio(decode=False))
    return samples_by_key(made)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--frames", type=int, default=6, help="max_new_tokens of every row")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each command (the best kept)")
    parser.add_argument("--output", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="drama3-engines-"))
    source = folder / "texts.parquet"
    write_rows(source, args.rows)
    checkpoint = default_tiny_checkpoint()
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    job = ["-m", "transformers_drama3.cli", "--model", checkpoint, "--dataset", str(source), "--id-column", "key",
           "--max-new-tokens", str(args.frames), "--batch-size", str(args.batch_size), "--quiet", "--output-dataset"]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision",
                  "no", "--dynamo_backend", "no"]
    figures = {"rows": args.rows, "frames": args.frames, "batch_size": args.batch_size, "machine": platform.machine(),
               "cpus": os.cpu_count(), "OMP_NUM_THREADS": environment["OMP_NUM_THREADS"],
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    commands = {"plain": [sys.executable, *job], "accelerate_1": [*accelerate, "--num_processes", "1", *job],
                "accelerate_2": [*accelerate, "--multi_gpu", "--num_processes", "2", *job]}
    for repeat in range(args.repeats):  # alternately; the best of each is kept (the first run also warms the disk)
        for name, command in commands.items():
            seconds = timed([*command, str(folder / f"{name}{repeat}")], environment)
            figures[f"{name}_s"] = min(seconds, figures.get(f"{name}_s", seconds))
    plain = from_disk(folder / "plain0")
    assert all(from_disk(folder / f"{name}{repeat}") == plain for name in commands for repeat in range(args.repeats))

    import ray
    import ray.data

    from transformers_drama3.jobs_ray import Drama3Predictor, read_source

    started = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": environment["OMP_NUM_THREADS"]}})
    figures["ray_init_s"] = time.perf_counter() - started
    for actors in (1, 2):
        started = time.perf_counter()
        read_source(str(source), ray.data, rows_per_block=args.batch_size).map_batches(
            Drama3Predictor, batch_format="pyarrow", batch_size=args.batch_size, concurrency=actors, num_cpus=1,
            fn_constructor_kwargs={"model": checkpoint, "device": "cpu", "columns": {"id": "key", "text": "text"},
                                   "max_new_tokens": args.frames},
        ).write_parquet(str(folder / f"ray{actors}"))
        figures[f"ray_{actors}_s"] = time.perf_counter() - started
        written = datasets.load_dataset("parquet", data_dir=str(folder / f"ray{actors}"), split="train",
                                        cache_dir=str(folder / "cache"))
        assert samples_by_key(written) == plain, f"Ray with {actors} actor(s) made other audio"
    ray.shutdown()

    figures["accelerate_startup_s"] = figures["accelerate_1_s"] - figures["plain_s"]
    figures["accelerate_2_over_1"] = figures["plain_s"] / figures["accelerate_2_s"]
    figures["ray_per_row_ms"] = 1000 * (figures["ray_1_s"] - figures["plain_s"]) / args.rows
    figures["ray_2_over_1"] = figures["ray_1_s"] / figures["ray_2_s"]
    print(json.dumps(figures, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
