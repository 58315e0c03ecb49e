"""Where Drama 3's modules live under accelerate device maps (`from_pretrained(device_map=...)`), and where they run.

transformers builds the device map (from `"auto"`, `max_memory` and `_no_split_modules`, or the user's dict) and
accelerate dispatches the model: modules mapped to `"cpu"` (next to a GPU) or `"disk"` keep their weights on the
meta device and hooks materialise them only inside that module's own `forward`.

The codec is the exception: it is **never offloaded**, it always sits on the model's main device (the first GPU
of the map, or the CPU). Two reasons: its weights come from `codec.pth`, which is read after transformers has
loaded and dispatched the safetensors (an offloaded codec has meta parameters that would silently ignore the
copy); and its `decode`/`encode`/streaming run through methods and lookup tables (`F.embedding(ids, table)`),
not through one `forward`, so offload hooks would never fire. It is small next to the backbone (about 1.6 GB in
float32 for the real codec). `model.codec.to(...)` moves it after loading.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.utils import logging

from .checkpoint_mapping import CODEC_MODULE, CODEC_PREFIX

logger = logging.get_logger(__name__)

_OFFLOAD_TARGETS = ("cpu", "disk")


def main_device(device_map: dict) -> int | str | torch.device:
    """The device accelerate executes on for cpu/disk-offloaded modules: the first accelerator in the map, else "cpu"."""
    return next((device for device in device_map.values() if str(device) not in _OFFLOAD_TARGETS), "cpu")


def pin_codec_to_main_device(device_map: dict, top_level_modules: list[str]) -> None:
    """Map the whole codec to the main device, in place (transformers dispatches with this same dict object).

    Entries for the codec or its submodules are replaced. A whole-model entry `""` is split into one entry per
    top-level module (`top_level_modules`): accelerate cannot keep a child in memory under an offloaded parent.
    """
    target = main_device(device_map)
    if "" in device_map:
        whole = device_map.pop("")
        for name in top_level_modules:
            device_map.setdefault(name, whole)
    for key in _codec_entries(device_map):
        del device_map[key]
    device_map[CODEC_MODULE] = target


def warn_about_codec_entries(device_map: dict) -> None:
    """Warn when a user's device map sends (part of) the codec anywhere but the main device, which is overridden."""
    target = main_device(device_map)
    moved = {key: device_map[key] for key in _codec_entries(device_map) if str(device_map[key]) != str(target)}
    if moved:
        logger.warning(
            f"device_map places {moved}, but the codec stays whole on the main device {target!r}: its weights come "
            "from codec.pth and its decoding runs outside accelerate's hooks. Use `model.codec.to(...)` after loading "
            "to move it."
        )


def _codec_entries(device_map: dict) -> list[str]:
    return [key for key in device_map if key == CODEC_MODULE or key.startswith(CODEC_PREFIX)]


def execution_device(module: nn.Module) -> torch.device:
    """Device where `module`'s weights are used: the execution device of its (or its first hooked submodule's)
    accelerate hook when the model is dispatched, else the device of its first parameter.

    Never reads the device of an offloaded parameter (those sit on the meta device).
    """
    for submodule in module.modules():
        device = _hook_execution_device(submodule)
        if device is not None:
            return device
    parameter = next(module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _hook_execution_device(module: nn.Module) -> torch.device | None:
    hook = getattr(module, "_hf_hook", None)
    for single in getattr(hook, "hooks", (hook,)):  # a SequentialHook holds several
        device = getattr(single, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return None


__all__ = ["execution_device", "main_device", "pin_codec_to_main_device", "warn_about_codec_entries"]
