"""One product `x [M, K] @ W.T` in each weight format torch offers on a CPU, side by side in one run.

A frame of Drama 3 on a CPU is mostly products of one row (`M = 1`, a decode step of one sequence) by a weight matrix
read from memory (the backbone's linears and routed experts, the tower's layers and heads); the prefill multiplies the
prompt's rows at once (`M = 61` for the benchmarks' prompt). This times one such product per weight format, the way a
frame meets them: `--matrices` different matrices of each shape in turn (so they come from memory, not from the
cache), rounds interleaved across the formats, thread CPU time per product (`time.thread_time`, steadier than wall
time on a shared machine) and wall time. The error is the largest difference from the float64 product, on outputs
of magnitude ~1-3 (random weights with unit-variance products).

Formats (each with torch's own kernels; the ones `cpu_weights.py` / `cpu_path.py` can run are marked in the output):

- `float32`: `F.linear`, the exact reference of the CPU path;
- `bfloat16`: bfloat16 weights and activations, `F.linear` (oneDNN; AVX512-BF16 or AMX where the CPU has them);
- `bfloat16 (float32 in/out)`: the same product with the activations cast to bfloat16 and the output back;
- `float16`: float16 weights and the activations cast to float16, `F.linear` (`cpu_weights.CpuLinear`'s float16
  format for one or two rows);
- `float16, float32 product`: the float16 weights cast to float32 for the product (`CpuLinear`'s float16 format for
  more rows: without native float16 arithmetic, torch multiplies float16 row by row);
- `fbgemm float16`: fbgemm's packed float16 (`quantized.linear_prepack_fp16` / `linear_dynamic_fp16`, x86 only);
- `int8 weight-only`: `_weight_int8pack_mm`, per-row int8 and bfloat16 activations (`cpu_weights`' int8 format,
  torchao's CPU int8 weight-only layout);
- `int4 (group G)`: `_weight_int4pack_mm_for_cpu` after `_convert_weight_to_int4pack_for_cpu`, bfloat16 in/out;
- `int8 dynamic (_int_mm)`: the int8 weight-only format's codes and scales with the activations rounded to int8 per
  row, `torch._int_mm` (oneDNN; AVX512-VNNI or AMX where the CPU has them);
- `fbgemm dynamic int8`: `quantized.linear_dynamic` (int8 activations too, torch's quantised-tensor stack);
- `int8, fbgemm (three 7-bit input parts)`: the int8 weight-only format's codes with float32 scales, multiplied by
  fbgemm with each input row split in three 7-bit parts (`cpu_weights.int8_linear`, `CpuLinear`'s int8 products on
  x86 builds of torch).

    python benchmarks/cpu_weight_formats.py --threads 1
    python benchmarks/cpu_weight_formats.py --threads 2 --rows 1,4,61 --shapes 1536x512,4096x512 --output formats.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from transformers_drama3.cpu_path import native_bfloat16
from transformers_drama3.cpu_weights import PACKED_INT8, int8_linear, packed_weight, quantize_rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--shapes", default="1536x512,4096x512",
                        help="comma-separated NxK weight shapes (default: a tower layer's fused projection and a "
                             "codebook head of the `small` geometry)")
    parser.add_argument("--rows", default="1,61", help="comma-separated row counts M of x (default 1,61)")
    parser.add_argument("--matrices", type=int, default=40, help="different matrices of each shape, used in turn")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--products", type=int, default=200, help="products per format and round")
    parser.add_argument("--output", default=None, help="where to write the JSON results")
    return parser.parse_args()


Product = Callable[[int], torch.Tensor]  # matrix index -> the product's output [1, N], float32


def formats(weights: list[torch.Tensor], x: torch.Tensor) -> dict[str, Product]:
    """Each format's product of `x [1, K]` (float32) by matrix `i` of `weights` (float32 `[N, K]`), prepared once."""
    products: dict[str, Product] = {"float32": lambda i: F.linear(x, weights[i])}
    bf16 = [w.to(torch.bfloat16) for w in weights]
    x_bf16 = x.to(torch.bfloat16)
    products["bfloat16"] = lambda i: F.linear(x_bf16, bf16[i])
    products["bfloat16 (float32 in/out)"] = lambda i: F.linear(x.to(torch.bfloat16), bf16[i]).float()
    half = [w.to(torch.float16) for w in weights]
    products["float16"] = lambda i: F.linear(x.to(torch.float16), half[i]).float()
    products["float16, float32 product"] = lambda i: F.linear(x, half[i].float())
    if torch.backends.quantized.engine in ("fbgemm", "x86"):
        packed = [torch.ops.quantized.linear_prepack_fp16(w, None) for w in weights]
        products["fbgemm float16"] = lambda i: torch.ops.quantized.linear_dynamic_fp16(x, packed[i])
        dynamic = []
        for w in weights:
            scale = w.abs().amax(1).clamp_min(1e-12) / 127
            q = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            dynamic.append(torch.ops.quantized.linear_prepack(q, None))
        products["fbgemm dynamic int8"] = lambda i: torch.ops.quantized.linear_dynamic(x, dynamic[i])
    int8 = [quantize_rows(w) for w in weights]
    products["int8 weight-only"] = lambda i: torch.ops.aten._weight_int8pack_mm(x_bf16, *int8[i]).float()
    products["int8 dynamic (_int_mm)"] = lambda i: _dynamic_int8(x, *int8[i])
    if PACKED_INT8:
        split = [quantize_rows(w, torch.float32) for w in weights]
        for codes, scale in split:
            packed_weight(codes, scale)  # packed once, as a CpuLinear is at the load
        products["int8, fbgemm (three 7-bit input parts)"] = lambda i: int8_linear(x, *split[i])
    for group in (32, 128):
        packed4 = [_int4(w, group) for w in weights]
        products[f"int4 (group {group})"] = (
            lambda i, packed4=packed4, group=group: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x_bf16, packed4[i][0], group, packed4[i][1]).float())
    return products


def _dynamic_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [M, K]` rounded to int8 with a scale per row, times the per-row int8 weight `codes [N, K]` (`scale [N]`)
    by `torch._int_mm` (oneDNN's int8 product, int32 sums) -> `[M, N]` float32."""
    row_scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127  # [M, 1]
    rounded = torch.round(x / row_scale).to(torch.int8)
    return torch._int_mm(rounded, codes.t()).float() * row_scale * scale.float()


def _int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of `weight [N, K]` in groups of `group` columns, packed for the CPU kernel: (packed weight,
    scales and zeros `[K / group, N, 2]` in bfloat16), as torchao's int4 CPU layout prepares them."""
    n, k = weight.shape
    grouped = weight.reshape(n, k // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp_min(1e-12)
    codes = torch.round((grouped - low) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale  # the kernel computes (code - 8) * scale + zero
    scales_and_zeros = torch.stack([scale[..., 0], zero[..., 0]], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed, scales_and_zeros


def measure(shape: tuple[int, int], rows: int, args: argparse.Namespace) -> dict:
    """Per format: thread CPU and wall time per product (median and min over rounds), largest error."""
    n, k = shape
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) / k**0.5 for _ in range(args.matrices)]
    x = torch.randn(rows, k, generator=generator)
    products = formats(weights, x)
    exact = [F.linear(x.double(), w.double()) for w in weights]
    error = {name: max((product(i).double() - exact[i]).abs().max().item() for i in range(args.matrices))
             for name, product in products.items()}
    cpu = {name: [] for name in products}
    wall = {name: [] for name in products}
    for _ in range(args.rounds):
        for name, product in products.items():
            product(0)
            begin, thread = time.perf_counter(), time.thread_time()
            for step in range(args.products):
                product(step % args.matrices)
            cpu[name].append((time.thread_time() - thread) / args.products * 1e6)
            wall[name].append((time.perf_counter() - begin) / args.products * 1e6)
    return {name: {"cpu_us_median": statistics.median(cpu[name]), "cpu_us_min": min(cpu[name]),
                   "wall_us_median": statistics.median(wall[name]), "max_error": error[name]} for name in products}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(side) for side in shape.split("x")) for shape in args.shapes.split(",")]
    if any(k % 128 for _, k in shapes):
        raise SystemExit(f"--shapes: every K must be a multiple of 128 (the int4 groups), got {args.shapes}")
    row_counts = [int(rows) for rows in args.rows.split(",")]
    load = os.getloadavg()
    print(f"{args.threads} thread(s); native bfloat16: {native_bfloat16()}; torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; load average {load[0]:.2f}; us per product, thread CPU "
          "median (min) / wall median; max error against float64")
    results = {}
    with torch.no_grad():
        for shape in shapes:
            for rows in row_counts:
                results[f"{rows} x {shape[1]} @ {shape[1]} x {shape[0]}"] = figures = measure(shape, rows, args)
                print(f"x [{rows}, {shape[1]}], W [{shape[0]}, {shape[1]}]")
                for name, f in figures.items():
                    print(f"  {name:28s} {f['cpu_us_median']:8.1f} ({f['cpu_us_min']:7.1f}) / "
                          f"{f['wall_us_median']:8.1f}   error {f['max_error']:.1e}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"threads": args.threads, "load_average": load, "native_bfloat16": native_bfloat16(),
                       "results": results}, file, indent=2)


if __name__ == "__main__":
    main()
