"""Codec codes, checked once for the whole package: the codec, the processor and voice files all use `check_codes`.

Codes are integer ids, one row per codebook: `[num_codebooks, frames]` for one recording (a reference, a voice, a
history turn), `[batch, num_codebooks, frames]` for the codec's batches (docs/format.md#the-codec).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether `dtype` holds integer ids (not floating point, complex or bool)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_codes(codes: Any, num_codebooks: int | None, where: str = "codes", *, batched: bool = False,
                vocab_size: int | None = None) -> torch.Tensor:
    """`codes` (a tensor, numpy array or nested list) as an int64 tensor on its device, or a `ValueError` that says
    what is wrong: ids that are not integers, a shape other than `[num_codebooks, frames]` (`[batch, num_codebooks,
    frames]` when `batched`; any number of codebooks when `num_codebooks` is None), a negative id, or (with
    `vocab_size`) an id at or above it."""
    if not isinstance(codes, torch.Tensor):
        if not isinstance(codes, (np.ndarray, list, tuple)):
            raise TypeError(f"{where} must be a torch.Tensor or numpy array; got {type(codes).__name__}")
        codes = torch.as_tensor(np.asarray(codes))
    if not is_integer_dtype(codes.dtype):
        raise ValueError(f"{where} must hold integer ids (torch.long); got {codes.dtype}")
    rows = "num_codebooks" if num_codebooks is None else num_codebooks
    shape = f"[batch, {rows}, frames]" if batched else f"[{rows}, frames]"
    if codes.ndim != 2 + batched or codes.shape[-2] != (codes.shape[-2] if num_codebooks is None else num_codebooks):
        transposed = num_codebooks is not None and codes.ndim == 2 + batched and codes.shape[-1] == num_codebooks
        raise ValueError(f"{where} must have shape {shape} (one row per codebook); got {list(codes.shape)}"
                         + (" (transposed? codes are [codebooks, frames])" if transposed else ""))
    if codes.numel():
        low, high = torch.stack(torch.aminmax(codes)).tolist()  # one device-to-host copy for both
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            limit = vocab_size if vocab_size is not None else "codebook size"
            raise ValueError(f"{where} has ids out of range [0, {limit}): min {low}, max {high}")
    return codes.long()


__all__ = ["check_codes", "is_integer_dtype"]
