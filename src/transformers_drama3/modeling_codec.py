"""The Fish "modified DAC" codec of Drama 3 (docs/format.md#the-codec): 44.1 kHz mono audio <-> 10 codes per frame.

`FishDACCodec` is a transformers model of its own (an audio tokenizer: `AutoModel`, `from_pretrained`,
`save_pretrained`) holding three parts, every size read from `FishDACConfig`:

- `FishDACEncoder`: audio -> latents (causal convs, Snake, one windowed transformer), one step per `hop_length`.
- `FishDACQuantizer`: latents -> codes and codes -> latents (down/upsampling, the `pre_module`/`post_module`
  windowed transformers, one semantic and `n_codebooks` residual vector quantizers).
- `FishDACDecoder`: latents -> audio (causal convs, causal transposed convs, Snake, tanh).

Every block is causal, so decoding can be streamed: `FishDACCodec.stream()` returns a
`FishDACStreamingDecoder` whose modules carry bounded state (the last inputs of each conv, the transformer keys
and values inside the attention window, the absolute frame position). Every stateful `forward` takes an
optional `state` dict for this; `None` means a one-shot call over the whole sequence.

Weights: a Drama 3 checkpoint keeps the codec in `codec.pth`, in the original layout (`load_codec_state_dict`,
`FishDACCodec.from_codec_file`), which is folded once while loading (weight norm, VQ output projections). The folded
codec is what `state_dict()`, `save_pretrained` and `from_pretrained` hold.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import initialization as init
from transformers.modeling_utils import PreTrainedAudioTokenizerBase

from .audio_io import resample_audio
from .configuration_drama3 import FishDACConfig

INIT_STD = 0.02  # standard deviation of a new codec's conv and linear weights

# A stream state maps each stateful module to what it carries between chunks (tensors or a position).
StreamState = dict[nn.Module, Any]


class FishDACLoadError(ValueError):
    """A `codec.pth` file or state dict cannot be used: unreadable, not tensors only, or keys/shapes that differ."""


# --------------------------------------------------------------------------------------------------------------
# Convolutions and activations
# --------------------------------------------------------------------------------------------------------------


class Snake(nn.Module):
    """`y = x + sin(alpha * x)^2 / alpha`, one learned `alpha` per channel (docs/format.md#codec-blocks)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor) -> Tensor:  # [batch, channels, time]
        # The reference's operations in its order (bit-identical), in place on one fresh tensor: 1.5x faster.
        return torch.mul(self.alpha, x).sin_().square_().mul_((self.alpha + 1e-9).reciprocal()).add_(x)


class CausalConv1d(nn.Module):
    """Conv1d that sees only past inputs: `ke - stride` zeros on the left, then right zeros up to a stride multiple.

    Output step `t` depends on inputs up to `t * stride + stride - 1`, so the conv streams by carrying its last
    `ke - stride` inputs (`state`), given chunks of whole strides (the decoder's convs all have stride 1).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 groups: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_channels, in_channels // groups, kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        self.stride, self.dilation, self.groups = stride, dilation, groups
        self.context = (kernel_size - 1) * dilation + 1 - stride  # left padding = inputs carried when streaming

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        # x: [batch, in_channels, time] -> [batch, out_channels, ceil(time / stride)]
        if state is None:
            padding = (self.context, -x.shape[-1] % self.stride)
            x = F.pad(x, padding) if any(padding) else x
        elif self.context:
            history = state.get(self)
            if history is None:
                history = x.new_zeros(x.shape[0], x.shape[1], self.context)
            x = torch.cat([history, x], dim=-1)
            state[self] = x[..., x.shape[-1] - self.context :]
        return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class CausalConvTranspose1d(nn.Module):
    """Transposed conv keeping `stride` outputs per input: the `kernel - stride` overhang on the right is dropped.

    Output sample `t * stride + r` mixes inputs `t` and the `history` inputs before it, so streaming carries the
    last `history = ceil(kernel / stride) - 1` inputs; the bias is added once per output either way.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(in_channels, out_channels, kernel_size))  # [in, out, kernel]
        self.bias = nn.Parameter(torch.zeros(out_channels))
        self.stride = stride
        self.history = -(-kernel_size // stride) - 1

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        # x: [batch, in_channels, time] -> [batch, out_channels, time * stride]
        steps = x.shape[-1]
        carried = 0
        if state is not None and self.history:
            history = state.get(self)
            if history is None:
                history = x.new_zeros(x.shape[0], x.shape[1], self.history)
            x = torch.cat([history, x], dim=-1)
            state[self] = x[..., x.shape[-1] - self.history :]
            carried = self.history
        y = F.conv_transpose1d(x, self.weight, self.bias, self.stride)
        return y[..., carried * self.stride : (carried + steps) * self.stride]


class ResidualUnit(nn.Module):
    """Snake -> causal conv k7 (dilated) -> Snake -> causal conv k1, added to the input
    (docs/format.md#codec-blocks)."""

    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = CausalConv1d(channels, channels, 7, dilation=dilation)
        self.snake2 = Snake(channels)
        self.conv2 = CausalConv1d(channels, channels, 1)

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:  # [batch, channels, time]
        y = self.conv1(self.snake1(x), state)
        y = self.conv2(self.snake2(y), state)
        return y.add_(x)  # x + y; stride-1 causal convs keep the length, so no cropping is needed


class ConvNeXtBlock(nn.Module):
    """Quantizer ConvNeXt block: depthwise causal conv k7 -> LayerNorm -> Linear x4 -> GELU -> Linear -> gamma."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:  # [batch, dim, time]
        y = self.dwconv(x, state).transpose(1, 2)  # [batch, time, dim]
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).transpose(1, 2)


# --------------------------------------------------------------------------------------------------------------
# Windowed causal transformer (encoder's last block, quantizer pre_module / post_module)
# --------------------------------------------------------------------------------------------------------------


def rope_table(positions: Tensor, head_dim: int, base: float) -> Tensor:
    """Rotary table `[positions, head_dim / 2, (cos, sin)]` rounded to bfloat16 like the reference, as float32.

    The reference builds the table in float32 with `torch.polar` and stores it as bfloat16; the rounding moves
    the audio by ~2e-3, far above the golden tolerance, so it is reproduced here. Each row depends only on its
    position, so streamed and one-shot calls get identical values.
    """
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(positions.float(), freqs)  # [positions, head_dim / 2]
    rotation = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([rotation.real, rotation.imag], dim=-1).to(torch.bfloat16).float()


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate interleaved pairs `(x[2i], x[2i+1])` of every head in float32. x: [batch, time, heads, head_dim]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # [batch, time, heads, head_dim / 2, 2]
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    rotated = torch.stack(
        [pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], dim=-1
    )
    return rotated.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    """RMSNorm with a plain gain (`w`, not `1 + w`), normalised in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # [..., dim]
        x32 = x.float()
        return (x32 * torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerScale(nn.Module):
    """Per-channel output scale `gamma` of a transformer sub-layer."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class WindowedAttention(nn.Module):
    """Causal attention where query `i` sees keys `j` with `i - window < j <= i`.

    Queries are processed in blocks of `window`, each against at most `2 * window - 1` keys, so memory and work
    are linear in the sequence length. When streaming, the last `window - 1` keys and values are carried.
    """

    def __init__(self, dim: int, n_head: int, head_dim: int, window: int):
        super().__init__()
        self.n_head, self.head_dim, self.window = n_head, head_dim, window
        self.wqkv = nn.Linear(dim, 3 * n_head * head_dim, bias=False)  # rows: q | k | v
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)

    def forward(self, x: Tensor, rope: Tensor, state: StreamState | None = None) -> Tensor:
        batch, steps, _ = x.shape  # x: [batch, time, dim]
        q, k, v = self.wqkv(x).view(batch, steps, 3, self.n_head, self.head_dim).unbind(2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, time, head_dim]
        past = 0
        if state is not None:
            if self in state:
                past_k, past_v = state[self]
                past = past_k.shape[2]
                k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            keep = max(0, k.shape[2] - (self.window - 1))
            state[self] = (k[:, :, keep:], v[:, :, keep:])
        out = torch.cat([self._attend_block(q, k, v, past, start) for start in range(0, steps, self.window)], dim=2)
        return self.wo(out.transpose(1, 2).reshape(batch, steps, self.n_head * self.head_dim))

    def _attend_block(self, q: Tensor, k: Tensor, v: Tensor, past: int, start: int) -> Tensor:
        """Queries `start : start + window` (after `past` carried keys) against the keys inside their window."""
        stop = min(start + self.window, q.shape[2])
        key_lo, key_hi = max(0, past + start - self.window + 1), past + stop
        query_pos = torch.arange(past + start, past + stop, device=q.device)[:, None]
        key_pos = torch.arange(key_lo, key_hi, device=q.device)[None, :]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - self.window)  # [queries, keys]
        return F.scaled_dot_product_attention(
            q[:, :, start:stop], k[:, :, key_lo:key_hi], v[:, :, key_lo:key_hi], attn_mask=mask
        )  # [batch, heads, queries, head_dim]


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`."""

    def __init__(self, dim: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(dim, intermediate_size, bias=False)
        self.w3 = nn.Linear(dim, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerLayer(nn.Module):
    """`h = x + g_attn * Attn(RMS(x))`, `out = h + g_ffn * FFN(RMS(h))`."""

    def __init__(self, dim: int, n_head: int, head_dim: int, intermediate_size: int, window: int, norm_eps: float):
        super().__init__()
        self.attention = WindowedAttention(dim, n_head, head_dim, window)
        self.feed_forward = FeedForward(dim, intermediate_size)
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def forward(self, x: Tensor, rope: Tensor, state: StreamState | None = None) -> Tensor:  # [batch, time, dim]
        h = x + self.attention_layer_scale(self.attention(self.attention_norm(x), rope, state))
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class WindowedTransformer(nn.Module):
    """Stack of `TransformerLayer`s and a final RMSNorm on channels-first input; positions count from the stream start."""

    def __init__(self, n_layer: int, dim: int, n_head: int, head_dim: int, intermediate_size: int, window_size: int,
                 rope_base: float, norm_eps: float):
        super().__init__()
        self.head_dim, self.rope_base = head_dim, rope_base
        self.layers = nn.ModuleList(
            TransformerLayer(dim, n_head, head_dim, intermediate_size, window_size, norm_eps) for _ in range(n_layer)
        )
        self.norm = RMSNorm(dim, norm_eps)

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:  # [batch, dim, time]
        start = state.get(self, 0) if state is not None else 0
        positions = torch.arange(start, start + x.shape[-1], device=x.device)
        rope = rope_table(positions, self.head_dim, self.rope_base)  # [time, head_dim / 2, 2]
        h = x.transpose(1, 2)  # [batch, time, dim]
        for layer in self.layers:
            h = layer(h, rope, state)
        if state is not None:
            state[self] = start + x.shape[-1]
        return self.norm(h).transpose(1, 2)


# --------------------------------------------------------------------------------------------------------------
# Encoder, quantizer, decoder
# --------------------------------------------------------------------------------------------------------------


class EncoderBlock(nn.Module):
    """Residual units at `width / 2` -> Snake -> strided causal conv to `width` -> optional windowed transformer."""

    def __init__(self, width: int, stride: int, transformer: WindowedTransformer | None):
        super().__init__()
        self.residual_units = nn.ModuleList(ResidualUnit(width // 2, dilation) for dilation in (1, 3, 9))
        self.snake = Snake(width // 2)
        self.downsample = CausalConv1d(width // 2, width, 2 * stride, stride=stride)
        self.transformer = transformer

    def forward(self, x: Tensor) -> Tensor:  # [batch, width / 2, time] -> [batch, width, ceil(time / stride)]
        for unit in self.residual_units:
            x = unit(x)
        x = self.downsample(self.snake(x))
        return self.transformer(x) if self.transformer is not None else x


class FishDACEncoder(nn.Module):
    """Audio -> latents: conv k7 -> encoder blocks -> Snake -> conv k3, one step per `hop_length`
    (docs/format.md#codec-encoding)."""

    def __init__(self, config: FishDACConfig):
        super().__init__()
        blocks = []
        for index, stride in enumerate(config.encoder_rates):
            shape = config.encoder_transformer_shape(index)
            transformer = None
            if shape["n_layer"]:
                transformer = WindowedTransformer(
                    **shape,
                    window_size=config.encoder_transformer["window_size"],
                    rope_base=config.encoder_transformer["rope_base"],
                    norm_eps=config.encoder_transformer["norm_eps"],
                )
            blocks.append(EncoderBlock(config.encoder_block_width(index), stride, transformer))
        self.input_conv = CausalConv1d(1, config.encoder_dim, 7)
        self.blocks = nn.ModuleList(blocks)
        last_width = config.encoder_block_width(len(blocks) - 1)
        self.output_snake = Snake(last_width)
        self.output_conv = CausalConv1d(last_width, config.latent_dim, 3)

    def forward(self, audio: Tensor) -> Tensor:  # [batch, 1, samples] -> [batch, latent_dim, samples / hop_length]
        x = self.input_conv(audio)
        for block in self.blocks:
            x = block(x)
        return self.output_conv(self.output_snake(x))


class DecoderBlock(nn.Module):
    """Snake -> causal transposed conv (k = 2 * stride) to `out_channels` -> residual units (dilations 1, 3, 9)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.snake = Snake(in_channels)
        self.upsample = CausalConvTranspose1d(in_channels, out_channels, 2 * stride, stride)
        self.residual_units = nn.ModuleList(ResidualUnit(out_channels, dilation) for dilation in (1, 3, 9))

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        x = self.upsample(self.snake(x), state)  # [batch, in, time] -> [batch, out, time * stride]
        for unit in self.residual_units:
            x = unit(x, state)
        return x


class FishDACDecoder(nn.Module):
    """Latents -> audio in [-1, 1]: conv k7 -> decoder blocks -> Snake -> conv k7 -> tanh
    (docs/format.md#codec-decoding)."""

    def __init__(self, config: FishDACConfig):
        super().__init__()
        widths = [config.decoder_dim // 2**index for index in range(len(config.decoder_rates) + 1)]
        self.input_conv = CausalConv1d(config.latent_dim, widths[0], 7)
        self.blocks = nn.ModuleList(
            DecoderBlock(widths[index], widths[index + 1], stride) for index, stride in enumerate(config.decoder_rates)
        )
        self.output_snake = Snake(widths[-1])
        self.output_conv = CausalConv1d(widths[-1], 1, 7)

    def forward(self, latents: Tensor, state: StreamState | None = None) -> Tensor:
        # latents: [batch, latent_dim, steps] -> audio [batch, 1, steps * prod(decoder_rates)]
        x = self.input_conv(latents, state)
        for block in self.blocks:
            x = block(x, state)
        return torch.tanh(self.output_conv(self.output_snake(x), state))


class VectorQuantizer(nn.Module):
    """One codebook. Encode: nearest entry by cosine similarity of `in_proj(z)`; decode: row of a folded table.

    `table[i] = out_proj(codebook[i])` (`[codebook_size, dim]`, bias included) is folded at load time, so decoding
    a code is a single lookup; `out_proj` itself is kept for writing the original `codec.pth` layout back.
    """

    def __init__(self, dim: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Linear(dim, codebook_dim)
        self.codebook = nn.Parameter(torch.zeros(codebook_size, codebook_dim))
        self.out_proj = nn.Linear(codebook_dim, dim)
        self.table = nn.Parameter(torch.zeros(codebook_size, dim))

    @torch.no_grad()
    def fold(self) -> None:
        """Recompute `table` from `codebook` and `out_proj` (after either changed)."""
        self.table.copy_(self.out_proj(self.codebook.float()).to(self.table.dtype))

    def encode(self, z: Tensor) -> Tensor:  # [batch, dim, time] -> ids [batch, time]
        latents = F.normalize(self.in_proj(z.transpose(1, 2)), dim=-1)  # [batch, time, codebook_dim]
        return (latents @ F.normalize(self.codebook, dim=-1).T).argmax(dim=-1)

    def decode(self, ids: Tensor) -> Tensor:  # [batch, time] -> [batch, dim, time]
        return F.embedding(ids, self.table).transpose(1, 2)


class ResampleStage(nn.Module):
    """Quantizer down- or upsampling stage: causal (transposed) conv with kernel = stride, then a ConvNeXt block."""

    def __init__(self, dim: int, factor: int, upsample: bool):
        super().__init__()
        self.conv = CausalConvTranspose1d(dim, dim, factor, factor) if upsample else CausalConv1d(dim, dim, factor, factor)
        self.convnext = ConvNeXtBlock(dim)

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:  # [batch, dim, time]
        return self.convnext(self.conv(x, state), state)


class FishDACQuantizer(nn.Module):
    """Latents at hop rate <-> codes at frame rate (docs/format.md#codec-encoding,
    docs/format.md#codec-decoding).

    `codebooks[0]` is the semantic codebook (code 0), `codebooks[1:]` the residual ones (codes 1..n).
    """

    def __init__(self, config: FishDACConfig):
        super().__init__()
        q = config.quantizer
        dim, factors = q["input_dim"], q["downsample_factor"]
        self.codebook_sizes = config.codebook_sizes
        self.downsample = nn.ModuleList(ResampleStage(dim, factor, upsample=False) for factor in factors)
        self.pre_module = WindowedTransformer(**q["transformer"])
        self.codebooks = nn.ModuleList(VectorQuantizer(dim, size, q["codebook_dim"]) for size in self.codebook_sizes)
        self.post_module = WindowedTransformer(**q["transformer"])
        self.upsample = nn.ModuleList(ResampleStage(dim, factor, upsample=True) for factor in reversed(factors))

    def encode(self, latents: Tensor) -> Tensor:  # [batch, dim, steps] -> codes [batch, codebooks, frames]
        z = latents
        for stage in self.downsample:
            z = stage(z)
        residual = self.pre_module(z)
        codes = []
        for vq in self.codebooks:  # each stage quantizes what the previous ones left
            ids = vq.encode(residual)
            codes.append(ids)
            residual = residual - vq.decode(ids)
        return torch.stack(codes, dim=1)

    def decode(self, codes: Tensor, state: StreamState | None = None) -> Tensor:
        # codes: [batch, codebooks, frames] (already clamped) -> latents [batch, dim, frames * prod(factors)]
        residual = sum(vq.decode(codes[:, index]) for index, vq in enumerate(self.codebooks) if index)
        z = self.codebooks[0].decode(codes[:, 0]) + residual
        z = self.post_module(z, state)
        for stage in self.upsample:
            z = stage(z, state)
        return z


# --------------------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------------------

def _as_tensor(value: Any, what: str) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (np.ndarray, list, tuple)):
        return torch.as_tensor(np.asarray(value))
    raise TypeError(f"{what} must be a torch.Tensor or numpy array, got {type(value).__name__}")


def _check_codes(codes: Any, codebook_sizes: list[int]) -> Tensor:
    """Validate `[batch, codebooks, frames]` integer codes and clamp each codebook to its size
    (docs/format.md#codec-decoding)."""
    codes = _as_tensor(codes, "codes")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor (torch.long), got {codes.dtype}")
    if codes.ndim != 3 or codes.shape[1] != len(codebook_sizes):
        raise ValueError(
            f"codes must have shape [batch, {len(codebook_sizes)}, frames] (one row per codebook), "
            f"got {list(codes.shape)}"
        )
    if codes.numel() and bool((codes < 0).any()):
        raise ValueError(f"codes must be non-negative codebook ids, got a minimum of {int(codes.min())}")
    limits = torch.tensor(codebook_sizes, device=codes.device)[None, :, None] - 1
    return torch.minimum(codes.long(), limits)


def _check_audio(audio: Any, sampling_rate: int) -> Tensor:
    """Validate audio and bring it to `[batch, samples]` mono (channels averaged); no resampling yet."""
    audio = _as_tensor(audio, "audio")
    if not audio.is_floating_point():
        raise TypeError(
            f"audio must be floating point samples in [-1, 1], got {audio.dtype}; convert integer PCM first "
            "(e.g. int16: audio.float() / 32768)"
        )
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer)) or sampling_rate <= 0:
        raise ValueError(f"sampling_rate must be a positive integer (Hz), got {sampling_rate!r}")
    if audio.numel() == 0:
        raise ValueError(f"audio is empty (shape {list(audio.shape)})")
    if audio.ndim == 1:
        audio = audio[None]
    elif audio.ndim == 2:
        if audio.shape[1] <= 8 < audio.shape[0]:
            raise ValueError(
                f"audio of shape {list(audio.shape)} looks like [samples, channels]; 2-D audio is [batch, samples]. "
                "Pass multi-channel audio as [batch, channels, samples] (e.g. audio.T[None])"
            )
    elif audio.ndim == 3:
        audio = audio.mean(dim=1)  # [batch, channels, samples] -> [batch, samples]
    else:
        raise ValueError(f"audio must be [samples], [batch, samples] or [batch, channels, samples], got {list(audio.shape)}")
    if not bool(torch.isfinite(audio).all()):
        raise ValueError("audio contains NaN or infinite samples")
    return audio


# --------------------------------------------------------------------------------------------------------------
# The codec
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _float32_precision(allow_tf32: bool) -> Iterator[None]:
    """Let CUDA convolutions and matmuls use TF32 only if `allow_tf32`; the global flags are restored afterwards.

    PyTorch lets cuDNN run float32 convolutions in TF32 by default (~1e-3 relative error), which is enough to
    move encoder codes; the codec is precision-sensitive, so it runs in true float32 unless told otherwise.
    """
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _codec_inference(method: Callable) -> Callable:
    """Run a codec method without autograd and at the codec's float32 precision (`allow_tf32`), once its weights are
    known to be in memory."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        codec = self if isinstance(self, FishDACCodec) else self.codec
        if codec.decoder.output_conv.weight.is_meta:
            raise ValueError(
                "the codec's weights are on the meta device (offloaded by a device map, or never loaded). It encodes "
                "and decodes through its own methods, outside accelerate's offload hooks, so it must be whole on one "
                "device: load it without offloading (no device_map, or a single device)"
            )
        with torch.no_grad(), _float32_precision(codec.allow_tf32):
            return method(self, *args, **kwargs)

    return run


class FishDACCodec(PreTrainedAudioTokenizerBase):
    """The Fish DAC codec as a transformers model of its own (an audio tokenizer, as transformers' DAC and Mimi are):
    `encode` (audio -> codes), `decode` (codes -> audio) and `stream()` (chunked decode).

    - `FishDACCodec.from_pretrained` / `save_pretrained` / `AutoModel.from_pretrained` work as for any transformers
      model (`model_type "fish_dac"`, a `FishDACConfig`, the folded weights in safetensors);
    - `FishDACCodec.from_codec_file(path, config)` reads a `codec.pth` (the codec of a Drama 3 checkpoint);
    - `FishDACCodec(config)` has random weights.

    It runs in float32 unless converted (`codec.to(torch.bfloat16)`); audio is always returned as float32. On CUDA it
    also keeps TF32 off while it runs; set `allow_tf32 = True` to trade precision for speed. docs/codec.md.
    """

    config_class = FishDACConfig
    base_model_prefix = ""
    main_input_name = "audio"  # what `encode` takes
    _no_split_modules = ["FishDACCodec"]  # decoding runs through methods and lookup tables, not one `forward`
    # The codec's attention is its own: causal attention inside a window of frames, computed block by block with
    # torch's scaled_dot_product_attention (`WindowedAttention`) whatever `attn_implementation` says. It accepts every
    # kernel the Drama 3 model accepts, so that `attn_implementation=...` given to `FishOmniForSpeech` (which reaches
    # every sub-config, this one too) loads, and leaves the codec's attention as it is.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    def __init__(self, config: FishDACConfig):
        super().__init__(config)
        self.allow_tf32 = False
        self.encoder = FishDACEncoder(config)
        self.quantizer = FishDACQuantizer(config)
        self.decoder = FishDACDecoder(config)
        self.post_init()

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """Switching kernels (`set_attn_implementation`) is always allowed: the codec's attention does not use them.

        transformers' default answer reads this module's source and says no, because its attention class does not
        go through `ALL_ATTENTION_FUNCTIONS`; that would print a warning whenever the Drama 3 model switches."""
        return True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Random weights for a new codec: convs and linears N(0, 0.02) with zero biases, codebooks and lookup
        tables N(0, 1), Snake `alpha`, norm gains and layer scales 1. (Loaded weights are left alone.)"""
        if isinstance(module, (CausalConv1d, CausalConvTranspose1d, nn.Linear)):
            init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, VectorQuantizer):
            init.normal_(module.codebook)
            init.normal_(module.table)  # `out_proj` (a Linear) is drawn as such; `fold()` makes the two agree
        elif isinstance(module, Snake):
            init.ones_(module.alpha)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (LayerScale, ConvNeXtBlock)):
            init.ones_(module.gamma)

    @classmethod
    def from_codec_file(cls, path: str | Path, config: FishDACConfig | None = None) -> FishDACCodec:
        """The codec for `config` (default: the real Drama 3 codec) with the weights of a `codec.pth` file: the original
        layout of a Drama 3 checkpoint, or the folded one that `FishOmniForSpeech.save_pretrained` writes. On the CPU,
        in float32 and in eval mode (see `from_codec_state_dict`)."""
        return cls.from_codec_state_dict(load_codec_state_dict(path), config)

    @classmethod
    def from_codec_state_dict(cls, state_dict: dict[str, Tensor], config: FishDACConfig | None = None) -> FishDACCodec:
        """The codec for `config` (default: the real Drama 3 codec) with the weights of a `codec.pth` state dict in
        either layout (`load_codec_weights`), on the CPU, in float32 and in eval mode. Keys and shapes are checked
        before any weight is allocated, and no random weights are drawn first."""
        with torch.device("meta"):
            codec = cls(config if config is not None else FishDACConfig())
        check_codec_state_dict(codec, state_dict)
        codec = codec.to_empty(device="cpu").float()  # uninitialised memory: the load below writes every weight
        load_codec_weights(codec, state_dict)
        return codec.eval()

    @_codec_inference
    def decode(self, codes: Tensor) -> Tensor:
        """codes `[batch, num_codebooks, frames]` -> float32 audio `[batch, frames * frame_length]` in [-1, 1].

        Ids above a codebook's size are clamped to its last entry (docs/format.md#codec-decoding); negative ids are
        an error.
        """
        codes = _check_codes(codes, self.quantizer.codebook_sizes)
        if codes.shape[-1] == 0:
            return torch.zeros(codes.shape[0], 0, device=codes.device)
        return self.decoder(self.quantizer.decode(codes))[:, 0].float()

    @_codec_inference
    def encode(self, audio: Tensor, sampling_rate: int) -> Tensor:
        """Float audio -> codes `[batch, num_codebooks, ceil(samples / frame_length)]` (docs/format.md#codec-encoding).

        `audio` is `[samples]`, `[batch, samples]` or `[batch, channels, samples]` (channels are averaged to
        mono). Audio at another rate is resampled to `config.sample_rate` with `resample_audio`; the result is
        right-padded with zeros to a whole number of frames.
        """
        audio = _check_audio(audio, sampling_rate)
        audio = resample_audio(audio, int(sampling_rate), self.config.sample_rate)
        audio = F.pad(audio, (0, -audio.shape[-1] % self.config.frame_length)).to(self.dtype)
        return self.quantizer.encode(self.encoder(audio[:, None]))

    def stream(self) -> FishDACStreamingDecoder:
        """A new streaming decoder: feed it codes chunk by chunk to get the audio of each chunk right away."""
        return FishDACStreamingDecoder(self)

    def load_original_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load a state dict in the original `codec.pth` layout (docs/format.md#codec-file-keys), folding weight norm
        and the VQ output projections.

        Strict: missing keys, unexpected keys and wrong shapes raise `FishDACLoadError` naming them.
        """
        _check_keys_and_shapes(original_state_dict_shapes(self), state_dict)
        with torch.no_grad():
            for prefix, kind, module in _original_layout(self):
                names = _FORMATS[kind][0](module)
                _FORMATS[kind][1](module, {name: state_dict[f"{prefix}.{name}"] for name in names})

    def original_state_dict(self) -> dict[str, Tensor]:
        """The codec's weights in the original `codec.pth` layout (float32, weight norm and VQ output projections
        unfolded), as the official tools read it; `load_original_state_dict` folds them back to the same weights,
        bit for bit."""
        return {f"{prefix}.{name}": tensor for prefix, kind, module in _original_layout(self)
                for name, tensor in _FORMATS[kind][2](module).items()}


class FishDACStreamingDecoder:
    """Decodes codes in chunks of any number of frames (including 0 and 1) with the audio of one whole decode.

    Carried state is bounded: the last inputs of every causal conv, the transformer keys and values of the last
    `window - 1` frames, and the absolute frame position; the work per chunk depends only on its length.
    """

    def __init__(self, codec: FishDACCodec):
        self.codec = codec
        self.frames_decoded = 0
        self._state: StreamState = {}
        self._batch_size: int | None = None

    @_codec_inference
    def decode(self, codes: Tensor) -> Tensor:
        """codes `[batch, num_codebooks, n]` -> float32 audio `[batch, n * frame_length]` continuing the stream."""
        codes = _check_codes(codes, self.codec.quantizer.codebook_sizes)
        if self._batch_size is not None and codes.shape[0] != self._batch_size:
            raise ValueError(f"this stream decodes a batch of {self._batch_size}, got a chunk of batch {codes.shape[0]}")
        self._batch_size = codes.shape[0]
        if codes.shape[-1] == 0:
            return torch.zeros(codes.shape[0], 0, device=codes.device)
        latents = self.codec.quantizer.decode(codes, self._state)
        audio = self.codec.decoder(latents, self._state)[:, 0].float()
        self.frames_decoded += codes.shape[-1]
        return audio

    def reset(self) -> None:
        """Forget the carried state, to start a new stream."""
        self.frames_decoded, self._state, self._batch_size = 0, {}, None

    def state_size(self) -> int:
        """Number of carried tensor elements (bounded; does not grow with the frames decoded)."""
        tensors = [value if isinstance(value, tuple) else (value,) for value in self._state.values()]
        return sum(t.numel() for group in tensors for t in group if isinstance(t, Tensor))


# --------------------------------------------------------------------------------------------------------------
# The original `codec.pth` layout (docs/format.md#codec-file-keys): key shapes, folding, checking, loading
# --------------------------------------------------------------------------------------------------------------


def _original_layout(codec: FishDACCodec) -> Iterator[tuple[str, str, nn.Module]]:
    """`(original key prefix, format, module)` for every module holding weights, in `codec.pth` naming."""
    encoder, quantizer, decoder = codec.encoder, codec.quantizer, codec.decoder
    yield "encoder.block.0", "wn_conv", encoder.input_conv
    for index, block in enumerate(encoder.blocks, start=1):
        for unit_index, unit in enumerate(block.residual_units):
            yield from _residual_unit_layout(f"encoder.block.{index}.block.{unit_index}", unit)
        yield f"encoder.block.{index}.block.3", "snake", block.snake
        yield f"encoder.block.{index}.block.4", "wn_conv", block.downsample
        if block.transformer is not None:
            yield f"encoder.block.{index}.block.5", "transformer", block.transformer
    yield f"encoder.block.{len(encoder.blocks) + 1}", "snake", encoder.output_snake
    yield f"encoder.block.{len(encoder.blocks) + 2}", "wn_conv", encoder.output_conv

    yield "quantizer.semantic_quantizer.quantizers.0", "vq", quantizer.codebooks[0]
    for index, vq in enumerate(quantizer.codebooks[1:]):
        yield f"quantizer.quantizer.quantizers.{index}", "vq", vq
    for name, stages in (("downsample", quantizer.downsample), ("upsample", quantizer.upsample)):
        for index, stage in enumerate(stages):
            yield f"quantizer.{name}.{index}.0", "conv", stage.conv
            yield f"quantizer.{name}.{index}.1", "convnext", stage.convnext
    yield "quantizer.pre_module", "transformer", quantizer.pre_module
    yield "quantizer.post_module", "transformer", quantizer.post_module

    yield "decoder.model.0", "wn_conv", decoder.input_conv
    for index, block in enumerate(decoder.blocks, start=1):
        yield f"decoder.model.{index}.block.0", "snake", block.snake
        yield f"decoder.model.{index}.block.1", "wn_conv", block.upsample
        for unit_index, unit in enumerate(block.residual_units, start=2):
            yield from _residual_unit_layout(f"decoder.model.{index}.block.{unit_index}", unit)
    yield f"decoder.model.{len(decoder.blocks) + 1}", "snake", decoder.output_snake
    yield f"decoder.model.{len(decoder.blocks) + 2}", "wn_conv", decoder.output_conv


def _residual_unit_layout(prefix: str, unit: ResidualUnit) -> Iterator[tuple[str, str, nn.Module]]:
    yield f"{prefix}.block.0", "snake", unit.snake1
    yield f"{prefix}.block.1", "wn_conv", unit.conv1
    yield f"{prefix}.block.2", "snake", unit.snake2
    yield f"{prefix}.block.3", "wn_conv", unit.conv2


def _fold_weight_norm(g: Tensor, v: Tensor) -> Tensor:
    """`W = g * v / ||v||`, norm over every dim but 0 (for transposed convs dim 0 is the input channel).

    `torch._weight_norm` is the kernel the reference's weight-norm parametrization runs, so the folded weights are
    bit-identical to the ones the reference computes on every forward.
    """
    return torch._weight_norm(v.float(), g.float(), 0)


def _wn_conv_shapes(conv: CausalConv1d | CausalConvTranspose1d) -> dict[str, tuple[int, ...]]:
    weight = tuple(conv.weight.shape)
    return {
        "conv.bias": tuple(conv.bias.shape),
        "conv.parametrizations.weight.original0": (weight[0], 1, 1),
        "conv.parametrizations.weight.original1": weight,
    }


def _load_wn_conv(conv: CausalConv1d | CausalConvTranspose1d, tensors: dict[str, Tensor]) -> None:
    conv.weight.copy_(_fold_weight_norm(tensors["conv.parametrizations.weight.original0"],
                                        tensors["conv.parametrizations.weight.original1"]))
    conv.bias.copy_(tensors["conv.bias"])


def _vq_shapes(vq: VectorQuantizer) -> dict[str, tuple[int, ...]]:
    size, codebook_dim = vq.codebook.shape
    dim = vq.out_proj.weight.shape[0]
    return {
        "codebook.weight": (size, codebook_dim),
        "in_proj.weight_g": (codebook_dim, 1, 1),
        "in_proj.weight_v": (codebook_dim, dim, 1),
        "in_proj.bias": (codebook_dim,),
        "out_proj.weight_g": (dim, 1, 1),
        "out_proj.weight_v": (dim, codebook_dim, 1),
        "out_proj.bias": (dim,),
    }


def _load_vq(vq: VectorQuantizer, tensors: dict[str, Tensor]) -> None:
    in_proj = _fold_weight_norm(tensors["in_proj.weight_g"], tensors["in_proj.weight_v"])[..., 0]  # [cb_dim, dim]
    out_proj = _fold_weight_norm(tensors["out_proj.weight_g"], tensors["out_proj.weight_v"])[..., 0]  # [dim, cb_dim]
    vq.in_proj.weight.copy_(in_proj)
    vq.in_proj.bias.copy_(tensors["in_proj.bias"])
    vq.codebook.copy_(tensors["codebook.weight"])
    vq.out_proj.weight.copy_(out_proj)
    vq.out_proj.bias.copy_(tensors["out_proj.bias"])
    vq.fold()  # [size, dim]


def _weight_norm_parts(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`(g, v)` of a folded weight in the original weight-norm layout: `v = W` and `g` the norms of `W` over every dim
    but 0 exactly as `torch._weight_norm` computes them (its interface returns them), so folding them again gives
    `W * (g / g) = W`, bit for bit."""
    weight = weight.detach().float()
    _, norms = torch._weight_norm_interface(weight, torch.ones_like(weight[:, :1, :1]), 0)
    return norms, weight


def _dump_wn_conv(conv: CausalConv1d | CausalConvTranspose1d) -> dict[str, Tensor]:
    g, v = _weight_norm_parts(conv.weight)
    return {"conv.parametrizations.weight.original0": g, "conv.parametrizations.weight.original1": v,
            "conv.bias": conv.bias.detach().float()}


def _dump_vq(vq: VectorQuantizer) -> dict[str, Tensor]:
    in_g, in_v = _weight_norm_parts(vq.in_proj.weight[..., None])  # conv1d weights [out, in, 1]
    out_g, out_v = _weight_norm_parts(vq.out_proj.weight[..., None])
    return {"codebook.weight": vq.codebook.detach().float(), "in_proj.weight_g": in_g, "in_proj.weight_v": in_v,
            "in_proj.bias": vq.in_proj.bias.detach().float(), "out_proj.weight_g": out_g,
            "out_proj.weight_v": out_v, "out_proj.bias": vq.out_proj.bias.detach().float()}


def _renamed(rename: Callable[[str], str]) -> tuple[Callable, Callable, Callable]:
    """Format whose original names map one to one onto the module's parameters (no folding)."""

    def shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
        return {rename(name): tuple(p.shape) for name, p in module.named_parameters()}

    def load(module: nn.Module, tensors: dict[str, Tensor]) -> None:
        for name, param in module.named_parameters():
            param.copy_(tensors[rename(name)])

    def dump(module: nn.Module) -> dict[str, Tensor]:
        return {rename(name): param.detach().float() for name, param in module.named_parameters()}

    return shapes, load, dump


# format -> (original tensor shapes of a module, loader of those tensors into the module, the module's tensors in
# the original layout)
_FORMATS: dict[str, tuple[Callable, Callable, Callable]] = {
    "snake": _renamed(lambda name: name),
    "wn_conv": (_wn_conv_shapes, _load_wn_conv, _dump_wn_conv),
    "conv": _renamed(lambda name: f"conv.{name}"),
    "convnext": _renamed(lambda name: name.replace("dwconv.", "dwconv.conv.")),
    "transformer": _renamed(lambda name: name),
    "vq": (_vq_shapes, _load_vq, _dump_vq),
}


def _prefixed(prefix: str, shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, tuple[int, ...]]]:
    return ((f"{prefix}.{name}", shape) for name, shape in shapes.items())


def _preview(items: list[str], limit: int = 8) -> str:
    return str(items[:limit])[:-1] + (f", ... {len(items) - limit} more]" if len(items) > limit else "]")


def original_state_dict_shapes(codec: FishDACCodec) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an original `codec.pth` for `codec` with its shape (`codec` may live on the meta device)."""
    return {key: shape for prefix, kind, module in _original_layout(codec)
            for key, shape in _prefixed(prefix, _FORMATS[kind][0](module))}


def original_codec_key_shapes(config: FishDACConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an original `codec.pth` for `config` (docs/format.md#codec-file-keys) with its shape;
    nothing is allocated."""
    with torch.device("meta"):
        codec = FishDACCodec(config)
    return original_state_dict_shapes(codec)


def is_original_layout(state_dict: dict[str, Tensor]) -> bool:
    """Whether a `codec.pth` state dict is in the original layout; the folded one (`FishDACCodec.state_dict()`) is
    recognised by its VQ lookup tables (`*.table`), which the original layout does not have."""
    return not any(key.endswith(".table") for key in state_dict)


def _check_keys_and_shapes(expected: dict[str, tuple[int, ...]], state_dict: dict[str, Tensor]) -> None:
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise FishDACLoadError(
            f"codec state dict does not match the codec config: {len(missing)} missing keys {_preview(missing)}, "
            f"{len(unexpected)} unexpected keys {_preview(unexpected)}"
        )
    wrong = [f"{key}: expected {list(shape)}, got {list(state_dict[key].shape)}"
             for key, shape in expected.items() if tuple(state_dict[key].shape) != tuple(shape)]
    if wrong:
        raise FishDACLoadError(f"codec state dict has {len(wrong)} tensors of the wrong shape: {_preview(wrong)}")


def check_codec_state_dict(codec: FishDACCodec, state_dict: dict[str, Tensor]) -> None:
    """Raise `FishDACLoadError` naming what differs unless `state_dict` (original or folded layout) holds exactly the
    tensors of `codec`, with their shapes. Reads shapes only, so `codec` may live on the meta device."""
    if is_original_layout(state_dict):
        expected = original_state_dict_shapes(codec)
    else:
        expected = {key: tuple(tensor.shape) for key, tensor in codec.state_dict().items()}
    _check_keys_and_shapes(expected, state_dict)


def load_codec_weights(codec: FishDACCodec, state_dict: dict[str, Tensor]) -> None:
    """Load a `codec.pth` state dict in either layout into `codec`, strictly: the original layout is folded while
    loading (`load_original_state_dict`), the folded one is copied as it is. Every weight of `codec` is written."""
    check_codec_state_dict(codec, state_dict)
    if is_original_layout(state_dict):
        codec.load_original_state_dict(state_dict)
    else:
        codec.load_state_dict(state_dict)


def load_codec_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Read an original `codec.pth` as a state dict, safely (`weights_only=True`, memory-mapped when possible).

    Unwraps `{"state_dict": ...}`, strips `generator.` prefixes and drops `...causal_mask` buffers. A file that
    holds pickled objects other than tensors is refused (never executed) with `FishDACLoadError`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"codec file not found: {path}")
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:  # legacy (non-zip) files cannot be memory-mapped
            if "mmap" not in str(error):
                raise
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        raise FishDACLoadError(
            f"{path} is not a tensors-only PyTorch state dict and was refused (it was loaded with weights_only=True, "
            f"so nothing in it was executed): {str(error).splitlines()[0]}"
        ) from error
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()):
        raise FishDACLoadError(f"{path} does not hold a state dict (a dict of name -> tensor)")
    return {key.removeprefix("generator."): value for key, value in loaded.items() if not key.endswith("causal_mask")}


__all__ = [
    "FishDACCodec",
    "FishDACDecoder",
    "FishDACEncoder",
    "FishDACLoadError",
    "FishDACQuantizer",
    "FishDACStreamingDecoder",
    "check_codec_state_dict",
    "is_original_layout",
    "load_codec_state_dict",
    "load_codec_weights",
    "original_codec_key_shapes",
    "original_state_dict_shapes",
]
