"""The playground page's cost and its time to first audio: `drama3-serve --tiny` with and without `--ui`.

- **start-up**: a fresh `drama3-serve --tiny` process, from its start to `GET /health` answering 200 (the model
  loaded), and its resident memory (RSS, with its children) then; with and without `--ui`, interleaved, `--repeats`
  rounds, medians. Without `--ui` Gradio is never imported, so both figures must match the server's before the page.
- **first audio**: one request `--takes` times (the same text, seed and frames), through the page in a headless
  Chromium (measured by the page's live player: from the click event's time to the first chunk scheduled with
  the Web Audio API) and over HTTP as benchmarks/serve_load.py sends it (streamed pcm: sent until the first
  audio byte), alternated on one server after one request that warms it up; the server's own figure for the page's
  request beside them.

    python benchmarks/serve_ui.py --repeats 5 --takes 7
    git archive main src | tar -x -C /tmp/before && python benchmarks/serve_ui.py --before /tmp/before/src
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

import httpx
import psutil

TEXT, SEED, FRAMES = "Did you hear that?", 1, 8
SETTLE_S = 2.0  # before each request: the browser finishes drawing the last take, so neither measurement pays for it


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(ui: bool, src: str | None = None) -> tuple[subprocess.Popen, str, float]:
    """A `drama3-serve --tiny` process (of the source tree `src`: default, this interpreter's), its URL, and the
    seconds until it was ready."""
    port = free_port()
    command = [sys.executable, "-m", "transformers_drama3.serving.cli", "--tiny", "--port", str(port),
               "--log-level", "warning", *(["--ui"] if ui else [])]
    began = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": src} if src else None
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url, time.perf_counter() - began
        except httpx.TransportError:
            time.sleep(0.05)
        if process.poll() is not None:
            raise RuntimeError(f"drama3-serve exited with status {process.returncode}")


def rss_mb(process: subprocess.Popen) -> float:
    parent = psutil.Process(process.pid)
    return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)]) / 2**20


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)


def startup(repeats: int, before: str | None) -> dict:
    """Ready time and RSS, medians: this tree without and with --ui (and `before`'s tree without it), interleaved."""
    kinds = {"without --ui": (False, None), "with --ui": (True, None)}
    if before:
        kinds["before, no --ui"] = (False, before)
    rows = {name: [] for name in kinds}
    for _ in range(repeats):
        for name, (ui, src) in kinds.items():
            process, _, seconds = start(ui, src)
            time.sleep(1)  # let the first requests' allocations settle
            rows[name].append((seconds, rss_mb(process)))
            stop(process)
    return {name: {"ready_s": statistics.median(r[0] for r in runs), "rss_mb": statistics.median(r[1] for r in runs)}
            for name, runs in rows.items()}


def http_first_audio(client: httpx.Client) -> float:
    """The request as benchmarks/serve_load.py sends it (streamed pcm, on a client made beforehand), timed to its
    first audio byte."""
    body = {"model": "drama3-tiny", "input": TEXT, "max_new_tokens": FRAMES, "response_format": "pcm", "seed": SEED}
    began = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/audio/speech", json=body) as response:
        for piece in response.iter_raw():
            if piece and first is None:
                first = time.perf_counter() - began
    return first


# The same HTTP request sent by the browser itself (fetch, as the page's player reads its stream), timed to the first
# bytes read: the browser as a client, without the page.
BROWSER_FETCH_JS = """
const done = arguments[arguments.length - 1];
const began = performance.now();
fetch('/v1/audio/speech', {method: 'POST', headers: {'Content-Type': 'application/json'}, body: arguments[0]})
  .then(async response => {
    const reader = response.body.getReader();
    let first = null;
    for (;;) {
      const {value, done: end} = await reader.read();
      if (end) break;
      if (first === null && value.length) first = performance.now() - began;
    }
    done(first);
  });
"""


def first_audio(takes: int) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.test_ui_browser import CHROMIUM, CHROMEDRIVER, CHROMIUM_FLAGS, Page, Service, webdriver

    process, url, _ = start(ui=True)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tempfile.mkdtemp()}"]:
        options.add_argument(flag)
    os.environ["SE_OFFLINE"] = "true"
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    server = type("Server", (), {"url": url})()
    page = Page(driver, server)
    browser, server_side, http, fetched = [], [], [], []
    body = json.dumps({"model": "drama3-tiny", "input": TEXT, "max_new_tokens": FRAMES, "response_format": "pcm",
                       "seed": SEED})
    client = httpx.Client(base_url=url, timeout=None)
    try:
        page.open()
        page.fill("text", TEXT)
        page.fill("max_frames", FRAMES)
        page.fill("seed", SEED)
        http_first_audio(client)  # the server's first request (warm-up), measured by neither
        for take in range(1, takes + 1):
            time.sleep(SETTLE_S)
            http.append(http_first_audio(client))
            time.sleep(SETTLE_S)
            fetched.append(driver.execute_async_script(BROWSER_FETCH_JS, body) / 1000)
            time.sleep(SETTLE_S)
            page.click("speak")
            live = page.wait(lambda: (state := driver.execute_script("return window.drama3Live")) and state["done"]
                             and state, "the live player to play the take")
            browser.append(live["first_audio_ms"] / 1000)
            line = page.take(take)
            server_side.append(float(re.search(r"first audio after (\d+) ms", line).group(1)) / 1000)
    finally:
        client.close()
        driver.quit()
        stop(process)
    return {"browser_s": statistics.median(browser), "server_side_s": statistics.median(server_side),
            "http_first_audio_s": statistics.median(http), "browser_fetch_s": statistics.median(fetched),
            "takes": takes,
            "takes_ms": [(round(b * 1000), round(s * 1000), round(h * 1000))
                         for b, s, h in zip(browser, server_side, http)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--takes", type=int, default=7)
    parser.add_argument("--before", help="another source tree's src/ (e.g. from git archive), measured without --ui")
    args = parser.parse_args()
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"{os.cpu_count()} CPUs")
    for name, row in startup(args.repeats, args.before).items() if args.repeats else ():
        print(f"{name:>15}: ready after {row['ready_s']:.2f} s, RSS {row['rss_mb']:.0f} MB (median of {args.repeats})")
    if not args.takes:
        return
    row = first_audio(args.takes)
    print("each take, in the browser / the server's figure for it / over HTTP (ms): "
          + ", ".join(" / ".join(map(str, take)) for take in row["takes_ms"]))
    print(f"first audio (median of {row['takes']}): in the browser (click to first chunk scheduled) "
          f"{row['browser_s'] * 1000:.0f} ms, over HTTP {row['http_first_audio_s'] * 1000:.0f} ms "
          f"({row['browser_s'] / row['http_first_audio_s'] - 1:+.0%}); the server's own figure for the page's request "
          f"{row['server_side_s'] * 1000:.0f} ms; the HTTP request sent by the browser's fetch "
          f"{row['browser_fetch_s'] * 1000:.0f} ms")

if __name__ == "__main__":
    main()
