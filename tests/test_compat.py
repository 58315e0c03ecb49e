"""One test per transformers-version shim of `compat` (run on 5.17 and on the newest version): each fails if the shim
takes the branch of the other version."""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.distributed import DistributedConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

from transformers_drama3 import FishOmniConfig, FishOmniForSpeech, compat
from transformers_drama3.configuration_drama3 import Drama3TowerConfig, FishDACConfig
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig

from .conftest import GOLDEN_TINY
from .tolerances import reordering_tolerance


@pytest.fixture(scope="module")
def tiny_backbone():
    """A randomly initialised backbone of the golden tiny geometry (4 layers, linear and full attention)."""
    torch.manual_seed(0)
    return Qwen3_5MoeTextModel(FishOmniConfig.from_pretrained(GOLDEN_TINY).text_config).eval()


def _checkpointing(model: nn.Module) -> bool:
    """Whether any layer of `model` recomputes its activations (the flag every transformers version sets)."""
    return any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


# --------------------------------------------------------------------------------------------------------------
# Modeling
# --------------------------------------------------------------------------------------------------------------


def test_the_backbone_takes_its_cache_under_the_shims_name(tiny_backbone):
    """The cache must hold the 3 rows afterwards, and the name must not be a deprecated alias (5.24 still accepts
    `past_key_values`, with a FutureWarning)."""
    cache = DynamicCache(config=tiny_backbone.config)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        tiny_backbone(inputs_embeds=torch.randn(1, 3, tiny_backbone.config.hidden_size), position_ids=torch.arange(3)[None],
                      use_cache=True, **{compat.backbone_cache_argument(): cache})
    assert cache.get_seq_length() == 3


def test_the_linear_attention_shims_read_and_advance_the_states_transformers_layer_keeps(tiny_backbone):
    """After a 3-row prefill, `one_token_state` is the state the cache holds for a linear-attention layer (None with
    no state), `one_token_convolution` of a 4th row continues the convolution the prefill started (equal to a
    convolution of the 4 rows at once), and the layer's cache is found under either keyword."""
    config = tiny_backbone.config
    layer, norm = tiny_backbone.layers[0].linear_attn, tiny_backbone.layers[0].input_layernorm
    assert compat.one_token_state(layer, DynamicCache(config=config)) is None
    assert compat.one_token_state(layer, None) is None
    cache, embeds = DynamicCache(config=config), torch.randn(1, 4, config.hidden_size)
    with torch.no_grad():
        tiny_backbone(inputs_embeds=embeds[:, :3], position_ids=torch.arange(3)[None], use_cache=True,
                      **{compat.backbone_cache_argument(): cache})
        state = compat.one_token_state(layer, cache)
        mixed = layer.in_proj_qkv(norm(embeds)).transpose(1, 2)  # [1, channels, 4] the layer's convolution input
        convolved = compat.one_token_convolution(layer, mixed[..., 3:], cache)  # [1, channels, 1]
        at_once = F.silu(F.conv1d(mixed, layer.conv1d.weight, padding=layer.conv_kernel_size - 1,
                                  groups=layer.conv_dim)[..., 3:4])
    assert state.shape == (1, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    assert state.abs().max() > 0
    # The same 4 products per channel, summed in another order (then silu, |silu'| <= 1.1): float32 reordering.
    torch.testing.assert_close(convolved, at_once, **reordering_tolerance(at_once, 2 * layer.conv_kernel_size))
    assert compat.linear_attention_cache((), {"cache": cache}) is cache
    assert compat.linear_attention_cache((), {"cache_params": cache}) is cache
    assert compat.linear_attention_cache((cache,), {}) is cache
    assert compat.linear_attention_cache((), {}) is None


def test_sub_configs_are_declared_as_the_installed_transformers_reads_them(tmp_path):
    config = FishOmniConfig.from_pretrained(GOLDEN_TINY)
    assert set(config.sub_configs) == {"text_config", "audio_decoder_config", "codec_config"}
    config._attn_implementation = "eager"  # transformers hands it down to every declared sub-config
    assert {sub._attn_implementation for sub in (config.text_config, config.audio_decoder_config,
                                                 config.codec_config)} == {"eager"}
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["codec_config"]["model_type"] == "fish_dac"
    reloaded = FishOmniConfig.from_pretrained(tmp_path)
    assert isinstance(reloaded.audio_decoder_config, Drama3TowerConfig)
    assert reloaded.codec_config.to_dict() == config.codec_config.to_dict() and isinstance(reloaded.codec_config,
                                                                                          FishDACConfig)


# --------------------------------------------------------------------------------------------------------------
# A pre-quantised (FP8) checkpoint dequantised while loading
# --------------------------------------------------------------------------------------------------------------


def _load_config(dtype, pre_quantized=True, dequantize=True):
    quantizer = SimpleNamespace(pre_quantized=pre_quantized, quantization_config=SimpleNamespace(dequantize=dequantize))
    return SimpleNamespace(hf_quantizer=quantizer, dtype=dtype)


def test_cast_dequantised_weights_gives_every_weight_the_requested_dtype():
    def mixed():
        return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16), nn.Embedding(3, 2))

    model = mixed()
    compat.cast_dequantised_weights(model, _load_config(torch.float32))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for untouched in (_load_config(None), _load_config(torch.float32, pre_quantized=False),
                      SimpleNamespace(hf_quantizer=None, dtype=None)):
        model = mixed()
        compat.cast_dequantised_weights(model, untouched)
        assert {p.dtype for p in model.parameters()} == {torch.float32, torch.bfloat16}
    # FP8 experts kept as shipped: the other weights take the dtype, the FP8 bytes and their float32 scales stay.
    model = mixed()
    model.register_parameter("gate_up_proj", nn.Parameter(torch.zeros(2, 2, dtype=torch.float8_e4m3fn), requires_grad=False))
    model.register_parameter("gate_up_proj_scale_inv", nn.Parameter(torch.ones(1, 1)))
    compat.cast_dequantised_weights(model, _load_config(torch.bfloat16, dequantize=False))
    assert {name: p.dtype for name, p in model.named_parameters() if "proj" in name} == {
        "gate_up_proj": torch.float8_e4m3fn, "gate_up_proj_scale_inv": torch.float32}
    assert model[0].weight.dtype == torch.bfloat16


def test_the_dtype_shim_runs_exactly_where_transformers_needs_it(monkeypatch):
    """The golden FP8 checkpoint loaded in float32: every weight is float32 with the shim; without it, some weights
    stay in the checkpoint's bf16 exactly on the versions the shim says."""
    dequantised = BsgemmMoeConfig(dequantize=True)
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, quantization_config=dequantised)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    kept = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32)  # FP8 experts kept: the rest float32
    assert {p.dtype for p in kept.parameters()} == {torch.float32, torch.float8_e4m3fn}

    monkeypatch.setattr(compat, "cast_dequantised_weights", lambda model, load_config: None)
    unfixed = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, quantization_config=dequantised)
    kept_bf16 = any(p.dtype == torch.bfloat16 for p in unfixed.parameters())
    assert kept_bf16 == compat.dequantised_weights_keep_checkpoint_dtype()


def test_kept_fp8_experts_save_where_their_scales_keep_their_shape(tmp_path):
    """Where the shim says so the save round trip is exact (tests/test_save_pretrained.py); elsewhere it is refused
    before anything is written."""
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.bfloat16)
    if compat.kept_fp8_scales_save_with_their_shape():
        model.save_pretrained(tmp_path)
        assert FishOmniForSpeech.from_pretrained(tmp_path).backbone.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    else:
        with pytest.raises(NotImplementedError, match="saving FP8 experts kept as shipped needs a newer transformers"):
            model.save_pretrained(tmp_path)
        assert not list(tmp_path.glob("*.safetensors"))


def test_a_dequantised_model_keeps_no_loading_conversions(tmp_path):
    """Saving reverses the plain mapping only: the FP8 dequantisation is not undone (5.17 would fail on it)."""
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32,
                                              quantization_config=BsgemmMoeConfig(dequantize=True))
    assert "_weight_conversions" not in vars(model)
    model.save_pretrained(tmp_path)  # raised "Undefined Operation encountered!" on 5.17 without the shim

    holder = SimpleNamespace(_weight_conversions=["recorded while loading"])
    compat.forget_loading_conversions(holder)
    assert not hasattr(holder, "_weight_conversions")
    compat.forget_loading_conversions(holder)  # nothing recorded: nothing to do


# --------------------------------------------------------------------------------------------------------------
# Training and parallelism
# --------------------------------------------------------------------------------------------------------------


def test_activation_checkpointing_is_switched_under_the_installed_name_without_warnings(tiny_backbone):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old names warn (FutureWarning) where the new ones exist
        compat.enable_activation_checkpointing(tiny_backbone, checkpointing_kwargs={"use_reentrant": False})
        assert _checkpointing(tiny_backbone)
        compat.disable_activation_checkpointing(tiny_backbone)
        assert not _checkpointing(tiny_backbone)


def test_checkpointing_training_arguments_are_accepted_without_warnings(tmp_path):
    from transformers import TrainingArguments

    arguments = compat.checkpointing_training_arguments(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        training = TrainingArguments(output_dir=str(tmp_path), report_to=[], **arguments)
    assert training.gradient_checkpointing is True  # the old name mirrors the new one on newer versions


def test_expert_parallel_arguments_build_a_distributed_config():
    """5.17 refuses `ep_size` (TypeError); 5.24 still takes `enable_expert_parallel` alone, with a FutureWarning (and
    then shards nothing along experts)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = DistributedConfig(tp_size=2, tp_plan="auto", **compat.expert_parallel_arguments(2))
    assert config.enable_expert_parallel is True and getattr(config, "ep_size", 2) == 2


def test_generation_defaults_are_transformers_global_defaults():
    """A pipeline that fills transformers' global defaults into a generation config sets nothing: `generate` takes
    such a config (top_k 50 and num_beams 1 among them) without changing Drama 3's settings."""
    from transformers import GenerationConfig

    from transformers_drama3.generation import DRAMA3_GENERATION_DEFAULTS, generation_settings

    defaults = compat.generation_defaults()
    assert defaults["top_k"] == 50 and defaults["num_beams"] == 1
    filled = GenerationConfig(**DRAMA3_GENERATION_DEFAULTS)
    filled.update(**defaults, defaults_only=True)  # what the text-to-audio pipeline of transformers 5.17 does
    settings = generation_settings(GenerationConfig(**DRAMA3_GENERATION_DEFAULTS), filled)
    assert settings.top_k == 0 and settings.top_p == 0.9 and settings.do_sample is True


def test_generation_values_copied_into_the_model_config_are_dropped():
    """transformers 5.17's text-to-audio pipeline copies the generation config into the model config, which
    `generate` then refuses as legacy generation control: the copied values go, a value set otherwise stays."""
    from transformers import GenerationConfig, PretrainedConfig

    config = PretrainedConfig()
    config.update({"top_p": 0.9, "temperature": 0.5})
    compat.drop_generation_values_copied_into_config(config, GenerationConfig(top_p=0.9, temperature=1.0))
    assert config._get_generation_parameters() == {"temperature": 0.5}
