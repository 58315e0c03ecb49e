"""Continuous batching: speech requests join the running batch at the next frame, from Python or a server.

`Drama3Engine` keeps one `FrameRunner` (frame_runner.py) running. A request (its prompt rows, its own sampling
settings and seed, its frame limit) waits until the next frame boundary, is prefilled alone and admitted into a free
slot of the running state; it leaves at EOS, at its frame limit or the context, or when cancelled. Requests with
different settings share the batch (the state holds settings per sequence), and each draws from its own random
stream, so a request gives the same frames alone, in a batch, and admitted while others run.

While sequences run, at most one newcomer is prefilled per frame (a running stream waits for one prefill at most);
with nothing running, every waiting request is admitted before the next frame. `generate` is this engine too: it adds
its batch with `add_batch` (one prefill for the batch, one admission) and steps the engine in its own thread until the
batch has ended, reading the frames back every `stop_check_interval` frames instead of every frame. The names follow transformers'
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

import torch
from transformers import StoppingCriteriaList
from transformers.utils import logging

from .device_placement import execution_device
from .engine_requests import FINISH_CANCELLED, FINISH_FAILED, Admission, Drama3Result, EngineRequest
from .frame_rules import FINISH_EOS, FINISH_STOP, Drama3EndOfSpeech, Drama3FrameLimit, Drama3FrameSampling
from .frame_runner import FrameRunner, KeptStates, check_cuda_graphs
from .generation_settings import generation_settings
from .prompt_cache import PromptCache, prefill
from .settings_checks import check_flag, check_seed

logger = logging.get_logger(__name__)

KEEP_RESULTS = 1024  # finished requests whose result or stream is kept until read (the default bound)
_END = object()  # the end of a request's frame stream (`request_id_iter`)
# Settings that are the engine's, not a request's: how the step runs, and what a frame hands back.
ENGINE_SETTINGS = {
    "fast_decode": "it is the engine's: Drama3Engine(model, fast_decode=...)",
    "compile_step": "it is the engine's: Drama3Engine(model, compile_step=...)",
    "stop_check_interval": "it is the engine's: Drama3Engine(model, stop_check_interval=...) (1 by default: each "
                           "frame reaches its request as it is made)",
    "output_scores": "the engine keeps no scores; use model.generate(..., output_scores=True)",
}


class Drama3Engine:
    """Continuous batching over one model (module docstring).

    `max_batch`: the most sequences generating at once. `fast_decode` / `compile_step`: how the frame step runs, as
    for `generate` (CUDA graphs on a CUDA device; torch.compile). `generation_config`: default settings of the
    requests (the model's by default); each request may override them. `keep_results`: how many finished requests
    keep their unread result and frame stream. `stop_check_interval`: frames between two reads of the frames back
    to the host (1: each frame reaches its request as it is made).

    Drive it with its thread (`start()`/`stop()`, or `with engine:`) or step it yourself (`step()` until it returns
    False, or `run_until_idle()`), never both. Callbacks run in the thread that steps the engine.

    `runner` and `observer` are how `generate` runs its batch here: its own `FrameRunner` (its hooks' rule and
    criteria, its graphs and scores) and a `GenerateObserver` (frame_observer.py) for its streamer and host hooks.
    """

    def __init__(self, model, max_batch: int = 8, fast_decode: bool = False, compile_step: bool | str = False,
                 generation_config=None, keep_results: int = KEEP_RESULTS, stop_check_interval: int = 1,
                 runner: FrameRunner | None = None, observer=None):
        for name, value in (("max_batch", max_batch), ("keep_results", keep_results),
                            ("stop_check_interval", stop_check_interval)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        base = generation_config if generation_config is not None else model.generation_config
        self.defaults = generation_settings(base, fast_decode=fast_decode, compile_step=compile_step)
        if self.defaults.output_scores and runner is None:
            raise ValueError(f"output_scores=True cannot apply: {ENGINE_SETTINGS['output_scores']}")
        self.model, self.max_batch, self.keep_results = model, max_batch, keep_results
        self.context = model.config.text_config.max_position_embeddings
        if runner is None:
            graphs = fast_decode and model.input_device.type == "cuda"
            if graphs:
                check_cuda_graphs(model)
            backend = "inductor" if compile_step is True else (compile_step or None)
            runner = FrameRunner(model, Drama3FrameSampling(), self.frame_criteria(model, self.defaults), graphs,
                                 backend, kept=KeptStates(model) if graphs else None)
        elif fast_decode or compile_step:
            raise ValueError("give fast_decode and compile_step to the runner, not with one")
        self.runner, self.observer, self.stop_check_interval = runner, observer, stop_check_interval
        self.noise_device = execution_device(model.lm_head)
        self.waiting: deque[Admission] = deque()
        self.requests: dict[str, EngineRequest] = {}  # waiting and running, by id
        self.results: OrderedDict[str, Drama3Result] = OrderedDict()  # finished and unread, in finishing order
        self.streams: dict[str, queue.Queue] = {}  # frame streams of streaming requests, running or unread
        self._ended_streams: OrderedDict[str, None] = OrderedDict()  # streams of finished requests, oldest first
        self._cancelled: set[str] = set()
        self._pending: list[torch.Tensor] = []  # frames' outputs not read back yet (device), of one slot layout
        self._pending_layout = -1  # the runner's layout of those frames
        self._ids = itertools.count()
        self._lock = threading.Condition()  # guards the dicts above, `waiting` and `_cancelled`
        self._stepping = threading.Lock()  # held by whoever runs a step
        self._thread: threading.Thread | None = None
        self._stopping = False

    @staticmethod
    def frame_criteria(model, settings) -> StoppingCriteriaList:
        """The device criteria every frame runs: EOS, then the frame limit (`settings.max_new_tokens` frames within
        the backbone's context; each sequence's own limit is set when it joins)."""
        context = model.config.text_config.max_position_embeddings
        return StoppingCriteriaList([Drama3EndOfSpeech(model.config.eos_token_id),
                                     Drama3FrameLimit(settings.max_new_tokens, context)])

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
        if seed is not None and generator is not None:
            raise ValueError("pass either seed or generator, not both")
        if seed is not None:
            check_seed(seed)
        if generator is None:
            generator = torch.Generator(device=self.noise_device)
            generator.manual_seed(seed) if seed is not None else generator.seed()
        elif not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        admission = self._checked_admission(input_ids, None, prompt_cache, [request_settings], [generator],
                                            on_frame, on_finish, streaming, record_timestamps)
        return self._queue(admission, [request_id], front)[0]

    def add_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, settings,
                  generators: list | None = None, prompt_cache: PromptCache | None = None) -> list[str]:
        """Queue a left-padded batch of prompts `[B, T, 1 + NCB]` (mask `[B, T]`, 0 = padding) as one admission
        with one prefill, all with `settings` (a checked GenerationConfig); returns their ids, in batch order.
        `generators`: one `torch.Generator` (or None) per sequence, or None for the runner's one random stream
        (`runner.one_stream`). This is how `generate` runs its batch; results come back through `get_result`."""
        generators = generators if generators is not None else [None] * input_ids.shape[0]
        admission = self._checked_admission(input_ids, attention_mask, prompt_cache, [settings] * len(generators),
                                            generators, None, None, False, False)
        return self._queue(admission, [None] * len(generators), False)

    def _checked_admission(self, input_ids, attention_mask, prompt_cache, settings: list, generators: list,
                           on_frame, on_finish, streaming: bool, record_timestamps: bool) -> Admission:
        """The checked spec of requests admitted together: prompt layout and values (one host read), prompt cache,
        frame limits; raises before anything is queued."""
        attention_mask, _ = self.model.checked_inputs(input_ids, attention_mask)  # reads the prompt back once
        # The prompts' lengths and main ids, for the results: one more read (none when the prompt is on the CPU).
        width = input_ids.shape[1]
        host = torch.cat((attention_mask.to(input_ids.device), input_ids[:, :, 0]), 1).cpu()  # [n, 2T]
        lengths, main_ids = host[:, :width].sum(1).tolist(), host[:, width:].tolist()
        input_ids = input_ids.to(self.model.input_device, torch.long)
        attention_mask = attention_mask.to(self.model.input_device)
        if prompt_cache is not None:
            if not isinstance(prompt_cache, PromptCache):
                raise TypeError(f"prompt_cache must be a PromptCache (PromptCache.build(model, prefix_rows)), got "
                                f"{type(prompt_cache).__name__}")
            prompt_cache.check(input_ids, attention_mask)
        requests = []
        for row, (length, request_settings, generator) in enumerate(zip(lengths, settings, generators)):
            limit = Drama3FrameLimit(request_settings.max_new_tokens, self.context)
            frames, reason = limit.limit(input_ids.shape[1])
            requests.append(EngineRequest(
                "", main_ids[row][input_ids.shape[1] - length :], request_settings, generator, frames, reason,
                on_frame, on_finish, queue.Queue() if streaming else None, [] if record_timestamps else None))
        return Admission(requests, input_ids, attention_mask, prompt_cache)

    def _queue(self, admission: Admission, request_ids: list, front: bool) -> list[str]:
        with self._lock:
            if self._stopping and self.is_running():
                raise RuntimeError("the engine is stopping (stop() was called and its thread has not ended yet): "
                                   "add requests after it has stopped, or to another engine")
            for request, request_id in zip(admission.requests, request_ids):
                if request_id is None:
                    request_id = f"req_{next(self._ids)}"
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
        """End running requests at the frame just made, with finish reason `"stop"` (a caller's stopping criterion;
        the stepping thread only, e.g. from an observer)."""
        for request_id in request_ids:
            self.requests[request_id].stopped = True
        self.runner.stop(request_ids)

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
        """Cancel every running and waiting request (their results say `"cancelled"`), free the frame state and end
        the engine's thread:
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
                self.runner.close()  # the state kept between requests is freed
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
                    self.runner.close()  # the state kept between requests is freed
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
            for admission in list(self.waiting):
                dropped = [r for r in admission.requests if r.request_id in cancelled]
                admission.requests = [r for r in admission.requests if r.request_id not in cancelled]
                if not admission.requests:
                    self.waiting.remove(admission)
                for request in dropped:
                    self._finish(request, FINISH_CANCELLED)
        running = set(self.runner.running)
        leaving = [self.requests[key] for key in cancelled if key in running]
        if leaving:
            self._read()  # frames made before the cancellation still reach their requests
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
                self._pending = []
                self.runner.close()
                for request in failed:
                    self._finish(request, FINISH_FAILED, error)
        with self._lock:
            return bool(self.requests)

    def _admit(self) -> None:
        """Prefill and admit waiting admissions: as many as there are free slots with nothing running, one while
        others run."""
        running = len(self.runner.running)
        others_run = running > 0
        while True:
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
            except Exception as error:  # noqa: BLE001  (these requests fail alone)
                logger.error("requests %s: prefill failed: %s", keys, error)
                self.runner.release(keys)
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
        """Read the pending frames back (one transfer), hand each made frame to its request, and retire the
        sequences that have ended."""
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
                request.first_frame_at = request.first_frame_at or now
                if request.timestamps is not None:
                    request.timestamps.append(clock)
                if request.on_frame is not None:
                    try:
                        request.on_frame(key, frame[1:])
                    except Exception as error:  # noqa: BLE001  (this request fails alone)
                        logger.error("request %s: on_frame failed: %s", key, error)
                        failed[key] = error
                        continue
                if request.stream is not None:
                    request.stream.put(frame[1:])
            if self.observer is not None:
                self.observer.frame_read(made)
        ended = [(self.requests[key], FINISH_FAILED, failed[key]) for key in failed]
        last = block[-1]
        for slot, key in zip(slots, keys):
            if key in failed or not bool(last[slot, -2]):
                continue
            request = self.requests[key]
            if request.stopped:
                reason = FINISH_STOP
            else:
                reason = request.limit_reason if int(last[slot, -1]) >= request.frame_limit else FINISH_EOS
            ended.append((request, reason, None))
        if ended:
            self.runner.release([request.request_id for request, _, _ in ended])
            for request, reason, error in ended:
                self._finish(request, reason, error)

    def _finish(self, request: EngineRequest, reason: str, error: BaseException | None = None) -> None:
        result = request.result(reason, error, self.model.config.num_codebooks)
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


__all__ = ["FINISH_CANCELLED", "FINISH_FAILED", "Drama3Engine", "Drama3Result"]
