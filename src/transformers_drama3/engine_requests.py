"""The requests of the continuous-batching engine (engine.py): what one holds while it waits and runs, the group it
is admitted with, and what it hands back when it ends (transformers' `GenerationOutput`, with Drama 3's frames).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching import RequestStatus
from transformers.generation.continuous_batching.requests import GenerationOutput

from .prompt_cache import PromptCache

FINISH_CANCELLED, FINISH_FAILED = "cancelled", "failed"


@dataclass
class Drama3Result(GenerationOutput):
    """A finished request, as transformers' continuous-batching `GenerationOutput` (`request_id`, `prompt_ids`: the
    main ids of the prompt rows, `generated_tokens`: the main id of each frame, `status` FINISHED or FAILED, `error`
    as text, `created_time` and `lifespan` in `time.perf_counter()` seconds, `timestamps` with
    `record_timestamps=True`), plus Drama 3's frames.

    codes: `[NCB, n]` the codes of the request's frames (on the CPU). finish_reason: `"eos"`, `"length"`,
    `"context"`, `"cancelled"` or `"failed"` (then `exception` holds what was raised). prompt_rows: the prompt's
    length in rows. added_at, admitted_at, first_frame_at: `time.monotonic()` seconds. audio: float32 `[n * 2048]`
    where the caller decoded it (`generate_batch`), else None.
    """

    codes: torch.LongTensor | None = None
    finish_reason: str = ""
    prompt_rows: int = 0
    exception: BaseException | None = None
    added_at: float = 0.0
    admitted_at: float | None = None
    first_frame_at: float | None = None
    audio: torch.Tensor | None = None

    @property
    def frames(self) -> int:
        return self.codes.shape[1]


@dataclass(eq=False)
class EngineRequest:
    """A request inside the engine (see `Drama3Engine.add_request`): one spec, built once when it is added."""

    request_id: str
    prompt_ids: list[int]  # [T] the main id of each prompt row
    settings: object  # GenerationConfig
    generator: torch.Generator | None  # None: the runner's one stream (a `generate` batch given one generator)
    frame_limit: int
    limit_reason: str  # "length" or "context" (Drama3FrameLimit)
    on_frame: Callable | None
    on_finish: Callable | None
    stream: queue.Queue | None
    timestamps: list[float] | None  # per frame, with record_timestamps=True
    frames: list = field(default_factory=list)  # [1 + NCB] per frame: its main id and codes
    stopped: bool = False  # ended by a stopping criterion of the caller's (`stop_requests`)
    added_at: float = field(default_factory=time.monotonic)
    created_time: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    admitted_time: float = -1.0  # perf_counter
    first_frame_at: float | None = None

    def result(self, reason: str, error: BaseException | None, num_codebooks: int) -> Drama3Result:
        """The request's `Drama3Result` as it ends with `reason` (and `error` when it failed)."""
        frames = torch.stack(self.frames) if self.frames else torch.zeros(0, 1 + num_codebooks, dtype=torch.long)
        failed = reason == FINISH_FAILED
        return Drama3Result(
            self.request_id, prompt_ids=self.prompt_ids, generated_tokens=frames[:, 0].tolist(),
            error=f"{type(error).__name__}: {error}" if failed else None,
            status=RequestStatus.FAILED if failed else RequestStatus.FINISHED, created_time=self.created_time,
            lifespan=(self.admitted_time, time.perf_counter()), timestamps=self.timestamps,
            codes=frames[:, 1:].T.contiguous(), finish_reason=reason, prompt_rows=len(self.prompt_ids),
            exception=error, added_at=self.added_at, admitted_at=self.admitted_at,
            first_frame_at=self.first_frame_at)



@dataclass(eq=False)
class Admission:
    """Requests admitted together after one prefill: their prompt rows `[n, T, 1 + NCB]` (left-padded), full mask
    `[n, T]` and prompt cache, all checked when they were added."""

    requests: list[EngineRequest]
    input_ids: torch.LongTensor
    attention_mask: torch.LongTensor
    prompt_cache: PromptCache | None


__all__ = ["FINISH_CANCELLED", "FINISH_FAILED", "Admission", "Drama3Result", "EngineRequest"]
