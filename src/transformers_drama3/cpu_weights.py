"""Linears and routed experts with 16- or 8-bit weights over float32 activations: the weights of the CPU path
(cpu_path.py).

Two weight formats, each with torch's own CPU kernels (docs/performance.md, "The CPU path", has the measurements of
every candidate, `benchmarks/cpu_weight_formats.py`):

- `"float16"`: weights rounded to float16 (relative error at most 2^-11). A product of up to `FLOAT16_ROWS` rows (a
  decode step) casts its input to float16 and runs `F.linear`, which torch computes as one float16 matrix-vector
  product per row, accumulating in float32; a product of more rows (a prefill) casts the weight to float32 instead,
  since torch's float16 matrix product is row by row on CPUs without float16 arithmetic. Half the bytes of float32.
- `"int8"`: symmetric per-row int8, `W ~ q * s` with `s[r] = max|W[r, :]| / 127` (error at most `s[r] / 2` per
  weight), a quarter of the bytes. A `CpuLinear`'s product runs through fbgemm, torch's x86 int8 kernels
  (`int8_linear`, where this torch build has them: `PACKED_INT8`), on a packed copy of its weight and its input split
  in three 7-bit parts (below); elsewhere, and in the routed experts, it is torch's weight-only int8 kernel
  `torch.ops.aten._weight_int8pack_mm` (the one torchao's int8 weight-only layout calls on a CPU), bfloat16 in and
  out, float32 accumulation.

The int8 products of fbgemm multiply int8 weights by 8-bit inputs. Rounding the input to 8 bits would cost more than
the weights' rounding (and one outlier of a row would take its range), so `int8_linear` writes each row `x` as
`m / 63 * (p0 + p1 / 126 + p2 / 126^2)`, `m = max |x|`: `p0 = round(63 x / m)`, `p1` the rounded remainder times
126, `p2` the next one, whole numbers in [-63, 63]; it multiplies the three rows in one fbgemm call (whose time is the
weight's bytes, one row or three: 0.49 against 0.43 ms for one row of a `[8192, 2048]` weight on an AMD EPYC) and adds
the results. The input is rounded by at most `m / (2 * 63 * 126^2)`, `m / 2,000,376`, per value: with a value 300
times a row's others, the product's error against the rounded weights was 1.2e-5 of its largest output, against
4.3e-3 for bfloat16 inputs (`_weight_int8pack_mm`). The parts stay in 7 bits so that fbgemm's AVX2 kernel, which adds
pairs of 8-bit products in 16 bits, cannot saturate (`2 * 127 * 127 < 2^15`).

`CpuLinear` replaces an `nn.Linear`; `CpuExperts` replaces the backbone's routed experts (fused `[E, out, in]`
tensors, or the FP8 experts kept as shipped, dequantised once here) and runs through transformers' experts interface,
as the other quantised experts do (quantized_experts.py). `CpuEmbedding` keeps an embedding table in bfloat16 when
every value of it is a bfloat16 value (a bfloat16 checkpoint's tables: the rows it looks up, widened back, are the
float32 ones exactly), at half the bytes.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from transformers.activations import ACT2FN
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
# fbgemm's int8 product with an input quantised by a given scale and a float32 output: x86 builds of torch (its
# quantised tensors, which torch deprecates; a torch without them takes `_weight_int8pack_mm`).
PACKED_INT8 = "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
    torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")
# `int8_linear`'s input parts: PARTS rows of whole numbers in [-LEVELS, LEVELS] (module docstring).
LEVELS = 63
PARTS = 3
# Quantised experts are dequantised this many at a time when converted (`CpuExperts.from_experts`): 16 of the real
# model's experts are 200 MiB in float32, against 3.2 GB for a layer's 256.
DEQUANTISED_EXPERTS = 16


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype = INT8_ACTIVATIONS) -> tuple[torch.Tensor, ...]:
    """Symmetric per-row int8 of `weight [..., out, in]`: `(q int8 [..., out, in], s [..., out])` in `scale_dtype`,
    `weight ~ q * s[..., None]`; an all-zero row gets scale 1 (its codes are 0)."""
    wide = weight.detach().float()
    scale = wide.abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(wide / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale.to(scale_dtype)


def stored(weight: torch.Tensor, weight_format: str, scale_dtype: torch.dtype = INT8_ACTIVATIONS
           ) -> tuple[torch.Tensor, ...]:
    """The tensors `weight [..., out, in]` is kept as in `weight_format`: `(float16,)` or `(int8 codes, scales)`,
    the scales in `scale_dtype`."""
    if weight_format == "float16":
        return (weight.detach().to(torch.float16),)
    return quantize_rows(weight, scale_dtype)


def product(x: torch.Tensor, weight: tuple[torch.Tensor, ...], packed: bool = False) -> torch.Tensor:
    """`x [..., in]` times the stored weight (`stored`) of one matrix `[out, in]` -> `[..., out]` in `x`'s dtype;
    `packed`: an int8 weight is multiplied by `int8_linear` (its scales in float32)."""
    if len(weight) == 1:
        if x.numel() <= FLOAT16_ROWS * x.shape[-1]:
            return F.linear(x.to(torch.float16), weight[0]).to(x.dtype)
        return F.linear(x, weight[0].to(x.dtype))
    codes, scale = weight
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    if packed:
        out = int8_linear(flat.float(), codes, scale)
    else:
        out = torch.ops.aten._weight_int8pack_mm(flat.to(INT8_ACTIVATIONS), codes, scale.to(INT8_ACTIVATIONS))
    return out.view(*x.shape[:-1], codes.shape[0]).to(x.dtype)


# fbgemm's packed copies of int8 weights, by the weight's memory: (the codes' and scales' storages, the packed copy).
# An entry counts while both storages live, so a freed weight's address reused by another is never taken for it.
_PACKED: dict[tuple, tuple[StorageWeakRef, StorageWeakRef, object]] = {}
_PACKING = threading.Lock()  # one packing at a time (the engine's threads may meet a new weight together)


@contextlib.contextmanager
def _fbgemm_engine():
    """torch's quantised engine set to fbgemm (whose packed weights `int8_linear`'s product takes) for a block."""
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        yield
    finally:
        torch.backends.quantized.engine = engine


def _kept(key: tuple):
    """The packed copy `_PACKED` holds for `key`, if both its storages still live; else None."""
    entry = _PACKED.get(key)
    return entry[2] if entry is not None and not (entry[0].expired() or entry[1].expired()) else None


def packed_weight(codes: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed copy of int8 `codes [out, in]` with float32 row scales `scale [out]`, made once per weight
    (the first call packs it: ~90 ms for 16 M weights) and kept while the weight lives."""
    key = (codes.data_ptr(), tuple(codes.shape), codes.stride(), scale.data_ptr())
    if (packed := _kept(key)) is not None:
        return packed
    with _PACKING:
        if (packed := _kept(key)) is not None:
            return packed
        for stale in [k for k in _PACKED if _kept(k) is None]:
            del _PACKED[stale]
        scales = scale.double()
        with warnings.catch_warnings(), _fbgemm_engine():
            # torch deprecates its quantised tensors (PACKED_INT8); this one only carries the codes into fbgemm.
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
            quantised = torch.quantize_per_channel(codes.float() * scale.float()[:, None], scales,
                                                   torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(quantised, None)
        _PACKED[key] = (StorageWeakRef(codes.untyped_storage()), StorageWeakRef(scale.untyped_storage()), packed)
    return packed


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [rows, in]` (float32) times int8 `codes [out, in]` with float32 row scales `scale [out]` -> `[rows, out]`
    float32, through fbgemm with the input split in `PARTS` 7-bit parts (module docstring). The split and the sum are
    tensor operations a compiled step fuses; the product is one operator (`fbgemm_int8_product`)."""
    size = x.abs().amax(-1, keepdim=True)  # [rows, 1]
    size = torch.where(size > 0, size, torch.ones_like(size))
    rest = x * (LEVELS / size)  # [rows, in], in [-LEVELS, LEVELS]
    parts = []
    for _ in range(PARTS - 1):
        parts.append(rest.round())
        rest = (rest - parts[-1]) * (2 * LEVELS)  # the remainder, in [-LEVELS, LEVELS]
    parts.append(rest)  # fbgemm rounds the last part
    products = torch.ops.transformers_drama3.fbgemm_int8_product(torch.cat(parts), codes, scale).unflatten(
        0, (PARTS, -1))  # [PARTS, rows, out]
    out = products[-1]
    for part in reversed(range(PARTS - 1)):
        out = products[part] + out / (2 * LEVELS)
    return out * (size / LEVELS)  # [rows, out]


def fbgemm_int8_product(parts: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`parts [n, in]` (float32 whole numbers in [-LEVELS, LEVELS]) times int8 `codes [out, in]` with float32 row scales
    `scale [out]` -> `[n, out]` float32, exactly up to the float32 scaling, by fbgemm on the weight's packed copy
    (`packed_weight`)."""
    # Input scale 1 and zero point LEVELS + 1: fbgemm's 8-bit values are the parts plus 64, in [1, 127].
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(parts, 1.0, LEVELS + 1,
                                                                             packed_weight(codes, scale))


# `fbgemm_int8_product` as one operator of the package's library, which a compiled step calls as it is (it cannot
# trace fbgemm's packed weight). Defined with `torch.library.Library` rather than `torch.library.custom_op`: the
# latter's per-call checks took 15 us against 5 (a trivial body), and a frame of the real width makes ~100 calls.
_LIBRARY = torch.library.Library("transformers_drama3", "FRAGMENT")
_LIBRARY.define("fbgemm_int8_product(Tensor parts, Tensor codes, Tensor scale) -> Tensor")
_LIBRARY.impl("fbgemm_int8_product", fbgemm_int8_product, "CPU")


@torch.library.register_fake("transformers_drama3::fbgemm_int8_product", lib=_LIBRARY)
def _(parts, codes, scale):
    return parts.new_empty(parts.shape[0], codes.shape[0])


def can_convert(linear: nn.Module, weight_format: str) -> bool:
    """Whether `linear` is a plain float `nn.Linear` that `weight_format` can hold (module docstring). A linear on the
    meta device converts to one on the meta device (stored_steps.py builds the CPU path's structure so)."""
    if type(linear) is not nn.Linear or not linear.weight.is_floating_point():
        return False
    return weight_format == "float16" or linear.in_features % INT8_COLUMN_MULTIPLE == 0


class CpuLinear(nn.Module):
    """`nn.Linear` with its weight in a `WEIGHT_FORMATS` format: `weight [out, in]` (float16, or int8 with
    `scale [out]`) and the float `bias [out]` if any. Frozen: the CPU path is for inference.

    int8 weights are multiplied through fbgemm (`int8_linear`) where torch has it (`PACKED_INT8`), their scales then
    kept in float32, and packed when the linear is made (not on the meta device): `packed` says which ran.

    `widened` (float16 only): every product widens the weight to the input's dtype first, whatever the rows, so the
    result is the float32 linear's with float16-rounded weights (`product` rounds the input of a few rows to float16
    too). The codec's linears take it: its streamed audio then still equals a one-shot decode's to float32 rounding."""

    def __init__(self, linear: nn.Linear, weight_format: str, widened: bool = False):
        super().__init__()
        if widened and weight_format != "float16":
            raise ValueError(f"only float16 weights can be widened, not {weight_format}")
        self.in_features, self.out_features, self.weight_format = linear.in_features, linear.out_features, weight_format
        self.widened, self.packed = widened, weight_format == "int8" and PACKED_INT8
        tensors = stored(linear.weight, weight_format, torch.float32 if self.packed else INT8_ACTIVATIONS)
        self.weight = nn.Parameter(tensors[0], requires_grad=False)
        self.scale = nn.Parameter(tensors[1], requires_grad=False) if len(tensors) > 1 else None
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        if self.packed and not self.weight.is_meta:
            packed_weight(self.weight, self.scale)  # at the load, not in the first product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.widened:
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        out = product(x, (self.weight,) if self.scale is None else (self.weight, self.scale), self.packed)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        widened = ", widened to the input's dtype" if self.widened else ""
        packed = ", fbgemm products" if self.packed else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.weight_format} "
                f"weights{widened}{packed}")


def exact_in_bfloat16(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is a bfloat16 value (then `CpuEmbedding` keeps it exactly in 16 bits)."""
    if weight.dtype == torch.bfloat16:
        return True
    # A few rows at a time: the real vocabulary's table is 2 GB in float32, and a whole copy in each dtype would add
    # 3 GB to a load's peak.
    return all(torch.equal(rows.to(torch.bfloat16).to(rows.dtype), rows) for rows in weight.detach().split(4096))


class CpuEmbedding(nn.Module):
    """`nn.Embedding` with its table `weight [num, dim]` kept in bfloat16 (`exact_in_bfloat16` tables only), a copy of
    its own (never a view of a checkpoint's memory map); the rows it looks up come out in `output_dtype` (None: the
    table's former dtype). Frozen: the CPU path is for inference."""

    def __init__(self, embedding: nn.Embedding, output_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.output_dtype = embedding.padding_idx, output_dtype or embedding.weight.dtype
        self.weight = nn.Parameter(embedding.weight.detach().to(torch.bfloat16, copy=True), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx).to(self.output_dtype)  # [..., dim]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bfloat16 table, {self.output_dtype} rows"


@torch.library.custom_op("transformers_drama3::routed_experts", mutates_args=())
def routed_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up_proj: torch.Tensor, gate_up_proj_scale: torch.Tensor | None, down_proj: torch.Tensor,
                   down_proj_scale: torch.Tensor | None, activation: str) -> torch.Tensor:
    """Routed-experts output `[tokens, H]` of `hidden_states [tokens, H]` routed by `top_k_index` / `top_k_weights`
    `[tokens, top_k]`, with `CpuExperts`' stored matrices (`*_scale` None for float16) and gate activation
    (`ACT2FN` name). Pairs routed to another rank's experts (ids >= E) count 0.

    It multiplies the stored matrices themselves (no dequantised copy of a layer): with fewer (token, expert) pairs
    than experts (a decode step) each pair multiplies views of its expert's matrices; with more (a prefill) each
    expert used multiplies the rows of all its tokens at once. Both read the routing on the host, which a compiled
    step cannot: it calls this as one operator, since traced it would copy each pair's matrices out first (measured
    at the real width, one layer's 8 experts: 12-20 ms a step against 4 ms eagerly, 1 thread)."""
    num_experts, tokens, top_k = gate_up_proj.shape[0], *top_k_index.shape
    weights = top_k_weights.masked_fill(top_k_index >= num_experts, 0.0).reshape(-1)  # [tokens * top_k]
    ids = top_k_index.clamp(0, num_experts - 1).reshape(-1)  # [tokens * top_k]
    act_fn = ACT2FN[activation]

    def pair_output(x: torch.Tensor, expert: int) -> torch.Tensor:  # [n, H] -> [n, H], one expert's gated MLP
        # transformers' default experts gate: the first half of the gate_up rows through the activation, times the rest
        gate, up = product(x, _expert_matrix(gate_up_proj, gate_up_proj_scale, expert)).chunk(2, dim=-1)  # [n, I]
        return product(act_fn(gate) * up, _expert_matrix(down_proj, down_proj_scale, expert))

    if tokens * top_k < num_experts:
        outputs = torch.cat([pair_output(hidden_states[pair // top_k, None], expert)
                             for pair, expert in enumerate(ids.tolist())])  # [tokens * top_k, H]
        return (outputs * weights[:, None].to(outputs.dtype)).view(tokens, top_k, -1).sum(1)  # [tokens, H]
    out = hidden_states.new_zeros(tokens, hidden_states.shape[-1])  # [tokens, H]
    for expert in ids.unique().tolist():
        pairs = (ids == expert).nonzero()[:, 0]  # [n] the pairs routed to this expert
        rows = pairs // top_k
        chosen = pair_output(hidden_states.index_select(0, rows), expert)  # [n, H]
        out.index_add_(0, rows, chosen * weights.index_select(0, pairs).to(chosen.dtype)[:, None])
    return out


@routed_experts.register_fake
def _(hidden_states, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_scale, down_proj, down_proj_scale,
      activation):
    return torch.empty_like(hidden_states)


def _expert_matrix(weight: torch.Tensor, scale: torch.Tensor | None, expert: int) -> tuple[torch.Tensor, ...]:
    """The stored matrix `[out, in]` of one expert, as views of `weight [E, out, in]` (and `scale [E, out]`)."""
    return (weight[expert],) if scale is None else (weight[expert], scale[expert])


def cpu_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """`CpuExperts`' forward: `routed_experts` with its matrices -> `[tokens, H]`."""
    return routed_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.gate_up_proj_scale,
                          self.down_proj, self.down_proj_scale, self.activation)


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
        self.weight_format, self.activation = weight_format, config.hidden_act
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

    def dequantized(self, name, expert_ids, dtype):
        weight, scale = getattr(self, name), getattr(self, f"{name}_scale")
        if expert_ids is not None:
            weight = weight[expert_ids]
            scale = None if scale is None else scale[expert_ids]
        weight = weight.to(dtype)
        return weight if scale is None else weight * scale.to(dtype)[..., None]


__all__ = ["CpuEmbedding", "CpuExperts", "CpuLinear", "PACKED_INT8", "WEIGHT_FORMATS", "can_convert",
           "exact_in_bfloat16", "fbgemm_int8_product", "int8_linear", "packed_weight", "product", "quantize_rows",
           "stored"]
