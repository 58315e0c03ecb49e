"""Tiny random Drama 3 checkpoints in the original layout, for tests, demos and benchmarks.

`write_tiny_checkpoint(path)` writes what `fishaudio/drama-3` ships, at toy size: config.json in the original
schema (`fish_omni_text` text config, `bsgemm-moe` quantization), sharded safetensors with the original tensor
names and FP8 routed experts (one tensor per expert, float32 `weight_scale_inv` per 128 x 128 block), `codec.pth`
with weight-norm parametrisation keys, and a byte-level BPE tokenizer with every special token. The loader accepts
it exactly like the real checkpoint.

`sine_recording` / `sine_wav` are the stand-in voice recording of tests and checks: a 220 Hz tone.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file

from .checkpoint_mapping import FP8_BLOCK, expected_original_tensors
from .configuration_drama3 import FishDACConfig, FishOmniConfig, merge_settings
from .codec_file import original_codec_key_shapes

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
STRUCTURAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|voice|>", "<|text|>", "<|interleave|>"]
NUM_SPEAKERS = 16
BPE_VOCAB = 400

# The embedded default: the golden tiny checkpoint's geometry (`tests/fixtures/tiny`, about 20 MB), original config.json
# schema.
TINY_CONFIG = {
    "architectures": ["FishOmniModel"],
    "model_type": "fish_omni",
    "fish_schema_version": 1,
    "speech_template_version": "reference-bracket-v1",
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "quantization_config": {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "text_config": {
        "model_type": "fish_omni_text",
        "vocab_size": 512,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "linear_num_key_heads": 1,
        "linear_key_head_dim": 64,
        "linear_num_value_heads": 2,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "hidden_act": "silu",
        "rotary_interleaved": False,
        "use_qk_norm": True,
        "attn_output_gate": True,
        "layernorm_zero_centered_gamma": True,
        "shared_expert_gate": True,
    },
    "audio_decoder_config": {
        "model_type": "fish_qwen3_audio_decoder",
        "decoder_type": "codebook_mtp_shared",
        "dim": 256,
        "text_dim": 256,
        "n_head": 2,
        "n_local_heads": 1,
        "head_dim": 128,
        "n_layer": 2,
        "shared_enrichment_layers": 2,
        "intermediate_size": 384,
        "norm_eps": 1e-6,
        "num_codebooks": 10,
        "vocab_size": 64,
        "max_seq_len": 11,
        "rope_base": 1e7,
        "rotary_percent": 0.25,
        "rotary_interleaved": True,
        "attention_output_gate": True,
        "attention_qk_norm": False,
        "layernorm_zero_centered_gamma": True,
        "vq_feature_scope": "all_vq",
        "vq_feature_placement": "backbone_partial",
        "vq_backbone_codebooks": 1,
    },
    "codec_config": {
        "encoder_dim": 4,
        "latent_dim": 64,
        "decoder_dim": 32,
        "encoder_transformer_layers": [0, 0, 0, 1],
        "quantizer": {
            "input_dim": 64,
            "codebook_size": 32,
            "semantic_codebook_size": 64,
            "transformer": {"n_layer": 2, "n_head": 4, "dim": 64, "head_dim": 16, "intermediate_size": 128},
        },
    },
}

_TRAINING_TEXT = (
    "Hello there, how are you today? The quick brown fox jumps over the lazy dog. Did you hear that? "
    "Hear what? I heard nothing at all. This is my voice, recorded on a quiet afternoon. Good morning, everyone. "
    "Nice to meet you. Thanks for waiting, we can start now. Speech is sound shaped by words; a voice carries "
    "feeling, rhythm and breath. She whispered softly, then laughed out loud! Numbers: one, two, three, 1 2 3. "
)


def tiny_config_dict(**overrides) -> dict:
    """The original-schema config.json of a tiny checkpoint; nested dicts in `overrides` merge key by key."""
    return merge_settings(TINY_CONFIG, overrides)


def write_tiny_checkpoint(path: str | os.PathLike, seed: int = 0, max_shard_size: str = "10MB", **overrides) -> str:
    """Write a random Drama 3 checkpoint in the original layout to `path` and return the path.

    `overrides` update the config (e.g. `audio_decoder_config={"vq_backbone_codebooks": 2}`); the semantic band
    and EOS ids follow from the tokenizer, which has `audio_decoder_config.vocab_size` semantic tokens.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config_dict = tiny_config_dict(**overrides)
    tokenizer = _build_tokenizer(config_dict["audio_decoder_config"]["vocab_size"])
    vocab = tokenizer.get_vocab()
    config_dict["semantic_start_token_id"] = vocab["<|semantic:0|>"]
    config_dict["semantic_end_token_id"] = vocab[f"<|semantic:{config_dict['audio_decoder_config']['vocab_size'] - 1}|>"]
    config_dict["eos_token_id"] = vocab["<|im_end|>"]
    text_vocab = config_dict["text_config"]["vocab_size"]
    if len(vocab) > text_vocab:
        config_dict["text_config"]["vocab_size"] = 64 * math.ceil(len(vocab) / 64)
    config = FishOmniConfig(**copy.deepcopy(config_dict))  # validates before anything is written

    generator = torch.Generator().manual_seed(seed)
    _save_sharded(_original_tensor_shapes(config), _random_original_tensors(config, generator), path, max_shard_size)
    torch.save(random_original_codec_state_dict(config.codec_config, generator), os.path.join(path, "codec.pth"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2)
    _save_tokenizer(tokenizer, path)
    return path


def _original_tensor_shapes(config: FishOmniConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every original tensor name, in the order the writer draws them (each FP8 weight's
    `weight_scale_inv` right after it)."""
    from .modeling_drama3 import FishOmniForSpeech

    with torch.device("meta"):
        skeleton = FishOmniForSpeech(config, with_codec=False)  # the codec goes to codec.pth
    return expected_original_tensors(skeleton, fp8_experts=_fp8_experts(config))


def _fp8_experts(config: FishOmniConfig) -> bool:
    return (getattr(config, "quantization_config", None) or {}).get("quant_method") == "bsgemm-moe"


def _random_original_tensors(config: FishOmniConfig, generator: torch.Generator):
    """Random tensors for every original name, one at a time (`(name, tensor)`, in `_original_tensor_shapes`
    order, so that a full-width checkpoint is written without being held): bf16 dense weights, FP8 experts with
    block scales.

    Zero-centred norm weights are small random values (std 0.15) so that a missing `1 +` is caught; the
    gated-DeltaNet output norm (a plain gain) is around 1.
    """
    fp8 = _fp8_experts(config)
    for name, shape in _original_tensor_shapes(config).items():
        if name.endswith("_scale_inv"):
            continue
        if ".mlp.experts." in name and fp8:
            weight = torch.randn(shape, generator=generator) * 0.05
            quantized, scale_inv = quantize_fp8_blockwise(weight)
            yield name, quantized
            yield name + "_scale_inv", scale_inv
        else:
            yield name, _random_dense(name, shape, generator).to(torch.bfloat16)


def _random_dense(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    if name.endswith("A_log"):
        return torch.rand(shape, generator=generator) * 2.0 - 1.0
    if name.endswith("dt_bias"):
        return torch.randn(shape, generator=generator) * 0.5
    if len(shape) == 1 and name.endswith(".weight"):  # every other 1-D weight is a zero-centred norm
        return 0.15 * torch.randn(shape, generator=generator)
    fan_in = shape[-1] if len(shape) > 1 else 1
    std = 1.0 if "embed" in name or "embedding" in name else 1.0 / math.sqrt(fan_in)
    return std * torch.randn(shape, generator=generator)


def quantize_fp8_blockwise(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [out, in]` -> (`float8_e4m3fn [out, in]`, float32 `scale_inv [ceil(out/block), ceil(in/block)]`)
    with `weight ≈ fp8 * scale_inv[i // block, j // block]` (docs/format.md, "FP8 experts")."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block), math.ceil(cols / block))
    padded = torch.zeros(grid[0] * block, grid[1] * block)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block, grid[1], block)  # [row blocks, block, col blocks, block]
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [row blocks, col blocks]
    quantized = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    quantized = quantized.view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return quantized.contiguous(), scale_inv.float()


def _save_sharded(shapes: dict[str, tuple[int, ...]], tensors, path: str, max_shard_size: str) -> None:
    """Write `tensors` (`(name, tensor)` pairs in `shapes` order) as safetensors shards of at most `max_shard_size`
    (a larger tensor gets a shard of its own), holding one shard in memory at a time; the names and the index file
    follow `huggingface_hub`'s sharding convention (its splitter needs every tensor at once)."""
    limit = _size_in_bytes(max_shard_size)
    fp8 = {name for name in shapes if name + "_scale_inv" in shapes}
    sizes = {name: math.prod(shape) * (1 if name in fp8 else 4 if name.endswith("_scale_inv") else 2)
             for name, shape in shapes.items()}
    shards, current, current_size = [], [], 0
    for name, size in sizes.items():
        if current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    shards.append(current)
    filenames = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors" for index in range(len(shards))])
    weight_map = {}
    for filename, names in zip(filenames, shards):
        shard = {}
        for name in names:
            drawn, tensor = next(tensors)
            assert drawn == name, (drawn, name)  # the generator draws in `shapes` order
            shard[name] = tensor.contiguous()
        save_file(shard, os.path.join(path, filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
        del shard
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def _size_in_bytes(size: str) -> int:
    """`"10MB"` -> 10_000_000 (KB, MB, GB, TB are powers of 1000, as in `max_shard_size` everywhere)."""
    number, unit = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)\s*", size.upper()).groups()
    return int(float(number) * 1000 ** ("KMGT".index(unit[0]) + 1))


def _build_tokenizer(num_semantic: int):
    """A byte-level BPE tokenizer (400 tokens trained on a short English text) plus every Drama 3 special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    specials = STRUCTURAL_TOKENS + [f"<|speaker:{i}|>" for i in range(NUM_SPEAKERS)]
    specials += [f"<|semantic:{i}|>" for i in range(num_semantic)]
    tokenizer.add_special_tokens(specials)
    return tokenizer


def _save_tokenizer(tokenizer, path: str) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", model_max_length=4096,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(path)


def random_original_codec_state_dict(config: FishDACConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A random float32 `codec.pth` state dict in the original layout, for tiny test checkpoints and benchmarks.

    Snake alphas in [0.5, 1.5], weight-norm gains in [0.5, 1.5] (never exactly 1), layer scales in [0.1, 0.5],
    norm gains near 1, random codebooks, fan-in scaled weights: `load_original_state_dict` accepts it and it
    decodes to finite audio that is not saturated.
    """

    def uniform(shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator) * (high - low) + low

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    state_dict = {}
    for key, shape in original_codec_key_shapes(config).items():
        if key.endswith("alpha"):
            value = uniform(shape, 0.5, 1.5)
        elif key.endswith(".block.3.conv.parametrizations.weight.original0"):  # last conv of a residual unit
            value = uniform(shape, 0.1, 0.3)  # small residual branches keep the stacked units from blowing up
        elif key.endswith(("original0", "weight_g")):
            value = uniform(shape, 0.5, 1.5)
        elif key.endswith(("original1", "weight_v", "codebook.weight")):
            value = normal(shape, 1.0)
        elif key.endswith(("layer_scale.gamma", ".1.gamma")):
            value = uniform(shape, 0.1, 0.5)
        elif key.endswith(("norm.weight",)):
            value = uniform(shape, 0.8, 1.2)
        elif key.endswith("bias"):
            value = normal(shape, 0.02)
        elif ".upsample." in key and key.endswith("conv.weight"):  # transposed [in, out, k], kernel = stride
            value = normal(shape, shape[0] ** -0.5)
        else:  # linear [out, in] or conv [out, in, k]
            value = normal(shape, math.prod(shape[1:]) ** -0.5)
        state_dict[key] = value
    return state_dict


def default_tiny_checkpoint(seed: int = 0) -> str:
    """Path of the embedded default checkpoint, written once per seed into the temp directory and reused."""
    path = os.path.join(tempfile.gettempdir(), f"transformers-drama3-tiny-seed{seed}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        staging = tempfile.mkdtemp(prefix="drama3-tiny-", dir=tempfile.gettempdir())
        write_tiny_checkpoint(staging, seed=seed)
        try:
            os.replace(staging, path)
        except OSError:  # another process finished first: keep theirs
            shutil.rmtree(staging, ignore_errors=True)
    return path


def sine_recording(seconds: float, rate: int = 16000) -> np.ndarray:
    """A stand-in voice recording: float32 `[seconds * rate]` samples of a 220 Hz sine at amplitude 0.3."""
    return (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def sine_wav(seconds: float, rate: int = 16000) -> bytes:
    """`sine_recording` as the bytes of a WAV file (soundfile's default 16-bit PCM)."""
    import io

    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, sine_recording(seconds, rate), rate, format="WAV")
    return buffer.getvalue()


__all__ = ["TINY_CONFIG", "default_tiny_checkpoint", "quantize_fp8_blockwise", "sine_recording", "sine_wav",
           "tiny_config_dict", "write_tiny_checkpoint"]
