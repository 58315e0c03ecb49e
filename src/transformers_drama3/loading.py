"""Loading a Drama 3 model for a command or a server: the device and dtype that "auto" means on this machine, the
model loaded there (or split over the ranks of a torchrun launch), and the dtype `from_pretrained` picks without one.

`drama3-tts` (cli.py) and `drama3-serve` (serving/) both load through this module. It imports torch and
transformers only inside its functions, so that a command's `--help` and usage errors answer at once.
"""

from __future__ import annotations

import logging
import os
from importlib.util import find_spec

# transformers' logger for kernel packages; it says, once per function, that a missing package makes a layer run
# its reference PyTorch code. The linear-attention layers of the backbone use two such packages (GPU kernels only):
KERNEL_LOGGER = "transformers.integrations.hub_kernels"
LINEAR_ATTENTION_KERNELS = {"causal_conv1d": "causal-conv1d", "fla": "flash-linear-attention"}  # module -> pip name


def under_torchrun() -> bool:
    """Launched by torchrun with several processes (`parallel.launched_with_torchrun`). parallel.py imports torch, so
    it is asked only when torchrun's `WORLD_SIZE` is set."""
    if "WORLD_SIZE" not in os.environ:
        return False
    from . import parallel

    return parallel.launched_with_torchrun()


def default_threads_wait_passively() -> None:
    """Unless the user chose otherwise, let idle OpenMP threads sleep instead of spinning (`OMP_WAIT_POLICY=PASSIVE`):
    on a CPU shared with other work, spinning threads fight it for the cores and generation ran several times slower
    (docs/performance.md, "Threads"). Read by the OpenMP runtime when torch loads, so called before torch is imported;
    the thread count stays torch's default (one per core), which the same figures favour."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def check_device(device: str) -> None:
    """Refuse a device torch does not know, or one this machine does not have, with a message saying what to use."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r} is not a device: use cpu, cuda, cuda:N, mps or xpu") from None
    if parsed.type == "cpu":
        return
    if parsed.type == "mps":
        available, count = torch.backends.mps.is_available(), 1
    elif parsed.type in ("cuda", "xpu"):
        backend = getattr(torch, parsed.type)
        available, count = backend.is_available(), backend.device_count()
    else:
        raise ValueError(f"--device {device!r}: Drama 3 does not run on {parsed.type!r} devices; use cpu, cuda or mps")
    if not available:
        build = " (this torch is built without CUDA)" if parsed.type == "cuda" and torch.version.cuda is None else ""
        raise ValueError(f"--device {device}: no {parsed.type} device is available on this machine{build}; "
                         "use --device cpu")
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"--device {device}: this machine has {count} {parsed.type} device(s), numbered from 0")


def resolve_device_and_dtype(device: str, dtype: str):
    """`--device` / `--dtype` values ("auto" or a name) -> (device, torch dtype or None), the device checked
    (`check_device`): cuda if available (under torchrun GPU `LOCAL_RANK`), else the CPU; bfloat16 on an accelerator,
    and on the CPU None: the CPU path this CPU offers (cpu_path.py; `DRAMA3_CPU_PATH` chooses another), which
    `load_model` takes when it gets no dtype."""
    import torch

    if device == "auto" and under_torchrun():
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    elif device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device)
    if dtype == "auto":
        return device, None if torch.device(device).type == "cpu" else torch.bfloat16
    return device, getattr(torch, dtype)


def dtype_label(dtype) -> str:
    """How a command names the weights it loads: the dtype, or the CPU path that a load without one takes."""
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    from .cpu_path import resolve_cpu_path

    return f"the {resolve_cpu_path()} CPU path"


def default_dtype(kwargs: dict) -> None:
    """Without a `dtype` (or with `"auto"`) on a machine with no GPU, load in float32 instead of the checkpoint's
    bfloat16: most CPUs compute bfloat16 slowly, and its rounding makes a greedy batch differ from greedy single
    runs. With a GPU (even when loading to the CPU first, to move the model later) the checkpoint's dtype stays.
    docs/usage.md#loading."""
    import torch

    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype not in (None, "auto") or torch.cuda.is_available() or torch.xpu.is_available():
        return
    if torch.backends.mps.is_available():
        return
    kwargs.pop("torch_dtype", None)
    kwargs["dtype"] = torch.float32


def load_model(path: str, device: str, dtype):
    """The model on `device` (loaded straight there on an accelerator, so a large checkpoint never sits in RAM)."""
    import torch

    from .modeling_drama3 import FishOmniForSpeech

    if torch.device(device).type == "cpu":
        weights = {} if dtype is None else {"dtype": dtype}  # none: the CPU path (`resolve_device_and_dtype`)
        return FishOmniForSpeech.from_pretrained(path, **weights).eval()
    return FishOmniForSpeech.from_pretrained(path, dtype=dtype, device_map=device).eval()


def load_parallel_model(path: str, dtype, expert_parallel: bool):
    """This rank's share of the model, split over the torchrun ranks (`transformers_drama3.parallel`)."""
    from . import parallel
    from .modeling_drama3 import FishOmniForSpeech

    config = parallel.distributed_config(expert_parallel=expert_parallel)
    return FishOmniForSpeech.from_pretrained(path, dtype=dtype, distributed_config=config).eval()


def is_kernel_fallback(record: logging.LogRecord) -> bool:
    """Whether `record` is transformers' note that a kernel package is missing (`KERNEL_LOGGER`): known by its
    logger and a stable fragment, never by parsing the package name out of the text."""
    return record.name == KERNEL_LOGGER and "reference PyTorch implementation" in record.getMessage()


def missing_kernel_packages() -> list[str]:
    """The pip names of the linear-attention kernel packages that are not installed (`LINEAR_ATTENTION_KERNELS`)."""
    return [package for module, package in LINEAR_ATTENTION_KERNELS.items() if find_spec(module) is None]
