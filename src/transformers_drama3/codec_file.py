"""`codec.pth`: where a Drama 3 checkpoint keeps its codec, and the one place that handles that file.

The official checkpoint stores the codec apart from the safetensors shards, in `codec.pth`: a PyTorch state dict in
the original layout (docs/format.md#the-codec-file). `FishOmniForSpeech.from_pretrained` therefore lets transformers
build, load, place (device maps, offloading, tensor parallelism) and quantise the model *without* its codec, so none
of that machinery meets the codec's weights; the codec, read from `codec.pth`, then joins the loaded model whole, in
float32, on the device where the model takes its inputs (or on the one a device map names for `"codec"`).
`FishOmniForSpeech.save_pretrained` writes the safetensors without the codec, and `codec.pth` beside them.

Why the codec is never offloaded: it encodes and decodes through its own methods and lookup tables
(`F.embedding(ids, table)`), not through one `forward`, so accelerate's offload hooks would never bring its weights
in. It is small next to the backbone (1.6 GB in float32 for the real codec).

Memory: the codec is built in place from the memory-mapped `codec.pth` (`FishDACCodec.from_codec_file`), and its
encoding side, which only voice cloning uses, waits for the first `encode` (docs/codec.md#memory).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .audio_io import write_atomically
from .checkpoint_mapping import Drama3CheckpointError
from .configuration_drama3 import FishDACConfig
from .codec_layout import check_codec_state_dict, load_codec_state_dict, original_state_dict_shapes
from .modeling_codec import FishDACCodec

CODEC_FILE = "codec.pth"
CODEC_MODULE = "codec"  # the codec's attribute in FishOmniForSpeech, and its prefix in the model's state dict


class CodecFileStateDict(dict):
    """The state dict of a `codec.pth` (name -> tensor, memory-mapped where the file allows) that also knows the file
    it was read from (`path`), so that `attach_codec` builds the codec in place from that file."""

    def __init__(self, state_dict: dict[str, torch.Tensor], path: str | os.PathLike):
        super().__init__(state_dict)
        self.path = Path(path)


def read_codec_file(directory: str, config: FishDACConfig) -> CodecFileStateDict:
    """The state dict of `directory/codec.pth`, checked against `config` (every key and shape; either layout) before
    any weight is used. Raises `Drama3CheckpointError` if the file is missing, `FishDACLoadError` if it cannot be
    used; the file is read with `weights_only=True` (`load_codec_state_dict`), so a pickled object is never run."""
    path = os.path.join(directory, CODEC_FILE)
    if not os.path.isfile(path):
        raise Drama3CheckpointError(f"checkpoint {directory!r} has no {CODEC_FILE} (the audio codec's weights)")
    state_dict = load_codec_state_dict(path)
    with torch.device("meta"):
        check_codec_state_dict(FishDACCodec(config), state_dict)
    return CodecFileStateDict(state_dict, path)


def original_codec_key_shapes(config: FishDACConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an original `codec.pth` for `config` (docs/format.md#codec-file-keys) with its shape;
    nothing is allocated."""
    with torch.device("meta"):
        codec = FishDACCodec(config)
    return original_state_dict_shapes(codec)


def take_codec_placement(device_map):
    """`(device_map for transformers, codec device or None)`: the `"codec"` entries of a dict device map (the whole
    codec, or `"codec.<submodule>"` entries) are taken out of a copy, since transformers loads the model without its
    codec, and name where the codec goes; None (no such entry, or a map that is not a dict) means the model's input
    device. The caller's dict is left as it is.

    The codec is not split or offloaded (see the module docstring): entries that map it to several devices or to
    `"disk"` raise a `ValueError` before anything is loaded. `"cpu"` runs it on the CPU.
    """
    if not isinstance(device_map, dict):
        return device_map, None
    entries = {key: device for key, device in device_map.items()
               if key == CODEC_MODULE or key.startswith(CODEC_MODULE + ".")}
    if not entries:
        return device_map, None
    devices = {str(device) for device in entries.values()}
    if len(devices) > 1 or "disk" in devices:
        raise ValueError(
            f"device_map places the codec as {entries}, but the codec stays whole on one device and is never "
            "offloaded to disk: it encodes and decodes outside accelerate's hooks. Map 'codec' to one device "
            "(a GPU or 'cpu'), or leave it out of the map to put it where the model takes its inputs"
        )
    remaining = {key: device for key, device in device_map.items() if key not in entries}
    return remaining, torch.device(next(iter(entries.values())))


def attach_codec(model, state_dict: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Give a model loaded without its codec (`FishOmniForSpeech(config, with_codec=False)`) the codec built from
    `state_dict` (`read_codec_file`), in float32, on `device` (default: the model's input device). The weights are
    folded on the CPU, as the reference folds them, then moved.

    A state dict read from a file (`CodecFileStateDict`) gives a codec built in place from that file, its encoding
    side waiting for the first `encode` (`FishDACCodec.from_codec_file(..., defer_encoding_side=True)`): on the CPU
    the codec's resident memory is then the decoding side's weights alone. Any other state dict is copied."""
    config = model.config.codec_config
    if isinstance(state_dict, CodecFileStateDict):
        codec = FishDACCodec.from_codec_file(state_dict.path, config, defer_encoding_side=True)
    else:
        codec = FishDACCodec.from_codec_state_dict(state_dict, config)
    setattr(model, CODEC_MODULE, codec.to(device if device is not None else model.input_device))


def without_codec(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state dict without the codec's tensors (they go to `codec.pth`, not to the safetensors files)."""
    return {name: tensor for name, tensor in state_dict.items() if not name.startswith(CODEC_MODULE + ".")}


def write_codec_file(codec: FishDACCodec, directory: str) -> None:
    """Write `directory/codec.pth` in the original layout (`codec.original_state_dict()`), which the official tools
    read and which `read_codec_file` and `FishDACCodec.from_codec_file` load back to the same weights, bit for bit.

    Written to a new file that then replaces the old one: a codec loaded from the old file keeps its weights in that
    file's memory map, so the old file must never be rewritten in place (saving a model over its own checkpoint)."""
    state_dict = codec.original_state_dict()
    write_atomically(os.path.join(directory, CODEC_FILE), lambda file: torch.save(state_dict, file))


__all__ = ["CODEC_FILE", "CODEC_MODULE", "CodecFileStateDict", "attach_codec", "original_codec_key_shapes", "read_codec_file",
           "take_codec_placement", "without_codec", "write_codec_file"]
