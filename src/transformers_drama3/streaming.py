"""Audio streamers: hear speech while `generate` is still making it.

`Drama3AudioStreamer` is a transformers `BaseStreamer` (pass it as `generate(..., streamer=...)`) that turns the
frames of a request into audio chunks with the codec's streaming decoder, so the chunks join into exactly the audio
of one decode of all frames.
"""

from __future__ import annotations

import queue
import threading

import torch
from transformers.generation.streamers import BaseStreamer


class Drama3AudioStreamer(BaseStreamer):
    """Streams audio while `generate` runs: a transformers `BaseStreamer` and an iterator of float32 chunks.

    `generate(..., streamer=streamer)` puts each new frame's codes; every `chunk_frames` frames (the first chunk
    after `first_chunk_frames`, for an early start) the codec decodes them with carried state, so the chunks
    concatenate to the audio of one decode of all frames. Iterate from another thread, or read `chunks` after
    generation. Batch size 1 only.

    `overlap=True` decodes in a worker thread (on its own CUDA stream on a GPU) while generation goes on, instead of
    in the generating thread between two frames: the same chunks, in the same order, and the codec's time no longer
    adds to the frames'. `end()` waits for the worker and re-raises an error it met.
    """

    def __init__(
        self, codec, chunk_frames: int = 7, first_chunk_frames: int = 1, timeout: float | None = None,
        overlap: bool = False,
    ):
        if chunk_frames < 1 or first_chunk_frames < 1:
            raise ValueError(f"chunk_frames ({chunk_frames}) and first_chunk_frames ({first_chunk_frames}) must be >= 1")
        self.decoder = codec.stream()
        self.chunk_frames = chunk_frames
        self.first_chunk_frames = first_chunk_frames
        self.timeout = timeout
        self.chunks: list[torch.Tensor] = []
        self._pending: list[torch.Tensor] = []  # codes [NCB] of frames not decoded yet
        self._flushed = 0  # chunks handed to the codec
        self._queue: queue.Queue = queue.Queue()
        self._jobs: queue.Queue | None = queue.Queue() if overlap else None  # (codes, CUDA event or None), None = stop
        self._worker = threading.Thread(target=self._decode_jobs, daemon=True) if overlap else None
        self._error: BaseException | None = None  # the worker's first error: later chunks are dropped
        if self._worker is not None:
            self._worker.start()

    def put(self, value: torch.Tensor) -> None:
        """`value`: the codes `[1, NCB]` of one new frame."""
        if value.dim() != 2 or value.shape[0] != 1:
            raise ValueError(f"Drama3AudioStreamer takes one frame of batch 1, codes [1, num_codebooks]; got {tuple(value.shape)}")
        self._pending.append(value[0])
        due = self.first_chunk_frames if not self._flushed else self.chunk_frames
        if len(self._pending) >= due:
            self._flush()

    def end(self) -> None:
        self._flush()
        if self._worker is not None and self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join()
        self._queue.put(None)
        error, self._error = self._error, None
        if error is not None:  # raised once, by the first end()
            raise error

    def _flush(self) -> None:
        if not self._pending:
            return
        codes = torch.stack(self._pending, dim=1)[None]  # [1, NCB, n]
        self._pending = []
        self._flushed += 1
        if self._jobs is None:
            self._emit(self._decode(codes))
            return
        event = None
        if codes.device.type == "cuda":  # the worker's stream waits for the codes to be written
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(codes.device))
        self._jobs.put((codes, event))

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder.decode(codes)[0].cpu()  # [n * frame_length]

    def _emit(self, chunk: torch.Tensor) -> None:
        self.chunks.append(chunk)
        self._queue.put(chunk)

    def _decode_jobs(self) -> None:
        """The worker of `overlap=True`: decode chunks in order until told to stop; keep the first error."""
        stream = None
        while (job := self._jobs.get()) is not None:
            if self._error is not None:
                continue
            codes, event = job
            try:
                if event is None:
                    self._emit(self._decode(codes))
                    continue
                stream = stream or torch.cuda.Stream(codes.device)
                with torch.cuda.stream(stream):
                    stream.wait_event(event)
                    codes.record_stream(stream)
                    self._emit(self._decode(codes))
            except Exception as error:  # noqa: BLE001  (re-raised by end(), in the generating thread)
                self._error = error

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        chunk = self._queue.get(timeout=self.timeout)
        if chunk is None:
            raise StopIteration
        return chunk


__all__ = ["Drama3AudioStreamer"]
