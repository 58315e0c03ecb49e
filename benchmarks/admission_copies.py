"""What the engine copies when requests join and leave: frame-state builds and bytes of running sequences' caches
moved, at the real cache widths, for several versions side by side.

A `Drama3Engine` (`max_batch` 8, greedy, the end-of-speech row of `lm_head` zeroed so that every request makes exactly
its frames) gets `--requests` requests one every `--every` frames, with prompts of different lengths, each making
`--frames` frames. The model has the real attention, linear-attention and tower widths (what the caches hold: the
caches are what a build or a move copies) with `--layers` backbone layers in the real pattern (3 linear-attention
layers, then 1 full-attention layer); the experts are narrowed (they hold no cache), so the run fits a CPU. Bytes per
layer kind scale linearly with the layer count, so the figures for the 40 layers are given by scaling (printed).

Counted, the same way for every version: `FrameState` builds, and the bytes the states' `take` (moving sequences into
another state) and `shift` (moving them to later cache positions in place, where the version has it) copy, split by
what caused them (an admission, a release, or a longer cache). A newcomer's own prefill copied into its slot is not
counted: every version copies it once.

    OMP_NUM_THREADS=2 python benchmarks/admission_copies.py --source main --source .
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", help="'.' (this tree) or a git commit/branch; repeat to compare")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--every", type=int, default=3, help="frames between two arrivals")
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # run the version on sys.path
    return parser.parse_args()


def run_one(args) -> dict:
    """The scenario on the version of the package that is imported (module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(HERE))
    from configs import build_model, model_config, random_prompt

    from transformers_drama3 import Drama3Engine
    from transformers_drama3 import frame_runner, frame_step

    config = model_config("real", layers=args.layers)
    text = config.text_config
    text.num_experts, text.num_experts_per_tok = 8, 2  # experts hold no cache: narrowed to fit a CPU
    text.moe_intermediate_size = text.shared_expert_intermediate_size = 32
    model = build_model(config, torch.device("cpu"), torch.bfloat16, seed=0, codec_weights=False)
    with torch.no_grad():
        model.lm_head.weight[config.eos_token_id] = 0.0

    counts = {"builds": {}, "moved_bytes": {}}
    cause = ["start"]

    class CopiedBytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args_=(), kwargs=None):
            name = func.__name__
            if name.startswith("index_copy_"):
                source = args_[3]
                counts["moved_bytes"][cause[0]] = counts["moved_bytes"].get(cause[0], 0) + source.numel() * source.element_size()
            elif name.startswith("copy_"):
                source = args_[1]
                counts["moved_bytes"][cause[0]] = counts["moved_bytes"].get(cause[0], 0) + source.numel() * source.element_size()
            return func(*args_, **(kwargs or {}))

    def counting(function, what):
        def wrapped(*a, **k):
            if what == "build":
                counts["builds"][cause[0]] = counts["builds"].get(cause[0], 0) + 1
                return function(*a, **k)
            with CopiedBytes():
                return function(*a, **k)
        return wrapped

    frame_step.FrameState.__init__ = counting(frame_step.FrameState.__init__, "build")
    for name in ("take", "shift"):
        if hasattr(frame_step.FrameState, name):
            setattr(frame_step.FrameState, name, counting(getattr(frame_step.FrameState, name), "move"))

    def tagged(function, label):
        def wrapped(*a, **k):
            previous, cause[0] = cause[0], label
            try:
                return function(*a, **k)
            finally:
                cause[0] = previous
        return wrapped

    runner_class = frame_runner.FrameRunner
    runner_class.admit = tagged(runner_class.admit, "admission")
    runner_class.release = tagged(runner_class.release, "release")
    runner_class.make_room = tagged(runner_class.make_room, "longer cache")

    engine = Drama3Engine(model, max_batch=8)
    lengths = [40 + 23 * ((index * 5) % 7) for index in range(args.requests)]  # 40..178 rows, in mixed order
    ids, added = [], 0
    with torch.no_grad():
        while added < args.requests or engine.step():
            if added < args.requests:
                prompt = random_prompt(config, lengths[added], 1, torch.device("cpu"), seed=added)[0]
                ids.append(engine.add_request(prompt, do_sample=False, max_new_tokens=args.frames))
                added += 1
                for _ in range(args.every):
                    engine.step()
    frames = [engine.get_result(request_id).frames for request_id in ids]
    assert frames == [args.frames] * args.requests, frames
    return {"prompt_lengths": lengths, "counts": counts, "layers": args.layers,
            "layer_types": list(text.layer_types)}


def main() -> int:
    args = parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return 0
    sys.path.insert(0, str(HERE))
    from serve_load import source_tree

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for source in args.source or ["."]:
            label, src = source_tree(source, Path(scratch))
            command = [sys.executable, __file__, "--one", "--layers", str(args.layers), "--requests",
                       str(args.requests), "--every", str(args.every), "--frames", str(args.frames)]
            environment = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{HERE}"}
            done = subprocess.run(command, check=True, capture_output=True, text=True, env=environment)
            results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    scale = 40 / args.layers
    print(f"{args.requests} requests, one every {args.every} frames, {args.frames} frames each, max_batch 8; "
          f"real cache widths, {args.layers} layers (x{scale:g} for 40); threads {os.environ.get('OMP_NUM_THREADS')}")
    print("| version | state builds (admission / release / longer cache) | MB moved per admission | MB moved in all "
          "| MB moved in all, 40 layers |")
    print("| --- | --- | --- | --- | --- |")
    for label, result in results.items():
        builds, moved = result["counts"]["builds"], result["counts"]["moved_bytes"]
        total = sum(moved.values()) / 2**20
        print(f"| {label} | {sum(builds.values())} ({builds.get('admission', 0)} / {builds.get('release', 0)} / "
              f"{builds.get('longer cache', 0)}) | {moved.get('admission', 0) / 2**20 / args.requests:.1f} | "
              f"{total:.1f} | {total * scale:.0f} |")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
