"""transformers' continuous-batching API on Drama 3: `init_continuous_batching`, `continuous_batching_context_manager`
and `generate_batch`, with transformers' signatures, over a `Drama3Engine` (engine.py) instead of transformers' manager
of text tokens in a paged cache. Drama 3's options come as keywords or through the fields of transformers'
`ContinuousBatchingConfig` that have the same meaning (`engine_options`).

    with model.continuous_batching_context_manager(max_batch=4) as engine:
        request_id = engine.add_request(inputs["input_ids"][0], seed=0)
        result = engine.get_result(request_id)                  # Drama3Result: codes [NCB, n], finish_reason
    results = model.generate_batch([rows_a, rows_b], max_new_tokens=200)   # {request_id: Drama3Result with audio}
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from tqdm.auto import tqdm
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints
from transformers.utils import logging

from ..device_placement import execution_device
from .engine import Drama3Engine

logger = logging.get_logger(__name__)

DEFAULT_MAX_BATCH = 8
# ContinuousBatchingConfig fields the engine honours -> its option of the same meaning.
HONOURED_FIELDS = {"max_requests_per_batch": "max_batch", "use_cuda_graph": "fast_decode"}
# Fields whose non-default value is what the engine does anyway: it never switches attention implementations.
CONSISTENT_VALUES = {"auto_switch_to_flash": False}
DRAMA3_OPTIONS = ("max_batch", "fast_decode", "compile_step", "keep_results")


def engine_options(continuous_batching_config: ContinuousBatchingConfig | None = None,
                   workload_hints: WorkloadHints | None = None, **options) -> dict:
    """The `Drama3Engine` keywords for transformers' arguments and Drama 3's `options`; raises `ValueError` naming a
    field of `continuous_batching_config` (or an option) that cannot apply, `TypeError` for an unknown keyword."""
    unknown = sorted(set(options) - set(DRAMA3_OPTIONS))
    if unknown:
        raise TypeError(f"unknown continuous-batching options {unknown}; Drama 3 takes {list(DRAMA3_OPTIONS)}, and "
                        "transformers' continuous_batching_config / workload_hints")
    chosen = {key: value for key, value in options.items() if value is not None}
    if continuous_batching_config is not None:
        if not isinstance(continuous_batching_config, ContinuousBatchingConfig):
            raise TypeError("continuous_batching_config must be a transformers ContinuousBatchingConfig, got "
                            f"{type(continuous_batching_config).__name__}")
        default = ContinuousBatchingConfig()
        for item in dataclasses.fields(ContinuousBatchingConfig):
            value = getattr(continuous_batching_config, item.name)
            if value == getattr(default, item.name) or CONSISTENT_VALUES.get(item.name, ...) == value:
                continue
            option = HONOURED_FIELDS.get(item.name)
            if option is None:
                raise ValueError(
                    f"continuous_batching_config.{item.name}={value!r} cannot apply to Drama 3's engine (it batches "
                    f"frames, not text tokens in a paged cache); of its fields it honours "
                    f"{sorted(HONOURED_FIELDS)}, and takes {list(DRAMA3_OPTIONS)} as keywords")
            if isinstance(value, tuple):  # use_cuda_graph per path (varlen, decode): one step here, one answer
                if len(set(value)) != 1:
                    raise ValueError(f"continuous_batching_config.use_cuda_graph={value!r}: Drama 3 has one frame "
                                     "step, so CUDA graphs are on or off for all of it")
                value = value[0]
            if option in chosen and chosen[option] != value:
                raise ValueError(f"{option}={chosen[option]!r} and continuous_batching_config.{item.name}={value!r} "
                                 "disagree: set one of them")
            chosen[option] = value
    if workload_hints is not None and "max_batch" not in chosen and workload_hints.num_requests > 0:
        chosen["max_batch"] = min(DEFAULT_MAX_BATCH, workload_hints.num_requests)  # no slots nobody can use
    return chosen


class Drama3ContinuousBatchingMixin:
    """transformers' continuous-batching methods for `FishOmniForSpeech`, each running a `Drama3Engine`."""

    def init_continuous_batching(self, generation_config: GenerationConfig | None = None,
                                 continuous_batching_config: ContinuousBatchingConfig | None = None,
                                 workload_hints: WorkloadHints | None = None, **drama3_options) -> Drama3Engine:
        """A `Drama3Engine` over this model (module docstring): the one kept on the model by
        `stop(keep_for_next_session=True)` if there is one, else a new one. `generation_config`: the requests'
        default settings, over the model's. Start it with `start()` (or `with`), then `add_request` / `get_result`."""
        options = engine_options(continuous_batching_config, workload_hints, **drama3_options)
        kept = getattr(self, "_cached_continuous_batching_manager", None)
        if kept is not None:
            logger.info("the engine kept on the model (stop(keep_for_next_session=True)) is used again; "
                        "destroy_cached_continuous_batching_manager() lets it go")
            return kept
        return Drama3Engine(self, generation_config=generation_config, **options)

    def destroy_cached_continuous_batching_manager(self) -> None:
        """Stop and let go the engine kept on the model (its frame states and CUDA graphs are freed)."""
        kept = getattr(self, "_cached_continuous_batching_manager", None)
        if kept is not None:
            kept.stop(hard_stop=True)

    @contextlib.contextmanager
    def continuous_batching_context_manager(self, generation_config: GenerationConfig | None = None,
                                            block: bool = True, timeout: float | None = None,
                                            continuous_batching_config: ContinuousBatchingConfig | None = None,
                                            persistent_manager: bool = False, warmup: bool = True,
                                            workload_hints: WorkloadHints | None = None, **drama3_options):
        """A started `Drama3Engine` (`warmup()` first, with `warmup`), stopped on exit: `stop(block, timeout,
        keep_for_next_session=persistent_manager)`, which cancels what runs when the block raised."""
        engine = self.init_continuous_batching(generation_config, continuous_batching_config, workload_hints,
                                               **drama3_options)
        if warmup:
            engine.warmup()
        engine.start()
        failed = True  # until the block has run: an exception (or the generator closed) cancels what runs
        try:
            yield engine
            failed = False
        finally:
            engine.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager, hard_stop=failed)

    @torch.no_grad()
    def generate_batch(self, inputs: list, generation_config: GenerationConfig | None = None,
                       continuous_batching_config: ContinuousBatchingConfig | None = None,
                       record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                       warmup: bool = True, output_audio: bool = True, seed: int | list[int] | None = None,
                       max_batch: int | None = None, fast_decode: bool | None = None,
                       compile_step: bool | str | None = None, **kwargs) -> dict:
        """Speak a list of prompts (each the frame rows `[T, 1 + NCB]` of one prompt, as `Drama3Processor` makes
        them) with continuous batching; returns `{request_id: Drama3Result}` in the order of `inputs`, each with
        its codes and (with `output_audio`) its float32 audio. `kwargs` are settings for every request
        (`max_new_tokens`, `temperature`, ...); `seed` is one seed for all, or a list of one per prompt. A request
        that fails has `status` FAILED and its `error`; the others are not affected."""
        if not inputs:
            return {}
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(inputs)
        if len(seeds) != len(inputs):
            raise ValueError(f"seed as a list needs one seed per prompt ({len(inputs)}), got {len(seeds)}")
        rows = [torch.as_tensor(prompt) for prompt in inputs]
        hints = WorkloadHints(max_prompt_length=max(r.shape[-2] if r.dim() > 1 else 0 for r in rows),
                              max_generated_length=kwargs.get("max_new_tokens") or 0, num_requests=len(rows))
        with self.continuous_batching_context_manager(
                generation_config, continuous_batching_config=continuous_batching_config,
                persistent_manager=persistent_manager, warmup=warmup, workload_hints=hints, max_batch=max_batch,
                fast_decode=fast_decode, compile_step=compile_step) as engine:
            ids = [engine.add_request(prompt, seed=s, record_timestamps=record_timestamps, **kwargs)
                   for prompt, s in zip(rows, seeds)]
            results = {}
            with tqdm(total=len(ids), unit="request", disable=not progress_bar) as bar:
                for request_id in ids:
                    results[request_id] = engine.get_result(request_id)
                    bar.update(1)
        if output_audio:
            device = execution_device(self.codec)
            for result in results.values():
                result.audio = self.codec.decode(result.codes[None].to(device)).audio_values[0, 0]
        return results


__all__ = ["Drama3ContinuousBatchingMixin", "engine_options"]
