"""Drama 3's generation settings: their defaults, and the one merge and check every door runs (`generation_settings`:
`generate`'s hook, the engine and each of its requests, the early checks of the CLI, jobs and the server).
"""

from __future__ import annotations

import copy

from transformers import GenerationConfig
from transformers.generation import GenerationMode

from .. import compat
from ..settings_checks import check_generation_settings

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
    "stop_check_interval": 8,  # frames between two host reads of a `generate` call (1 with a streamer or host hooks)
    "fast_decode": False,  # on CUDA: capture the frame step once as a CUDA graph and replay it (cuda_graphs.py)
    "compile_step": False,  # torch.compile the frame step first (True: inductor; or a torch.compile backend's name)
    "return_dict_in_generate": True,
    "output_scores": False,  # the main-token candidate logits of every frame, in `Drama3GenerateOutput.scores`
}
# Settings that are the engine's, not a request's: how the step runs, and what a frame hands back.
ENGINE_SETTINGS = {
    "fast_decode": "it is the engine's: Drama3Engine(model, fast_decode=...)",
    "compile_step": "it is the engine's: Drama3Engine(model, compile_step=...)",
    "stop_check_interval": "it is the engine's: Drama3Engine(model, stop_check_interval=...) (1 by default: each "
                           "frame reaches its request as it is made)",
    "output_scores": "the engine keeps no scores; use model.generate(..., output_scores=True)",
}
# transformers' generation settings that mean nothing for frames, but that pipelines and configs carry.
IGNORED_SETTINGS = ("pad_token_id", "bos_token_id", "eos_token_id", "use_cache", "transformers_version",
                    "_from_model_config")
# Drama 3's own `generate` keywords besides the settings, which reach `_sample` with the model keywords.
CALL_ARGUMENTS = ("attention_mask", "seed", "generator", "show_progress", "prompt_cache")


def unsupported_arguments(names) -> TypeError:
    """The error for `generate` keywords that Drama 3 generation does not take (unknown, or transformers settings
    that mean nothing for frames)."""
    return TypeError(
        f"generate() got unknown or unsupported arguments {sorted(names)}; Drama 3 generation accepts "
        f"{sorted(DRAMA3_GENERATION_DEFAULTS)} (plus input_ids, attention_mask, generation_config, logits_processor, "
        "stopping_criteria, streamer, seed, generator, output_audio, show_progress, prompt_cache)"
    )


def chosen_settings(generation_config: GenerationConfig | None, kwargs: dict) -> dict:
    """The Drama 3 settings a call chooses (from `generation_config`, then keywords), after refusing the transformers
    settings it chooses that do not apply to frames (beams, penalties, ...). Values equal to transformers' global
    defaults in `generation_config` are no choice (pipelines of some versions fill them in)."""
    chosen = {}
    if generation_config is not None:
        neutral = compat.generation_defaults()
        given = {key: value for key, value in generation_config.to_diff_dict().items()
                 if key in DRAMA3_GENERATION_DEFAULTS or (value is not None and value != neutral.get(key))}
        unsupported = sorted(set(given) - set(DRAMA3_GENERATION_DEFAULTS) - set(IGNORED_SETTINGS))
        if unsupported:
            raise ValueError(
                f"generation_config sets {unsupported}, which Drama 3 generation does not use; it accepts "
                f"{sorted(DRAMA3_GENERATION_DEFAULTS)} (see docs/usage.md, 'Sampling settings')"
            )
        chosen.update((key, value) for key, value in given.items() if key in DRAMA3_GENERATION_DEFAULTS)
    known = GenerationConfig()
    unsupported = [key for key in kwargs if hasattr(known, key) and key not in DRAMA3_GENERATION_DEFAULTS
                   and key not in IGNORED_SETTINGS]
    if unsupported:
        raise unsupported_arguments(unsupported)
    chosen.update((key, value) for key, value in kwargs.items() if key in DRAMA3_GENERATION_DEFAULTS)
    return chosen


def merge_settings(base: GenerationConfig, generation_config: GenerationConfig | None,
                   kwargs: dict) -> tuple[GenerationConfig, dict]:
    """The settings a call runs with, checked, and the keywords that are no settings (`seed`, `attention_mask`, ...).

    Drama 3's own settings are checked on the complete set (`base`'s, or Drama 3's defaults where `base` lacks them,
    under the call's choices) before anything else; then transformers' order of precedence builds the config:
    `generation_config` (or a new one), then `base`'s values where it leaves a setting unset, then transformers'
    global defaults, then the keywords. Only greedy and sampled decoding apply to frames.
    """
    values = {key: getattr(base, key, None) for key in DRAMA3_GENERATION_DEFAULTS}
    values = {key: DRAMA3_GENERATION_DEFAULTS[key] if value is None else value for key, value in values.items()}
    values.update(chosen_settings(generation_config, kwargs))
    check_generation_settings(values)
    settings = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    settings.update(**base.to_dict(), defaults_only=True, allow_custom_entries=True)
    settings.update(**compat.generation_defaults(), defaults_only=True)
    rest = settings.update(**kwargs)  # the keywords that are no settings
    for key, value in values.items():  # a generation config set by hand may lack Drama 3's keys
        if getattr(settings, key, None) is None:
            setattr(settings, key, value)
    mode = settings.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"Drama 3 generates frames greedily (do_sample=False) or by sampling, not by "
                         f"{mode.value}; check the model's generation_config")
    return settings, rest


def generation_settings(
    base: GenerationConfig, generation_config: GenerationConfig | None = None, **kwargs
) -> GenerationConfig:
    """The settings `generate(generation_config=..., **kwargs)` runs with on a model whose generation config is
    `base`, checked as `generate` checks them: the one early check for front ends (the CLI, a manifest, a server)
    before any model loads, with `GenerationConfig(**DRAMA3_GENERATION_DEFAULTS)` as `base`.

    Raises `TypeError` for an unknown keyword and `ValueError` for a value out of range or a transformers setting
    that does not apply to Drama 3 (beams, penalties, ...), naming the setting.
    """
    settings, rest = merge_settings(base, generation_config, kwargs)
    unknown = [key for key, value in rest.items() if value is not None and key not in CALL_ARGUMENTS]
    if unknown:
        raise unsupported_arguments(unknown)
    return settings


__all__ = ["CALL_ARGUMENTS", "DRAMA3_GENERATION_DEFAULTS", "ENGINE_SETTINGS", "generation_settings", "merge_settings",
           "unsupported_arguments"]
