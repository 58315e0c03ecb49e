"""The sampling rules of Drama 3 (docs/format.md, "Sampling") as transformers `LogitsProcessor`s.

One draw of the official server is `sample(logits, T, top_k, top_p, keep_crossing)`: scale by `1 / max(T, 1e-5)` in
float32, sort, softmax over all candidates, keep by top-p (the token that crosses `top_p` stays for the main token,
`keep_crossing=True`, and is dropped for the codebook heads, `keep_crossing=False`), always keep rank 0, then keep
ranks `< top_k`, renormalise, draw. `TopKTopPWarper` computes the kept, scaled logits of that rule.

Repetition-aware sampling (RAS) redraws the main token with other settings when the first draw is a semantic token
among the last `window` main ids. `RepetitionAwareLogitsProcessor` returns the log-probabilities of that two-draw
procedure as a single distribution, `q = p1 * (1 - repeated) + p1(repeated) * p2`, so one draw from `q` has exactly
the law of "draw from p1; if repeated, draw again from p2", on the device and without a host round trip.

`draw` takes its randomness as uniform noise (an exponential race, exact), and `FrameSampler` makes all the draws
of one frame from a single noise tensor, filled outside the frame step (so a captured CUDA graph replays with new
noise each frame, and seeds work as usual).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

MIN_TEMPERATURE = 1e-5
CODEBOOK_TOP_K_CAP = 30  # codebook top-k is capped at 30 (docs/format.md, "Codebook heads")
# Settings a sampling frame step depends on (besides do_sample).
SAMPLING_SETTINGS = (
    "temperature", "top_k", "top_p", "ras_window", "ras_temperature", "ras_top_k", "ras_top_p",
    "codebook_temperature", "codebook_top_k", "codebook_top_p",
)


class TopKTopPWarper(LogitsProcessor):
    """Temperature, top-p (keeping or dropping the crossing token) then top-k: the draw rule of docs/format.md ("The draw rule").

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


def draw(
    log_probs: torch.Tensor, generator: torch.Generator | None = None, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """One draw per row from `softmax(log_probs)` `[B, C]` -> `[B]` (-inf entries are never drawn).

    Exponential race (the Gumbel-max trick): with `E_i = -log(u_i)` for uniform `u` `[B, C]` in [0, 1), the index of
    the largest `p_i / E_i` has law `p` exactly. `noise` is that `u` (taken from `generator` when not given), so a
    caller can draw all the randomness of a step at once, outside a captured CUDA graph.
    """
    if noise is None:
        noise = torch.rand(log_probs.shape, generator=generator, device=log_probs.device)
    return (log_probs.float() - torch.log(-torch.log(noise))).argmax(dim=-1)


class FrameSampler:
    """The draws of one frame of `generate` (docs/format.md, "Sampling"): the main token with RAS, then codes 1..NCB-1.

    Built from the generation settings. All randomness of a frame is one uniform tensor `[B, NCB, V + 1]`
    (`fill_noise`): the main token draws from `noise[:, 0]`, codebook `j` from `noise[:, j, :V]`. With
    `do_sample=False` every draw is an argmax and no noise is used.
    """

    def __init__(self, rows: int, ras_window: int, device):
        # TEMPORARY (until per-row tensors land): one settings object for all rows.
        self.do_sample, self.key, self.settings = False, (False,), None

    def set_rows(self, index, settings) -> None:
        self.settings = settings
        self.do_sample = settings.do_sample
        self.main_processor = RepetitionAwareLogitsProcessor(
            TopKTopPWarper(settings.temperature, settings.top_k or None, settings.top_p, keep_crossing=True),
            TopKTopPWarper(settings.ras_temperature, settings.ras_top_k or None, settings.ras_top_p, keep_crossing=True),
            window=settings.ras_window,
        )
        codebook_top_k = min(settings.codebook_top_k or CODEBOOK_TOP_K_CAP, CODEBOOK_TOP_K_CAP)
        self.codebook_warper = TopKTopPWarper(
            settings.codebook_temperature, codebook_top_k, settings.codebook_top_p, keep_crossing=False
        )
        self.key = (self.do_sample,)

    def copy_rows(self, other, index) -> None:
        if other.settings is not None:
            self.set_rows(None, other.settings)

    def fill_noise(self, noise: torch.Tensor, generators: torch.Generator | list | None) -> None:
        """Fill `noise` `[b, NCB, V + 1]` with one frame's uniforms, in place (nothing to do when greedy).

        `generators` is one `torch.Generator` (or None: torch's default) for all rows, or a list with one per row, so
        that each sequence draws from its own stream (None entries, for padding rows, are left as they are).
        """
        if not self.do_sample:
            return
        if not isinstance(generators, list):
            noise.uniform_(generator=generators)
            return
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].uniform_(generator=generator)

    def main(self, logits: torch.Tensor, history: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Candidate column `[B]` of the main token from its logits `[B, V + 1]` (float32) and the RAS history."""
        if not self.do_sample:
            return logits.argmax(-1)
        return draw(self.main_processor(history, logits), noise=noise[:, 0])

    def codebook(self, logits: torch.Tensor, index: int, noise: torch.Tensor | None) -> torch.Tensor:
        """Code `[B]` of codebook `index` (1..NCB-1) from its head's logits `[B, V]`."""
        if not self.do_sample:
            return logits.argmax(-1)
        return draw(self.codebook_warper(None, logits), noise=noise[:, index, : logits.shape[-1]])


__all__ = ["FrameSampler", "RepetitionAwareLogitsProcessor", "TopKTopPWarper", "draw"]
