"""What every example shares: the `--model` flag and loading a model with its processor.

Without `--model` the examples use the embedded tiny random checkpoint (it speaks noise, quickly). On a GPU the
model loads in bfloat16 on it; on a CPU in float32.
"""

import argparse

import torch
from transformers import AutoModel, AutoProcessor

import transformers_drama3  # noqa: F401  (registers Drama 3 with AutoModel / AutoProcessor)
from transformers_drama3.testing import default_tiny_checkpoint


def example_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory or Hub id (default: the embedded tiny checkpoint)")
    return parser


def checkpoint_path(model: str | None) -> str:
    return model or default_tiny_checkpoint()


def load_model_and_processor(model: str | None):
    """The model (bf16 on a GPU, float32 on CPU) and its processor holding the model's codec (which encodes reference
    audio and decodes frames), for `--model` or the tiny checkpoint."""
    path = checkpoint_path(model)
    gpu = torch.cuda.is_available()
    loaded = AutoModel.from_pretrained(path, dtype=torch.bfloat16 if gpu else torch.float32,
                                       device_map="cuda" if gpu else None)
    return loaded, AutoProcessor.from_pretrained(path, codec=loaded.codec)
