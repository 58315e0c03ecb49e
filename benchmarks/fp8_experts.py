"""The frame step with the routed experts kept in FP8, as the real checkpoint ships them (random weights).

On a GPU, `from_pretrained` of the real checkpoint keeps the routed experts in FP8 (`bsgemm-moe`, 128 x 128 blocks)
and runs them with transformers' fine-grained FP8 kernels. This builds the same model without a 41 GB checkpoint:
the model in bfloat16 with random weights, its routed experts swapped for transformers' FP8 experts
(`replace_with_fp8_linear`) holding the block-quantised bf16 weights, then it times the eager step and the CUDA-graph
step side by side (benchmarks/frame_step.py) and compares the first frames with the bf16 model's.

transformers' FP8 experts need CUDA, the `kernels` package and its `kernels-community/finegrained-fp8` build (a
download from the Hub, cached afterwards): when any is missing the script says which and stops.

    PYTHONPATH=src python benchmarks/fp8_experts.py --config real --device cuda --output fp8.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers.utils.quantization_config import FineGrainedFP8Config

import frame_step
from configs import build_model, model_config, random_prompt
from transformers_drama3.generation.cuda_graphs import captured_experts
from transformers_drama3.testing import quantize_fp8_blockwise

BLOCK = [128, 128]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small", "real", "topology"], default="real")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N backbone layers")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--prompt-rows", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def missing_requirements(device: torch.device) -> str | None:
    """What transformers' FP8 experts need that this machine lacks (None when everything is there)."""
    if device.type != "cuda":
        return "FP8 experts run on CUDA only (transformers' fine-grained FP8 kernels are Triton/CUDA kernels)"
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except (ImportError, OSError) as error:
        return (f"transformers' FP8 kernel is not available: {error} (it needs `pip install kernels` and one download "
                "of kernels-community/finegrained-fp8 from the Hub, cached afterwards)")
    return None


def with_fp8_experts(model) -> None:
    """Swap every routed-experts module of the backbone for transformers' FP8 experts holding its weights,
    quantised in 128 x 128 blocks as the checkpoint stores them."""
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    originals = {name: module for name, module in model.backbone.named_modules() if name.endswith(".experts")}
    not_experts = sorted({name for name, module in model.backbone.named_modules()
                          if isinstance(module, torch.nn.Linear) and ".experts" not in name})
    config = FineGrainedFP8Config(weight_block_size=BLOCK, modules_to_not_convert=not_experts)
    replace_with_fp8_linear(model.backbone, modules_to_not_convert=not_experts, quantization_config=config,
                            pre_quantized=True)
    device = model.lm_head.weight.device
    for name, original in originals.items():
        fp8 = model.backbone.get_submodule(name)
        fp8.to_empty(device=device)
        for projection in ("gate_up_proj", "down_proj"):
            weights = getattr(original, projection).detach()  # [E, out, in]
            quantised = [quantize_fp8_blockwise(weight, BLOCK[0]) for weight in weights]
            getattr(fp8, projection).data.copy_(torch.stack([q for q, _ in quantised]))
            getattr(fp8, f"{projection}_scale_inv").data.copy_(torch.stack([s for _, s in quantised]))


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    report = {"command": " ".join(sys.argv)}
    problem = missing_requirements(device)
    if problem is not None:
        report["missing"] = problem
        print(problem)
    else:
        config = model_config(args.config, args.layers)
        model = build_model(config, device, torch.bfloat16, args.seed)
        prompt = random_prompt(config, args.prompt_rows, 1, device, args.seed)
        with captured_experts(model):
            reference = model.generate(prompt, do_sample=False, max_new_tokens=8, output_audio=False).sequences
        with_fp8_experts(model)
        report["weights_gib"] = frame_step.weights_gib(model)
        report["timings"] = {}
        for batch in (int(b) for b in args.batches.split(",")):
            batch_prompt = random_prompt(config, args.prompt_rows, batch, device, args.seed)
            for mode in ("eager", "graph"):
                report["timings"][f"{mode}@{batch}"] = frame_step.attempt(
                    lambda: frame_step.time_mode(model, batch_prompt, mode, args, device))
        fp8 = model.generate(prompt, do_sample=False, max_new_tokens=8, output_audio=False).sequences
        report["same_first_8_greedy_frames_as_bf16"] = bool(torch.equal(fp8, reference))
        report["memory"] = frame_step.peak_memory(device)
        print(json.dumps({k: v for k, v in report.items() if k != "timings"}, default=str))
        for key, entry in report["timings"].items():
            print(key, {k: v for k, v in entry.items() if k != "samples_ms"})
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    main()
