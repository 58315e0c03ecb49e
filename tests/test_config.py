"""Config loading, round trips and the validation rules of docs/format.md ("Config rules") (each bad config names key, value and rule)."""

import copy
import json

import pytest
from transformers import AutoConfig, Qwen3_5MoeTextConfig

from transformers_drama3 import Drama3ConfigError, FishDACConfig, FishOmniConfig

from .conftest import GOLDEN_TINY


@pytest.fixture
def golden_dict():
    with open(GOLDEN_TINY / "config.json") as f:
        return json.load(f)


def test_golden_config_loads_with_autoconfig():
    config = AutoConfig.from_pretrained(GOLDEN_TINY)
    assert isinstance(config, FishOmniConfig)
    assert type(config.text_config) is Qwen3_5MoeTextConfig
    assert config.text_config.model_type == "qwen3_5_moe_text"
    assert config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    # Fish-only keys are dropped from the backbone config.
    for key in ("rotary_interleaved", "use_qk_norm", "attn_output_gate", "mlp_layer_types"):
        assert not hasattr(config.text_config, key)
    assert config.sampling_rate == 44100
    assert config.audio_decoder_config.vq_backbone_codebooks == 1
    assert config.codec_config.encoder_dim == 4 and config.codec_config.frame_length == 2048
    assert config.get_text_config() is config.text_config


def test_plain_qwen_text_config_is_accepted(golden_dict):
    text = golden_dict["text_config"]
    for key in ("rotary_interleaved", "use_qk_norm", "attn_output_gate", "layernorm_zero_centered_gamma",
                "shared_expert_gate", "mlp_layer_types"):
        text.pop(key)
    text["model_type"] = "qwen3_5_moe_text"
    config = FishOmniConfig(**golden_dict)
    assert config.text_config.hidden_size == 256


def test_round_trip_save_pretrained(tmp_path, golden_dict):
    config = FishOmniConfig(**golden_dict)
    config.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)
    drop_path = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert drop_path(again) == drop_path(config)
    assert again.codec_config.quantizer == config.codec_config.quantizer


def test_codec_defaults_are_the_real_codec():
    codec = FishDACConfig()
    assert codec.sample_rate == 44100 and codec.frame_length == 2048 and codec.hop_length == 512
    assert codec.codebook_sizes == [4096] + [1024] * 9
    assert codec.encoder_transformer_shape(3) == {
        "n_layer": 4, "dim": 1024, "n_head": 16, "head_dim": 64, "intermediate_size": 3072
    }
    assert codec.quantizer["transformer"]["n_layer"] == 8 and codec.decoder_dim == 1536


def test_partial_codec_override_keeps_other_defaults():
    codec = FishDACConfig(quantizer={"transformer": {"n_layer": 2}})
    assert codec.quantizer["transformer"]["n_layer"] == 2
    assert codec.quantizer["transformer"]["dim"] == 1024 and codec.quantizer["codebook_size"] == 1024


def _set(d, dotted, value):
    *parents, last = dotted.split(".")
    for key in parents:
        d = d[key]
    if value is _DELETE:
        del d[last]
    else:
        d[last] = value


_DELETE = object()

BAD_CONFIGS = [
    # (dotted key, value, text that must appear in the error)
    ("model_type", "qwen3_5_moe", "model_type"),
    ("speech_template_version", "reference-bracket-v9", "speech_template_version"),
    ("fish_schema_version", 2, "fish_schema_version"),
    ("semantic_end_token_id", 480, "vocab_size"),  # band of 60 ids vs tower vocab 64
    ("eos_token_id", 430, "outside the semantic band"),
    ("text_config.rope_parameters.mrope_section", [8, 12, 12], "mrope_section"),
    ("audio_decoder_config.vq_backbone_codebooks", 0, "vq_backbone_codebooks"),  # backbone_partial needs 1..9
    ("audio_decoder_config.vq_backbone_codebooks", 10, "vq_backbone_codebooks"),
    ("audio_decoder_config.vq_feature_placement", "somewhere", "vq_feature_placement"),
    ("audio_decoder_config.n_head", 4, "num_attention_heads"),
    ("audio_decoder_config.n_local_heads", 2, "n_local_heads"),
    ("audio_decoder_config.head_dim", 64, "head_dim"),
    ("audio_decoder_config.n_layer", 3, "shared_enrichment_layers"),
    ("audio_decoder_config.max_seq_len", 12, "max_seq_len"),
    ("audio_decoder_config.attention_output_gate", False, "attention_output_gate"),
    ("audio_decoder_config.use_moe", True, "use_moe"),
    ("audio_decoder_config.decoder_type", "mtp", "decoder_type"),
    ("text_config.rotary_interleaved", True, "rotary_interleaved"),
    ("text_config.layernorm_zero_centered_gamma", False, "layernorm_zero_centered_gamma"),
    ("text_config.mlp_layer_types", ["moe", "dense", "moe", "moe"], "mlp_layer_types"),
    ("text_config.model_type", "llama", "text_config.model_type"),
    ("audio_encoder_config", {"dim": 4}, "audio_encoder_config"),
    ("extra_samplable_token_ids", [3], "extra_samplable_token_ids"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
    ("codec_config.quantizer.semantic_codebook_size", 128, "semantic_codebook_size"),
    ("codec_config.latent_dim", 32, "latent_dim"),
]


@pytest.mark.parametrize("key,value,needle", BAD_CONFIGS, ids=[f"{k}={v}" for k, v, _ in BAD_CONFIGS])
def test_bad_config_is_refused_with_key_and_rule(golden_dict, key, value, needle):
    bad = copy.deepcopy(golden_dict)
    _set(bad, key, value)
    with pytest.raises(Drama3ConfigError) as error:
        FishOmniConfig(**bad)
    message = str(error.value)
    assert needle in message and "breaks the rule" in message


def test_mtp_shared_pre_with_k0_is_valid(golden_dict):
    golden_dict["audio_decoder_config"].update(vq_feature_placement="mtp_shared_pre", vq_backbone_codebooks=0)
    assert FishOmniConfig(**golden_dict).audio_decoder_config.vq_backbone_codebooks == 0


def test_mtp_shared_pre_needs_k0(golden_dict):
    golden_dict["audio_decoder_config"].update(vq_feature_placement="mtp_shared_pre", vq_backbone_codebooks=1)
    with pytest.raises(Drama3ConfigError, match="vq_backbone_codebooks"):
        FishOmniConfig(**golden_dict)


def test_bad_config_file_fails_before_weights_are_read(tmp_path, golden_dict):
    """A wrong model_type in config.json stops `from_pretrained` before any weight file is opened."""
    from transformers_drama3 import FishOmniForSpeech

    golden_dict["speech_template_version"] = "unknown-v2"
    (tmp_path / "config.json").write_text(json.dumps(golden_dict))
    # No weight files at all: reaching them would be a different error.
    with pytest.raises(Drama3ConfigError, match="speech_template_version"):
        FishOmniForSpeech.from_pretrained(tmp_path)
