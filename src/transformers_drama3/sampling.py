"""The sampling rules of Drama 3 (SPEC 6) as transformers `LogitsProcessor`s.

One draw of the official server is `sample(logits, T, top_k, top_p, keep_crossing)`: scale by `1 / max(T, 1e-5)` in
float32, sort, softmax over all candidates, keep by top-p (the token that crosses `top_p` stays for the main token,
`keep_crossing=True`, and is dropped for the codebook heads, `keep_crossing=False`), always keep rank 0, then keep
ranks `< top_k`, renormalise, draw. `TopKTopPWarper` computes the kept, scaled logits of that rule.

Repetition-aware sampling (RAS) redraws the main token with other settings when the first draw is a semantic token
among the last `window` main ids. `RepetitionAwareLogitsProcessor` returns the log-probabilities of that two-draw
procedure as a single distribution, `q = p1 * (1 - repeated) + p1(repeated) * p2`, so one draw from `q` has exactly
the law of "draw from p1; if repeated, draw again from p2", on the device and without a host round trip.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

MIN_TEMPERATURE = 1e-5


class TopKTopPWarper(LogitsProcessor):
    """Temperature, top-p (keeping or dropping the crossing token) then top-k: SPEC 6's `sample` rule.

    Returns float32 logits scaled by the temperature with `-inf` outside the kept set (`[B, C]` in, `[B, C]` out).
    """

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0, keep_crossing: bool = True):
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be at least 1 (or None for no limit), got {top_k}")
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.keep_crossing = keep_crossing

    def kept(self, scaled: torch.Tensor) -> torch.Tensor:
        """Bool mask `[B, C]` of the candidates this rule can draw, for logits already scaled."""
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, C]
        probs = sorted_logits.softmax(dim=-1)
        inclusive = probs.cumsum(dim=-1)
        keep = (inclusive - probs) < self.top_p if self.keep_crossing else inclusive <= self.top_p
        keep[..., 0] = True
        if self.top_k is not None:
            keep[..., self.top_k :] = False
        return torch.zeros_like(keep).scatter(-1, order, keep)

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        scaled = scores.float() / max(self.temperature, MIN_TEMPERATURE)
        return scaled.masked_fill(~self.kept(scaled), float("-inf"))


class RepetitionAwareLogitsProcessor(LogitsProcessor):
    """RAS over the main-token candidates (column 0 = EOS, column `1 + c` = `<|semantic:c|>`).

    `input_ids` given to `__call__` is the main-token history as candidate columns `[B, >= window]` (-1 for rows
    that are no candidate, e.g. prompt text); its last `window` entries are the window. Returns log-probabilities
    `[B, V + 1]` of the two-draw procedure (module docstring).
    """

    def __init__(self, first: TopKTopPWarper, second: TopKTopPWarper, window: int = 16):
        if window < 0:
            raise ValueError(f"ras_window must be >= 0, got {window}")
        self.first = first
        self.second = second
        self.window = window

    def repeated(self, history: torch.Tensor, num_candidates: int) -> torch.Tensor:
        """Bool `[B, V + 1]`: semantic columns present in the window of `history` `[B, H]`."""
        recent = history[:, history.shape[1] - min(self.window, history.shape[1]) :]
        hits = torch.zeros(history.shape[0], num_candidates + 1, dtype=torch.bool, device=history.device)
        hits.scatter_(1, (recent + 1).clamp(min=0), True)  # column c -> slot c + 1; "no candidate" (-1) -> slot 0
        hits = hits[:, 1:]
        hits[:, 0] = False  # EOS never triggers a redraw
        return hits

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        first = self.first(None, scores).softmax(dim=-1)  # [B, V + 1]
        if self.window == 0:
            return first.log()
        second = self.second(None, scores).softmax(dim=-1)
        repeated = self.repeated(input_ids, scores.shape[-1])
        redraw_mass = (first * repeated).sum(dim=-1, keepdim=True)  # [B, 1]
        return (first * ~repeated + redraw_mass * second).log()


def draw(log_probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from `softmax(log_probs)` `[B, C]` -> `[B]` (-inf entries are never drawn)."""
    probs = log_probs.float().softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


__all__ = ["RepetitionAwareLogitsProcessor", "TopKTopPWarper", "draw"]
