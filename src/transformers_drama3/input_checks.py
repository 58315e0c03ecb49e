"""The checks of `FishOmniForSpeech`'s inputs: layouts first (nothing read back), then values as `Problem`s that
`raise_first_problem` reads back in one host sync, so a bad input gets a clear error before any work and a good one
costs one read.

`forward` and `generate` check through `FishOmniForSpeech.checked_inputs`; `generate` also checks layouts before
transformers' `generate` looks at its inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .codes import is_integer_dtype

IGNORE_INDEX = -100  # a label row's main id that leaves the row out of the loss
# A check of input values: a bool tensor marking offending entries, and the error message for them (built only when
# one is found). `raise_first_problem` reads all of a call's checks back at once.
Problem = tuple[torch.Tensor, Callable[[torch.Tensor], str]]


def check_frame_layout(frames, name: str, num_codebooks: int) -> None:
    """Raise a clear error for frame rows of the wrong type, shape or dtype (no data is read; the values are
    checked by `frame_problems`)."""
    ncb = num_codebooks
    if not isinstance(frames, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of frame rows [batch, rows, {1 + ncb}], got {type(frames).__name__}")
    if frames.dim() != 3 or frames.shape[-1] != 1 + ncb:
        raise ValueError(
            f"{name} must be frame rows [batch, rows, {1 + ncb}] ([main_id, c0..c{ncb - 1}], as the processor "
            f"returns them), got shape {tuple(frames.shape)}"
        )
    if not is_integer_dtype(frames.dtype):
        raise ValueError(f"{name} must hold integer ids, got {frames.dtype}")
    if frames.shape[0] == 0 or frames.shape[1] == 0:
        raise ValueError(f"{name} must hold at least one prompt row per sequence, got shape {tuple(frames.shape)}")

def frame_problems(frames: torch.Tensor, name: str, config, audio: torch.Tensor) -> list[Problem]:
    """What can be wrong with the values of frame rows of a valid layout, as `Problem`s (nothing is read back):
    main ids outside the vocabulary, text rows with codes, audio rows whose codes lie outside `[0, V)` or whose
    main id and c0 disagree (`audio`: the rows whose main id is in the semantic band); the message names the first offending row and column."""
    ncb, vocab, codebook = config.num_codebooks, config.text_config.vocab_size, config.codebook_size
    start, end = config.semantic_start_token_id, config.semantic_end_token_id
    main = frames[..., 0]

    def at(bad: torch.Tensor) -> list[int]:  # [b, t] or [b, t, column] of the first True entry
        return bad.nonzero()[0].tolist()

    def main_outside(bad):
        b, t = at(bad)
        return f"{name}[{b}, {t}, 0] = {int(main[b, t])}: main ids must lie in the text vocabulary [0, {vocab})"

    def text_with_codes(bad):
        b, t, c = at(bad)
        return (f"{name}[{b}, {t}, {c + 1}] = {int(frames[b, t, c + 1])}: a text row (main id {int(main[b, t])}, "
                f"outside the semantic band [{start}, {end}]) must have all codes 0; an audio row is "
                f"[semantic_start + c0, c0, ..., c{ncb - 1}]")

    def codes_outside(bad):
        b, t, c = at(bad)
        return f"{name}[{b}, {t}, {c + 1}] = {int(frames[b, t, c + 1])}: codes of an audio row must lie in [0, {codebook})"

    def mismatch(bad):
        b, t = at(bad)
        return f"{name}[{b}, {t}, 0]: an audio row's main id must be semantic_start + c0"

    return [
        ((main < 0) | (main >= vocab), main_outside),
        (~audio[..., None] & (frames[..., 1:] != 0), text_with_codes),
        (audio[..., None] & ((frames[..., 1:] < 0) | (frames[..., 1:] >= codebook)), codes_outside),
        (audio & (main - start != frames[..., 1]), mismatch),
    ]


def label_problems(labels: torch.Tensor, row_mask: torch.Tensor, config, audio: torch.Tensor) -> list[Problem]:
    """What can be wrong with the values of labels of the right layout, as `Problem`s (`audio`: the label rows whose
    main id is in the semantic band)."""
    main = labels[..., 0].long()  # [B, T]
    text_vocab, vocab = config.text_config.vocab_size, config.codebook_size
    counted_audio = (main != IGNORE_INDEX) & row_mask & audio
    codes = labels[..., 2:]  # [B, T, NCB-1]

    def main_outside(bad):
        b, t = bad.nonzero()[0].tolist()
        return (f"labels[{b}, {t}, 0] = {int(main[b, t])}: label main ids must lie in the text vocabulary "
                f"[0, {text_vocab}), or be {IGNORE_INDEX} to leave the row out of the loss")

    return [
        ((main != IGNORE_INDEX) & ((main < 0) | (main >= text_vocab)), main_outside),
        (counted_audio[..., None] & ((codes < 0) | (codes >= vocab)),
         lambda bad: f"labels have codes outside [0, {vocab - 1}] on audio rows"),
    ]


def attention_mask_layout(attention_mask, batch: int, past: int, rows: int, device) -> torch.Tensor:
    """The long mask `[B, past + T]` (all ones when none is given) after its type and shape checks (nothing read)."""
    if attention_mask is None:
        return torch.ones(batch, past + rows, dtype=torch.long, device=device)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor [batch, rows], got {type(attention_mask).__name__}")
    if attention_mask.shape != (batch, past + rows):
        raise ValueError(
            f"attention_mask must be [batch, cached rows + new rows] = [{batch}, {past + rows}], got "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype.is_complex:
        raise ValueError("attention_mask must hold 0 (left padding) and 1 (real rows) only")
    return attention_mask.long()

def mask_problems(attention_mask: torch.Tensor) -> list[Problem]:
    """What can be wrong with the values of an attention mask of the right shape, as `Problem`s."""
    mask = attention_mask.long()

    def first_row(bad) -> int:
        return int(bad.nonzero()[0, 0])

    return [
        (((attention_mask != 0) & (attention_mask != 1)),
         lambda bad: "attention_mask must hold 0 (left padding) and 1 (real rows) only"),
        (mask.sum(-1) == 0,
         lambda bad: f"attention_mask row {first_row(bad)} is all zeros: that sequence has no real row to condition "
                     "on (1 marks a real row, 0 left padding)"),
        ((mask[:, 1:] < mask[:, :-1]).any(-1),
         lambda bad: f"attention_mask row {first_row(bad)} has padding (0) after real rows: Drama 3 takes "
                     "left-padded batches, padding first (the processor pads that way)"),
    ]


def raise_first_problem(problems: list[Problem]) -> None:
    """Raise a `ValueError` with the message of the first problem found, reading every flag back in one host sync."""
    if not problems:
        return
    device = problems[0][0].device
    found = torch.stack([bad.any().to(device) for bad, _ in problems]).tolist()
    for (bad, message), hit in zip(problems, found):
        if hit:
            raise ValueError(message(bad))


__all__ = ["IGNORE_INDEX", "Problem", "attention_mask_layout", "check_frame_layout", "frame_problems", "label_problems",
           "mask_problems", "raise_first_problem"]
