"""What each frame runs besides the networks: the sampling rule and the stopping criteria, as transformers'
`LogitsProcessor` and `StoppingCriteria` objects that the frame step calls on the device, for `generate` and the engine.
None reads a value back to the host, changes a shape or holds per-sequence state: they read each row's settings,
frame count and limit from the frame state's tensors, so one object serves a batch whose rows change.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, StoppingCriteria, StoppingCriteriaList

from .sampling import CODEBOOK_TOP_K_CAP, FrameSampler, draw, kept_logits, ras_log_probs

FINISH_EOS, FINISH_LENGTH, FINISH_CONTEXT, FINISH_STOP = "eos", "length", "context", "stop"


class Drama3FrameSampling(LogitsProcessor):
    """Drama 3's draws of one frame with one setting per row (docs/format.md, "Sampling"): the main token
    (temperature, top-p, top-k, then the repetition-aware redraw) and codes 1..NCB-1 (temperature, top-p without the
    crossing token, top-k capped at 30); greedy rows take the argmax. The settings are read from a `FrameSampler`'s
    tensors (`sampler`), the randomness from one uniform noise tensor per frame, filled between frames."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor, sampler: FrameSampler) -> torch.Tensor:
        """Log-probabilities `[b, V + 1]` of each sampling row's main token (its temperature, top-p and top-k, then
        the repetition-aware redraw with its RAS settings): `input_ids` is the RAS history `[b, W]` (candidate
        columns, -1 for none), `scores` the main-token candidate logits `[b, V + 1]` (float32). A greedy row's entry
        is not used: `main` takes its argmax."""
        first = kept_logits(scores, sampler.temperature, sampler.top_k, sampler.top_p, keep_crossing=True)
        second = (kept_logits(scores, sampler.ras_temperature, sampler.ras_top_k, sampler.ras_top_p, keep_crossing=True)
                  if sampler.history_width else None)
        return ras_log_probs(input_ids, sampler.ras_window, first, second)

    def main(self, scores: torch.Tensor, history: torch.Tensor, sampler: FrameSampler,
             noise: torch.Tensor | None) -> torch.Tensor:
        """Candidate column `[b]` of each row's main token (0 = EOS) from its logits `[b, V + 1]`, RAS history
        `[b, W]` and the frame's uniform noise `[b, NCB, V + 1]` (`FrameSampler.fill_noise`; None when no row
        samples): one draw from this rule's log-probabilities for sampling rows, the argmax for greedy ones."""
        greedy = scores.argmax(-1)  # [b]
        if not sampler.sampling:  # host-known: a plain argmax
            return greedy
        return torch.where(sampler.do_sample, draw(self(history, scores, sampler), noise=noise[:, 0]), greedy)

    def codebook(self, scores: torch.Tensor, index: int, sampler: FrameSampler,
                 noise: torch.Tensor | None) -> torch.Tensor:
        """Code `[b]` of codebook `index` (1..NCB-1) from its head's logits `[b, V]` and the frame's noise."""
        greedy = scores.argmax(-1)  # [b]
        if not sampler.sampling:
            return greedy
        # Every row's top-k is capped: on a CPU only that many ranks are ordered (a sort of all V cost more there); a
        # GPU sorts all V in one kernel, fewer than the partial ordering's.
        limit = CODEBOOK_TOP_K_CAP if scores.device.type == "cpu" else None
        kept = kept_logits(scores, sampler.codebook_temperature, sampler.codebook_top_k, sampler.codebook_top_p,
                           keep_crossing=False, rank_limit=limit)
        return torch.where(sampler.do_sample, draw(kept, noise=noise[:, index, : scores.shape[-1]]), greedy)


class Drama3EndOfSpeech(StoppingCriteria):
    """A sequence ends at its EOS frame: called with the frame rows just made `[b, 1 + NCB]` (main id first), it is
    True where the main id is EOS (`eos_token_id`)."""

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None, **kwargs) -> torch.BoolTensor:
        return input_ids[:, 0] == self.eos_token_id


class Drama3FrameLimit(StoppingCriteria):
    """A sequence ends when it has made its frame limit: `max_new_tokens` frames, and never past the backbone's
    `context` (`max_position_embeddings` rows; the last frame is not fed back, so prompt + frames may reach the
    context + 1).

    `limit(prompt_length)` gives a sequence's limit in frames and the finish reason of a sequence that reaches it
    (`"length"` or `"context"`): the one place both are decided, for `generate` and the engine. In the frame step it is
    called per row with `frames_made` `[b]` and `frame_limit` `[b]` (each sequence's own limit, set when it joined)."""

    def __init__(self, max_new_tokens: int, context: int):
        self.max_new_tokens, self.context = max_new_tokens, context

    def limit(self, prompt_length: int) -> tuple[int, str]:
        room = self.context - prompt_length + 1  # frames before the context is full
        if room < 1:
            raise ValueError(f"the prompt has {prompt_length} rows, more than the context of {self.context} allows")
        frames = min(self.max_new_tokens, room)
        return frames, FINISH_LENGTH if frames == self.max_new_tokens else FINISH_CONTEXT

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None, frames_made: torch.Tensor,
                 frame_limit: torch.Tensor, **kwargs) -> torch.BoolTensor:
        return frames_made >= frame_limit


def frame_criteria(model, settings) -> StoppingCriteriaList:
    """The device criteria every frame runs: EOS, then the frame limit (`settings.max_new_tokens` frames within the
    backbone's context; each sequence's own limit is set when it joins)."""
    context = model.config.text_config.max_position_embeddings
    return StoppingCriteriaList([Drama3EndOfSpeech(model.config.eos_token_id),
                                 Drama3FrameLimit(settings.max_new_tokens, context)])


__all__ = ["FINISH_CONTEXT", "FINISH_EOS", "FINISH_LENGTH", "FINISH_STOP", "Drama3EndOfSpeech", "Drama3FrameLimit",
           "Drama3FrameSampling", "frame_criteria"]
