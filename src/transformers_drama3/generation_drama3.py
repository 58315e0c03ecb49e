"""Speech generation for Drama 3: transformers' `GenerationMixin.generate`, with Drama 3's frames as the decoding
method it runs, then the codec. transformers calls the hooks overridden here, and each returns what runs
(docs/architecture.md, "Generation"); `_sample` runs the batch on a `Drama3Engine` in the calling thread.
"""

from __future__ import annotations

import contextlib
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
    StoppingCriteriaList,
)
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.utils import logging
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
from .generation.engine import Drama3Engine
from .generation.observer import GenerateObserver
from .generation.prompt_cache import PromptCache
from .generation.rules import FINISH_EOS, Drama3EndOfSpeech, Drama3FrameLimit, Drama3FrameSampling, frame_criteria
from .generation.runner import FrameRunner, check_cuda_graphs, kept_states
from .generation.sampling import request_generators
from .generation.settings import CALL_ARGUMENTS, DRAMA3_GENERATION_DEFAULTS, merge_settings, unsupported_arguments
from .input_checks import attention_mask_layout, check_frame_layout
from .settings_checks import check_flag, check_hooks

logger = logging.get_logger(__name__)

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


def _one_of(items, kind: type, hook: str):
    """The one object of type `kind` in what a generation hook returned."""
    found = [item for item in items if isinstance(item, kind)]
    if len(found) != 1:
        raise ValueError(f"{hook} must return exactly one {kind.__name__} (Drama 3's frames run it), got "
                         f"{len(found)}")
    return found[0]


def _refuse_types(items, allowed: tuple, what: str, hint: str) -> None:
    """Refuse transformers' own processors or criteria in `items` that are not of the `allowed` types (a user's own
    class is taken: its contract is the frame logits and rows that `generate` documents)."""
    refused = [type(item).__name__ for item in items
               if (type(item).__module__.startswith("transformers.") and not isinstance(item, allowed))
               or isinstance(item, (Drama3FrameSampling, Drama3EndOfSpeech, Drama3FrameLimit))]
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
        """The merge every door runs (`settings.merge_settings`): `model.generation_config` <
        `generation_config` < keywords, checked, greedy or sampled."""
        if generation_config is None:
            compat.drop_generation_values_copied_into_config(self.config, self.generation_config)
        return merge_settings(self.generation_config, generation_config, kwargs)

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """Refuse keywords that are neither settings nor Drama 3's own (`seed`, `prompt_cache`, ...)."""
        unknown = [key for key, value in model_kwargs.items() if value is not None and key not in CALL_ARGUMENTS]
        if unknown:
            raise unsupported_arguments(unknown)

    def _prepare_cache_for_generation(self, *args, **kwargs) -> None:
        """No cache here: the prefill makes the backbone's and the tower's (or copies a prompt cache's)."""

    def _get_logits_processor(self, generation_config: GenerationConfig, logits_processor=None, **kwargs):
        """What draws each frame: the user's processors, which run on the host on each frame's main-token candidate
        logits `[B, V + 1]`, then `Drama3FrameSampling`, the per-row rule (temperature, top-p, top-k, the
        repetition-aware redraw; the codebook draws; greedy rows take the argmax) that the frame step runs on the
        device with each sequence's settings."""
        processors = LogitsProcessorList(logits_processor or [])
        _refuse_types(processors, FRAME_LOGITS_PROCESSORS, "logits_processor",
                      "Drama 3 applies a logits_processor to the main-token candidate logits [batch, V + 1] of each "
                      "frame (column 0 EOS, column 1 + c <|semantic:c|>), not to text token ids")
        processors.append(Drama3FrameSampling())
        return processors

    def _get_stopping_criteria(self, generation_config: GenerationConfig, stopping_criteria=None, **kwargs):
        """What ends a sequence: the user's criteria (called on the host after each frame with the rows so far and
        that frame's candidate logits), then the device criteria the frame step runs: its EOS frame, and its frame
        limit (`max_new_tokens` frames, within the backbone's context)."""
        criteria = StoppingCriteriaList(stopping_criteria or [])
        _refuse_types(criteria, FRAME_STOPPING_CRITERIA, "stopping_criteria",
                      "a Drama 3 sequence ends at its EOS frame (finish reason 'eos'), never on a text token or "
                      "string")
        criteria.extend(frame_criteria(self, generation_config))
        return criteria

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer: BaseStreamer | None = None, **model_kwargs):
        """Greedy or sampled frames (`generation_config.do_sample`, per sequence in the rule's tensors): the batch's
        specs run on a `Drama3Engine` in this thread. Returns a `Drama3GenerateOutput` without audio (or only
        `sequences` with `return_dict_in_generate=False`). `synced_gpus` is not needed: the ranks of a split model run
        the same frames."""
        settings = generation_config
        batch, prompt_length, _ = input_ids.shape
        input_ids = input_ids.to(self.input_device, torch.long)  # the output's sequences live there too
        seed, generator = model_kwargs.get("seed"), model_kwargs.get("generator")
        rules = getattr(self, "split_rules", None)  # set on a model split over ranks (parallel.SplitModelRules)
        if rules is not None:
            seed = rules.shared_seed(self, seed, generator)  # every rank draws the same noise
        generators = request_generators(seed, generator, batch, execution_device(self.lm_head))
        # What the hooks returned runs: found by type (a subclass's hooks may order or replace them).
        sampling = _one_of(logits_processor, Drama3FrameSampling, "_get_logits_processor")
        frame_limit = _one_of(stopping_criteria, Drama3FrameLimit, "_get_stopping_criteria")
        user_processors = LogitsProcessorList(p for p in logits_processor if p is not sampling) or None
        device_criteria = StoppingCriteriaList(c for c in stopping_criteria
                                               if isinstance(c, (Drama3EndOfSpeech, Drama3FrameLimit)))
        user_criteria = StoppingCriteriaList(c for c in stopping_criteria if c not in device_criteria) or None
        graphs = settings.fast_decode and self.input_device.type == "cuda"
        if settings.fast_decode:
            if rules is not None:
                rules.check_fast_decode()
            check_cuda_graphs(self)
        if graphs and user_processors:
            logger.warning_once("a logits_processor runs in Python between the step's parts: the frame step runs "
                                "eagerly, without CUDA graphs")
            graphs = False
        # A user's logits processor is Python run inside the step: it cannot be compiled with it either.
        compile_step = settings.compile_step if not user_processors else False
        frames = frame_limit.limit(prompt_length)[0] if batch else 0
        with tqdm(total=frames, unit="frame", leave=False, disable=not model_kwargs.get("show_progress")) as bar:
            observer = GenerateObserver(input_ids, streamer, bar.update, user_processors, user_criteria,
                                        settings.output_scores)
            kept = kept_states(self) if graphs else None
            try:
                with kept.in_use() if kept is not None else contextlib.nullcontext():
                    one_stream = not isinstance(generators, list)  # one stream for the batch (or torch's default)
                    runner = FrameRunner(self, sampling, device_criteria, graphs, compile_step, observer.needs_scores,
                                         kept, admits_later=False, one_stream=one_stream,
                                         generator=generators if one_stream else None)
                    interval = 1 if observer.reads_every_frame else settings.stop_check_interval
                    engine = Drama3Engine(self, max_batch=max(batch, 1), stop_check_interval=interval, runner=runner,
                                          observer=observer)
                    try:
                        ids = engine.add_batch(input_ids, model_kwargs.get("attention_mask"), settings,
                                               None if one_stream else generators, model_kwargs.get("prompt_cache"),
                                               frame_limit)
                        observer.ids = {request_id: index for index, request_id in enumerate(ids)}
                        engine.run_until_idle()
                    finally:
                        runner.close()
            finally:
                if streamer is not None:
                    streamer.end()
        results = [engine.get_result(request_id) for request_id in ids]
        for result in results:
            if result.exception is not None:
                raise result.exception
        return self._output(input_ids, results, observer, settings)

    @staticmethod
    def _output(input_ids, results, observer: GenerateObserver, settings):
        """`Drama3GenerateOutput` of the batch's results (or its `sequences` alone)."""
        batch, prompt_length, width = input_ids.shape
        lengths = [result.frames for result in results]
        frames = torch.zeros(batch, max(lengths, default=0), width, dtype=torch.long)  # [B, N, 1 + NCB]
        for index, result in enumerate(results):
            frames[index, : lengths[index], 0] = torch.tensor(result.generated_tokens, dtype=torch.long)
            frames[index, : lengths[index], 1:] = result.codes.T
        sequences = torch.cat((input_ids, frames.to(input_ids.device)), 1)
        if not settings.return_dict_in_generate:
            return sequences
        codes = [sequences[i, prompt_length : prompt_length + n, 1:].T.contiguous() for i, n in enumerate(lengths)]
        reasons = [result.finish_reason for result in results]
        scores = observer.kept_scores(lengths, [reason == FINISH_EOS for reason in reasons])
        return Drama3GenerateOutput(sequences=sequences, codes=codes, finish_reason=reasons,
                                    scores=scores if settings.output_scores else None)

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


__all__ = ["Drama3GenerateOutput", "Drama3GenerationMixin"]
