"""Linears and routed experts with 16- or 8-bit weights over float32 activations: the weights of the CPU path
(cpu_path.py).

Two weight formats, each with torch's own CPU kernels (docs/performance.md, "The CPU path", has the measurements of
every candidate, `benchmarks/cpu_weight_formats.py`):

- `"float16"`: weights rounded to float16 (relative error at most 2^-11). A product of up to `FLOAT16_ROWS` rows (a
  decode step) casts its input to float16 and runs `F.linear`, which torch computes as one float16 matrix-vector
  product per row, accumulating in float32; a product of more rows (a prefill) casts the weight to float32 instead,
  since torch's float16 matrix product is row by row on CPUs without float16 arithmetic. Half the bytes of float32.
- `"int8"`: symmetric per-row int8, `W ~ q * s` with `s[r] = max|W[r, :]| / 127` (error at most `s[r] / 2` per
  weight); the product is torch's weight-only int8 kernel `torch.ops.aten._weight_int8pack_mm` (the one torchao's
  int8 weight-only layout calls on a CPU), bfloat16 in and out, float32 accumulation. A quarter of the bytes.

`CpuLinear` replaces an `nn.Linear`; `CpuExperts` replaces the backbone's routed experts (fused `[E, out, in]`
tensors, or the FP8 experts kept as shipped, dequantised once here) and runs through transformers' experts interface,
as the other quantised experts do (quantized_experts.py). `CpuEmbedding` keeps an embedding table in bfloat16 when
every value of it is a bfloat16 value (a bfloat16 checkpoint's tables: the rows it looks up, widened back, are the
float32 ones exactly), at half the bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ExpertsInterface, use_experts_implementation

from .quantized_experts import PROJECTIONS, QuantizedExperts

WEIGHT_FORMATS = ("float16", "int8")
# `_weight_int8pack_mm` reads its inputs 8 columns at a time: a reduction size that is not a multiple of 8 gives wrong
# products (measured: garbage for 4 columns, a crash for 5), so such int8 linears keep their float weights.
INT8_COLUMN_MULTIPLE = 8
# The int8 kernel's fast paths take bfloat16 activations (float32 ones ran ~8x slower on an AVX2 CPU).
INT8_ACTIVATIONS = torch.bfloat16
# The most rows a float16 product multiplies in float16. torch multiplies float16 one row at a time (a fast
# matrix-vector kernel); casting the weight to float32 instead costs about two rows' time and then grows slowly with
# the rows: on an AMD EPYC (Zen 4; AVX512-BF16, no float16 arithmetic) a [4096, 512] weight took 0.29 / 0.50 / 0.96 /
# 0.95 ms for 1 / 2 / 3 / 4 rows in float16 against 0.50 / 0.75 / ~1.4 / 0.78 ms cast to float32, and 14.0 against
# 4.8 ms for a 61-row prefill (1 thread; benchmarks/cpu_weight_formats.py --rows 1,2,3,4,61).
FLOAT16_ROWS = 3
# Quantised experts are dequantised this many at a time when converted (`CpuExperts.from_experts`): 16 of the real
# model's experts are 200 MiB in float32, against 3.2 GB for a layer's 256.
DEQUANTISED_EXPERTS = 16


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of `weight [..., out, in]`: `(q int8 [..., out, in], s [..., out])` in
    `INT8_ACTIVATIONS`, `weight ~ q * s[..., None]`; an all-zero row gets scale 1 (its codes are 0)."""
    wide = weight.detach().float()
    scale = wide.abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(wide / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale.to(INT8_ACTIVATIONS)


def stored(weight: torch.Tensor, weight_format: str) -> tuple[torch.Tensor, ...]:
    """The tensors `weight [..., out, in]` is kept as in `weight_format`: `(float16,)` or `(int8 codes, scales)`."""
    if weight_format == "float16":
        return (weight.detach().to(torch.float16),)
    return quantize_rows(weight)


def product(x: torch.Tensor, weight: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`x [..., in]` times the stored weight (`stored`) of one matrix `[out, in]` -> `[..., out]` in `x`'s dtype."""
    if len(weight) == 1:
        if x.numel() <= FLOAT16_ROWS * x.shape[-1]:
            return F.linear(x.to(torch.float16), weight[0]).to(x.dtype)
        return F.linear(x, weight[0].to(x.dtype))
    codes, scale = weight
    flat = x.reshape(-1, x.shape[-1]).to(INT8_ACTIVATIONS)
    return torch.ops.aten._weight_int8pack_mm(flat, codes, scale).view(*x.shape[:-1], codes.shape[0]).to(x.dtype)


def can_convert(linear: nn.Module, weight_format: str) -> bool:
    """Whether `linear` is a plain float `nn.Linear` that `weight_format` can hold (module docstring). A linear on the
    meta device converts to one on the meta device (stored_steps.py builds the CPU path's structure so)."""
    if type(linear) is not nn.Linear or not linear.weight.is_floating_point():
        return False
    return weight_format == "float16" or linear.in_features % INT8_COLUMN_MULTIPLE == 0


class CpuLinear(nn.Module):
    """`nn.Linear` with its weight in a `WEIGHT_FORMATS` format: `weight [out, in]` (float16, or int8 with
    `scale [out]`) and the float `bias [out]` if any. Frozen: the CPU path is for inference."""

    def __init__(self, linear: nn.Linear, weight_format: str):
        super().__init__()
        self.in_features, self.out_features, self.weight_format = linear.in_features, linear.out_features, weight_format
        tensors = stored(linear.weight, weight_format)
        self.weight = nn.Parameter(tensors[0], requires_grad=False)
        self.scale = nn.Parameter(tensors[1], requires_grad=False) if len(tensors) > 1 else None
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = product(x, (self.weight,) if self.scale is None else (self.weight, self.scale))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.weight_format} weights"


def exact_in_bfloat16(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is a bfloat16 value (then `CpuEmbedding` keeps it exactly in 16 bits)."""
    if weight.dtype == torch.bfloat16:
        return True
    # A few rows at a time: the real vocabulary's table is 2 GB in float32, and a whole copy in each dtype would add
    # 3 GB to a load's peak.
    return all(torch.equal(rows.to(torch.bfloat16).to(rows.dtype), rows) for rows in weight.detach().split(4096))


class CpuEmbedding(nn.Module):
    """`nn.Embedding` with its table `weight [num, dim]` kept in bfloat16 (`exact_in_bfloat16` tables only); the rows
    it looks up come out in the table's former dtype (`output_dtype`). Frozen: the CPU path is for inference."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.output_dtype = embedding.padding_idx, embedding.weight.dtype
        self.weight = nn.Parameter(embedding.weight.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx).to(self.output_dtype)  # [..., dim]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bfloat16 table, {self.output_dtype} rows"


def cpu_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """Routed-experts output `[tokens, H]` of `hidden_states [tokens, H]` routed by `top_k_index` / `top_k_weights`
    `[tokens, top_k]`, multiplying the stored matrices themselves (no dequantised copy of a layer). Pairs routed to
    another rank's experts (ids >= `num_experts`) count 0.

    Eagerly the routing is read to the host (free on a CPU): with fewer (token, expert) pairs than experts (a decode
    step) each pair multiplies views of its expert's matrices; with more (a prefill) each expert used multiplies the
    rows of all its tokens at once. Under `torch.compile` (no host reads) each pair's matrices are gathered."""
    tokens, top_k = top_k_index.shape
    weights = top_k_weights.masked_fill(top_k_index >= self.num_experts, 0.0)  # [tokens, top_k]
    ids = top_k_index.clamp(0, self.num_experts - 1)  # [tokens, top_k]
    if torch.compiler.is_compiling() or tokens * top_k < self.num_experts:
        gathered = torch.compiler.is_compiling()
        experts = ids.reshape(-1) if gathered else ids.reshape(-1).tolist()
        rows = []
        for token in range(tokens):
            total = 0
            for k in range(top_k):
                expert = experts[token * top_k + k : token * top_k + k + 1] if gathered else experts[token * top_k + k]
                total = total + self.pair_output(hidden_states[token : token + 1], expert) * weights[token, k]
            rows.append(total)
        return torch.cat(rows)  # [tokens, H]
    out = hidden_states.new_zeros(tokens, hidden_states.shape[-1])  # [tokens, H]
    flat_weights = weights.reshape(-1)
    for expert in ids.unique().tolist():
        pairs = (ids.reshape(-1) == expert).nonzero()[:, 0]  # [n] the pairs routed to this expert
        rows = pairs // top_k
        chosen = self.pair_output(hidden_states.index_select(0, rows), expert)  # [n, H]
        out.index_add_(0, rows, chosen * flat_weights.index_select(0, pairs).to(chosen.dtype)[:, None])
    return out


class CpuExpertsInterface(ExpertsInterface):
    """Every experts implementation name runs `cpu_experts_forward` on `CpuExperts`."""

    _global_mapping = {name: cpu_experts_forward for name in ("eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe")}


@use_experts_implementation(experts_interface=CpuExpertsInterface())
class CpuExperts(QuantizedExperts):
    """Routed experts with `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` in a `WEIGHT_FORMATS` format (int8 with
    per-row `*_scale [E, out]`)."""

    forward = cpu_experts_forward  # also without an experts implementation set (a module used on its own)

    def __init__(self, config, tensors: dict[str, tuple[torch.Tensor, ...]], weight_format: str):
        """`tensors`: per projection, what `stored` keeps of its `[E, out, in]` weights in `weight_format`."""
        super().__init__(config)
        self.weight_format = weight_format
        for name in PROJECTIONS:
            kept = tensors[name]
            setattr(self, name, nn.Parameter(kept[0], requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(kept[1], requires_grad=False) if len(kept) > 1 else None)

    @classmethod
    def from_experts(cls, experts: nn.Module, config, weight_format: str) -> CpuExperts:
        """From float experts (`Qwen3_5MoeExperts`) or quantised ones (`QuantizedExperts.dequantized`, in float32,
        `DEQUANTISED_EXPERTS` experts at a time: a whole layer's float32 copy would add 3.2 GB to the load's peak at
        the real width, as much as the layer's float16 weights twice)."""
        if not isinstance(experts, QuantizedExperts):
            return cls(config, {name: stored(getattr(experts, name), weight_format) for name in PROJECTIONS},
                       weight_format)
        tensors = {}
        for name in PROJECTIONS:
            kept = None
            for ids in torch.arange(experts.num_experts).split(DEQUANTISED_EXPERTS):
                part = stored(experts.dequantized(name, ids, torch.float32), weight_format)  # rows stored one by one
                if kept is None:
                    kept = tuple(piece.new_empty((experts.num_experts, *piece.shape[1:])) for piece in part)
                for whole, piece in zip(kept, part):
                    whole[int(ids[0]) : int(ids[-1]) + 1] = piece
            tensors[name] = kept
        return cls(config, tensors, weight_format)

    def matrix(self, name: str, expert) -> tuple[torch.Tensor, ...]:
        """The stored matrix `[out, in]` of `name` for one expert: an int (a view) or a one-id tensor (a gather)."""
        tensors = (getattr(self, name), getattr(self, f"{name}_scale"))
        if isinstance(expert, int):
            return tuple(t[expert] for t in tensors if t is not None)
        return tuple(t.index_select(0, expert)[0] for t in tensors if t is not None)

    def pair_output(self, x: torch.Tensor, expert) -> torch.Tensor:
        """One expert's output `[n, H]` for its inputs `x [n, H]` (the gated MLP of `gate_up_proj` and `down_proj`)."""
        gate_up = product(x, self.matrix("gate_up_proj", expert))  # [n, 2I]
        return product(self._apply_gate(gate_up), self.matrix("down_proj", expert))

    def dequantized(self, name, expert_ids, dtype):
        weight, scale = getattr(self, name), getattr(self, f"{name}_scale")
        if expert_ids is not None:
            weight = weight[expert_ids]
            scale = None if scale is None else scale[expert_ids]
        weight = weight.to(dtype)
        return weight if scale is None else weight * scale.to(dtype)[..., None]


__all__ = ["CpuEmbedding", "CpuExperts", "CpuLinear", "WEIGHT_FORMATS", "can_convert", "exact_in_bfloat16", "product",
           "quantize_rows", "stored"]
