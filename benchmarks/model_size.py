"""Memory of the real-size Drama 3 model in each hardware configuration, from its parameter counts.

The model is built on the meta device from `FishOmniConfig()` (the real geometry: Qwen3.5-35B-A3B backbone, the
13-layer tower, the real codec), so nothing is allocated. Parameters are counted per group (routed experts, the
backbone's dense linears, the rest of the backbone, lm_head, tower, codec) and turned into bytes for each way of
loading. Offloaded configurations use accelerate's own `infer_auto_device_map` on the meta model without its codec
and with the `max_memory` shown, then add the codec to the input embedding's device, as `from_pretrained` does. Sizes are in GB
(10^9 bytes), the unit of `max_memory="20GB"`.

    python benchmarks/model_size.py            # prints the tables of docs/hardware.md
    python benchmarks/model_size.py --json sizes.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from accelerate import infer_auto_device_map
from accelerate.utils import compute_module_sizes
from torch import nn

from transformers_drama3 import FishOmniConfig, FishOmniForSpeech

GB = 1e9
FP8_BLOCK = 128 * 128  # one float32 weight_scale_inv per 128 x 128 block
BNB_4BIT_BLOCK = 64  # one float32 absmax per 64 weights (no double quantisation)
CODEC_BYTES_PER_PARAM = 4  # the codec stays float32

BNB_NESTED_BLOCK = 256  # double quantisation: absmax in uint8, one float32 scale per 256 of them
FOUR_BIT = 0.5 + 4 / BNB_4BIT_BLOCK  # 4-bit weight + float32 absmax per 64
FOUR_BIT_DOUBLE = 0.5 + 1 / BNB_4BIT_BLOCK + 4 / (BNB_4BIT_BLOCK * BNB_NESTED_BLOCK)

# (name, bytes per parameter of: routed experts, dense backbone linears, everything else but the codec)
WEIGHT_SCHEMES = {
    "bf16 (FP8 experts dequantised)": (2, 2, 2),
    "FP8 experts kept (any device; or transformers' kernel), rest bf16": (1 + 4 / FP8_BLOCK, 2, 2),
    "float32": (4, 4, 4),
    "bnb 8-bit dense linears, FP8 experts kept, bf16 rest": (1 + 4 / FP8_BLOCK, 1, 2),  # + a float32 scale per row, below
    "bnb 4-bit dense linears and routed experts (fp4 or nf4), bf16 rest": (FOUR_BIT, FOUR_BIT, 2),
    "bnb 4-bit with double quantisation, bf16 rest": (FOUR_BIT_DOUBLE, FOUR_BIT_DOUBLE, 2),
}

# The generation configurations of docs/hardware.md: (name, `from_pretrained` arguments, experts and dense bytes
# per parameter, tower bytes per linear parameter, lm_head rows kept, codec bytes per parameter on the GPU).
GPU_CONFIGURATIONS = [
    ("24 GB: 4-bit as written", "quantization_config=BitsAndBytesConfig(load_in_4bit=True)",
     FOUR_BIT, 2, None, 4),
    ("24 GB: nf4 + double quant, tower 4-bit, candidate lm_head rows, codec bf16",
     'quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", '
     'bnb_4bit_use_double_quant=True, llm_int8_skip_modules=["lm_head"]), candidate_head_rows_only=True; '
     "model.codec.to(torch.bfloat16)", FOUR_BIT_DOUBLE, FOUR_BIT_DOUBLE, "candidates", 2),
    ("24 GB: the same, codec on the CPU", "... as above; model.codec.to('cpu')", FOUR_BIT_DOUBLE, FOUR_BIT_DOUBLE,
     "candidates", 0),
    ("48 GB: FP8 kept (the default)", "dtype=torch.bfloat16", 1 + 4 / FP8_BLOCK, 2, None, 4),
    ("48 GB: FP8 kept, candidate lm_head rows, codec bf16", "candidate_head_rows_only=True; model.codec.to(torch.bfloat16)",
     1 + 4 / FP8_BLOCK, 2, "candidates", 2),
    ("80 GB: bf16", "quantization_config=BsgemmMoeConfig(dequantize=True)", 2, 2, None, 4),
]


def configuration_bytes(groups: Counter, config: FishOmniConfig, experts: float, tower_linear: float,
                        head_rows, codec: float) -> float:
    """GPU bytes of one `GPU_CONFIGURATIONS` entry: experts and dense linears at `experts`, the tower's linears at
    `tower_linear` (its embeddings and norms bf16), lm_head whole or its V + 1 candidate rows (bf16), the rest bf16,
    the codec at `codec` bytes per parameter (0: on another device)."""
    head = groups["lm_head"] if head_rows is None else (config.codebook_size + 1) * config.text_config.hidden_size
    tower = groups["tower_linears"] * tower_linear + (groups["tower"] - groups["tower_linears"]) * 2
    dense = groups["dense_linears"] * (experts if experts < 1 else 2)
    return (groups["routed_experts"] * experts + dense + groups["backbone_other"] * 2 + head * 2 + tower
            + groups["codec"] * codec)


def parameter_groups(model: FishOmniForSpeech) -> Counter:
    """Parameter count per group: routed_experts, dense_linears (what bitsandbytes quantises), backbone_other,
    lm_head, tower, codec; plus `dense_linear_rows` (output rows of the dense linears, for int8 row scales)."""
    groups = Counter()
    linears = {name: module for name, module in model.backbone.named_modules() if isinstance(module, nn.Linear)}
    tower_linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)
                     and name.startswith("tower.")}
    for name, parameter in model.named_parameters():
        top, _, rest = name.partition(".")
        if top != "backbone":
            groups[top] += parameter.numel()
            if name.rpartition(".")[0] in tower_linears:
                groups["tower_linears"] += parameter.numel()
        elif ".mlp.experts." in name:
            groups["routed_experts"] += parameter.numel()
        elif rest.rpartition(".")[0] in linears:
            groups["dense_linears"] += parameter.numel()
            groups["dense_linear_rows"] += parameter.shape[0]
        else:
            groups["backbone_other"] += parameter.numel()
    return groups


def weight_bytes(groups: Counter, scheme: str) -> float:
    """Bytes of all weights (codec included) when loaded with `scheme`."""
    experts, dense, rest = WEIGHT_SCHEMES[scheme]
    others = groups["backbone_other"] + groups["lm_head"] + groups["tower"]
    total = groups["routed_experts"] * experts + groups["dense_linears"] * dense + others * rest
    if scheme.startswith("bnb 8-bit"):
        total += groups["dense_linear_rows"] * 4
    return total + groups["codec"] * CODEC_BYTES_PER_PARAM


def request_state_bytes(config: FishOmniConfig, rows: int) -> float:
    """Caches of one request of `rows` frame rows in bf16: backbone KV (full-attention layers), linear-attention
    conv + recurrent states (float32 recurrent state), and the 13 tower layers' KV."""
    text = config.text_config
    kv_row = 2 * text.num_key_value_heads * text.head_dim * 2  # K and V, bf16
    full = text.layer_types.count("full_attention")
    linear = len(text.layer_types) - full
    conv_channels = 2 * text.linear_num_key_heads * text.linear_key_head_dim + text.linear_num_value_heads * text.linear_value_head_dim
    recurrent = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
    tower = config.audio_decoder_config
    tower_layers = tower.shared_enrichment_layers + tower.num_codebooks - 1
    tower_row = 2 * tower.n_local_heads * tower.head_dim * 2
    return rows * (full * kv_row + tower_layers * tower_row) + linear * (conv_channels * text.linear_conv_kernel_dim * 2 + recurrent)


def offload_split(model: FishOmniForSpeech, codec_bytes: float, max_memory: dict) -> dict:
    """GB per device ("cpu", "disk", GPU index) of a bf16 load with `device_map="auto"` and `max_memory`: transformers
    maps the model without its codec (`model`), and the codec (`codec_bytes`, float32) joins the input embedding."""
    device_map = infer_auto_device_map(model, max_memory=dict(max_memory), no_split_module_classes=model._no_split_modules)
    sizes = compute_module_sizes(model)
    totals = Counter()
    for name, device in device_map.items():
        totals[device] += sizes[name]
    embedding = next(device for name, device in device_map.items() if "backbone.embed_tokens".startswith(name))
    totals[embedding] += codec_bytes
    return {device: round(size / GB, 1) for device, size in totals.items()}


OFFLOAD_CASES = {
    "48 GB GPU + 64 GB RAM": {0: "44GB", "cpu": "60GB"},
    "24 GB GPU + 64 GB RAM": {0: "20GB", "cpu": "60GB"},
    "24 GB GPU + 32 GB RAM + disk": {0: "20GB", "cpu": "24GB", "disk": "200GB"},
    "CPU only, 32 GB RAM + disk": {"cpu": "24GB", "disk": "200GB"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()

    config = FishOmniConfig()
    with torch.device("meta"):
        model = FishOmniForSpeech(config)
    groups = parameter_groups(model)
    total = sum(count for name, count in groups.items() if name not in ("dense_linear_rows", "tower_linears"))
    print("| part | parameters | share |\n| --- | --- | --- |")
    for name in ("routed_experts", "dense_linears", "backbone_other", "lm_head", "tower", "codec"):
        print(f"| {name} | {groups[name] / 1e9:.3f} B | {100 * groups[name] / total:.1f} % |")
    print(f"| total | {total / 1e9:.3f} B | |\n")

    weights = {scheme: round(weight_bytes(groups, scheme) / GB, 1) for scheme in WEIGHT_SCHEMES}
    print("| weights loaded as | GB |\n| --- | --- |")
    for scheme, size in weights.items():
        print(f"| {scheme} | {size} |")
    configurations = {name: round(configuration_bytes(groups, config, *sizes) / GB, 2)
                      for name, _, *sizes in GPU_CONFIGURATIONS}
    print("\n| configuration | GPU weights, GB | settings |\n| --- | --- | --- |")
    for name, settings, *_ in GPU_CONFIGURATIONS:
        print(f"| {name} | {configurations[name]} | `{settings}` |")
    state = {rows: round(request_state_bytes(config, rows) / GB, 3) for rows in (1024, 8192)}
    print(f"\nrequest caches (bf16): {state} GB for 1024 / 8192 rows\n")

    with torch.device("meta"):
        without_codec = FishOmniForSpeech(config, with_codec=False).to(torch.bfloat16)
    codec_bytes = groups["codec"] * CODEC_BYTES_PER_PARAM
    splits = {case: offload_split(without_codec, codec_bytes, memory) for case, memory in OFFLOAD_CASES.items()}
    print("| bf16, device_map='auto' | max_memory | GB per device |\n| --- | --- | --- |")
    for case, memory in OFFLOAD_CASES.items():
        print(f"| {case} | {memory} | {splits[case]} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"parameters": dict(groups), "weights_gb": weights, "configurations_gb": configurations,
                       "request_state_gb": state,
                       "offload_gb": {case: {str(k): v for k, v in split.items()} for case, split in splits.items()}},
                      f, indent=2)


if __name__ == "__main__":
    main()
