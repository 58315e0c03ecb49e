"""Per-frame cost of Drama 3 generation (random weights): the regular ("eager") frame loop against the fast decode
path (`generate(..., fast_decode=True)`), side by side in one process, and how far each is from real time.

Frame step, per batch size in `--batches` (default 1,16 on CUDA, else 1,4; every sequence gets the same prompt
rows), default sampling settings (seeded, so the RAS and top-p work is included), medians and p90 over `--frames`
timed frames after `--warmup`:
- eager: `_FrameLoop._step` + `_feed_back`, exactly as `generate` runs a frame (SPEC 5.3);
- fast, static step: `StaticFrameState.step` run eagerly (the per-frame noise fill included), on a state of
  `--capacity` rows (default: what `generate(fast_decode=True)` allocates for its default `max_new_tokens`); the
  step attends over the attention window `generate` would use for the rows of this run (`visible_rows`: 256 rows
  doubled until the rows in use fit);
- fast, CUDA graph replay (CUDA only): the same step captured once and replayed, as `generate` runs it on CUDA.
Each fast figure is also a speed-up over eager at the same batch. The real-time factor is per stream: frame step /
audio of one frame (2048 samples = 46.4 ms), below 1 is faster than real time. The timed steps never stop: an EOS
only sets flags. The eager frame is also split into main-token sampling (the frame's noise, `lm_head` candidate
logits, RAS and the draw), the tower step (`tower.decode_frame`, all codebooks, generate's codebook sampler) and the
backbone step (`run_backbone` of the new row), each timed alone; above batch 1 the eager figures use
`--eager-batch-frames` timed frames (the eager step is slow at real size).

Also: the codec (a streaming decoder fed `--chunk-frames`-frame chunks, per frame) as a share of the eager and the
fast frame step; streamed `generate` calls of `--stream-frames` greedy frames (EOS suppressed) with the codec
decoding in line and in `Drama3AudioStreamer(overlap=True)`'s worker thread, wall time per frame on each path;
time to first audio when streaming (a `Drama3AudioStreamer` with `first_chunk_frames=1`, from the `generate` call
to the first chunk) on both paths, the fast path's first (cold) call, which builds its state and captures its
graph, apart; a correctness check, the first `--check-frames` frames of `generate` on both paths, greedy and seeded
sampling (leading identical frames; on CUDA both paths run `batched_mm` experts there, as a captured step does);
peak memory; and the backbone step with each experts implementation as a speed-up over `eager` experts. A
captured step runs `batched_mm` experts (`captured_experts`); everything else runs the model's default. CUDA is
synchronised around every timed region; CPU runs use one thread unless `--threads` says otherwise.

Configurations: `tiny` (the golden tiny geometry), `small` (CPU-sized: hidden 512, 8 layers, 16 experts, the real
codec), `real` (the real-size architecture, `FishOmniConfig()` defaults, built on the device in bfloat16 with random
weights; needs a ~80 GB GPU). The codec always runs in float32.

    python benchmarks/frame_step.py --config tiny --output frame-step-tiny.json
    PYTHONPATH=src python benchmarks/frame_step.py --config real --device cuda --warmup 8 --frames 24 --batches 1,16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone

import torch
import transformers

from transformers_drama3 import FishOmniConfig, FishOmniForSpeech
from transformers_drama3.fast_decode import (
    CAPTURED_EXPERTS, FastFrameDecoder, bucket_size, capacity_for, captured_experts, visible_rows,
)
from transformers_drama3.generation_drama3 import DRAMA3_GENERATION_DEFAULTS, _FrameLoop
from transformers_drama3.streaming import Drama3AudioStreamer
from transformers_drama3.testing import random_original_codec_state_dict
from transformers_drama3.testing import tiny_config_dict

EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
SMALL_CONFIG = {
    "text_config": {
        "vocab_size": 8448,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 64,
        "linear_num_value_heads": 8,
        "linear_value_head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    },
    "audio_decoder_config": {
        "dim": 512,
        "text_dim": 512,
        "n_head": 8,
        "n_local_heads": 2,
        "head_dim": 64,
        "intermediate_size": 1536,
    },
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small", "real"], default="tiny")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="backbone, lm_head and tower precision (default: bfloat16 for real, else float32)")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep only the first N backbone layers (a quick check of a big geometry)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed frames first (default 8)")
    parser.add_argument("--frames", type=int, default=32, help="timed frames (default 32)")
    parser.add_argument("--batches", default=None,
                        help="comma-separated batch sizes of the frame step (default: 1,16 on cuda, else 1,4)")
    parser.add_argument("--eager-batch-frames", type=int, default=None,
                        help="timed eager frames (split and whole) at batches above 1 (default: --frames, at most 16)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="cache rows of the fast path's state (default: what generate(fast_decode=True) allocates "
                             "for the prompt and its default max_new_tokens)")
    parser.add_argument("--expert-frames", type=int, default=16,
                        help="timed backbone steps per experts implementation, after --warmup untimed ones")
    parser.add_argument("--prompt-rows", type=int, default=50, help="text rows of the prompt (default 50)")
    parser.add_argument("--chunk-frames", type=int, default=7, help="frames per streamed codec chunk (default 7)")
    parser.add_argument("--stream-frames", type=int, default=21,
                        help="frames of each streamed generate call, codec in line vs overlapped (default 21)")
    parser.add_argument("--codec-chunks", type=int, default=4, help="timed codec chunks, after one untimed")
    parser.add_argument("--ttfa-runs", type=int, default=3, help="timed time-to-first-audio runs, after one untimed")
    parser.add_argument("--check-frames", type=int, default=32,
                        help="frames of generate compared between the eager and the fast path (default 32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on the CPU, steadier on a shared machine; torch's choice "
                             "on other devices; 0 = torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="where to write the JSON results (default: none)")
    return parser.parse_args()


# ------------------------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------------------------


def with_band_at_top(config: dict) -> dict:
    """Put the semantic band on the last V ids of the text vocabulary and EOS right below it."""
    vocab = config["text_config"]["vocab_size"]
    band = config.get("audio_decoder_config", {}).get("vocab_size", 4096)
    return {**config, "semantic_start_token_id": vocab - band, "semantic_end_token_id": vocab - 1,
            "eos_token_id": vocab - band - 1}


def model_config(name: str, layers: int | None) -> FishOmniConfig:
    """`tiny`: the golden tiny geometry; `small`: CPU-sized with the real codec; `real`: `FishOmniConfig()` defaults."""
    if name == "tiny":
        config = FishOmniConfig(**with_band_at_top(tiny_config_dict()))
    elif name == "small":
        config = FishOmniConfig(**with_band_at_top(SMALL_CONFIG))
    else:
        config = FishOmniConfig()
    if layers is not None:
        text = config.text_config
        text.layer_types, text.num_hidden_layers = text.layer_types[:layers], layers
    return config


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Create parameters in `dtype` directly (a float32 real-size model would need 140 GB)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: FishOmniConfig, device: torch.device, dtype: torch.dtype, seed: int) -> FishOmniForSpeech:
    """The model built on `device` in `dtype` with the default random initialisation; the codec in float32 with
    random weights loaded through the real `codec.pth` path."""
    torch.manual_seed(seed)
    with default_dtype(dtype), device:
        model = FishOmniForSpeech(config)
    model.codec.float()
    codec_state = random_original_codec_state_dict(config.codec_config, torch.Generator().manual_seed(seed))
    model.codec.load_original_state_dict(codec_state)
    return model.eval()


def parameter_counts(model: FishOmniForSpeech) -> dict[str, int]:
    return {name: sum(p.numel() for p in getattr(model, name).parameters())
            for name in ("backbone", "lm_head", "tower", "codec")}


def random_prompt(config: FishOmniConfig, rows: int, device: torch.device, seed: int) -> torch.Tensor:
    """Frame rows `[1, rows, 1 + NCB]` of random text tokens (ids below EOS and the semantic band)."""
    low = min(config.eos_token_id, config.semantic_start_token_id)
    tokens = torch.randint(0, low, (1, rows), generator=torch.Generator().manual_seed(seed))
    prompt = torch.zeros(1, rows, 1 + config.num_codebooks, dtype=torch.long)
    prompt[..., 0] = tokens
    return prompt.to(device)


def default_capacity(config: FishOmniConfig, prompt_rows: int) -> int:
    """Cache rows `generate(fast_decode=True)` allocates for a prompt with its default `max_new_tokens`."""
    limit = config.text_config.max_position_embeddings
    frames = min(DRAMA3_GENERATION_DEFAULTS["max_new_tokens"], limit - prompt_rows + 1)
    return capacity_for(prompt_rows + frames)


# ------------------------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run, device: torch.device):
    """`(run(), seconds)`, the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = run()
    synchronize(device)
    return result, time.perf_counter() - start


def summary_ms(seconds: list[float]) -> dict:
    """Median and 90th percentile (nearest rank) in milliseconds, and the raw samples."""
    ordered = sorted(seconds)
    return {"median_ms": 1e3 * statistics.median(ordered), "p90_ms": 1e3 * ordered[math.ceil(0.9 * len(ordered)) - 1],
            "samples_ms": [1e3 * s for s in seconds]}


# ------------------------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------------------------

PATH_LABELS = {
    "eager": "eager (_step + _feed_back)",
    "fast_static_eager": "fast, static step run eagerly",
    "fast_cuda_graphs": "fast, CUDA graph replay",
}
SPLIT_LABELS = {
    "backbone": "backbone step (run_backbone, 1 row)",
    "tower": "tower step (decode_frame, 9 codebooks)",
    "main": "main-token sampling (noise+lm_head+RAS)",
    "sum_of_parts": "frame step, sum of the parts",
    "frame": "frame step as generate runs it",
}


def start_loop(model: FishOmniForSpeech, prompt: torch.Tensor, frames: int, seed: int) -> _FrameLoop:
    """generate's frame loop with the default settings, prefilled on `prompt` `[b, T, 1 + NCB]`."""
    settings = model._generation_settings(None, {"max_new_tokens": frames})
    mask = torch.ones(prompt.shape[:2], dtype=torch.long, device=prompt.device)
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    loop = _FrameLoop(model, settings, prompt, mask, generator, None)
    if not bool(torch.isfinite(loop.hidden).all()):
        raise RuntimeError("the backbone gave non-finite hidden states after the prefill: check the initialisation")
    return loop


def experts_implementation(model: FishOmniForSpeech) -> str | None:
    return model.backbone.config._experts_implementation


# Eager path ----------------------------------------------------------------------------------------------------


def sample_main(loop: _FrameLoop) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The main token `[b]` and the frame's noise `[b, NCB, V + 1]` as `_FrameLoop._step` draws them (the RAS window
    is not advanced: same cost)."""
    logits = loop.model.main_logits(loop.hidden, loop.candidates).float()  # [b, V + 1]
    noise = loop.sampler.frame_noise(
        logits.shape[0], loop.model.config.num_codebooks, logits.shape[1], loop.generator, logits.device
    )
    return loop.candidates[loop.sampler.main(logits, loop.history, noise)], noise


def split_frame(loop: _FrameLoop, device: torch.device) -> dict[str, float]:
    """One frame in three timed parts; returns the seconds of each."""
    tower = loop.model.tower
    (main, noise), main_s = timed(lambda: sample_main(loop), device)
    (codes, _), tower_s = timed(lambda: tower.decode_frame(
        loop.hidden, loop.row, main, loop.position, loop.mask, loop.tower_cache,
        lambda logits, index: loop.sampler.codebook(logits, index, noise)), device)
    new_rows = torch.cat((main[:, None], codes), dim=1)  # [b, 1 + NCB]
    _, backbone_s = timed(lambda: loop._feed_back(new_rows), device)
    return {"main": main_s, "tower": tower_s, "backbone": backbone_s}


def whole_frame(loop: _FrameLoop, device: torch.device) -> float:
    """Seconds of one frame exactly as `generate` runs it (`_step` then `_feed_back`)."""
    return timed(lambda: loop._feed_back(loop._step()), device)[1]


def measure_eager(model: FishOmniForSpeech, prompt: torch.Tensor, frames: int, args: argparse.Namespace,
                  device: torch.device) -> dict:
    """The regular frame loop on `prompt` `[b, T, 1 + NCB]`: `--warmup` frames, `frames` split ones, `frames` whole."""
    loop = start_loop(model, prompt, args.warmup + 2 * frames, args.seed)
    for _ in range(args.warmup):
        whole_frame(loop, device)
    parts = [split_frame(loop, device) for _ in range(frames)]
    split = {name: summary_ms([p[name] for p in parts]) for name in ("backbone", "tower", "main")}
    split["sum_of_parts"] = summary_ms([sum(p.values()) for p in parts])
    frame = summary_ms([whole_frame(loop, device) for _ in range(frames)])
    return {"frame": frame, "split": split, "timed_frames": frames, "experts": experts_implementation(model),
            "ended_sequences": int(loop.ended.sum())}


# Fast path -----------------------------------------------------------------------------------------------------


def measure_fast(model: FishOmniForSpeech, prompt: torch.Tensor, capacity: int, cuda_graphs: bool,
                 args: argparse.Namespace, device: torch.device) -> dict:
    """The fast path's frame (noise fill, then `state.step` or its CUDA graph replay) on a fresh state loaded from
    a prefill of `prompt` `[b, T, 1 + NCB]`. A private `FastFrameDecoder`: the model's own stays cold for `generate`."""
    captured = cuda_graphs and device.type == "cuda"
    experts = CAPTURED_EXPERTS if captured else experts_implementation(model)  # a capture runs `CAPTURED_EXPERTS`
    return fast_frames(model, prompt, capacity, cuda_graphs, args, device) | {"experts": experts}


def fast_frames(model: FishOmniForSpeech, prompt: torch.Tensor, capacity: int, cuda_graphs: bool,
                args: argparse.Namespace, device: torch.device) -> dict:
    """`measure_fast`'s work: build the state, get its runner (a capture, with `cuda_graphs` on
    CUDA), load the prefill, then `--warmup` untimed and `--frames` timed frames."""
    loop = start_loop(model, prompt, 1, args.seed)
    decoder = FastFrameDecoder(model, cuda_graphs=cuda_graphs)
    bucket = bucket_size(prompt.shape[0])
    state, state_s = timed(lambda: decoder.state(bucket, capacity, loop.settings.ras_window, loop.cache), device)
    # Attention window: the rows in use after the last timed frame (one window, one graph, for the whole run).
    visible = visible_rows(loop.slots + args.warmup + args.frames, state.capacity)
    run, runner_s = timed(lambda: decoder.runner(state, loop.sampler, visible), device)  # captures: before loading
    state.load_prefill(loop)

    def frame() -> None:
        if loop.sampler.do_sample:
            state.noise.uniform_(generator=loop.generator)
        run()

    for _ in range(args.warmup):
        timed(frame, device)
    result = summary_ms([timed(frame, device)[1] for _ in range(args.frames)])
    return {"frame": result, "timed_frames": args.frames, "bucket": bucket,
            "capacity": state.capacity, "attention_rows": visible, "state_build_s": state_s, "runner_s": runner_s,
            "ended_sequences": int(state.ended[: prompt.shape[0]].sum())}


def measure_batch(model: FishOmniForSpeech, prompt: torch.Tensor, batch: int, capacity: int, args: argparse.Namespace,
                  device: torch.device, audio_ms: float) -> dict:
    """Every path's frame step at `batch` sequences (each with the prompt's rows), with speed-ups over eager and
    per-stream real-time factors."""
    rows = prompt.repeat(batch, 1, 1)  # [batch, T, 1 + NCB]
    eager_frames = args.frames if batch == 1 else args.eager_batch_frames
    paths = {"eager": measure_eager(model, rows, eager_frames, args, device)}
    paths["fast_static_eager"] = attempt(lambda: measure_fast(model, rows, capacity, False, args, device))
    if device.type == "cuda":
        paths["fast_cuda_graphs"] = attempt(lambda: measure_fast(model, rows, capacity, True, args, device))
    eager_ms = paths["eager"]["frame"]["median_ms"]
    for path in paths.values():
        if "error" in path:
            continue
        frame = path["frame"]
        frame["speedup_over_eager"] = eager_ms / frame["median_ms"]
        frame["rtf_per_stream"] = frame["median_ms"] / audio_ms  # below 1: faster than real time
        frame["faster_than_real_time"] = frame["rtf_per_stream"] < 1
        frame["audio_per_compute_all_streams"] = batch * audio_ms / frame["median_ms"]
    graphs, static = paths.get("fast_cuda_graphs", {}), paths["fast_static_eager"]
    if "frame" in graphs and "frame" in static:  # what the graph alone gains
        graphs["frame"]["speedup_over_static_step"] = static["frame"]["median_ms"] / graphs["frame"]["median_ms"]
    return {"batch": batch, **paths}


def fast_path(entry: dict) -> str | None:
    """The fast path of a batch entry as `generate(fast_decode=True)` runs it on this device (CUDA graphs on CUDA),
    or the static step run eagerly when that failed; None when both failed."""
    for key in ("fast_cuda_graphs", "fast_static_eager"):
        if key in entry and "error" not in entry[key]:
            return key
    return None


def attempt(run) -> dict:
    """`run()`, or `{"error": ...}` when it raises: a failing fast path must not lose the rest of a long run."""
    try:
        return run()
    except Exception as error:  # reported in the table and the JSON, the traceback on stderr
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}"}


# Codec, first audio, correctness, experts ----------------------------------------------------------------------


def measure_codec(model: FishOmniForSpeech, args: argparse.Namespace, device: torch.device) -> dict:
    """A streaming decoder fed random `--chunk-frames`-frame chunks: seconds per chunk and per frame."""
    generator = torch.Generator().manual_seed(args.seed)
    sizes = model.codec.config.codebook_sizes
    codes = torch.stack([torch.randint(0, n, (1, args.chunk_frames), generator=generator) for n in sizes], 1).to(device)
    stream = model.codec.stream()
    stream.decode(codes)
    seconds = [timed(lambda: stream.decode(codes), device)[1] for _ in range(args.codec_chunks)]
    result = summary_ms(seconds)
    result["per_frame_ms"] = result["median_ms"] / args.chunk_frames
    return result


def codec_share(codec: dict, entry: dict, audio_ms: float) -> dict:
    """The streamed codec per frame against one stream's frame step on each path (batch `entry['batch']`)."""
    per_frame, path = codec["per_frame_ms"], fast_path(entry)
    eager = entry["eager"]["frame"]["median_ms"]
    result = {"batch": entry["batch"], "codec_per_frame_ms": per_frame, "of_eager_frame": per_frame / eager,
              "rtf_eager_with_codec": (eager + per_frame) / audio_ms, "fast_path": path}
    if path is not None:
        fast = entry[path]["frame"]["median_ms"]
        result.update(of_fast_frame=per_frame / fast, rtf_fast_with_codec=(fast + per_frame) / audio_ms)
    return result


class FirstChunkClock(Drama3AudioStreamer):
    """A streamer that notes when the first audio chunk is ready (it is copied to the host, so it is final)."""

    def __init__(self, codec):
        super().__init__(codec, first_chunk_frames=1)
        self.first_chunk_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        if self.first_chunk_at is None and self.chunks:
            self.first_chunk_at = time.perf_counter()


def first_audio(model: FishOmniForSpeech, prompt: torch.Tensor, seed: int, fast: bool,
                device: torch.device) -> tuple[float | None, float]:
    """Seconds from a streaming `generate` call to its first chunk (None when EOS came first), and of the call."""
    streamer = FirstChunkClock(model.codec)
    synchronize(device)
    start = time.perf_counter()
    model.generate(prompt, streamer=streamer, max_new_tokens=2, output_audio=False, seed=seed, fast_decode=fast)
    synchronize(device)
    call = time.perf_counter() - start
    return (None if streamer.first_chunk_at is None else streamer.first_chunk_at - start), call


def measure_first_audio(model: FishOmniForSpeech, prompt: torch.Tensor, fast: bool, args: argparse.Namespace,
                        device: torch.device) -> dict:
    """Seconds from the `generate` call (prompt rows already on the device) to the first streamed audio chunk.

    The first call is a warm-up, reported apart (`first_call`); on the fast path the model's fast decode state is
    reset first, so that call builds its state (and captures its graph on CUDA). A seed whose first draw is EOS
    gives no audio; the next seed is tried.
    """
    if fast:
        model.reset_fast_decode()
    return first_audio_runs(model, prompt, fast, args, device)


def first_audio_runs(model: FishOmniForSpeech, prompt: torch.Tensor, fast: bool, args: argparse.Namespace,
                     device: torch.device) -> dict:
    """`--ttfa-runs` + 1 calls with audio (seeds from `--seed` on); every call is kept in `calls`."""
    seconds, calls, seed = [], [], args.seed
    while len(seconds) < args.ttfa_runs + 1:
        if seed > args.seed + 3 * (args.ttfa_runs + 1):
            raise RuntimeError("generate drew EOS first for most seeds: no audio to time")
        first, call = first_audio(model, prompt, seed, fast, device)
        calls.append({"seed": seed, "first_audio_ms": None if first is None else 1e3 * first, "call_ms": 1e3 * call})
        seed += 1
        if first is not None:
            seconds.append(first)
    return {**summary_ms(seconds[1:]), "first_call": calls[0], "calls": calls}


@contextlib.contextmanager
def eos_suppressed(model: FishOmniForSpeech):
    """EOS's `lm_head` row zeroed (its logit is 0, below the best of the 4096 semantic logits): runs reach their
    frame count."""
    row = model.lm_head.weight[model.config.eos_token_id]
    saved = row.detach().clone()
    row.data.zero_()
    try:
        yield
    finally:
        row.data.copy_(saved)


def measure_streaming(model: FishOmniForSpeech, prompt: torch.Tensor, args: argparse.Namespace,
                      device: torch.device) -> dict:
    """Greedy streamed `generate` of `--stream-frames` frames (EOS suppressed), `--chunk-frames`-frame chunks: wall
    ms per frame with the codec decoding in line (`overlap=False`) and in its worker thread (`overlap=True`), on
    each path; one untimed call per path first."""
    results = {}
    with eos_suppressed(model):
        for fast in (False, True):
            for overlap in (None, False, True):  # None: the untimed warm-up
                streamer = Drama3AudioStreamer(model.codec, chunk_frames=args.chunk_frames, overlap=bool(overlap))
                _, seconds = timed(lambda: model.generate(
                    prompt, streamer=streamer, do_sample=False, max_new_tokens=args.stream_frames,
                    output_audio=False, fast_decode=fast), device)
                if overlap is not None:
                    results[f"{'fast' if fast else 'eager'}_{'overlap' if overlap else 'inline'}_ms_per_frame"] = (
                        1e3 * seconds / args.stream_frames)
    for name in ("eager", "fast"):
        results[f"{name}_overlap_speedup"] = results[f"{name}_inline_ms_per_frame"] / results[f"{name}_overlap_ms_per_frame"]
    return results


def compare_paths(model: FishOmniForSpeech, prompt: torch.Tensor, frames: int, device: torch.device,
                  **settings) -> dict:
    """The first `frames` frames of `generate` on the eager and the fast path (same settings; on CUDA both with the
    experts a captured step runs, so that only the paths differ): lengths, finish reasons and leading identical
    frames (whole rows: main id and every code)."""
    kwargs = {"max_new_tokens": frames, "output_audio": False, **settings}
    with captured_experts(model) if device.type == "cuda" else contextlib.nullcontext():
        experts = experts_implementation(model)
        eager = model.generate(prompt, **kwargs)
        fast = model.generate(prompt, fast_decode=True, **kwargs)
    rows = prompt.shape[1]
    lengths = {"eager": eager.codes[0].shape[1], "fast": fast.codes[0].shape[1]}
    shared = min(lengths.values())
    same = (eager.sequences[0, rows : rows + shared] == fast.sequences[0, rows : rows + shared]).all(-1)  # [shared]
    leading = shared if bool(same.all()) else int((~same).nonzero()[0, 0])
    return {"settings": settings, "experts": experts, "frames": frames, "lengths": lengths,
            "finish_reason": {"eager": eager.finish_reason[0], "fast": fast.finish_reason[0]},
            "identical_leading_frames": leading, "identical_frames": int(same.sum()),
            "all_identical": lengths["eager"] == lengths["fast"] and leading == shared}


def measure_experts(model: FishOmniForSpeech, prompt: torch.Tensor, args: argparse.Namespace, device: torch.device) -> dict:
    """Backbone step per experts implementation (same frame row each step, batch 1), and its speed-up over eager."""
    default = experts_implementation(model)
    loop = start_loop(model, prompt, 1, args.seed)
    row = loop.row
    results = {}
    for name in EXPERTS_IMPLEMENTATIONS:
        try:
            model.backbone.set_experts_implementation(name)
            for _ in range(args.warmup):
                loop._feed_back(row)
            results[name] = summary_ms([timed(lambda: loop._feed_back(row), device)[1] for _ in range(args.expert_frames)])
        except (RuntimeError, ValueError, ImportError, NotImplementedError) as error:
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    model.backbone.set_experts_implementation(default)
    eager = results["eager"].get("median_ms")
    for result in results.values():
        if eager and "median_ms" in result:
            result["speedup_over_eager"] = eager / result["median_ms"]
    return {"default": default, "implementations": results}


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"kind": "torch.cuda.max_memory_allocated", "gib": torch.cuda.max_memory_allocated(device) / 2**30}
    return {"kind": "ru_maxrss (whole process)", "gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------


def describe(config: FishOmniConfig) -> str:
    text, tower, codec = config.text_config, config.audio_decoder_config, config.codec_config
    return (f"backbone hidden {text.hidden_size}, {text.num_hidden_layers} layers, {text.num_experts} experts top "
            f"{text.num_experts_per_tok}; tower {tower.shared_enrichment_layers}+{tower.num_codebooks - 1} layers, "
            f"V {tower.vocab_size}; codec decoder_dim {codec.decoder_dim}")


def print_header(report: dict) -> None:
    print(f"Drama 3 frame step, config {report['config']} ({report['geometry']})")
    print(f"{report['device']} {report['dtype']} (codec float32), torch {report['torch']}, transformers "
          f"{report['transformers']}, {report['torch_threads']} threads; experts: eager path "
          f"{report['experts_eager_path']}, fast path {report['experts_fast_path']}")
    print(f"default sampling, seed {report['seed']}; {report['timed_frames']} timed frames after "
          f"{report['warmup_frames']} (eager above batch 1: {report['eager_batch_frames']}); prompt "
          f"{report['prompt_rows']} rows; fast path state of {report['fast_capacity']} cache rows")
    print("parameters (M): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in report["parameters"].items())
          + f"; built in {report['build_s']:.1f} s")


def print_paths(report: dict) -> None:
    print(f"\n{'frame step (one step, whole batch)':<34} {'batch':>5} {'median ms':>10} {'p90 ms':>8} "
          f"{'vs eager':>9} {'RTF/stream':>11} {'< real time':>12} {'streams x RT':>13}")
    for entry in report["frame_step"]:
        for key, label in PATH_LABELS.items():
            if key not in entry:
                continue
            if "error" in entry[key]:
                print(f"{label:<34} {entry['batch']:>5} {'failed':>10}  {entry[key]['error'][:90]}")
                continue
            f = entry[key]["frame"]
            print(f"{label:<34} {entry['batch']:>5} {f['median_ms']:>10.2f} {f['p90_ms']:>8.2f} "
                  f"{f['speedup_over_eager']:>8.2f}x {f['rtf_per_stream']:>11.3f} "
                  f"{'yes' if f['faster_than_real_time'] else 'no':>12} {f['audio_per_compute_all_streams']:>13.2f}")
    print(f"RTF = frame step / {report['audio_ms_per_frame']:.2f} ms of audio a frame, per stream (below 1: faster than "
          "real time); streams x RT = audio of all streams / compute; vs eager = eager median / this median")
    set_up = []
    for entry in report["frame_step"]:
        for key in ("fast_static_eager", "fast_cuda_graphs"):
            if key in entry and "error" not in entry[key]:
                what = "capture" if key == "fast_cuda_graphs" else "state build"
                seconds = entry[key]["runner_s"] if key == "fast_cuda_graphs" else entry[key]["state_build_s"]
                set_up.append(f"b={entry['batch']} {what} {seconds:.2f}")
    if set_up:
        print("fast path set-up, seconds: " + ", ".join(set_up))


def print_split(report: dict) -> None:
    entries = report["frame_step"]
    print(f"\n{'eager frame split':<44}" + "".join(f" {'b=' + str(e['batch']) + ' ms':>10} {'p90':>8} {'of frame':>8}"
                                                  for e in entries))
    for key, label in SPLIT_LABELS.items():
        cells = []
        for entry in entries:
            eager = entry["eager"]
            result = eager["frame"] if key == "frame" else eager["split"][key]
            share = result["median_ms"] / eager["split"]["sum_of_parts"]["median_ms"]
            cells.append(f" {result['median_ms']:>10.2f} {result['p90_ms']:>8.2f} {100 * share:>7.0f}%")
        print(f"{label:<44}" + "".join(cells))


def print_codec(report: dict) -> None:
    codec, share = report["codec"], report["codec_share"]
    fast = "" if share["fast_path"] is None else (
        f", {100 * share['of_fast_frame']:.1f}% of the fast one ({PATH_LABELS[share['fast_path']]})")
    print(f"\ncodec, {report['chunk_frames']}-frame chunks, per frame: median {codec['per_frame_ms']:.2f} ms (p90 "
          f"{codec['p90_ms'] / report['chunk_frames']:.2f}) = {100 * share['of_eager_frame']:.1f}% of the eager frame "
          f"step at batch {share['batch']}{fast}")
    fast = "" if share["fast_path"] is None else f", fast {share['rtf_fast_with_codec']:.3f}"
    print(f"real-time factor with the codec, batch {share['batch']}: eager {share['rtf_eager_with_codec']:.3f}{fast}")


def print_first_audio(report: dict) -> None:
    ttfa = report["time_to_first_audio"]
    eager, fast = ttfa["eager"], ttfa["fast"]
    line = (f"time to first audio (streamed, first_chunk_frames=1), median (p90) of {report['ttfa_runs']} warm calls: "
            f"eager {eager['median_ms']:.1f} ({eager['p90_ms']:.1f}) ms")
    if "error" in fast:
        print(f"{line}; fast failed: {fast['error'][:90]}")
        return
    print(f"{line}, fast {fast['median_ms']:.1f} ({fast['p90_ms']:.1f}) ms: {ttfa['speedup_over_eager']:.2f}x")
    cold = fast["first_call"]
    first = "none (EOS first)" if cold["first_audio_ms"] is None else f"{cold['first_audio_ms']:.1f} ms"
    print(f"fast path's first (cold) call, building its state{' and capturing its graph' if report['cuda'] else ''}: "
          f"first audio {first}, whole call {cold['call_ms']:.1f} ms (eager's first call {eager['first_call']['call_ms']:.1f} ms)")


def print_streaming(report: dict) -> None:
    result = report["streaming"]
    line = f"streamed generate, {report['stream_frames']} greedy frames in {report['chunk_frames']}-frame chunks, wall ms per frame"
    if "error" in result:
        print(f"{line}: failed: {result['error'][:90]}")
        return
    print(f"{line}: " + "; ".join(
        f"{name} {result[f'{name}_inline_ms_per_frame']:.1f} with the codec in line, "
        f"{result[f'{name}_overlap_ms_per_frame']:.1f} overlapped ({result[f'{name}_overlap_speedup']:.2f}x)"
        for name in ("eager", "fast")))


def print_checks(report: dict) -> None:
    for name, check in report["check"].items():
        what = "greedy" if name == "greedy" else f"sampled (seed {report['seed']})"
        line = f"check, generate's first {report['check_frames']} frames, {what}"
        if "error" in check:
            print(f"{line}: failed: {check['error'][:90]}")
            continue
        lengths, reasons = check["lengths"], check["finish_reason"]
        print(f"{line}: eager {lengths['eager']} ({reasons['eager']}), fast {lengths['fast']} ({reasons['fast']}); "
              f"{check['identical_leading_frames']} leading frames identical; all identical: "
              f"{'yes' if check['all_identical'] else 'no'}")


def print_report(report: dict) -> None:
    print_header(report)
    print_paths(report)
    print_split(report)
    print_codec(report)
    print_first_audio(report)
    print_streaming(report)
    print_checks(report)
    print(f"peak memory: {report['peak_memory']['gib']:.2f} GiB ({report['peak_memory']['kind']})")
    print(f"\n{'backbone step by experts implementation':<44} {'median ms':>10} {'speed-up over eager':>20}")
    for name, result in report["experts"]["implementations"].items():
        if "error" in result:
            print(f"{name:<44} {'failed':>10}  {result['error'][:80]}")
        else:
            print(f"{name:<44} {result['median_ms']:>10.2f} {result.get('speedup_over_eager', float('nan')):>20.2f}")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    batches = [int(b) for b in (args.batches or ("1,16" if device.type == "cuda" else "1,4")).split(",")]
    if args.eager_batch_frames is None:
        args.eager_batch_frames = min(args.frames, 16)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.config == "real" else "float32"))
    config = model_config(args.config, args.layers)
    capacity = args.capacity or default_capacity(config, args.prompt_rows)
    if capacity < args.prompt_rows + args.warmup + args.frames:
        raise SystemExit(f"--capacity {capacity} cannot hold the prompt and {args.warmup + args.frames} frames")
    audio_ms = 1e3 * config.codec_config.frame_length / config.codec_config.sample_rate
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, build_s = timed(lambda: build_model(config, device, dtype, args.seed), device)
    prompt = random_prompt(config, args.prompt_rows, device, args.seed)
    with torch.no_grad():
        codec = measure_codec(model, args, device)
        frame_step = [measure_batch(model, prompt, b, capacity, args, device, audio_ms) for b in batches]
        first_audio = {"eager": measure_first_audio(model, prompt, False, args, device),
                       "fast": attempt(lambda: measure_first_audio(model, prompt, True, args, device))}
        if "error" not in first_audio["fast"]:
            first_audio["speedup_over_eager"] = first_audio["eager"]["median_ms"] / first_audio["fast"]["median_ms"]
        streaming = attempt(lambda: measure_streaming(model, prompt, args, device))
        check = {"greedy": attempt(lambda: compare_paths(model, prompt, args.check_frames, device, do_sample=False)),
                 "sampled": attempt(lambda: compare_paths(model, prompt, args.check_frames, device, seed=args.seed))}
        experts = measure_experts(model, prompt, args, device)
    fast = [entry[fast_path(entry)] for entry in frame_step if fast_path(entry)]
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "arguments": vars(args),
        "config": args.config if args.layers is None else f"{args.config} ({args.layers} layers)",
        "geometry": describe(config),
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "cuda": device.type == "cuda",
        "dtype": str(dtype).removeprefix("torch."),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "parameters": parameter_counts(model),
        "build_s": build_s,
        "seed": args.seed,
        "prompt_rows": args.prompt_rows,
        "warmup_frames": args.warmup,
        "timed_frames": args.frames,
        "eager_batch_frames": args.eager_batch_frames,
        "fast_capacity": capacity,
        "experts_eager_path": frame_step[0]["eager"]["experts"],
        "experts_fast_path": fast[0]["experts"] if fast else None,
        "chunk_frames": args.chunk_frames,
        "ttfa_runs": args.ttfa_runs,
        "check_frames": args.check_frames,
        "audio_ms_per_frame": audio_ms,
        "frame_step": frame_step,
        "codec": codec,
        "codec_share": codec_share(codec, frame_step[0], audio_ms),
        "time_to_first_audio": first_audio,
        "streaming": streaming,
        "stream_frames": args.stream_frames,
        "check": check,
        "experts": experts,
        "peak_memory": peak_memory(device),
    }
    print_report(report)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
        print(f"written: {args.output}")


if __name__ == "__main__":
    main()
