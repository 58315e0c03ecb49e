"""Fish Audio Drama 3 for Hugging Face transformers.

Importing this package registers the Drama 3 classes with transformers (idempotently: importing twice, or
reloading, does not fail): the config with `AutoConfig`, the model with `AutoModel` and
`AutoModelForTextToWaveform`, the `bsgemm-moe` FP8 quantization method, and the original checkpoint names.
"""

from transformers import AutoConfig, AutoModel, AutoModelForTextToWaveform, AutoProcessor

from .checkpoint_mapping import Drama3CheckpointError, register_checkpoint_mapping
from .configuration_drama3 import Drama3ConfigError, Drama3TowerConfig, FishDACConfig, FishOmniConfig
from .device_placement import execution_device
from .chunking import split_text
from .generation_drama3 import Drama3GenerateOutput
from .modeling_codec import FishDACCodec, FishDACDecoder, FishDACEncoder
from .modeling_drama3 import Drama3SpeechOutput, FishOmniForSpeech, FishOmniPreTrainedModel
from .modeling_tower import Drama3CodebookTower, Drama3TowerCache
from .parallel import Drama3ParallelError
from .processing_drama3 import Drama3Processor
from .streaming import Drama3AudioStreamer
from .quantization_bsgemm import BsgemmMoeConfig, register_bsgemm_moe
from .synthesis import Drama3Speech, synthesize
from .voice import Drama3Voice


def _register() -> None:
    register_bsgemm_moe()
    register_checkpoint_mapping()
    AutoConfig.register(FishOmniConfig.model_type, FishOmniConfig, exist_ok=True)
    AutoConfig.register(Drama3TowerConfig.model_type, Drama3TowerConfig, exist_ok=True)
    AutoConfig.register(FishDACConfig.model_type, FishDACConfig, exist_ok=True)
    AutoModel.register(FishOmniConfig, FishOmniForSpeech, exist_ok=True)
    AutoModelForTextToWaveform.register(FishOmniConfig, FishOmniForSpeech, exist_ok=True)
    AutoProcessor.register(FishOmniConfig, Drama3Processor, exist_ok=True)


_register()

__all__ = [
    "BsgemmMoeConfig",
    "Drama3AudioStreamer",
    "Drama3CheckpointError",
    "Drama3CodebookTower",
    "Drama3ConfigError",
    "Drama3GenerateOutput",
    "Drama3ParallelError",
    "Drama3Processor",
    "Drama3Speech",
    "Drama3SpeechOutput",
    "Drama3TowerCache",
    "Drama3TowerConfig",
    "Drama3Voice",
    "FishDACCodec",
    "FishDACConfig",
    "FishDACDecoder",
    "FishDACEncoder",
    "FishOmniConfig",
    "FishOmniForSpeech",
    "FishOmniPreTrainedModel",
    "execution_device",
    "split_text",
    "synthesize",
]
