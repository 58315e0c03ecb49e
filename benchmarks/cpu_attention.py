"""One decode step's attention on a CPU: the CPU path's (`cpu_attention.cpu_sdpa_forward`, a group's query heads
packed as rows of their key/value head) against transformers' `sdpa` with each key/value head copied once per query
head of its group (what a compiled step ran before it), torch's kernel sharing the groups itself (`enable_gqa=True`)
and transformers' own `sdpa_attention_forward` as an eager step runs it (5.25 and later pack the groups too).

One query row per sequence over a cache window (an additive mask hides its unused rows), the real model's geometry by
default (16 query heads, 2 key/value heads of 256: the backbone's full-attention layers and the tower), each variant
called on fresh inputs in turn (40 different caches, so they come from memory as a step's do), rounds interleaved,
thread CPU time per call (`time.thread_time`), median over rounds. Each variant's largest difference from the
copied-heads output is reported (float32 reordering, or 0).

    python benchmarks/cpu_attention.py --threads 1 --windows 256,1024,4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from transformers_drama3.cpu_attention import cpu_sdpa_forward


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--windows", default="256,1024,4096", help="comma-separated cache windows (rows)")
    parser.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    parser.add_argument("--head-dim", type=int, default=256, help="head size (default 256)")
    parser.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40, help="calls per variant and round, each on its own cache")
    parser.add_argument("--output", default=None, help="where to write the JSON results")
    return parser.parse_args()


class Layer(torch.nn.Module):
    """What the kernels read of an attention layer: its query heads per key/value head."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def copied_heads(module, query, key, value, mask, scaling):
    """transformers' `sdpa` on copied key/value heads, as a compiled step ran it -> `[b, 1, H, d]`."""
    groups = module.num_key_value_groups
    out = torch.nn.functional.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups),
                                                           attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def grouped_in_kernel(module, query, key, value, mask, scaling):
    """torch's kernel sharing each key/value head among its query heads (`enable_gqa`) -> `[b, 1, H, d]`."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


VARIANTS = {"cpu path (groups packed as rows)": cpu_sdpa_forward, "sdpa on copied heads": copied_heads,
            "enable_gqa in the kernel": grouped_in_kernel, "transformers sdpa, eager": sdpa_attention_forward}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    module, scaling = Layer(args.heads // args.kv_heads), args.head_dim**-0.5
    results = {}
    with torch.inference_mode():
        for window in (int(w) for w in args.windows.split(",")):
            generator = torch.Generator().manual_seed(window)
            query = torch.randn(args.batch, args.heads, 1, args.head_dim, generator=generator)
            caches = [tuple(torch.randn(args.batch, args.kv_heads, window, args.head_dim, generator=generator)
                            for _ in range(2)) for _ in range(args.calls)]
            used = window - window // 4  # rows in use; the mask hides the rest
            mask = torch.where(torch.arange(window) < used, 0.0, torch.finfo(torch.float32).min)[None, None, None]
            reference, _ = copied_heads(module, query, *caches[0], mask, scaling)
            for name, function in VARIANTS.items():
                out, _ = function(module, query, *caches[0], mask, scaling=scaling)
                results[(window, name)] = {"max_abs_diff": float((out - reference).abs().max()), "cpu_us": []}
            for _ in range(args.rounds):
                for name, function in VARIANTS.items():
                    start = time.thread_time()
                    for key, value in caches:
                        function(module, query, key, value, mask, scaling=scaling)
                    results[(window, name)]["cpu_us"].append((time.thread_time() - start) / args.calls * 1e6)
    print(f"threads {args.threads}; {args.heads} query heads, {args.kv_heads} key/value heads of {args.head_dim}; "
          f"batch {args.batch}; torch {torch.__version__}; load average {os.getloadavg()[0]:.1f}")
    for (window, name), result in results.items():
        print(f"window {window:5d}  {name:40s} thread CPU us a call: median {statistics.median(result['cpu_us']):9.0f} "
              f"(rounds {', '.join(f'{v:.0f}' for v in result['cpu_us'])}); max |out - copied heads| "
              f"{result['max_abs_diff']:.1e}")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"threads": args.threads, "torch": torch.__version__,
                       "results": [{"window": w, "variant": n, **r} for (w, n), r in results.items()]}, handle, indent=1)


if __name__ == "__main__":
    main()
