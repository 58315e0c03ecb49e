"""Batching prepared examples for `FishOmniForSpeech.forward` (the `data_collator` of a `Trainer`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..codes import is_integer_dtype
from ..input_checks import IGNORE_INDEX


@dataclass
class Drama3SpeechCollator:
    """Left-pads examples `{"input_ids": [T_i, 1 + K], "labels": [T_i, 1 + K]}` into one batch.

    Returns `input_ids` and `labels` `[B, T, 1 + K]` and `attention_mask` `[B, T]` (int64). Padding goes on the
    left, as in the processor's prompts: the model's row positions count from the first real row, so a padded
    example computes what it computes alone. Pad rows are all-zero frame rows with mask 0 and label main id -100
    (left out of the loss). Other keys of the examples (the dataset's `name`, `text`, ...) are dropped.

    Args:
        pad_to_multiple_of: round the padded length up to a multiple of this (steadier shapes for compiled or
            CUDA-graph kernels); None pads to the longest example.
    """

    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if self.pad_to_multiple_of is not None and (
            isinstance(self.pad_to_multiple_of, bool) or not isinstance(self.pad_to_multiple_of, int)
            or self.pad_to_multiple_of < 1
        ):
            raise ValueError(f"pad_to_multiple_of must be a positive integer or None, got {self.pad_to_multiple_of!r}")

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("cannot collate an empty list of examples")
        rows = [self._rows(example, "input_ids", index) for index, example in enumerate(examples)]
        labels = [self._rows(example, "labels", index) for index, example in enumerate(examples)]
        for index, (row, label) in enumerate(zip(rows, labels)):
            if row.shape != label.shape:
                raise ValueError(
                    f"example {index}: labels {tuple(label.shape)} must have the shape of input_ids {tuple(row.shape)}"
                )
        width = rows[0].shape[1]
        if any(row.shape[1] != width for row in rows):
            raise ValueError(f"examples have frame rows of different widths: {sorted({row.shape[1] for row in rows})}")
        length = max(row.shape[0] for row in rows)
        if self.pad_to_multiple_of is not None:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(rows)
        input_ids = torch.zeros(batch, length, width, dtype=torch.long)  # [B, T, 1 + K]
        padded_labels = torch.zeros(batch, length, width, dtype=torch.long)
        padded_labels[..., 0] = IGNORE_INDEX
        attention_mask = torch.zeros(batch, length, dtype=torch.long)  # [B, T]
        for index, (row, label) in enumerate(zip(rows, labels)):
            start = length - row.shape[0]
            input_ids[index, start:], padded_labels[index, start:], attention_mask[index, start:] = row, label, 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": padded_labels}

    @staticmethod
    def _rows(example: Mapping[str, Any], key: str, index: int) -> torch.Tensor:
        if key not in example:
            raise KeyError(f"example {index} has no {key!r}: collate examples made by prepare_dataset / speech_example")
        rows = torch.as_tensor(example[key])
        if rows.ndim != 2 or rows.shape[0] == 0 or not is_integer_dtype(rows.dtype):
            raise ValueError(
                f"example {index}: {key} must be integer frame rows [rows, 1 + K], got {tuple(rows.shape)} {rows.dtype}"
            )
        return rows.long()


__all__ = ["Drama3SpeechCollator"]
