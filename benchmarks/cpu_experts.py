"""One layer of routed experts on the CPU path (`cpu_weights.CpuExperts`), eager against compiled, side by side.

A decode step routes each of its tokens to `top_k` of the layer's experts; the CPU path multiplies those experts'
stored matrices (float16 or int8) one (token, expert) pair at a time. This times one layer's experts forward the way a
frame meets it, eagerly and inside `torch.compile(fullgraph=True)` (the stored frame step is compiled so), with a
different random routing at every call (so the experts' weights come from memory, not from the cache), rounds
interleaved across the variants, thread CPU time per call (`time.thread_time`, steadier than wall time on a shared
machine) and wall time. The compiled output is checked against the eager one on the same routing first.

Random weights at the real width by default (`FishOmniConfig()`'s text config: 256 experts of 2048 x 512, top 8):
1.5 GiB in float16, 0.75 GiB in int8; `--config small` takes the `small` geometry of configs.py (16 experts of 512 x
256, top 4). It uses only the package's public names, so it also runs against an older checkout
(`PYTHONPATH=<checkout>/src`).

    python benchmarks/cpu_experts.py --threads 1
    python benchmarks/cpu_experts.py --threads 2 --formats int8 --tokens 1,4 --output experts.json
    python benchmarks/cpu_experts.py --config small
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from configs import model_config

from transformers_drama3 import FishOmniConfig
from transformers_drama3.cpu_weights import CpuExperts, cpu_experts_forward, stored


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--config", choices=("real", "small"), default="real", help="the layer's geometry")
    parser.add_argument("--formats", default="float16,int8", help="comma-separated weight formats (default both)")
    parser.add_argument("--tokens", default="1", help="comma-separated tokens per call, a decode step's slots")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--calls", type=int, default=40, help="timed calls per variant and round (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="where to write the JSON results")
    return parser.parse_args()


def random_experts(config, weight_format: str) -> CpuExperts:
    """Random `CpuExperts` of `config`'s geometry, quantised 16 experts at a time (a float32 copy of the whole layer
    would be 3 GiB)."""
    experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
    tensors = {}
    for name, shape in (("gate_up_proj", (2 * inner, hidden)), ("down_proj", (hidden, inner))):
        parts = [stored(torch.randn(min(16, experts - first), *shape) * shape[1] ** -0.5, weight_format)
                 for first in range(0, experts, 16)]
        tensors[name] = tuple(torch.cat(pieces) for pieces in zip(*parts))
    return CpuExperts(config, tensors, weight_format).eval()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = FishOmniConfig().text_config if args.config == "real" else model_config("small").text_config
    token_counts = [int(t) for t in args.tokens.split(",")]
    variants, results = {}, {}
    for weight_format in args.formats.split(","):
        module = random_experts(config, weight_format)
        eager = lambda h, i, w, module=module: cpu_experts_forward(module, h, i, w)  # noqa: E731
        for tokens in token_counts:
            for mode, function in (("eager", eager), ("compiled", torch.compile(eager, fullgraph=True))):
                variants[f"{weight_format}, {tokens} token(s), {mode}"] = (function, tokens)

    def routing(tokens: int):
        hidden = torch.randn(tokens, config.hidden_size)
        ids = torch.stack([torch.randperm(config.num_experts)[: config.num_experts_per_tok] for _ in range(tokens)])
        return hidden, ids, torch.rand(tokens, config.num_experts_per_tok).softmax(-1)

    with torch.inference_mode():
        for name, (function, tokens) in variants.items():  # compile, warm up, and check against the eager output
            inputs = routing(tokens)
            out = function(*inputs)
            reference = variants[name.replace("compiled", "eager")][0](*inputs)
            difference = float((out - reference).abs().max())
            results[name] = {"max_abs_diff_from_eager": difference, "cpu_ms": [], "wall_ms": []}
            for _ in range(3):
                function(*routing(tokens))
        for _ in range(args.rounds):
            for name, (function, tokens) in variants.items():
                calls = [routing(tokens) for _ in range(args.calls)]
                cpu, wall = time.thread_time(), time.perf_counter()
                for inputs in calls:
                    function(*inputs)
                results[name]["cpu_ms"].append((time.thread_time() - cpu) / args.calls * 1e3)
                results[name]["wall_ms"].append((time.perf_counter() - wall) / args.calls * 1e3)
    print(f"threads {args.threads}; {config.num_experts} experts of {config.hidden_size} x "
          f"{config.moe_intermediate_size}, top {config.num_experts_per_tok}; torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, result in results.items():
        print(f"{name:36s} thread CPU ms a call: median {statistics.median(result['cpu_ms']):7.2f} "
              f"(rounds {', '.join(f'{v:.2f}' for v in result['cpu_ms'])}); wall median "
              f"{statistics.median(result['wall_ms']):.2f}; "
              f"max |compiled - eager| {result['max_abs_diff_from_eager']:.2e}")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"threads": args.threads, "torch": torch.__version__, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
