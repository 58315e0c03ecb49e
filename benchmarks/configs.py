"""The model configurations of the benchmarks, and building a random model from one.

Only the package's public names are used, so the benchmarks that time `generate` alone run against any version.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch

from transformers_drama3 import FishOmniConfig, FishOmniForSpeech
from transformers_drama3.testing import tiny_config_dict

SMALL_CONFIG = {
    "text_config": {
        "vocab_size": 8448, "hidden_size": 512, "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 4, "linear_key_head_dim": 64, "linear_num_value_heads": 8, "linear_value_head_dim": 64,
        "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    },
    "audio_decoder_config": {"dim": 512, "text_dim": 512, "n_head": 8, "n_local_heads": 2, "head_dim": 64,
                             "intermediate_size": 1536},
}
# The real topology at narrow widths: every count of layers, heads, experts and codebooks as in FishOmniConfig(), the
# widths (hidden, head and expert sizes) small enough for a CPU; the text vocabulary holds the semantic band.
TOPOLOGY_CONFIG = {
    "text_config": {
        "vocab_size": 8448, "hidden_size": 256, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 16, "linear_key_head_dim": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 16,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_position_embeddings": 4096,
    },
    "audio_decoder_config": {"dim": 256, "text_dim": 256, "n_head": 16, "n_local_heads": 2, "head_dim": 32,
                             "intermediate_size": 256},
}

def with_band_at_top(config: dict) -> dict:
    """Put the semantic band on the last V ids of the text vocabulary and EOS right below it."""
    vocab = config["text_config"]["vocab_size"]
    band = config.get("audio_decoder_config", {}).get("vocab_size", 4096)
    return {**config, "semantic_start_token_id": vocab - band, "semantic_end_token_id": vocab - 1,
            "eos_token_id": vocab - band - 1}


def model_config(name: str, layers: int | None = None) -> FishOmniConfig:
    """The configuration `name`, with only its first `layers` backbone layers when given."""
    source = {"tiny": tiny_config_dict(), "small": SMALL_CONFIG, "topology": TOPOLOGY_CONFIG}.get(name)
    config = FishOmniConfig() if source is None else FishOmniConfig(**with_band_at_top(source))
    if layers is not None:  # at most the layers the configuration has
        text = config.text_config
        text.layer_types = text.layer_types[:layers]
        text.num_hidden_layers = len(text.layer_types)
    return config


def served_checkpoint(name: str) -> str:
    """A checkpoint directory for the server benchmarks: `tiny`, the embedded tiny checkpoint; `small`, the `small`
    backbone and tower written once (into the temp directory) with the tiny codec and tokenizer."""
    from transformers_drama3.testing import default_tiny_checkpoint, write_tiny_checkpoint

    if name == "tiny":
        return default_tiny_checkpoint()
    path = os.path.join(tempfile.gettempdir(), "transformers-drama3-serve-benchmark-small")
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_tiny_checkpoint(path, **SMALL_CONFIG)
    return path


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Create parameters in `dtype` directly (a float32 real-size model would need 140 GB)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: FishOmniConfig, device: torch.device, dtype: torch.dtype, seed: int,
                codec_weights: bool = True) -> FishOmniForSpeech:
    """The model built on `device` in `dtype` with the default random initialisation; the codec in float32, with
    random weights loaded through the real `codec.pth` path when `codec_weights`."""
    torch.manual_seed(seed)
    with default_dtype(dtype), device:
        model = FishOmniForSpeech(config)
    model.codec.float()
    if codec_weights:
        from transformers_drama3.testing import random_original_codec_state_dict

        state = random_original_codec_state_dict(config.codec_config, torch.Generator().manual_seed(seed))
        model.codec.load_original_state_dict(state)
    return model.eval()


def random_prompt(config: FishOmniConfig, rows: int, batch: int, device: torch.device, seed: int) -> torch.Tensor:
    """Frame rows `[batch, rows, 1 + NCB]` of random text tokens (ids below EOS and the semantic band)."""
    low = min(config.eos_token_id, config.semantic_start_token_id)
    tokens = torch.randint(0, low, (1, rows), generator=torch.Generator().manual_seed(seed)).expand(batch, -1)
    prompt = torch.zeros(batch, rows, 1 + config.num_codebooks, dtype=torch.long)
    prompt[..., 0] = tokens
    return prompt.to(device)
