"""The one check of generation settings' values, run at every door (`generate`, `Drama3Engine.add_request`, the
CLI, manifests, the server): type, range, and that the tensor which will hold the value can hold it.

The frame step keeps the sampling settings in per-row tensors (sampling.py's `FrameSampler`): the float ones in
float32, the integer ones in int64. So a float setting must be a finite number whose float32 rounding is finite and
in range (`1e308` overflows float32; `1e-50` rounds to 0), and an integer setting must fit int64. A bool is never
taken for a number (`True` is not 1 frame), and neither is a string (`"7"`). Every refusal is a `SettingError`, a
`ValueError` naming the setting, the value and what is allowed.
"""

from __future__ import annotations

import numbers
import struct

import numpy as np

INT64_MAX = 2**63 - 1
FLOAT32_MAX = struct.unpack("<f", bytes.fromhex("ffff7f7f"))[0]  # 3.4028234663852886e+38, the largest finite float32
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes (a 64-bit integer, signed or not)

# Settings by kind, as on a `GenerationConfig` (generation_drama3.DRAMA3_GENERATION_DEFAULTS has them all).
FLAGS = ("do_sample", "fast_decode", "return_dict_in_generate", "output_scores")
COUNTS = {"max_new_tokens": 1, "stop_check_interval": 1, "ras_window": 0}  # integer settings: their least value
TEMPERATURES = ("temperature", "ras_temperature", "codebook_temperature")  # (0, float32 max] when sampling
TOP_PS = ("top_p", "ras_top_p", "codebook_top_p")  # (0, 1]
TOP_KS = ("top_k", "ras_top_k", "codebook_top_k")  # >= 0 or None (0 and None: no limit)


class SettingError(ValueError):
    """A generation setting with a value it cannot take: `setting` (its name), `value` and `allowed` (in words)."""

    def __init__(self, setting: str, value, allowed: str, hint: str = ""):
        super().__init__(f"{setting} must be {allowed}, got {short_repr(value)}{hint}")
        self.setting, self.value, self.allowed = setting, value, allowed


def short_repr(value) -> str:
    """`repr(value)`, cut to 60 characters for a message (a 5000-digit integer, a long string)."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def is_integer(value) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def float32_of(value) -> float | None:
    """`value` rounded to float32 as the frame step's tensors hold it; None when it is no real number (a bool, a
    string, ...), is not finite in float32 (NaN, an infinity, beyond about 3.4e38) or is an int beyond int64."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        return None
    if is_integer(value) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        return None  # torch reads a Python int as int64 before converting it to float32
    try:
        rounded = struct.unpack("<f", struct.pack("<f", float(value)))[0]  # OverflowError past float32's range
    except (OverflowError, ValueError):
        return None
    return rounded if abs(rounded) <= FLOAT32_MAX else None  # NaN fails the comparison too


def check_integer(name: str, value, least: int, hint: str = "") -> None:
    """An integer in `[least, INT64_MAX]` (the int64 a tensor holds it in)."""
    if not is_integer(value) or not least <= value <= INT64_MAX:
        raise SettingError(name, value, f"an integer in [{least}, {INT64_MAX}]", hint)


def check_flag(name: str, value) -> None:
    """True or False, never another value taken for one (`"no"` is truthy; 1 is a number)."""
    if not isinstance(value, bool):
        raise SettingError(name, value, "True or False")


def check_seed(value, name: str = "seed") -> None:
    """A seed `torch.Generator.manual_seed` takes: a 64-bit integer (signed or not)."""
    low, high = SEED_RANGE
    if not is_integer(value) or not low <= value <= high:
        raise SettingError(name, value, f"an integer in [{low}, {high}]")


def check_hooks(generation_config, logits_processor, stopping_criteria, streamer) -> None:
    """The objects `generate` calls or reads, by type (a `TypeError` naming the keyword): a transformers
    `GenerationConfig`, lists of callables (`LogitsProcessorList`, `StoppingCriteriaList`), a streamer with `put` and
    `end`; each may be None."""
    from transformers import GenerationConfig

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig (or None), got "
                        f"{type(generation_config).__name__}")
    for name, items in (("logits_processor", logits_processor), ("stopping_criteria", stopping_criteria)):
        if items is not None and (not isinstance(items, (list, tuple)) or not all(callable(item) for item in items)):
            raise TypeError(f"{name} must be a list of callables (transformers' {name.title().replace('_', '')}List), "
                            f"got {short_type(items)}")
    if streamer is not None and not all(callable(getattr(streamer, method, None)) for method in ("put", "end")):
        raise TypeError(f"streamer must have put() and end() (a transformers BaseStreamer), got {short_type(streamer)}")


def short_type(value) -> str:
    """The type of `value`, and of its items for a list: `int`, `list of int`."""
    if isinstance(value, (list, tuple)) and value:
        return f"{type(value).__name__} of {', '.join(sorted({type(item).__name__ for item in value}))}"
    return type(value).__name__


def check_generation_settings(values: dict) -> None:
    """Raise a `SettingError` for the first Drama 3 generation setting in `values` (a complete set: name -> value) that
    is of the wrong type, out of range, or not representable in the tensor that holds it. The sampling settings'
    ranges apply when sampling (`do_sample`); greedy decoding ignores their values, but they must still be numbers."""
    for name in FLAGS:
        check_flag(name, values[name])
    compile_step = values["compile_step"]
    if not isinstance(compile_step, bool) and not (isinstance(compile_step, str) and compile_step.strip()):
        raise SettingError("compile_step", compile_step, "True, False or a torch.compile backend name")
    for name, least in COUNTS.items():
        check_integer(name, values[name], least)
    sampling = values["do_sample"]
    for name in TEMPERATURES + TOP_PS:
        value, high = values[name], FLOAT32_MAX if name in TEMPERATURES else 1
        if value is None and not sampling:
            continue
        rounded = float32_of(value)
        if rounded is None or (sampling and not 0 < rounded <= high):
            hint = " (use do_sample=False for greedy)" if sampling and name in TEMPERATURES else ""
            raise SettingError(name, value, f"a number in (0, {high:.8g}], also once rounded to float32", hint)
    for name in TOP_KS:
        if values[name] is not None:
            check_integer(name, values[name], 0, " (0 or None: no limit)")


__all__ = ["FLOAT32_MAX", "INT64_MAX", "SEED_RANGE", "SettingError", "check_flag", "check_generation_settings",
           "check_hooks", "check_integer", "check_seed", "float32_of", "is_integer", "short_repr"]
