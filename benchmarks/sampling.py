"""The draws of one frame (`FrameSampler.main` and the 9 codebook draws) at Drama 3's real sizes, eagerly on one
device: per-row settings (uniform, mixed) against a former sampler with one set of scalar settings, same run.

Shapes: `V + 1 = 4097` main-token candidates, a RAS history of 16, 10 codebooks of 4096 logits, batches of `--batches`.
Cases: `greedy` (no row samples: the argmax fast path), `sampled` (every row with the defaults), `mixed` (rows cycling
through greedy, the defaults, another temperature/top-p/top-k and RAS off). With `--baseline-src DIR` (a checkout's
`src` from before per-row settings) its `FrameSampler(settings)` runs `greedy` and `sampled` too, interleaved with the
new one. The figure is the process's CPU time per frame (median of `--repeats` rounds of `--frames` frames), robust on
a shared machine.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/sampling.py --batches 1,16 \
        --baseline-src /path/to/old/src
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from transformers_drama3.generation import DRAMA3_GENERATION_DEFAULTS
from transformers_drama3.generation.rules import Drama3FrameSampling
from transformers_drama3.generation.sampling import FrameSampler

RULE = Drama3FrameSampling()
CANDIDATES, CODEBOOKS, HISTORY = 4097, 10, 16
MIXED = [dict(), dict(do_sample=False), dict(temperature=0.7, top_p=0.8, top_k=50), dict(ras_window=0, temperature=1.2)]


def settings(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{**DRAMA3_GENERATION_DEFAULTS, **changes})


def new_sampler(case: str, batch: int) -> FrameSampler:
    sampler = FrameSampler(batch, HISTORY)
    if case == "mixed":
        for row in range(batch):
            sampler.set_rows(torch.tensor([row]), settings(**MIXED[row % len(MIXED)]))
    else:
        sampler.set_rows(slice(None), settings(do_sample=case == "sampled"))
    return sampler


def old_sampler(module, case: str):
    return module.FrameSampler(settings(do_sample=case == "sampled"))


def frame(sampler, logits, heads, history, noise) -> None:
    """One frame's draws: the main token, then codebooks 1..9 (each from its head's logits). The sampler of an older
    `src` (`old_sampler`) draws by itself; this one's settings are drawn from by `Drama3FrameSampling`."""
    if not isinstance(sampler, FrameSampler):
        sampler.main(logits, history, noise)
        for index in range(1, CODEBOOKS):
            sampler.codebook(heads[index - 1], index, noise)
        return
    RULE.main(logits, history, sampler, noise)
    for index in range(1, CODEBOOKS):
        RULE.codebook(heads[index - 1], index, sampler, noise)


def cpu_ms_per_frame(sampler, inputs, frames: int) -> float:
    start = time.process_time()
    for _ in range(frames):
        frame(sampler, *inputs)
    return 1e3 * (time.process_time() - start) / frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--frames", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-src", default=None, help="a former checkout's src directory")
    args = parser.parse_args()
    baseline = None
    if args.baseline_src:
        path = Path(args.baseline_src) / "transformers_drama3" / "sampling.py"
        spec = importlib.util.spec_from_file_location("former_sampling", path)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU ms per frame (median of {args.repeats})")
    print(f"{'batch':>5} {'case':<8} {'per-row':>9} {'former':>9} {'per-row / former':>17}")
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, CANDIDATES, generator=generator)
        heads = torch.randn(CODEBOOKS - 1, batch, CANDIDATES - 1, generator=generator)
        history = torch.randint(-1, CANDIDATES, (batch, HISTORY), generator=generator)
        noise = torch.rand(batch, CODEBOOKS, CANDIDATES, generator=generator)
        inputs = (logits, heads, history, noise)
        for case in ("greedy", "sampled", "mixed"):
            samplers = {"per-row": new_sampler(case, batch)}
            if baseline is not None and case != "mixed":
                samplers["former"] = old_sampler(baseline, case)
            times = {name: [] for name in samplers}
            with torch.no_grad():
                for sampler in samplers.values():
                    frame(sampler, *inputs)  # untimed first frame
                for _ in range(args.repeats):  # interleaved rounds
                    for name, sampler in samplers.items():
                        times[name].append(cpu_ms_per_frame(sampler, inputs, args.frames))
            median = {name: statistics.median(values) for name, values in times.items()}
            former = median.get("former")
            ratio = f"{median['per-row'] / former:.2f}" if former else "-"
            print(f"{batch:>5} {case:<8} {median['per-row']:>9.3f} {former if former else float('nan'):>9.3f} {ratio:>17}")


if __name__ == "__main__":
    main()
