"""Where one frame's time goes on a CPU: thread CPU time per part of the frame step, per CPU path, side by side.

Each path in `--paths` loads the checkpoint (`FishOmniForSpeech.from_pretrained(path, cpu_path=...)`, the `small`
checkpoint of `benchmarks/cpu_path.py` by default) in this one process; the frame step that `generate` runs
(`FrameState.step` through the runner of `benchmarks/frame_step.py`, after a 50-row prefill) is then timed per
part, the paths interleaved frame by frame (`--frames` timed frames each, after 4). The parts are modules timed with
forward hooks (`time.thread_time` on entry and exit: CPU time of this thread, steadier than wall time on a shared
machine); nested parts are indented, and what no module covers (the main token's candidate logits and draw, the 9
codebook draws, code embeddings, the step's glue) is the frame's rest. Then `torch.profiler` over `--op-frames`
frames of the first path gives the operations that take the most time, with their calls per frame.

Those runners run the eager step (the step store off). The first path's model then also runs its stored compiled step
(generation/stored_steps.py) from the store (`--store`, default the package's; `benchmarks/cpu_path.py` fills it),
interleaved with the others: its whole frame, and its operations under `torch.profiler` (a compiled step has no
module calls to time by part).

    python benchmarks/cpu_frame_profile.py --paths float16,float32 --threads 1
    python benchmarks/cpu_frame_profile.py --paths float16,bfloat16,int8 --threads 1 --checkpoint DIR --store DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from cpu_path import small_checkpoint, step_prompt
from frame_step import loaded_runner
from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.generation.stored_steps import STORE_VARIABLE, default_directory

# (part, indentation, the modules of the part by name). A part's time is the time of its modules' calls, outermost
# calls only.
PARTS = (
    ("backbone", 0, lambda name: name == "backbone"),
    ("routed experts", 1, lambda name: name.startswith("backbone.") and name.endswith(".mlp.experts")),
    ("shared expert and router", 1, lambda name: name.startswith("backbone.") and name.endswith(
        (".mlp.shared_expert", ".mlp.shared_expert_gate", ".mlp.gate"))),
    ("linear attention", 1, lambda name: name.startswith("backbone.") and name.endswith(".linear_attn")),
    ("full attention", 1, lambda name: name.startswith("backbone.") and name.endswith(".self_attn")),
    ("tower: shared layers", 0, lambda name: name.startswith("tower.shared_layers.") and name.count(".") == 2),
    ("tower: residual layers", 0, lambda name: name.startswith("tower.residual_layers.") and name.count(".") == 2),
    ("tower: heads", 0, lambda name: name.startswith("tower.heads.") and name.count(".") == 2),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="float16,float32", help="comma-separated cpu_path values")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--frames", type=int, default=12, help="timed frames per path (default 12)")
    parser.add_argument("--op-frames", type=int, default=5, help="frames under torch.profiler (default 5)")
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory (default: cpu_path.py's small one)")
    parser.add_argument("--store", default=None, help="the step store's folder (default: the package's)")
    parser.add_argument("--output", default=None, help="where to write the JSON results")
    return parser.parse_args()


class PartTimer:
    """Forward hooks on the modules of `PARTS`: thread CPU time of each part's outermost calls, per frame."""

    def __init__(self, model: torch.nn.Module):
        self.spent: dict[str, float] = defaultdict(float)
        self.depth: dict[str, int] = defaultdict(int)
        self.started: dict[str, float] = {}
        for name, module in model.named_modules():
            for part, _, matches in PARTS:
                if matches(name):
                    module.register_forward_pre_hook(lambda *_, part=part: self.enter(part))
                    module.register_forward_hook(lambda *_, part=part: self.leave(part))

    def enter(self, part: str) -> None:
        if self.depth[part] == 0:
            self.started[part] = time.thread_time()
        self.depth[part] += 1

    def leave(self, part: str) -> None:
        self.depth[part] -= 1
        if self.depth[part] == 0:
            self.spent[part] += time.thread_time() - self.started[part]

    def frame(self, runner) -> dict[str, float]:
        """Run one step; its parts and the whole frame, in ms of thread CPU time."""
        self.spent.clear()
        begin = time.thread_time()
        runner.step()
        whole = time.thread_time() - begin
        figures = {"whole frame": whole, **{part: self.spent[part] for part, _, _ in PARTS}}
        covered = figures["backbone"] + sum(figures[part] for part, depth, _ in PARTS[5:] if depth == 0)
        figures["rest: main token, codebook draws, embeddings, glue"] = whole - covered
        return {part: 1e3 * value for part, value in figures.items()}


def operations(runner, frames: int) -> tuple[float, list[tuple[str, float, float]]]:
    """Operations a frame (every profiled call, composite operations included), and (operation, share of the self
    CPU time, calls per frame) of the operations taking the most time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(frames):
            runner.step()
    events = profile.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    ranked = sorted(events, key=lambda event: event.self_cpu_time_total, reverse=True)[:14]
    calls = sum(event.count for event in events) / frames
    return calls, [(event.key, event.self_cpu_time_total / total, event.count / frames) for event in ranked]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint or small_checkpoint()
    paths = args.paths.split(",")
    load = os.getloadavg()
    store = args.store or str(default_directory())
    runners, timers, runs, models = {}, {}, {path: [] for path in paths}, {}
    os.environ[STORE_VARIABLE] = "off"  # the parts are the eager step's
    with torch.no_grad():
        for path in paths:
            model = models[path] = FishOmniForSpeech.from_pretrained(checkpoint, cpu_path=path).eval()
            runners[path] = loaded_runner(model, step_prompt(model), 0)
            timers[path] = PartTimer(model)
            for _ in range(4):
                runners[path].step()
        os.environ[STORE_VARIABLE] = store
        stored = loaded_runner(models[paths[0]], step_prompt(models[paths[0]]), 0)
        for _ in range(4):
            stored.step()
        stored_frames = []
        for _ in range(args.frames):
            for path in paths:
                runs[path].append(timers[path].frame(runners[path]))
            begin = time.thread_time()
            stored.step()
            stored_frames.append(1e3 * (time.thread_time() - begin))
        calls, ops = operations(runners[paths[0]], args.op_frames)
        stored_calls, stored_ops = operations(stored, args.op_frames)
    medians = {path: {part: statistics.median(frame[part] for frame in runs[path]) for part in runs[path][0]}
               for path in paths}
    print(f"{args.threads} thread(s), load average {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
          f"ms of thread CPU time per frame, median of {args.frames}")
    print(f"| part | {' | '.join(paths)} |\n| --- |{' --- |' * len(paths)}")
    depth = {part: indent for part, indent, _ in PARTS}
    for part in medians[paths[0]]:
        label = "  " * depth.get(part, 0) + ("- " if depth.get(part, 0) else "") + part
        print(f"| {label} | {' | '.join(f'{medians[path][part]:.1f}' for path in paths)} |")
    print(f"\nOperations of the {paths[0]} path ({args.op_frames} frames, torch.profiler): {calls:.0f} calls a frame "
          "(composite operations included); share of self CPU time, calls per frame")
    for name, share, count in ops:
        print(f"  {name:40s} {100 * share:5.1f} %  {count:7.1f}")
    ran = stored.stored_frames
    print(f"\nThe {paths[0]} path's stored step ({ran} of {args.frames + 4 + args.op_frames} frames from the "
          f"store {store}; none: fill it with benchmarks/cpu_path.py): {statistics.median(stored_frames):.1f} ms of "
          f"thread CPU a frame, {stored_calls:.0f} profiled calls a frame; share of self CPU time, calls per frame")
    for name, share, count in stored_ops:
        print(f"  {name[:40]:40s} {100 * share:5.1f} %  {count:7.1f}")
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"threads": args.threads, "load_average": load, "medians": medians, "calls_per_frame": calls,
                       "operations": ops, "stored_step_ms": statistics.median(stored_frames),
                       "stored_frames": ran, "stored_calls_per_frame": stored_calls, "stored_operations": stored_ops,
                       "command": " ".join(sys.argv)}, file, indent=2)


if __name__ == "__main__":
    main()
