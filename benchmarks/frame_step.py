"""Per-frame cost of Drama 3 generation (random weights): where the time of one frame goes, and how far from real time.

Measured on the frame loop that `generate` runs (`_FrameLoop`, SPEC 5.3), one frame split into:
- main-token sampling: `lm_head` candidate logits + `RepetitionAwareLogitsProcessor` + draw;
- tower step: `tower.decode_frame`, all codebooks, with generate's default codebook sampler;
- backbone step: `run_backbone` of the new row with the cache;
plus the whole frame as `generate` runs it, the codec (streamed 7-frame chunks, per frame), the real-time factor
(compute time / audio time, 2048 samples = 46.4 ms a frame), time to first audio when streaming (a `Drama3AudioStreamer`
with `first_chunk_frames=1`, from the `generate` call to the first chunk), peak memory, and the backbone step with each
experts implementation as a speed-up over `eager` measured in the same run. Medians over `--frames` frames after
`--warmup` frames; CUDA is synchronised around every timed region.

Configurations: `tiny` (the golden tiny geometry), `small` (CPU-sized: hidden 512, 8 layers, 16 experts, the real
codec), `real` (the real-size architecture, `FishOmniConfig()` defaults, built on the device in bfloat16 with random
weights; needs a ~80 GB GPU). The codec always runs in float32.

    python benchmarks/frame_step.py --config tiny --output frame-step-tiny.json
    PYTHONPATH=src python benchmarks/frame_step.py --config real --device cuda --warmup 16 --frames 32
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
from datetime import datetime, timezone

import torch
import transformers

from transformers_drama3 import FishOmniConfig, FishOmniForSpeech
from transformers_drama3.generation_drama3 import Drama3AudioStreamer, _FrameLoop
from transformers_drama3.modeling_codec import random_original_codec_state_dict
from transformers_drama3.sampling import draw
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
    parser.add_argument("--expert-frames", type=int, default=16,
                        help="timed backbone steps per experts implementation, after --warmup untimed ones")
    parser.add_argument("--prompt-rows", type=int, default=50, help="text rows of the prompt (default 50)")
    parser.add_argument("--chunk-frames", type=int, default=7, help="frames per streamed codec chunk (default 7)")
    parser.add_argument("--codec-chunks", type=int, default=4, help="timed codec chunks, after one untimed")
    parser.add_argument("--ttfa-runs", type=int, default=3, help="timed time-to-first-audio runs, after one untimed")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
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


def start_loop(model: FishOmniForSpeech, prompt: torch.Tensor, frames: int, seed: int) -> _FrameLoop:
    """generate's frame loop with the default settings, prefilled on `prompt`."""
    settings = model._generation_settings(None, {"max_new_tokens": frames})
    mask = torch.ones(prompt.shape[:2], dtype=torch.long, device=prompt.device)
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    loop = _FrameLoop(model, settings, prompt, mask, generator, None)
    if not bool(torch.isfinite(loop.hidden).all()):
        raise RuntimeError("the backbone gave non-finite hidden states after the prefill: check the initialisation")
    return loop


def sample_main(loop: _FrameLoop) -> torch.Tensor:
    """The main token `[b]` as `_FrameLoop._step` draws it (the RAS window is not advanced: same cost)."""
    logits = loop.model.lm_head(loop.hidden).index_select(-1, loop.candidates).float()
    return loop.candidates[draw(loop.main_processor(loop.history, logits), loop.generator)]


def split_frame(loop: _FrameLoop, device: torch.device) -> dict[str, float]:
    """One frame in three timed parts; returns the seconds of each."""
    tower = loop.model.tower
    main, main_s = timed(lambda: sample_main(loop), device)
    (codes, _), tower_s = timed(lambda: tower.decode_frame(
        loop.hidden, loop.row, main, loop.position, loop.mask, loop.tower_cache, loop._sample_codebook), device)
    new_rows = torch.cat((main[:, None], codes), dim=1)
    _, backbone_s = timed(lambda: loop._feed_back(new_rows), device)
    return {"main": main_s, "tower": tower_s, "backbone": backbone_s}


def whole_frame(loop: _FrameLoop, device: torch.device) -> float:
    """Seconds of one frame exactly as `generate` runs it (`_step` then `_feed_back`)."""
    return timed(lambda: loop._feed_back(loop._step()), device)[1]


def measure_frames(loop: _FrameLoop, args: argparse.Namespace, device: torch.device) -> dict:
    for _ in range(args.warmup):
        whole_frame(loop, device)
    parts = [split_frame(loop, device) for _ in range(args.frames)]
    result = {name: summary_ms([p[name] for p in parts]) for name in ("backbone", "tower", "main")}
    result["sum_of_parts"] = summary_ms([sum(p.values()) for p in parts])
    result["generate_frame"] = summary_ms([whole_frame(loop, device) for _ in range(args.frames)])
    return result


def measure_experts(model: FishOmniForSpeech, loop: _FrameLoop, args: argparse.Namespace, device: torch.device) -> dict:
    """Backbone step per experts implementation (same frame row each step), and its speed-up over eager."""
    default = model.backbone.config._experts_implementation
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


class FirstChunkClock(Drama3AudioStreamer):
    """A streamer that notes when the first audio chunk is ready (it is copied to the host, so it is final)."""

    def __init__(self, codec):
        super().__init__(codec, first_chunk_frames=1)
        self.first_chunk_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        if self.first_chunk_at is None and self.chunks:
            self.first_chunk_at = time.perf_counter()


def measure_first_audio(model: FishOmniForSpeech, prompt: torch.Tensor, args: argparse.Namespace) -> dict:
    """Seconds from the `generate` call (prompt rows already on the device) to the first streamed audio chunk.

    The first run is a warm-up. A seed whose first draw is EOS gives no audio; the next seed is tried.
    """
    seconds, seed = [], args.seed
    while len(seconds) < args.ttfa_runs + 1:
        if seed > args.seed + 3 * (args.ttfa_runs + 1):
            raise RuntimeError("generate drew EOS first for most seeds: no audio to time")
        streamer = FirstChunkClock(model.codec)
        start = time.perf_counter()
        model.generate(prompt, streamer=streamer, max_new_tokens=2, output_audio=False, seed=seed)
        seed += 1
        if streamer.first_chunk_at is not None:
            seconds.append(streamer.first_chunk_at - start)
    return summary_ms(seconds[1:])


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


def print_report(report: dict) -> None:
    frames, audio_ms = report["frames"], report["audio_ms_per_frame"]
    print(f"Drama 3 frame step, config {report['config']} ({report['geometry']})")
    print(f"{report['device']} {report['dtype']} (codec float32), torch {report['torch']}, transformers "
          f"{report['transformers']}, {report['torch_threads']} threads; experts {report['experts']['default']}; "
          f"{report['timed_frames']} timed frames after {report['warmup_frames']}, prompt {report['prompt_rows']} rows")
    print("parameters (M): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in report["parameters"].items())
          + f"; built in {report['build_s']:.1f} s")
    frame_ms = frames["sum_of_parts"]["median_ms"]
    rows = [
        ("backbone step (run_backbone, 1 row)", frames["backbone"]),
        ("tower step (decode_frame, 9 codebooks)", frames["tower"]),
        ("main-token sampling (lm_head+RAS+draw)", frames["main"]),
        ("frame step, sum of the parts", frames["sum_of_parts"]),
        ("frame step as generate runs it", frames["generate_frame"]),
    ]
    print(f"{'part':<40} {'median ms':>10} {'p90 ms':>9} {'of frame':>9}")
    for name, result in rows:
        print(f"{name:<40} {result['median_ms']:>10.2f} {result['p90_ms']:>9.2f} "
              f"{100 * result['median_ms'] / frame_ms:>8.0f}%")
    codec = report["codec"]
    label = f"codec, {report['chunk_frames']}-frame chunk, per frame"
    print(f"{label:<40} {codec['per_frame_ms']:>10.2f} {codec['p90_ms'] / report['chunk_frames']:>9.2f}")
    print(f"audio per frame {audio_ms:.2f} ms; real-time factor (compute / audio): frame step "
          f"{report['rtf_frame_step']:.3f}, with the codec {report['rtf_with_codec']:.3f}")
    ttfa = report["time_to_first_audio"]
    print(f"time to first audio (streamed, first_chunk_frames=1): median {ttfa['median_ms']:.1f} ms, "
          f"p90 {ttfa['p90_ms']:.1f} ms")
    print(f"peak memory: {report['peak_memory']['gib']:.2f} GiB ({report['peak_memory']['kind']})")
    print(f"{'backbone step by experts implementation':<40} {'median ms':>10} {'speed-up over eager':>20}")
    for name, result in report["experts"]["implementations"].items():
        if "error" in result:
            print(f"{name:<40} {'failed':>10}  {result['error'][:80]}")
        else:
            print(f"{name:<40} {result['median_ms']:>10.2f} {result.get('speedup_over_eager', float('nan')):>20.2f}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.config == "real" else "float32"))
    config = model_config(args.config, args.layers)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, build_s = timed(lambda: build_model(config, device, dtype, args.seed), device)
    prompt = random_prompt(config, args.prompt_rows, device, args.seed)
    with torch.no_grad():
        loop = start_loop(model, prompt, args.warmup + 2 * args.frames, args.seed)
        frames = measure_frames(loop, args, device)
        first_audio = measure_first_audio(model, prompt, args)
        codec = measure_codec(model, args, device)
        experts = measure_experts(model, loop, args, device)
    audio_ms = 1e3 * config.codec_config.frame_length / config.codec_config.sample_rate
    frame_ms = frames["sum_of_parts"]["median_ms"]
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "config": args.config if args.layers is None else f"{args.config} ({args.layers} layers)",
        "geometry": describe(config),
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "parameters": parameter_counts(model),
        "build_s": build_s,
        "prompt_rows": args.prompt_rows,
        "warmup_frames": args.warmup,
        "timed_frames": args.frames,
        "chunk_frames": args.chunk_frames,
        "audio_ms_per_frame": audio_ms,
        "frames": frames,
        "codec": codec,
        "rtf_frame_step": frame_ms / audio_ms,
        "rtf_with_codec": (frame_ms + codec["per_frame_ms"]) / audio_ms,
        "time_to_first_audio": first_audio,
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
