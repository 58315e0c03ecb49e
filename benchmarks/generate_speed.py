"""Wall time per frame of `model.generate` on a random model, through the public API only (so the same script times
any version of the package: put its `src/` first on PYTHONPATH).

Greedy decoding with the end-of-speech row of `lm_head` zeroed (every run makes exactly `--frames` frames), batch
sizes `--batches` (every sequence the same prompt), the median of `--repeats` calls after one untimed call: wall time,
and the process's CPU time (steadier when other processes share the machine).

    python benchmarks/generate_speed.py --config tiny --batches 1,4
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/generate_speed.py --config tiny --batches 1,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import transformers_drama3
from configs import build_model, model_config, random_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small", "topology"], default="tiny")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--prompt-rows", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = model_config(args.config)
    model = build_model(config, torch.device("cpu"), torch.float32, args.seed, codec_weights=False)
    with torch.no_grad():
        model.lm_head.weight[config.eos_token_id] = 0.0
    results = {"package": transformers_drama3.__file__, "config": args.config, "frames": args.frames}
    for batch in (int(b) for b in args.batches.split(",")):
        prompt = random_prompt(config, args.prompt_rows, batch, torch.device("cpu"), args.seed)
        seconds, cpu_seconds = [], []
        for repeat in range(args.repeats + 1):
            start, cpu_start = time.perf_counter(), time.process_time()
            out = model.generate(prompt, do_sample=False, max_new_tokens=args.frames, output_audio=False)
            if repeat:
                seconds.append(time.perf_counter() - start)
                cpu_seconds.append(time.process_time() - cpu_start)
        assert all(codes.shape[1] == args.frames for codes in out.codes)
        results[f"batch {batch} ms per frame"] = 1e3 * statistics.median(seconds) / args.frames
        # CPU time of the process: less sensitive than wall time to other processes on a shared machine.
        results[f"batch {batch} CPU ms per frame"] = 1e3 * statistics.median(cpu_seconds) / args.frames
    print(json.dumps(results))


if __name__ == "__main__":
    main()
