"""What every example shares: the `--model` flag and loading a model with its processor; for the server examples,
the `--url` / `--api-key` flags and a tiny server started in this process when no `--url` is given.

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


def server_parser(description: str) -> argparse.ArgumentParser:
    """Flags of the server examples: `--url` (a running drama3-serve), `--api-key`, `--model` (the served id)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running drama3-serve (default: start a tiny one here)")
    parser.add_argument("--api-key", help="the server's --api-key, if it has one")
    parser.add_argument("--model", default="drama3-tiny", help="the served model id (GET /v1/models)")
    return parser


def server_url(stack, args) -> str:
    """`args.url`, or the URL of a server on the tiny checkpoint started in a background thread (stopped when the
    `contextlib.ExitStack` `stack` closes)."""
    if args.url is not None:
        return args.url
    from transformers_drama3.serving import ServerSettings
    from transformers_drama3.serving.thread import ServerThread

    settings = ServerSettings(model=default_tiny_checkpoint(), model_name=args.model)
    return stack.enter_context(ServerThread(settings)).url
