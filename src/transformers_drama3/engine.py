"""Continuous batching: speech requests join the running batch at the next frame, from Python or a server.

`Drama3Engine` keeps one `FrameRunner` (frame_runner.py) running. A request (its prompt rows, its own sampling
settings and seed, its frame limit) waits until the next frame boundary, is prefilled alone and admitted into a free
row of the running state; it leaves at EOS, at its frame limit or the context, or when cancelled. Requests with
different settings share the batch (the state holds settings per row), and each draws from its own random stream,
so a request gives the same frames alone, in a batch, and admitted while others run.

While sequences run, at most one newcomer is prefilled per frame (a running stream waits for one prefill at most);
with nothing running, every waiting request is admitted before the next frame. The names follow transformers'
continuous-batching manager where it has one: `add_request`, `cancel_request`, `get_result`, `request_id_iter`,
`start`, `stop`.

    engine = Drama3Engine(model, max_batch=8)
    with engine:                                            # a thread runs the frames
        inputs = processor("Hello there.", references=[voice])
        request_id = engine.add_request(inputs["input_ids"][0], seed=0, temperature=0.8)
        result = engine.get_result(request_id)              # codes [NCB, n], finish_reason
        audio = model.codec.decode(result.codes[None]).audio_values[0, 0]
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from .device_placement import execution_device
from .frame_runner import FINISH_CONTEXT, FINISH_EOS, FINISH_LENGTH, FrameRunner, KeptStates, check_cuda_graphs
from .generation_drama3 import generation_settings
from .prompt_cache import PromptCache, prefill
from .settings_checks import check_flag, check_seed

logger = logging.get_logger(__name__)

FINISH_CANCELLED, FINISH_FAILED = "cancelled", "failed"
_END = object()  # the end of a request's frame stream (`request_id_iter`)


@dataclass
class Drama3Result:
    """A finished request: its frames' codes `[NCB, n]` (on the CPU), why it ended (`"eos"`, `"length"`,
    `"context"`, `"cancelled"` or `"failed"`, with `error`), its prompt rows, and when it was added, admitted and
    made its first frame (`time.monotonic()` seconds)."""

    request_id: str
    codes: torch.LongTensor
    finish_reason: str
    prompt_rows: int
    error: BaseException | None = None
    added_at: float = 0.0
    admitted_at: float | None = None
    first_frame_at: float | None = None

    @property
    def frames(self) -> int:
        return self.codes.shape[1]


@dataclass(eq=False)
class EngineRequest:
    """A request inside the engine (see `Drama3Engine.add_request`)."""

    request_id: str
    input_ids: torch.LongTensor  # [1, T, 1 + NCB]
    attention_mask: torch.LongTensor  # [1, T]
    settings: object  # GenerationConfig
    generator: torch.Generator
    frame_limit: int
    limit_reason: str  # FINISH_LENGTH or FINISH_CONTEXT
    prompt_cache: PromptCache | None
    on_frame: Callable | None
    on_finish: Callable | None
    stream: queue.Queue | None
    frames: list = field(default_factory=list)  # [NCB] per frame
    added_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_frame_at: float | None = None
    cancelled: bool = False


class Drama3Engine:
    """Continuous batching over one model (module docstring).

    `max_batch`: the most sequences generating at once. `fast_decode` / `compile_step`: how the frame step runs, as
    for `generate` (CUDA graphs on a CUDA device; torch.compile). `generation_config`: default settings of the
    requests (the model's by default); each request may override them.

    Drive it with a thread (`start()`/`stop()`, or `with engine:`) or step it yourself (`step()` until it returns
    False). Callbacks run in the thread that steps the engine.
    """

    def __init__(self, model, max_batch: int = 8, fast_decode: bool = False, compile_step: bool | str = False,
                 generation_config=None):
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        base = generation_config if generation_config is not None else model.generation_config
        self.defaults = generation_settings(base, fast_decode=fast_decode, compile_step=compile_step)
        graphs = fast_decode and model.input_device.type == "cuda"
        if graphs:
            check_cuda_graphs(model)
        self.model, self.max_batch = model, max_batch
        backend = "inductor" if compile_step is True else (compile_step or None)
        self.runner = FrameRunner(model, graphs, backend, kept=KeptStates(model) if graphs else None)
        self.noise_device = execution_device(model.lm_head)
        self.context = model.config.text_config.max_position_embeddings
        self.waiting: deque[EngineRequest] = deque()
        self.requests: dict[str, EngineRequest] = {}  # waiting and running, by id
        self.results: dict[str, Drama3Result] = {}  # finished, not yet taken by `get_result`
        self._finished_order: deque[str] = deque()
        self._cancelled: set[str] = set()
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- requests (any thread) -------------------------------------------------------------------------------------

    def add_request(self, input_ids: torch.Tensor, request_id: str | None = None, max_new_tokens: int | None = None,
                    seed: int | None = None, generator: torch.Generator | None = None,
                    prompt_cache: PromptCache | None = None, streaming: bool = False,
                    on_frame: Callable[[str, torch.LongTensor], None] | None = None,
                    on_finish: Callable[[Drama3Result], None] | None = None, front: bool = False,
                    **settings) -> str:
        """Queue one request and return its id; it joins the running batch at the next frame boundary.

        `input_ids`: the prompt's frame rows `[T, 1 + NCB]` (or `[1, T, 1 + NCB]`, no padding), as `Drama3Processor`
        makes them. Settings (`temperature`, `top_p`, `top_k`, `do_sample`, `ras_*`, `codebook_*`) override the
        engine's defaults for this request; `max_new_tokens` is its frame limit. `seed` (or a `torch.Generator`)
        makes it reproducible: it gives the frames `generate` gives alone with that seed. `prompt_cache` starts
        its prefill from a cached prefix (prompt_cache.py). `on_frame(request_id, codes [NCB])` is called for each
        frame as it is made, `on_finish(result)` once at the end (the result then goes there, not to `get_result`); with
        `streaming=True`, `request_id_iter` yields the
        frames. `front=True` queues it before the requests already waiting (a server's next text chunk of a request
        that is speaking, so its audio goes on without waiting behind newcomers). Bad input raises here (`ValueError`,
        `TypeError`), before anything runs.
        """
        if input_ids.dim() == 2:
            input_ids = input_ids[None]
        if input_ids.dim() != 3 or input_ids.shape[0] != 1:
            raise ValueError(f"add_request takes the frame rows of one prompt [T, 1 + NCB], got {tuple(input_ids.shape)}")
        check_flag("streaming", streaming)
        check_flag("front", front)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string (or None for a new id), got {request_id!r}")
        for name, callback in (("on_frame", on_frame), ("on_finish", on_finish)):
            if callback is not None and not callable(callback):
                raise TypeError(f"{name} must be a function (or None), got {type(callback).__name__}")
        keywords = dict(settings)
        if max_new_tokens is not None:
            keywords["max_new_tokens"] = max_new_tokens
        request_settings = generation_settings(self.defaults, **keywords)
        attention_mask, _ = self.model.checked_inputs(input_ids)  # one host read; raises on a malformed prompt
        input_ids = input_ids.to(self.model.input_device, torch.long)
        if prompt_cache is not None:
            if not isinstance(prompt_cache, PromptCache):
                raise TypeError(f"prompt_cache must be a PromptCache, got {type(prompt_cache).__name__}")
            prompt_cache.check(input_ids, attention_mask)
        if seed is not None and generator is not None:
            raise ValueError("pass either seed or generator, not both")
        if seed is not None:
            check_seed(seed)
        if generator is None:
            generator = torch.Generator(device=self.noise_device)
            generator.manual_seed(seed) if seed is not None else generator.seed()
        elif not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        rows = input_ids.shape[1]
        room = self.context - rows + 1  # frames before the context is full (the last frame is not fed back)
        if room < 1:
            raise ValueError(f"the prompt has {rows} rows, more than the context of {self.context} allows")
        limit = min(request_settings.max_new_tokens, room)
        reason = FINISH_LENGTH if limit == request_settings.max_new_tokens else FINISH_CONTEXT
        with self._lock:
            if request_id is None:
                request_id = f"req_{next(self._ids)}"
            if request_id in self.requests or request_id in self.results:
                raise ValueError(f"a request with id {request_id!r} is already in the engine")
            request = EngineRequest(request_id, input_ids, attention_mask, request_settings, generator, limit, reason,
                                    prompt_cache, on_frame, on_finish, queue.Queue() if streaming else None)
            self.requests[request_id] = request
            self.waiting.appendleft(request) if front else self.waiting.append(request)
            self._lock.notify_all()
        return request_id

    def cancel_request(self, request_id: str) -> None:
        """Stop a request: a waiting one is dropped, a running one leaves the batch at the next frame boundary (its
        result has finish reason `"cancelled"` and the frames made so far). Unknown or finished ids are ignored."""
        with self._lock:
            if request_id in self.requests:
                self._cancelled.add(request_id)
                self._lock.notify_all()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> Drama3Result | None:
        """The result of `request_id` once it has finished (or of the next request to finish, with None); None if
        `timeout` seconds pass first. A result is handed out once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if request_id is None and self._finished_order:
                    return self.results.pop(self._finished_order.popleft())
                if request_id is None and not self.requests:
                    return None  # nothing will finish
                if request_id is not None and request_id in self.results:
                    self._finished_order.remove(request_id)
                    return self.results.pop(request_id)
                if request_id is not None and request_id not in self.requests:
                    raise KeyError(f"no request {request_id!r} in the engine (its result may have been taken)")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if self._thread is None:  # nobody else steps the engine: do it here
                    self._lock.release()
                    try:
                        self.step()
                    finally:
                        self._lock.acquire()
                else:
                    self._lock.wait(left)

    def request_id_iter(self, request_id: str) -> Iterator[torch.LongTensor]:
        """The codes `[NCB]` of each frame of a request added with `streaming=True`, as they are made; ends when the
        request does (its result is then ready for `get_result`)."""
        request = self.requests.get(request_id)
        if request is None or request.stream is None:
            raise ValueError(f"request {request_id!r} is not a streaming request of this engine (add_request(..., "
                             "streaming=True))")
        while True:
            if self._thread is None and request.stream.empty():
                self.step()
                continue
            item = request.stream.get()
            if item is _END:
                return
            yield item

    @property
    def running(self) -> int:
        """Sequences generating now."""
        return len(self.runner.running)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self.waiting)

    # -- the loop ---------------------------------------------------------------------------------------------------

    def start(self) -> Drama3Engine:
        """Run the engine in a background thread until `stop`."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="drama3-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the thread: running and waiting requests are cancelled (their results say so)."""
        with self._lock:
            self._stopping = True
            self._cancelled.update(self.requests)
            self._lock.notify_all()
        if block and self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> Drama3Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.waiting and not self._cancelled and not self.runner.running:
                    self._lock.wait()
                if self._stopping and not self._cancelled and not self.requests:
                    return
            self.step()
            if self._stopping and not self.requests:
                return

    @torch.no_grad()
    def step(self) -> bool:
        """One round: cancelled requests leave, waiting ones are admitted, the running ones make one frame. Returns
        whether requests remain (waiting or running)."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            for request in [r for r in self.waiting if r.request_id in cancelled]:
                self.waiting.remove(request)
                self._finish(request, FINISH_CANCELLED)
        running = set(self.runner.running)
        leaving = [self.requests[key] for key in cancelled if key in running]
        if leaving:
            self.runner.release([r.request_id for r in leaving])
            for request in leaving:
                self._finish(request, FINISH_CANCELLED)
        self._admit()
        if self.runner.running:
            try:
                self._frame()
            except Exception as error:  # noqa: BLE001  (the running requests fail; the engine goes on)
                logger.error("the frame step failed: %s", error)
                failed = [self.requests[key] for key in self.runner.running]
                self.runner.close()
                for request in failed:
                    self._finish(request, FINISH_FAILED, error)
        with self._lock:
            return bool(self.requests)

    def _admit(self) -> None:
        """Prefill and admit waiting requests: up to the free rows with nothing running, one while others run."""
        running = len(self.runner.running)
        budget = self.max_batch - running if running == 0 else min(1, self.max_batch - running)
        for _ in range(budget):
            with self._lock:
                if not self.waiting:
                    return
                request = self.waiting.popleft()
            try:
                prefilled = prefill(self.model, request.input_ids, request.attention_mask, request.prompt_cache)
                self.runner.admit([request.request_id], prefilled, request.input_ids, request.attention_mask,
                                  [request.settings], [request.generator], [request.frame_limit])
            except Exception as error:  # noqa: BLE001  (this request fails alone)
                logger.error("request %s: prefill failed: %s", request.request_id, error)
                self.runner.release([request.request_id])
                self._finish(request, FINISH_FAILED, error)
                continue
            request.admitted_at = time.monotonic()

    def _frame(self) -> None:
        """One frame of every running sequence; its codes go to their requests, finished ones leave."""
        self.runner.step()
        rows, keys = self.runner.rows()
        outputs = self.runner.read()  # [b, 1 + NCB + 3]: the one host read of the frame
        now = time.monotonic()
        failed = {}
        for row, key in zip(rows, keys):
            if not bool(outputs[row, -3]):  # no frame: EOS, or ended before
                continue
            request = self.requests[key]
            codes = outputs[row, 1 : -3].clone()  # [NCB]
            request.frames.append(codes)
            request.first_frame_at = request.first_frame_at or now
            if request.on_frame is not None:
                try:
                    request.on_frame(key, codes)
                except Exception as error:  # noqa: BLE001  (this request fails alone)
                    logger.error("request %s: on_frame failed: %s", key, error)
                    failed[key] = error
                    continue
            if request.stream is not None:
                request.stream.put(codes)
        ended = [(self.requests[key], FINISH_FAILED, failed[key]) for key in failed]
        for key, _, at_limit in self.runner.finished(outputs):
            if key not in failed:
                request = self.requests[key]
                ended.append((request, request.limit_reason if at_limit else FINISH_EOS, None))
        if ended:
            self.runner.release([request.request_id for request, _, _ in ended])
            for request, reason, error in ended:
                self._finish(request, reason, error)

    def _finish(self, request: EngineRequest, reason: str, error: BaseException | None = None) -> None:
        codes = torch.stack(request.frames, 1) if request.frames else torch.zeros(
            self.model.config.num_codebooks, 0, dtype=torch.long)  # [NCB, n]
        result = Drama3Result(request.request_id, codes, reason, request.input_ids.shape[1], error, request.added_at,
                              request.admitted_at, request.first_frame_at)
        with self._lock:
            self.requests.pop(request.request_id, None)
            if request.on_finish is None:  # a request with on_finish hands its result there only
                self.results[request.request_id] = result
                self._finished_order.append(request.request_id)
            self._lock.notify_all()
        if request.stream is not None:
            request.stream.put(_END)
        if request.on_finish is not None:
            try:
                request.on_finish(result)
            except Exception:  # noqa: BLE001  (a caller's callback must not stop the engine)
                logger.exception("request %s: on_finish failed", request.request_id)


__all__ = ["Drama3Engine", "Drama3Result"]
