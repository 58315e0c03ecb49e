"""Continuous batching: speech requests join the running batch at the next frame, from Python or a server.

`Drama3Engine` runs one `FrameRunner` (runner.py). A request is admitted into a free slot at a frame boundary, ends
exactly once, and draws from its own random stream (the same frames alone, batched, or admitted while others run).
One thread steps the engine (its own after `start()`, or the caller's); the other methods may be called from any
thread, and callbacks never run under the engine's lock. A frame's path and failures: docs/architecture.md.

    with Drama3Engine(model, max_batch=8) as engine:       # a thread runs the frames
        request_id = engine.add_request(processor("Hello there.")["input_ids"][0], seed=0, temperature=0.8)
        result = engine.get_result(request_id)              # codes [NCB, n], finish_reason
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

import torch
from transformers.utils import logging

from ..device_placement import execution_device
from ..settings_checks import check_flag, check_integer
from .prompt_cache import PromptCache, prefill
from .requests import FINISH_CANCELLED, FINISH_FAILED, Admission, Drama3Result, EngineRequest
from .rules import FINISH_EOS, FINISH_STOP, Drama3FrameLimit, Drama3FrameSampling, frame_criteria
from .runner import FrameRunner, KeptStates, check_cuda_graphs
from .sampling import request_generator
from .settings import ENGINE_SETTINGS, generation_settings

logger = logging.get_logger(__name__)

KEEP_RESULTS = 1024  # finished requests whose result or stream is kept until read (the default bound)
WARMUP_FRAMES = 2  # frames of each warm-up request


class Drama3Engine:
    """Continuous batching over one model (module docstring).

    `max_batch`: the most sequences generating at once. `generation_config`: the requests' defaults, merged as
    `generate` merges them (Drama 3's < the model's < this one). `fast_decode` / `compile_step`: how the step runs,
    from those settings unless given. `keep_results`: how many finished requests keep their unread result and stream.
    `stop_check_interval`: frames between two reads of the frames back to the host. `runner` and `observer`: how
    `generate` runs its batch here (its hooks' rule and criteria; its streamer and host hooks, observer.py).
    """

    def __init__(self, model, max_batch: int = 8, fast_decode: bool | None = None,
                 compile_step: bool | str | None = None, generation_config=None, keep_results: int = KEEP_RESULTS,
                 stop_check_interval: int = 1, runner: FrameRunner | None = None, observer=None):
        for name, value in {"max_batch": max_batch, "keep_results": keep_results,
                            "stop_check_interval": stop_check_interval}.items():
            check_integer(name, value, 1)
        self.defaults = generation_settings(model.generation_config, generation_config)
        if runner is None:
            if self.defaults.output_scores:
                raise ValueError(f"output_scores=True cannot apply: {ENGINE_SETTINGS['output_scores']}")
            fast_decode = self.defaults.fast_decode if fast_decode is None else fast_decode
            check_flag("fast_decode", fast_decode)
            graphs = fast_decode and model.input_device.type == "cuda"
            if graphs:
                check_cuda_graphs(model)
            runner = FrameRunner(model, Drama3FrameSampling(), frame_criteria(model, self.defaults), graphs,
                                 self.defaults.compile_step if compile_step is None else compile_step,
                                 kept=KeptStates(model) if graphs else None)
        elif fast_decode is not None or compile_step is not None:
            raise ValueError("give fast_decode and compile_step to the runner, not with one")
        self.model, self.max_batch, self.keep_results = model, max_batch, keep_results
        self.context = model.config.text_config.max_position_embeddings
        self.runner, self.observer, self.stop_check_interval = runner, observer, stop_check_interval
        self.noise_device = execution_device(model.lm_head)
        self.waiting: deque[Admission] = deque()
        self.requests: dict[str, EngineRequest] = {}  # waiting and running, by id
        self.results: OrderedDict[str, Drama3Result] = OrderedDict()  # finished and unread, in finishing order
        self.streams: dict[str, queue.Queue] = {}  # outputs of streaming requests, running or unread
        self._ended_streams: OrderedDict[str, None] = OrderedDict()  # streams of finished requests, oldest first
        self._handlers: dict[str, Callable] = {}  # register_result_handler: its callback, on its event loop
        self._cancelled: set[str] = set()
        self._pending: list[torch.Tensor] = []  # frames' outputs not read back yet (device), of one slot layout
        self._pending_layout = -1  # the runner's layout of those frames
        self._held = False  # admissions wait for a running request to end (out of memory beside them)
        self._failure: BaseException | None = None  # what broke the engine (it then refuses requests)
        self._ids = itertools.count()
        self._lock = threading.Condition()  # guards the containers above
        self._stepping = threading.Lock()  # held by whoever runs a step
        self._thread: threading.Thread | None = None
        # stop() was called; with keep_for_next_session=True; destroy() was called
        self._stopping = self._keep_states = self._destroyed = False

    def __deepcopy__(self, memo):
        """A copied model starts without the engine kept on it (`stop(keep_for_next_session=True)`)."""
        return None

    # -- requests (any thread) -------------------------------------------------------------------------------------

    def add_request(self, input_ids: torch.Tensor, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, seed: int | None = None,
                    generator: torch.Generator | None = None, prompt_cache: PromptCache | None = None,
                    on_frame: Callable[[str, torch.LongTensor], None] | None = None,
                    on_finish: Callable[[Drama3Result], None] | None = None, front: bool = False,
                    **settings) -> str:
        """Queue one request (its prompt's frame rows `[T, 1 + NCB]`, no padding) and return its id; it joins the
        running batch at the next frame boundary. Settings override the engine's defaults; `max_new_tokens` is its
        frame limit; `seed` (or a `torch.Generator`) gives the frames `generate` gives alone with that seed.
        `on_frame(request_id, codes [NCB])` is called per frame, `on_finish(result)` once (the result then goes there
        only); `streaming=True` feeds `request_id_iter`; `front=True` queues it before the requests waiting (a
        server's next text chunk). Bad input, the engine's own settings included, raises here, before anything runs.
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
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        request_settings = generation_settings(self.defaults, **settings)
        generator = request_generator(seed, generator, self.noise_device)
        limit = Drama3FrameLimit(request_settings.max_new_tokens, self.context)
        admission = Admission.checked(self.model, input_ids, None, prompt_cache, [request_settings], [generator],
                                      limit, on_frame, on_finish, streaming, record_timestamps)
        return self._queue(admission, [request_id], front)[0]

    def add_requests(self, inputs: list, max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **settings) -> list[str]:
        """`add_request` for each prompt of `inputs` (frame rows `[T, 1 + NCB]` each), with the same settings; all
        are checked before any is queued. Returns their ids, in order."""
        rows = [torch.as_tensor(prompt) for prompt in inputs]
        for prompt in rows:
            if prompt.dim() not in (2, 3):
                raise ValueError(f"add_requests takes a list of prompts' frame rows [T, 1 + NCB], got a prompt of "
                                 f"shape {tuple(prompt.shape)}")
        return [self.add_request(prompt, max_new_tokens=max_new_tokens, streaming=streaming,
                                 record_timestamps=record_timestamps, **settings) for prompt in rows]

    def add_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, settings,
                  generators: list | None = None, prompt_cache: PromptCache | None = None,
                  frame_limit: Drama3FrameLimit | None = None) -> list[str]:
        """Queue a left-padded batch of prompts `[B, T, 1 + NCB]` (mask `[B, T]`, 0 = padding) as one admission with
        one prefill, all with `settings` (a checked GenerationConfig) and `frame_limit` (the criterion that decides
        their limit; from `settings` by default); returns their ids, in batch order. `generators`: one per sequence,
        or None for the runner's one stream. This is how `generate` runs its batch."""
        if input_ids.shape[0] > self.max_batch:
            raise ValueError(f"a batch of {input_ids.shape[0]} prompts cannot run on an engine of max_batch "
                             f"{self.max_batch}: add them one by one, or make the engine larger")
        generators = generators if generators is not None else [None] * input_ids.shape[0]
        limit = frame_limit or Drama3FrameLimit(settings.max_new_tokens, self.context)
        admission = Admission.checked(self.model, input_ids, attention_mask, prompt_cache,
                                      [settings] * len(generators), generators, limit, None, None, False, False)
        return self._queue(admission, [None] * len(generators), False)

    def _queue(self, admission: Admission, request_ids: list, front: bool) -> list[str]:
        with self._lock:
            if self._failure is not None:
                raise RuntimeError(f"the engine failed and takes no more requests ({type(self._failure).__name__}: "
                                   f"{self._failure}); make a new one") from self._failure
            if self._stopping and self.is_running():
                raise RuntimeError("the engine is stopping (stop() was called and its thread has not ended yet): "
                                   "add requests after it has stopped, or to another engine")
            for request, request_id in zip(admission.requests, request_ids):
                request_id = f"req_{next(self._ids)}" if request_id is None else request_id
                if request_id in self.requests or request_id in self.results or request_id in self.streams:
                    raise ValueError(f"a request with id {request_id!r} is already in the engine")
                request.request_id = request_id
            for request in admission.requests:
                self.requests[request.request_id] = request
                if request.stream is not None:
                    self.streams[request.request_id] = request.stream
            self.waiting.appendleft(admission) if front else self.waiting.append(admission)
            self._lock.notify_all()
        return [request.request_id for request in admission.requests]

    def stop_requests(self, request_ids) -> None:
        """End running requests at the frame just made, as `"stop"` (a caller's criterion; the stepping thread)."""
        for request_id in request_ids:
            self.requests[request_id].stopped = True
        self.runner.stop(request_ids)

    def cancel_request(self, request_id: str) -> None:
        """Stop a request: a waiting one is dropped, a running one leaves at the next frame boundary (`"cancelled"`,
        with the frames made so far). Unknown or finished ids are ignored."""
        with self._lock:
            if request_id in self.requests:
                self._cancelled.add(request_id)
                self._lock.notify_all()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> Drama3Result | None:
        """The result of `request_id` once it has finished (or of the next to finish, with None), handed out once;
        None after `timeout` seconds, or, with no id, when no request is left. Without the engine's thread and with no
        `timeout`, a request not finished yet is an error (step the engine first)."""
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

    def __iter__(self) -> Iterator[Drama3Result]:
        """Results as requests finish (transformers' manager), until no request is left waiting, running or unread.
        Without the engine's thread, it yields those finished and raises while others are left (step it first)."""
        while True:
            with self._lock:
                if not self.requests and not self.results:
                    return
            if not self.is_running() and not self.results:
                raise RuntimeError(self._nothing_steps(None))
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Iterator[Drama3Result]:
        """The outputs of a request added with `streaming=True`, as they are made: one `Drama3Result` per frame
        (status DECODING, `frame` = its codes `[NCB]`), those made before the call included, then its result (status
        FINISHED), which is then no longer kept for `get_result`. A request that failed raises its error instead. It
        only waits: without the engine's thread, it yields what was made and raises if the request has not ended."""
        with self._lock:
            stream = self.streams.get(request_id)
        if stream is None:
            raise ValueError(f"request {request_id!r} is not a streaming request of this engine (add_request(..., "
                             "streaming=True)), or its stream was read or dropped beyond keep_results")
        while True:
            try:
                output = stream.get(timeout=None if self.is_running() else 0)
            except queue.Empty:
                raise RuntimeError(self._nothing_steps(request_id)) from None
            if output.is_finished():
                with self._lock:
                    self.streams.pop(request_id, None)
                    self._ended_streams.pop(request_id, None)
                    self.results.pop(request_id, None)
                if output.exception is not None:
                    raise output.exception
                yield output
                return
            yield output

    def register_result_handler(self, request_id: str, callback: Callable[[Drama3Result], None]) -> None:
        """Call `callback(output)` on the running asyncio event loop of the caller for each output of a request: its
        streamed frames (`streaming=True`) and its result, which then goes there only. Call it from a coroutine."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("register_result_handler delivers on the caller's asyncio event loop: call it from "
                               "a coroutine (or use add_request(..., on_finish=...) from plain threads)") from None
        with self._lock:
            if request_id not in self.requests:
                raise KeyError(f"no running or waiting request {request_id!r} in the engine")
            self._handlers[request_id] = functools.partial(loop.call_soon_threadsafe, callback)

    @staticmethod
    def _nothing_steps(request_id) -> str:
        return (f"{'no request has' if request_id is None else f'request {request_id!r} has not'} finished and nothing "
                "steps the engine: start() it (or `with engine:`), or step it in this thread first (run_until_idle())")

    @property
    def running(self) -> int:  # sequences generating now
        return len(self.runner.running)

    @property
    def queued(self) -> int:  # admissions waiting for a slot
        return len(self.waiting)

    # -- who steps it ---------------------------------------------------------------------------------------------

    def is_running(self) -> bool:
        """Whether the engine's thread is alive (it steps the engine until `stop`)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> Drama3Engine:
        """Run the engine in its thread until `stop`; from then on only that thread steps it."""
        if self._destroyed:
            raise RuntimeError("this engine was destroyed (destroy()): make a new one")
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

    def warmup(self) -> None:
        """Capture or compile the step before the first request (transformers' `warmup`, before `start()`): a greedy
        then a sampled one-row request run alone, so a request alone finds both kinds of step ready (larger batches
        get theirs when they first run). An eager step has nothing to warm up."""
        if not (self.runner.graphs or self.runner.compile_backend):
            return
        if self.is_running():
            raise RuntimeError("warmup() runs in the calling thread: call it before start()")
        row = torch.zeros(1, 1 + self.model.config.num_codebooks, dtype=torch.long)
        row[0, 0] = self.model.config.eos_token_id  # a text row
        for do_sample in (False, True):
            request_id = self.add_request(row, max_new_tokens=WARMUP_FRAMES, do_sample=do_sample, seed=0)
            self.run_until_idle()
            result = self.get_result(request_id)
            if result.exception is not None:
                raise result.exception

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop (transformers' semantics): no new request; those waiting and running finish (with `hard_stop`, are
        cancelled), then the thread ends (`block`: wait up to `timeout` s; without a thread, it runs here). The frame
        states are freed, or, with `keep_for_next_session`, kept with the engine, kept on the model for the next
        `init_continuous_batching`."""
        with self._lock:
            thread = self._thread if self.is_running() else None
            self._stopping, self._keep_states = True, keep_for_next_session
            if hard_stop:
                self._cancelled.update(self.requests)
            self._lock.notify_all()
        if keep_for_next_session:
            self.model._cached_continuous_batching_manager = self
        elif getattr(self.model, "_cached_continuous_batching_manager", None) is self:
            self.model._cached_continuous_batching_manager = None
        if thread is None:
            with self._stepping:
                try:
                    while self._step():
                        pass
                finally:
                    self.runner.close(keep=keep_for_next_session)
            return
        if block:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the engine's thread has not ended after %s s: it ends once its requests have",
                               timeout)

    def destroy(self) -> None:
        """Stop for good (transformers' manager): the requests left finish, the frame states are freed, and `start`
        is refused from then on."""
        self.stop(keep_for_next_session=False)
        self._destroyed = True

    def __enter__(self) -> Drama3Engine:
        return self.start()

    def __exit__(self, error_type, *exc) -> None:
        self.stop(hard_stop=error_type is not None)  # an error in the block cancels what runs

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self.waiting and not self._cancelled and not self.runner.running:
                        self._lock.wait()
                    if self._stopping and not self.requests and not self._cancelled:
                        return
                with self._stepping:
                    self._step()
        except BaseException as error:  # noqa: BLE001  (the thread ends: every waiter is told why)
            self._break(error)
        finally:
            self.runner.close(keep=self._keep_states)

    def step(self) -> bool:
        """One round: cancelled requests leave, waiting ones are admitted, the running ones make one frame. Returns
        whether requests remain (waiting or running). Refused while the engine's thread runs (it steps the engine)."""
        if self.is_running():
            raise RuntimeError("the engine's thread steps this engine (start() was called): read results with "
                               "get_result or request_id_iter, or stop() it before stepping it yourself")
        with self._stepping:
            try:
                return self._step()
            except BaseException as error:
                self._break(error)
                raise

    def run_until_idle(self) -> None:
        """Step the engine in this thread until no request waits or runs."""
        while self.step():
            pass

    # -- one step (the stepping thread only) --------------------------------------------------------------------

    @torch.no_grad()
    def _step(self) -> bool:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            dropped = []
            for admission in list(self.waiting):
                dropped += admission.drop(cancelled)
                if not admission.requests:
                    self.waiting.remove(admission)
        for request in dropped:
            self._finish(request, FINISH_CANCELLED)
        try:
            if any(key in cancelled for key in self.runner.running):
                self._read()  # frames made before the cancellation still reach their requests
                self._end([(self.requests[key], FINISH_CANCELLED, None) for key in self.runner.running
                           if key in cancelled])
            self._admit()
            if self.runner.running:
                self._frame()
        except Exception as error:  # noqa: BLE001  (the running requests fail; the engine goes on)
            logger.error("the frame step failed, and the requests running with it: %r", error)
            self._pending = []
            self.runner.close(keep=False)  # a state left half-way is never used again
            self._fail_lost(error)
        with self._lock:
            return bool(self.requests)

    def _fail_lost(self, error: BaseException) -> None:
        """Fail the admitted requests whose sequences the runner no longer holds (it dropped its state)."""
        held = set(self.runner.running)
        for request in [r for r in list(self.requests.values()) if r.admitted and r.request_id not in held]:
            self._finish(request, FINISH_FAILED, error)

    def _break(self, error: BaseException) -> None:
        """The engine cannot go on: fail every request, waiting or running, and refuse new ones with `error`."""
        logger.error("the engine failed and stops: %s: %s", type(error).__name__, error)
        with self._lock:
            self._failure = error
            self.waiting.clear()
            requests = list(self.requests.values())
        for request in requests:
            self._finish(request, FINISH_FAILED, error)

    def _admit(self) -> None:
        """Prefill and admit waiting admissions: as many as there are free slots with nothing running, one while
        others run; none while `_held`."""
        running = len(self.runner.running)
        others_run = running > 0
        while not self._held:
            with self._lock:
                if not self.waiting or len(self.waiting[0].requests) > self.max_batch - running:
                    return
                admission = self.waiting.popleft()
            self._read()  # the slots change: frames of the old layout are read first
            keys = [request.request_id for request in admission.requests]
            try:
                prefilled = prefill(self.model, admission.input_ids, admission.attention_mask, admission.prompt_cache)
                self.runner.admit(keys, prefilled, admission.input_ids, admission.attention_mask,
                                  [r.settings for r in admission.requests], [r.generator for r in admission.requests],
                                  [r.frame_limit for r in admission.requests])
            except Exception as error:  # noqa: BLE001  (these requests fail alone, or wait)
                self._fail_lost(error)  # running sequences go only where a move stopped half-way
                if isinstance(error, torch.OutOfMemoryError) and self.runner.running:
                    logger.warning("requests %s: out of memory beside %d running requests: they wait until one "
                                   "ends", keys, len(self.runner.running))
                    with self._lock:
                        self.waiting.appendleft(admission)
                    self._held = True
                    return
                logger.error("requests %s: prefill failed: %s: %s", keys, type(error).__name__, error)
                for request in admission.requests:
                    self._finish(request, FINISH_FAILED, error)
                continue
            now, clock = time.monotonic(), time.perf_counter()
            for request in admission.requests:
                request.admitted_at, request.admitted_time = now, clock
            running += len(keys)
            if others_run:
                return

    def _frame(self) -> None:
        """One frame of every running sequence; every `stop_check_interval` frames (and before the slots change),
        the frames made go to their requests and finished ones leave."""
        runner, observer = self.runner, self.observer
        runner.make_room()
        if self._pending and runner.layout != self._pending_layout:
            self._read()
        if observer is not None:
            observer.before_step(runner)
        runner.step(observer.main_logits_hook(runner) if observer is not None else None)
        if observer is not None:
            observer.after_step(self, runner)
        if not self._pending:
            self._pending_layout = runner.layout  # the step changes no slot: the frames pending share one layout
        self._pending.append(runner.outputs())
        due = self.stop_check_interval
        if due > 1:  # a sequence makes at most one frame per step: none passes its frame limit before `due` steps
            due = min(due, *(self.requests[key].frame_limit - len(self.requests[key].frames) for key in runner.running))
        if len(self._pending) >= due:
            self._read()

    def _read(self) -> None:
        """Read the pending frames back (one transfer), hand each made frame to its request, and end the sequences
        that have ended."""
        if not self._pending:
            return
        block = torch.stack(self._pending).cpu()  # [k, b, 1 + NCB + 3]: the one host read of these frames
        self._pending = []
        slots, keys = self.runner.taken()
        failed = {}
        for outputs in block:
            now, clock = time.monotonic(), time.perf_counter()
            made = {}
            for slot, key in zip(slots, keys):
                if key in failed or not bool(outputs[slot, -3]):  # no frame: EOS, or ended before
                    continue
                request = self.requests[key]
                frame = outputs[slot, :-3].clone()  # [1 + NCB]: the main id, then the codes
                made[key] = frame
                request.frames.append(frame)
                request.tokens.append(int(frame[0]))
                request.first_frame_at = request.first_frame_at or now
                if request.timestamps is not None:
                    request.timestamps.append(clock)
                try:
                    if request.on_frame is not None:
                        request.on_frame(key, frame[1:])
                    if request.stream is not None:
                        output = request.output(frame)
                        request.stream.put(output)
                        if key in self._handlers:
                            self._handlers[key](output)
                except Exception as error:  # noqa: BLE001  (this request fails alone)
                    logger.error("request %s: on_frame failed: %s", key, error)
                    failed[key] = error
            if self.observer is not None:
                self.observer.frame_read(made)
        ended = [(self.requests[key], FINISH_FAILED, failed[key]) for key in failed]
        last = block[-1]
        for slot, key in zip(slots, keys):
            if key in failed or not bool(last[slot, -2]):
                continue
            request = self.requests[key]
            reason = request.limit_reason if int(last[slot, -1]) >= request.frame_limit else FINISH_EOS
            ended.append((request, FINISH_STOP if request.stopped else reason, None))
        self._end(ended)

    def _end(self, ended: list) -> None:
        """Finish running requests `(request, reason, error)`, then free their slots."""
        for request, reason, error in ended:
            self._finish(request, reason, error)
        if ended:
            self.runner.release([request.request_id for request, _, _ in ended])

    def _finish(self, request: EngineRequest, reason: str, error: BaseException | None = None) -> None:
        """The one end of a request: its result goes to its stream, its handler, `on_finish` or `get_result`."""
        if request.finished:
            return
        request.finished = True
        if request.admitted:
            self._held = False  # a running request ends: a newcomer held back may fit now
        result = request.result(reason, error, self.model.config.num_codebooks)
        with self._lock:
            self.requests.pop(request.request_id, None)
            handler = self._handlers.pop(request.request_id, None)
            if request.on_finish is None and handler is None:  # a callback gets the result instead
                self.results[request.request_id] = result
            if request.stream is not None:
                self._ended_streams[request.request_id] = None
            self._drop_beyond_retention()
            self._lock.notify_all()
        if request.stream is not None:  # after the result is kept: the stream's reader takes it from there
            request.stream.put(result)
        try:
            if handler is not None:
                handler(result)
            if request.on_finish is not None:
                request.on_finish(result)
        except Exception:  # noqa: BLE001  (a caller's callback must not stop the engine)
            logger.exception("request %s: its result callback failed", request.request_id)

    def _drop_beyond_retention(self) -> None:
        """Drop the oldest unread results and streams beyond `keep_results` (with `_lock` held)."""
        for kept, drop in ((self.results, self.results.popitem), (self._ended_streams, self._ended_streams.popitem)):
            while len(kept) > self.keep_results:
                request_id, _ = drop(last=False)
                self.streams.pop(request_id, None)
                logger.warning("request %s finished %d requests ago and was never read: its result or stream is "
                               "dropped (Drama3Engine(keep_results=...))", request_id, self.keep_results)


__all__ = ["FINISH_CANCELLED", "FINISH_FAILED", "Drama3Engine", "Drama3Result"]
