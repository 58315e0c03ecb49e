"""The original `codec.pth` layout (docs/format.md#codec-file-keys) and its conversion to the codec's own weights.

A Drama 3 checkpoint keeps its codec in `codec.pth`, a PyTorch state dict in the layout of the reference
implementation: weight-normed convolutions stored as `(g, v)` pairs and vector quantizers with separate
input/output projections. `FishDACCodec` holds them folded (one weight per conv, one lookup table per codebook).
This module knows that layout: every original key with its shape, folding while loading (bit-identical to the
reference's own folding), unfolding for saving, the strict key and shape check, and reading the file safely.

It walks the codec's module tree by attribute (`codec.encoder.blocks`, ...) and imports nothing from
`modeling_codec`; `FishDACCodec.from_codec_file`, `load_original_state_dict` and `original_state_dict` call it.

A codec may hold only some of its parts: one loaded from a file with its encoding side left for first use
(`ENCODING_SIDE`, `FishDACCodec.load_encoding_side`) has `None` in their place. The layout, the checks and
`folded_state_dict` then cover the parts present; the whole-codec operations (`load_original_state_dict`,
`load_codec_weights`, `original_state_dict`) load a waiting encoding side first.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The parts of the codec that only encoding uses (voice cloning), as paths in the codec; their keys begin with the same
# names in both layouts (`encoder.`, `quantizer.downsample.`, `quantizer.pre_module.`). About half the codec's weights.
ENCODING_SIDE = ("encoder", "quantizer.downsample", "quantizer.pre_module")


class FishDACLoadError(ValueError):
    """A `codec.pth` file or state dict cannot be used: unreadable, not tensors only, or keys/shapes that differ."""


def _original_layout(codec: nn.Module) -> Iterator[tuple[str, str, nn.Module]]:
    """`(original key prefix, format, module)` for every module holding weights, in `codec.pth` naming; parts that
    are `None` (not loaded) are left out."""
    encoder, quantizer, decoder = codec.encoder, codec.quantizer, codec.decoder
    if encoder is not None:
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

    if quantizer.codebooks is not None:
        yield "quantizer.semantic_quantizer.quantizers.0", "vq", quantizer.codebooks[0]
        for index, vq in enumerate(quantizer.codebooks[1:]):
            yield f"quantizer.quantizer.quantizers.{index}", "vq", vq
    for name, stages in (("downsample", quantizer.downsample), ("upsample", quantizer.upsample)):
        for index, stage in enumerate(stages or ()):
            yield f"quantizer.{name}.{index}.0", "conv", stage.conv
            yield f"quantizer.{name}.{index}.1", "convnext", stage.convnext
    for name in ("pre_module", "post_module"):
        if getattr(quantizer, name) is not None:
            yield f"quantizer.{name}", "transformer", getattr(quantizer, name)

    if decoder is not None:
        yield "decoder.model.0", "wn_conv", decoder.input_conv
        for index, block in enumerate(decoder.blocks, start=1):
            yield f"decoder.model.{index}.block.0", "snake", block.snake
            yield f"decoder.model.{index}.block.1", "wn_conv", block.upsample
            for unit_index, unit in enumerate(block.residual_units, start=2):
                yield from _residual_unit_layout(f"decoder.model.{index}.block.{unit_index}", unit)
        yield f"decoder.model.{len(decoder.blocks) + 1}", "snake", decoder.output_snake
        yield f"decoder.model.{len(decoder.blocks) + 2}", "wn_conv", decoder.output_conv


def _residual_unit_layout(prefix: str, unit: nn.Module) -> Iterator[tuple[str, str, nn.Module]]:
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


def _wn_conv_shapes(conv: nn.Module) -> dict[str, tuple[int, ...]]:
    weight = tuple(conv.weight.shape)
    return {
        "conv.bias": tuple(conv.bias.shape),
        "conv.parametrizations.weight.original0": (weight[0], 1, 1),
        "conv.parametrizations.weight.original1": weight,
    }


def _wn_conv_weights(conv: nn.Module, kept: dict[str, Tensor], read: dict[str, Tensor]) -> dict[str, Tensor]:
    weight = _fold_weight_norm(read["conv.parametrizations.weight.original0"], read["conv.parametrizations.weight.original1"])
    return {"weight": weight, "bias": kept["conv.bias"].float()}


def _vq_shapes(vq: nn.Module) -> dict[str, tuple[int, ...]]:
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


def _vq_weights(vq: nn.Module, kept: dict[str, Tensor], read: dict[str, Tensor]) -> dict[str, Tensor]:
    in_proj = _fold_weight_norm(read["in_proj.weight_g"], read["in_proj.weight_v"])[..., 0]  # [cb_dim, dim]
    out_proj = _fold_weight_norm(read["out_proj.weight_g"], read["out_proj.weight_v"])[..., 0]  # [dim, cb_dim]
    return {"in_proj.weight": in_proj, "in_proj.bias": kept["in_proj.bias"].float(),
            "codebook": kept["codebook.weight"].float(), "out_proj.weight": out_proj,
            "out_proj.bias": kept["out_proj.bias"].float(),
            # the lookup table of decoding: `out_proj` applied to every codebook entry, [size, dim]
            "table": F.linear(read["codebook.weight"].float(), out_proj, read["out_proj.bias"].float())}


def _weight_norm_parts(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`(g, v)` of a folded weight in the original weight-norm layout: `v = W` and `g` the norms of `W` over every dim
    but 0 exactly as `torch._weight_norm` computes them (its interface returns them), so folding them again gives
    `W * (g / g) = W`, bit for bit."""
    weight = weight.detach().float()
    _, norms = torch._weight_norm_interface(weight, torch.ones_like(weight[:, :1, :1]), 0)
    return norms, weight


def _dump_wn_conv(conv: nn.Module) -> dict[str, Tensor]:
    g, v = _weight_norm_parts(conv.weight)
    return {"conv.parametrizations.weight.original0": g, "conv.parametrizations.weight.original1": v,
            "conv.bias": conv.bias.detach().float()}


def _dump_vq(vq: nn.Module) -> dict[str, Tensor]:
    in_g, in_v = _weight_norm_parts(vq.in_proj.weight[..., None])  # conv1d weights [out, in, 1]
    out_g, out_v = _weight_norm_parts(vq.out_proj.weight[..., None])
    return {"codebook.weight": vq.codebook.detach().float(), "in_proj.weight_g": in_g, "in_proj.weight_v": in_v,
            "in_proj.bias": vq.in_proj.bias.detach().float(), "out_proj.weight_g": out_g,
            "out_proj.weight_v": out_v, "out_proj.bias": vq.out_proj.bias.detach().float()}


def _renamed(rename: Callable[[str], str]) -> tuple[Callable, Callable, Callable]:
    """Format whose original names map one to one onto the module's parameters (no folding)."""

    def shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
        return {rename(name): tuple(p.shape) for name, p in module.named_parameters()}

    def weights(module: nn.Module, kept: dict[str, Tensor], read: dict[str, Tensor]) -> dict[str, Tensor]:
        return {name: kept[rename(name)].float() for name, _ in module.named_parameters()}

    def dump(module: nn.Module) -> dict[str, Tensor]:
        return {rename(name): param.detach().float() for name, param in module.named_parameters()}

    return shapes, weights, dump


# format -> (original tensor shapes of a module; the module's own float32 parameters from its original tensors, given
# twice: `kept`, whose tensors may become the module's as they are, and `read`, the same tensors read only to fold
# them; the module's tensors in the original layout)
_FORMATS: dict[str, tuple[Callable, Callable, Callable]] = {
    "snake": _renamed(lambda name: name),
    "wn_conv": (_wn_conv_shapes, _wn_conv_weights, _dump_wn_conv),
    "conv": _renamed(lambda name: f"conv.{name}"),
    "convnext": _renamed(lambda name: name.replace("dwconv.", "dwconv.conv.")),
    "transformer": _renamed(lambda name: name),
    "vq": (_vq_shapes, _vq_weights, _dump_vq),
}


def _prefixed(prefix: str, shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, tuple[int, ...]]]:
    return ((f"{prefix}.{name}", shape) for name, shape in shapes.items())


def _preview(items: list[str], limit: int = 8) -> str:
    return str(items[:limit])[:-1] + (f", ... {len(items) - limit} more]" if len(items) > limit else "]")


def original_state_dict_shapes(codec: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an original `codec.pth` for `codec` with its shape (`codec` may live on the meta device)."""
    return {key: shape for prefix, kind, module in _original_layout(codec)
            for key, shape in _prefixed(prefix, _FORMATS[kind][0](module))}


def encoding_side_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors of a `codec.pth` state dict (either layout) that belong to the encoding side (`ENCODING_SIDE`)."""
    prefixes = tuple(f"{path}." for path in ENCODING_SIDE)
    return {key: tensor for key, tensor in state_dict.items() if key.startswith(prefixes)}


def _present_parts_only(codec: nn.Module, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state_dict` without the keys of the encoding-side parts that `codec` does not hold (`ENCODING_SIDE`)."""
    absent = tuple(f"{path}." for path in ENCODING_SIDE if _part(codec, path) is None)
    return {key: tensor for key, tensor in state_dict.items() if not key.startswith(absent)} if absent else state_dict


def _part(codec: nn.Module, path: str) -> nn.Module | None:
    module = codec
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _own_shapes(codec: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shapes of `codec`'s own (folded) state dict, parts present only. `nn.Module.state_dict` itself: a codec's
    `state_dict` loads a waiting encoding side first."""
    return {key: tuple(tensor.shape) for key, tensor in nn.Module.state_dict(codec, keep_vars=True).items()}


def _load_waiting_encoding_side(codec: nn.Module) -> None:
    """Load `codec`'s encoding side now if it waits for first use (`FishDACCodec.load_encoding_side`)."""
    load = getattr(codec, "load_encoding_side", None)
    if load is not None:
        load()


def folded_state_dict(codec: nn.Module, state_dict: dict[str, Tensor],
                      read_from: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """`codec`'s own state dict (the folded layout, float32), for the parts `codec` holds, from a `codec.pth` state dict
    in either layout (checked first: `check_codec_state_dict`).

    Tensors that the codec keeps as stored are taken from `state_dict` as they are (float32 ones are the very same
    tensors: no copy, so a memory-mapped file's pages become the codec's weights). Folded ones (weight norm, the VQ
    lookup tables) are computed from the same tensors of `read_from` (default: `state_dict`): a second memory map of
    the file, whose pages, read only to fold them, go when it is dropped."""
    check_codec_state_dict(codec, state_dict)
    read_from = state_dict if read_from is None else read_from
    if not is_original_layout(state_dict):
        return {key: state_dict[key].float() for key in _own_shapes(codec)}
    paths = {id(module): path for path, module in codec.named_modules()}
    folded = {}
    for prefix, kind, module in _original_layout(codec):
        names = _FORMATS[kind][0](module)
        kept = {name: state_dict[f"{prefix}.{name}"] for name in names}
        read = {name: read_from[f"{prefix}.{name}"] for name in names}
        with torch.no_grad():
            weights = _FORMATS[kind][1](module, kept, read)
        folded.update((f"{paths[id(module)]}.{name}", tensor) for name, tensor in weights.items())
    return folded


def load_original_state_dict(codec: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Load a state dict in the original layout into `codec` (copied into its weights), folding weight norm and the
    VQ output projections. Strict: missing keys, unexpected keys and wrong shapes raise `FishDACLoadError` naming
    them."""
    _load_waiting_encoding_side(codec)
    codec.load_state_dict(folded_state_dict(codec, state_dict))


def original_state_dict(codec: nn.Module) -> dict[str, Tensor]:
    """`codec`'s weights in the original layout (float32, weight norm and VQ output projections unfolded);
    `load_original_state_dict` folds them back to the same weights, bit for bit."""
    _load_waiting_encoding_side(codec)
    return {f"{prefix}.{name}": tensor for prefix, kind, module in _original_layout(codec)
            for name, tensor in _FORMATS[kind][2](module).items()}


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


def check_codec_state_dict(codec: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Raise `FishDACLoadError` naming what differs unless `state_dict` (original or folded layout) holds exactly the
    tensors of `codec`, with their shapes; the keys of encoding-side parts that `codec` does not hold (yet) are not
    looked at. Reads shapes only, so `codec` may live on the meta device."""
    expected = original_state_dict_shapes(codec) if is_original_layout(state_dict) else _own_shapes(codec)
    _check_keys_and_shapes(expected, _present_parts_only(codec, state_dict))


def load_codec_weights(codec: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Load a `codec.pth` state dict in either layout into `codec` (copied into its weights), strictly: the original
    layout is folded while loading (`load_original_state_dict`), the folded one is copied as it is. Every weight of
    `codec` is written (a waiting encoding side is loaded first, then overwritten)."""
    _load_waiting_encoding_side(codec)
    check_codec_state_dict(codec, state_dict)
    if is_original_layout(state_dict):
        load_original_state_dict(codec, state_dict)
    else:
        codec.load_state_dict(state_dict)


def load_codec_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Read an original `codec.pth` as a state dict, safely (`weights_only=True`, memory-mapped when possible).

    Unwraps `{"state_dict": ...}`, strips `generator.` prefixes and drops `...causal_mask` buffers. A file that
    holds pickled objects other than tensors is refused (never executed) with `FishDACLoadError`.
    """
    return _read_state_dict(path)[0]


def memory_maps(path: str | Path, count: int) -> list[dict[str, Tensor]] | None:
    """`count` state dicts of `codec.pth` (as `load_codec_state_dict` reads it), each a memory map of its own: a
    tensor costs memory only once its pages are read, and a map's pages go with the last tensor viewing them. None
    for a file in the legacy format, which cannot be memory-mapped. Raises `FishDACLoadError` if the file is replaced
    or rewritten while it is being read (the maps would not hold the same weights)."""
    before = _identity(path)
    maps = [_read_state_dict(path) for _ in range(count)]
    if _identity(path) != before:
        raise FishDACLoadError(f"{path} changed while it was being read; load it again")
    return [state_dict for state_dict, _ in maps] if all(mapped for _, mapped in maps) else None


def _identity(path: str | Path) -> tuple[int, ...]:
    status = os.stat(path)
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _read_state_dict(path: str | Path) -> tuple[dict[str, Tensor], bool]:
    """`load_codec_state_dict`'s state dict, and whether it is memory-mapped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"codec file not found: {path}")
    mapped = True
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:  # legacy (non-zip) files cannot be memory-mapped
            if "mmap" not in str(error):
                raise
            loaded, mapped = torch.load(path, map_location="cpu", weights_only=True), False
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        raise FishDACLoadError(
            f"{path} is not a tensors-only PyTorch state dict and was refused (it was loaded with weights_only=True, "
            f"so nothing in it was executed): {str(error).splitlines()[0]}"
        ) from error
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()):
        raise FishDACLoadError(f"{path} does not hold a state dict (a dict of name -> tensor)")
    state_dict = {key.removeprefix("generator."): value for key, value in loaded.items()
                  if not key.endswith("causal_mask")}
    return state_dict, mapped


class EncodingSideSource:
    """What a waiting encoding side is loaded from: two memory maps of the codec's `codec.pth` made with the codec's
    own (`kept`: tensors that become weights; `read`: tensors read only to fold), so that it has the weights of the
    file the rest came from even if that file is replaced later. A map costs memory only for the pages read."""

    def __init__(self, kept: dict[str, Tensor], read: dict[str, Tensor]):
        self.kept, self.read, self.lock = kept, read, threading.Lock()

    def __deepcopy__(self, memo) -> EncodingSideSource:
        return self  # read-only maps of one file: a copy of the codec loads from the same ones

    def __getstate__(self) -> dict:
        return {"kept": self.kept, "read": self.read}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["kept"], state["read"])


def encoding_side_modules(codec: nn.Module) -> tuple[nn.Module | None, ...]:
    """The modules of `ENCODING_SIDE`, in its order."""
    return codec.encoder, codec.quantizer.downsample, codec.quantizer.pre_module


def set_encoding_side(codec: nn.Module, encoder, downsample, pre_module) -> None:
    """Put the modules of `ENCODING_SIDE` in place (None: the encoding side waits for first use)."""
    codec.encoder, codec.quantizer.downsample, codec.quantizer.pre_module = encoder, downsample, pre_module


__all__ = [
    "ENCODING_SIDE",
    "EncodingSideSource",
    "FishDACLoadError",
    "check_codec_state_dict",
    "encoding_side_modules",
    "encoding_side_state_dict",
    "folded_state_dict",
    "is_original_layout",
    "load_codec_state_dict",
    "load_codec_weights",
    "load_original_state_dict",
    "memory_maps",
    "original_state_dict",
    "original_state_dict_shapes",
    "set_encoding_side",
]
