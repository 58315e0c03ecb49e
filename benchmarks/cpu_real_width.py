"""The CPU path at the real width: the frame step per backbone layer, extrapolated to the real 40 layers.

For each `--layers` count, a random checkpoint with the real topology at full width (loading_memory.py's FULL_TEXT and
FULL_TOWER: hidden 2048, 256 routed experts of 512, top-8, the 248,320-token vocabulary, the 13-layer tower with 4096
codes; the real Fish DAC codec) and that many backbone layers (the real pattern: three linear-attention layers, then a
full-attention one), FP8 routed experts as shipped, written by the package's writer (`write_tiny_checkpoint`, seed 0,
one shard in memory at a time) into `--directory`. Each checkpoint is then loaded as a user loads it
(`FishOmniForSpeech.from_pretrained(path)`, no dtype: the default CPU path, which converts the FP8 experts once) in a
fresh process per layer count and round, the layer counts interleaved, `--rounds` times. Each process reports:

- the load (wall and CPU time) and the model's bytes in memory per part (routed experts, the rest of the backbone,
  lm_head, tower, codec; parameters and buffers);
- the frame step (`FrameState.step` as `generate` runs it, sampled, after a 50-row prompt, median of `--frames`
  steps, wall and the thread's CPU time; `stored_frames`: how many a stored compiled step ran);
- `generate` of 32 sampled frames with its prompt ("Hello there, how are you today?", 61 rows), and their codec decode
  streamed in chunks of 7 frames as `drama3-tts` decodes;
- the peak RSS (`ru_maxrss`, as `/usr/bin/time` reports it) after the load, before the decode and at the end; the
  load's peak of anonymous memory (sampled every 50 ms: `ru_maxrss` also counts the checkpoint's page-cache pages the
  load maps while reading them, reclaimable) and the anonymous memory after it; the load average at the process's
  start.

Per layer: the slope of the least-squares line through the median frame time at each layer count (at least two
counts of at least 4: the real pattern's first full-attention layer is the fourth, and a backbone without one is
refused by transformers' cache and by the llama.cpp port alike; the counts differ in backbone layers only); at 40
layers: that line's value at 40, an extrapolation. Before the rounds the step store (`--store`, default the
package's) is filled as benchmarks/cpu_path.py fills it, once per checkpoint and thread count (`--no-fill` measures
what it holds).

Memory: the 4-layer checkpoint is 9.6 GB on disk; its load (converted from the checkpoint's memory map, the pages read
given back as it goes: docs/usage.md, "Loading on the CPU path") peaks at about the loaded model, 12 GiB on the float16
path and 8 GiB on the int8 one (`ru_maxrss`: 12.7 and 8.6 GiB); the writer holds one shard (1 GB) and the codec's state
at a time. Disk: `--keep` keeps the checkpoints,
otherwise they are deleted at the end.

    python benchmarks/cpu_real_width.py --layers 4,8 --threads 1 --rounds 2 --directory /path/to/scratch \
        --output real-width.json
    python benchmarks/cpu_real_width.py --layers 4 --write-only --directory /path/to/scratch   # write and keep
    python benchmarks/cpu_real_width.py --load-only /path/to/scratch/layers-4     # the load's time and memory only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_path import fill_store, peak_gib, step_prompt, timed_steps  # noqa: E402  (a sibling benchmark: its steps and memory)
TEXT = "Hello there, how are you today?"
REAL_LAYERS = 40
GB = 1e9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,8", help="backbone layer counts, multiples of 4 (default 4,8)")
    parser.add_argument("--directory", default=None, help="where the checkpoints are written (layers-N folders)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per layer count, interleaved (default 3; 0: only fill the step store)")
    parser.add_argument("--frames", type=int, default=24, help="timed frame steps per process (default 24)")
    parser.add_argument("--store", default=None, help="the step store's folder (default: the package's)")
    parser.add_argument("--no-fill", action="store_true", help="do not fill the step store first")
    parser.add_argument("--write-only", action="store_true", help="write the checkpoints (kept) and stop")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument("--output", default=None, help="where to write the JSON results")
    parser.add_argument("--load-only", default=None, metavar="CHECKPOINT",
                        help="load CHECKPOINT as a user does, print the load's figures (JSON) and stop")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def checkpoint_overrides(layers: int) -> dict:
    """`write_tiny_checkpoint`'s overrides for the real topology at full width with `layers` backbone layers."""
    sys.path.insert(0, HERE)
    from loading_memory import FULL_TEXT, FULL_TOWER

    from transformers_drama3 import FishDACConfig

    return {"text_config": {**FULL_TEXT, "num_hidden_layers": layers}, "audio_decoder_config": dict(FULL_TOWER),
            "codec_config": FishDACConfig().to_dict()}


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)
               if name.endswith((".safetensors", ".pth")))


def write_checkpoint(directory: str, layers: int) -> str:
    """The checkpoint `directory/layers-N`, written unless it is there (its config.json is written last)."""
    from transformers_drama3.testing import write_tiny_checkpoint

    path = os.path.join(directory, f"layers-{layers}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        shutil.rmtree(path, ignore_errors=True)
        start = time.perf_counter()
        write_tiny_checkpoint(path, seed=0, max_shard_size="1GB", **checkpoint_overrides(layers))
        print(f"{layers} layers: wrote {checkpoint_bytes(path) / GB:.2f} GB in {time.perf_counter() - start:.0f} s",
              flush=True)
    return path


def anonymous_gib() -> float:
    """This process's anonymous resident memory now (`RssAnon`: what is not a file's pages), GiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 2**20
    return float("nan")  # not Linux


class AnonymousPeak:
    """The largest `anonymous_gib()` seen every 50 ms inside a `with` block (`.peak`): a load's own peak, which
    `ru_maxrss` mixes with the checkpoint's page-cache pages it maps while reading them."""

    def __enter__(self) -> AnonymousPeak:
        self.peak, self.done = anonymous_gib(), threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while not self.done.wait(0.05):
            self.peak = max(self.peak, anonymous_gib())

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, anonymous_gib())


def part_of(name: str) -> str:
    if name.startswith("backbone.") and ".mlp.experts." in name:
        return "routed_experts"
    for part in ("backbone", "lm_head", "tower", "codec"):
        if name.startswith(part + "."):
            return part
    return "other"


def bytes_per_part(model) -> dict:
    """The model's parameters and buffers in memory, GB per part (`part_of`) and in all."""
    parts = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        parts[part_of(name)] = parts.get(part_of(name), 0) + tensor.numel() * tensor.element_size()
    parts["total"] = sum(parts.values())
    return {name: size / GB for name, size in parts.items()}


def load(checkpoint: str):
    from transformers_drama3 import Drama3Processor, FishOmniForSpeech

    model = FishOmniForSpeech.from_pretrained(checkpoint).eval()  # the default CPU path, as a user gets it
    return model, Drama3Processor.from_pretrained(checkpoint, codec=model.codec)


def warm(checkpoint: str) -> None:
    """Run each kind of step `measure` runs once, so that the step store is asked for every missing step."""
    import torch

    sys.path.insert(0, HERE)
    from frame_step import loaded_runner

    model, processor = load(checkpoint)
    model.generate(**processor(TEXT), max_new_tokens=2, do_sample=True, output_audio=False)
    with torch.no_grad():
        loaded_runner(model, step_prompt(model), 0).step()


def measured_load(checkpoint: str) -> tuple[dict, object, object]:
    """`load` with its figures: wall and CPU time, the model's bytes per part, the memory peaks (module docstring)."""
    import torch

    report = {"load_average": os.getloadavg()[0], "threads": torch.get_num_threads()}
    start, start_cpu = time.perf_counter(), time.process_time()
    with AnonymousPeak() as anonymous:
        model, processor = load(checkpoint)
    report.update(cpu_path=model.cpu_path, load_s=time.perf_counter() - start,
                  load_cpu_s=time.process_time() - start_cpu, model_gb=bytes_per_part(model),
                  layers=model.config.text_config.num_hidden_layers, peak_rss_loaded_gib=peak_gib(),
                  anonymous_peak_loading_gib=anonymous.peak, anonymous_loaded_gib=anonymous_gib())
    return report, model, processor


def measure(checkpoint: str, frames: int) -> dict:
    """One process's figures (module docstring)."""
    import torch

    report, model, processor = measured_load(checkpoint)
    report.update(timed_steps(model, frames), timed_frames=frames)
    inputs = processor(TEXT)
    report["prompt_rows"] = inputs["input_ids"].shape[1]
    torch.manual_seed(42)
    begin, cpu_start = time.perf_counter(), time.process_time()
    out = model.generate(**inputs, max_new_tokens=32, do_sample=True, output_audio=False)
    report["generate_32_s"], report["generate_32_cpu_s"] = time.perf_counter() - begin, time.process_time() - cpu_start
    report["generated_frames"] = int(out.codes[0].shape[-1])
    report["peak_rss_before_decode_gib"] = peak_gib()
    stream = model.codec.stream()
    begin = time.perf_counter()
    for chunk in out.codes[0][None].split(7, dim=-1):
        stream.decode(chunk)
    report["codec_streamed_s"] = time.perf_counter() - begin
    report["peak_rss_gib"] = peak_gib()
    return report


def per_layer_fit(points: dict[int, float]) -> tuple[float, float]:
    """(per layer, at 0 layers) of the least-squares line through {layers: ms}."""
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return slope, mean_y - slope * mean_x


def main() -> None:
    args = parse_args()
    if args.load_only:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measured_load(args.load_only)[0]))
        return
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        if args.warm:
            warm(args.child)
            return
        print(json.dumps(measure(args.child, args.frames)))
        return
    if args.directory is None:
        raise SystemExit("--directory is needed: where the checkpoints are written (several GB each)")
    counts = [int(n) for n in args.layers.split(",")]
    if min(counts) < 4:
        raise SystemExit(f"--layers {args.layers}: each count must be 4 or more (the fourth layer is the first with "
                         "full attention, which the model's cache needs)")
    os.makedirs(args.directory, exist_ok=True)
    paths = {n: write_checkpoint(args.directory, n) for n in counts}
    if args.write_only:
        return
    from transformers_drama3.generation.stored_steps import STORE_VARIABLE, default_directory

    directory = default_directory()  # None when DRAMA3_STEP_STORE is off: then nothing is filled
    store = args.store or ("off" if directory is None else str(directory))
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), STORE_VARIABLE: store}
    results = {"threads": args.threads, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "checkpoint_gb": {n: checkpoint_bytes(p) / GB for n, p in paths.items()},
               "runs": {n: [] for n in counts}}
    try:
        for n in counts if not args.no_fill and store != "off" else ():
            fill_store([sys.executable, __file__, "--child", paths[n], "--warm", "--threads", str(args.threads)],
                       environment, store)
        for _ in range(args.rounds):
            for n in counts:
                result = subprocess.run([sys.executable, __file__, "--child", paths[n], "--threads",
                                         str(args.threads), "--frames", str(args.frames)],
                                        capture_output=True, text=True, env=environment, check=True)
                results["runs"][n].append(json.loads(result.stdout.strip().splitlines()[-1]))
                run = results["runs"][n][-1]
                print(f"{n} layers: step {run['step_ms']:.1f} ms (thread CPU {run['step_cpu_ms']:.1f}, "
                      f"{run['stored_frames']} of {run['timed_frames']} stored), generate 32 {run['generate_32_s']:.2f}"
                      f" s, peak RSS {run['peak_rss_gib']:.2f} GiB, model {run['model_gb']['total']:.2f} GB, load "
                      f"average {run['load_average']:.2f}", flush=True)
        if len(counts) > 1 and args.rounds:  # `--rounds 0` only fills the store
            for figure in ("step_ms", "step_cpu_ms"):
                medians = {n: statistics.median(r[figure] for r in results["runs"][n]) for n in counts}
                slope, fixed = per_layer_fit(medians)
                results[f"{figure}_per_layer"], results[f"{figure}_at_0_layers"] = slope, fixed
                results[f"{figure}_at_{REAL_LAYERS}_layers_extrapolated"] = fixed + REAL_LAYERS * slope
                print(f"{figure}: medians {medians}; per layer {slope:.2f}, at 0 layers {fixed:.1f}, at "
                      f"{REAL_LAYERS} layers (extrapolated) {fixed + REAL_LAYERS * slope:.1f}")
    finally:
        if args.output:
            with open(args.output, "w") as f:
                json.dump(results, f, indent=2)
        if not args.keep:
            for path in paths.values():
                shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
