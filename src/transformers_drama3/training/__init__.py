"""Fine-tuning Drama 3 with `datasets`, the transformers `Trainer` and `peft` LoRA (docs/finetuning.md).

- `prepare_dataset` (and the `drama3-prepare` command): a folder of recordings -> a dataset of training examples;
- `Drama3SpeechCollator`: the `data_collator` that pads them into batches;
- `drama3_lora_config` and `LORA_PRESETS`: what LoRA adapts;
- `checkpointing_arguments`, `enable_checkpointing`: activation checkpointing under either transformers name.

Needs the `train` extra: `pip install "transformers-drama3[train]"` (datasets, peft).
"""

try:
    import datasets  # noqa: F401
    import peft  # noqa: F401
except ImportError as error:
    raise ImportError(
        f"transformers_drama3.training needs {error.name!r}: pip install \"transformers-drama3[train]\""
    ) from error

from ..compat import checkpointing_training_arguments as checkpointing_arguments
from ..compat import disable_activation_checkpointing as disable_checkpointing
from ..compat import enable_activation_checkpointing as enable_checkpointing
from .collator import Drama3SpeechCollator
from .lora import LORA_PRESETS, LoraTargets, drama3_lora_config
from .prepare import PreparedDataset, load_codec_and_processor, prepare_dataset, speech_example
from .recordings import Recording, SkippedClip, find_recordings

__all__ = [
    "Drama3SpeechCollator",
    "LORA_PRESETS",
    "LoraTargets",
    "PreparedDataset",
    "Recording",
    "SkippedClip",
    "checkpointing_arguments",
    "disable_checkpointing",
    "drama3_lora_config",
    "enable_checkpointing",
    "find_recordings",
    "load_codec_and_processor",
    "prepare_dataset",
    "speech_example",
]
