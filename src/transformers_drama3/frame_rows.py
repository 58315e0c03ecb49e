"""The padding layout of a batch of frame rows `[B, T, 1 + NCB]`: Drama 3 reads left-padded batches with all-zero pad
rows (what the processor makes); transformers' pipeline collator pads on the right with its pad id in every column.
Shared by the processor and `generate`, which imports nothing from the processor.
"""

from __future__ import annotations

import torch


def padded_on_the_right(attention_mask: torch.Tensor) -> bool:
    """Whether a 0/1 mask `[B, T]` has padding only on the right of some sequence (ones, then zeros)."""
    mask = attention_mask.bool()
    ones_then_zeros = ~(mask[:, 1:] & ~mask[:, :-1]).any(-1)  # no 0 -> 1 step
    return bool((ones_then_zeros & ~mask[:, -1] & mask.any(-1)).any() & ones_then_zeros.all())  # one host read


def left_pad_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of frame rows padded on either side with any pad values -> the processor's layout: each sequence's
    rows at the end, all-zero pad rows in front (`input_ids [B, T, 1 + K]`, `attention_mask [B, T]`).

    transformers' pipeline collator pads a batch on its tokenizer's side and fills pad rows with the tokenizer's pad
    id in every column; Drama 3's generation reads left-padded batches with all-zero pad rows.
    """
    mask = attention_mask.bool()  # [B, T]
    order = torch.sort(mask.to(torch.int8), dim=-1, stable=True).indices  # pad rows first, each group in order
    rows = input_ids.gather(1, order[..., None].expand_as(input_ids))  # [B, T, 1 + K]
    mask = mask.gather(1, order)
    return rows * mask[..., None], mask.to(attention_mask.dtype)


__all__ = ["left_pad_rows", "padded_on_the_right"]
