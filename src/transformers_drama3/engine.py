"""Continuous batching: speech requests join the running batch at the next frame, from Python or a server.

`Drama3Engine` keeps one `FrameRunner` (frame_runner.py) running. A request (its prompt rows, its own sampling
settings and seed, its frame limit) waits until the next frame boundary, is prefilled alone and admitted into a free
slot of the running state; it leaves at EOS, at its frame limit or the context, or when cancelled. Requests with
different settings share the batch (the state holds settings per sequence), and each draws from its own random
stream, so a request gives the same frames alone, in a batch, and admitted while others run.

While sequences run, at most one newcomer is prefilled per frame (a running stream waits for one prefill at most);
with nothing running, every waiting request is admitted before the next frame. The names follow transformers'
continuous-batching manager: `add_request`, `cancel_request`, `get_result`, `request_id_iter`, `start`, `stop`,
`is_running` (and `model.init_continuous_batching`, `generate_batch`, `continuous_batching_context_manager`,
continuous_batching.py).

Threads. Exactly one thread steps the engine. After `start()` it is the engine's own thread, and any other
caller of `step()` is refused. Without it, the caller steps the engine itself, with `step()` or
`run_until_idle()`. `add_request`, `cancel_request`, `get_result` and `request_id_iter` may be called from any
thread, and they never step the engine. The result and the frame stream of a finished request are kept until they
are read, for up to `keep_results` finished requests; beyond that, the oldest unread ones are dropped, with a
warning.

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
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching import RequestStatus
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.utils import logging

from .device_placement import execution_device
from .frame_runner import FINISH_EOS, FrameRunner, KeptStates, check_cuda_graphs
from .generation_drama3 import Drama3FrameLimit, generation_settings
from .prompt_cache import PromptCache, prefill
from .settings_checks import check_flag, check_seed

logger = logging.get_logger(__name__)

FINISH_CANCELLED, FINISH_FAILED = "cancelled", "failed"
KEEP_RESULTS = 1024  # finished requests whose result or stream is kept until read (the default bound)
_END = object()  # the end of a request's frame stream (`request_id_iter`)
# Settings that are the engine's, not a request's: how the step runs, and what a frame hands back.
ENGINE_SETTINGS = {
    "fast_decode": "it is the engine's: Drama3Engine(model, fast_decode=...)",
    "compile_step": "it is the engine's: Drama3Engine(model, compile_step=...)",
    "stop_check_interval": "the engine reads each frame's stop flags with its codes, once per frame",
    "output_scores": "the engine keeps no scores; use model.generate(..., output_scores=True)",
}


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
    input_ids: torch.LongTensor  # [1, T, 1 + NCB]
    attention_mask: torch.LongTensor  # [1, T]
    prompt_ids: list[int]  # [T] the main id of each prompt row
    settings: object  # GenerationConfig
    generator: torch.Generator
    frame_limit: int
    limit_reason: str  # "length" or "context" (Drama3FrameLimit)
    prompt_cache: PromptCache | None
    on_frame: Callable | None
    on_finish: Callable | None
    stream: queue.Queue | None
    timestamps: list[float] | None  # per frame, with record_timestamps=True
    frames: list = field(default_factory=list)  # [1 + NCB] per frame: its main id and codes
    added_at: float = field(default_factory=time.monotonic)
    created_time: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    admitted_time: float = -1.0  # perf_counter
    first_frame_at: float | None = None


class Drama3Engine:
    """Continuous batching over one model (module docstring).

    `max_batch`: the most sequences generating at once. `fast_decode` / `compile_step`: how the frame step runs, as
    for `generate` (CUDA graphs on a CUDA device; torch.compile). `generation_config`: default settings of the
    requests (the model's by default); each request may override them. `keep_results`: how many finished requests
    keep their unread result and frame stream.

    Drive it with its thread (`start()`/`stop()`, or `with engine:`) or step it yourself (`step()` until it returns
    False, or `run_until_idle()`), never both. Callbacks run in the thread that steps the engine.
    """

    def __init__(self, model, max_batch: int = 8, fast_decode: bool = False, compile_step: bool | str = False,
                 generation_config=None, keep_results: int = KEEP_RESULTS):
        for name, value in (("max_batch", max_batch), ("keep_results", keep_results)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        base = generation_config if generation_config is not None else model.generation_config
        self.defaults = generation_settings(base, fast_decode=fast_decode, compile_step=compile_step)
        if self.defaults.output_scores:
            raise ValueError(f"output_scores=True cannot apply: {ENGINE_SETTINGS['output_scores']}")
        graphs = fast_decode and model.input_device.type == "cuda"
        if graphs:
            check_cuda_graphs(model)
        self.model, self.max_batch, self.keep_results = model, max_batch, keep_results
        backend = "inductor" if compile_step is True else (compile_step or None)
        self.runner = FrameRunner(model, graphs, backend, kept=KeptStates(model) if graphs else None)
        self.noise_device = execution_device(model.lm_head)
        self.context = model.config.text_config.max_position_embeddings
        self.waiting: deque[EngineRequest] = deque()
        self.requests: dict[str, EngineRequest] = {}  # waiting and running, by id
        self.results: OrderedDict[str, Drama3Result] = OrderedDict()  # finished and unread, in finishing order
        self.streams: dict[str, queue.Queue] = {}  # frame streams of streaming requests, running or unread
        self._ended_streams: OrderedDict[str, None] = OrderedDict()  # streams of finished requests, oldest first
        self._cancelled: set[str] = set()
        self._ids = itertools.count()
        self._lock = threading.Condition()  # guards the dicts above, `waiting` and `_cancelled`
        self._stepping = threading.Lock()  # held by whoever runs a step
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- requests (any thread) -------------------------------------------------------------------------------------

    def add_request(self, input_ids: torch.Tensor, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, seed: int | None = None,
                    generator: torch.Generator | None = None, prompt_cache: PromptCache | None = None,
                    on_frame: Callable[[str, torch.LongTensor], None] | None = None,
                    on_finish: Callable[[Drama3Result], None] | None = None, front: bool = False,
                    **settings) -> str:
        """Queue one request and return its id; it joins the running batch at the next frame boundary.

        `input_ids`: the prompt's frame rows `[T, 1 + NCB]` (or `[1, T, 1 + NCB]`, no padding), as `Drama3Processor`
        makes them. Settings (`temperature`, `top_p`, `top_k`, `do_sample`, `ras_*`, `codebook_*`) override the
        engine's defaults for this request; `max_new_tokens` is its frame limit. `seed` (or a `torch.Generator`)
        makes it reproducible: it gives the frames `generate` gives alone with that seed. `prompt_cache` starts
        its prefill from a cached prefix (prompt_cache.py). `on_frame(request_id, codes [NCB])` is called for each
        frame as it is made, `on_finish(result)` once at the end (the result then goes there, not to `get_result`);
        with `streaming=True`, `request_id_iter` yields the frames. `record_timestamps=True` keeps each frame's
        `time.perf_counter()` in the result's `timestamps`. `front=True` queues it before the requests already
        waiting (a server's next text chunk of a request that is speaking, so its audio goes on without waiting
        behind newcomers). Bad input raises here (`ValueError`, `TypeError`), before anything runs; so do the
        engine's own settings (`fast_decode`, `compile_step`, `stop_check_interval`, `output_scores`).
        """
        if input_ids.dim() == 2:
            input_ids = input_ids[None]
        if input_ids.dim() != 3 or input_ids.shape[0] != 1:
            raise ValueError(f"add_request takes the frame rows of one prompt [T, 1 + NCB], got {tuple(input_ids.shape)}")
        refused = sorted(set(settings) & set(ENGINE_SETTINGS))
        if refused:
            raise ValueError(f"{refused[0]} is not a request's setting: {ENGINE_SETTINGS[refused[0]]}")
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
        prompt_ids = input_ids[0, :, 0].tolist()  # the prompt is checked on the host already: no further wait
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
        limit = Drama3FrameLimit(request_settings.max_new_tokens, input_ids.shape[1], self.context)
        with self._lock:
            if self._stopping and self.is_running():
                raise RuntimeError("the engine is stopping (stop() was called and its thread has not ended yet): "
                                   "add requests after it has stopped, or to another engine")
            if request_id is None:
                request_id = f"req_{next(self._ids)}"
            if request_id in self.requests or request_id in self.results or request_id in self.streams:
                raise ValueError(f"a request with id {request_id!r} is already in the engine")
            stream = queue.Queue() if streaming else None
            request = EngineRequest(request_id, input_ids, attention_mask, prompt_ids, request_settings, generator,
                                    limit.frames, limit.reason, prompt_cache, on_frame, on_finish, stream,
                                    [] if record_timestamps else None)
            self.requests[request_id] = request
            if stream is not None:
                self.streams[request_id] = stream
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
        `timeout` seconds pass first, or, with no id, when no request is left. A result is handed out once. It only
        waits: without the engine's thread and with no `timeout`, a request not finished yet is an error (step the
        engine first, e.g. `run_until_idle()`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if request_id is None and self.results:
                    return self.results.popitem(last=False)[1]
                if request_id is None and not self.requests:
                    return None  # nothing will finish
                if request_id is not None and request_id in self.results:
                    return self.results.pop(request_id)
                if request_id is not None and request_id not in self.requests:
                    raise KeyError(f"no request {request_id!r} in the engine (its result may have been taken, handed "
                                   "to on_finish, or dropped beyond keep_results)")
                if timeout is None and not self.is_running():
                    raise RuntimeError(self._nothing_steps(request_id))
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._lock.wait(0.5 if left is None else min(left, 0.5))  # re-checks that a thread still runs

    def request_id_iter(self, request_id: str) -> Iterator[torch.LongTensor]:
        """The codes `[NCB]` of each frame of a request added with `streaming=True`, as they are made (those made
        before the call included, also when the request has finished); ends when the request does (its result is
        then ready for `get_result`). It only waits: without the engine's thread, it yields the frames made so far
        and raises if the request has not ended (step the engine first)."""
        with self._lock:
            stream = self.streams.get(request_id)
        if stream is None:
            raise ValueError(f"request {request_id!r} is not a streaming request of this engine (add_request(..., "
                             "streaming=True)), or its stream was read or dropped beyond keep_results")
        while True:
            try:
                item = stream.get(timeout=None if self.is_running() else 0)
            except queue.Empty:
                raise RuntimeError(self._nothing_steps(request_id)) from None
            if item is _END:
                with self._lock:
                    self.streams.pop(request_id, None)
                    self._ended_streams.pop(request_id, None)
                return
            yield item

    @staticmethod
    def _nothing_steps(request_id) -> str:
        which = "no request has" if request_id is None else f"request {request_id!r} has not"
        return (f"{which} finished and nothing steps the engine: start() it (or `with engine:`), or step it in this "
                "thread first (run_until_idle() or step())")

    @property
    def running(self) -> int:
        """Sequences generating now."""
        return len(self.runner.running)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self.waiting)

    # -- who steps it ---------------------------------------------------------------------------------------------

    def is_running(self) -> bool:
        """Whether the engine's thread is alive (it steps the engine until `stop`)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> Drama3Engine:
        """Run the engine in its thread until `stop`; from then on only that thread steps it."""
        with self._lock:
            if self.is_running():
                if self._stopping:
                    raise RuntimeError("the engine's thread is still stopping (stop(block=False), or a stop whose "
                                       "join timed out): wait for it with stop() before starting it again")
                return self
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="drama3-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Cancel every running and waiting request (their results say `"cancelled"`) and end the engine's thread:
        with `block`, wait up to `timeout` seconds for it (it ends after its current frame). Until it has ended,
        `start`, `step` and `add_request` are refused. Without a thread, the cancellations run here."""
        with self._lock:
            thread = self._thread if self.is_running() else None
            self._stopping = True
            self._cancelled.update(self.requests)
            self._lock.notify_all()
        if thread is None:
            with self._stepping:
                self._step()
            return
        if block:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the engine's thread has not ended after %s s; it ends after its current frame",
                               timeout)

    def __enter__(self) -> Drama3Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.waiting and not self._cancelled and not self.runner.running:
                    self._lock.wait()
                if self._stopping and not self.requests and not self._cancelled:
                    return
            with self._stepping:
                self._step()

    def step(self) -> bool:
        """One round: cancelled requests leave, waiting ones are admitted, the running ones make one frame. Returns
        whether requests remain (waiting or running). Refused while the engine's thread runs (it steps the engine)."""
        if self.is_running():
            raise RuntimeError("the engine's thread steps this engine (start() was called): read results with "
                               "get_result or request_id_iter, or stop() it before stepping it yourself")
        with self._stepping:
            return self._step()

    def run_until_idle(self) -> None:
        """Step the engine in this thread until no request waits or runs."""
        while self.step():
            pass

    # -- one step (the stepping thread only) --------------------------------------------------------------------

    @torch.no_grad()
    def _step(self) -> bool:
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
        """Prefill and admit waiting requests: up to the free slots with nothing running, one while others run."""
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
            request.admitted_at, request.admitted_time = time.monotonic(), time.perf_counter()

    def _frame(self) -> None:
        """One frame of every running sequence; its codes go to their requests, finished ones leave."""
        self.runner.step()
        slots, keys = self.runner.rows()
        outputs = self.runner.read()  # [b, 1 + NCB + 3]: the one host read of the frame
        now, clock = time.monotonic(), time.perf_counter()
        failed = {}
        for slot, key in zip(slots, keys):
            if not bool(outputs[slot, -3]):  # no frame: EOS, or ended before
                continue
            request = self.requests[key]
            frame = outputs[slot, :-3].clone()  # [1 + NCB]: the main id, then the codes
            codes = frame[1:]
            request.frames.append(frame)
            request.first_frame_at = request.first_frame_at or now
            if request.timestamps is not None:
                request.timestamps.append(clock)
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

    def _result(self, request: EngineRequest, reason: str, error: BaseException | None) -> Drama3Result:
        frames = torch.stack(request.frames) if request.frames else torch.zeros(
            0, 1 + self.model.config.num_codebooks, dtype=torch.long)  # [n, 1 + NCB]
        failed = reason == FINISH_FAILED
        return Drama3Result(
            request.request_id, prompt_ids=request.prompt_ids, generated_tokens=frames[:, 0].tolist(),
            error=f"{type(error).__name__}: {error}" if failed else None,
            status=RequestStatus.FAILED if failed else RequestStatus.FINISHED, created_time=request.created_time,
            lifespan=(request.admitted_time, time.perf_counter()), timestamps=request.timestamps,
            codes=frames[:, 1:].T.contiguous(), finish_reason=reason, prompt_rows=request.input_ids.shape[1],
            exception=error, added_at=request.added_at, admitted_at=request.admitted_at,
            first_frame_at=request.first_frame_at)

    def _finish(self, request: EngineRequest, reason: str, error: BaseException | None = None) -> None:
        result = self._result(request, reason, error)
        if request.stream is not None:
            request.stream.put(_END)
        with self._lock:
            self.requests.pop(request.request_id, None)
            if request.on_finish is None:  # a request with on_finish hands its result there only
                self.results[request.request_id] = result
            if request.stream is not None:
                self._ended_streams[request.request_id] = None
            self._drop_beyond_retention()
            self._lock.notify_all()
        if request.on_finish is not None:
            try:
                request.on_finish(result)
            except Exception:  # noqa: BLE001  (a caller's callback must not stop the engine)
                logger.exception("request %s: on_finish failed", request.request_id)

    def _drop_beyond_retention(self) -> None:
        """Drop the oldest unread results and streams beyond `keep_results` (with `_lock` held)."""
        for kept, drop in ((self.results, self.results.popitem), (self._ended_streams, self._ended_streams.popitem)):
            while len(kept) > self.keep_results:
                request_id, _ = drop(last=False)
                self.streams.pop(request_id, None)
                logger.warning("request %s finished %d requests ago and was never read: its result or stream is "
                               "dropped (Drama3Engine(keep_results=...))", request_id, self.keep_results)


__all__ = ["Drama3Engine", "Drama3Result"]
