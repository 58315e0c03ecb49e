"""Load and fault runs of `drama3-serve`, for several versions of the package side by side in one run.

Each version (`--source`: this tree, or a git commit whose `src/` is extracted with `git archive` into a temporary
folder; no worktree) runs as its own `drama3-serve` process (PYTHONPATH set to that version's `src/`) on the same
checkpoint, one after another, and meets the same scenarios, with the same random draws:

- **late**: a short request's time to first audio while a long one streams, against the same request alone (median
  of `--repeats`); the ratio is what continuous batching is meant to bring down to about 1.
- **capacity**: 16 clients at once, each sending requests back to back (mixed lengths and settings): requests/s and
  frames/s. The first version's capacity sets the arrival rates of the next scenario, for every version.
- **poisson**: Poisson arrivals at 50 % and 90 % of that capacity (mixed lengths: `--frames-mix`; mixed settings:
  greedy, sampled at two temperatures, top-p, top-k): time to first audio p50 / p99, frames/s, requests/s.
- **disconnect**: rounds of clients that leave after their first audio; the server's RSS after each round, and its
  queue and running batch at the end (both must be empty, and the RSS flat after the first round).

Time to first audio is from sending the request to its first audio byte. Frames are counted from the bytes received
(2048 16-bit samples a frame). The JSON output has every figure; the table sums them up.

    python benchmarks/serve_load.py --config tiny --source . --source main --output serve-load-tiny.json
    python benchmarks/serve_load.py --config small --frames-mix 8,16,32 --long-frames 160 --source . --source main
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from configs import served_checkpoint

BYTES_PER_FRAME = 2048 * 2
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Did you hear that?", "Good morning, everyone.",
         "Thanks for waiting, we can start now.", "She whispered softly, then laughed out loud!",
         "Numbers: one, two, three.", "This is my voice, recorded on a quiet afternoon.", "Nice to meet you."]
SETTINGS_MIX = [{"temperature": 0}, {"temperature": 0.8}, {"temperature": 1.0, "top_p": 0.8},
                {"temperature": 0.7, "top_k": 20}]
REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--source", action="append", help="'.' (this tree) or a git commit/branch; repeat to compare "
                        "(default: this tree only)")
    parser.add_argument("--scenarios", default="late,capacity,poisson,disconnect")
    parser.add_argument("--frames-mix", default="8,16,32,64", help="max_new_tokens of the mixed requests")
    parser.add_argument("--short-frames", type=int, default=8)
    parser.add_argument("--long-frames", type=int, default=240)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48, help="requests per capacity and Poisson run")
    parser.add_argument("--disconnect-rounds", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="where to write the JSON results")
    return parser.parse_args()


def source_tree(source: str, scratch: Path) -> tuple[str, Path]:
    """(label, src folder) of a version: this tree, or a commit's `src/` extracted by `git archive`."""
    if source == ".":
        return "this tree", REPO / "src"
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", source], check=True,
                            capture_output=True, text=True).stdout.strip()
    target = scratch / commit
    if not target.exists():
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"], check=True,
                                 capture_output=True).stdout
        target.mkdir(parents=True)
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
    return f"{source} ({commit})", target / "src"


class Server:
    """`drama3-serve` of one version as a process on a free port."""

    def __init__(self, src: Path, model: str, max_batch: int, max_frames: int, log: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        command = [sys.executable, "-m", "transformers_drama3.serving.cli", "--model", model, "--model-name",
                   "benchmark", "--port", str(self.port), "--max-batch", str(max_batch), "--max-frames",
                   str(max_frames), "--max-queue", "1024", "--log-level", "warning"]
        self.log = open(log, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_until_ready(self, timeout: float = 600) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the server was not ready in time")

    def rss_mb(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def metrics(self) -> dict:
        """Its queue, running requests and cancelled count, from `GET /metrics` (the Prometheus text format)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ("drama3_queue_length", "drama3_running"):
                    values[{"drama3_queue_length": "queued", "drama3_running": "running"}[sample.name]] = sample.value
                elif sample.name == "drama3_speech_requests_total" and sample.labels.get("outcome") == "cancelled":
                    values["cancelled"] = sample.value
        return values

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


async def request(client: httpx.AsyncClient, text: str, frames: int, settings: dict, seed: int,
                  leave_after_first: bool = False) -> dict:
    """One streamed pcm request: time to first audio, total time and frames received."""
    body = {"model": "benchmark", "input": text, "max_new_tokens": frames, "response_format": "pcm", "seed": seed,
            **settings}
    start = time.perf_counter()
    first, size = None, 0
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        response.raise_for_status()
        async for piece in response.aiter_raw():
            if first is None and piece:
                first = time.perf_counter() - start
                if leave_after_first:
                    break
            size += len(piece)
    return {"first_audio_s": first, "seconds": time.perf_counter() - start, "frames": size / BYTES_PER_FRAME}


def mixed_requests(count: int, frames_mix: list[int], seed: int) -> list[tuple[str, int, dict, int]]:
    """The same `count` (text, frames, settings, seed) for every version."""
    draw = random.Random(seed)
    return [(f"{draw.choice(TEXTS)} ({n})", draw.choice(frames_mix), draw.choice(SETTINGS_MIX), draw.randrange(2**31))
            for n in range(count)]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def summary(results: list[dict], wall: float) -> dict:
    first = [r["first_audio_s"] for r in results if r["first_audio_s"] is not None]
    frames = sum(r["frames"] for r in results)
    return {"requests": len(results), "wall_s": wall, "requests_per_s": len(results) / wall,
            "frames_per_s": frames / wall, "first_audio_p50_s": statistics.median(first),
            "first_audio_p99_s": percentile(first, 0.99)}


def client_for(server: Server, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=None, limits=httpx.Limits(max_connections=connections))


async def late_arrival(server: Server, args) -> dict:
    async with client_for(server, 4) as client:
        alone = [await request(client, "Did you hear that?", args.short_frames, {"temperature": 0}, n)
                 for n in range(args.repeats)]
        behind = []
        for n in range(args.repeats):
            started = asyncio.Event()

            async def long_one():
                body = {"model": "benchmark", "input": "A long story begins here, and it goes on for a while.",
                        "max_new_tokens": args.long_frames, "response_format": "pcm", "temperature": 0}
                async with client.stream("POST", "/v1/audio/speech", json=body) as response:
                    async for piece in response.aiter_raw():
                        if piece:
                            started.set()

            task = asyncio.create_task(long_one())
            await started.wait()
            behind.append(await request(client, "Did you hear that?", args.short_frames, {"temperature": 0}, n))
            await task
    alone_s = statistics.median(r["first_audio_s"] for r in alone)
    behind_s = statistics.median(r["first_audio_s"] for r in behind)
    return {"alone_first_audio_s": alone_s, "behind_long_first_audio_s": behind_s, "ratio": behind_s / alone_s,
            "long_frames": args.long_frames, "short_frames": args.short_frames}


async def capacity(server: Server, args, frames_mix: list[int]) -> dict:
    work = mixed_requests(args.requests, frames_mix, args.seed)
    async with client_for(server, args.clients) as client:
        queue = list(work)

        async def worker() -> list[dict]:
            done = []
            while queue:
                text, frames, settings, seed = queue.pop(0)
                done.append(await request(client, text, frames, settings, seed))
            return done

        start = time.perf_counter()
        results = await asyncio.gather(*[worker() for _ in range(args.clients)])
        wall = time.perf_counter() - start
    return {"clients": args.clients, **summary([r for rs in results for r in rs], wall)}


async def poisson(server: Server, args, frames_mix: list[int], rate: float) -> dict:
    work = mixed_requests(args.requests, frames_mix, args.seed + 1)
    gaps = random.Random(args.seed + 2)
    async with client_for(server, args.requests) as client:
        tasks, start = [], time.perf_counter()
        for text, frames, settings, seed in work:
            tasks.append(asyncio.create_task(request(client, text, frames, settings, seed)))
            await asyncio.sleep(gaps.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return {"arrivals_per_s": rate, **summary(list(results), wall)}


async def disconnects(server: Server, args) -> dict:
    rss = [server.rss_mb()]
    async with client_for(server, args.clients) as client:
        for round_ in range(args.disconnect_rounds):
            await asyncio.gather(*[request(client, f"{TEXTS[n % len(TEXTS)]} ({round_}.{n})", 64, {"temperature": 0.8},
                                           n, leave_after_first=True) for n in range(args.clients)])
            await asyncio.sleep(2)  # cancelled requests leave at the next frame
            rss.append(server.rss_mb())
    deadline = time.monotonic() + 60
    metrics = server.metrics()
    while (metrics.get("queued") or metrics.get("running")) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        metrics = server.metrics()
    return {"rounds": args.disconnect_rounds, "clients": args.clients, "rss_mb": rss,
            "rss_growth_after_first_round_mb": rss[-1] - rss[1], "queued_after": metrics.get("queued"),
            "running_after": metrics.get("running"), "cancelled": metrics.get("cancelled")}


def run_version(label: str, src: Path, args, model: str, frames_mix: list[int], rates: list[float] | None,
                scratch: Path) -> dict:
    scenarios = args.scenarios.split(",")
    server = Server(src, model, args.max_batch, max(frames_mix + [args.long_frames, 64]),
                    scratch / f"server-{len(os.listdir(scratch))}.log").wait_until_ready()
    result = {"version": label}

    def say(what: str) -> None:
        print(f"   {datetime.now(timezone.utc):%H:%M:%S} {what}", flush=True)

    try:
        asyncio.run(late_arrival(server, argparse.Namespace(**{**vars(args), "repeats": 1})))  # warm-up
        say("ready")
        if "late" in scenarios:
            say("late arrival")
            result["late"] = asyncio.run(late_arrival(server, args))
        if "capacity" in scenarios or "poisson" in scenarios:
            say("capacity")
            result["capacity"] = asyncio.run(capacity(server, args, frames_mix))
        if "poisson" in scenarios:
            rates = rates or [share * result["capacity"]["requests_per_s"] for share in (0.5, 0.9)]
            say(f"poisson at {', '.join(f'{rate:.2f}' for rate in rates)} requests/s")
            result["poisson"] = [asyncio.run(poisson(server, args, frames_mix, rate)) for rate in rates]
        if "disconnect" in scenarios:
            say("disconnects")
            result["disconnect"] = asyncio.run(disconnects(server, args))
        say("done")
    finally:
        server.stop()
    return result


def main() -> int:
    args = parse_args()
    frames_mix = [int(f) for f in args.frames_mix.split(",")]
    model = served_checkpoint(args.config)
    started = datetime.now(timezone.utc)
    versions, rates = [], None
    with tempfile.TemporaryDirectory(prefix="drama3-serve-load-") as scratch:
        for source in args.source or ["."]:
            label, src = source_tree(source, Path(scratch))
            print(f"-- {label}", flush=True)
            versions.append(run_version(label, src, args, model, frames_mix, rates, Path(scratch)))
            if "poisson" in versions[-1]:
                rates = [row["arrivals_per_s"] for row in versions[-1]["poisson"]]  # the first version's capacity
    result = {"config": args.config, "args": vars(args), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "load_average": os.getloadavg(), "started_utc": started.isoformat(),
              "finished_utc": datetime.now(timezone.utc).isoformat(), "versions": versions}
    for version in versions:
        print(f"\n{version['version']}")
        if "late" in version:
            late = version["late"]
            print(f"  late arrival: first audio alone {late['alone_first_audio_s']:.3f} s, behind a "
                  f"{late['long_frames']}-frame request {late['behind_long_first_audio_s']:.3f} s "
                  f"({late['ratio']:.1f}x)")
        rows = ([("capacity, %d clients" % version["capacity"]["clients"], version["capacity"])]
                if "capacity" in version else [])
        rows += [(f"poisson {row['arrivals_per_s']:.2f}/s", row) for row in version.get("poisson", [])]
        for name, row in rows:
            print(f"  {name:<22} requests/s {row['requests_per_s']:.2f}  frames/s {row['frames_per_s']:.1f}  "
                  f"first audio p50 {row['first_audio_p50_s']:.3f} s  p99 {row['first_audio_p99_s']:.3f} s")
        if "disconnect" in version:
            d = version["disconnect"]
            print(f"  disconnects: RSS {' -> '.join(f'{v:.0f}' for v in d['rss_mb'])} MB, queued {d['queued_after']}, "
                  f"running {d['running_after']}, cancelled {d['cancelled']}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
