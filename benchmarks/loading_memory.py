"""Peak resident memory while `FishOmniForSpeech.from_pretrained` loads a checkpoint of a few GB.

The checkpoint is a random one in the original layout, written by `write_tiny_checkpoint` with larger dimensions
(FP8 experts by default, or bf16 everywhere with `--bf16-checkpoint`), into a temporary directory that is deleted
afterwards. The load runs in a fresh subprocess that polls its own `/proc/self/status` every 5 ms: anonymous
memory (`RssAnon`: tensors the process owns) and file-backed memory (`RssFile`: pages of the memory-mapped
safetensors files, which the kernel can drop at any time) are reported apart, with `ru_maxrss` as a cross-check.
The baseline is taken after the imports, right before the load.

    python benchmarks/loading_memory.py --output loading-memory.json
    python benchmarks/loading_memory.py --bf16-checkpoint --output loading-memory-bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

GB = 1e9

# Larger than the tiny default: hidden 1024, 16 layers of 96 experts (~2.5 GB of FP8 experts).
BIG_TEXT = {"hidden_size": 1024, "num_hidden_layers": 16, "num_experts": 96, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
BIG_TOWER = {"dim": 1024, "text_dim": 1024}

# Runs in the subprocess: load, polling the process's own memory from a thread.
CHILD = r"""
import json, resource, sys, threading, time
import torch
import transformers_drama3
from transformers_drama3 import FishOmniForSpeech

def status():
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields

peak = status()
baseline = dict(peak)
done = threading.Event()

def poll():
    while not done.is_set():
        for key, value in status().items():
            peak[key] = max(peak[key], value)
        time.sleep(0.005)

thread = threading.Thread(target=poll)
thread.start()
start = time.perf_counter()
model = FishOmniForSpeech.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
seconds = time.perf_counter() - start
done.set()
thread.join()
loaded = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
print(json.dumps({"baseline": baseline, "peak": peak, "after": status(), "loaded_bytes": loaded, "seconds": seconds,
                  "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16-checkpoint", action="store_true", help="write bf16 experts instead of FP8")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="load dtype")
    parser.add_argument("--directory", default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--output", default="loading-memory.json", help="where to write the JSON results")
    return parser.parse_args()


def write_checkpoint(directory: str, bf16: bool) -> float:
    """Write the big random checkpoint; returns its size in bytes (safetensors + codec.pth)."""
    from transformers_drama3.testing import write_tiny_checkpoint

    overrides = {"text_config": BIG_TEXT, "audio_decoder_config": BIG_TOWER}
    if bf16:
        overrides["quantization_config"] = None
    write_tiny_checkpoint(directory, seed=0, max_shard_size="1GB", **overrides)
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
               if name.endswith((".safetensors", ".pth")))


def measure(directory: str, dtype: str) -> dict:
    subprocess.run(["sync"], check=False)
    result = subprocess.run([sys.executable, "-c", CHILD, directory, dtype], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(checkpoint_bytes: float, child: dict, args: argparse.Namespace) -> dict:
    base, peak, after = child["baseline"], child["peak"], child["after"]
    figures = {
        "checkpoint_gb": checkpoint_bytes / GB,
        "loaded_model_gb": child["loaded_bytes"] / GB,
        "load_seconds": child["seconds"],
        "peak_rss_gb": peak["VmRSS"] / GB,
        "peak_rss_over_baseline_gb": (peak["VmRSS"] - base["VmRSS"]) / GB,
        "peak_anon_over_baseline_gb": (peak["RssAnon"] - base["RssAnon"]) / GB,
        "peak_file_gb": peak["RssFile"] / GB,
        "anon_after_load_over_baseline_gb": (after["RssAnon"] - base["RssAnon"]) / GB,
        "ru_maxrss_gb": child["ru_maxrss"] / GB,
    }
    figures["ratio_peak_rss_over_checkpoint"] = figures["peak_rss_over_baseline_gb"] / figures["checkpoint_gb"]
    figures["ratio_peak_anon_over_loaded_model"] = figures["peak_anon_over_baseline_gb"] / figures["loaded_model_gb"]
    return {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "checkpoint": "bf16" if args.bf16_checkpoint else "FP8 experts (bsgemm-moe)",
        "load_dtype": args.dtype,
        "geometry": {"text_config": BIG_TEXT, "audio_decoder_config": BIG_TOWER},
        "figures": {key: round(value, 3) for key, value in figures.items()},
    }


def main() -> None:
    args = parse_args()
    directory = args.directory or tempfile.mkdtemp(prefix="drama3-loading-memory-")
    try:
        start = time.perf_counter()
        checkpoint_bytes = write_checkpoint(directory, args.bf16_checkpoint)
        print(f"wrote {checkpoint_bytes / GB:.2f} GB in {time.perf_counter() - start:.0f} s to {directory}")
        results = report(checkpoint_bytes, measure(directory, args.dtype), args)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for key, value in results["figures"].items():
        print(f"{key:38s} {value}")
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
