"""The `bsgemm-moe` quantization method of Drama 3 checkpoints (SPEC 2.3), made known to transformers.

Only the routed experts are FP8 (`float8_e4m3fn` with float32 `weight_scale_inv` per 128 x 128 block), exactly the
layout of transformers' fine-grained FP8 method. transformers silently ignores an unknown `quant_method` and would
load the raw FP8 bytes as weights, so `register_bsgemm_moe()` runs on `import transformers_drama3`, before any
load. Without an FP8-capable GPU the fine-grained FP8 quantizer dequantises to the model's dtype while loading:
`W[i, j] = float(W8[i, j]) * weight_scale_inv[i // 128, j // 128]`, per expert, before the experts are fused.
"""

from __future__ import annotations

from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.utils.quantization_config import FineGrainedFP8Config

BSGEMM_MOE = "bsgemm-moe"
NOT_ROUTED_EXPERTS = r"(?!.*\.mlp\.experts$).+"

class BsgemmMoeConfig(FineGrainedFP8Config):
    """`quant_method: "bsgemm-moe"`: fine-grained FP8 (128 x 128 blocks) on the routed experts only."""

    def __init__(self, **kwargs):
        kwargs["quant_method"] = BSGEMM_MOE
        super().__init__(**kwargs)


class BsgemmMoeHfQuantizer(FineGrainedFP8HfQuantizer):
    """Loads `bsgemm-moe` checkpoints with transformers' fine-grained FP8 machinery (dequantising on CPU)."""

    def _process_model_before_weight_loading(self, model, **kwargs):
        # Everything outside the routed experts is bf16 in the checkpoint and must stay a plain module. transformers
        # matches skip names as prefixes or suffixes, so short names ("self_attn") protect nothing; one regex (its
        # patterns are matched with `re.match`) protects every module whose name does not end in `.mlp.experts`.
        # It is set for this call only, so a saved config keeps the user's own list.
        user_skip = self.quantization_config.modules_to_not_convert
        self.quantization_config.modules_to_not_convert = [NOT_ROUTED_EXPERTS] + list(user_skip or [])
        try:
            return super()._process_model_before_weight_loading(model, **kwargs)
        finally:
            self.quantization_config.modules_to_not_convert = user_skip


def register_bsgemm_moe() -> None:
    """Register `"bsgemm-moe"` with transformers' quantizer registry; safe to call more than once."""
    if BSGEMM_MOE not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(BSGEMM_MOE)(BsgemmMoeConfig)
    if BSGEMM_MOE not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(BSGEMM_MOE)(BsgemmMoeHfQuantizer)
