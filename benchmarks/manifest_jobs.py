"""Throughput of manifest jobs (`drama3-tts --manifest`): 2 ranks against 1, and batching by length against file
order, each pair measured side by side in one run.

The manifest mixes short and long texts (alternating, so file order puts a long text in every batch): `--items`
items, each `--frames` frames at most (greedy, so every run makes the same frames).

1. Ranks: the same job run by `drama3-tts --manifest` in one process and by `torchrun --nproc-per-node 2` (gloo,
   a whole model per rank), alternately, `--repeats` times each. Reported: the wall time of the whole command
   (start-up and loading included) and the job's own time (the longest rank's summed batch times, from
   results.jsonl), as audio seconds per second, and their ratios.
2. Order: in this process, one model loaded once, `run_manifest` with `sort_by_length=True` and with `False`,
   alternately, `--repeats` times each (the best of each reported).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/manifest_jobs.py --output jobs.json
    python benchmarks/manifest_jobs.py --checkpoint DIR --items 64 --frames 200     # a real checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from transformers_drama3 import loading
from transformers_drama3.jobs import records_in, run_manifest
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.testing import default_tiny_checkpoint

SHORT = ["Yes.", "No, thanks.", "See you soon.", "Right away."]
LONG = ("The storm had passed by morning, and the village woke to a sky washed clean; children ran along the "
        "harbour wall while the fishermen counted their nets and argued, as they always did, about the weather to "
        "come and the price of cod at the market in town.")


def write_manifest(folder: Path, items: int) -> Path:
    path = folder / "mix.jsonl"
    lines = [json.dumps({"id": f"item{index:03d}", "text": LONG if index % 2 else SHORT[index // 2 % len(SHORT)]})
             for index in range(items)]
    path.write_text("\n".join(lines) + "\n")
    return path


def job_seconds(results: Path) -> tuple[float, float]:
    """(the longest rank's summed batch time, audio seconds) of a finished job."""
    per_rank: dict[int, float] = {}
    audio = 0.0
    for record in records_in(results):
        if record["status"] == "done":
            per_rank[record["rank"]] = per_rank.get(record["rank"], 0.0) + record["time_s"]
            audio += record["seconds"]
    return max(per_rank.values()), audio


def run_command(checkpoint: str, manifest: Path, output: Path, ranks: int, args) -> dict:
    flags = ["--model", checkpoint, "--manifest", str(manifest), "--output-dir", str(output), "--greedy",
             "--max-new-tokens", str(args.frames), "--batch-size", str(args.batch_size), "--quiet"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    environment = {key: value for key, value in os.environ.items() if key != "WORLD_SIZE"}
    started = time.perf_counter()
    subprocess.run([*launcher, "-m", "transformers_drama3.cli", *flags], check=True, env=environment)
    wall = time.perf_counter() - started
    job, audio = job_seconds(output / "results.jsonl")
    return {"ranks": ranks, "wall_s": round(wall, 2), "job_s": round(job, 2), "audio_s": round(audio, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the embedded tiny checkpoint)")
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    checkpoint = args.checkpoint or default_tiny_checkpoint()
    folder = Path(tempfile.mkdtemp(prefix="drama3-jobs-bench-"))
    manifest = write_manifest(folder, args.items)

    ranks = []
    for repeat in range(args.repeats):
        for count in (1, 2):
            ranks.append(run_command(checkpoint, manifest, folder / f"ranks{count}-{repeat}", count, args))
            print(ranks[-1], flush=True)

    model = loading.load_model(checkpoint, "cpu", torch.float32)
    processor = Drama3Processor.from_pretrained(checkpoint)
    order = []
    for repeat in range(args.repeats):
        for by_length in (True, False):
            output = folder / f"order-{by_length}-{repeat}"
            started = time.perf_counter()
            summary = run_manifest(model, processor, manifest, output, batch_size=args.batch_size, do_sample=False,
                                   max_new_tokens=args.frames, sort_by_length=by_length, show_progress=False)
            order.append({"by_length": by_length, "job_s": round(time.perf_counter() - started, 2),
                          "audio_s": round(summary.seconds, 2)})
            print(order[-1], flush=True)

    def best(rows, **match):
        return min((row for row in rows if all(row[k] == v for k, v in match.items())), key=lambda row: row["job_s"])

    one, two = best(ranks, ranks=1), best(ranks, ranks=2)
    sorted_run, file_order = best(order, by_length=True), best(order, by_length=False)
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "threads": os.environ.get("OMP_NUM_THREADS"), "items": args.items, "frames": args.frames,
        "batch_size": args.batch_size, "ranks": ranks, "order": order,
        "two_ranks_vs_one_job": round(one["job_s"] / two["job_s"], 2),
        "two_ranks_vs_one_wall": round(min(r["wall_s"] for r in ranks if r["ranks"] == 1)
                                       / min(r["wall_s"] for r in ranks if r["ranks"] == 2), 2),
        "by_length_vs_file_order": round(file_order["job_s"] / sorted_run["job_s"], 2),
    }
    print(json.dumps(report, indent=1))
    if args.output:
        args.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
