"""The original `codec.pth` layout (docs/format.md#codec-file-keys) and its conversion to the codec's own weights.

A Drama 3 checkpoint keeps its codec in `codec.pth`, a PyTorch state dict in the layout of the reference
implementation: weight-normed convolutions stored as `(g, v)` pairs and vector quantizers with separate
input/output projections. `FishDACCodec` holds them folded (one weight per conv, one lookup table per codebook).
This module knows that layout: every original key with its shape, folding while loading (bit-identical to the
reference's own folding), unfolding for saving, the strict key and shape check, and reading the file safely.

It walks the codec's module tree by attribute (`codec.encoder.blocks`, ...) and imports nothing from
`modeling_codec`; `FishDACCodec.from_codec_file`, `load_original_state_dict` and `original_state_dict` call it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn


class FishDACLoadError(ValueError):
    """A `codec.pth` file or state dict cannot be used: unreadable, not tensors only, or keys/shapes that differ."""


def _original_layout(codec: nn.Module) -> Iterator[tuple[str, str, nn.Module]]:
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


def _load_wn_conv(conv: nn.Module, tensors: dict[str, Tensor]) -> None:
    conv.weight.copy_(_fold_weight_norm(tensors["conv.parametrizations.weight.original0"],
                                        tensors["conv.parametrizations.weight.original1"]))
    conv.bias.copy_(tensors["conv.bias"])


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


def _load_vq(vq: nn.Module, tensors: dict[str, Tensor]) -> None:
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


def original_state_dict_shapes(codec: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an original `codec.pth` for `codec` with its shape (`codec` may live on the meta device)."""
    return {key: shape for prefix, kind, module in _original_layout(codec)
            for key, shape in _prefixed(prefix, _FORMATS[kind][0](module))}


def load_original_state_dict(codec: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Load a state dict in the original layout into `codec`, folding weight norm and the VQ output projections.
    Strict: missing keys, unexpected keys and wrong shapes raise `FishDACLoadError` naming them."""
    _check_keys_and_shapes(original_state_dict_shapes(codec), state_dict)
    with torch.no_grad():
        for prefix, kind, module in _original_layout(codec):
            names = _FORMATS[kind][0](module)
            _FORMATS[kind][1](module, {name: state_dict[f"{prefix}.{name}"] for name in names})


def original_state_dict(codec: nn.Module) -> dict[str, Tensor]:
    """`codec`'s weights in the original layout (float32, weight norm and VQ output projections unfolded);
    `load_original_state_dict` folds them back to the same weights, bit for bit."""
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
    tensors of `codec`, with their shapes. Reads shapes only, so `codec` may live on the meta device."""
    if is_original_layout(state_dict):
        expected = original_state_dict_shapes(codec)
    else:
        expected = {key: tuple(tensor.shape) for key, tensor in codec.state_dict().items()}
    _check_keys_and_shapes(expected, state_dict)


def load_codec_weights(codec: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Load a `codec.pth` state dict in either layout into `codec`, strictly: the original layout is folded while
    loading (`load_original_state_dict`), the folded one is copied as it is. Every weight of `codec` is written."""
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
    "FishDACLoadError",
    "check_codec_state_dict",
    "is_original_layout",
    "load_codec_state_dict",
    "load_codec_weights",
    "load_original_state_dict",
    "original_state_dict",
    "original_state_dict_shapes",
]
