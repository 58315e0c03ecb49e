"""The requests of the engine (engine.py): what one holds while it waits and runs, the group it is admitted with, and
what it hands back (transformers' `GenerationOutput`, with Drama 3's frames).
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
    """A request's output, as transformers' continuous-batching `GenerationOutput` (`request_id`, `prompt_ids`: the
    main ids of the prompt rows, `generated_tokens`: the main id of each frame so far, `status`, `error` as text,
    `created_time` and `lifespan` in `time.perf_counter()` seconds, `timestamps` with `record_timestamps=True`), plus
    Drama 3's frames.

    A finished request (`is_finished()`: status FINISHED or FAILED) has `codes` `[NCB, n]`, the codes of all its frames
    (on the CPU), and `finish_reason`: `"eos"`, `"length"`, `"context"`, `"stop"`, `"cancelled"` or `"failed"` (then
    `exception` holds what was raised). A streamed output (status DECODING, `request_id_iter`) has `frame` instead: the
    codes `[NCB]` of the frame just made; a stream's last output is the result itself (no `frame`). prompt_rows: the
    prompt's length in rows. added_at, admitted_at, first_frame_at: `time.monotonic()` seconds. audio: float32
    `[n * 2048]` where the caller decoded it (`generate_batch`), else None.
    """

    codes: torch.LongTensor | None = None
    finish_reason: str = ""
    prompt_rows: int = 0
    exception: BaseException | None = None
    added_at: float = 0.0
    admitted_at: float | None = None
    first_frame_at: float | None = None
    audio: torch.Tensor | None = None
    frame: torch.LongTensor | None = None

    @property
    def frames(self) -> int:
        return len(self.generated_tokens)


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
    stream: queue.Queue | None  # streamed outputs, then the final result (`request_id_iter`)
    timestamps: list[float] | None  # per frame, with record_timestamps=True
    frames: list = field(default_factory=list)  # [1 + NCB] per frame: its main id and codes
    tokens: list[int] = field(default_factory=list)  # the main id of each frame
    stopped: bool = False  # ended by a stopping criterion of the caller's (`stop_requests`)
    finished: bool = False  # its one result is made (exactly once, whatever ends it)
    added_at: float = field(default_factory=time.monotonic)
    created_time: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None  # set once it runs in the frame state
    admitted_time: float = -1.0  # perf_counter
    first_frame_at: float | None = None

    @property
    def admitted(self) -> bool:
        """Whether it runs (or ran) in the frame state."""
        return self.admitted_at is not None

    def output(self, frame: torch.Tensor) -> Drama3Result:
        """The streamed output of the frame `[1 + NCB]` just made."""
        return self._as_result(RequestStatus.DECODING, -1, frame=frame[1:])

    def result(self, reason: str, error: BaseException | None, num_codebooks: int) -> Drama3Result:
        """The request's `Drama3Result` as it ends with `reason` (and `error` when it failed)."""
        frames = torch.stack(self.frames) if self.frames else torch.zeros(0, 1 + num_codebooks, dtype=torch.long)
        failed = reason == FINISH_FAILED
        return self._as_result(RequestStatus.FAILED if failed else RequestStatus.FINISHED, time.perf_counter(),
                               error=f"{type(error).__name__}: {error}" if failed else None,
                               timestamps=self.timestamps, codes=frames[:, 1:].T.contiguous(), finish_reason=reason,
                               exception=error)

    def _as_result(self, status: RequestStatus, ended: float, **fields) -> Drama3Result:
        """A `Drama3Result` of this request as it is now (`ended`: its lifespan's end, -1 while it runs)."""
        return Drama3Result(
            self.request_id, prompt_ids=self.prompt_ids, generated_tokens=list(self.tokens), status=status,
            created_time=self.created_time, lifespan=(self.admitted_time, ended), prompt_rows=len(self.prompt_ids),
            added_at=self.added_at, admitted_at=self.admitted_at, first_frame_at=self.first_frame_at, **fields)


@dataclass(eq=False)
class Admission:
    """Requests admitted together after one prefill: their prompt rows `[n, T, 1 + NCB]` (left-padded), full mask
    `[n, T]` and prompt cache, all checked when they were added; `requests[i]` is row `i`."""

    requests: list[EngineRequest]
    input_ids: torch.LongTensor
    attention_mask: torch.LongTensor
    prompt_cache: PromptCache | None

    @classmethod
    def checked(cls, model, input_ids, attention_mask, prompt_cache, settings: list, generators: list, limit,
                on_frame, on_finish, streaming: bool, record_timestamps: bool) -> Admission:
        """The requests of prompts `[n, T, 1 + NCB]` (mask `[n, T]` or None) admitted together, each with its settings
        and generator, all with the frame limit of `limit` (a `Drama3FrameLimit`) and the same callbacks; the
        prompts' layout and values (one host read) and the prompt cache are checked first."""
        attention_mask, _ = model.checked_inputs(input_ids, attention_mask)  # reads the prompt back once
        # The prompts' lengths and main ids, for the results: one more read (none when the prompt is on the CPU).
        width = input_ids.shape[1]
        host = torch.cat((attention_mask.to(input_ids.device), input_ids[:, :, 0]), 1).cpu()  # [n, 2T]
        lengths, main_ids = host[:, :width].sum(1).tolist(), host[:, width:].tolist()
        input_ids = input_ids.to(model.input_device, torch.long)
        attention_mask = attention_mask.to(model.input_device)
        if prompt_cache is not None:
            if not isinstance(prompt_cache, PromptCache):
                raise TypeError(f"prompt_cache must be a PromptCache (PromptCache.build(model, prefix_rows)), got "
                                f"{type(prompt_cache).__name__}")
            prompt_cache.check(input_ids, attention_mask)
        frames, reason = limit.limit(width)
        requests = [EngineRequest("", main_ids[row][width - length :], request_settings, generator, frames, reason,
                                  on_frame, on_finish, queue.Queue() if streaming else None,
                                  [] if record_timestamps else None)
                    for row, (length, request_settings, generator) in enumerate(zip(lengths, settings, generators))]
        return cls(requests, input_ids, attention_mask, prompt_cache)

    def drop(self, request_ids: set) -> list[EngineRequest]:
        """Remove the requests `request_ids` (cancelled before admission) with their rows; returns them."""
        keep = [row for row, request in enumerate(self.requests) if request.request_id not in request_ids]
        dropped = [request for request in self.requests if request.request_id in request_ids]
        if dropped:
            rows = torch.tensor(keep, dtype=torch.long, device=self.input_ids.device)
            self.requests = [self.requests[row] for row in keep]
            self.input_ids, self.attention_mask = self.input_ids[rows], self.attention_mask[rows]
        return dropped


__all__ = ["FINISH_CANCELLED", "FINISH_FAILED", "Admission", "Drama3Result", "EngineRequest"]
