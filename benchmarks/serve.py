"""Throughput and time to first audio of `drama3-serve` for 1, 4 and 16 concurrent clients, against the same
requests sent one at a time.

A real uvicorn server runs in this process (a thread, 127.0.0.1, `--max-batch` 16) on a random checkpoint; clients
are httpx coroutines. For each concurrency C the same C * `--requests-per-client` greedy requests (distinct texts,
`--frames` frames each, streamed 16-bit PCM) are sent twice: by C clients at once, each sending its requests back to
back, and one at a time. Reported per concurrency: audio seconds per wall second (throughput), time to first audio
(from sending the request to the first audio byte) p50 and p90 (nearest rank), the batch occupancy (frame steps by
the number of requests that made a frame in them), and
the ratio of throughputs concurrent / one at a time (the gain from batching, measured side by side in one run).

Checkpoints: `tiny` (the embedded tiny checkpoint: golden tiny geometry), `small` (the `small` backbone and tower
of benchmarks/configs.py, hidden 512 with 8 layers and 16 experts, written as a checkpoint with the tiny codec and
tokenizer), or `--checkpoint DIR` (any checkpoint, e.g. on a GPU machine).

    python benchmarks/serve.py --config tiny --output serve-tiny.json
    python benchmarks/serve.py --config small --frames 24 --output serve-small.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import httpx
import torch

from configs import served_checkpoint
from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.thread import ServerThread

SAMPLE_BYTES = 2  # 16-bit PCM
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Did you hear that?", "Good morning, everyone.",
         "Thanks for waiting, we can start now.", "She whispered softly, then laughed out loud!",
         "Numbers: one, two, three.", "This is my voice, recorded on a quiet afternoon.", "Nice to meet you."]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", choices=["tiny", "small"], default="tiny")
    source.add_argument("--checkpoint", help="serve this checkpoint directory instead")
    parser.add_argument("--device", default="auto", help='"cpu", "cuda", ... (default: cuda if available)')
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (default 1,4,16)")
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--frames", type=int, default=32, help="max_new_tokens of every request (default 32)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 0 = torch's choice)")
    parser.add_argument("--output", help="where to write the JSON results")
    return parser.parse_args()


def checkpoint(args: argparse.Namespace) -> str:
    if args.checkpoint:
        return args.checkpoint
    return served_checkpoint(args.config)


async def one_request(client: httpx.AsyncClient, text: str, frames: int) -> dict:
    """Send one streamed pcm request: time to first audio byte, total time and audio seconds."""
    body = {"model": "benchmark", "input": text, "temperature": 0, "max_new_tokens": frames, "response_format": "pcm"}
    start = time.perf_counter()
    first, size = None, 0
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        response.raise_for_status()
        rate = int(response.headers["x-sample-rate"])
        async for piece in response.aiter_raw():
            if first is None and piece:
                first = time.perf_counter() - start
            size += len(piece)
    return {"first_audio_s": first, "seconds": time.perf_counter() - start, "audio_s": size / SAMPLE_BYTES / rate}


async def run_clients(url: str, clients: int, per_client: int, frames: int) -> tuple[list[dict], float]:
    """`clients` clients at once, each sending `per_client` requests back to back: (results, wall seconds)."""
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=clients)) as client:

        async def client_loop(index: int) -> list[dict]:
            texts = [TEXTS[(index * per_client + n) % len(TEXTS)] + f" ({index}.{n})" for n in range(per_client)]
            return [await one_request(client, text, frames) for text in texts]

        start = time.perf_counter()
        results = await asyncio.gather(*[client_loop(index) for index in range(clients)])
        return [r for rs in results for r in rs], time.perf_counter() - start


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def measure(server: ServerThread, clients: int, per_client: int, frames: int) -> dict:
    metrics = server.service.worker.metrics
    before = dict(metrics.occupancy)
    together, together_wall = asyncio.run(run_clients(server.url, clients, per_client, frames))
    sizes = {size: count - before.get(size, 0) for size, count in metrics.occupancy.items()
             if count - before.get(size, 0)}
    alone, alone_wall = asyncio.run(run_clients(server.url, 1, clients * per_client, frames))
    audio = sum(r["audio_s"] for r in together)
    first = [r["first_audio_s"] for r in together if r["first_audio_s"] is not None]
    return {
        "clients": clients, "requests": len(together), "audio_s": audio,
        "concurrent_wall_s": together_wall, "throughput": audio / together_wall,
        "first_audio_p50_s": statistics.median(first) if first else None,
        "first_audio_p90_s": percentile(first, 0.9) if first else None,
        "occupancy": {str(size): count for size, count in sorted(sizes.items())},
        "one_at_a_time_wall_s": alone_wall,
        "one_at_a_time_throughput": sum(r["audio_s"] for r in alone) / alone_wall,
        "one_at_a_time_first_audio_p50_s": statistics.median(r["first_audio_s"] for r in alone if r["first_audio_s"]),
    }


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = checkpoint(args)
    server = ServerThread(ServerSettings(model=path, model_name="benchmark", device=args.device,
                                         max_batch=args.max_batch, max_frames=max(args.frames, 1))).wait_until_ready()
    started = datetime.now(timezone.utc)
    try:
        # First-call costs (buffers sized for the request's frames, lazy initialisation) out of the figures.
        one_request_warmup = asyncio.run(run_clients(server.url, 1, 1, args.frames))
        rows = [measure(server, int(c), args.requests_per_client, args.frames) for c in args.concurrency.split(",")]
    finally:
        server.stop()
    result = {
        "checkpoint": args.checkpoint or args.config, "frames": args.frames, "max_batch": args.max_batch,
        "device": str(server.service.model.input_device), "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "torch": torch.__version__, "started_utc": started.isoformat(),
        "finished_utc": datetime.now(timezone.utc).isoformat(), "warmup_s": one_request_warmup[1], "rows": rows,
    }
    print(f"{result['checkpoint']} on {result['device']}, {args.frames} frames per request, "
          f"threads {result['threads']}")
    print("clients | audio s / wall s | one at a time | ratio | first audio p50 / p90 | frame steps by occupancy")
    for row in rows:
        print(f"{row['clients']:>7} | {row['throughput']:>16.3f} | {row['one_at_a_time_throughput']:>13.3f} | "
              f"{row['throughput'] / row['one_at_a_time_throughput']:>5.2f} | "
              f"{row['first_audio_p50_s']:.3f} s / {row['first_audio_p90_s']:.3f} s | {row['occupancy']}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
