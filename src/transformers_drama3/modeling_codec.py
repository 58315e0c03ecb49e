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

Weights: a Drama 3 checkpoint keeps the codec in `codec.pth`, in the original layout (`FishDACCodec.from_codec_file`;
`codec_layout.py` knows that layout), which is folded once while loading (weight norm, VQ output projections). The
folded codec is what `state_dict()`, `save_pretrained` and `from_pretrained` hold. Read from `codec.pth`, the codec's
weights are the file's own memory-mapped pages wherever no folding is needed, and its encoding side (only voice
cloning uses it: about half the weights) can wait for first use (`defer_encoding_side=True`, what
`FishOmniForSpeech.from_pretrained` does): docs/codec.md#memory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import initialization as init
from transformers.modeling_utils import PreTrainedAudioTokenizerBase
from transformers.utils import ModelOutput

from .audio_io import check_audio_layout, resample_audio
from .codec_blocks import (
    FishDACCausalConv1d,
    FishDACCausalConvTranspose1d,
    FishDACConvNeXtBlock,
    FishDACLayerScale,
    FishDACRMSNorm,
    FishDACResidualUnit,
    FishDACSnake,
    FishDACWindowedTransformer,
    StreamState,
)
from .codec_layout import (
    ENCODING_SIDE,
    EncodingSideSource,
    check_codec_state_dict,
    encoding_side_modules,
    encoding_side_state_dict,
    folded_state_dict,
    load_codec_state_dict,
    load_codec_weights,
    load_original_state_dict,
    memory_maps,
    original_state_dict,
    set_encoding_side,
)
from .codes import check_codes
from .configuration_drama3 import FishDACConfig
from .device_placement import execution_device

INIT_STD = 0.02  # standard deviation of a new codec's conv and linear weights

# --------------------------------------------------------------------------------------------------------------
# Encoder, quantizer, decoder
# --------------------------------------------------------------------------------------------------------------


class FishDACEncoderBlock(nn.Module):
    """Residual units at `width / 2` -> Snake -> strided causal conv to `width` -> optional windowed transformer."""

    def __init__(self, width: int, stride: int, transformer: FishDACWindowedTransformer | None):
        super().__init__()
        self.residual_units = nn.ModuleList(FishDACResidualUnit(width // 2, dilation) for dilation in (1, 3, 9))
        self.snake = FishDACSnake(width // 2)
        self.downsample = FishDACCausalConv1d(width // 2, width, 2 * stride, stride=stride)
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
                transformer = FishDACWindowedTransformer(
                    **shape,
                    window_size=config.encoder_transformer["window_size"],
                    rope_base=config.encoder_transformer["rope_base"],
                    norm_eps=config.encoder_transformer["norm_eps"],
                )
            blocks.append(FishDACEncoderBlock(config.encoder_block_width(index), stride, transformer))
        self.input_conv = FishDACCausalConv1d(1, config.encoder_dim, 7)
        self.blocks = nn.ModuleList(blocks)
        last_width = config.encoder_block_width(len(blocks) - 1)
        self.output_snake = FishDACSnake(last_width)
        self.output_conv = FishDACCausalConv1d(last_width, config.latent_dim, 3)

    def forward(self, audio: Tensor) -> Tensor:  # [batch, 1, samples] -> [batch, latent_dim, samples / hop_length]
        x = self.input_conv(audio)
        for block in self.blocks:
            x = block(x)
        return self.output_conv(self.output_snake(x))


class FishDACDecoderBlock(nn.Module):
    """Snake -> causal transposed conv (k = 2 * stride) to `out_channels` -> residual units (dilations 1, 3, 9)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.snake = FishDACSnake(in_channels)
        self.upsample = FishDACCausalConvTranspose1d(in_channels, out_channels, 2 * stride, stride)
        self.residual_units = nn.ModuleList(FishDACResidualUnit(out_channels, dilation) for dilation in (1, 3, 9))

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
        self.input_conv = FishDACCausalConv1d(config.latent_dim, widths[0], 7)
        self.blocks = nn.ModuleList(
            FishDACDecoderBlock(widths[index], widths[index + 1], stride) for index, stride in enumerate(config.decoder_rates)
        )
        self.output_snake = FishDACSnake(widths[-1])
        self.output_conv = FishDACCausalConv1d(widths[-1], 1, 7)

    def forward(self, latents: Tensor, state: StreamState | None = None) -> Tensor:
        # latents: [batch, latent_dim, steps] -> audio [batch, 1, steps * prod(decoder_rates)]
        x = self.input_conv(latents, state)
        for block in self.blocks:
            x = block(x, state)
        return torch.tanh(self.output_conv(self.output_snake(x), state))


class FishDACVectorQuantizer(nn.Module):
    """One codebook. Encode: nearest entry by cosine similarity of `in_proj(z)`; decode: row of a folded table.

    `table[i] = out_proj(codebook[i])` (`[codebook_size, dim]`, bias included) is folded at load time
    (`codec_layout.folded_state_dict`), so decoding a code is a single lookup; `out_proj` itself is kept for writing the
    original `codec.pth` layout back.
    """

    def __init__(self, dim: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Linear(dim, codebook_dim)
        self.codebook = nn.Parameter(torch.zeros(codebook_size, codebook_dim))
        self.out_proj = nn.Linear(codebook_dim, dim)
        self.table = nn.Parameter(torch.zeros(codebook_size, dim))

    def encode(self, z: Tensor) -> Tensor:  # [batch, dim, time] -> ids [batch, time]
        latents = F.normalize(self.in_proj(z.transpose(1, 2)), dim=-1)  # [batch, time, codebook_dim]
        return (latents @ F.normalize(self.codebook, dim=-1).T).argmax(dim=-1)

    def decode(self, ids: Tensor) -> Tensor:  # [batch, time] -> [batch, dim, time]
        return F.embedding(ids, self.table).transpose(1, 2)


class FishDACResampleStage(nn.Module):
    """Quantizer down- or upsampling stage: causal (transposed) conv with kernel = stride, then a ConvNeXt block."""

    def __init__(self, dim: int, factor: int, upsample: bool):
        super().__init__()
        self.conv = FishDACCausalConvTranspose1d(dim, dim, factor, factor) if upsample else FishDACCausalConv1d(dim, dim, factor, factor)
        self.convnext = FishDACConvNeXtBlock(dim)

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
        self.downsample = nn.ModuleList(FishDACResampleStage(dim, factor, upsample=False) for factor in factors)
        self.pre_module = FishDACWindowedTransformer(**q["transformer"])
        self.codebooks = nn.ModuleList(FishDACVectorQuantizer(dim, size, q["codebook_dim"]) for size in self.codebook_sizes)
        self.post_module = FishDACWindowedTransformer(**q["transformer"])
        self.upsample = nn.ModuleList(FishDACResampleStage(dim, factor, upsample=True) for factor in reversed(factors))

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

def _clamped_codes(codes: Any, codebook_sizes: list[int]) -> Tensor:
    """Checked `[batch, codebooks, frames]` codes (`check_codes`), each codebook's ids above its size clamped to its
    last entry (docs/format.md#codec-decoding)."""
    codes = check_codes(codes, len(codebook_sizes), batched=True)
    limits = torch.tensor(codebook_sizes, device=codes.device)[None, :, None] - 1
    return torch.minimum(codes, limits)


def _mono_audio(audio: Any, sampling_rate: int) -> Tensor:
    """Checked float audio in the package's layout (`check_audio_layout`: `[samples]`, `[channels, samples]` or
    `[batch, channels, samples]`) as mono `[batch, samples]`, channels averaged; no resampling yet."""
    if not isinstance(audio, Tensor):
        if not isinstance(audio, (np.ndarray, list, tuple)):
            raise TypeError(f"audio must be a torch.Tensor or numpy array, got {type(audio).__name__}")
        audio = torch.as_tensor(np.asarray(audio))
    if not audio.is_floating_point():
        raise TypeError(
            f"audio must be floating point samples in [-1, 1], got {audio.dtype}; convert integer PCM first "
            "(e.g. int16: audio.float() / 32768)"
        )
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer)) or sampling_rate <= 0:
        raise ValueError(f"sampling_rate must be a positive integer (Hz), got {sampling_rate!r}")
    check_audio_layout(tuple(audio.shape), "FishDACCodec.encode", batched=True)
    if not bool(torch.isfinite(audio).all()):
        raise ValueError("audio contains NaN or infinite samples")
    if audio.ndim < 3:
        audio = audio.reshape(1, -1, audio.shape[-1])  # one recording: [1, channels, samples]
    return audio.mean(dim=1)  # [batch, samples]


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


@dataclass
class FishDACEncoderOutput(ModelOutput):
    """What `FishDACCodec.encode` returns. audio_codes: `[batch, num_codebooks, frames]` int64 codes."""

    audio_codes: Tensor | None = None


@dataclass
class FishDACDecoderOutput(ModelOutput):
    """What `FishDACCodec.decode` and `FishDACStreamingDecoder.decode` return. audio_values: float32 audio
    `[batch, 1, frames * frame_length]` in [-1, 1]."""

    audio_values: Tensor | None = None


@dataclass
class FishDACOutput(ModelOutput):
    """What `FishDACCodec.forward` returns: the `audio_codes` encoded (or given) and the `audio_values` decoded."""

    audio_codes: Tensor | None = None
    audio_values: Tensor | None = None


class FishDACCodec(PreTrainedAudioTokenizerBase):
    """The Fish DAC codec as a transformers model of its own (an audio tokenizer, as transformers' DAC and Mimi are):
    `encode` (audio -> codes), `decode` (codes -> audio) and `stream()` (chunked decode).

    - `FishDACCodec.from_pretrained` / `save_pretrained` / `AutoModel.from_pretrained` work as for any transformers
      model (`model_type "fish_dac"`, a `FishDACConfig`, the folded weights in safetensors);
    - `FishDACCodec.from_codec_file(path, config)` reads a `codec.pth` (the codec of a Drama 3 checkpoint), in place:
      with `defer_encoding_side=True` the encoding side (`encoder`, `quantizer.downsample`, `quantizer.pre_module`)
      stays `None` until the first `encode` (or `load_encoding_side()`) loads it;
    - `FishDACCodec(config)` has random weights.

    It runs in float32 unless converted (`codec.to(torch.bfloat16)`); audio is always returned as float32. On CUDA it
    also keeps TF32 off while it runs; set `allow_tf32 = True` to trade precision for speed. docs/codec.md.
    """

    config_class = FishDACConfig
    base_model_prefix = ""
    main_input_name = "audio"  # what `encode` takes
    _no_split_modules = ["FishDACCodec"]  # encode/decode run through methods and lookup tables, outside hooks
    # The codec's attention is its own: causal attention inside a window of frames, computed block by block with
    # torch's scaled_dot_product_attention (`FishDACWindowedAttention`) whatever `attn_implementation` says. It accepts every
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
        self._encoding_side_source: EncodingSideSource | None = None  # set while the encoding side waits
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
        if isinstance(module, (FishDACCausalConv1d, FishDACCausalConvTranspose1d, nn.Linear)):
            init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, FishDACVectorQuantizer):
            init.normal_(module.codebook)
            init.normal_(module.table)  # `out_proj` (a Linear) is drawn as such; `fold()` makes the two agree
        elif isinstance(module, FishDACSnake):
            init.ones_(module.alpha)
        elif isinstance(module, (FishDACRMSNorm, nn.LayerNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (FishDACLayerScale, FishDACConvNeXtBlock)):
            init.ones_(module.gamma)

    @classmethod
    def from_codec_file(cls, path: str | Path, config: FishDACConfig | None = None, *,
                        defer_encoding_side: bool = False) -> FishDACCodec:
        """The codec for `config` (default: the real Drama 3 codec) with the weights of a `codec.pth` file: the original
        layout of a Drama 3 checkpoint, or the folded one. On the CPU, in float32 and in eval mode; keys and shapes are
        checked before any weight is read.

        Built in place: the file is memory-mapped, its float32 tensors that need no folding become the codec's weights
        as they are (no copy, and no page is read before the codec uses it), and folded ones are computed from a
        second map of the file that is dropped afterwards. So loading holds no second copy of the weights.
        `defer_encoding_side=True` leaves the encoding side to the first `encode` (`load_encoding_side`). A file in
        the legacy format, which cannot be memory-mapped, is read into memory and loaded whole (`from_codec_state_dict`).
        """
        maps = memory_maps(path, 4 if defer_encoding_side else 2)
        if maps is None:
            return cls.from_codec_state_dict(load_codec_state_dict(path), config)
        with torch.device("meta"):
            codec = cls(config if config is not None else FishDACConfig())
        check_codec_state_dict(codec, maps[0])  # the whole file, the encoding side too
        if defer_encoding_side:
            set_encoding_side(codec, None, None, None)
            codec._encoding_side_source = EncodingSideSource(*maps[2:])
        codec.load_state_dict(folded_state_dict(codec, maps[0], maps[1]), assign=True)
        return codec.eval()

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
    def decode(self, audio_codes: Tensor) -> FishDACDecoderOutput:
        """Codes `[batch, num_codebooks, frames]` -> `FishDACDecoderOutput` whose `audio_values` are float32 audio
        `[batch, 1, frames * frame_length]` in [-1, 1] (mono, in the package's `[batch, channels, samples]` layout).

        Ids above a codebook's size are clamped to its last entry (docs/format.md#codec-decoding); negative ids are
        an error. The codes may be on any device: they are moved to the codec's, where the audio is returned.
        """
        device = execution_device(self)
        codes = _clamped_codes(audio_codes, self.quantizer.codebook_sizes).to(device)  # one copy, if any
        if codes.shape[-1] == 0:
            return FishDACDecoderOutput(torch.zeros(codes.shape[0], 1, 0, device=device))
        return FishDACDecoderOutput(self.decoder(self.quantizer.decode(codes)).float())  # [batch, 1, samples]

    @property
    def encoding_side_loaded(self) -> bool:
        """False while the encoding side waits for first use (`from_codec_file(..., defer_encoding_side=True)`)."""
        return self._encoding_side_source is None

    def load_encoding_side(self) -> None:
        """Load the encoding side now if it waits for first use (nothing otherwise): built in place from the maps of
        `codec.pth` made when the codec was loaded, then placed on the codec's device in the dtype of its codebooks'
        input projections (the encoding weights that are always loaded). Once, and safe to call from several threads:
        `encode`, `state_dict`, `original_state_dict` and weight loads call it."""
        source = self._encoding_side_source
        if source is None:
            return
        # Weights made inside a caller's inference mode (the processor encodes in one) would be inference tensors,
        # which autograd refuses for the rest of the codec's life: they are made outside it.
        with source.lock, torch.inference_mode(False), torch.no_grad():
            if self._encoding_side_source is None:  # another thread loaded it meanwhile
                return
            with torch.device("meta"):
                part = type(self)(self.config)
            part.decoder = part.quantizer.codebooks = part.quantizer.post_module = part.quantizer.upsample = None
            weights = folded_state_dict(part, *(encoding_side_state_dict(m) for m in (source.kept, source.read)))
            part.load_state_dict(weights, assign=True)
            reference = self.quantizer.codebooks[0].in_proj.weight
            device = execution_device(self)
            loaded = [module.to(device, reference.dtype).requires_grad_(reference.requires_grad).train(self.training)
                      for module in encoding_side_modules(part)]
            set_encoding_side(self, *loaded)  # each replaces a None: a thread walking the modules meanwhile is safe
            self._encoding_side_source = None

    def state_dict(self, *args, **kwargs) -> dict[str, Tensor]:
        """The folded weights, the encoding side included (loaded first if it waits: `load_encoding_side`)."""
        self.load_encoding_side()
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A state dict that holds encoding-side weights loads into a whole codec: a waiting encoding side is loaded
        # first (and then overwritten), so that none of its weights is unexpected or left as it was.
        if any(key.startswith(tuple(f"{prefix}{path}." for path in ENCODING_SIDE)) for key in state_dict):
            self.load_encoding_side()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @_codec_inference
    def encode(self, audio: Tensor, sampling_rate: int) -> FishDACEncoderOutput:
        """Float audio -> `FishDACEncoderOutput` whose `audio_codes` are `[batch, num_codebooks, ceil(samples /
        frame_length)]` (docs/format.md#codec-encoding).

        `audio` is in the package's layout: `[samples]` or `[channels, samples]` (one recording, batch 1) or
        `[batch, channels, samples]`; channels are averaged to mono. Audio at another rate is resampled to
        `config.sample_rate` with `resample_audio`; the result is right-padded with zeros to a whole number of
        frames. The audio may be on any device (it is checked and resampled there, then moved to the codec's once);
        the codes are returned on the codec's device.
        """
        audio = _mono_audio(audio, sampling_rate)  # [batch, samples]
        self.load_encoding_side()
        audio = resample_audio(audio, int(sampling_rate), self.config.sample_rate)
        audio = F.pad(audio, (0, -audio.shape[-1] % self.config.frame_length))
        audio = audio.to(execution_device(self), self.dtype)  # one copy to the codec's device, if any
        return FishDACEncoderOutput(self.quantizer.encode(self.encoder(audio[:, None])))

    def forward(self, audio: Tensor | None = None, sampling_rate: int | None = None,
                audio_codes: Tensor | None = None) -> FishDACOutput:
        """The codec's round trip, as transformers' DAC and Mimi run it: `audio` (with its `sampling_rate`) encoded to
        `audio_codes`, unless codes are given, then decoded to `audio_values` (see `encode` and `decode`)."""
        if (audio is None) == (audio_codes is None):
            raise ValueError("FishDACCodec takes either `audio` (with `sampling_rate`) or `audio_codes`, not both")
        if audio_codes is None:
            audio_codes = self.encode(audio, sampling_rate).audio_codes
        return FishDACOutput(audio_codes=audio_codes, audio_values=self.decode(audio_codes).audio_values)

    def stream(self) -> FishDACStreamingDecoder:
        """A new streaming decoder: feed it codes chunk by chunk to get the audio of each chunk right away."""
        return FishDACStreamingDecoder(self)

    def load_original_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load a state dict in the original `codec.pth` layout (docs/format.md#codec-file-keys), folding weight norm
        and the VQ output projections (`codec_layout.load_original_state_dict`).

        Strict: missing keys, unexpected keys and wrong shapes raise `FishDACLoadError` naming them.
        """
        load_original_state_dict(self, state_dict)

    def original_state_dict(self) -> dict[str, Tensor]:
        """The codec's weights in the original `codec.pth` layout (float32, weight norm and VQ output projections
        unfolded), as the official tools read it; `load_original_state_dict` folds them back to the same weights,
        bit for bit."""
        return original_state_dict(self)


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
    def decode(self, audio_codes: Tensor) -> FishDACDecoderOutput:
        """Codes `[batch, num_codebooks, n]` -> `FishDACDecoderOutput`, `audio_values` float32 `[batch, 1, n *
        frame_length]` continuing the stream, on the codec's device (the codes may be on any device)."""
        device = execution_device(self.codec)
        codes = _clamped_codes(audio_codes, self.codec.quantizer.codebook_sizes).to(device)  # one copy, if any
        if self._batch_size is not None and codes.shape[0] != self._batch_size:
            raise ValueError(f"this stream decodes a batch of {self._batch_size}, got a chunk of batch {codes.shape[0]}")
        self._batch_size = codes.shape[0]
        if codes.shape[-1] == 0:
            return FishDACDecoderOutput(torch.zeros(codes.shape[0], 1, 0, device=device))
        latents = self.codec.quantizer.decode(codes, self._state)
        audio = self.codec.decoder(latents, self._state).float()  # [batch, 1, samples]
        self.frames_decoded += codes.shape[-1]
        return FishDACDecoderOutput(audio)

    def reset(self) -> None:
        """Forget the carried state, to start a new stream."""
        self.frames_decoded, self._state, self._batch_size = 0, {}, None

    def state_size(self) -> int:
        """Number of carried tensor elements (bounded; does not grow with the frames decoded)."""
        tensors = [value if isinstance(value, tuple) else (value,) for value in self._state.values()]
        return sum(t.numel() for group in tensors for t in group if isinstance(t, Tensor))


__all__ = [
    "FishDACCodec",
    "FishDACDecoder",
    "FishDACDecoderOutput",
    "FishDACEncoder",
    "FishDACEncoderOutput",
    "FishDACOutput",
    "FishDACQuantizer",
    "FishDACStreamingDecoder",
]
