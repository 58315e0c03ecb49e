"""Audio streamers: hear speech while `generate` is still making it.

`generate(..., streamer=...)` first hands the streamer the prompt rows `[B, T, 1 + NCB]` (as transformers' generate
does; Drama 3 streamers skip them), then calls `streamer.put(codes)` once per frame step in which at least one
sequence made a frame, with `codes [B, NCB]` (long) for every sequence of the call; the row of a sequence that made no frame in that
step (it has ended) is all -1. `streamer.end()` follows the last frame. Any transformers `BaseStreamer` can listen.

`Drama3AudioStreamer` turns those frames into audio chunks with the codec's streaming decoder, one decoder per
sequence, so each sequence's chunks join into exactly the audio of one decode of all its frames.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

import torch
from transformers.generation.streamers import BaseStreamer

from .device_placement import execution_device

# on_audio(sequence, chunk): a decoded float32 chunk `[n * frame_length]` of `sequence`, or None once its audio is done.
AudioCallback = Callable[[int, "torch.Tensor | None"], None]


class Drama3AudioStreamer(BaseStreamer):
    """Streams audio while `generate` runs: a transformers `BaseStreamer` and, for one sequence, an iterator of chunks.

    Every `chunk_frames` frames of a sequence (its first chunk after `first_chunk_frames`, for an early start) the
    codec decodes them with carried state. Batch 1: iterate the streamer (from another thread) or read `chunks` after
    generation. Any batch: pass `on_audio(sequence, chunk)`, called with each chunk of each sequence in order, then
    with `chunk=None` as soon as that sequence has ended (not only at the end of the call).

    `overlap=True` decodes in a worker thread (on its own CUDA stream on a GPU) while generation goes on, instead of
    in the generating thread between two frames: the same chunks in the same order, and the codec's time no longer
    adds to the frames'. `on_audio` is then called from the worker. `end()` waits for the worker and re-raises an
    error it met.

    Codes may arrive on any device (`generate` puts them on the model's, the engine on the CPU): each chunk's codes
    move to the codec's device once, and each chunk of audio comes back to the CPU once (float32).
    """

    def __init__(
        self, codec, chunk_frames: int = 7, first_chunk_frames: int = 1, timeout: float | None = None,
        overlap: bool = False, on_audio: AudioCallback | None = None,
    ):
        if chunk_frames < 1 or first_chunk_frames < 1:
            raise ValueError(f"chunk_frames ({chunk_frames}) and first_chunk_frames ({first_chunk_frames}) must be >= 1")
        self.codec = codec
        self.chunk_frames = chunk_frames
        self.first_chunk_frames = first_chunk_frames
        self.timeout = timeout
        self.on_audio = on_audio
        self.chunks: list[torch.Tensor] = []  # batch 1 without on_audio: the chunks so far
        self._sequences: list[_SequenceStream] | None = None  # one per sequence, made at the first put
        self._queue: queue.Queue = queue.Queue()
        self._jobs: queue.Queue | None = queue.Queue() if overlap else None  # (sequence, codes, CUDA event), None = stop
        self._worker = threading.Thread(target=self._decode_jobs, daemon=True) if overlap else None
        self._error: BaseException | None = None  # the worker's first error: later chunks are dropped
        if self._worker is not None:
            self._worker.start()

    @property
    def decoder(self):
        """The streaming decoder of sequence 0 (batch 1)."""
        return self._stream(0, 1).decoder

    def _stream(self, sequence: int, batch: int) -> _SequenceStream:
        if self._sequences is None:
            if batch > 1 and self.on_audio is None:
                raise ValueError(
                    f"Drama3AudioStreamer got a batch of {batch} sequences: pass on_audio=fn(sequence, chunk) to "
                    "receive each sequence's audio (iterating the streamer serves one sequence)"
                )
            self._sequences = [_SequenceStream(self.codec.stream()) for _ in range(batch)]
        if batch != len(self._sequences):
            raise ValueError(f"Drama3AudioStreamer serves one call: it has {len(self._sequences)} sequences, got {batch}")
        return self._sequences[sequence]

    def put(self, value: torch.Tensor) -> None:
        """`value`: the codes `[B, NCB]` of one frame step, a row of -1 for a sequence that made no frame (the prompt
        rows `[B, T, 1 + NCB]`, which `generate` puts first, are no frames)."""
        if value.dim() == 3:
            return
        if value.dim() != 2:
            raise ValueError(f"Drama3AudioStreamer takes one frame step's codes [batch, num_codebooks]; got {tuple(value.shape)}")
        made = (value[:, 0] >= 0).tolist()
        for sequence, has_frame in enumerate(made):
            stream = self._stream(sequence, len(made))
            if stream.ended:
                continue
            if not has_frame:
                self._finish(sequence)
                continue
            stream.pending.append(value[sequence])
            due = self.first_chunk_frames if not stream.flushed else self.chunk_frames
            if len(stream.pending) >= due:
                self._flush(sequence)

    def end(self) -> None:
        for sequence in range(len(self._sequences or ())):
            if not self._sequences[sequence].ended:
                self._finish(sequence)
        if self._worker is not None and self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join()
        self._queue.put(None)
        error, self._error = self._error, None
        if error is not None:  # raised once, by the first end()
            raise error

    def _finish(self, sequence: int) -> None:
        """Decode what is left of `sequence` and announce the end of its audio."""
        self._flush(sequence)
        self._sequences[sequence].ended = True
        self._submit(sequence, None)

    def _flush(self, sequence: int) -> None:
        stream = self._sequences[sequence]
        if not stream.pending:
            return
        codes = torch.stack(stream.pending, dim=1)[None]  # [1, NCB, n]
        stream.pending = []
        stream.flushed += 1
        self._submit(sequence, codes)

    def _submit(self, sequence: int, codes: torch.Tensor | None) -> None:
        """Decode `codes` (None: the end mark) of `sequence`, here or in the worker, in order."""
        if self._jobs is None:
            self._emit(sequence, None if codes is None else self._decode(sequence, codes))
            return
        event = None
        if codes is not None and codes.device.type == "cuda":  # marks when the frame loop's stream wrote the codes
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(codes.device))
        self._jobs.put((sequence, codes, event))

    def _decode(self, sequence: int, codes: torch.Tensor) -> torch.Tensor:
        """One chunk's codes `[1, NCB, n]` (any device: the decoder moves them to the codec's once) -> its audio
        `[n * frame_length]`, brought back to the CPU once."""
        return self._sequences[sequence].decoder.decode(codes).audio_values[0, 0].cpu()

    def _emit(self, sequence: int, chunk: torch.Tensor | None) -> None:
        if self.on_audio is not None:
            self.on_audio(sequence, chunk)
        elif chunk is not None:
            self.chunks.append(chunk)
            self._queue.put(chunk)

    def _decode_jobs(self) -> None:
        """The worker of `overlap=True`: decode chunks in order until told to stop; keep the first error.

        With the codec on a GPU, every decode runs on the worker's own CUDA stream. Codes made on a GPU are waited
        for there (their event), never by the frame loop; codes from the CPU (the engine's) are copied to the codec's
        device on that stream."""
        device = execution_device(self.codec)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        while (job := self._jobs.get()) is not None:
            if self._error is not None:
                continue
            sequence, codes, event = job
            try:
                if codes is None:
                    self._emit(sequence, None)
                    continue
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    if event is not None and stream is not None:
                        stream.wait_event(event)
                        codes.record_stream(stream)
                    elif event is not None:  # GPU codes, codec elsewhere: the copy out waits for them here
                        event.synchronize()
                    self._emit(sequence, self._decode(sequence, codes))
            except Exception as error:  # noqa: BLE001  (re-raised by end(), in the generating thread)
                self._error = error

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        chunk = self._queue.get(timeout=self.timeout)
        if chunk is None:
            raise StopIteration
        return chunk


class _SequenceStream:
    """The streaming state of one sequence: its codec decoder, frames not decoded yet, chunks sent, whether it ended."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.pending: list[torch.Tensor] = []  # codes [NCB] of frames not decoded yet
        self.flushed = 0
        self.ended = False


__all__ = ["AudioCallback", "Drama3AudioStreamer"]
