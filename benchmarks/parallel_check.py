"""Tensor and expert parallelism check: a random Drama 3 split over N GPUs (or CPU processes) against the same model
on one device, and the per-GPU memory table of docs/hardware.md.

Under `torchrun --nproc-per-node N` (N >= 2): rank 0 writes a random checkpoint in the original layout (FP8 experts,
as `fishaudio/drama-3` ships them) to `--checkpoint` unless one is there; every rank loads it split over the N ranks,
once per mode in `--modes` (`tensor`, `expert`; a mode the geometry cannot be split by is reported as refused, with
the reason); then rank 0 alone loads it whole on one device. For each load: the teacher-forced main logits of a
random prompt, `--frames` greedy frames after `--warmup` untimed ones, the time of each frame step (the wall time
between two frames reaching the streamer, which syncs the device every frame; median and p90) and the peak device
memory of every rank. Reported: split vs one device (main logits max abs diff and relative L2, how many leading
greedy frames are equal, frame step ratio). With one process (plain `python`) only the one-device half runs.

Geometries (`--config`): `tiny` (the tiny test geometry with 2 key/value heads and 256 expert rows, so both modes
split it over 2 ranks), `real` (the real geometry: hidden 2048, 40 layers, 256 experts, the 13-layer tower, the real
codec). `--layers L` keeps the first L backbone layers (the real
checkpoint is ~41 GB with FP8 experts; 8 layers make it ~9 GB). bf16 on CUDA, float32 on the CPU.

    torchrun --nproc-per-node 2 benchmarks/parallel_check.py --config real --layers 8 --checkpoint /tmp/drama3-random
    torchrun --standalone --nproc-per-node 2 benchmarks/parallel_check.py --config tiny   # CPU, gloo
    python benchmarks/parallel_check.py --memory      # the memory table (real size, computed, no GPU needed)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import tempfile
import time
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist
import transformers
from transformers.generation.streamers import BaseStreamer

from transformers_drama3 import FishOmniConfig, FishOmniForSpeech, parallel
from transformers_drama3.testing import write_tiny_checkpoint

GB = 1e9
FP8_BLOCK = 128 * 128  # one float32 scale per 128 x 128 block
MODES = ("tensor", "expert")


def real_geometry(layers: int | None) -> dict:
    """`write_tiny_checkpoint` overrides for the real geometry (original config.json keys)."""
    real = FishOmniConfig()
    text, tower = real.text_config, real.audio_decoder_config
    text_keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                 "linear_value_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "max_position_embeddings")
    tower_keys = ("dim", "text_dim", "n_head", "n_local_heads", "head_dim", "n_layer", "shared_enrichment_layers",
                  "intermediate_size", "vocab_size")
    text_config = {key: getattr(text, key) for key in text_keys}
    if layers is not None:
        text_config["num_hidden_layers"] = layers
    codec = real.codec_config.to_dict()
    codec_config = {key: codec[key] for key in ("encoder_dim", "latent_dim", "decoder_dim", "encoder_transformer_layers",
                                                "quantizer")}
    return {"text_config": text_config, "audio_decoder_config": {key: getattr(tower, key) for key in tower_keys},
            "codec_config": codec_config}


GEOMETRIES = {
    "tiny": lambda layers: {"text_config": {"num_key_value_heads": 2, "moe_intermediate_size": 256,
                                            **({"num_hidden_layers": layers} if layers else {})},
                            "audio_decoder_config": {"n_local_heads": 2}},
    "real": real_geometry,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="print the per-GPU memory table and exit")
    parser.add_argument("--config", choices=sorted(GEOMETRIES), default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N backbone layers")
    parser.add_argument("--checkpoint", default=None,
                        help="directory of the random checkpoint (written there when missing; default: a temp dir)")
    parser.add_argument("--modes", default="tensor,expert", help="comma-separated: tensor, expert")
    parser.add_argument("--prompt-rows", type=int, default=32, help="random text rows of the prompt (default 32)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed frames first (default 4)")
    parser.add_argument("--frames", type=int, default=16, help="timed greedy frames (default 16)")
    parser.add_argument("--output", default=None, help="where rank 0 writes the JSON report")
    return parser.parse_args()


# ------------------------------------------------------------------------------------------------------------------
# Memory per GPU (computed on the meta device)
# ------------------------------------------------------------------------------------------------------------------


def bytes_per_rank(model: FishOmniForSpeech, size: int, expert_parallel: bool, fp8_experts: bool) -> float:
    """Weight bytes one of `size` ranks holds: split parameters count 1/size (`parallel.is_split`); routed experts
    in bf16 or FP8 (1 byte + a float32 scale per 128 x 128 block), the codec in float32, the rest in bf16."""
    total = 0.0
    for name, parameter in model.named_parameters():
        count = parameter.numel() / (size if parallel.is_split(name, model.config, size, expert_parallel) else 1)
        if name.startswith("codec."):
            total += 4 * count
        elif ".mlp.experts." in name and fp8_experts:
            total += (1 + 4 / FP8_BLOCK) * count
        else:
            total += 2 * count
    return total


def refusal(config: FishOmniConfig, size: int, expert_parallel: bool, fp8_experts: bool) -> str | None:
    """Why `from_pretrained` would refuse this split (None when it loads)."""
    if not fp8_experts:
        config = copy.deepcopy(config)
        config.quantization_config = None
    request = parallel.ParallelRequest(size=size, expert_parallel=expert_parallel, tp_plan=None)
    try:
        request.check(config)
    except parallel.Drama3ParallelError as error:
        return str(error)
    return None


def memory_table() -> str:
    config = FishOmniConfig()
    config.quantization_config = {"quant_method": "bsgemm-moe", "weight_block_size": [128, 128]}
    with torch.device("meta"):
        model = FishOmniForSpeech(config)
    lines = [f"transformers {transformers.__version__}: weights per GPU, GB (10^9 bytes), codec float32",
             "| mode | experts | 1 GPU | N = 2 | N = 4 | N = 8 |", "| --- | --- | --- | --- | --- | --- |"]
    for mode in MODES:
        for fp8 in (False, True):
            cells = [f"{bytes_per_rank(model, 1, False, fp8) / GB:.1f}"]
            for size in (2, 4, 8):
                reason = refusal(config, size, mode == "expert", fp8)
                cells.append("refused" if reason else f"{bytes_per_rank(model, size, mode == 'expert', fp8) / GB:.1f}")
                attention = [name for name, _ in model.named_parameters() if ".self_attn." in name]
                if not reason and not any(parallel.is_split(name, config, size, mode == "expert") for name in attention):
                    cells[-1] += "*"
            lines.append(f"| {mode} | {'FP8' if fp8 else 'bf16'} | " + " | ".join(cells) + " |")
    lines.append("* the full-attention layers stay whole on every rank (the ranks outnumber the 2 key/value heads, or "
                 "the expert plan of transformers 5.17 leaves the dense layers whole)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------------
# The check
# ------------------------------------------------------------------------------------------------------------------


class FrameClock(BaseStreamer):
    """Records the wall time at which each frame reaches the streamer (generate syncs the device before `put`)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def random_prompt(config: FishOmniConfig, rows: int) -> torch.Tensor:
    """Frame rows `[1, rows, 1 + NCB]` of random text tokens (ids below EOS and the semantic band)."""
    low = min(config.eos_token_id, config.semantic_start_token_id)
    prompt = torch.zeros(1, rows, 1 + config.num_codebooks, dtype=torch.long)
    prompt[..., 0] = torch.randint(0, low, (1, rows), generator=torch.Generator().manual_seed(0))
    return prompt


def measure(model: FishOmniForSpeech, args: argparse.Namespace) -> dict:
    """Main logits of the prompt, greedy frames and per-frame step times of one load."""
    device = model.input_device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prompt = random_prompt(model.config, args.prompt_rows)
    with torch.no_grad():
        logits = model(prompt).main_logits[0].float().cpu()  # [rows, V + 1]
    clock = FrameClock()
    out = model.generate(prompt, do_sample=False, max_new_tokens=args.warmup + args.frames, output_audio=False,
                         streamer=clock)
    steps = [later - earlier for earlier, later in zip(clock.times[args.warmup:], clock.times[args.warmup + 1:])]
    result = {"main_logits": logits, "codes": out.codes[0].cpu(), "finish_reason": out.finish_reason[0]}
    if steps:
        steps.sort()
        p90 = steps[math.ceil(0.9 * len(steps)) - 1]
        result["frame_ms"] = {"median": round(1e3 * statistics.median(steps), 3), "p90": round(1e3 * p90, 3)}
    if device.type == "cuda":
        result["peak_gb"] = torch.cuda.max_memory_allocated(device) / GB
    return result


def compare(split: dict, whole: dict) -> dict:
    difference = split["main_logits"] - whole["main_logits"]
    a, b = split["codes"], whole["codes"]
    n = min(a.shape[1], b.shape[1])
    equal = (a[:, :n] == b[:, :n]).all(0)
    leading = int(n if bool(equal.all()) else equal.int().argmin())
    report = {"main_logits_max_abs": difference.abs().max().item(),
              "main_logits_rel_l2": (difference.norm() / whole["main_logits"].norm()).item(),
              "leading_equal_frames": leading, "frames": n}
    if "frame_ms" in split and "frame_ms" in whole:
        report["frame_step_ratio"] = split["frame_ms"]["median"] / whole["frame_ms"]["median"]
    return report


def public(result: dict) -> dict:
    return {key: value for key, value in result.items() if key not in ("main_logits", "codes")}


def main() -> None:
    args = parse_args()
    if args.memory:
        print(memory_table())
        return
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # steadier on a shared CPU machine
    size = parallel.world_size()
    if size > 1:  # the other ranks wait while rank 0 writes the checkpoint and runs the one-device half
        parallel.init_process_group(timeout=timedelta(hours=2))
    checkpoint = args.checkpoint or os.path.join(tempfile.gettempdir(), f"drama3-parallel-{args.config}")
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        parallel.run_on_main_process(write_tiny_checkpoint, checkpoint, **GEOMETRIES[args.config](args.layers))
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "config": args.config,
              "layers": args.layers, "ranks": size, "transformers": transformers.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "modes": {}}
    split_results = {}
    for mode in args.modes.split(",") if size > 1 else ():
        try:
            config = parallel.distributed_config(expert_parallel=mode == "expert")
            model = FishOmniForSpeech.from_pretrained(checkpoint, dtype=dtype, distributed_config=config)
        except parallel.Drama3ParallelError as error:
            report["modes"][mode] = {"refused": str(error)}
            continue
        split_results[mode] = measure(model, args)
        peaks = [None] * size
        dist.all_gather_object(peaks, split_results[mode].get("peak_gb"))
        report["modes"][mode] = {**public(split_results[mode]), "peak_gb_per_rank": peaks}
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if size > 1:
        dist.barrier()
    if parallel.is_main_process():
        device_map = "cuda:0" if torch.cuda.is_available() else None
        whole = measure(FishOmniForSpeech.from_pretrained(checkpoint, dtype=dtype, device_map=device_map), args)
        report["one_device"] = public(whole)
        for mode, result in split_results.items():
            report["modes"][mode].update(compare(result, whole))
        print_report(report)
        if args.output:
            with open(args.output, "w") as file:
                json.dump(report, file, indent=2)
    if size > 1:
        dist.barrier()
        dist.destroy_process_group()


def print_report(report: dict) -> None:
    print(f"Drama 3 split over {report['ranks']} ranks, config {report['config']} (layers {report['layers'] or 'all'}), "
          f"{report['device']}, transformers {report['transformers']}, {report['date']}")
    whole = report["one_device"]
    print(f"one device: frame step {whole.get('frame_ms')}, peak {whole.get('peak_gb')} GB")
    if report["ranks"] == 1:
        print("note: one process, so only the one-device half ran; launch with torchrun --nproc-per-node N (N >= 2)")
    for mode, result in report["modes"].items():
        if "refused" in result:
            print(f"{mode}: refused: {result['refused']}")
            continue
        print(f"{mode}: frame step {result.get('frame_ms')} ({result.get('frame_step_ratio', float('nan')):.2f}x one "
              f"device), peak per rank {result['peak_gb_per_rank']} GB; main logits max abs diff "
              f"{result['main_logits_max_abs']:.3g}, rel L2 {result['main_logits_rel_l2']:.3g}; "
              f"{result['leading_equal_frames']}/{result['frames']} greedy frames equal to one process")


if __name__ == "__main__":
    main()
