"""The sampling rules of Drama 3 with one setting per row, as tensors (docs/format.md, "Sampling").

`kept_logits` is the official draw rule; `ras_log_probs` folds repetition-aware sampling ("draw; if the draw repeats a
recent semantic token, draw again with other settings") into one distribution with the same law,
`q = p1 * (1 - repeated) + p1(repeated) * p2`, so no host round trip is needed; `draw` takes its randomness as uniform
noise. `FrameSampler` holds a frame state's per-row settings and noise; `request_generator` makes a request's stream.
"""

from __future__ import annotations

import torch

from ..settings_checks import check_seed

MIN_TEMPERATURE = 1e-5
CODEBOOK_TOP_K_CAP = 30  # codebook top-k is capped at 30 (docs/format.md, "Codebook heads")
# Per-row settings of a `FrameSampler` (besides do_sample), named as on a GenerationConfig.
FLOAT_SETTINGS = ("temperature", "top_p", "ras_temperature", "ras_top_p", "codebook_temperature", "codebook_top_p")
INTEGER_SETTINGS = ("top_k", "ras_window", "ras_top_k", "codebook_top_k")  # top-k 0: no limit
SAMPLING_SETTINGS = FLOAT_SETTINGS + INTEGER_SETTINGS


def kept_logits(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                keep_crossing: bool, rank_limit: int | None = None) -> torch.Tensor:
    """The draw rule of docs/format.md ("The draw rule") with one setting per row: float32 logits `[B, C]` scaled by
    the row's temperature, `-inf` outside its kept set.

    `scores` `[B, C]`; `temperature` `[B]` (floored at 1e-5); `top_k` `[B]` long (0: no limit); `top_p` `[B]` in
    (0, 1]. `keep_crossing` keeps the rank that crosses `top_p` (main token) or drops it (codebook heads).
    `rank_limit`: a bound on every row's top-k known beforehand (the codebooks' cap): only that many ranks are
    ordered (`topk` instead of a sort of all C; their probabilities against the log-sum-exp of all), the same rule.
    """
    scaled = scores.float() / temperature.float().clamp(min=MIN_TEMPERATURE)[:, None]  # [B, C]
    if rank_limit is None or rank_limit >= scores.shape[-1]:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, C]
        probs = sorted_logits.softmax(dim=-1)
    else:
        sorted_logits, order = scaled.topk(rank_limit, dim=-1)  # [B, R] the first R ranks, in order
        probs = (sorted_logits - scaled.logsumexp(dim=-1, keepdim=True)).exp()
    inclusive = probs.cumsum(dim=-1)
    top_p = top_p.float()[:, None]  # [B, 1]
    keep = (inclusive - probs) < top_p if keep_crossing else inclusive <= top_p  # [B, C] by rank
    limit = torch.where(top_k > 0, top_k, scores.shape[-1])[:, None]  # [B, 1]
    keep &= torch.arange(keep.shape[-1], device=scores.device) < limit
    keep[:, 0] = True
    kept = torch.zeros_like(scaled, dtype=torch.bool).scatter(-1, order, keep)  # [B, C] by candidate
    return scaled.masked_fill(~kept, float("-inf"))


def repeated_candidates(history: torch.Tensor, window: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """Bool `[B, V + 1]`: semantic columns among the last `window[b]` entries of `history` `[B, H]` (candidate columns,
    -1 for no candidate; a window longer than `H` sees all of it). EOS (column 0) never counts."""
    width = history.shape[1]
    in_window = torch.arange(width, device=history.device) >= width - window.to(history.device)[:, None]  # [B, H]
    recent = torch.where(in_window, history, -1)
    hits = torch.zeros(history.shape[0], num_candidates + 1, dtype=torch.bool, device=history.device)
    hits.scatter_(1, (recent + 1).clamp(min=0), True)  # column c -> slot c + 1; "no candidate" (-1) -> slot 0
    hits = hits[:, 1:]
    hits[:, 0] = False  # EOS never triggers a redraw
    return hits


def ras_log_probs(history: torch.Tensor, window: torch.Tensor, first: torch.Tensor,
                  second: torch.Tensor | None) -> torch.Tensor:
    """Log-probabilities `[B, V + 1]` of the two-draw RAS procedure (module docstring) from the kept logits of the first
    and second rules (`[B, V + 1]`, `kept_logits`), the main-token history `[B, H]` and the windows `[B]` (0: the
    first rule alone). `second=None` when no row has a window."""
    first = first.softmax(dim=-1)  # [B, V + 1]
    if second is None:
        return first.log()
    second = second.softmax(dim=-1)
    repeated = repeated_candidates(history, window, first.shape[-1])
    redraw_mass = (first * repeated).sum(dim=-1, keepdim=True)  # [B, 1]
    return (first * ~repeated + redraw_mass * second).log()


def draw(log_probs: torch.Tensor, generator: torch.Generator | None = None,
         noise: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row from `softmax(log_probs)` `[B, C]` -> `[B]` (-inf entries are never drawn).

    Exponential race (the Gumbel-max trick): with `E_i = -log(u_i)` for uniform `u` `[B, C]` in [0, 1), the index of
    the largest `p_i / E_i` has law `p` exactly. `noise` is that `u` (taken from `generator` when not given), so a
    caller can draw all the randomness of a step at once, outside a captured CUDA graph.
    """
    if noise is None:
        noise = torch.rand(log_probs.shape, generator=generator, device=log_probs.device)
    return (log_probs.float() - torch.log(-torch.log(noise))).argmax(dim=-1)


class FrameSampler:
    """The per-row settings and noise of one frame's draws (docs/format.md, "Sampling") for `rows` sequences, each
    with its own settings; `rules.Drama3FrameSampling` makes the draws from them.

    The settings are tensors `[rows]` at fixed addresses (a captured CUDA graph reads them there): `do_sample` and
    `SAMPLING_SETTINGS`, named as on a GenerationConfig (top-k 0: no limit; `codebook_top_k` capped at 30; `ras_window`
    at most the history width given here, 0: no RAS). A new sampler's rows are greedy.

    All randomness of a frame is one uniform tensor `[rows, NCB, V + 1]` (`fill_noise`): the main token draws from
    `noise[:, 0]`, codebook `j` from `noise[:, j, :V]`; greedy rows take the argmax and use no noise.
    """

    def __init__(self, rows: int, ras_window: int, device: torch.device | str | None = None):
        if rows < 1 or ras_window < 0:
            raise ValueError(f"a FrameSampler needs rows >= 1 and a RAS history width >= 0, got {rows} and {ras_window}")
        self.rows, self.history_width = rows, ras_window
        self.do_sample = torch.zeros(rows, dtype=torch.bool, device=device)  # [rows]
        for name in FLOAT_SETTINGS:
            setattr(self, name, torch.ones(rows, device=device))  # [rows] float32
        for name in INTEGER_SETTINGS:
            setattr(self, name, torch.zeros(rows, dtype=torch.long, device=device))  # [rows]
        self.sampled_rows = [False] * rows  # do_sample on the host: the key and fill_noise read it, never the step

    @property
    def sampling(self) -> bool:
        """Whether any row samples (host-known): without, every draw of the frame is a plain argmax."""
        return any(self.sampled_rows)

    @property
    def key(self) -> tuple:
        """What a captured step bakes in besides the tensors' addresses: the argmax-only step or the sampling one (any
        mix of settings runs in the latter; changing a temperature never needs a new capture)."""
        return (self.sampling,)

    def _host_rows(self, index: torch.Tensor | slice) -> list[int]:
        if isinstance(index, slice):
            return list(range(self.rows)[index])
        if not isinstance(index, torch.Tensor) or index.dtype != torch.long or index.dim() != 1:
            raise TypeError(f"rows are given as a slice or a 1-D LongTensor of row numbers, got {index!r}")
        return index.tolist()

    def set_rows(self, index: torch.Tensor | slice, settings) -> None:
        """Write one settings object's values into rows `index` (a LongTensor `[n]` or a slice), in place.

        `settings` has the Drama 3 attribute names of a generation config (`do_sample`, `temperature`, `top_k`,
        `ras_window`, `codebook_top_p`, ...), checked already (`generation_settings`). Greedy rows get neutral values
        (their other settings may be anything). A RAS window longer than the history width sees the whole history.
        """
        rows = self._host_rows(index)
        do_sample = bool(settings.do_sample)
        if do_sample:
            values = {name: getattr(settings, name) for name in SAMPLING_SETTINGS}
            for name in ("top_k", "ras_top_k"):
                values[name] = values[name] or 0  # None or 0: no limit
            values["codebook_top_k"] = min(values["codebook_top_k"] or CODEBOOK_TOP_K_CAP, CODEBOOK_TOP_K_CAP)
            values["ras_window"] = min(values["ras_window"], self.history_width)
        else:
            values = {**dict.fromkeys(FLOAT_SETTINGS, 1.0), **dict.fromkeys(INTEGER_SETTINGS, 0)}
        if isinstance(index, torch.Tensor):
            index = index.to(self.do_sample.device)
        self.do_sample[index] = do_sample
        for name, value in values.items():
            getattr(self, name)[index] = value
        for row in rows:
            self.sampled_rows[row] = do_sample

    def copy_rows(self, other: FrameSampler, index: torch.Tensor) -> None:
        """Copy rows `index` `[n]` of `other` into rows `[0, n)`, in place (sequences moving between states); the
        rows from `n` on keep their settings. RAS windows are cut to this sampler's history width."""
        rows = self._host_rows(index)
        index = index.to(other.do_sample.device)
        count = len(rows)
        for name in ("do_sample", *SAMPLING_SETTINGS):
            getattr(self, name)[:count] = getattr(other, name)[index].to(self.do_sample.device)
        self.ras_window.clamp_(max=self.history_width)
        self.sampled_rows[:count] = [other.sampled_rows[row] for row in rows]

    def fill_noise(self, noise: torch.Tensor, generators: torch.Generator | list | None) -> None:
        """Fill `noise` `[rows, NCB, V + 1]` with one frame's uniforms, in place (nothing to do when no row samples).

        `generators` is one `torch.Generator` (or None: torch's default) for all rows, or a list with one per row, so
        that each sequence draws from its own stream (None entries, for padding rows, and greedy rows are left as
        they are).
        """
        if not self.sampling:
            return
        if not isinstance(generators, list):
            noise.uniform_(generator=generators)
            return
        for row, generator in enumerate(generators):
            if generator is not None and self.sampled_rows[row]:
                noise[row].uniform_(generator=generator)


def request_generator(seed: int | None, generator: torch.Generator | None, device) -> torch.Generator:
    """The random stream of one request: `generator` itself, or a new one on `device` seeded with `seed` (a fresh
    random seed without one)."""
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        return generator
    made = torch.Generator(device=device)
    if seed is None:
        made.seed()
    else:
        check_seed(seed)
        made.manual_seed(seed)
    return made


def request_generators(seed, generator, batch: int, device) -> torch.Generator | list | None:
    """The random streams of a `generate` call: None (torch's default) or one `torch.Generator` for the whole batch,
    or a list of one per sequence (from `seed` or `generator` given as a list)."""
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    many = seed if isinstance(seed, (list, tuple)) else generator if isinstance(generator, (list, tuple)) else None
    if many is not None:
        if len(many) != batch:
            raise ValueError(f"seed or generator as a list needs one per sequence ({batch}), got {len(many)}")
        return [request_generator(each, None, device) if seed is not None else request_generator(None, each, device)
                for each in many]
    return None if seed is None and generator is None else request_generator(seed, generator, device)


__all__ = ["FrameSampler", "draw", "kept_logits", "ras_log_probs", "request_generator", "request_generators"]
