"""Continuous batching in Python (`Drama3Engine`) against fixed batches (`generate`), on a random model, side by side.

Scenarios (greedy, the end-of-speech row of `lm_head` zeroed so that every request makes exactly its frames):

- **late**: a short request (`--short-frames`) added while a long one (`--long-frames`) has made `--late-after`
  frames. Its time to first frame (from `add_request` to its first frame) in the engine, against the same request
  alone in the engine, and against what a fixed batch gives it: waiting for the long request's remaining frames,
  then its own prefill and first frame (measured: the long request's remaining time plus the short one alone).
- **throughput**: `--clients` requests at once with mixed lengths (`--frames-mix`): frames/s of the engine (rows
  freed by short requests are reused by none, all arrive at once) against one `generate` over the same prompts (it
  runs to the longest one, its finished rows leave the batch at stop checks).

Every figure comes from the same process, one scenario after the other; threads: `--threads` (1 by default, with
OMP_WAIT_POLICY=PASSIVE set by the caller).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/engine_admission.py --config tiny
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/engine_admission.py --config small --long-frames 96
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from configs import build_model, model_config, random_prompt
from transformers_drama3 import Drama3Engine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--prompt-rows", type=int, default=40)
    parser.add_argument("--long-frames", type=int, default=160)
    parser.add_argument("--short-frames", type=int, default=8)
    parser.add_argument("--late-after", type=int, default=20, help="frames of the long request before the short one")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--frames-mix", default="8,16,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def result_of(engine: Drama3Engine, request_id: str):
    """The request's result, stepping the engine (it has no thread of its own here) until nothing is left to run."""
    engine.run_until_idle()
    return engine.get_result(request_id)


def first_frame_seconds(engine: Drama3Engine, request_id: str) -> float:
    result = result_of(engine, request_id)
    return result.first_frame_at - result.added_at


def late(model, config, args) -> dict:
    long_prompt = random_prompt(config, args.prompt_rows, 1, torch.device("cpu"), args.seed)[0]
    short_prompt = random_prompt(config, args.prompt_rows // 2, 1, torch.device("cpu"), args.seed + 1)[0]
    alone, behind, remaining = [], [], []
    for _ in range(args.repeats):
        engine = Drama3Engine(model, max_batch=4)
        alone.append(first_frame_seconds(engine, engine.add_request(short_prompt, do_sample=False,
                                                                    max_new_tokens=args.short_frames)))
        long_id = engine.add_request(long_prompt, do_sample=False, max_new_tokens=args.long_frames)
        for _ in range(args.late_after):
            engine.step()
        short_id = engine.add_request(short_prompt, do_sample=False, max_new_tokens=args.short_frames)
        behind.append(first_frame_seconds(engine, short_id))
        result_of(engine, long_id)
        # A fixed batch: the short request waits for the rest of the long one (its remaining frames alone, timed
        # after it: the engine's batch of two is done by then).
        engine = Drama3Engine(model, max_batch=4)
        long_id = engine.add_request(long_prompt, do_sample=False, max_new_tokens=args.long_frames)
        for _ in range(args.late_after):
            engine.step()
        started = time.monotonic()
        result_of(engine, long_id)
        remaining.append(time.monotonic() - started)
    median = statistics.median
    fixed = [r + a for r, a in zip(remaining, alone)]
    return {"alone_ms": 1e3 * median(alone), "engine_behind_long_ms": 1e3 * median(behind),
            "fixed_batch_behind_long_ms": 1e3 * median(fixed), "engine_ratio": median(behind) / median(alone),
            "fixed_batch_ratio": median(fixed) / median(alone)}


def throughput(model, config, args) -> dict:
    mix = [int(f) for f in args.frames_mix.split(",")]
    frames = [mix[i % len(mix)] for i in range(args.clients)]
    prompts = [random_prompt(config, args.prompt_rows, 1, torch.device("cpu"), args.seed + i)[0]
               for i in range(args.clients)]
    engine_seconds, generate_seconds = [], []
    for _ in range(args.repeats):
        engine = Drama3Engine(model, max_batch=args.clients)
        start = time.monotonic()
        ids = [engine.add_request(p, do_sample=False, max_new_tokens=n) for p, n in zip(prompts, frames)]
        results = [result_of(engine, request_id) for request_id in ids]
        engine_seconds.append(time.monotonic() - start)
        assert [r.frames for r in results] == frames
        # One generate over the batch: every sequence runs to the longest limit (frames past its own are counted
        # as made, but only its own are the work a client asked for).
        start = time.monotonic()
        model.generate(torch.stack(prompts), do_sample=False, max_new_tokens=max(frames), output_audio=False)
        generate_seconds.append(time.monotonic() - start)
    asked = sum(frames)
    median = statistics.median
    return {"frames_asked": asked, "engine_frames_per_s": asked / median(engine_seconds),
            "generate_batch_frames_per_s": asked / median(generate_seconds),
            "engine_over_generate": median(generate_seconds) / median(engine_seconds)}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    config = model_config(args.config)
    model = build_model(config, torch.device("cpu"), torch.float32, args.seed, codec_weights=False)
    with torch.no_grad():
        model.lm_head.weight[config.eos_token_id] = 0.0
    report = {"config": args.config, "threads": args.threads, "args": vars(args)}
    warm_up = Drama3Engine(model)  # first calls allocate and initialise: untimed
    result_of(warm_up, warm_up.add_request(random_prompt(config, args.prompt_rows, 1, torch.device("cpu"), 0)[0],
                                           do_sample=False, max_new_tokens=args.short_frames))
    report["late"] = late(model, config, args)
    print("late:", json.dumps(report["late"]), flush=True)
    report["throughput"] = throughput(model, config, args)
    print("throughput:", json.dumps(report["throughput"]), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
