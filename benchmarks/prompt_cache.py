"""Time to first audio with a saved voice, with and without its cached prompt prefix, and the memory per voice.

A random checkpoint (`--config`: the `small` backbone and tower of configs.py, or `tiny`), written with the tiny
codec and tokenizer, and a random voice of `--reference-seconds` of codes (21.5 frames a second). Two measurements,
side by side in one run:

- `generate`: from the call to the first frame reaching a streamer, `prompt_cache=` the voice's `PromptCache` or
  not, alternating the two, median of `--repeats` (after one untimed call of each);
- the server: two `drama3-serve` servers in this process (`ServerThread`), `--prompt-cache-mb` 512 and 0, the
  voice saved in their voices directory; from sending a greedy streamed pcm request to its first audio byte,
  alternating between the servers, median of `--repeats` (after one untimed request to each, which builds the
  cache on the first).

Also printed: the prefix's rows, the build time of a cache, and the bytes a cached voice holds (backbone attention
keys/values and linear-attention states, tower keys/values with their preallocated room).

    python benchmarks/prompt_cache.py --config small --reference-seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import httpx
import torch
from transformers.generation.streamers import BaseStreamer

from configs import served_checkpoint
from transformers_drama3 import Drama3Processor, Drama3Voice, FishOmniForSpeech
from transformers_drama3.generation.prompt_cache import PromptCache
from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.thread import ServerThread

TEXT = "Hello there, how are you doing today?"


class FirstFrame(BaseStreamer):
    def __init__(self):
        self.at = None

    def put(self, value):
        if self.at is None:
            self.at = time.perf_counter()

    def end(self):
        pass


def first_frame_seconds(model, inputs, cache) -> float:
    streamer = FirstFrame()
    start = time.perf_counter()
    model.generate(**inputs, do_sample=False, max_new_tokens=1, output_audio=False, streamer=streamer,
                   prompt_cache=cache)
    return streamer.at - start


def first_audio_seconds(url: str) -> float:
    body = {"model": "benchmark", "input": TEXT, "voice": "voice", "temperature": 0, "max_new_tokens": 8,
            "response_format": "pcm"}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=None) as response:
        response.raise_for_status()
        for piece in response.iter_raw():
            if piece:
                return time.perf_counter() - start
    raise RuntimeError("no audio")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small"], default="small")
    parser.add_argument("--reference-seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = served_checkpoint(args.config)
    model = FishOmniForSpeech.from_pretrained(path, dtype=torch.float32).eval()
    processor = Drama3Processor.from_pretrained(path)
    frames = round(args.reference_seconds * model.config.sampling_rate / model.config.codec_config.frame_length)
    codes = torch.randint(0, model.config.audio_decoder_config.vocab_size, (model.config.num_codebooks, frames),
                          generator=torch.Generator().manual_seed(0))
    voice = Drama3Voice(codes, "This is how I sound when I read a few sentences aloud on a quiet afternoon.")
    prefix = processor.reference_prefix_rows([voice])
    inputs = processor(TEXT, references=[voice])
    start = time.perf_counter()
    cache = PromptCache.build(model, prefix)
    build_s = time.perf_counter() - start

    without, with_cache = [], []
    for repeat in range(args.repeats + 1):
        plain, cached = first_frame_seconds(model, inputs, None), first_frame_seconds(model, inputs, cache)
        if repeat:
            without.append(plain)
            with_cache.append(cached)
    result = {"config": args.config, "reference_frames": frames, "prefix_rows": prefix.shape[0],
              "prompt_rows": inputs["input_ids"].shape[1], "cache_build_s": build_s,
              "cache_mb": cache.nbytes / 2**20, "generate_first_frame_s": statistics.median(without),
              "generate_first_frame_cached_s": statistics.median(with_cache)}
    result["generate_ratio"] = result["generate_first_frame_cached_s"] / result["generate_first_frame_s"]
    del model

    with tempfile.TemporaryDirectory() as voices:
        voice.save(os.path.join(voices, "voice.safetensors"))
        servers = [ServerThread(ServerSettings(model=path, model_name="benchmark", voices_dir=voices,
                                               prompt_cache_mb=mb)) for mb in (512, 0)]
        try:
            urls = [server.wait_until_ready().url for server in servers]
            times = {url: [] for url in urls}
            for repeat in range(args.repeats + 1):
                for url in urls:
                    seconds = first_audio_seconds(url)
                    if repeat:
                        times[url].append(seconds)
            stats = servers[0].service.worker.prompt_caches.stats()
        finally:
            for server in servers:
                server.stop()
    result["server_first_audio_cached_s"] = statistics.median(times[urls[0]])
    result["server_first_audio_s"] = statistics.median(times[urls[1]])
    result["server_ratio"] = result["server_first_audio_cached_s"] / result["server_first_audio_s"]
    result["server_cache"] = stats
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
