"""The linear-attention layers in a compiled CPU frame step: the CPU path's one-token step (`CpuGatedDeltaNet`,
cpu_linear_attention.py) against transformers' own layer, side by side in one process.

Two models of the same random weights are built in memory at the real width (`configs.model_config("real")`, the
first `--layers` backbone layers: with 4, three linear-attention layers and one full-attention layer), with
`--experts` routed experts per layer instead of 256 (the experts do not touch linear attention; 256 of them would
need the checkpoint writer and tens of GB, benchmarks/cpu_real_width.py), and brought to the CPU path `--path`. One
of them then gets transformers' `Qwen3_5MoeGatedDeltaNet` back. Each runs the frame step `generate` runs, compiled
by inductor in this process (the runner of benchmarks/frame_step.py after a 50-row prefill); after 4 warm-up
frames the two are timed frame by frame in turn (`--frames` each, thread CPU time, `time.thread_time`), and then
`torch.profiler` records `--op-frames` frames of each, with inductor's kernels named by the operations they fuse.
The report gives each variant's median frame, and per frame its fused kernels that read the recurrent state
(those fusing the rule's `exp` with the norms' `rsqrt`) and the batched products (`aten::bmm`) and the operations
that take the most time.

    python benchmarks/cpu_linear_attention.py --threads 1 --layers 4 --path int8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from configs import model_config
from cpu_path import step_prompt
from frame_step import loaded_runner
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.cpu_linear_attention import CpuGatedDeltaNet
from transformers_drama3.cpu_path import apply_cpu_path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--layers", type=int, default=4, help="backbone layers (default 4)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per layer (default 16)")
    parser.add_argument("--path", default="int8", choices=["float16", "int8", "bfloat16"], help="CPU path")
    parser.add_argument("--frames", type=int, default=12, help="timed frames per variant (default 12)")
    parser.add_argument("--op-frames", type=int, default=5, help="frames under torch.profiler (default 5)")
    parser.add_argument("--output", default=None, help="where to write the JSON results")
    return parser.parse_args()


def built(args: argparse.Namespace, linear_attention: str) -> FishOmniForSpeech:
    """The model of the module docstring (seed 0), on `args.path`, with `linear_attention` "cpu" or "transformers"."""
    config = model_config("real", layers=args.layers)
    config.text_config.num_experts = args.experts
    torch.manual_seed(0)
    model = FishOmniForSpeech(config).eval()
    apply_cpu_path(model, args.path)
    if linear_attention == "transformers":
        for module in model.modules():
            if type(module) is CpuGatedDeltaNet:
                module.__class__ = Qwen3_5MoeGatedDeltaNet
    return model


def operations(prof, frames: int, rows: int = 8) -> dict:
    """Per frame: the state-reading fused kernels, the batched products, and the `rows` costliest operations (ms)."""
    averages = prof.key_averages()
    per_frame = {event.key: event.self_cpu_time_total / 1e3 / frames for event in averages}
    state_kernels = {key: ms for key, ms in per_frame.items() if "cpp_fused" in key and "exp" in key and "rsqrt" in key}
    top = dict(sorted(per_frame.items(), key=lambda item: -item[1])[:rows])
    return {"state_kernels_ms": round(sum(state_kernels.values()), 3), "bmm_ms": round(per_frame.get("aten::bmm", 0.0), 3),
            "top_ms": {key[:100]: round(ms, 3) for key, ms in top.items()}}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # Name inductor's kernels by the operations they fuse and record each one under torch.profiler.
    inductor_config.cpp.enable_kernel_profile = True
    inductor_config.cpp.descriptive_names = "original_aten"
    variants = ("cpu", "transformers")
    runners, times = {}, {name: [] for name in variants}
    with torch.no_grad():
        for name in variants:
            model = built(args, name)
            started = time.perf_counter()
            runners[name] = loaded_runner(model, step_prompt(model), 0, compile_step=True)
            for _ in range(4):
                runners[name].step()
            print(f"{name}: compiled and warm in {time.perf_counter() - started:.0f} s", flush=True)
        for _ in range(args.frames):
            for name in variants:
                started = time.thread_time()
                runners[name].step()
                times[name].append(1e3 * (time.thread_time() - started))
        profiles = {}
        for name in variants:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.op_frames):
                    runners[name].step()
            profiles[name] = operations(prof, args.op_frames)
    result = {"threads": args.threads, "layers": args.layers, "experts": args.experts, "path": args.path,
              "torch": torch.__version__, "loadavg": os.getloadavg(),
              "frame_ms": {name: round(statistics.median(times[name]), 2) for name in variants},
              "frame_ms_all": {name: [round(t, 1) for t in times[name]] for name in variants}, "operations": profiles}
    result["ratio"] = round(result["frame_ms"]["cpu"] / result["frame_ms"]["transformers"], 3)
    for name in variants:
        ops = profiles[name]
        print(f"{name:12s} frame {result['frame_ms'][name]:7.1f} ms (thread CPU, median of {args.frames}); state "
              f"kernels {ops['state_kernels_ms']:.2f} ms, bmm {ops['bmm_ms']:.2f} ms a frame")
        for key, ms in ops["top_ms"].items():
            print(f"    {ms:8.2f} ms  {key}")
    print(f"ratio cpu / transformers: {result['ratio']}  (threads {args.threads}, load {result['loadavg']})")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
