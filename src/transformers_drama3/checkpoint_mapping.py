"""How the original Drama 3 tensor names map onto `FishOmniForSpeech`, and checking a checkpoint before loading it.

The original checkpoint (docs/format.md#tensor-names) loads through transformers' own `from_pretrained`: prefix
renamings are registered for `model_type "fish_omni"` with transformers' conversion-mapping API, and the nested
`Qwen3_5MoeTextModel` brings its own mapping that fuses the per-expert tensors. `save_pretrained` reverses the
renamings, so saved checkpoints keep the original names.

`check_checkpoint_tensors` reads only the safetensors headers and fails, before any weight is read, on a missing
shard, a missing or unknown tensor, a tensor of the wrong shape, or an FP8 tensor without its scale.
"""

from __future__ import annotations

import json
import math
import os
import re

import torch
from safetensors import safe_open
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming

MODEL_TYPE = "fish_omni"

# original checkpoint prefix -> module path in FishOmniForSpeech. Everything below a prefix keeps its name.
ORIGINAL_PREFIXES = {
    "model.language_model.": "backbone.",
    "audio_decoder.codebook_embeddings.": "tower.codebook_embeddings.",
    "audio_decoder_mtp_shared.layers.": "tower.shared_layers.",
    "audio_decoder_mtp.layers.": "tower.residual_layers.",
    "audio_decoder_mtp.heads.": "tower.heads.",
}
FP8_BLOCK = 128
_FUSED_EXPERTS = re.compile(r"^(?P<layer>.+\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)$")
_SAFETENSORS_FP8 = {"F8_E4M3"}
_PLAIN_LAYOUT_MARKER = "backbone.embed_tokens.weight"


class Drama3CheckpointError(ValueError):
    """A checkpoint's files or tensors do not match what its config describes."""


def register_checkpoint_mapping() -> None:
    """Register the original-name renamings for `fish_omni` (idempotent)."""
    renamings = [
        WeightRenaming(source_patterns="^" + re.escape(original), target_patterns=ours)
        for original, ours in ORIGINAL_PREFIXES.items()
    ]
    if get_checkpoint_conversion_mapping(MODEL_TYPE) is None:
        register_checkpoint_conversion_mapping(MODEL_TYPE, renamings)


def to_original_name(name: str) -> str:
    """Module parameter name -> original checkpoint name (the inverse of `ORIGINAL_PREFIXES`)."""
    for original, ours in ORIGINAL_PREFIXES.items():
        if name.startswith(ours):
            return original + name[len(ours):]
    return name


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (math.ceil(shape[0] / FP8_BLOCK), math.ceil(shape[1] / FP8_BLOCK))


def expected_original_tensors(model: torch.nn.Module, fp8_experts: bool) -> dict[str, tuple[int, ...]]:
    """Original name -> shape of every tensor a checkpoint for `model` holds (the model may live on `meta`).

    The fused routed experts (`experts.gate_up_proj [E, 2I, D]`, `experts.down_proj [E, D, I]`) are stored one
    tensor per expert (`experts.E.{gate,up,down}_proj.weight`), each with a `weight_scale_inv` when FP8.
    `model` is built without its codec, which is not in the safetensors files (see `codec_file`).
    """
    expected: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            expected[to_original_name(name)] = tuple(tensor.shape)
            continue
        num_experts, rows, cols = tensor.shape
        if match["name"] == "gate_up_proj":
            per_expert = {"gate_proj": (rows // 2, cols), "up_proj": (rows // 2, cols)}
        else:
            per_expert = {"down_proj": (rows, cols)}
        for expert in range(num_experts):
            for proj, shape in per_expert.items():
                key = to_original_name(f"{match['layer']}.{expert}.{proj}.weight")
                expected[key] = shape
                if fp8_experts:
                    expected[key + "_scale_inv"] = _scale_shape(shape)
    return expected


def expected_checkpoint_tensors(model: torch.nn.Module, shards: list[str], fp8_experts: bool) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the safetensors `shards` must hold for `model`.

    Usually the original layout (`expected_original_tensors`). A checkpoint saved with
    `save_pretrained(..., save_original_format=False)` uses the module names instead (`backbone.*`, fused experts);
    it is recognised by its `backbone.embed_tokens.weight` tensor.
    """
    if not any(_PLAIN_LAYOUT_MARKER in _tensor_names(path) for path in shards):
        return expected_original_tensors(model, fp8_experts)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _tensor_names(path: str) -> set[str]:
    with safe_open(path, framework="pt") as f:
        return set(f.keys())


def checkpoint_shards(directory: str) -> list[str]:
    """Paths of the safetensors files of a local checkpoint directory (sharded or single); each must exist."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        shards = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    else:
        shards = [os.path.join(directory, "model.safetensors")]
    missing = [os.path.basename(path) for path in shards if not os.path.isfile(path)]
    if missing:
        raise Drama3CheckpointError(
            f"checkpoint {directory!r} is missing the weight file(s) {missing}; download the complete checkpoint "
            "(every shard listed in model.safetensors.index.json)"
        )
    return shards


def tensor_headers(shards: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, safetensors dtype name) of every tensor in `shards`, from their headers (no weight is read)."""
    found = {}
    for path in shards:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                found[key] = (tuple(tensor.get_shape()), tensor.get_dtype())
    return found


def dense_dtypes(shards: list[str]) -> set[str]:
    """The safetensors dtype names (`"BF16"`, `"F32"`, ...) of the tensors in `shards` other than FP8 values and
    their block scales (`*_scale_inv`). Reads only the headers."""
    return {dtype for key, (_, dtype) in tensor_headers(shards).items()
            if dtype not in _SAFETENSORS_FP8 and not key.endswith("_scale_inv")}


def check_checkpoint_tensors(shards: list[str], expected: dict[str, tuple[int, ...]]) -> None:
    """Compare the safetensors headers of `shards` with `expected`; raise on any difference. Reads no weights."""
    found = tensor_headers(shards)
    problems = []
    missing = sorted(set(expected) - set(found))
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_preview(missing)}")
    unknown = sorted(set(found) - set(expected))
    if unknown:
        problems.append(f"tensors the config does not describe ({len(unknown)}): {_preview(unknown)}")
    wrong = [
        f"{key} has shape {list(found[key][0])}, expected {list(shape)}"
        for key, shape in expected.items()
        if key in found and found[key][0] != shape
    ]
    if wrong:
        problems.append("wrong shapes: " + _preview(wrong))
    unscaled = sorted(
        key for key, (_, dtype) in found.items() if dtype in _SAFETENSORS_FP8 and key + "_scale_inv" not in found
    )
    if unscaled:
        problems.append(f"FP8 tensors without their `weight_scale_inv`: {_preview(unscaled)}")
    if problems:
        raise Drama3CheckpointError(
            "the checkpoint does not match its config.json: " + "; ".join(problems)
            + ". Check that the files come from the same checkpoint as config.json."
        )


def _preview(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
