"""The CPU path (cpu_path.py) against the float32 reference, as a user runs them: each load in a process of its own.

Per path and round, a fresh process loads the checkpoint with `FishOmniForSpeech.from_pretrained(path,
cpu_path=...)` and measures: the load; time to first audio (from the `generate` call, with the prompt rows already made
by the processor, to the first streamed chunk of `Drama3AudioStreamer(first_chunk_frames=1)`: prefill, one frame and
its audio), on the first call and on a later one; the frame step (`FrameState.step` as `generate` runs it, after a
50-row prefill, median of `--frames` steps; CPU time of the thread too, steadier on a shared machine); 32 greedy frames
through `generate` and their codec decode (one call for the 32 frames); the process's peak RSS (`ru_maxrss`, as
`/usr/bin/time` reports it) and its RSS just before that one-shot decode. Wall times come with the process's CPU
time (`*_cpu_s`, every thread), and each process reports the load average at its start. Paths run interleaved,
`--rounds` times.

The checkpoint is the `small` geometry of configs.py with a tower vocabulary of 4096 and the real Fish DAC codec, FP8
experts as shipped, written once by the package's writer (`write_tiny_checkpoint`, seed 0) into the temp directory
(`--checkpoint` to use another). The prompt: "Hello there, how are you today?" (61 rows).

    python benchmarks/cpu_path.py --paths float32,auto --threads 1 --rounds 3
    python benchmarks/cpu_path.py --paths float32,auto --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

TEXT = "Hello there, how are you today?"
HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="float32,auto", help="comma-separated cpu_path values (default float32,auto)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per path, interleaved (default 3)")
    parser.add_argument("--frames", type=int, default=24, help="timed frame steps per process (default 24)")
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the small one, written once)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help="where to write the JSON results")
    return parser.parse_args()


def small_checkpoint() -> str:
    """The `small` checkpoint with a 4096-code tower and the real codec, written once into the temp directory."""
    sys.path.insert(0, HERE)
    from configs import SMALL_CONFIG

    from transformers_drama3 import FishDACConfig
    from transformers_drama3.testing import write_tiny_checkpoint

    path = os.path.join(tempfile.gettempdir(), "transformers-drama3-cpu-path-small")
    if not os.path.isfile(os.path.join(path, "config.json")):
        config = {name: dict(section) for name, section in SMALL_CONFIG.items()}
        config["audio_decoder_config"]["vocab_size"] = 4096
        write_tiny_checkpoint(path, seed=0, max_shard_size="200MB", codec_config=FishDACConfig().to_dict(), **config)
    return path


def resident_gib() -> float:
    """This process's resident memory now (Linux's /proc/self/statm: resident pages), GiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def measure(checkpoint: str, cpu_path: str, frames: int) -> dict:
    """One process's figures (module docstring)."""
    import torch

    sys.path.insert(0, HERE)
    from frame_step import loaded_runner

    from transformers_drama3 import Drama3AudioStreamer, Drama3Processor, FishOmniForSpeech

    report = {"load_average": os.getloadavg()[0]}
    start = time.perf_counter()
    model = FishOmniForSpeech.from_pretrained(checkpoint, cpu_path=cpu_path).eval()
    processor = Drama3Processor.from_pretrained(checkpoint, codec=model.codec)
    report.update(path=model.cpu_path, load_s=time.perf_counter() - start,
                  weights_gib=sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30)
    inputs = processor(TEXT)
    report["prompt_rows"] = inputs["input_ids"].shape[1]
    for call in ("first", "later"):
        chunks = []
        streamer = Drama3AudioStreamer(model.codec, first_chunk_frames=1,
                                       on_audio=lambda sequence, chunk: chunks.append((time.perf_counter(),
                                                                                       time.process_time())))
        begin, cpu = time.perf_counter(), time.process_time()
        model.generate(**inputs, max_new_tokens=1, do_sample=False, streamer=streamer, output_audio=False)
        report[f"first_audio_{call}_call_s"] = chunks[0][0] - begin
        report[f"first_audio_{call}_call_cpu_s"] = chunks[0][1] - cpu
    begin, cpu = time.perf_counter(), time.process_time()
    out = model.generate(**inputs, max_new_tokens=32, do_sample=False, output_audio=False)
    report["generate_32_s"], report["generate_32_cpu_s"] = time.perf_counter() - begin, time.process_time() - cpu
    report["generated_frames"] = len(out.codes[0][0])
    report["rss_before_one_shot_decode_gib"] = resident_gib()
    begin, cpu = time.perf_counter(), time.process_time()
    model.codec.decode(out.codes[0][None])
    report["codec_32_s"], report["codec_32_cpu_s"] = time.perf_counter() - begin, time.process_time() - cpu
    prompt = torch.zeros(1, 50, 1 + model.config.num_codebooks, dtype=torch.long)
    prompt[..., 0] = torch.randint(0, model.config.eos_token_id, (1, 50), generator=torch.Generator().manual_seed(0))
    wall, cpu = [], []
    with torch.no_grad():
        runner = loaded_runner(model, prompt, 0)
        for _ in range(4):
            runner.step()
        for _ in range(frames):
            begin, thread = time.perf_counter(), time.thread_time()
            runner.step()
            wall.append(time.perf_counter() - begin)
            cpu.append(time.thread_time() - thread)
    report["step_ms"] = 1e3 * statistics.median(wall)
    report["step_cpu_ms"] = 1e3 * statistics.median(cpu)
    report["frames"] = out.sequences[0, report["prompt_rows"]:].tolist()
    report["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return report


def main() -> None:
    args = parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.checkpoint, args.child, args.frames)))
        return
    checkpoint = args.checkpoint or small_checkpoint()
    paths = args.paths.split(",")
    runs = {path: [] for path in paths}
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for _ in range(args.rounds):
        for path in paths:
            result = subprocess.run([sys.executable, __file__, "--child", path, "--checkpoint", checkpoint,
                                     "--threads", str(args.threads), "--frames", str(args.frames)],
                                    capture_output=True, text=True, env=environment, check=True)
            runs[path].append(json.loads(result.stdout.strip().splitlines()[-1]))
    reference = runs[paths[0]][0]["frames"]
    names = ("step_ms", "step_cpu_ms", "generate_32_s", "generate_32_cpu_s", "codec_32_s", "codec_32_cpu_s",
             "first_audio_first_call_s", "first_audio_later_call_s", "first_audio_later_call_cpu_s", "load_s",
             "peak_rss_gib", "rss_before_one_shot_decode_gib", "weights_gib", "load_average")
    print(f"CPU path, {args.threads} thread(s), {args.rounds} processes per path; min / median")
    for path, results in runs.items():
        figures = ", ".join(f"{name} {min(r[name] for r in results):.3g} / "
                            f"{statistics.median(r[name] for r in results):.3g}" for name in names)
        same = sum(a == b for a, b in zip(results[0]["frames"], reference))
        print(f"{path} ({results[0]['path']}): {figures}; greedy frames equal to {paths[0]}'s: {same} of {len(reference)}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"threads": args.threads, "runs": runs, "command": " ".join(sys.argv)}, f, indent=2)


if __name__ == "__main__":
    main()
