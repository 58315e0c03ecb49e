"""Fish Audio Drama 3 for Hugging Face transformers.

`import transformers_drama3` is what makes transformers know Drama 3: after it, `AutoConfig`, `AutoModel`,
`AutoModelForTextToWaveform`, `AutoProcessor` and `pipeline("text-to-speech")` load Drama 3 checkpoints, with the
`bsgemm-moe` FP8 quantization method and the original checkpoint names (`registration.py`). Without it transformers
says it does not know the model type `fish_omni`, and `AutoProcessor` quietly returns a bare tokenizer.

The import itself is light (no torch, no transformers): the public names below load their modules on first use, and
the registration runs when transformers' Auto classes are imported. Importing twice, or reloading, does not fail.
"""

from importlib import import_module

from .registration import arm

# Public name -> the module that defines it (imported on first use).
_PUBLIC = {
    "BsgemmMoeConfig": "quantization_bsgemm",
    "Drama3AudioStreamer": "streaming",
    "Drama3CheckpointError": "checkpoint_mapping",
    "Drama3CodebookTower": "modeling_tower",
    "Drama3ConfigError": "configuration_drama3",
    "Drama3Engine": "generation",
    "Drama3GenerateOutput": "generation_drama3",
    "Drama3ParallelError": "parallel",
    "Drama3Processor": "processing_drama3",
    "Drama3Result": "generation",
    "Drama3Speech": "synthesis",
    "Drama3SpeechOutput": "modeling_drama3",
    "Drama3TowerCache": "modeling_tower",
    "Drama3TowerConfig": "configuration_drama3",
    "Drama3Voice": "voice",
    "FishDACCodec": "modeling_codec",
    "FishDACConfig": "configuration_drama3",
    "FishDACDecoder": "modeling_codec",
    "FishDACDecoderOutput": "modeling_codec",
    "FishDACEncoder": "modeling_codec",
    "FishDACEncoderOutput": "modeling_codec",
    "FishDACOutput": "modeling_codec",
    "FishOmniConfig": "configuration_drama3",
    "FishOmniForSpeech": "modeling_drama3",
    "FishOmniPreTrainedModel": "modeling_drama3",
    "PromptCache": "generation",
    "PromptCacheStore": "generation",
    "execution_device": "device_placement",
    "split_text": "chunking",
    "synthesize": "synthesis",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


arm()
