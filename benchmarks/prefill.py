"""The teacher-forced prefill (`FishOmniForSpeech.forward(..., use_cache=True, logits_to_keep=1)`): host reads per
call and time, for one or more source trees side by side in one run.

A host read (`Tensor.__bool__`, `item`, `tolist`, `__int__`, `__float__`) waits for the device on a GPU: each one is
a synchronisation that stalls the launch queue. They are counted during one call, split by the caller: this package's
code, and everything else (transformers' backbone: its mask builders and, with the eager experts loop, the routing
it reads per layer); the counts are the same on any machine. Then the call is timed (median of
`--repeats`), alternating between the trees so that a busy machine slows them alike.

Each tree runs in its own subprocess with `PYTHONPATH=<tree>/src`; the golden tiny checkpoint, float32, the eager
experts loop. To compare with an older commit, export it first:

    git archive <commit> src | tar -x -C /tmp/old
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/prefill.py --source /tmp/old --source . --batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = r"""
import json, sys, time, traceback, torch
from safetensors.torch import load_file
from transformers_drama3 import FishOmniForSpeech

batch, repeats = int(sys.argv[1]), int(sys.argv[2])
model = FishOmniForSpeech.from_pretrained(sys.argv[3], dtype=torch.float32)
model.set_experts_implementation("eager")
rows = load_file(sys.argv[4])["prompt_a_rows"]  # [59, 11]
prompt = rows[None].expand(batch, -1, -1).contiguous()
mask = torch.ones(prompt.shape[:2], dtype=torch.long)
mask[1:, :8] = 0  # left padding in every sequence but the first
prompt[1:, :8] = 0
reads = {"package": 0, "other": 0}

def counting(name):
    original = getattr(torch.Tensor, name)
    def read(self, *args, **kwargs):
        caller = traceback.extract_stack(limit=2)[0].filename
        reads["package" if "transformers_drama3" in caller else "other"] += 1
        return original(self, *args, **kwargs)
    setattr(torch.Tensor, name, read)
    return original

def prefill():
    with torch.no_grad():
        return model(prompt, mask, use_cache=True, logits_to_keep=1)

prefill()
originals = {name: counting(name) for name in ("__bool__", "item", "tolist", "__int__", "__float__")}
prefill()
for name, original in originals.items():
    setattr(torch.Tensor, name, original)
times = []
for _ in range(repeats):
    start = time.perf_counter()
    prefill()
    times.append(time.perf_counter() - start)
print(json.dumps({"host_reads": reads, "seconds": times}))
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", default=None, help="a source tree (with src/); repeatable")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds alternating between the trees")
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args()


def run(source: str, batch: int, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(source).resolve() / "src")}
    fixtures = ROOT / "tests" / "fixtures"
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(batch), str(repeats), str(fixtures / "tiny"), str(fixtures / "expected.safetensors")],
        env=env, capture_output=True, text=True, check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    sources = args.source or ["."]
    reads, times = {}, {source: [] for source in sources}
    for _ in range(args.rounds):
        for source in sources:
            out = run(source, args.batch, args.repeats)
            reads[source] = out["host_reads"]
            times[source] += out["seconds"]
    report = {
        "batch": args.batch, "rows": 59, "threads": os.environ.get("OMP_NUM_THREADS"),
        "trees": {source: {"host_reads_per_call": reads[source], "median_ms": 1000 * statistics.median(times[source])}
                  for source in sources},
    }
    print(json.dumps(report, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
