"""Speech generation for Drama 3: settings, the frame loop around the one frame step, stopping, batching, outputs.

`FishOmniForSpeech.generate(input_ids, ...)` runs the teacher-forced `forward` over the prompt rows once (the
prefill: backbone and tower caches), loads the sequences into a `FrameState` and runs `FrameState.step`
(frame_step.py) once per frame: main token with repetition-aware sampling -> tower codes -> the new row fed back to
the backbone (docs/format.md, "Prefill and decoding"). Everything per frame stays on the device; the host looks at
the stop flags every `stop_check_interval` frames, and finished sequences then leave the batch. With
`fast_decode=True` on a CUDA device each step is a CUDA graph replay (cuda_graphs.py); everywhere else the same step
runs eagerly.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

from . import compat
from .device_placement import execution_device
from .frame_rows import left_pad_rows, padded_on_the_right
from .frame_runner import FrameLoop, check_cuda_graphs, request_generators
from .parallel import check_fast_decode_allowed, shared_seed
from .prompt_cache import PromptCache, prefill

# Drama 3 settings kept on `model.generation_config` (defaults of the official server; docs/format.md, "Sampling").
DRAMA3_GENERATION_DEFAULTS = {
    "do_sample": True,
    "max_new_tokens": 2048,  # frames: 2048 frames = 95 s of audio
    "temperature": 1.0,  # main token
    "top_p": 0.9,
    "top_k": 0,  # 0 (or None): no top-k for the main token; a cap of 30 makes reference-free takes fall silent
    "ras_window": 16,
    "ras_temperature": 1.0,
    "ras_top_k": 30,
    "ras_top_p": 0.95,
    "codebook_temperature": 1.0,
    "codebook_top_k": 30,  # capped at 30
    "codebook_top_p": 0.9,
    "stop_check_interval": 8,  # frames between two host checks of the stop flags
    "fast_decode": False,  # on CUDA: capture the frame step once as a CUDA graph and replay it (cuda_graphs.py)
    "compile_step": False,  # torch.compile the frame step first (True: inductor; or a torch.compile backend's name)
    "return_dict_in_generate": True,
    "output_scores": False,  # the main-token candidate logits of every frame, in `Drama3GenerateOutput.scores`
}
# transformers' generation settings that mean nothing for frames, but that pipelines and configs carry.
_IGNORED_SETTINGS = ("pad_token_id", "bos_token_id", "eos_token_id", "use_cache", "transformers_version", "_from_model_config")


@dataclass
class Drama3GenerateOutput(ModelOutput):
    """What `generate` returns.

    sequences: `[B, T + N, 1 + NCB]` prompt rows followed by the generated frame rows (rows after a sequence's
        end are zeros). codes: per sequence `[NCB, n_i]` (c0..c9 of each generated frame). audio: per sequence
        float32 `[n_i * frame_length]` (None with `output_audio=False`). finish_reason: per sequence `"eos"`,
        `"length"` (max_new_tokens), `"context"` (the backbone's max_position_embeddings) or `"stop"` (a stopping
        criterion). scores (`output_scores=True`): per frame, the main-token candidate logits `[B, V + 1]` (after any
        `logits_processor`; column 0 is EOS, column `1 + c` is `<|semantic:c|>`; rows of sequences that had already
        ended are zeros).
    """

    sequences: torch.LongTensor | None = None
    codes: list[torch.LongTensor] | None = None
    audio: list[torch.Tensor] | None = None
    finish_reason: list[str] | None = None
    scores: tuple[torch.Tensor, ...] | None = None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_settings(values: dict) -> None:
    """Raise a `ValueError` naming the first Drama 3 generation setting in `values` that is out of range (types
    included: a string, a NaN or an infinity is never a valid number)."""
    if not _is_int(values["max_new_tokens"]) or values["max_new_tokens"] < 1:
        raise ValueError(f"max_new_tokens (frames) must be an integer >= 1, got {values['max_new_tokens']!r}")
    if not _is_int(values["stop_check_interval"]) or values["stop_check_interval"] < 1:
        raise ValueError(f"stop_check_interval must be an integer >= 1, got {values['stop_check_interval']!r}")
    if not isinstance(values["compile_step"], (bool, str)):
        raise ValueError(f"compile_step must be True, False or a torch.compile backend name, got {values['compile_step']!r}")
    for name in ("fast_decode", "do_sample", "return_dict_in_generate", "output_scores"):
        if not isinstance(values[name], bool):
            raise ValueError(f"{name} must be True or False, got {values[name]!r}")
    if not _is_int(values["ras_window"]) or values["ras_window"] < 0:
        raise ValueError(f"ras_window must be an integer >= 0, got {values['ras_window']!r}")
    if not values["do_sample"]:
        return
    for name in ("temperature", "ras_temperature", "codebook_temperature"):
        if not _is_number(values[name]) or values[name] <= 0:
            raise ValueError(f"{name} must be a finite number > 0 when sampling (use do_sample=False for greedy), "
                             f"got {values[name]!r}")
    for name in ("top_p", "ras_top_p", "codebook_top_p"):
        if not _is_number(values[name]) or not 0 < values[name] <= 1:
            raise ValueError(f"{name} must be a number in (0, 1], got {values[name]!r}")
    for name in ("top_k", "ras_top_k", "codebook_top_k"):
        if values[name] is not None and (not _is_int(values[name]) or values[name] < 0):
            raise ValueError(f"{name} must be an integer >= 1 (0 or None for no limit), got {values[name]!r}")


def generation_settings(
    base: GenerationConfig, generation_config: GenerationConfig | None = None, **kwargs
) -> GenerationConfig:
    """`base` (a model's generation config) updated with `generation_config` and per-call keywords, checked.

    The one place where Drama 3's generation settings are validated: `generate` calls it, and so can a front end
    (the CLI, a server) before loading a model, with `GenerationConfig(**DRAMA3_GENERATION_DEFAULTS)` as `base`.
    Raises `TypeError` for an unknown keyword and `ValueError` for a value out of range or a transformers setting
    that does not apply to Drama 3 (beams, penalties, ...), naming the setting.
    """
    settings = copy.deepcopy(base)
    for key, value in DRAMA3_GENERATION_DEFAULTS.items():  # a generation_config.json may lack our keys (or unset them)
        if getattr(settings, key, None) is None:
            setattr(settings, key, value)
    if generation_config is not None:
        # transformers' own defaults filled in (pipelines of some versions do it) set nothing.
        neutral = compat.generation_defaults()
        given = {key: value for key, value in generation_config.to_diff_dict().items()
                 if key in DRAMA3_GENERATION_DEFAULTS or (value is not None and value != neutral.get(key))}
        unsupported = sorted(set(given) - set(DRAMA3_GENERATION_DEFAULTS) - set(_IGNORED_SETTINGS))
        if unsupported:
            raise ValueError(
                f"generation_config sets {unsupported}, which Drama 3 generation does not use; it accepts "
                f"{sorted(DRAMA3_GENERATION_DEFAULTS)} (see docs/usage.md, 'Sampling settings')"
            )
        check_settings({**settings.to_dict(), **given})
        settings.update(**given)
    for key in _IGNORED_SETTINGS:
        kwargs.pop(key, None)
    unknown = sorted(set(kwargs) - set(DRAMA3_GENERATION_DEFAULTS))
    if unknown:
        raise TypeError(
            f"generate() got unknown or unsupported arguments {unknown}; Drama 3 generation accepts "
            f"{sorted(DRAMA3_GENERATION_DEFAULTS)} (plus input_ids, attention_mask, generation_config, "
            "logits_processor, stopping_criteria, streamer, seed, generator, output_audio, show_progress, prompt_cache)"
        )
    check_settings({**settings.to_dict(), **kwargs})
    settings.update(**kwargs)
    return settings


class Drama3GenerationMixin(GenerationMixin):
    """`generate` for `FishOmniForSpeech`: transformers' `GenerationMixin`, with Drama 3's frame loop as the decoding
    method it runs."""

    def _init_generation_config(self) -> None:
        """Put the Drama 3 defaults on `generation_config` where it sets nothing (a loaded `generation_config.json`
        wins)."""
        for key, value in DRAMA3_GENERATION_DEFAULTS.items():
            if getattr(self.generation_config, key, None) is None:
                setattr(self.generation_config, key, value)
        self.generation_config.eos_token_id = self.config.eos_token_id

    def adjust_generation_fn(self, *args, **kwargs):
        """transformers' loading of the checkpoint's generation config (`from_pretrained`), then the Drama 3
        defaults for what it leaves unset."""
        super().adjust_generation_fn(*args, **kwargs)
        self._init_generation_config()

    def reset_frame_states(self) -> None:
        """Free the frame states and captured CUDA graphs that `generate(..., fast_decode=True)` keeps on a CUDA
        device for later calls (they are rebuilt on the next such call)."""
        self._kept_frame_states = None

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,  # [B, T, 1 + NCB] prompt frame rows from Drama3Processor
        attention_mask: torch.Tensor | None = None,  # [B, T], 0 = left padding
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        streamer: BaseStreamer | None = None,
        seed: int | list[int] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_audio: bool = True,
        show_progress: bool = False,
        prompt_cache: PromptCache | None = None,
        **kwargs,
    ) -> Drama3GenerateOutput | torch.LongTensor:
        """Generate speech frames (and their audio) for a batch of left-padded prompts.

        Settings come from `model.generation_config` (Drama 3 defaults) updated by `generation_config` and by
        keywords (`temperature`, `top_p`, `top_k`, `ras_*`, `codebook_*`, `max_new_tokens`, `do_sample`,
        `output_scores`, `return_dict_in_generate`, ...); an unknown keyword is an error. `do_sample=False` is greedy
        everywhere (no RAS). `seed` (or a `torch.Generator`) makes a run reproducible; a list of seeds (or
        generators), one per sequence, gives each sequence the frames it gets alone with that seed.

        `logits_processor` (a `LogitsProcessorList`) is applied to the main-token candidate logits `[B, V + 1]` of each
        frame before Drama 3's sampling rule, called with the rows generated so far (`[B, T + n, 1 + NCB]`);
        `stopping_criteria` (a `StoppingCriteriaList`) is called after each frame with the rows including it and
        that frame's candidate logits, and a sequence it marks ends with finish reason `"stop"`. `streamer` gets
        `put(codes [B, NCB])` per frame (-1 rows for sequences without a frame) and `end()`. `fast_decode=True`
        replays the frame step as a CUDA graph on a CUDA device (docs/usage.md). `prompt_cache` (a `PromptCache` of
        the prompt's first rows, prompt_cache.py) starts the prefill from a copy of its caches instead of recomputing
        those rows. Returns a `Drama3GenerateOutput`
        (or only `sequences` with `return_dict_in_generate=False`).
        """
        settings = generation_settings(self.generation_config, generation_config, **kwargs)
        if logits_processor is not None and not isinstance(logits_processor, LogitsProcessorList):
            logits_processor = LogitsProcessorList(logits_processor)
        if stopping_criteria is not None and not isinstance(stopping_criteria, StoppingCriteriaList):
            stopping_criteria = StoppingCriteriaList(stopping_criteria)
        if isinstance(attention_mask, torch.Tensor) and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 3:
            # Padding on the right (transformers' pipeline collator pads that way, with its pad id in every column)
            # moves to the left, as all-zero rows; padding inside a sequence is refused below.
            if attention_mask.shape == input_ids.shape[:2] and padded_on_the_right(attention_mask):
                input_ids, attention_mask = left_pad_rows(input_ids, attention_mask)
        attention_mask, _ = self.checked_inputs(input_ids, attention_mask)  # before any work; one host read
        batch = input_ids.shape[0]
        input_ids = input_ids.to(self.input_device, torch.long)
        seed = shared_seed(self, seed, generator)  # split over ranks: every rank draws the same noise
        generators = request_generators(seed, generator, batch, execution_device(self.lm_head))
        if settings.fast_decode:
            check_fast_decode_allowed(self)
            check_cuda_graphs(self)

        prefilled = prefill(self, input_ids, attention_mask, prompt_cache)
        loop = FrameLoop(self, settings, prefilled, input_ids, attention_mask, generators, streamer, logits_processor,
                         stopping_criteria)
        try:
            with tqdm(total=loop.frames, unit="frame", disable=not show_progress, leave=False) as bar:
                loop.run(on_step=bar.update)
        finally:
            if streamer is not None:
                streamer.end()

        rows = loop.rows
        sequences = loop.sequences[:, : rows + max(loop.lengths, default=0)]
        codes = [sequences[i, rows : rows + n, 1:].T.contiguous() for i, n in enumerate(loop.lengths)]  # [NCB, n_i]
        if not settings.return_dict_in_generate:
            return sequences
        audio = [self.codec.decode(c[None].to(execution_device(self.codec))).audio_values[0, 0] for c in codes] if output_audio else None
        return Drama3GenerateOutput(
            sequences=sequences, codes=codes, audio=audio, finish_reason=loop.finish_reason,
            scores=tuple(loop.scores) if settings.output_scores else None,
        )


__all__ = ["DRAMA3_GENERATION_DEFAULTS", "Drama3GenerateOutput", "Drama3GenerationMixin", "generation_settings"]
