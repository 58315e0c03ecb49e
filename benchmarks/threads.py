"""torch threads on a busy and on a quiet CPU: `generate` wall time with 1 and with 2 threads, side by side.

    python benchmarks/threads.py                     # tiny and small checkpoints, 0 / 1 / 2 busy loops
    python benchmarks/threads.py --frames 24 --busy 0 2

For each number of busy loops (processes spinning on a core, started by this script, as other work on a shared
machine would) and each thread count, a fresh process loads the checkpoint with `OMP_NUM_THREADS=N` (and
`OMP_WAIT_POLICY=PASSIVE`, or `--wait-policy`), runs one warm-up `generate`, then times `generate` of `--frames` frames with a seed,
best of 3. It also prints digests of the codes and of the audio, so that the same seed at different thread counts can be compared.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import hashlib, json, sys, time, torch
from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.processing_drama3 import Drama3Processor
path, frames = sys.argv[1], int(sys.argv[2])
model = FishOmniForSpeech.from_pretrained(path, dtype=torch.float32).eval()
processor = Drama3Processor.from_pretrained(path)
inputs = processor("The lighthouse keeper woke before dawn.")
def run():
    return model.generate(**inputs, max_new_tokens=frames, seed=1, show_progress=False)
run()  # warm-up
times, out = [], None
for _ in range(3):
    start = time.perf_counter(); out = run(); times.append(time.perf_counter() - start)
codes = hashlib.sha256(out.codes[0].numpy().tobytes()).hexdigest()[:8]
audio = hashlib.sha256(out.audio[0].numpy().tobytes()).hexdigest()[:8]
digest = f"codes {codes}, audio {audio}"
print(json.dumps({"seconds": min(times), "frames": out.codes[0].shape[-1], "threads": torch.get_num_threads(),
                  "digest": digest}))
"""


def spin() -> None:
    while True:
        pass


def checkpoint(name: str) -> str:
    from transformers_drama3.testing import default_tiny_checkpoint, write_tiny_checkpoint

    if name == "tiny":
        return default_tiny_checkpoint()
    sys.path.insert(0, os.path.dirname(__file__))
    from configs import SMALL_CONFIG

    path = os.path.join(tempfile.gettempdir(), "transformers-drama3-serve-benchmark-small")
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_tiny_checkpoint(path, **SMALL_CONFIG)
    return path


def measure(path: str, frames: int, threads: int, wait_policy: str | None) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["OMP_NUM_THREADS"] = str(threads)
    if wait_policy is not None:
        env["OMP_WAIT_POLICY"] = wait_policy
    result = subprocess.run([sys.executable, "-c", CHILD, path, str(frames)], env=env, capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["tiny", "small"])
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--wait-policy", choices=["PASSIVE", "ACTIVE", "unset"], default="PASSIVE",
                        help="OMP_WAIT_POLICY of the measured process (unset: the OpenMP runtime's default)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; load average before: {os.getloadavg()}; OMP_WAIT_POLICY {args.wait_policy}")
    for name in args.configs:
        path = checkpoint(name)
        for busy in args.busy:
            loops = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
            for loop in loops:
                loop.start()
            try:
                policy = None if args.wait_policy == "unset" else args.wait_policy
                row = {threads: measure(path, args.frames, threads, policy) for threads in args.threads}
            finally:
                for loop in loops:
                    loop.terminate()
                    loop.join()
            cells = "  ".join(f"{threads} thread(s) {r['seconds']:6.2f} s for {r['frames']} frames [{r['digest']}]"
                              for threads, r in row.items())
            print(f"{name:<6} busy loops {busy}: {cells}", flush=True)


if __name__ == "__main__":
    main()
