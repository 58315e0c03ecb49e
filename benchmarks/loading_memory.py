"""Peak resident memory while `FishOmniForSpeech.from_pretrained` loads a checkpoint of a few GB, and the bytes of
the loaded model, per way of loading the routed experts.

The checkpoint is a random one in the original layout, written (streamed, one shard in memory at a time) by
`write_tiny_checkpoint` with larger dimensions (FP8 experts by default, or bf16 everywhere with
`--bf16-checkpoint`), into a temporary directory that is deleted afterwards. `--full-width` writes the real
topology at full width (hidden 2048, 256 experts of 512, top-8, the real 248,320-token vocabulary, the real
13-layer tower) with `--layers` backbone layers; its codec is the tiny one (the real codec's 1.62 GB in float32 is a
constant, added by `model_size.py`). `--settings` names the loads, each measured in its own fresh process:
`fp8-kept` (the default), `dequantise` (`BsgemmMoeConfig(dequantize=True)`), `4bit` (`BitsAndBytesConfig(
load_in_4bit=True)` as users write it), `4bit-24gb` (nf4 with double quantisation, the tower 4-bit too, only the
candidate rows of lm_head: the 24 GB configuration of docs/hardware.md). The load runs in a fresh subprocess that polls its own `/proc/self/status` every 5 ms: anonymous
memory (`RssAnon`: tensors the process owns) and file-backed memory (`RssFile`: pages of the memory-mapped
safetensors files, which the kernel can drop at any time) are reported apart, with `ru_maxrss` as a cross-check.
The baseline is taken after the imports, right before the load.

    python benchmarks/loading_memory.py --output loading-memory.json
    python benchmarks/loading_memory.py --bf16-checkpoint --output loading-memory-bf16.json
    python benchmarks/loading_memory.py --full-width --layers 2,4,8 --settings fp8-kept,4bit,4bit-24gb \
        --directory /path/to/scratch --output loading-memory-full-width.json
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
# The real topology at full width (FishOmniConfig()'s values), in the original config.json schema.
FULL_TEXT = {"vocab_size": 248320, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
             "head_dim": 256, "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
             "linear_value_head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
             "shared_expert_intermediate_size": 512, "max_position_embeddings": 32768}
FULL_TOWER = {"dim": 2048, "text_dim": 2048, "n_head": 16, "n_local_heads": 2, "head_dim": 256, "n_layer": 4,
              "shared_enrichment_layers": 4, "intermediate_size": 6144, "vocab_size": 4096}

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

from transformers import BitsAndBytesConfig
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig

SETTINGS = {
    "fp8-kept": {},
    "dequantise": {"quantization_config": BsgemmMoeConfig(dequantize=True)},
    "4bit": {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)},
    "4bit-24gb": {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                             bnb_4bit_use_double_quant=True,
                                                             llm_int8_skip_modules=["lm_head"]),
                  "candidate_head_rows_only": True},
}

def tensor_bytes(t):
    return t.numel() * t.element_size()

def model_bytes(model):
    # Parameters and buffers, with bitsandbytes' block statistics (a Params4bit's absmax, an Int8Params' SCB).
    total = sum(tensor_bytes(b) for b in model.buffers())
    for p in model.parameters():
        total += tensor_bytes(p)
        state = getattr(p, "quant_state", None)
        if state is not None:
            total += tensor_bytes(state.absmax) + (tensor_bytes(state.state2.absmax) if state.nested else 0)
        if getattr(p, "SCB", None) is not None:
            total += tensor_bytes(p.SCB)
    return total

thread = threading.Thread(target=poll)
thread.start()
start = time.perf_counter()
model = FishOmniForSpeech.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]), **SETTINGS[sys.argv[3]])
seconds = time.perf_counter() - start
done.set()
thread.join()
loaded = model_bytes(model)
codec = sum(tensor_bytes(t) for t in model.codec.state_dict().values())
print(json.dumps({"baseline": baseline, "peak": peak, "after": status(), "loaded_bytes": loaded, "codec_bytes": codec,
                  "seconds": seconds, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16-checkpoint", action="store_true", help="write bf16 experts instead of FP8")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="load dtype")
    parser.add_argument("--directory", default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--output", default="loading-memory.json", help="where to write the JSON results")
    parser.add_argument("--full-width", action="store_true", help="the real topology at full width (see above)")
    parser.add_argument("--layers", default="16", help="backbone layer counts, comma-separated (one checkpoint each)")
    parser.add_argument("--settings", default="fp8-kept", help="comma-separated: fp8-kept, dequantise, 4bit, 4bit-24gb")
    return parser.parse_args()


def geometry(full_width: bool, layers: int) -> dict:
    text, tower = (FULL_TEXT, FULL_TOWER) if full_width else (BIG_TEXT, BIG_TOWER)
    overrides = {"text_config": {**text, "num_hidden_layers": layers}, "audio_decoder_config": tower}
    if full_width:  # the tiny codec, with the real codebook sizes the tower's vocabulary requires
        overrides["codec_config"] = {"quantizer": {"codebook_size": 4096, "semantic_codebook_size": 4096}}
    return overrides


def write_checkpoint(directory: str, bf16: bool, overrides: dict) -> float:
    """Write the big random checkpoint; returns its size in bytes (safetensors + codec.pth)."""
    from transformers_drama3.testing import write_tiny_checkpoint

    overrides = dict(overrides)
    if bf16:
        overrides["quantization_config"] = None
    write_tiny_checkpoint(directory, seed=0, max_shard_size="1GB", **overrides)
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
               if name.endswith((".safetensors", ".pth")))


def measure(directory: str, dtype: str, setting: str) -> dict:
    subprocess.run(["sync"], check=False)
    result = subprocess.run([sys.executable, "-c", CHILD, directory, dtype, setting], capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(checkpoint_bytes: float, child: dict) -> dict:
    base, peak, after = child["baseline"], child["peak"], child["after"]
    figures = {
        "checkpoint_gb": checkpoint_bytes / GB,
        "loaded_model_gb": child["loaded_bytes"] / GB,
        "loaded_codec_gb": child["codec_bytes"] / GB,
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
    return {key: round(value, 3) for key, value in figures.items()}


def main() -> None:
    args = parse_args()
    results = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "checkpoint": "bf16" if args.bf16_checkpoint else "FP8 experts (bsgemm-moe)",
        "load_dtype": args.dtype,
        "runs": [],
    }
    for layers in (int(n) for n in args.layers.split(",")):
        overrides = geometry(args.full_width, layers)
        directory = tempfile.mkdtemp(prefix="drama3-loading-memory-", dir=args.directory)
        try:
            start = time.perf_counter()
            checkpoint_bytes = write_checkpoint(directory, args.bf16_checkpoint, overrides)
            print(f"{layers} layers: wrote {checkpoint_bytes / GB:.2f} GB in {time.perf_counter() - start:.0f} s")
            for setting in args.settings.split(","):
                figures = report(checkpoint_bytes, measure(directory, args.dtype, setting))
                results["runs"].append({"layers": layers, "setting": setting, "geometry": overrides, "figures": figures})
                print(f"  {setting}: " + ", ".join(f"{key} {value}" for key, value in figures.items()))
                with open(args.output, "w") as f:
                    json.dump(results, f, indent=2)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
