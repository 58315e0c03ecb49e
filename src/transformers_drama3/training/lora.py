"""LoRA target presets for Drama 3 and the `peft.LoraConfig` built from them (docs/finetuning.md).

Module names are full regular expressions anchored at `backbone.` or `tower.`: the codec has modules with the same
short names (`wqkv`, `w1`, ...) and must never be adapted (it is not part of the forward pass).

- `"attention"`: the backbone's full-attention projections (`q/k/v/o_proj`) and linear-attention projections
  (`in_proj_qkv`, `in_proj_z`, `out_proj`; the per-head `in_proj_a/b` have fewer outputs than a LoRA rank).
- `"default"`: `"attention"` + the shared expert of every MoE layer (`gate/up/down_proj`) + every linear of the
  codebook tower (its attention, feed-forward, `eh_proj` mixing and the codebook heads).
- `"experts"`: `"default"` + the routed experts, through peft's parameter targeting of the fused 3-D tensors
  `mlp.experts.gate_up_proj [E, 2I, H]` and `mlp.experts.down_proj [E, H, I]` (one rank-r pair per expert; peft
  builds the update of all experts at every forward, and it allows no LoRA dropout there).
"""

from __future__ import annotations

from dataclasses import dataclass

from peft import LoraConfig

_LAYER = r"backbone\.layers\.\d+\."
_ATTENTION = _LAYER + r"(self_attn\.(q_proj|k_proj|v_proj|o_proj)|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))"
_SHARED_EXPERT = _LAYER + r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)"
_TOWER = r"tower\.((shared_layers|residual_layers)\.\d+\.(eh_proj|transformer_layer\.(attention\.(wqkv|wo)|" \
         r"feed_forward\.(w1|w2|w3)))|heads\.\d+)"
_ROUTED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class LoraTargets:
    """What a preset adapts: `modules` (peft `target_modules`, one regular expression over full module names) and
    `parameters` (peft `target_parameters`, suffixes of 3-D parameter names)."""

    modules: str
    parameters: tuple[str, ...] = ()


LORA_PRESETS = {
    "attention": LoraTargets(_ATTENTION),
    "default": LoraTargets(f"({_ATTENTION}|{_SHARED_EXPERT}|{_TOWER})"),
    "experts": LoraTargets(f"({_ATTENTION}|{_SHARED_EXPERT}|{_TOWER})", _ROUTED_EXPERTS),
}


def drama3_lora_config(
    preset: str = "default", r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.0, **kwargs
) -> LoraConfig:
    """A `peft.LoraConfig` for one of `LORA_PRESETS`; other keywords go to `LoraConfig` unchanged.

    Pass it to `peft.get_peft_model(model, config)`. The defaults (rank 16, alpha 32, no dropout) are the starting
    point of docs/finetuning.md. `"experts"` needs `lora_dropout=0` (peft cannot apply dropout to fused experts).
    """
    if preset not in LORA_PRESETS:
        raise ValueError(f"unknown LoRA preset {preset!r}; choose one of {sorted(LORA_PRESETS)}")
    targets = LORA_PRESETS[preset]
    if targets.parameters and lora_dropout:
        raise ValueError(
            f"preset {preset!r} adapts the fused routed experts, where peft allows no LoRA dropout: use lora_dropout=0"
        )
    for key in ("target_modules", "target_parameters"):
        if key in kwargs:
            raise ValueError(f"{key} comes from the preset; build a peft.LoraConfig yourself to choose other targets")
    return LoraConfig(
        r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets.modules,
        target_parameters=list(targets.parameters) or None, **kwargs
    )


__all__ = ["LORA_PRESETS", "LoraTargets", "drama3_lora_config"]
