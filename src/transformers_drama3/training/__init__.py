"""Fine-tuning Drama 3 with `datasets`, the transformers `Trainer` and `peft` LoRA (docs/finetuning.md).

- `prepare_dataset` (and the `drama3-prepare` command): a folder of recordings -> a dataset of training examples;
- `Drama3SpeechCollator`: the `data_collator` that pads them into batches;
- `drama3_lora_config` and `LORA_PRESETS`: what LoRA adapts;
- `checkpointing_arguments`, `enable_checkpointing`: activation checkpointing under either transformers name.

Needs the `train` extra: `pip install "transformers-drama3[train]"` (datasets, peft).
"""

from importlib import import_module
from importlib.util import find_spec

for _package in ("datasets", "peft"):
    if find_spec(_package) is None:
        raise ImportError(f"transformers_drama3.training needs {_package!r}: pip install \"transformers-drama3[train]\"",
                          name=_package)

# Public name -> (module, name there), imported on first use: `drama3-prepare` never imports peft (and with it
# bitsandbytes, which prints a line about its CPU kernels on import); only the LoRA names do.
_PUBLIC = {
    "Drama3SpeechCollator": ("collator", "Drama3SpeechCollator"),
    "LORA_PRESETS": ("lora", "LORA_PRESETS"),
    "LoraTargets": ("lora", "LoraTargets"),
    "PreparedDataset": ("prepare", "PreparedDataset"),
    "Recording": ("recordings", "Recording"),
    "SkippedClip": ("recordings", "SkippedClip"),
    "checkpointing_arguments": ("..compat", "checkpointing_training_arguments"),
    "disable_checkpointing": ("..compat", "disable_activation_checkpointing"),
    "drama3_lora_config": ("lora", "drama3_lora_config"),
    "enable_checkpointing": ("..compat", "enable_activation_checkpointing"),
    "find_recordings": ("recordings", "find_recordings"),
    "load_codec_and_processor": ("prepare", "load_codec_and_processor"),
    "prepare_dataset": ("prepare", "prepare_dataset"),
    "speech_example": ("prepare", "speech_example"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(import_module(module if module.startswith("..") else f".{module}", __name__), attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
