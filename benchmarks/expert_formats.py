"""Frame time with the routed experts in each format, side by side in one run (random weights).

One model is built (`--config`, `--layers`) with random weights; its experts are first quantised to the
checkpoint's FP8 blocks and dequantised again (exactly what `BsgemmMoeConfig(dequantize=True)` loads), then the
same eager frame step (`benchmarks/frame_step.py`, the step `generate` runs) is timed with the experts:

- `dequantised`: transformers' own experts holding those weights (the dequantise-at-load model);
- `fp8-kept`: `Fp8SelectedExperts` holding the FP8 bytes and scales (the default without an FP8 GPU kernel);
- `4bit`: `Bnb4bitSelectedExperts` quantised by bitsandbytes from the same weights (`--quant-types`, fp4 as
  `BitsAndBytesConfig(load_in_4bit=True)` gives, nf4 with double quantisation as the 24 GB configuration).

Only the experts change between the timings; dense linears stay as built. The first greedy frames of each format are
compared with the dequantised model's. The model is built without its codec (a frame step does not decode).

    python benchmarks/expert_formats.py --config small --output expert-formats-small.json
    python benchmarks/expert_formats.py --config real --layers 1 --dtype bfloat16 --output expert-formats-real.json
    python benchmarks/expert_formats.py --config real --device cuda --batches 1,16 --output expert-formats-gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import frame_step
from configs import default_dtype, model_config, random_prompt
from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.quantized_experts import Bnb4bitSelectedExperts, Fp8SelectedExperts
from transformers_drama3.testing import quantize_fp8_blockwise


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small", "real", "topology"], default="small")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N backbone layers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on a CPU, bfloat16 on a GPU")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--quant-types", default="fp4,nf4-double")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--prompt-rows", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def fp8_experts(plain, device) -> Fp8SelectedExperts:
    """`plain` experts quantised as the checkpoint ships them: per expert, gate and up rows apart, 128 x 128 blocks."""
    with torch.device("meta"):
        kept = Fp8SelectedExperts(plain.config)
    kept.to_empty(device=device)
    for name, halves in (("gate_up_proj", 2), ("down_proj", 1)):
        weight = getattr(plain, name).detach()  # [E, out, in]
        pieces = [quantize_fp8_blockwise(part.float()) for expert in weight for part in expert.chunk(halves)]
        getattr(kept, name).data.copy_(torch.stack([q for q, _ in pieces]).view(weight.shape))
        scales = torch.stack([s for _, s in pieces])
        getattr(kept, f"{name}_scale_inv").data.copy_(scales.view(weight.shape[0], -1, scales.shape[-1]))
    return kept.requires_grad_(False)


def four_bit_experts(kept: Fp8SelectedExperts, kind: str, device) -> Bnb4bitSelectedExperts:
    import bitsandbytes as bnb  # only 4-bit experts need it

    quant_type, _, double = kind.partition("-")
    with torch.device("meta"):
        experts = Bnb4bitSelectedExperts(kept.config, quant_type=quant_type, compress_statistics=bool(double))
    for name in ("gate_up_proj", "down_proj"):
        weight = kept.dequantized(name, None, torch.float32)
        setattr(experts, name, bnb.nn.Params4bit(weight, requires_grad=False, quant_type=quant_type,
                                                 compress_statistics=bool(double)).to(device))
    return experts


def experts_modules(model) -> dict:
    return {name: module for name, module in model.backbone.named_modules() if name.endswith(".mlp.experts")}


def experts_gb(model) -> float:
    """Bytes of the routed experts, block statistics included."""
    total = 0
    for module in experts_modules(model).values():
        for parameter in module.parameters():
            total += parameter.numel() * parameter.element_size()
            state = getattr(parameter, "quant_state", None)
            if state is not None:
                total += state.absmax.numel() * state.absmax.element_size()
                if state.nested:
                    total += state.state2.absmax.numel() * state.state2.absmax.element_size()
    return total / 1e9


def time_format(model, prompts, args, device) -> dict:
    timings = {}
    for batch, prompt in prompts.items():
        timings[f"eager@{batch}"] = frame_step.attempt(lambda: frame_step.time_mode(model, prompt, "eager", args, device))
    greedy = model.generate(prompts[min(prompts)], do_sample=False, max_new_tokens=4, output_audio=False).sequences
    return {"experts_gb": round(experts_gb(model), 3), "timings": timings, "greedy": greedy}


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    config = model_config(args.config, args.layers)
    torch.manual_seed(args.seed)
    with default_dtype(dtype), device:
        model = FishOmniForSpeech(config, with_codec=False).eval()
    prompts = {int(b): random_prompt(config, args.prompt_rows, int(b), device, args.seed) for b in args.batches.split(",")}
    report = {"command": " ".join(sys.argv), "config": args.config, "layers": args.layers,
              "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "formats": {}}
    kept = {}
    for name, plain in experts_modules(model).items():  # the FP8 weights, and the plain experts dequantised from them
        kept[name] = fp8_experts(plain, device)
        for projection in ("gate_up_proj", "down_proj"):
            getattr(plain, projection).data.copy_(kept[name].dequantized(projection, None, dtype))
    start = time.perf_counter()
    report["formats"]["dequantised"] = time_format(model, prompts, args, device)
    for name, experts in kept.items():
        model.backbone.set_submodule(name, experts)
    report["formats"]["fp8-kept"] = time_format(model, prompts, args, device)
    for kind in args.quant_types.split(","):
        for name in kept:
            model.backbone.set_submodule(name, four_bit_experts(kept[name], kind, device))
        report["formats"][f"4bit-{kind}"] = time_format(model, prompts, args, device)
    reference = report["formats"]["dequantised"].pop("greedy")
    for name, entry in report["formats"].items():
        if "greedy" in entry:
            entry["same_first_4_greedy_frames_as_dequantised"] = bool(torch.equal(entry.pop("greedy"), reference))
        base = report["formats"]["dequantised"]["timings"]
        for key, timing in entry["timings"].items():
            if "median_ms" in timing and "median_ms" in base.get(key, {}):
                timing["over_dequantised"] = round(timing["median_ms"] / base[key]["median_ms"], 2)
            timing.pop("samples_ms", None)
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2, default=str))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    main()
