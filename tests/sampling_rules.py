"""The sampling rules with one setting for all rows, as the tests state their cases: thin wrappers that call the
package's per-row `kept_logits` and `ras_log_probs` with that setting repeated on every row."""

from __future__ import annotations

import torch

from transformers_drama3.generation.sampling import kept_logits, ras_log_probs


def _per_row(scores: torch.Tensor, value) -> torch.Tensor:
    return torch.full((scores.shape[0],), value, device=scores.device)


class ScalarRule:
    """Temperature, top-p (keeping or dropping the crossing token), then top-k (None: no limit): `kept_logits`."""

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
                 keep_crossing: bool = True):
        self.temperature, self.top_k, self.top_p, self.keep_crossing = temperature, top_k, top_p, keep_crossing

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:  # [B, C] -> [B, C]
        return kept_logits(scores, _per_row(scores, float(self.temperature)), _per_row(scores, self.top_k or 0),
                           _per_row(scores, float(self.top_p)), self.keep_crossing)


class ScalarRas:
    """Repetition-aware sampling with one window for all rows: `ras_log_probs` of two `ScalarRule`s, over a
    history `[B, >= window]` of candidate columns (its last `window` entries are the window)."""

    def __init__(self, first: ScalarRule, second: ScalarRule, window: int = 16):
        self.first, self.second, self.window = first, second, window

    def __call__(self, history: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [B, V + 1] log-probs
        second = self.second(None, scores) if self.window else None
        return ras_log_probs(history, _per_row(scores, self.window), self.first(None, scores), second)
