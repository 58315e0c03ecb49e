"""The generation worker: queued speech requests, batched into one `generate` call at a time.

Requests wait in one queue. The worker (an asyncio task) takes the oldest request and every other waiting request
with the same sampling settings (`generate` applies one set of settings to its whole batch), up to `max_batch`,
and runs one `generate` over them in its generation thread. Each request keeps its own random generator (so a
request sampled inside a batch gives the audio it gives alone with the same seed), its own frame limit (a stopping
criterion stops it there) and its own audio stream. A long `input` is spoken in text chunks (`split_text`): after
each chunk the request goes back to the front of the queue with its spoken chunks as history, as `synthesize` does.

Audio reaches the client while it is generated: `BatchAudioRouter` (the batch's streamer) hands each sequence's
frames to that request's own `Drama3AudioStreamer`, whose codec state lasts over all of the request's text chunks
(so they join without a seam, as in `synthesize`), and the decoded chunks go to the request's asyncio queue. A client
that disconnects is marked cancelled: a waiting request is dropped, a running one is stopped by the stopping
criterion and leaves the batch at the next frame. A request that fails (its reference cannot be encoded, or
`generate` raises) fails alone with an OpenAI-shaped error; the worker goes on with the next batch.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..prompt_cache import PromptCache, PromptCacheStore
from ..streaming import Drama3AudioStreamer
from ..synthesis import encode_references, history_turns
from ..voice import Drama3Voice
from .errors import APIError

logger = logging.getLogger("transformers_drama3.serving")
FINISH_CANCELLED = "cancelled"


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
    sampling: dict  # settings shared by a batch: do_sample, temperature, top_p, top_k
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
    batch_sizes: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    audio_stream: Drama3AudioStreamer | None = None
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    first_audio_at: float | None = None
    closed: bool = False  # the HTTP side got its last event
    finished: bool = False  # counted and logged
    cancelled: threading.Event = field(default_factory=threading.Event)
    settled: threading.Event = field(default_factory=threading.Event)  # set once `finish` has recorded everything

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can share one `generate` call."""
        return tuple(sorted(self.sampling.items()))

    @property
    def next_text(self) -> str:
        return self.texts[len(self.spoken)]

    @property
    def on_last_chunk(self) -> bool:
        return len(self.spoken) == len(self.texts) - 1

    def cancel(self) -> None:
        """The client is gone: stop generating for this request (thread-safe)."""
        if not self.closed:
            self.cancelled.set()

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


class BatchAudioRouter(BaseStreamer):
    """The streamer of one batched `generate`: routes each sequence's frame codes to its request's audio stream.

    `put(codes [B, NCB])` comes once per frame step; a sequence that produced no frame (it has ended) has a row of
    -1. Written here rather than using `Drama3AudioStreamer(on_audio=...)` for the batch because a request's codec
    state must last over all of its text chunks, that is over several `generate` calls: each request owns a
    batch-1 `Drama3AudioStreamer`, ended when its last chunk's sequence ends (not only when the batch ends).
    """

    def __init__(self, jobs: list[SpeechJob], on_sequence_end):
        self.jobs, self.on_sequence_end = jobs, on_sequence_end
        self.ended = [False] * len(jobs)

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 3:  # the prompt rows [B, T, 1 + NCB], which generate puts first: no frames
            return
        produced = (value[:, 0] >= 0).tolist()  # [B]
        for index, (job, has_frame) in enumerate(zip(self.jobs, produced)):
            if has_frame and job.audio_stream is not None:  # None: the request failed or ended already
                job.frames += 1
                job.audio_stream.put(value[index : index + 1])  # [1, NCB]
            elif not self.ended[index]:
                self.ended[index] = True
                self.on_sequence_end(job)

    def end(self) -> None:
        for index, job in enumerate(self.jobs):
            if not self.ended[index]:
                self.ended[index] = True
                self.on_sequence_end(job)


class RequestStops(StoppingCriteria):
    """Stops a sequence whose client has gone, or that reached its own request's frame limit (a batch runs to the
    largest limit among its requests)."""

    def __init__(self, jobs: list[SpeechJob], prompt_rows: int):
        self.jobs, self.prompt_rows = jobs, prompt_rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        frames = input_ids.shape[1] - self.prompt_rows  # frames so far of every sequence still running
        stop = [job.cancelled.is_set() or frames >= job.max_new_tokens for job in self.jobs]
        return torch.tensor(stop, dtype=torch.bool, device=input_ids.device)  # [B]


@dataclass
class WorkerMetrics:
    """Counters shown by `GET /metrics`."""

    requests: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0  # refused because the queue was full
    batches: int = 0
    frames: int = 0
    audio_seconds: float = 0.0
    batch_sizes: Counter = field(default_factory=Counter)  # generate calls per batch size

    def as_dict(self) -> dict:
        sizes = {str(size): count for size, count in sorted(self.batch_sizes.items())}
        return {"requests": self.requests, "completed": self.completed, "failed": self.failed,
                "cancelled": self.cancelled, "rejected": self.rejected, "batches": self.batches,
                "batch_sizes": sizes, "max_batch_size": max(self.batch_sizes, default=0), "frames": self.frames,
                "audio_seconds": round(self.audio_seconds, 3)}


class GenerationWorker:
    """Runs queued `SpeechJob`s through `model.generate`, batching those with equal sampling settings."""

    def __init__(self, model, processor, max_batch: int, max_queue: int, batch_window_ms: float,
                 step_options: dict | None = None, log_text: bool = False, prompt_cache_bytes: int = 0):
        self.model, self.processor = model, processor
        self.max_batch, self.max_queue, self.batch_window = max_batch, max_queue, batch_window_ms / 1000
        self.step_options = step_options or {}  # how generate runs its frame step: fast_decode, compile_step
        self.log_text = log_text
        self.pending: deque[SpeechJob] = deque()
        self.running: list[SpeechJob] = []
        self.metrics = WorkerMetrics()
        self.lock = threading.Lock()  # metrics are updated from the event loop and the generation thread
        self.wakeup = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drama3-generate")
        self.overlap = model.input_device.type == "cuda"  # decode audio in a thread beside the frame loop on a GPU
        self.prompt_caches = PromptCacheStore(prompt_cache_bytes)  # saved voices' prefixes, by content

    # -- queue (event loop) ----------------------------------------------------------------------------------

    def submit(self, job: SpeechJob) -> None:
        """Queue `job`; 429 when `max_queue` requests are already waiting."""
        waiting = sum(1 for queued in self.pending if not queued.spoken)
        if waiting >= self.max_queue:
            with self.lock:
                self.metrics.rejected += 1
            raise APIError(429, f"the server is busy: {waiting} requests are waiting (--max-queue {self.max_queue}); "
                           "retry later", code="queue_full", headers={"Retry-After": "1"})
        with self.lock:
            self.metrics.requests += 1
        self.pending.append(job)
        self.wakeup.set()

    async def run(self) -> None:
        """Take batches from the queue and generate them, one at a time, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.pending:
                self.wakeup.clear()
                await self.wakeup.wait()
                if self.batch_window:  # let requests sent at the same moment join the batch
                    await asyncio.sleep(self.batch_window)
            batch = self.take_batch()
            if not batch:
                continue
            self.running = batch
            try:
                await loop.run_in_executor(self.executor, self.run_batch, batch)
            except Exception as error:  # noqa: BLE001  (a bug here must not stop the worker: fail the batch)
                logger.exception("the worker failed on requests %s", [job.request_id for job in batch])
                for job in batch:
                    self.finish(job, failure(error, "the server failed"))
            finally:
                self.running = []
            for job in reversed(batch):  # requests with text left go first, in their order
                if not job.finished:
                    self.pending.appendleft(job)

    def take_batch(self) -> list[SpeechJob]:
        """The oldest waiting request and those that can share its `generate` call, removed from the queue."""
        for job in [job for job in self.pending if job.cancelled.is_set() and job.started_at is None]:
            self.pending.remove(job)  # never started: nothing to free in the generation thread
            self.finish(job, None)
        if not self.pending:
            return []
        key = self.pending[0].batch_key
        batch = [job for job in self.pending if job.batch_key == key][: self.max_batch]
        for job in batch:
            self.pending.remove(job)
        return batch

    def snapshot(self) -> dict:
        """Counters and the current queue, for `GET /metrics`."""
        with self.lock:
            counters = self.metrics.as_dict()
        return {"queued": len(self.pending), "running": len(self.running), **counters,
                "prompt_cache": self.prompt_caches.stats()}

    @property
    def idle(self) -> bool:
        """No request is waiting or running."""
        return not self.pending and not self.running

    def cancel_all(self) -> None:
        """Stop every request: waiting ones are dropped, the running batch ends at its next frame (event loop)."""
        for job in [*self.pending, *self.running]:
            job.cancel()

    def shutdown(self) -> None:
        """Wait for the generation thread to finish its batch (call `cancel_all` first to make that quick)."""
        self.executor.shutdown(wait=True, cancel_futures=True)

    # -- generation (the generation thread) ------------------------------------------------------------------

    def run_batch(self, jobs: list[SpeechJob]) -> None:
        """Generate the next text chunk of every job; a failure fails the jobs it concerns, never the worker."""
        for job in [job for job in jobs if job.cancelled.is_set()]:  # left while waiting for its next chunk
            self.end_audio(job)
            self.finish(job, None)
        jobs = [job for job in jobs if not job.finished and self.start(job)]
        if not jobs:
            return
        try:
            inputs = self.processor([job.next_text for job in jobs], references=[job.references for job in jobs],
                                    history=[history_turns(job.spoken, job.codes) for job in jobs])
            prompt_rows = inputs["input_ids"].shape[1]  # [B, T, 1 + NCB], left-padded
            for index, job in enumerate(jobs):
                job.prompt_rows = job.prompt_rows or int(inputs["attention_mask"][index].sum())
                job.batch_sizes.append(len(jobs))
            with self.lock:
                self.metrics.batches += 1
                self.metrics.batch_sizes[len(jobs)] += 1
            output = self.model.generate(
                inputs["input_ids"], inputs["attention_mask"], prompt_cache=self.voice_prefix(jobs, inputs),
                streamer=BatchAudioRouter(jobs, self.end_of_sequence),
                generator=[job.generator for job in jobs],
                stopping_criteria=StoppingCriteriaList([RequestStops(jobs, prompt_rows)]),
                max_new_tokens=max(job.max_new_tokens for job in jobs),
                output_audio=False, **self.step_options, **jobs[0].sampling,
            )
        except Exception as error:  # noqa: BLE001  (every request of the batch fails; the worker goes on)
            logger.exception("generation failed for requests %s", [job.request_id for job in jobs])
            for job in jobs:
                self.end_audio(job)
                self.finish(job, failure(error, "generation failed"))
            return
        for index, job in enumerate(jobs):
            reason = output.finish_reason[index]
            if reason == "stop":  # our stopping criterion: the client left, or the request's own frame limit
                reason = FINISH_CANCELLED if job.cancelled.is_set() else "length"
            job.spoken.append(job.next_text)
            job.codes.append(output.codes[index].cpu())
            job.finish_reasons.append(reason)
            if job.closed or job.cancelled.is_set() or len(job.spoken) == len(job.texts):
                self.end_audio(job)
                self.finish(job, None)

    def voice_prefix(self, jobs: list[SpeechJob], inputs: dict) -> PromptCache | None:
        """The cached prefix of the batch's saved voice (built on first use), or None when there is nothing to share:
        no store, requests without the same saved voice first, or a batch padded inside the prefix (a prompt cache
        continues every sequence from the same rows). Keyed on the voice's content, so an edited voice file is a new
        entry."""
        voices = [job.references[0] if job.references else None for job in jobs]
        if self.prompt_caches.max_bytes == 0 or not all(isinstance(voice, Drama3Voice) for voice in voices):
            return None
        key = voice_content_key(voices[0])
        if any(voice_content_key(voice) != key for voice in voices[1:]):
            return None
        rows = self.processor.reference_prefix_rows([voices[0]])  # [P, 1 + NCB]
        if not bool(inputs["attention_mask"][:, : rows.shape[0]].all()):
            return None
        return self.prompt_caches.get(key, lambda: PromptCache.build(self.model, rows))

    def start(self, job: SpeechJob) -> bool:
        """Before a job's first chunk: its generator, audio stream and encoded references. False if it failed."""
        if job.started_at is not None:
            return True
        job.started_at = time.monotonic()
        try:
            job.generator = torch.Generator(device=self.model.input_device).manual_seed(job.seed)
            job.references = encode_references(self.processor, job.references)
            job.audio_stream = Drama3AudioStreamer(self.model.codec, overlap=self.overlap, on_audio=job.on_audio)
        except Exception as error:  # noqa: BLE001  (this request fails alone)
            logger.warning("request %s: cannot start: %s", job.request_id, error)
            self.finish(job, failure(error, "cannot prepare the request"))
            return False
        return True

    def end_of_sequence(self, job: SpeechJob) -> None:
        """A sequence of the running batch ended: if it was its request's last text chunk, the request's audio is
        complete now (its client need not wait for the rest of the batch)."""
        if job.on_last_chunk and not job.cancelled.is_set():
            if self.end_audio(job):
                job.close(JobDone(job.frames, job.prompt_rows))

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
            metrics = self.metrics
            metrics.frames += job.frames
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
        logger.info("request %s %s: %d frames (%.2f s of audio), %s in %d chunk(s), batch sizes %s, queued %.0f ms, "
                    "first audio after %s, real-time factor %s (generation time / audio time)", job.request_id,
                    outcome, job.frames, seconds, text, len(job.texts), job.batch_sizes,
                    ((job.started_at or now) - job.queued_at) * 1000, first, rtf)
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
