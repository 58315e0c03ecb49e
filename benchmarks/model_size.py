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

# (name, bytes per parameter of: routed experts, dense backbone linears, everything else but the codec)
WEIGHT_SCHEMES = {
    "bf16 (FP8 experts dequantised)": (2, 2, 2),
    "FP8 experts (FP8 GPU + `kernels`)": (1 + 4 / FP8_BLOCK, 2, 2),
    "float32": (4, 4, 4),
    "bnb 8-bit dense linears, bf16 rest": (2, 1, 2),  # + a float32 absmax per row, added below
    "bnb 4-bit dense linears, bf16 rest": (2, 0.5 + 4 / BNB_4BIT_BLOCK, 2),
}


def parameter_groups(model: FishOmniForSpeech) -> Counter:
    """Parameter count per group: routed_experts, dense_linears (what bitsandbytes quantises), backbone_other,
    lm_head, tower, codec; plus `dense_linear_rows` (output rows of the dense linears, for int8 row scales)."""
    groups = Counter()
    linears = {name: module for name, module in model.backbone.named_modules() if isinstance(module, nn.Linear)}
    for name, parameter in model.named_parameters():
        top, _, rest = name.partition(".")
        if top != "backbone":
            groups[top] += parameter.numel()
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
    total = sum(count for name, count in groups.items() if name != "dense_linear_rows")
    print("| part | parameters | share |\n| --- | --- | --- |")
    for name in ("routed_experts", "dense_linears", "backbone_other", "lm_head", "tower", "codec"):
        print(f"| {name} | {groups[name] / 1e9:.3f} B | {100 * groups[name] / total:.1f} % |")
    print(f"| total | {total / 1e9:.3f} B | |\n")

    weights = {scheme: round(weight_bytes(groups, scheme) / GB, 1) for scheme in WEIGHT_SCHEMES}
    print("| weights loaded as | GB |\n| --- | --- |")
    for scheme, size in weights.items():
        print(f"| {scheme} | {size} |")
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
            json.dump({"parameters": dict(groups), "weights_gb": weights, "request_state_gb": state,
                       "offload_gb": {case: {str(k): v for k, v in split.items()} for case, split in splits.items()}},
                      f, indent=2)


if __name__ == "__main__":
    main()
