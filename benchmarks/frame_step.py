"""Drama 3's frame step (random weights): kernels per frame, time per frame in every way it can run, time to first
audio, memory, and a check that every way gives the same frames.

The frame step is `FrameState.step` (frame_step.py), the one step `generate` runs. Ways to run it (`--modes`):
- `eager`: the step as Python calls it, one kernel per dispatched operation (what a CPU and offloaded models run);
- `compiled`: `torch.compile(step, fullgraph=True)` (inductor: element-wise chains fused into one kernel each);
- `graph` (CUDA): the eager step captured once as a CUDA graph and replayed (`generate(..., fast_decode=True)`);
- `compiled+graph` (CUDA): the compiled step captured and replayed (`fast_decode=True, compile_step=True`).
Every figure of a mode is also given as a speed-up over `eager` at the same batch, measured in the same run.

Kernel counts per frame (`--count-kernels`, no timing involved, so they are the same on any machine):
- eager: the ATen operations the step dispatches that launch a kernel (views and metadata left out), split into the
  backbone step, the tower (codes 1..9 with their draws), main-token sampling (candidate logits, RAS, the draw) and
  the rest (embedding of the new row, masks, RAS window, feedback);
- compiled: the kernel launches in the code inductor generates for the step (fused kernels, library calls such as
  matmuls, and ATen fallbacks). Compiling a 40-layer step takes long on a CPU, so `--compile-layers` (default 4,8)
  counts two depths and extrapolates linearly to the model's depth (every backbone layer of a kind compiles to the
  same kernels). The time each compile took is reported.

Configurations: `tiny` (the golden tiny geometry), `small` (CPU-sized, the real codec), `real` (`FishOmniConfig()`:
the 35B-A3B backbone, built on the device in bfloat16 with random weights; needs a ~80 GB GPU) and `topology` (the
real topology, 40 layers with their linear/full-attention pattern, 256 experts top 8, the 13-layer tower, 10 codebooks
of 4096, at narrow widths: kernel counts on any CPU). The codec always runs in float32.

    python benchmarks/frame_step.py --config topology --count-kernels --modes eager --output topology.json
    python benchmarks/frame_step.py --config tiny --output tiny.json
    PYTHONPATH=src python benchmarks/frame_step.py --config real --device cuda --count-kernels --batches 1,16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import re
import resource
import statistics
import sys
import time
import traceback
from collections import Counter
from datetime import datetime, timezone

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from configs import build_model, model_config, random_prompt
from transformers_drama3 import Drama3AudioStreamer, execution_device
from transformers_drama3.generation.cuda_graphs import captured_experts
from transformers_drama3.generation.state import FrameState, attention_window, row_limit
from transformers_drama3.generation.rules import Drama3FrameSampling, frame_criteria
from transformers_drama3.generation.runner import FrameRunner, KeptStates
from transformers_drama3.generation import generation_settings

MODES = ("eager", "compiled", "graph", "compiled+graph")
PARTS = ("backbone", "tower", "main-token sampling", "embedding and feedback")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small", "real", "topology"], default="tiny")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep only the first N backbone layers (a quick look at a deep geometry; the step's cost "
                             "is about linear in N)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="backbone, lm_head and tower precision (default: bfloat16 for real, else float32)")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated ways to run the step, of {','.join(MODES)} (default: eager,graph on "
                             "cuda, eager elsewhere; compiled ones add a compile of minutes)")
    parser.add_argument("--batches", default="1", help="comma-separated batch sizes (default 1)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first, per mode and batch (default 4)")
    parser.add_argument("--frames", type=int, default=24, help="timed steps per mode and batch (default 24)")
    parser.add_argument("--prompt-rows", type=int, default=50, help="text rows of the prompt (default 50)")
    parser.add_argument("--count-kernels", action="store_true", help="count kernels per frame (eager and compiled)")
    parser.add_argument("--compile-layers", default="4,8",
                        help="backbone depths whose compiled step is counted, to extrapolate (default 4,8; 'none' "
                             "counts the eager step only)")
    parser.add_argument("--chunk-frames", type=int, default=7, help="frames per streamed codec chunk (default 7)")
    parser.add_argument("--ttfa-runs", type=int, default=3, help="timed time-to-first-audio runs, after one untimed")
    parser.add_argument("--check-frames", type=int, default=24, help="frames of generate compared across modes")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on the CPU, steadier on a shared machine; 0 = torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="where to write the JSON results (default: none)")
    return parser.parse_args()


# ------------------------------------------------------------------------------------------------------------------
# The step as generate prepares it
# ------------------------------------------------------------------------------------------------------------------


def loaded_runner(model, prompt: torch.Tensor, seed: int, graphs: bool = False,
                  compile_step: bool | str = False) -> FrameRunner:
    """A runner holding `prompt`'s sequences after their prefill, as `generate` prepares them (default sampling
    settings, one random stream), that never end (the step's cost does not depend on it)."""
    settings = generation_settings(model.generation_config)
    mask = torch.ones(prompt.shape[:2], dtype=torch.long, device=prompt.device)
    with torch.no_grad():
        prefill = model(prompt, mask, use_cache=True, logits_to_keep=1)
    if not bool(torch.isfinite(prefill.last_hidden_state).all()):
        raise RuntimeError("the backbone gave non-finite hidden states after the prefill: check the initialisation")
    generator = torch.Generator(device=execution_device(model.lm_head)).manual_seed(seed)
    runner = FrameRunner(model, Drama3FrameSampling(), frame_criteria(model, settings), graphs,
                         compile_step, kept=KeptStates(model) if graphs else None, one_stream=True,
                         generator=generator)
    batch = prompt.shape[0]
    runner.admit(list(range(batch)), prefill, prompt, mask, [settings] * batch, [None] * batch, [10**9] * batch)
    return runner


def loaded_state(model, prompt: torch.Tensor, seed: int) -> tuple[FrameState, int, tuple]:
    """The state of `loaded_runner` with its noise drawn, the attention window of its next step, and the rules its
    step runs (the sampling rule and the device criteria)."""
    runner = loaded_runner(model, prompt, seed)
    state = runner.state
    state.sampler.fill_noise(state.noise, runner.shared_generator)
    window = attention_window(state.pointer + 1, row_limit(model.config.text_config.max_position_embeddings))
    return state, window, (runner.sampling, runner.stopping)


# ------------------------------------------------------------------------------------------------------------------
# Kernels per frame
# ------------------------------------------------------------------------------------------------------------------


# Operations that launch no kernel although their schema does not say they alias: reshapes of contiguous tensors,
# allocations, and reads of a value back to the host (a synchronisation, counted apart).
NO_KERNEL = {"_unsafe_view", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
             "_local_scalar_dense"}


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it that launch a kernel, per part of the step (`part`). Left out:
    views (their outputs alias an input without writing it), operations with no tensor output (metadata) and
    `NO_KERNEL`."""

    def __init__(self):
        super().__init__()
        self.part = PARTS[-1]
        self.counts: dict[str, Counter] = {part: Counter() for part in PARTS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        has_tensor = any(isinstance(t, torch.Tensor) for t in (out if isinstance(out, (tuple, list)) else (out,)))
        name = func.overloadpacket.__name__
        if not is_view and has_tensor and name not in NO_KERNEL:
            self.counts[self.part][name] += 1
        return out


@contextlib.contextmanager
def parts_of_the_step(model, counter: OpCounter):
    """Tags what the step runs with its part: the backbone forward, the tower's codes, main-token sampling."""
    patched = []

    def tag(owner, name: str, part: str):
        original = getattr(owner, name)

        def tagged(*args, **kwargs):
            outer, counter.part = counter.part, part
            try:
                return original(*args, **kwargs)
            finally:
                counter.part = outer

        setattr(owner, name, tagged)
        patched.append((owner, name, original))

    tag(model.backbone, "forward", "backbone")
    tag(model.tower, "decode_codes", "tower")
    tag(model, "main_logits", "main-token sampling")
    tag(Drama3FrameSampling, "main", "main-token sampling")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            if isinstance(owner, type):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute hid the class's method


def eager_kernels(model, prompt: torch.Tensor, seed: int) -> dict:
    """Dispatched kernel-launching ATen operations of one eager step, per part, with the top operations."""
    state, visible, rules = loaded_state(model, prompt, seed)
    with torch.no_grad():
        state.step(visible, *rules)  # lazy initialisations happen outside the count
        counter = OpCounter()
        with parts_of_the_step(model, counter), counter:
            state.step(visible, *rules)
    total = sum((c for c in counter.counts.values()), Counter())
    return {"per_part": {part: sum(c.values()) for part, c in counter.counts.items()}, "total": sum(total.values()),
            "top_ops": dict(total.most_common(12))}


KERNEL_CALL = re.compile(r"\b(?:cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(")


def compiled_kernels(model, prompt: torch.Tensor, seed: int) -> dict:
    """Kernel launches in inductor's code for one compiled step (fused kernels, library calls, ATen fallbacks), and
    the compile time."""
    from torch._inductor.utils import run_and_get_code

    state, visible, rules = loaded_state(model, prompt, seed)
    torch._dynamo.reset()
    compiled = torch.compile(state.step, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    with torch.no_grad():
        _, sources = run_and_get_code(compiled, visible, *rules)
    seconds = time.perf_counter() - start
    kinds = Counter()
    for source in sources:
        body = source[source.index("def call(") :] if "def call(" in source else source
        for match in KERNEL_CALL.finditer(body):
            name = match.group(0)
            kinds["fused" if name.startswith(("cpp_fused", "triton_")) else name.split("(")[0].rsplit(".", 1)[0]] += 1
    return {"total": sum(kinds.values()), "by_kind": dict(kinds), "compile_seconds": seconds}


def count_kernels(config_name: str, device, dtype, prompt_rows: int, batches: list[int], compile_layers: list[int],
                  seed: int) -> dict:
    config = model_config(config_name)
    model = build_model(config, device, dtype, seed)
    report = {"eager": {}, "compiled": {}}
    with captured_experts(model):  # batched_mm experts: what a captured (or compiled) step runs
        for batch in batches:
            report["eager"][batch] = eager_kernels(model, random_prompt(config, prompt_rows, batch, device, seed), seed)
    del model
    layers = config.text_config.num_hidden_layers
    def compiled_at(depth: int, batch: int) -> dict:
        shallow = build_model(model_config(config_name, depth), device, dtype, seed)
        with captured_experts(shallow):
            return compiled_kernels(shallow, random_prompt(config, prompt_rows, batch, device, seed), seed)

    for batch in batches:
        points = {depth: attempt(lambda: compiled_at(depth, batch)) for depth in compile_layers}
        entry = {"counted": points}
        if len(points) == 2 and all("total" in p for p in points.values()):
            (d1, p1), (d2, p2) = sorted(points.items())
            per_layer = (p2["total"] - p1["total"]) / (d2 - d1)
            entry["per_backbone_layer"] = per_layer
            entry["extrapolated_total"] = round(p1["total"] + per_layer * (layers - d1))
        report["compiled"][batch] = entry
    return report


# ------------------------------------------------------------------------------------------------------------------
# Time per frame
# ------------------------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary_ms(seconds: list[float]) -> dict:
    """Median and 90th percentile (nearest rank) in milliseconds, and the raw samples."""
    ordered = sorted(seconds)
    return {"median_ms": 1e3 * statistics.median(ordered), "p90_ms": 1e3 * ordered[math.ceil(0.9 * len(ordered)) - 1],
            "samples_ms": [1e3 * s for s in seconds]}


def time_mode(model, prompt: torch.Tensor, mode: str, args, device: torch.device) -> dict:
    """Time per step of `mode` at the prompt's batch: warm-up (with the compile or capture), then timed steps."""
    start = time.perf_counter()
    with torch.no_grad():
        runner = loaded_runner(model, prompt, args.seed, graphs="graph" in mode,
                               compile_step="inductor" if "compiled" in mode else False)
        for _ in range(args.warmup):
            runner.step()
        synchronize(device)
        ready_seconds = time.perf_counter() - start
        seconds = []
        for _ in range(args.frames):
            synchronize(device)
            begin = time.perf_counter()
            runner.step()  # the random stream's draw of the frame's noise included, as generate runs it
            synchronize(device)
            seconds.append(time.perf_counter() - begin)
    return {**summary_ms(seconds), "first_steps_seconds": ready_seconds}


def measure_codec(model, args, device: torch.device) -> dict:
    """The streaming codec fed `--chunk-frames`-frame chunks: milliseconds per frame."""
    codes = torch.randint(0, 1024, (1, model.config.num_codebooks, args.chunk_frames), device=device)
    stream = model.codec.stream()
    stream.decode(codes)
    seconds = []
    for _ in range(4):
        synchronize(device)
        begin = time.perf_counter()
        stream.decode(codes)
        synchronize(device)
        seconds.append((time.perf_counter() - begin) / args.chunk_frames)
    return summary_ms(seconds)


def time_to_first_audio(model, prompt: torch.Tensor, settings: dict, args) -> dict:
    """From the `generate` call to the first streamed chunk (`first_chunk_frames=1`): the first call (compiles and
    captures when the mode does) apart from the median of `--ttfa-runs` warm calls."""
    runs = []
    for _ in range(args.ttfa_runs + 1):
        chunk_times = []
        clock = Drama3AudioStreamer(model.codec, first_chunk_frames=1,
                                    on_audio=lambda sequence, chunk: chunk_times.append(time.perf_counter()))
        begin = time.perf_counter()
        model.generate(prompt, max_new_tokens=2, seed=args.seed, streamer=clock, output_audio=False, **settings)
        runs.append(chunk_times[0] - begin)
    model.reset_frame_states()
    return {"cold_ms": 1e3 * runs[0], **summary_ms(runs[1:])}


def check_frames(model, prompt: torch.Tensor, modes: list[str], args) -> dict:
    """The first `--check-frames` frames of `generate` in every mode against eager: greedy and sampled (seeded)."""
    results = {}
    for name, kwargs in (("greedy", {"do_sample": False}), ("sampled", {"seed": args.seed})):
        outputs = {}
        for mode in modes:
            settings = {"fast_decode": "graph" in mode, "compile_step": "compiled" in mode}
            outputs[mode] = model.generate(prompt, max_new_tokens=args.check_frames, output_audio=False,
                                           **settings, **kwargs).sequences
            model.reset_frame_states()
        reference = outputs["eager"]
        results[name] = {mode: bool(torch.equal(out, reference)) for mode, out in outputs.items() if mode != "eager"}
    return results


def attempt(run) -> dict:
    """`run()`, or the error it raised (a failed part of the benchmark does not stop the others)."""
    try:
        return run()
    except Exception as error:  # noqa: BLE001  (reported in the results)
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}"}


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"cuda_max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    return {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def weights_gib(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------


def print_report(report: dict) -> None:
    print(f"Drama 3 frame step, config {report['config']}: {report['machine']}")
    counts = report.get("kernels")
    if counts:
        print("kernels per frame, eager step (dispatched ATen ops that launch a kernel):")
        for batch, entry in counts["eager"].items():
            parts = ", ".join(f"{part} {n}" for part, n in entry["per_part"].items())
            print(f"  batch {batch}: {entry['total']} ({parts}); top: {entry['top_ops']}")
        print("kernels per frame, compiled step (inductor's kernel launches):")
        for batch, entry in counts["compiled"].items():
            print(f"  batch {batch}: {json.dumps(entry)}")
    timings = report.get("timings", {})
    if timings:
        audio_ms = report["audio_ms_per_frame"]
        print(f"{'mode':<16}{'batch':>6}{'median ms':>11}{'p90 ms':>9}{'vs eager':>10}{'RTF/stream':>12}{'first steps s':>15}")
        for key, entry in timings.items():
            mode, batch = key.rsplit("@", 1)
            if "error" in entry:
                print(f"{mode:<16}{batch:>6}  {entry['error']}")
                continue
            eager = timings.get(f"eager@{batch}", {}).get("median_ms")
            speedup = f"{eager / entry['median_ms']:.2f}x" if eager else "-"
            print(f"{mode:<16}{batch:>6}{entry['median_ms']:>11.2f}{entry['p90_ms']:>9.2f}{speedup:>10}"
                  f"{entry['median_ms'] / audio_ms:>12.3f}{entry['first_steps_seconds']:>15.1f}")
    for name in ("codec_ms_per_frame", "time_to_first_audio", "checks", "memory"):
        if name in report:
            print(f"{name}: {json.dumps(report[name], default=str)}")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.config == "real" else torch.float32)
    modes = args.modes.split(",") if args.modes else (["eager", "graph"] if device.type == "cuda" else ["eager"])
    if device.type != "cuda" and any("graph" in mode for mode in modes):
        sys.exit("CUDA graph modes need --device cuda")
    batches = [int(b) for b in args.batches.split(",")]
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine())
    report = {
        "config": args.config + (f", first {args.layers} backbone layers" if args.layers else ""), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{machine}, torch {torch.__version__}, transformers {transformers.__version__}, "
                   f"{torch.get_num_threads()} threads, {str(dtype).removeprefix('torch.')}",
        "command": " ".join(sys.argv), "audio_ms_per_frame": None, "timings": {},
    }
    if args.count_kernels:
        report["kernels"] = count_kernels(args.config, device, dtype, args.prompt_rows, batches,
                                          [] if args.compile_layers == "none" else
                                          [int(d) for d in args.compile_layers.split(",")], args.seed)
    config = model_config(args.config, args.layers)
    model = build_model(config, device, dtype, args.seed)
    report["audio_ms_per_frame"] = 1e3 * config.codec_config.frame_length / config.sampling_rate
    report["weights_gib"] = weights_gib(model)
    with captured_experts(model):  # every mode runs batched_mm experts, as a captured step does
        for batch in batches:
            prompt = random_prompt(config, args.prompt_rows, batch, device, args.seed)
            for mode in modes:
                report["timings"][f"{mode}@{batch}"] = attempt(lambda: time_mode(model, prompt, mode, args, device))
        prompt = random_prompt(config, args.prompt_rows, 1, device, args.seed)
        report["codec_ms_per_frame"] = attempt(lambda: measure_codec(model, args, device))
        report["time_to_first_audio"] = {
            mode: attempt(lambda: time_to_first_audio(
                model, prompt, {"fast_decode": "graph" in mode, "compile_step": "compiled" in mode}, args))
            for mode in modes
        }
        report["checks"] = attempt(lambda: check_frames(model, prompt, modes, args))
    report["memory"] = {**peak_memory(device), "weights_gib": report["weights_gib"]}
    print_report(report)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    main()
