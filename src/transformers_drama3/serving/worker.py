"""The generation worker: a scheduler of speech requests on one `Drama3Engine` (continuous batching, engine.py).

Every request becomes engine requests, one per text chunk (`split_text`): its sampling settings, seed and frame
limit are its own, so requests with any mix of settings share the running batch. The worker's generation thread
steps the engine: between two frames it prepares at most one new request while others speak (its random generator,
its encoded references, its audio stream, its first chunk's prompt rows), then the engine admits waiting requests
(one prefill per frame while sequences run, up to `max_batch` running) and makes one frame of every running one. A
request that arrives while others speak is thus admitted at the next frame boundary; it never waits for the batch.

Each frame goes to its request's own `Drama3AudioStreamer`, whose codec state lasts over all of the request's text
chunks (they join without a seam, as in `synthesize`), and the decoded chunks go to the request's asyncio queue.
When a chunk ends, the next one is queued at once, at the front of the engine's queue, with the spoken chunks as
history (`history_turns`, as `synthesize` does). A client that disconnects cancels its request: a waiting one is
dropped, a running one leaves the batch at the next frame. A request that fails (its reference cannot be encoded,
its prefill or its audio decoding raises) fails alone with an OpenAI-shaped error; the others go on. The model is
used by the generation thread only (voice enrolment runs there too, through `call`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..generation import FINISH_CANCELLED, FINISH_FAILED, Drama3Engine, Drama3Result, PromptCache, PromptCacheStore
from ..streaming import Drama3AudioStreamer
from ..synthesis import encode_references, history_turns
from ..voice import Drama3Voice
from .errors import APIError

logger = logging.getLogger("transformers_drama3.serving")


@dataclass
class JobDone:
    """The last event of a request whose audio is complete: frames generated and rows of its first prompt."""

    frames: int
    prompt_rows: int


@dataclass(eq=False)
class SpeechJob:
    """One speech request on its way through the worker.

    Events for the HTTP side arrive on `events` (an asyncio queue of the server's loop): float32 audio chunks
    `[samples]` in order, then one `JobDone` or `APIError` (`close`). `finish` then counts and logs the request.
    """

    request_id: str
    texts: list[str]  # text chunks, each starting with its speaker tag
    references: list  # Drama3Voice or {"transcript", "audio" float32 [L], "sampling_rate"}
    sampling: dict  # this request's settings: do_sample, temperature, top_p, top_k, ras_*, codebook_*
    max_new_tokens: int  # frames per text chunk
    seed: int
    text_length: int  # characters of the request's input, for the log
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    spoken: list[str] = field(default_factory=list)
    codes: list[torch.Tensor] = field(default_factory=list)  # [NCB, n] per spoken chunk
    finish_reasons: list[str] = field(default_factory=list)
    frames: int = 0
    prompt_rows: int = 0  # rows of the first chunk's prompt
    generator: torch.Generator | None = None
    audio_stream: Drama3AudioStreamer | None = None
    engine_id: str | None = None  # the engine request of the chunk being spoken
    engine: Drama3Engine | None = None  # set by the worker, so that `cancel` reaches the engine
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # its first chunk was admitted into the running batch
    first_audio_at: float | None = None
    closed: bool = False  # the HTTP side got its last event
    finished: bool = False  # counted and logged
    cancelled: threading.Event = field(default_factory=threading.Event)
    settled: threading.Event = field(default_factory=threading.Event)  # set once `finish` has recorded everything

    @property
    def next_text(self) -> str:
        return self.texts[len(self.spoken)]

    @property
    def on_last_chunk(self) -> bool:
        return len(self.spoken) == len(self.texts) - 1

    def cancel(self) -> None:
        """The client is gone: stop generating for this request (thread-safe); its engine request is dropped from the
        queue or leaves the batch at the next frame."""
        if not self.closed:
            self.cancelled.set()
            engine, engine_id = self.engine, self.engine_id
            if engine is not None and engine_id is not None:
                engine.cancel_request(engine_id)

    def emit(self, event) -> None:
        """Queue an event for the HTTP side (callable from any thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def on_audio(self, sequence: int, chunk: torch.Tensor | None) -> None:
        """`Drama3AudioStreamer`'s callback: a decoded chunk of this request (None: its stream ended)."""
        if chunk is None:
            return
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
        self.emit(chunk)

    def close(self, event: JobDone | APIError) -> None:
        """Send the last event (once)."""
        if not self.closed:
            self.closed = True
            self.emit(event)


@dataclass
class WorkerMetrics:
    """Counters shown by `GET /metrics`."""

    requests: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0  # refused because the queue was full
    steps: int = 0  # frame steps of the engine
    frames: int = 0
    audio_seconds: float = 0.0
    occupancy: Counter = field(default_factory=Counter)  # frame steps by the number of requests that made a frame

    def as_dict(self) -> dict:
        rows = {str(size): count for size, count in sorted(self.occupancy.items())}
        return {"requests": self.requests, "completed": self.completed, "failed": self.failed,
                "cancelled": self.cancelled, "rejected": self.rejected, "steps": self.steps, "occupancy": rows,
                "max_occupancy": max(self.occupancy, default=0), "frames": self.frames,
                "audio_seconds": round(self.audio_seconds, 3)}


class GenerationWorker:
    """Schedules `SpeechJob`s on one `Drama3Engine`, stepped by the worker's generation thread (module docstring)."""

    def __init__(self, model, processor, max_batch: int, max_queue: int, step_options: dict | None = None,
                 log_text: bool = False, prompt_cache_bytes: int = 0):
        self.model, self.processor = model, processor
        self.max_batch, self.max_queue = max_batch, max_queue
        self.engine = Drama3Engine(model, max_batch=max_batch, **(step_options or {}))
        self.log_text = log_text
        self.jobs: dict[str, SpeechJob] = {}  # submitted and not finished, by request id
        self.tasks: deque = deque()  # callables for the generation thread: preparing jobs, voice enrolment
        self.metrics = WorkerMetrics()
        self.lock = threading.Condition()  # guards jobs, tasks and metrics; wakes the generation thread
        self.overlap = model.input_device.type == "cuda"  # decode audio in a thread beside the frame loop on a GPU
        self.prompt_caches = PromptCacheStore(prompt_cache_bytes)  # saved voices' prefixes, by content
        self.step_rows = 0  # requests that made a frame in the step running now
        self.stopping = False
        self.thread = threading.Thread(target=self.loop, name="drama3-generate", daemon=True)

    # -- requests (event loop) -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the generation thread."""
        self.thread.start()

    def submit(self, *jobs: SpeechJob) -> None:
        """Queue `jobs` (a batch's items) all together, or none of them: 429 when they would take the number of
        requests waiting for their first frame past `max_queue` (a caller refuses more than `max_queue` jobs at once
        up front: they could never be queued)."""
        with self.lock:
            waiting = len(self.pending)
            if waiting + len(jobs) > self.max_queue:
                self.metrics.rejected += len(jobs)
                raise APIError(429, f"the server is busy: {waiting} requests are waiting and {len(jobs)} more would "
                               f"pass --max-queue {self.max_queue}; retry later", code="queue_full",
                               headers={"Retry-After": "1"})
            for job in jobs:
                self.metrics.requests += 1
                job.engine = self.engine
                self.jobs[job.request_id] = job
                self.tasks.append(lambda job=job: self.prepare(job))
            self.lock.notify_all()

    async def call(self, function):
        """`function()` run by the generation thread between two frames (the model is used by that thread only)."""
        future = Future()

        def task():
            try:
                future.set_result(function())
            except BaseException as error:  # noqa: BLE001  (handed to the caller)
                future.set_exception(error)

        with self.lock:
            self.tasks.append(task)
            self.lock.notify_all()
        return await asyncio.wrap_future(future)

    @property
    def pending(self) -> list[SpeechJob]:
        """Requests not yet admitted into the running batch."""
        return [job for job in list(self.jobs.values()) if job.started_at is None]

    @property
    def running(self) -> list[SpeechJob]:
        """Requests admitted into the running batch and not finished."""
        return [job for job in list(self.jobs.values()) if job.started_at is not None]

    def snapshot(self) -> dict:
        """Counters and the current queue, for `GET /metrics`."""
        with self.lock:
            counters = self.metrics.as_dict()
            pending, running = len(self.pending), len(self.running)
        return {"queued": pending, "running": running, "running_sequences": self.engine.running, **counters,
                "prompt_cache": self.prompt_caches.stats()}

    @property
    def idle(self) -> bool:
        """No request is waiting or running."""
        return not self.jobs

    def cancel_all(self) -> None:
        """Stop every request: waiting ones are dropped, running ones leave the batch at the next frame."""
        for job in list(self.jobs.values()):
            job.cancel()

    def shutdown(self) -> None:
        """Stop the generation thread once it has finished the requests left (call `cancel_all` first to make that
        quick)."""
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        if self.thread.is_alive():
            self.thread.join()

    # -- the generation thread -------------------------------------------------------------------------------

    def loop(self) -> None:
        """Run tasks and engine steps until `shutdown`: all waiting tasks when nothing runs, one between two frames
        while requests speak (a running stream waits for one preparation at most, as for one prefill)."""
        busy = False
        while True:
            with self.lock:
                while not self.tasks and not busy and not (self.stopping and not self.jobs):
                    self.lock.wait()
                if self.stopping and not self.jobs and not self.tasks and not busy:
                    return
                count = 1 if busy else len(self.tasks)
                tasks = [self.tasks.popleft() for _ in range(min(count, len(self.tasks)))]
            try:
                for task in tasks:
                    task()
                self.step_rows = 0
                busy = self.engine.step()
            except Exception as error:  # noqa: BLE001  (a bug here must not stop the thread: fail what runs)
                logger.exception("the worker failed")
                for job in list(self.jobs.values()):
                    job.cancel()
                    self.finish(job, failure(error, "the server failed"))
                busy = bool(self.engine.requests)
            if self.step_rows:
                with self.lock:
                    self.metrics.steps += 1
                    self.metrics.frames += self.step_rows
                    self.metrics.occupancy[self.step_rows] += 1

    def prepare(self, job: SpeechJob) -> None:
        """Before a job's first chunk: its generator, audio stream and encoded references; then its first chunk."""
        if job.cancelled.is_set():
            self.finish(job, None)
            return
        try:
            job.generator = torch.Generator(device=self.engine.noise_device).manual_seed(job.seed)
            job.references = encode_references(self.processor, job.references)
            job.audio_stream = Drama3AudioStreamer(self.model.codec, overlap=self.overlap, on_audio=job.on_audio)
        except Exception as error:  # noqa: BLE001  (this request fails alone)
            logger.warning("request %s: cannot start: %s", job.request_id, error)
            self.end_audio(job)
            self.finish(job, failure(error, "cannot prepare the request"))
            return
        self.add_chunk(job)

    def add_chunk(self, job: SpeechJob) -> None:
        """Queue the job's next text chunk in the engine, with its spoken chunks as history (a continuation goes
        before the waiting requests)."""
        try:
            inputs = self.processor(job.next_text, references=job.references,
                                    history=history_turns(job.spoken, job.codes))
            rows = inputs["input_ids"][0]  # [T, 1 + NCB]
            job.prompt_rows = job.prompt_rows or rows.shape[0]
            job.engine_id = self.engine.add_request(
                rows, request_id=f"{job.request_id}/{len(job.spoken)}", max_new_tokens=job.max_new_tokens,
                generator=job.generator, prompt_cache=self.voice_prefix(job), on_frame=self.on_frame,
                on_finish=self.on_chunk_end, front=bool(job.spoken), **job.sampling)
        except Exception as error:  # noqa: BLE001  (this request fails alone)
            logger.exception("request %s: cannot queue its text", job.request_id)
            self.end_audio(job)
            self.finish(job, failure(error, "generation failed"))
            return
        if job.cancelled.is_set():  # the client left while the chunk was being queued
            self.engine.cancel_request(job.engine_id)

    def job_of(self, engine_id: str) -> SpeechJob:
        return self.jobs[engine_id.rpartition("/")[0]]

    def on_frame(self, engine_id: str, codes: torch.Tensor) -> None:
        """The engine's callback: one frame `[NCB]` of a job's chunk, to its audio stream."""
        job = self.job_of(engine_id)
        self.step_rows += 1
        if job.started_at is None:  # its first frame: it was admitted in this step
            admitted = self.engine.requests.get(engine_id)
            job.started_at = (admitted and admitted.admitted_at) or time.monotonic()
        job.frames += 1
        if job.audio_stream is not None:
            job.audio_stream.put(codes[None])  # [1, NCB]

    def on_chunk_end(self, result: Drama3Result) -> None:
        """The engine's callback: a chunk ended. The next one is queued at once, or the request is complete."""
        job = self.job_of(result.request_id)
        try:
            if result.finish_reason == FINISH_FAILED:
                logger.error("request %s failed: %s", job.request_id, result.error)
                self.end_audio(job)
                self.finish(job, failure(result.exception, "generation failed"))
                return
            if result.finish_reason != FINISH_CANCELLED and not job.cancelled.is_set():
                job.spoken.append(job.next_text)
                job.codes.append(result.codes)
                job.finish_reasons.append(result.finish_reason)
                if len(job.spoken) < len(job.texts):
                    self.add_chunk(job)
                    return
            if self.end_audio(job) and not job.cancelled.is_set():
                job.close(JobDone(job.frames, job.prompt_rows))
            self.finish(job, None)
        except Exception as error:  # noqa: BLE001  (a bug here fails this request, never the generation thread)
            logger.exception("request %s: the worker failed", job.request_id)
            self.finish(job, failure(error, "the server failed"))

    def voice_prefix(self, job: SpeechJob) -> PromptCache | None:
        """The cached prefix of the job's saved voice (built on first use), or None without a store or when its first
        reference is not a saved voice. Keyed on the voice's content, so an edited voice file is a new entry."""
        voice = job.references[0] if job.references else None
        if self.prompt_caches.max_bytes == 0 or not isinstance(voice, Drama3Voice):
            return None
        rows = self.processor.reference_prefix_rows([voice])  # [P, 1 + NCB]
        return self.prompt_caches.get(voice_content_key(voice), lambda: PromptCache.build(self.model, rows))

    def end_audio(self, job: SpeechJob) -> bool:
        """Flush the request's audio stream (once); False if decoding failed (the request is then closed with the
        error)."""
        stream, job.audio_stream = job.audio_stream, None
        if stream is None:
            return True
        try:
            stream.end()
        except Exception as error:  # noqa: BLE001
            logger.exception("request %s: audio decoding failed", job.request_id)
            job.cancelled.set()
            job.close(failure(error, "audio decoding failed"))
            return False
        return True

    def finish(self, job: SpeechJob, error: APIError | None) -> None:
        """Close the request if it is still open (with `error`, as cancelled, or done), count it and log it."""
        if job.finished:
            return
        job.finished = True
        if error is not None:
            job.close(error)
        elif job.cancelled.is_set():
            job.close(APIError(499, "the request was cancelled", code="cancelled"))
        else:
            job.close(JobDone(job.frames, job.prompt_rows))
        seconds = job.frames * self.model.config.codec_config.frame_length / self.model.config.sampling_rate
        with self.lock:
            self.jobs.pop(job.request_id, None)
            metrics = self.metrics
            metrics.audio_seconds += seconds
            if error is not None:
                metrics.failed += 1
                outcome = f"failed ({error.message})"
            elif job.cancelled.is_set():
                metrics.cancelled += 1
                outcome = "cancelled (client gone)"
            else:
                metrics.completed += 1
                outcome = "done, finish " + ",".join(job.finish_reasons)
        now = time.monotonic()
        wall = now - (job.started_at or now)
        first = "-" if job.first_audio_at is None else f"{(job.first_audio_at - job.queued_at) * 1000:.0f} ms"
        rtf = f"{wall / seconds:.2f}" if seconds else "-"
        text = f"text {job.texts!r}" if self.log_text else f"text of {job.text_length} characters"
        logger.info("request %s %s: %d frames (%.2f s of audio), %s in %d chunk(s), queued %.0f ms, first audio "
                    "after %s, real-time factor %s (generation time / audio time)", job.request_id, outcome,
                    job.frames, seconds, text, len(job.texts), ((job.started_at or now) - job.queued_at) * 1000, first,
                    rtf)
        job.settled.set()


def voice_content_key(voice: Drama3Voice) -> str:
    """A digest of what a voice's prompt rows are made of: its codes and its transcript."""
    digest = hashlib.sha256(voice.codes.numpy().tobytes())
    digest.update(voice.transcript.encode("utf-8"))
    return digest.hexdigest()


def failure(error: Exception, what: str) -> APIError:
    """An exception raised while generating, as the error its client gets."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):  # the package's checks of a request's content (e.g. its reference audio)
        return APIError(400, f"{what}: {error}", code="invalid_request")
    if isinstance(error, torch.OutOfMemoryError):
        return APIError(503, f"{what}: out of memory; retry with a shorter text or fewer references",
                        code="out_of_memory")
    return APIError(500, f"{what}: {type(error).__name__}: {error}", code="generation_failed")
