"""Where Drama 3's modules run under accelerate device maps (`from_pretrained(device_map=...)`).

transformers builds the device map (from `"auto"`, `max_memory` and `_no_split_modules`, or the user's dict) and
accelerate dispatches the model: modules mapped to `"cpu"` (next to a GPU) or `"disk"` keep their weights on the
meta device and hooks materialise them only inside that module's own `forward`. Glue code therefore never reads an
offloaded weight's device: `execution_device` asks the hooks. (The codec is never part of the map: see `codec_file`.)
"""

from __future__ import annotations

import torch
from torch import nn


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


__all__ = ["execution_device"]
