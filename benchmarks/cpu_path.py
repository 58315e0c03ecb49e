"""The CPU path (cpu_path.py) against the float32 reference, as a user runs them: each load in a process of its own.

Per path and round, a fresh process loads the checkpoint with `FishOmniForSpeech.from_pretrained(path,
cpu_path=...)` and measures: the load; time to first audio (from the `generate` call, with the prompt rows already made
by the processor, to the first streamed chunk of `Drama3AudioStreamer(first_chunk_frames=1)`: prefill, one frame and
its audio), on the first call and on a later one; the frame step (`FrameState.step` as `generate` runs it, after a
50-row prefill, median of `--frames` steps; CPU time of the thread too, steadier on a shared machine; `stored_frames`:
how many of them a stored compiled step ran, generation/stored_steps.py); 32 greedy frames through `generate` and
their codec decode, first streamed in chunks of 7 frames as `drama3-tts` decodes, then in one call as
`generate(output_audio=True)` does; the process's peak RSS (`ru_maxrss`, as `/usr/bin/time` reports it) before the
decodes, after the streamed one and at the end, and its memory after each stage (`memory_mib`: resident, anonymous,
file-backed, peak). Wall times come with the process's CPU time (`*_cpu_s`, every
thread), and each process reports the load average at its start. Paths run interleaved, `--rounds` times.

Before the rounds, the step store (`--store`, default the package's) is filled for each path that uses one: a
process runs the steps measured here and waits for the background compiles they ask for, until none is missing
(minutes, once per checkpoint, thread count and package version). `--no-fill` measures whatever the store holds;
`--rounds 0` only fills it.

The checkpoint is the `small` geometry of configs.py with a tower vocabulary of 4096 and the real Fish DAC codec, FP8
experts as shipped, written once by the package's writer (`write_tiny_checkpoint`, seed 0) into the temp directory
(`--checkpoint` to use another). The prompt: "Hello there, how are you today?" (61 rows).

    python benchmarks/cpu_path.py --paths float32,auto --threads 1 --rounds 3
    python benchmarks/cpu_path.py --paths float32,auto --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import glob
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
    parser.add_argument("--store", default=None, help="the step store's folder (default: the package's)")
    parser.add_argument("--no-fill", action="store_true", help="do not fill the step store first")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
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


def memory_mib() -> list[int]:
    """This process's resident memory now, its anonymous part (heap, tensors) and its file-backed part (libraries,
    memory-mapped weights such as the codec's), and the peak so far (Linux's /proc/self/status), MiB."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return [int(fields[name].split()[0]) // 1024 for name in ("VmRSS", "RssAnon", "RssFile", "VmHWM")]


def peak_gib() -> float:
    """This process's peak resident memory so far (`ru_maxrss`, as `/usr/bin/time` reports it), GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def step_prompt(model):
    """The 50 random text rows the frame step is timed after."""
    import torch

    prompt = torch.zeros(1, 50, 1 + model.config.num_codebooks, dtype=torch.long)
    prompt[..., 0] = torch.randint(0, model.config.eos_token_id, (1, 50), generator=torch.Generator().manual_seed(0))
    return prompt


def timed_steps(model, frames: int) -> dict:
    """The frame step `generate` runs (sampled, after `step_prompt`): 4 warm-up steps, then the median wall and
    calling-thread CPU ms of `frames` steps (`step_ms`, `step_cpu_ms`), each step's wall ms, and how many steps a
    stored compiled step ran (`stored_frames`, the warm-up's included)."""
    import torch

    sys.path.insert(0, HERE)
    from frame_step import loaded_runner

    wall, cpu = [], []
    with torch.no_grad():
        runner = loaded_runner(model, step_prompt(model), 0)
        for _ in range(4):
            runner.step()
        for _ in range(frames):
            begin, thread = time.perf_counter(), time.thread_time()
            runner.step()
            wall.append(time.perf_counter() - begin)
            cpu.append(time.thread_time() - thread)
    return {"step_ms": 1e3 * statistics.median(wall), "step_cpu_ms": 1e3 * statistics.median(cpu),
            "step_ms_all": [1e3 * t for t in wall], "stored_frames": runner.stored_frames}


def warm(checkpoint: str, cpu_path: str) -> None:
    """Run each kind of step `measure` runs (greedy and sampled `generate`, the timed runner) once, so that the step
    store is asked for every missing step."""
    import torch

    sys.path.insert(0, HERE)
    from frame_step import loaded_runner

    from transformers_drama3 import Drama3Processor, FishOmniForSpeech

    model = FishOmniForSpeech.from_pretrained(checkpoint, cpu_path=cpu_path).eval()
    inputs = Drama3Processor.from_pretrained(checkpoint, codec=model.codec)(TEXT)
    for sample in (False, True):
        model.generate(**inputs, max_new_tokens=2, do_sample=sample, output_audio=False)
    with torch.no_grad():
        loaded_runner(model, step_prompt(model), 0).step()


def fill_store(warm_command: list[str], environment: dict, store: str) -> None:
    """Run the warm process `warm_command` until one asks for no compile (each waits for the background compiles
    asked, one at a time). The command names the timed runs' thread count: a stored step is for its thread count."""
    for _ in range(8):
        subprocess.run(warm_command, capture_output=True, text=True, env=environment, check=True)
        if not glob.glob(os.path.join(store, "*", "*.lock")):
            return
        while glob.glob(os.path.join(store, "*", "*.lock")):
            time.sleep(5)


def measure(checkpoint: str, cpu_path: str, frames: int) -> dict:
    """One process's figures (module docstring)."""
    from transformers_drama3 import Drama3AudioStreamer, Drama3Processor, FishOmniForSpeech

    report = {"load_average": os.getloadavg()[0], "memory_mib": {"imported": memory_mib()}}
    start, start_cpu = time.perf_counter(), time.process_time()
    model = FishOmniForSpeech.from_pretrained(checkpoint, cpu_path=cpu_path).eval()
    processor = Drama3Processor.from_pretrained(checkpoint, codec=model.codec)
    report.update(path=model.cpu_path, load_s=time.perf_counter() - start, load_cpu_s=time.process_time() - start_cpu,
                  weights_gib=sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30)
    inputs = processor(TEXT)
    report["prompt_rows"] = inputs["input_ids"].shape[1]
    report["memory_mib"]["loaded"] = memory_mib()
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
    report["memory_mib"]["generated"] = memory_mib()
    report["peak_rss_before_decode_gib"] = peak_gib()
    stream = model.codec.stream()
    begin, cpu = time.perf_counter(), time.process_time()
    for chunk in out.codes[0][None].split(7, dim=-1):
        stream.decode(chunk)
    report["codec_32_streamed_s"] = time.perf_counter() - begin
    report["codec_32_streamed_cpu_s"] = time.process_time() - cpu
    report["peak_rss_streamed_decode_gib"] = peak_gib()
    report["memory_mib"]["streamed decode"] = memory_mib()
    begin, cpu = time.perf_counter(), time.process_time()
    model.codec.decode(out.codes[0][None])
    report["codec_32_s"], report["codec_32_cpu_s"] = time.perf_counter() - begin, time.process_time() - cpu
    report["memory_mib"]["one-shot decode"] = memory_mib()
    report.update(timed_steps(model, frames))
    report["frames"] = out.sequences[0, report["prompt_rows"]:].tolist()
    report["peak_rss_gib"] = peak_gib()
    return report


def main() -> None:
    args = parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        if args.warm:
            warm(args.checkpoint, args.child)
            return
        print(json.dumps(measure(args.checkpoint, args.child, args.frames)))
        return
    checkpoint = args.checkpoint or small_checkpoint()
    paths = args.paths.split(",")
    runs = {path: [] for path in paths}
    from transformers_drama3.generation.stored_steps import STORE_VARIABLE, default_directory

    directory = default_directory()  # None when DRAMA3_STEP_STORE is off: then nothing is filled
    store = args.store or ("off" if directory is None else str(directory))
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), STORE_VARIABLE: store}
    for path in paths if not args.no_fill and store != "off" else ():
        if path != "float32":
            fill_store([sys.executable, __file__, "--child", path, "--warm", "--checkpoint", checkpoint, "--threads",
                        str(args.threads)], environment, store)
    for _ in range(args.rounds):
        for path in paths:
            result = subprocess.run([sys.executable, __file__, "--child", path, "--checkpoint", checkpoint,
                                     "--threads", str(args.threads), "--frames", str(args.frames)],
                                    capture_output=True, text=True, env=environment, check=True)
            runs[path].append(json.loads(result.stdout.strip().splitlines()[-1]))
    if not args.rounds:  # `--rounds 0`: only fill the step store
        return
    reference = runs[paths[0]][0]["frames"]
    names = ("step_ms", "step_cpu_ms", "stored_frames", "generate_32_s", "generate_32_cpu_s", "codec_32_streamed_s",
             "codec_32_streamed_cpu_s", "codec_32_s", "codec_32_cpu_s", "first_audio_first_call_s",
             "first_audio_first_call_cpu_s", "first_audio_later_call_s", "first_audio_later_call_cpu_s", "load_s",
             "load_cpu_s", "peak_rss_before_decode_gib", "peak_rss_streamed_decode_gib", "peak_rss_gib", "weights_gib",
             "load_average")
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
