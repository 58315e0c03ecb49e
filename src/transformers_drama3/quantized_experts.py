"""Routed experts kept quantised in memory, run by dequantising only the experts the router picked.

The backbone stays transformers' `Qwen3_5MoeTextModel`; only its `mlp.experts` modules are swapped at load time
(`quantization_bsgemm`) for one of:

- `Fp8SelectedExperts`: the checkpoint's FP8 as shipped (`float8_e4m3fn [E, out, in]` plus float32
  `*_scale_inv [E, out/128, in/128]`, docs/format.md#fp8-experts), 1 byte per weight, on any device, without the
  `kernels` package.
- `Bnb4bitSelectedExperts`: bitsandbytes 4-bit (nf4 / fp4, with or without double quantisation): each fused expert
  tensor is one bitsandbytes `Params4bit`, quantised by `bitsandbytes.functional.quantize_4bit` while loading and
  read back by `dequantize_4bit` (0.5 byte per weight plus its block statistics).

Both run through transformers' experts interface (`use_experts_implementation` with `SELECTED_EXPERTS`, an
`ExpertsInterface` like transformers' own FP8 one): every experts implementation name (`eager`, `batched_mm`,
`grouped_mm`, ...) runs `selected_experts_forward`, so a step captured with `batched_mm` experts runs it too.
Per call it gathers the quantised bytes and scales of the `tokens x top_k` selected (token, expert) pairs,
dequantises just those to the activations' dtype and multiplies them (`torch.bmm`, as transformers' `batched_mm`
does): static shapes, no host reads, so it runs eagerly, under `torch.compile(fullgraph=True)` and in a CUDA
graph. When there are at least as many pairs as experts (a prefill), dequantising every expert of the layer once
is less work than one copy per pair: the layer's experts are then dequantised whole and run through transformers'
`grouped_mm` forward.
"""

from __future__ import annotations

import math
import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward, use_experts_implementation

FP8_BLOCK = 128
# bitsandbytes' 4-bit kernels read and write these dtypes; a float64 model dequantises in float32 and casts.
BNB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch's grouped GEMM (transformers' `grouped_mm` forward) takes these; a float64 model always takes the selected path.
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# bitsandbytes' double quantisation quantises the 4-bit block scales again, in blocks of 256 (`quantize_4bit`).
BNB_NESTED_BLOCK = 256
PROJECTIONS = ("gate_up_proj", "down_proj")


def selected_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """Routed-experts output `[tokens, H]` of `hidden_states [tokens, H]`, routed by `top_k_index` and
    `top_k_weights [tokens, top_k]`, dequantising only what is used (module docstring).

    Under expert parallelism transformers marks the pairs routed to another rank's experts with ids >=
    `num_experts` (and zero weights): they are clamped to a local expert and their output is dropped (a no-op
    otherwise, done always: transformers versions differ in how they flag expert parallelism).
    """
    tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)  # [S], S = tokens * top_k
    pair_weights = top_k_weights.reshape(-1).masked_fill(expert_ids >= self.num_experts, 0.0)  # [S]
    expert_ids = expert_ids.clamp(0, self.num_experts - 1)
    dtype = hidden_states.dtype
    many_pairs = expert_ids.numel() >= self.num_experts * self.pairs_per_expert_before_dequantising_all
    if many_pairs and dtype in GROUPED_MM_DTYPES:
        return grouped_mm_experts_forward(DequantizedLayer(self, dtype), hidden_states, expert_ids.view(tokens, top_k),
                                          pair_weights.view(tokens, top_k))
    pair_inputs = hidden_states.repeat_interleave(top_k, dim=0)  # [S, H]
    # transformers' batched_mm gathers `gate_up_proj[expert_ids]` from full-precision weights; here the gathered
    # weights are dequantised from the quantised bytes first, so the two bmm calls are written out.
    gate_up = self.dequantized("gate_up_proj", expert_ids, dtype)  # [S, 2I, H]
    projected = self._apply_gate(torch.bmm(gate_up, pair_inputs.unsqueeze(-1)).squeeze(-1))  # [S, I]
    down = self.dequantized("down_proj", expert_ids, dtype)  # [S, H, I]
    pair_outputs = torch.bmm(down, projected.unsqueeze(-1)).squeeze(-1)  # [S, H]
    weighted = pair_outputs * pair_weights.to(pair_outputs.dtype).unsqueeze(-1)
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(dtype)  # [tokens, H]


class DequantizedLayer:
    """A layer's experts dequantised whole, with the attributes transformers' experts forwards read."""

    has_gate, has_bias, is_transposed, has_post_expert_norm, _is_expert_parallel = True, False, False, False, False

    def __init__(self, experts: "QuantizedExperts", dtype: torch.dtype):
        self.gate_up_proj = experts.dequantized("gate_up_proj", None, dtype)  # [E, 2I, H]
        self.down_proj = experts.dequantized("down_proj", None, dtype)  # [E, H, I]
        self.num_experts = experts.num_experts
        self._apply_gate = experts._apply_gate


class SelectedExpertsInterface(ExpertsInterface):
    """Every experts implementation name runs `selected_experts_forward` on quantised experts (transformers' FP8
    experts get their own interface the same way)."""

    _global_mapping = {name: selected_experts_forward for name in ("eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe")}


SELECTED_EXPERTS = SelectedExpertsInterface()


@use_experts_implementation(experts_interface=SELECTED_EXPERTS)
class QuantizedExperts(nn.Module):
    """Base of the quantised routed experts: the backbone experts' geometry and gate; subclasses hold the weights
    and say how to dequantise the experts `expert_ids` (`dequantized`)."""

    # The selected path runs while there are fewer than `num_experts * this` (token, expert) pairs (module
    # docstring); a class attribute so that a test can make the tiny geometry's batches take it too.
    pairs_per_expert_before_dequantising_all = 1

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.act_fn = ACT2FN[config.hidden_act]

    def shape(self, name: str) -> tuple[int, int, int]:
        """`[E, out, in]` of the full-precision `gate_up_proj` or `down_proj`."""
        if name == "gate_up_proj":
            return self.num_experts, 2 * self.intermediate_dim, self.hidden_dim
        return self.num_experts, self.hidden_dim, self.intermediate_dim

    def dequantized(self, name: str, expert_ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """`[len(expert_ids) or E, out, in]` weights of `name` for the experts `expert_ids` (all when None)."""
        raise NotImplementedError


class Fp8SelectedExperts(QuantizedExperts):
    """The checkpoint's FP8 experts as shipped: `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` in
    `float8_e4m3fn`, with float32 `*_scale_inv` per 128 x 128 block (gate and up rows have their own blocks)."""

    def __init__(self, config):
        super().__init__(config)
        for name in PROJECTIONS:
            experts, rows, cols = self.shape(name)
            halves = 2 if name == "gate_up_proj" else 1
            scale_rows = halves * math.ceil(rows // halves / FP8_BLOCK)
            setattr(self, name, nn.Parameter(torch.empty(experts, rows, cols, dtype=torch.float8_e4m3fn),
                                             requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(
                torch.empty(experts, scale_rows, math.ceil(cols / FP8_BLOCK), dtype=torch.float32), requires_grad=False))

    def dequantized(self, name, expert_ids, dtype):
        weight, scale = getattr(self, name), getattr(self, f"{name}_scale_inv")
        if expert_ids is not None:
            weight, scale = weight[expert_ids], scale[expert_ids]  # [S, out, in] FP8, [S, out/128, in/128]
        halves = 2 if name == "gate_up_proj" else 1  # gate and up rows are blocked separately
        count, rows, cols = weight.shape
        return dequantize_fp8_blocks(weight.reshape(count * halves, rows // halves, cols),
                                     scale.reshape(count * halves, -1, scale.shape[-1]), dtype).view(count, rows, cols)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight [N, R, C]` FP8 times `scale_inv [N, R/bR, C/bC]` per block, in float32, as `dtype` (the arithmetic
    of transformers' dequantisation at load, so a float32 product is the same number either way)."""
    count, rows, cols = weight.shape
    scale_rows, scale_cols = scale_inv.shape[-2:]
    if rows % scale_rows or cols % scale_cols:
        raise ValueError(f"FP8 weight [{rows}, {cols}] is not divisible into the {scale_rows} x {scale_cols} scale grid")
    blocks = weight.to(torch.float32).view(count, scale_rows, rows // scale_rows, scale_cols, cols // scale_cols)
    return (blocks * scale_inv[:, :, None, :, None]).view(count, rows, cols).to(dtype)


class Bnb4bitSelectedExperts(QuantizedExperts):
    """bitsandbytes 4-bit experts: `gate_up_proj` and `down_proj` are each one `Params4bit` holding the fused
    `[E, out, in]` tensor (quantised while loading, like a `Linear4bit` weight); every expert fills whole
    quantisation blocks (`check_4bit_expert_blocks`), so one expert's bytes and block scales are a slice."""

    source_cls = nn.Module  # read by transformers' bitsandbytes quantize op (it transposes `Conv1D` weights only)
    BLOCKSIZE = 64  # bitsandbytes' default, what transformers' `Linear4bit` weights get too

    def __init__(self, config, quant_type: str = "fp4", compress_statistics: bool = True,
                 quant_storage: torch.dtype = torch.uint8, blocksize: int = BLOCKSIZE):
        import bitsandbytes as bnb  # the [quant] extra: only 4-bit experts need it
        super().__init__(config)
        for name in PROJECTIONS:
            setattr(self, name, bnb.nn.Params4bit(
                torch.empty(self.shape(name)), requires_grad=False, blocksize=blocksize,
                compress_statistics=compress_statistics, quant_type=quant_type, quant_storage=quant_storage))

    def quantized_parameter(self, name: str, weight: torch.Tensor) -> torch.nn.Parameter:
        """`weight [E, out, in]` (full precision, as the loader made it) quantised with this module's settings for
        `name` (`quantize_experts_4bit`)."""
        import bitsandbytes as bnb  # the [quant] extra: only 4-bit experts need it

        settings = getattr(self, name)
        packed, state = quantize_experts_4bit(weight, settings.quant_type, settings.compress_statistics,
                                              settings.quant_storage, settings.blocksize)
        return bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=settings.blocksize,
                                 compress_statistics=settings.compress_statistics, quant_type=settings.quant_type,
                                 quant_storage=settings.quant_storage, bnb_quantized=True)

    def dequantized(self, name, expert_ids, dtype):
        import bitsandbytes as bnb  # the [quant] extra: only 4-bit experts need it

        parameter = getattr(self, name)
        state = parameter.quant_state
        shape = self.shape(name)
        count = shape[0] if expert_ids is None else expert_ids.shape[0]
        packed = parameter.data.view(torch.uint8).view(self.num_experts, -1)  # [E, out * in / 2]
        absmax = state.absmax.view(self.num_experts, -1)  # [E, blocks] (uint8 codes when nested)
        if expert_ids is not None:
            packed, absmax = packed[expert_ids], absmax[expert_ids]
        if state.nested:
            nested = state.state2.absmax.view(self.num_experts, -1)  # [E, blocks / 256]
            nested = nested if expert_ids is None else nested[expert_ids]
            absmax = bnb.functional.dequantize_blockwise(
                absmax.reshape(-1), absmax=nested.reshape(-1), code=state.state2.code, blocksize=state.state2.blocksize
            ) + state.offset
        selected = bnb.functional.QuantState(
            absmax=absmax.reshape(-1).float(), shape=torch.Size((count,) + shape[1:]), blocksize=state.blocksize,
            quant_type=state.quant_type, dtype=dtype if dtype in BNB_DTYPES else torch.float32,
        )
        return bnb.functional.dequantize_4bit(packed.reshape(-1), selected).to(dtype)  # [count, out, in]


def freeze_quantized_experts(model: nn.Module) -> None:
    """Quantised experts are frozen (transformers' loader makes every floating-point parameter trainable, FP8 too):
    fine-tuning the routed experts needs them dequantised at load (docs/finetuning.md)."""
    for module in model.modules():
        if isinstance(module, QuantizedExperts):
            module.requires_grad_(False)


def quantize_experts_4bit(weight: torch.Tensor, quant_type: str, compress_statistics: bool,
                          quant_storage: torch.dtype, blocksize: int) -> tuple:
    """bitsandbytes' `quantize_4bit` of the fused `weight [E, out, in]`, one expert at a time: the same packed bytes
    and block statistics (no block crosses an expert), with one expert's temporaries instead of the layer's
    (bitsandbytes' CPU quantisation of a whole 537M-weight layer peaked at several times its size). Double
    quantisation is then applied to all the block scales at once, as `quantize_4bit` does it."""
    import bitsandbytes as bnb  # the [quant] extra

    pieces = [bnb.functional.quantize_4bit(expert, blocksize=blocksize, compress_statistics=False, quant_type=quant_type,
                                           quant_storage=quant_storage) for expert in weight]
    packed = torch.cat([data for data, _ in pieces])  # [E * out * in / 2, 1]
    absmax = torch.cat([state.absmax for _, state in pieces])  # [E * out * in / blocksize]
    settings = {"shape": weight.shape, "dtype": weight.dtype, "blocksize": blocksize, "code": pieces[0][1].code,
                "quant_type": quant_type}
    if not compress_statistics:
        return packed, bnb.functional.QuantState(absmax=absmax, **settings)
    offset = absmax.mean()
    nested, nested_state = bnb.functional.quantize_blockwise(absmax - offset, blocksize=BNB_NESTED_BLOCK)
    return packed, bnb.functional.QuantState(absmax=nested, offset=offset, state2=nested_state, **settings)


def check_4bit_expert_blocks(config, blocksize: int, compress_statistics: bool) -> None:
    """Raise before loading if an expert's weights do not fill whole bitsandbytes blocks (each expert must be a
    slice of the fused tensor's 4-bit bytes and block scales)."""
    sizes = {"gate_up_proj": 2 * config.moe_intermediate_size * config.hidden_size,
             "down_proj": config.hidden_size * config.moe_intermediate_size}
    unit = blocksize * (BNB_NESTED_BLOCK if compress_statistics else 1)
    for name, size in sizes.items():
        if size % unit:
            raise ValueError(
                f"bitsandbytes 4-bit experts: one expert's {name} has {size} weights, not a multiple of {unit} "
                f"(blocks of {blocksize}{f' x {BNB_NESTED_BLOCK} for double quantisation' if compress_statistics else ''}); "
                "use bnb_4bit_use_double_quant=False, or keep the experts in FP8 (load without a BitsAndBytesConfig)"
            )


def quantized_experts_bytes(model: nn.Module) -> int:
    """Bytes held by the quantised experts of `model`, block statistics included (a `Params4bit`'s own size
    counts its packed bytes only)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Bnb4bitSelectedExperts):
            for name in PROJECTIONS:
                parameter = getattr(module, name)
                state = parameter.quant_state
                total += parameter.numel() * parameter.element_size() + state.absmax.numel() * state.absmax.element_size()
                if state.nested:
                    total += state.state2.absmax.numel() * state.state2.absmax.element_size()
        elif isinstance(module, Fp8SelectedExperts):
            total += sum(p.numel() * p.element_size() for p in module.parameters())
    return total


__all__ = [
    "Bnb4bitSelectedExperts",
    "Fp8SelectedExperts",
    "QuantizedExperts",
    "SELECTED_EXPERTS",
    "SelectedExpertsInterface",
    "check_4bit_expert_blocks",
    "dequantize_fp8_blocks",
    "freeze_quantized_experts",
    "quantize_experts_4bit",
    "quantized_experts_bytes",
    "selected_experts_forward",
]
