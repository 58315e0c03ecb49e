"""Tolerances of the self-consistency checks (cached vs full, batched vs single, streamed vs one-shot, ...).

Such a check computes the same function twice, in another order of operations (other blocking, other reduction
lengths, another kernel), so the two results differ by floating-point rounding only. The error model:

- A sum or dot product of n terms computed in floating point, in any order, is off by at most n * u * sum(|terms|)
  (to first order; Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1), with u the unit
  roundoff: 2**-24 for float32, 2**-53 for float64.
- Along a chain of operations (the layers of a network) the relative errors add to first order, so the output
  carries at most u * R * (its magnitude), R the sum of the reduction lengths on the path from input to output
  ("depth times accumulation length").
- The magnitude is the largest |value| of the compared tensor (the logit or audio scale). Each of the two results
  carries its own error, so they differ by at most twice the bound: atol = 2 * u * R * max|reference|.

The bound takes the worst case n * u, while rounding errors grow like sqrt(n) * u in practice (Higham and Mary,
SIAM J. Sci. Comput. 41(5), 2019): the factor sqrt(n) (16 for n = 256) it leaves covers cancellation (sum(|terms|)
above |result|) and the O(1) gains of the normalised layers between an error and the output. A wrong formula (a
leaked padded row, a wrong position, a skipped cache row) changes logits and audio by O(0.1-1) of their scale,
orders of magnitude above these bounds. Comparisons with the golden outputs use the tolerances of
`fixtures/README.md` instead.
"""

import math

import torch

from transformers_drama3.codec_blocks import (
    FishDACCausalConv1d,
    FishDACCausalConvTranspose1d,
    FishDACRMSNorm,
    FishDACWindowedAttention,
)
from transformers_drama3.modeling_codec import FishDACCodec


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: the largest relative error of rounding one real number to `dtype` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def reordering_tolerance(reference: torch.Tensor, reductions: int) -> dict:
    """`torch.testing.assert_close` arguments for a recomputation of `reference` in another order of operations:
    atol = 2 * u * reductions * max|reference| (module docstring), rtol 0."""
    scale = reference.detach().abs().max().item()
    return {"atol": 2 * unit_roundoff(reference.dtype) * reductions * scale, "rtol": 0.0}


def backbone_reductions(text_config, rows: int) -> int:
    """Reduction lengths on the path from the input embedding to the backbone's final norm, over `rows` rows.

    Per layer: two RMS norms (hidden each); full attention: the q/k/v projections (hidden), the scores (head_dim),
    the weighted sum over the rows, the output projection (heads * head_dim); linear attention: the in projections
    (hidden), the causal conv (kernel), the recurrent state, which sums over every earlier row and, in the chunked
    form, over a 64-row triangular solve, its read-out (key head_dim) and the output projection (value heads *
    value head_dim); the MoE block: router and expert input (hidden), expert output (the larger intermediate size)
    and the weighted sum of the top-k experts. Then the final norm (hidden).
    """
    c = text_config
    hidden = c.hidden_size
    mixer = {
        "full_attention": hidden + c.head_dim + rows + c.num_attention_heads * c.head_dim,
        "linear_attention": hidden + c.linear_conv_kernel_dim + rows + 64 + c.linear_key_head_dim
        + c.linear_num_value_heads * c.linear_value_head_dim,
    }
    mlp = hidden + max(c.moe_intermediate_size, c.shared_expert_intermediate_size) + c.num_experts_per_tok
    return sum(2 * hidden + mixer[kind] + mlp for kind in c.layer_types) + hidden


def main_logit_reductions(config, rows: int) -> int:
    """Backbone, then lm_head (hidden)."""
    return backbone_reductions(config.text_config, rows) + config.text_config.hidden_size


def tower_reductions(tower_config, rows: int) -> int:
    """Reduction lengths from the tower's input hidden state to its last head, over `rows` rows.

    Every shared and residual layer lies on that path. Per layer: the embedding and hidden norms (dim) and eh_proj
    (2 * dim); the block's attention norm (dim), wqkv (dim), scores (head_dim), weighted sum over the rows, wo
    (heads * head_dim); its feed-forward norm (dim), w1/w3 (dim), w2 (intermediate); the final norm (dim). Then
    the head (dim).
    """
    c = tower_config
    layer = 2 * c.dim + 2 * c.dim + c.dim + c.dim + c.head_dim + rows + c.n_head * c.head_dim
    layer += c.dim + c.dim + c.intermediate_size + c.dim
    return (c.shared_enrichment_layers + c.num_codebooks - 1) * layer + c.dim


def codebook_logit_reductions(config, rows: int) -> int:
    """Backbone, then the tower to its last head."""
    return backbone_reductions(config.text_config, rows) + tower_reductions(config.audio_decoder_config, rows)


def codec_decode_reductions(codec: FishDACCodec) -> int:
    """Reduction lengths from the codes to the audio: the sum of the codebook lookups, then every layer of the
    quantizer's post-transformer and upsampling stages and of the decoder, all on the path. A convolution sums
    in_channels / groups * kernel terms (a transposed one in_channels * ceil(kernel / stride)), a linear
    in_features, a norm its width, windowed attention head_dim then at most window rows."""
    total = len(codec.quantizer.codebooks)
    parts = (codec.quantizer.post_module, codec.quantizer.upsample, codec.decoder)
    for module in (module for part in parts for module in part.modules()):
        if isinstance(module, FishDACCausalConv1d):
            total += module.weight.shape[1] * module.weight.shape[2]
        elif isinstance(module, FishDACCausalConvTranspose1d):
            total += module.weight.shape[0] * math.ceil(module.weight.shape[2] / module.stride)
        elif isinstance(module, torch.nn.Linear):
            total += module.in_features
        elif isinstance(module, (FishDACRMSNorm, torch.nn.LayerNorm)):
            total += module.weight.shape[0]
        elif isinstance(module, FishDACWindowedAttention):
            total += module.head_dim + module.window
    return total
