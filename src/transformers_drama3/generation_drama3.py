"""Speech generation for Drama 3 (SPEC 5.3, 6, 7): the frame loop, its settings, stopping, batching and streaming.

`FishOmniForSpeech.generate(input_ids, ...)` prefills the backbone and the tower over the prompt rows, then per
frame: main token (EOS or `<|semantic:c0|>`, with repetition-aware sampling) -> tower codes c1..c9 -> the new row
is embedded and fed back to the backbone. Everything per frame stays on the device: sampling, the RAS window and
the stop flags are tensors; the host looks at the stop flags every `stop_check_interval` frames, and finished
sequences then leave the batch (they stop costing backbone and tower work).
"""

from __future__ import annotations

import copy
import queue
import threading
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

from .device_placement import execution_device
from .fast_decode import check_fast_decode, run_fast
from .parallel import check_fast_decode_allowed, shared_seed
from .sampling import FrameSampler

# Drama 3 settings kept on `model.generation_config` (defaults of the official server, SPEC 6 and 7).
DRAMA3_GENERATION_DEFAULTS = {
    "do_sample": True,
    "max_new_tokens": 2048,  # frames: 2048 frames = 95 s of audio
    "temperature": 1.0,  # main token
    "top_p": 0.9,
    "top_k": None,  # no top-k for the main token: a cap of 30 makes reference-free takes fall silent
    "ras_window": 16,
    "ras_temperature": 1.0,
    "ras_top_k": 30,
    "ras_top_p": 0.95,
    "codebook_temperature": 1.0,
    "codebook_top_k": 30,  # capped at 30 (SPEC 6)
    "codebook_top_p": 0.9,
    "stop_check_interval": 8,  # frames between two host checks of the stop flags
    "fast_decode": False,  # preallocated state and, on CUDA, one captured CUDA graph per frame step (fast_decode.py)
}
# Arguments that transformers' pipelines pass to every `generate` and that mean nothing here.
_IGNORED_PIPELINE_ARGS = ("pad_token_id", "bos_token_id")
FINISH_EOS, FINISH_LENGTH, FINISH_CONTEXT = "eos", "length", "context"


@dataclass
class Drama3GenerateOutput(ModelOutput):
    """What `generate` returns.

    sequences: `[B, T + N, 1 + NCB]` prompt rows followed by the generated frame rows (rows after a sequence's
        end are zeros). codes: per sequence `[NCB, n_i]` (c0..c9 of each generated frame). audio: per sequence
        float32 `[n_i * frame_length]` (None with `output_audio=False`). finish_reason: per sequence `"eos"`,
        `"length"` (max_new_tokens) or `"context"` (the backbone's max_position_embeddings).
    """

    sequences: torch.LongTensor | None = None
    codes: list[torch.LongTensor] | None = None
    audio: list[torch.Tensor] | None = None
    finish_reason: list[str] | None = None
    sampling_rate: int | None = None


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


class Drama3GenerationMixin:
    """`generate` for `FishOmniForSpeech` (mixed into the model class)."""

    def _init_generation_config(self) -> None:
        """Put the Drama 3 defaults on `generation_config` (a loaded `generation_config.json` overrides them)."""
        for key, value in DRAMA3_GENERATION_DEFAULTS.items():
            setattr(self.generation_config, key, value)
        self.generation_config.eos_token_id = self.config.eos_token_id

    def reset_fast_decode(self) -> None:
        """Free the preallocated state and captured CUDA graphs that `generate(..., fast_decode=True)` keeps for
        later calls (they are rebuilt on the next such call)."""
        self._fast_decoder = None

    def _generation_settings(self, generation_config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
        """The model's generation config updated with `generation_config` and per-call keywords; checked."""
        settings = copy.deepcopy(self.generation_config)
        for key, value in DRAMA3_GENERATION_DEFAULTS.items():  # a generation_config.json may lack our keys
            if not hasattr(settings, key):
                setattr(settings, key, value)
        if generation_config is not None:
            settings.update(**generation_config.to_diff_dict())
        for key in _IGNORED_PIPELINE_ARGS:
            kwargs.pop(key, None)
        unknown = sorted(set(kwargs) - set(DRAMA3_GENERATION_DEFAULTS))
        if unknown:
            raise TypeError(
                f"generate() got unknown or unsupported arguments {unknown}; Drama 3 generation accepts "
                f"{sorted(DRAMA3_GENERATION_DEFAULTS)} (plus input_ids, attention_mask, generation_config, streamer, "
                "seed, generator, output_audio, show_progress, return_dict_in_generate)"
            )
        settings.update(**kwargs)
        if settings.max_new_tokens is None or settings.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens (frames) must be >= 1, got {settings.max_new_tokens}")
        if settings.stop_check_interval < 1:
            raise ValueError(f"stop_check_interval must be >= 1, got {settings.stop_check_interval}")
        if not isinstance(settings.fast_decode, bool):
            raise ValueError(f"fast_decode must be True or False, got {settings.fast_decode!r}")
        if settings.do_sample:
            for name in ("temperature", "ras_temperature", "codebook_temperature"):
                if getattr(settings, name) is None or getattr(settings, name) <= 0:
                    raise ValueError(f"{name} must be > 0 when sampling (use do_sample=False for greedy), got {getattr(settings, name)}")
            for name in ("top_p", "ras_top_p", "codebook_top_p"):
                if not 0 < getattr(settings, name) <= 1:
                    raise ValueError(f"{name} must be in (0, 1], got {getattr(settings, name)}")
        return settings

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,  # [B, T, 1 + NCB] prompt frame rows from Drama3Processor
        attention_mask: torch.Tensor | None = None,  # [B, T], 0 = left padding
        generation_config: GenerationConfig | None = None,
        streamer: BaseStreamer | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        output_audio: bool = True,
        show_progress: bool = False,
        return_dict_in_generate: bool = True,
        **kwargs,
    ) -> Drama3GenerateOutput | torch.LongTensor:
        """Generate speech frames (and their audio) for a batch of prompts.

        Settings come from `model.generation_config` (Drama 3 defaults) updated by `generation_config` and by
        keywords (`temperature`, `top_p`, `top_k`, `ras_*`, `codebook_*`, `max_new_tokens`, `do_sample`, ...); an
        unknown keyword is an error. `do_sample=False` is greedy everywhere (no RAS). `seed` (or a
        `torch.Generator`) makes a run reproducible bit for bit on the same machine. `fast_decode=True` runs the frames
        over preallocated state, one CUDA graph replay per frame on CUDA (`fast_decode.py`; same frames, see
        docs/usage.md). Returns a `Drama3GenerateOutput` (or only `sequences` with `return_dict_in_generate=False`).
        """
        settings = self._generation_settings(generation_config, dict(kwargs))
        self.check_frames(input_ids)
        input_ids = input_ids.to(self.input_device)
        attention_mask = attention_mask.to(self.input_device) if attention_mask is not None else None
        batch, rows, _ = input_ids.shape
        if batch == 0 or rows == 0:
            raise ValueError(f"input_ids must hold at least one prompt row per sequence, got shape {tuple(input_ids.shape)}")
        if streamer is not None and batch != 1:
            raise ValueError(f"streaming takes one sequence at a time, got a batch of {batch}")
        device = input_ids.device
        seed = shared_seed(self, seed, generator)  # split over ranks: every rank draws the same noise
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        attention_mask = self._full_attention_mask(attention_mask, batch, 0, rows, device)
        limit = self.config.text_config.max_position_embeddings
        if rows > limit:
            raise ValueError(f"the prompt has {rows} rows but the backbone's context is {limit} rows")

        if settings.fast_decode:
            check_fast_decode_allowed(self)
            check_fast_decode(self)

        loop = _FrameLoop(self, settings, input_ids, attention_mask, generator, streamer)
        with tqdm(total=settings.max_new_tokens, unit="frame", disable=not show_progress, leave=False) as bar:
            if settings.fast_decode:
                run_fast(loop, on_step=bar.update)
            else:
                loop.run(on_step=bar.update)
        if streamer is not None:
            streamer.end()

        codes = [loop.frames[i, : loop.lengths[i], 1:].T.contiguous() for i in range(batch)]  # [NCB, n_i]
        sequences = torch.cat((input_ids, loop.frames[:, : max(loop.lengths, default=0)]), dim=1)
        if not return_dict_in_generate:
            return sequences
        audio = [self.codec.decode(c[None].to(execution_device(self.codec)))[0] for c in codes] if output_audio else None
        return Drama3GenerateOutput(
            sequences=sequences, codes=codes, audio=audio, finish_reason=loop.finish_reason,
            sampling_rate=self.config.sampling_rate,
        )


class _FrameLoop:
    """The state of one `generate` call: caches, the running batch, outputs and stop flags (SPEC 5.3)."""

    def __init__(self, model, settings: GenerationConfig, input_ids, attention_mask, generator, streamer):
        self.model, self.settings, self.generator, self.streamer = model, settings, generator, streamer
        config = model.config
        batch, rows, width = input_ids.shape
        device = input_ids.device
        self.limit = config.text_config.max_position_embeddings
        self.candidates = model.main_candidate_ids(device)  # [V + 1]
        self.frames = input_ids.new_zeros(batch, settings.max_new_tokens, width)  # generated rows, per sequence
        self.lengths = [0] * batch
        self.finish_reason: list[str | None] = [None] * batch
        self.active = torch.arange(batch, device=device)  # original index of each running sequence
        self.count = torch.zeros(batch, dtype=torch.long, device=device)  # frames of each running sequence
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)  # EOS drawn
        self.mask = attention_mask if not bool(attention_mask.all()) else None  # None: no padding anywhere
        self.slots = rows  # rows in the backbone cache

        self.sampler = FrameSampler(settings)
        # RAS window: the last prompt rows' main ids as candidate columns (-1 for text rows).
        main = input_ids[..., 0]
        columns = torch.where(model.is_audio_row(main), main - config.semantic_start_token_id + 1, -1)
        self.history = columns[:, -settings.ras_window :] if settings.ras_window else columns[:, :0]
        self._prefill(input_ids, attention_mask)

    def _prefill(self, input_ids, attention_mask) -> None:
        model = self.model
        positions = model.row_positions(attention_mask)  # [B, T]
        self.cache, self.tower_cache = model.new_caches()
        hidden = model.run_backbone(input_ids, positions, self.mask, self.cache)  # [B, T, D]
        if input_ids.shape[1] > 1:  # tower teacher forcing over rows 0..T-2, labelled by rows 1..T-1
            tower_mask = None if self.mask is None else self.mask[:, :-1]
            model.tower(hidden[:, :-1], input_ids[:, :-1], input_ids[:, 1:], positions[:, :-1], tower_mask, self.tower_cache)
        self.hidden, self.row, self.position = hidden[:, -1], input_ids[:, -1], positions[:, -1]

    def _step(self) -> torch.Tensor:
        """One frame for every running sequence; returns the new rows `[b, 1 + NCB]`."""
        model = self.model
        logits = model.main_logits(self.hidden, self.candidates).float()  # [b, V + 1]
        noise = self.sampler.frame_noise(
            logits.shape[0], model.config.num_codebooks, logits.shape[1], self.generator, logits.device
        )  # [b, NCB, V + 1] or None
        column = self.sampler.main(logits, self.history, noise)
        main = self.candidates[column]  # [b]
        codes, _ = model.tower.decode_frame(
            self.hidden, self.row, main, self.position, self.mask, self.tower_cache,
            lambda head_logits, index: self.sampler.codebook(head_logits, index, noise),
        )
        if self.settings.ras_window:
            self.history = torch.cat((self.history, column[:, None]), dim=1)[:, -self.settings.ras_window :]
        eos = column == 0
        keep = ~eos & ~self.ended
        new_rows = torch.cat((main[:, None], codes), dim=1)  # [b, 1 + NCB]
        index = self.count.clamp(max=self.frames.shape[1] - 1)
        self.frames[self.active, index] = torch.where(keep[:, None], new_rows, self.frames[self.active, index])
        self.count += keep.long()
        self.ended |= eos
        if self.streamer is not None and bool(keep[0]):  # batch 1: the streamer needs the frame now
            self.streamer.put(codes)
        return new_rows

    def _feed_back(self, new_rows: torch.Tensor) -> None:
        """Embed the new rows and run one backbone step."""
        if self.mask is not None:
            self.mask = torch.cat((self.mask, self.mask.new_ones(self.mask.shape[0], 1)), dim=1)
        self.position = self.position + 1
        self.hidden = self.model.run_backbone(new_rows[:, None], self.position[:, None], self.mask, self.cache)[:, 0]
        self.row = new_rows
        self.slots += 1

    def _retire(self, keep: torch.Tensor, reason_for_dropped: str | None) -> None:
        """Record the outputs of sequences leaving the batch and drop them from every running tensor."""
        for position, original in enumerate(self.active.tolist()):
            if not bool(keep[position]):
                self.lengths[original] = int(self.count[position])
                self.finish_reason[original] = FINISH_EOS if bool(self.ended[position]) else reason_for_dropped
        if bool(keep.all()) or not bool(keep.any()):
            return
        index = keep.nonzero()[:, 0]
        # `reorder_cache` with a subset of indices selects those sequences (every cache layer kind supports it).
        self.cache.reorder_cache(index)
        self.tower_cache.reorder_cache(index)
        for name in ("active", "count", "ended", "hidden", "row", "position", "history", "new_rows"):
            setattr(self, name, getattr(self, name)[index])
        if self.mask is not None:
            self.mask = self.mask[index]

    def end_at_first_eos(self, recorded: list[int], length_limited: bool) -> None:
        """For frames recorded without stopping (the fast path: `recorded[i]` rows of sequence `i`, ended ones
        included): cut each sequence at its first EOS row (zeroing the rest) and set `lengths` and `finish_reason`."""
        for index, rows in enumerate(recorded):
            eos = (self.frames[index, :rows, 0] == self.model.config.eos_token_id).nonzero()
            if eos.numel():
                self.lengths[index], self.finish_reason[index] = int(eos[0, 0]), FINISH_EOS
            else:
                self.lengths[index] = rows
                self.finish_reason[index] = FINISH_LENGTH if length_limited else FINISH_CONTEXT
            self.frames[index, self.lengths[index] :] = 0

    def run(self, on_step) -> None:
        check_every = self.settings.stop_check_interval
        for step in range(1, self.settings.max_new_tokens + 1):
            self.new_rows = self._step()
            on_step(1)
            if step == self.settings.max_new_tokens:
                self._retire(torch.zeros_like(self.ended), FINISH_LENGTH)
                return
            if self.slots >= self.limit:  # the new rows would not fit in the backbone's context
                self._retire(torch.zeros_like(self.ended), FINISH_CONTEXT)
                return
            if step % check_every == 0:
                all_ended = bool(self.ended.all())
                self._retire(~self.ended, None)
                if all_ended:
                    return
            self._feed_back(self.new_rows)
