"""The engines of an offline job side by side, each on 1 and on 2 workers, in one run (docs/scaling.md,
docs/performance.md#jobs-on-three-engines): a `--rows`-row parquet file of texts spoken into an audio dataset, at
most `--frames` frames a row, by

1. the plain job: `drama3-tts --dataset X --output-dataset OUT` in one process, and under
   `torchrun --standalone --nproc_per_node 2` (two ranks with a whole model each, sharing batches dynamically);
2. `accelerate launch --num_processes 1` of the same command, and `--multi_gpu --num_processes 2`;
3. Ray Data: `ray.init(num_cpus=4)` (timed: Ray's start-up), then `drama3-ray`'s pipeline (`speech_pipeline`:
   `ReferenceEncoder` on one CPU actor -> `Drama3Predictor` on 1 or 2 actors -> `write_parquet`; the file cut into
   blocks of a batch: an actor takes a block at a time). Ray's CPUs are scheduling slots, not cores: each actor takes
   one, and the reading and writing tasks need slots of their own.

Each command's wall time is measured whole (imports, start-up, loading, the job, writing). Start-up is measured as
the same command on a 1-row file (`startup_*`), so that `job_over_startup` says how many times the start-up the job
itself took. The load average of the machine is recorded before and after (other people's work shares the cores).
Every output is checked against the plain job's: the datasets' audio decodes (with soundfile, from the stored bytes)
to the same samples, row for row.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/jobs_engines.py --rows 96 --frames 64 \
        --output engines.json
    # a larger job, fewer engines (within ~10 minutes on 2 shared cores):
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/jobs_engines.py --rows 240 --engines plain,ray
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
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--frames", type=int, default=64, help="max_new_tokens of every row")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--output", type=Path, help="write the figures here as JSON")
    parser.add_argument("--engines", default="plain,accelerate,ray",
                        help="which engines, comma-separated (plain always runs: every output is checked against it)")
    args = parser.parse_args()
    engines = ["plain", *(name for name in ("accelerate", "ray") if name in args.engines.split(","))]

    folder = Path(tempfile.mkdtemp(prefix="drama3-engines-"))
    source, one_row = folder / "texts.parquet", folder / "one.parquet"
    write_rows(source, args.rows)
    write_rows(one_row, 1)
    checkpoint = default_tiny_checkpoint()
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    job = ["-m", "transformers_drama3.cli", "--model", checkpoint, "--id-column", "key", "--max-new-tokens",
           str(args.frames), "--batch-size", str(args.batch_size), "--quiet"]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision",
                  "no", "--dynamo_backend", "no"]
    figures = {"rows": args.rows, "frames": args.frames, "batch_size": args.batch_size, "machine": platform.machine(),
               "cpus": os.cpu_count(), "OMP_NUM_THREADS": environment["OMP_NUM_THREADS"],
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": os.getloadavg()}

    commands = {"plain_1": [sys.executable, *job],
                "plain_2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            *job],
                "accelerate_1": [*accelerate, "--num_processes", "1", *job],
                "accelerate_2": [*accelerate, "--multi_gpu", "--num_processes", "2", *job]}
    commands = {name: command for name, command in commands.items() if name[:-2] in engines}
    for name in commands:
        if not name.endswith("_1"):
            continue
        figures[f"startup_{name[:-2]}_s"] = timed(
            [*commands[name], "--dataset", str(one_row), "--output-dataset", str(folder / f"{name}-one")], environment)
    for name, command in commands.items():
        figures[f"{name}_s"] = timed([*command, "--dataset", str(source), "--output-dataset", str(folder / name)],
                                     environment)
    plain = from_disk(folder / "plain_1")
    assert all(from_disk(folder / name) == plain for name in commands), "an engine made other audio"

    if "ray" in engines:
        run_ray(args, figures, folder, source, one_row, checkpoint, environment, plain)
    figures["load_after"] = os.getloadavg()
    for engine in engines:
        one, two, startup = (figures[f"{engine}_1_s"], figures[f"{engine}_2_s"], figures[f"startup_{engine}_s"])
        figures[f"{engine}_2_over_1"] = one / two  # the speed-up of a second worker
        figures[f"{engine}_1_vs_plain"] = one / figures["plain_1_s"]  # the engine's cost, on 1 worker
        figures[f"{engine}_job_over_startup"] = (one - startup) / startup
    print(json.dumps(figures, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(figures, indent=2) + "\n")


def run_ray(args, figures: dict, folder: Path, source: Path, one_row: Path, checkpoint: str, environment: dict,
            plain: dict) -> None:
    """Ray's figures: `ray.init`, its start-up on the 1-row file, then 1 and 2 generating actors."""
    import ray
    import ray.data

    from transformers_drama3.jobs_ray import speech_pipeline

    started = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": environment["OMP_NUM_THREADS"]}})
    figures["ray_init_s"] = time.perf_counter() - started
    for name, path, actors in (("startup_ray", one_row, 1), ("ray_1", source, 1), ("ray_2", source, 2)):
        started = time.perf_counter()
        rows = ray.data.read_parquet(str(path)).repartition(target_num_rows_per_block=args.batch_size)
        speech_pipeline(rows, checkpoint,
                        batch_size=args.batch_size, concurrency=actors, device="cpu",
                        columns={"id": "key", "text": "text"}, max_new_tokens=args.frames,
                        ).write_parquet(str(folder / name))
        figures[f"{name}_s"] = time.perf_counter() - started
    figures["startup_ray_s"] += figures["ray_init_s"]
    for name in ("ray_1", "ray_2"):
        written = datasets.load_dataset("parquet", data_dir=str(folder / name), split="train",
                                        cache_dir=str(folder / "cache"))
        assert samples_by_key(written) == plain, f"{name} made other audio"
    ray.shutdown()
    figures["ray_1_s"] += figures["ray_init_s"]  # a driver's whole run, as the commands above are timed whole
    figures["ray_2_s"] += figures["ray_init_s"]


if __name__ == "__main__":
    main()
