"""Speech generation for Drama 3: transformers' `GenerationMixin.generate`, with Drama 3's frame loop as the decoding
method it runs.

`FishOmniForSpeech.generate(input_ids, ...)` is `GenerationMixin.generate` plus the codec. transformers merges the
settings (`model.generation_config`, a `generation_config`, keywords) and calls the hooks overridden here:
`_prepare_generation_config` (greedy and sample only; Drama 3's settings checked), `_get_logits_processor` (the
user's processors, checked by type, then Drama 3's main-token rule), `_get_stopping_criteria` (the user's criteria,
checked by type, then the frame limit) and `_sample`: the teacher-forced prefill over the prompt rows
(prompt_cache.py), then the frame loop (frame_runner.py) around the one frame step: main token with
repetition-aware sampling -> tower codes -> the new row fed back to the backbone (docs/format.md, "Prefill and
decoding"). `generate` then decodes each sequence's codes into audio.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessorList,
    MaxLengthCriteria,
    MaxTimeCriteria,
    PretrainedConfig,
    StoppingCriteriaList,
)
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMode
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

from . import compat
from .device_placement import execution_device
from .frame_rows import left_pad_rows, padded_on_the_right
from .frame_runner import FINISH_CONTEXT, FINISH_LENGTH, FrameLoop, check_cuda_graphs, request_generators
from .input_checks import attention_mask_layout, check_frame_layout
from .prompt_cache import PromptCache, prefill
from .sampling import RepetitionAwareLogitsProcessor, main_token_rule
from .settings_checks import check_flag, check_generation_settings, check_hooks

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
# Drama 3's own `generate` keywords, which reach `_sample` with the model keywords.
CALL_ARGUMENTS = ("seed", "generator", "show_progress", "prompt_cache")
# Processors of transformers that read only the scores, so they apply to the main-token candidate logits as they
# apply to text logits; the others index the scores by text token ids (penalties, bad words, forced tokens, ...).
FRAME_LOGITS_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
    EpsilonLogitsWarper, EtaLogitsWarper, InfNanRemoveLogitsProcessor,
)
# transformers' criteria that count rows or time (the others look for text tokens or strings).
FRAME_STOPPING_CRITERIA = (MaxLengthCriteria, MaxTimeCriteria)


@dataclass
class Drama3GenerateOutput(GenerateDecoderOnlyOutput):
    """What `generate` returns: transformers' `GenerateDecoderOnlyOutput`, with the frames' codes and audio.

    sequences: `[B, T + N, 1 + NCB]` prompt rows followed by the generated frame rows (rows after a sequence's
        end are zeros). codes: per sequence `[NCB, n_i]` (c0..c9 of each generated frame). audio: per sequence
        float32 `[n_i * frame_length]` (None with `output_audio=False`). finish_reason: per sequence `"eos"`,
        `"length"` (max_new_tokens), `"context"` (the backbone's max_position_embeddings) or `"stop"` (a stopping
        criterion). scores (`output_scores=True`): per frame, the main-token candidate logits `[B, V + 1]` (after any
        `logits_processor`; column 0 is EOS, column `1 + c` is `<|semantic:c|>`; rows of sequences that had already
        ended are zeros).
    """

    codes: list[torch.LongTensor] | None = None
    audio: list[torch.Tensor] | None = None
    finish_reason: list[str] | None = None


class Drama3FrameLimit(MaxLengthCriteria):
    """Drama 3's length limit, in rows `[B, T + n, 1 + NCB]`: `max_new_tokens` frames after a prompt of
    `prompt_length` rows, and never past the backbone's `context` (`max_position_embeddings` rows; the last frame is
    not fed back, so `T + n` may reach the context + 1). `frames` is the limit in frames and `reason` the finish
    reason of a sequence that reaches it (`"length"` or `"context"`): the one place both are decided, for `generate`
    and the engine. The frame loop runs it on the device; only the user's criteria run on the host."""

    def __init__(self, max_new_tokens: int, prompt_length: int, context: int):
        room = context - prompt_length + 1  # frames before the context is full
        if room < 1:
            raise ValueError(f"the prompt has {prompt_length} rows, more than the context of {context} allows")
        self.frames = min(max_new_tokens, room)
        self.reason = FINISH_LENGTH if self.frames == max_new_tokens else FINISH_CONTEXT
        super().__init__(prompt_length + self.frames)


def unsupported_arguments(names) -> TypeError:
    """The error for `generate` keywords that Drama 3 generation does not take (unknown, or transformers settings
    that mean nothing for frames)."""
    return TypeError(
        f"generate() got unknown or unsupported arguments {sorted(names)}; Drama 3 generation accepts "
        f"{sorted(DRAMA3_GENERATION_DEFAULTS)} (plus input_ids, attention_mask, generation_config, logits_processor, "
        "stopping_criteria, streamer, seed, generator, output_audio, show_progress, prompt_cache)"
    )


def _refuse_what_does_not_apply(generation_config: GenerationConfig | None, kwargs: dict) -> dict:
    """The Drama 3 settings a call chooses (from `generation_config`, then keywords), after refusing the transformers
    settings it chooses that do not apply to frames (beams, penalties, ...). Values equal to transformers' global
    defaults in `generation_config` are no choice (pipelines of some versions fill them in)."""
    chosen = {}
    if generation_config is not None:
        neutral = compat.generation_defaults()
        given = {key: value for key, value in generation_config.to_diff_dict().items()
                 if key in DRAMA3_GENERATION_DEFAULTS or (value is not None and value != neutral.get(key))}
        unsupported = sorted(set(given) - set(DRAMA3_GENERATION_DEFAULTS) - set(_IGNORED_SETTINGS))
        if unsupported:
            raise ValueError(
                f"generation_config sets {unsupported}, which Drama 3 generation does not use; it accepts "
                f"{sorted(DRAMA3_GENERATION_DEFAULTS)} (see docs/usage.md, 'Sampling settings')"
            )
        chosen.update((key, value) for key, value in given.items() if key in DRAMA3_GENERATION_DEFAULTS)
    known = GenerationConfig()
    unsupported = [key for key in kwargs if hasattr(known, key) and key not in DRAMA3_GENERATION_DEFAULTS
                   and key not in _IGNORED_SETTINGS]
    if unsupported:
        raise unsupported_arguments(unsupported)
    chosen.update((key, value) for key, value in kwargs.items() if key in DRAMA3_GENERATION_DEFAULTS)
    return chosen


def _refuse_types(items, allowed: tuple, what: str, hint: str) -> None:
    """Refuse transformers' own processors or criteria in `items` that are not of the `allowed` types (a user's own
    class is taken: its contract is the frame logits and rows that `generate` documents)."""
    refused = [type(item).__name__ for item in items
               if (type(item).__module__.startswith("transformers.") and not isinstance(item, allowed))
               or isinstance(item, (RepetitionAwareLogitsProcessor, Drama3FrameLimit))]
    if refused:
        raise ValueError(f"{what} holds {refused}, which cannot apply to Drama 3 frames: {hint}; transformers' "
                         f"{[kind.__name__ for kind in allowed]} apply, and so does your own class")


class Drama3GenerationMixin(GenerationMixin):
    """`generate` for `FishOmniForSpeech`: transformers' `GenerationMixin`, with Drama 3's frame loop as the decoding
    method it runs (greedy and sample)."""

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

    def _prepare_generation_config(self, generation_config: GenerationConfig | None, **kwargs):
        """transformers' merge (`model.generation_config` < `generation_config` < keywords), after refusing the
        settings that do not apply and checking Drama 3's own (before transformers' checks, which name fewer)."""
        chosen = _refuse_what_does_not_apply(generation_config, kwargs)
        base = {key: getattr(self.generation_config, key, None) for key in DRAMA3_GENERATION_DEFAULTS}
        base = {key: DRAMA3_GENERATION_DEFAULTS[key] if value is None else value for key, value in base.items()}
        check_generation_settings({**base, **chosen})
        if generation_config is None:
            compat.drop_generation_values_copied_into_config(self.config, self.generation_config)
        settings, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        for key, value in base.items():  # a generation config set by hand may lack Drama 3's keys
            if getattr(settings, key, None) is None and key not in chosen:
                setattr(settings, key, value)
        mode = settings.get_generation_mode()
        if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            raise ValueError(f"Drama 3 generates frames greedily (do_sample=False) or by sampling, not by "
                             f"{mode.value}; check the model's generation_config")
        return settings, model_kwargs

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """Refuse keywords that are neither settings nor Drama 3's own (`seed`, `prompt_cache`, ...)."""
        unknown = [key for key, value in model_kwargs.items()
                   if value is not None and key not in ("attention_mask", *CALL_ARGUMENTS)]
        if unknown:
            raise unsupported_arguments(unknown)

    def _prepare_cache_for_generation(self, *args, **kwargs) -> None:
        """No cache here: the prefill makes the backbone's and the tower's (or copies a prompt cache's)."""

    def _get_logits_processor(self, generation_config: GenerationConfig, logits_processor=None, **kwargs):
        """The user's processors, which run on each frame's main-token candidate logits `[B, V + 1]`, then Drama 3's
        main-token rule when sampling (temperature, top-p, top-k, then the repetition-aware redraw: the official
        order, `sampling.py`), which the frame step runs on the device."""
        processors = LogitsProcessorList(logits_processor or [])
        _refuse_types(processors, FRAME_LOGITS_PROCESSORS, "logits_processor",
                      "Drama 3 applies a logits_processor to the main-token candidate logits [batch, V + 1] of each "
                      "frame (column 0 EOS, column 1 + c <|semantic:c|>), not to text token ids")
        if generation_config.do_sample:
            processors.append(main_token_rule(generation_config))
        return processors

    def _get_stopping_criteria(self, generation_config: GenerationConfig, stopping_criteria=None, **kwargs):
        """The user's criteria (called after each frame with the rows so far and that frame's candidate logits),
        then the frame limit: `max_new_tokens` frames, within the backbone's context."""
        criteria = StoppingCriteriaList(stopping_criteria or [])
        _refuse_types(criteria, FRAME_STOPPING_CRITERIA, "stopping_criteria",
                      "a Drama 3 sequence ends at its EOS frame (finish reason 'eos'), never on a text token or "
                      "string")
        prompt_length = generation_config.max_length - generation_config.max_new_tokens  # transformers' sum
        criteria.append(Drama3FrameLimit(generation_config.max_new_tokens, prompt_length,
                                         self.config.text_config.max_position_embeddings))
        return criteria

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer: BaseStreamer | None = None, **model_kwargs):
        """Greedy or sampled frames (`generation_config.do_sample`): the prefill, then the frame loop. Returns a
        `Drama3GenerateOutput` without audio (or only `sequences` with `return_dict_in_generate=False`).
        `synced_gpus` is not needed: the ranks of a split model run the same frames."""
        settings = generation_config
        # transformers drops an all-ones mask (None); `checked_inputs` makes the full mask again (one host read).
        attention_mask, _ = self.checked_inputs(input_ids, model_kwargs.get("attention_mask"))
        batch = input_ids.shape[0]
        input_ids = input_ids.to(self.input_device, torch.long)
        seed, generator = model_kwargs.get("seed"), model_kwargs.get("generator")
        rules = getattr(self, "split_rules", None)  # set on a model split over ranks (parallel.SplitModelRules)
        if rules is not None:
            seed = rules.shared_seed(self, seed, generator)  # every rank draws the same noise
        generators = request_generators(seed, generator, batch, execution_device(self.lm_head))
        if settings.fast_decode:
            if rules is not None:
                rules.check_fast_decode()
            check_cuda_graphs(self)
        limit = next(c for c in stopping_criteria if isinstance(c, Drama3FrameLimit))
        # The main-token rule runs inside the frame step (FrameLoop's sampler, from the same settings).
        user_processors = [p for p in logits_processor if not isinstance(p, RepetitionAwareLogitsProcessor)]
        user_criteria = [c for c in stopping_criteria if c is not limit]

        prefilled = prefill(self, input_ids, attention_mask, model_kwargs.get("prompt_cache"))
        loop = FrameLoop(self, settings, limit, prefilled, input_ids, attention_mask, generators, streamer,
                         LogitsProcessorList(user_processors) if user_processors else None,
                         StoppingCriteriaList(user_criteria) if user_criteria else None)
        try:
            with tqdm(total=limit.frames, unit="frame", leave=False,
                      disable=not model_kwargs.get("show_progress")) as bar:
                loop.run(on_step=bar.update)
        finally:
            if streamer is not None:
                streamer.end()

        rows = loop.rows
        sequences = loop.sequences[:, : rows + max(loop.lengths, default=0)]
        if not settings.return_dict_in_generate:
            return sequences
        codes = [sequences[i, rows : rows + n, 1:].T.contiguous() for i, n in enumerate(loop.lengths)]  # [NCB, n_i]
        return Drama3GenerateOutput(sequences=sequences, codes=codes, finish_reason=loop.finish_reason,
                                    scores=tuple(loop.scores) if settings.output_scores else None)

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
        """Generate speech frames (and their audio) for a batch of left-padded prompts: `GenerationMixin.generate`,
        then the codec.

        Settings come from `model.generation_config` (Drama 3 defaults) updated by `generation_config` and by
        keywords (`temperature`, `top_p`, `top_k`, `ras_*`, `codebook_*`, `max_new_tokens`, `do_sample`,
        `output_scores`, `return_dict_in_generate`, ...); an unknown keyword is an error. `do_sample=False` is greedy
        everywhere (no RAS). `seed` (or a `torch.Generator`) makes a run reproducible; a list of seeds (or
        generators), one per sequence, gives each sequence the frames it gets alone with that seed.

        `logits_processor` (a `LogitsProcessorList`) is applied to the main-token candidate logits `[B, V + 1]` of each
        frame before Drama 3's sampling rule, called with the rows generated so far (`[B, T + n, 1 + NCB]`);
        `stopping_criteria` (a `StoppingCriteriaList`) is called after each frame with the rows including it and
        that frame's candidate logits, and a sequence it marks ends with finish reason `"stop"`. transformers'
        processors and criteria that work on text token ids are refused. `streamer` gets the prompt rows
        `put(input_ids [B, T, 1 + NCB])` first (as transformers' generate does), then `put(codes [B, NCB])` per frame
        (-1 rows for sequences without a frame) and `end()`. `fast_decode=True` replays the frame step as a CUDA
        graph on a CUDA device (docs/usage.md). `prompt_cache` (a `PromptCache` of the prompt's first rows,
        prompt_cache.py) starts the prefill from a copy of its caches instead of recomputing those rows. Returns a
        `Drama3GenerateOutput` (or only `sequences` with `return_dict_in_generate=False`).
        """
        # Types and shapes before transformers reads them (no data read; the values are checked by `_sample`).
        check_frame_layout(input_ids, "input_ids", self.config.num_codebooks)
        full_mask = attention_mask_layout(attention_mask, input_ids.shape[0], 0, input_ids.shape[1],
                                          input_ids.device)  # all ones when none is given
        attention_mask = full_mask if attention_mask is None else attention_mask
        check_flag("output_audio", output_audio)
        check_flag("show_progress", show_progress)
        check_hooks(generation_config, logits_processor, stopping_criteria, streamer)
        refused = [key for key, value in kwargs.items()
                   if key in _TRANSFORMERS_ONLY_ARGUMENTS and value is not None and value is not False]
        if refused:
            raise unsupported_arguments(refused)
        # Padding on the right (transformers' pipeline collator pads that way, with its pad id in every column) moves
        # to the left, as all-zero rows; padding inside a sequence is refused by `checked_inputs`.
        if padded_on_the_right(attention_mask):
            input_ids, attention_mask = left_pad_rows(input_ids, attention_mask)
        output = super().generate(
            input_ids, generation_config=generation_config, logits_processor=logits_processor,
            stopping_criteria=stopping_criteria, streamer=streamer, attention_mask=attention_mask, seed=seed,
            generator=generator, show_progress=show_progress, prompt_cache=prompt_cache, **kwargs,
        )
        if isinstance(output, Drama3GenerateOutput) and output_audio:
            device = execution_device(self.codec)
            output["audio"] = [self.codec.decode(c[None].to(device)).audio_values[0, 0] for c in output.codes]
        return output


# `GenerationMixin.generate` parameters that Drama 3 does not take (assisted decoding, token constraints, ...).
_TRANSFORMERS_ONLY_ARGUMENTS = set(inspect.signature(GenerationMixin.generate).parameters) - set(
    inspect.signature(Drama3GenerationMixin.generate).parameters) - {"self", "kwargs"}


class _SettingsOf(Drama3GenerationMixin):
    """Stands for a model with generation config `base`, so that `generation_settings` runs `generate`'s own merge
    and checks without a model."""

    def __init__(self, base: GenerationConfig):
        self.generation_config = base
        self.config = PretrainedConfig()


def generation_settings(
    base: GenerationConfig, generation_config: GenerationConfig | None = None, **kwargs
) -> GenerationConfig:
    """The settings `generate(generation_config=..., **kwargs)` runs with on a model whose generation config is
    `base`, checked as `generate` checks them: the one early check for front ends (the CLI, a manifest, a server)
    before any model loads, with `GenerationConfig(**DRAMA3_GENERATION_DEFAULTS)` as `base`.

    Raises `TypeError` for an unknown keyword and `ValueError` for a value out of range or a transformers setting
    that does not apply to Drama 3 (beams, penalties, ...), naming the setting.
    """
    holder = _SettingsOf(base)
    settings, model_kwargs = holder._prepare_generation_config(generation_config, **kwargs)
    holder._validate_model_kwargs(model_kwargs)
    return settings


__all__ = ["DRAMA3_GENERATION_DEFAULTS", "Drama3FrameLimit", "Drama3GenerateOutput", "Drama3GenerationMixin",
           "generation_settings"]
