"""Speed of the real-size Fish DAC codec (random weights): decode and encode, one-shot and streamed.

Speed is reported as a real-time factor: seconds of audio processed per second of compute (> 1 is faster than
real time). The codec has the real Drama 3 constants (`FishDACConfig()`, ~391 M parameters) with random weights
from `random_original_codec_state_dict`, loaded through the same folding path as a real `codec.pth`.

    python benchmarks/codec.py --seconds 3 --output codec-benchmark.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone

import torch

from transformers_drama3.configuration_drama3 import FishDACConfig
from transformers_drama3.modeling_codec import FishDACCodec
from transformers_drama3.testing import random_original_codec_state_dict


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="audio duration per measurement (default 3 s)")
    parser.add_argument("--chunk-frames", type=int, default=7, help="frames per streamed chunk (default 7)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per measurement; the best is kept")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="codec precision")
    parser.add_argument("--allow-tf32", action="store_true", help="let CUDA use TF32 (the codec keeps it off)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="codec-benchmark.json", help="where to write the JSON results")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(run, repeats: int, device: torch.device) -> float:
    """Shortest wall time of `repeats` calls of `run()` in seconds."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def build_codec(seed: int, device: torch.device, dtype: torch.dtype) -> tuple[FishDACCodec, float]:
    start = time.perf_counter()
    config = FishDACConfig()
    state_dict = random_original_codec_state_dict(config, torch.Generator().manual_seed(seed))
    codec = FishDACCodec.from_codec_state_dict(state_dict, config)  # what loading a real codec.pth runs
    codec = codec.to(device=device, dtype=dtype)
    return codec, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    codec, build_seconds = build_codec(args.seed, device, dtype)
    codec.allow_tf32 = args.allow_tf32
    config = codec.config
    frames = max(1, math.ceil(args.seconds * config.sample_rate / config.frame_length))
    audio_seconds = frames * config.frame_length / config.sample_rate
    generator = torch.Generator().manual_seed(args.seed)
    codes = torch.stack(
        [torch.randint(0, size, (1, frames), generator=generator) for size in config.codebook_sizes], dim=1
    ).to(device)
    audio = (0.3 * torch.randn(1, 1, frames * config.frame_length, generator=generator)).to(device)  # [batch, channels, samples]

    def stream_decode() -> None:
        stream = codec.stream()
        for start in range(0, frames, args.chunk_frames):
            stream.decode(codes[..., start : start + args.chunk_frames])

    codec.decode(codes[..., :1])  # warm-up (allocator, kernels)
    results = {}
    for name, run in (
        ("decode one-shot", lambda: codec.decode(codes)),
        (f"decode streamed ({args.chunk_frames}-frame chunks)", stream_decode),
        ("encode one-shot", lambda: codec.encode(audio, config.sample_rate)),
    ):
        seconds = best_time(run, args.repeats, device)
        results[name] = {"compute_s": seconds, "realtime_factor": audio_seconds / seconds}

    chunk_seconds = args.chunk_frames * config.frame_length / config.sample_rate
    stream_name = f"decode streamed ({args.chunk_frames}-frame chunks)"
    chunks = math.ceil(frames / args.chunk_frames)
    results[stream_name]["mean_chunk_s"] = results[stream_name]["compute_s"] / chunks

    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": str(device),
        "dtype": args.dtype,
        "allow_tf32": args.allow_tf32,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "parameters_folded": sum(p.numel() for p in codec.parameters()),
        "build_and_load_s": build_seconds,
        "audio_seconds": audio_seconds,
        "frames": frames,
        "chunk_frames": args.chunk_frames,
        "chunk_audio_seconds": chunk_seconds,
        "results": results,
    }
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
        report["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)

    print(f"Fish DAC codec, real size, random weights: {args.device} {args.dtype}"
          f"{' tf32' if args.allow_tf32 else ''}, {report['torch_threads']} threads, "
          f"{audio_seconds:.2f} s of audio ({frames} frames)")
    print(f"{'measurement':<34} {'compute (s)':>12} {'audio s / compute s':>20}")
    for name, result in results.items():
        print(f"{name:<34} {result['compute_s']:>12.2f} {result['realtime_factor']:>20.3f}")
    print(f"streamed: {results[stream_name]['mean_chunk_s']:.2f} s of compute per {args.chunk_frames}-frame chunk "
          f"({chunk_seconds:.3f} s of audio)")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
