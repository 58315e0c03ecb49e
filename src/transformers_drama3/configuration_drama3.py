"""Configurations of Drama 3: the whole model, its codebook tower and its codec.

`FishOmniConfig` reads the original `config.json` of `fishaudio/drama-3` (docs/format.md#config-rules). Its
`text_config` becomes transformers' own `Qwen3_5MoeTextConfig` (the backbone *is* that model); the Fish-only keys
of a `"fish_omni_text"` config are checked and dropped. Every rule of the format is checked when the config is
built, so a bad checkpoint fails before any weight is read, with a `Drama3ConfigError` naming the key, the value
and the rule.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from transformers import PreTrainedConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from .compat import sub_configs_declaration

SPEECH_TEMPLATE_VERSIONS = ("reference-bracket-v1",)
FISH_SCHEMA_VERSIONS = (1,)


class Drama3ConfigError(ValueError):
    """A config value breaks one of the rules of the Drama 3 checkpoint format (docs/format.md#config-rules)."""


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise Drama3ConfigError(f"config key `{key}` = {value!r} breaks the rule: {rule}")


# --------------------------------------------------------------------------------------------------------------
# Codec
# --------------------------------------------------------------------------------------------------------------

_DEFAULT_ENCODER_TRANSFORMER = {"head_dim": 64, "window_size": 512, "rope_base": 10000, "norm_eps": 1e-5}
_DEFAULT_QUANTIZER = {
    "input_dim": 1024,
    "n_codebooks": 9,
    "codebook_size": 1024,
    "semantic_codebook_size": 4096,
    "codebook_dim": 8,
    "downsample_factor": [2, 2],
    "transformer": {
        "n_layer": 8,
        "n_head": 16,
        "dim": 1024,
        "head_dim": 64,
        "intermediate_size": 3072,
        "window_size": 128,
        "rope_base": 10000,
        "norm_eps": 1e-5,
    },
}


def merge_settings(defaults: dict, overrides: dict | None) -> dict:
    """Deep-merge `overrides` into a copy of `defaults` (nested dicts merge key by key)."""
    merged = copy.deepcopy(defaults)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_settings(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


class FishDACConfig(PreTrainedConfig):
    """Constants of the Fish "modified DAC" codec (docs/format.md#codec-constants); the defaults are the real Drama 3
    codec. It configures `FishDACCodec`, on its own (`model_type "fish_dac"`) or as `FishOmniConfig.codec_config`.

    Drama 3's `config.json` has no codec section; the optional `codec_config` dict of `FishOmniConfig` overrides these
    defaults key by key (the tiny test checkpoints use it; schema in tests/fixtures/README.md, "`codec_config`
    keys"). Derived keys (`hop_length`, `frame_length`, `encoder_transformer.blocks`, the `*_rule` strings) are
    recomputed and only checked when present.
    """

    model_type = "fish_dac"

    sample_rate: int = 44100
    encoder_dim: int = 64
    encoder_rates: list[int] | tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int = 1024
    decoder_dim: int = 1536
    decoder_rates: list[int] | tuple[int, ...] = (8, 8, 4, 2)
    encoder_transformer_layers: list[int] | tuple[int, ...] = (0, 0, 0, 4)
    encoder_transformer: dict | None = None
    quantizer: dict | None = None

    def __post_init__(self, **kwargs):
        derived = {key: kwargs.pop(key) for key in ("hop_length", "frame_length") if key in kwargs}
        self.encoder_rates = list(self.encoder_rates)
        self.decoder_rates = list(self.decoder_rates)
        self.encoder_transformer_layers = list(self.encoder_transformer_layers)
        encoder_transformer = dict(self.encoder_transformer or {})
        for key in ("n_head_rule", "intermediate_size_rule", "blocks"):
            encoder_transformer.pop(key, None)
        self.encoder_transformer = merge_settings(_DEFAULT_ENCODER_TRANSFORMER, encoder_transformer)
        self.quantizer = merge_settings(_DEFAULT_QUANTIZER, self.quantizer)
        super().__post_init__(**kwargs)
        self.validate_codec()
        for key, value in derived.items():
            _require(value == getattr(self, key), f"codec_config.{key}", value, f"must equal {getattr(self, key)}")

    @property
    def sampling_rate(self) -> int:
        return self.sample_rate

    @property
    def hop_length(self) -> int:
        """Samples per encoder latent step, `prod(encoder_rates)` (512 for the real codec)."""
        return math.prod(self.encoder_rates)

    @property
    def frame_length(self) -> int:
        """Samples per codec frame, `hop_length * prod(quantizer.downsample_factor)` (2048)."""
        return self.hop_length * math.prod(self.quantizer["downsample_factor"])

    @property
    def num_codebooks(self) -> int:
        """Codes per frame: one semantic codebook plus the residual ones (10)."""
        return 1 + self.quantizer["n_codebooks"]

    @property
    def codebook_sizes(self) -> list[int]:
        """Entries of each codebook, semantic first (`[4096] + [1024] * 9` for the real codec)."""
        q = self.quantizer
        return [q["semantic_codebook_size"]] + [q["codebook_size"]] * q["n_codebooks"]

    def encoder_block_width(self, index: int) -> int:
        """Width of encoder block `index` (its strided conv's output channels)."""
        return self.encoder_dim * 2 ** (index + 1)

    def encoder_transformer_shape(self, index: int) -> dict[str, int]:
        """Layers, width, heads and FFN width of the windowed transformer ending encoder block `index`."""
        width = self.encoder_block_width(index)
        head_dim = self.encoder_transformer["head_dim"]
        return {
            "n_layer": self.encoder_transformer_layers[index],
            "dim": width,
            "n_head": width // head_dim,
            "head_dim": head_dim,
            "intermediate_size": 3 * width,
        }

    def validate_codec(self) -> None:
        q = self.quantizer
        _require(self.sample_rate > 0, "codec_config.sample_rate", self.sample_rate, "must be positive")
        _require(
            len(self.encoder_transformer_layers) == len(self.encoder_rates),
            "codec_config.encoder_transformer_layers",
            self.encoder_transformer_layers,
            f"needs one entry per encoder block ({len(self.encoder_rates)})",
        )
        expected_latent = self.encoder_dim * 2 ** len(self.encoder_rates)
        _require(
            self.latent_dim == expected_latent,
            "codec_config.latent_dim",
            self.latent_dim,
            f"must equal encoder_dim * 2**len(encoder_rates) = {expected_latent}",
        )
        _require(
            q["input_dim"] == self.latent_dim,
            "codec_config.quantizer.input_dim",
            q["input_dim"],
            f"must equal latent_dim = {self.latent_dim}",
        )
        _require(
            q["transformer"]["dim"] == self.latent_dim,
            "codec_config.quantizer.transformer.dim",
            q["transformer"]["dim"],
            f"must equal latent_dim = {self.latent_dim}",
        )
        _require(
            self.decoder_dim % 2 ** len(self.decoder_rates) == 0,
            "codec_config.decoder_dim",
            self.decoder_dim,
            f"must be divisible by 2**len(decoder_rates) = {2 ** len(self.decoder_rates)}",
        )
        _require(
            math.prod(self.decoder_rates) * math.prod(q["downsample_factor"]) == self.frame_length,
            "codec_config.decoder_rates",
            self.decoder_rates,
            f"must upsample one frame to frame_length = {self.frame_length} samples",
        )
        for index, layers in enumerate(self.encoder_transformer_layers):
            if layers:
                width = self.encoder_block_width(index)
                _require(
                    width % self.encoder_transformer["head_dim"] == 0,
                    "codec_config.encoder_transformer.head_dim",
                    self.encoder_transformer["head_dim"],
                    f"must divide the width {width} of encoder block {index}",
                )


# --------------------------------------------------------------------------------------------------------------
# Codebook tower
# --------------------------------------------------------------------------------------------------------------

# Tower flags stored in the checkpoint that must hold: key -> (required value, rule text).
_TOWER_FIXED_FLAGS = {
    "decoder_type": ("codebook_mtp_shared", "the only tower kind of Drama 3"),
    "attention_output_gate": (True, "the tower's attention always has an output gate"),
    "layernorm_zero_centered_gamma": (True, "every tower norm is zero-centred (gain 1 + w)"),
    "attention_qkv_bias": (False, "the tower has no biases"),
    "attention_o_bias": (False, "the tower has no biases"),
    "use_moe": (False, "the tower has no MoE"),
    "mtp_use_swa": (False, "the tower has no sliding window"),
    "window_size": (None, "the tower has no sliding window"),
    "vq_feature_scope": ("all_vq", "the only supported scope"),
}
VQ_FEATURE_PLACEMENTS = ("mtp_shared_pre", "backbone_partial")


class Drama3TowerConfig(PreTrainedConfig):
    """The codebook tower (`audio_decoder_config`; docs/format.md#config-rules, docs/format.md#the-codebook-tower):
    4 shared + 9 residual layers.

    `rotary_interleaved` and `attention_qk_norm` are stored by the exporter but ignored: the tower's RoPE is
    always interleaved and its q/k norms always exist.
    """

    model_type = "fish_qwen3_audio_decoder"

    decoder_type: str = "codebook_mtp_shared"
    dim: int = 2048
    text_dim: int = 2048
    n_head: int = 16
    n_local_heads: int = 2
    head_dim: int = 256
    intermediate_size: int = 6144
    norm_eps: float = 1e-6
    num_codebooks: int = 10
    vocab_size: int = 4096
    shared_enrichment_layers: int = 4
    n_layer: int = 4
    max_seq_len: int = 11
    rope_base: float = 1e7
    rotary_percent: float = 0.25
    vq_feature_placement: str = "backbone_partial"
    vq_backbone_codebooks: int = 1
    vq_feature_scope: str = "all_vq"
    rotary_interleaved: bool = True
    attention_qk_norm: bool = False
    attention_output_gate: bool = True
    layernorm_zero_centered_gamma: bool = True
    attention_qkv_bias: bool = False
    attention_o_bias: bool = False
    use_moe: bool = False
    mtp_use_swa: bool = False
    window_size: int | None = None
    dropout: float = 0.0

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_tower()

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates: `head_dim * rotary_percent`."""
        return int(self.head_dim * self.rotary_percent)

    def validate_tower(self) -> None:
        prefix = "audio_decoder_config"
        for key, (required, rule) in _TOWER_FIXED_FLAGS.items():
            value = getattr(self, key)
            _require(value == required, f"{prefix}.{key}", value, f"must be {required!r} ({rule})")
        _require(
            self.n_layer == self.shared_enrichment_layers,
            f"{prefix}.n_layer",
            self.n_layer,
            f"must equal shared_enrichment_layers = {self.shared_enrichment_layers}",
        )
        _require(self.shared_enrichment_layers >= 1, f"{prefix}.shared_enrichment_layers",
                 self.shared_enrichment_layers, "must be at least 1")
        _require(self.num_codebooks >= 2, f"{prefix}.num_codebooks", self.num_codebooks, "must be at least 2")
        _require(
            self.max_seq_len == self.num_codebooks + 1,
            f"{prefix}.max_seq_len",
            self.max_seq_len,
            f"must equal num_codebooks + 1 = {self.num_codebooks + 1}",
        )
        _require(self.dim == self.text_dim, f"{prefix}.dim", self.dim, f"must equal text_dim = {self.text_dim}")
        _require(
            self.n_head % self.n_local_heads == 0,
            f"{prefix}.n_head",
            self.n_head,
            f"must be a multiple of n_local_heads = {self.n_local_heads}",
        )
        rotary = self.head_dim * self.rotary_percent
        _require(
            0 < rotary <= self.head_dim and rotary == int(rotary) and int(rotary) % 2 == 0,
            f"{prefix}.rotary_percent",
            self.rotary_percent,
            f"head_dim * rotary_percent must be an even whole number of dims in (0, head_dim = {self.head_dim}]",
        )
        _require(
            self.vq_feature_placement in VQ_FEATURE_PLACEMENTS,
            f"{prefix}.vq_feature_placement",
            self.vq_feature_placement,
            f"must be one of {VQ_FEATURE_PLACEMENTS}",
        )
        k = self.vq_backbone_codebooks
        if self.vq_feature_placement == "mtp_shared_pre":
            _require(k == 0, f"{prefix}.vq_backbone_codebooks", k, "must be 0 with vq_feature_placement 'mtp_shared_pre'")
        else:
            _require(
                1 <= k <= self.num_codebooks - 1,
                f"{prefix}.vq_backbone_codebooks",
                k,
                f"must be in 1..{self.num_codebooks - 1} with vq_feature_placement 'backbone_partial'",
            )


# --------------------------------------------------------------------------------------------------------------
# The whole model
# --------------------------------------------------------------------------------------------------------------

# Fish-only keys of a "fish_omni_text" config: key -> (check, rule text). They are validated, then dropped.
_FISH_TEXT_KEYS = {
    "rotary_interleaved": (lambda v: v is False, "must be false (the backbone RoPE is the rotate-half kind)"),
    "use_qk_norm": (lambda v: v is True, "must be true"),
    "attn_output_gate": (lambda v: v is True, "must be true"),
    "layernorm_zero_centered_gamma": (lambda v: v is True, "must be true"),
    "shared_expert_gate": (lambda v: v is True, "must be true"),
    "mlp_layer_types": (lambda v: isinstance(v, list) and all(t == "moe" for t in v), 'must be all "moe"'),
}
_TEXT_MODEL_TYPES = ("qwen3_5_moe_text", "fish_omni_text")


def _contains_key(obj: Any, key: str) -> bool:
    if isinstance(obj, dict):
        return any(k == key or _contains_key(v, key) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return any(_contains_key(v, key) for v in obj)
    return False


def text_config_from_dict(text: dict) -> Qwen3_5MoeTextConfig:
    """Build the backbone config from a `text_config` dict, checking and dropping the Fish-only keys."""
    text = copy.deepcopy(text)
    model_type = text.pop("model_type", "qwen3_5_moe_text")
    _require(model_type in _TEXT_MODEL_TYPES, "text_config.model_type", model_type, f"must be one of {_TEXT_MODEL_TYPES}")
    _require(not _contains_key(text, "mrope_section"), "text_config.mrope_section", "present",
             "must be absent (Drama 3 uses plain 1-D positions)")
    num_layers = text.get("num_hidden_layers", Qwen3_5MoeTextConfig.num_hidden_layers)
    for key, (check, rule) in _FISH_TEXT_KEYS.items():
        if key in text:
            value = text.pop(key)
            _require(check(value), f"text_config.{key}", value, rule)
    layer_types = text.get("layer_types")
    if layer_types is not None:
        _require(len(layer_types) == num_layers, "text_config.layer_types", layer_types,
                 f"needs one entry per layer ({num_layers})")
        _require(
            all(t in ("linear_attention", "full_attention") for t in layer_types) and "full_attention" in layer_types,
            "text_config.layer_types",
            layer_types,
            'entries must be "linear_attention" or "full_attention", with at least one full-attention layer',
        )
    rope = text.get("rope_parameters") or {}
    _require(rope.get("rope_type", "default") == "default", "text_config.rope_parameters.rope_type",
             rope.get("rope_type"), 'must be "default"')
    return Qwen3_5MoeTextConfig(**text)


class FishOmniConfig(PreTrainedConfig):
    """Configuration of `FishOmniForSpeech` (Drama 3): backbone + codebook tower + codec.

    Sub-configs: `text_config` (transformers' `Qwen3_5MoeTextConfig`), `audio_decoder_config`
    (`Drama3TowerConfig`) and `codec_config` (`FishDACConfig`, real codec constants unless overridden).
    `sampling_rate` (44 100 Hz) is where `pipeline("text-to-speech")` reads it.
    """

    model_type = "fish_omni"
    locals().update(
        sub_configs_declaration(
            {"text_config": Qwen3_5MoeTextConfig, "audio_decoder_config": Drama3TowerConfig, "codec_config": FishDACConfig}
        )
    )

    text_config: dict | PreTrainedConfig | None = None
    audio_decoder_config: dict | PreTrainedConfig | None = None
    codec_config: dict | PreTrainedConfig | None = None
    fish_schema_version: int = 1
    speech_template_version: str = "reference-bracket-v1"
    semantic_start_token_id: int = 151678
    semantic_end_token_id: int = 155773
    eos_token_id: int = 151645
    tie_word_embeddings: bool = False
    audio_encoder_config: dict | None = None
    extra_samplable_token_ids: list[int] | None = None

    def __post_init__(self, **kwargs):
        if isinstance(self.text_config, dict) or self.text_config is None:
            self.text_config = text_config_from_dict(self.text_config or {})
        if isinstance(self.audio_decoder_config, dict) or self.audio_decoder_config is None:
            self.audio_decoder_config = Drama3TowerConfig(**(self.audio_decoder_config or {}))
        if isinstance(self.codec_config, dict) or self.codec_config is None:
            self.codec_config = FishDACConfig(**(self.codec_config or {}))
        _require(not _contains_key(kwargs, "mrope_section"), "mrope_section", "present",
                 "must be absent (Drama 3 uses plain 1-D positions)")
        super().__post_init__(**kwargs)
        self.validate_drama3()

    @property
    def sampling_rate(self) -> int:
        """Audio sample rate in Hz (read by `pipeline("text-to-speech")`)."""
        return self.codec_config.sample_rate

    @property
    def num_codebooks(self) -> int:
        return self.audio_decoder_config.num_codebooks

    @property
    def codebook_size(self) -> int:
        """Tower vocabulary V (4096): size of the semantic band and of each head."""
        return self.audio_decoder_config.vocab_size

    def validate_drama3(self) -> None:
        """Check the rules of docs/format.md#config-rules that tie the sub-configs together."""
        _require(self.model_type == "fish_omni", "model_type", self.model_type, 'must be "fish_omni"')
        _require(self.fish_schema_version in FISH_SCHEMA_VERSIONS, "fish_schema_version", self.fish_schema_version,
                 f"must be one of {FISH_SCHEMA_VERSIONS}")
        _require(
            self.speech_template_version in SPEECH_TEMPLATE_VERSIONS,
            "speech_template_version",
            self.speech_template_version,
            f"must be one of {SPEECH_TEMPLATE_VERSIONS} (the only prompt format known)",
        )
        _require(not self.audio_encoder_config, "audio_encoder_config", self.audio_encoder_config, "must be absent or empty")
        _require(not self.extra_samplable_token_ids, "extra_samplable_token_ids", self.extra_samplable_token_ids,
                 "must be absent or empty")
        _require(self.tie_word_embeddings is False, "tie_word_embeddings", self.tie_word_embeddings,
                 "must be false (Drama 3 has a separate lm_head)")
        text, tower = self.text_config, self.audio_decoder_config
        vocab = tower.vocab_size
        band = self.semantic_end_token_id - self.semantic_start_token_id + 1
        _require(
            band == vocab,
            "semantic_end_token_id",
            self.semantic_end_token_id,
            f"the semantic band [{self.semantic_start_token_id}, {self.semantic_end_token_id}] has {band} ids but "
            f"audio_decoder_config.vocab_size is {vocab}; they must be equal",
        )
        _require(
            0 <= self.semantic_start_token_id and self.semantic_end_token_id < text.vocab_size,
            "semantic_end_token_id",
            self.semantic_end_token_id,
            f"the semantic band must lie inside the text vocabulary (text_config.vocab_size = {text.vocab_size})",
        )
        eos = self.eos_token_id
        _require(isinstance(eos, int) and 0 <= eos < text.vocab_size, "eos_token_id", eos,
                 f"must be one id inside the text vocabulary ({text.vocab_size})")
        _require(
            not self.semantic_start_token_id <= eos <= self.semantic_end_token_id,
            "eos_token_id",
            eos,
            f"must lie outside the semantic band [{self.semantic_start_token_id}, {self.semantic_end_token_id}]",
        )
        _require(tower.dim == text.hidden_size, "audio_decoder_config.dim", tower.dim,
                 f"must equal text_config.hidden_size = {text.hidden_size}")
        for tower_key, text_key in (
            ("n_head", "num_attention_heads"),
            ("n_local_heads", "num_key_value_heads"),
            ("head_dim", "head_dim"),
        ):
            _require(
                getattr(tower, tower_key) == getattr(text, text_key),
                f"audio_decoder_config.{tower_key}",
                getattr(tower, tower_key),
                f"must equal text_config.{text_key} = {getattr(text, text_key)}",
            )
        _require(
            self.codec_config.quantizer["semantic_codebook_size"] == vocab,
            "codec_config.quantizer.semantic_codebook_size",
            self.codec_config.quantizer["semantic_codebook_size"],
            f"must equal audio_decoder_config.vocab_size = {vocab}",
        )
        _require(
            self.codec_config.num_codebooks == tower.num_codebooks,
            "codec_config.quantizer.n_codebooks",
            self.codec_config.quantizer["n_codebooks"],
            f"must equal audio_decoder_config.num_codebooks - 1 = {tower.num_codebooks - 1}",
        )


__all__ = ["Drama3ConfigError", "Drama3TowerConfig", "FishDACConfig", "FishOmniConfig"]
