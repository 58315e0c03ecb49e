"""Loading the original Drama 3 layout: golden checkpoint, FP8 dequantisation, the tiny writer, bad checkpoints."""

import json
import logging
import pickle
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoTokenizer, PreTrainedModel

from transformers_drama3 import Drama3CheckpointError, FishDACCodec, FishOmniForSpeech
from transformers_drama3.codec_layout import FishDACLoadError
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig
from transformers_drama3.quantized_experts import Fp8SelectedExperts
from transformers_drama3.testing import quantize_fp8_blockwise, write_tiny_checkpoint

from .conftest import GOLDEN_TINY


def _load(path, **kwargs):
    model, info = FishOmniForSpeech.from_pretrained(path, output_loading_info=True, **kwargs)
    return model, info


def _assert_complete(info):
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]


@pytest.fixture(scope="module")
def golden_fp32():
    model, info = _load(GOLDEN_TINY, dtype=torch.float32, quantization_config=BsgemmMoeConfig(dequantize=True))
    _assert_complete(info)
    model.config.text_config._experts_implementation = "eager"  # as the golden reference ran
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_golden_loads_with_no_missing_or_unexpected_keys(dtype):
    model, info = _load(GOLDEN_TINY, dtype=dtype)
    _assert_complete(info)
    assert model.backbone.norm.weight.dtype == dtype
    assert model.tower.heads[0].weight.dtype == dtype
    # The codec stays float32 whatever the model dtype (precision-sensitive, small), a transformers sub-model whose
    # config is the model's own `codec_config`.
    assert {p.dtype for p in model.codec.parameters()} == {torch.float32}
    assert isinstance(model.codec, FishDACCodec) and model.codec.config is model.config.codec_config
    # The routed experts stay FP8 as shipped (no GPU kernel here), everything else has the load's dtype.
    fp8 = {name for name, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert fp8 == {f"backbone.layers.{i}.mlp.experts.{proj}" for i in range(4) for proj in ("gate_up_proj", "down_proj")}
    assert all(isinstance(layer.mlp.experts, Fp8SelectedExperts) for layer in model.backbone.layers)


def test_automodel_gives_the_drama3_class():
    model = AutoModel.from_pretrained(GOLDEN_TINY)
    assert isinstance(model, FishOmniForSpeech)


def test_choosing_an_attention_kernel_leaves_the_codec_alone_without_warnings(caplog):
    """The codec is a sub-model that declares the kernels it accepts (it keeps its own windowed attention), so
    transformers finds the sub-model of `codec_config` and warns about nothing, at load or when switching."""
    with caplog.at_level(logging.WARNING):
        model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, attn_implementation="eager")
        model.set_attn_implementation("sdpa")
        model.set_attn_implementation("eager")
    assert model.config.codec_config._attn_implementation == "eager"
    assert "codec" not in caplog.text and "FishDAC" not in caplog.text


def test_tokenizer_of_the_checkpoint_loads():
    tokenizer = AutoTokenizer.from_pretrained(GOLDEN_TINY)
    assert tokenizer.convert_tokens_to_ids("<|semantic:0|>") == 421
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 401


def test_dequantised_experts_equal_fp8_times_scale(golden_fp32, expected):
    """Bit-equal float32: W[i, j] = float(W8[i, j]) * scale_inv[i // 128, j // 128] (docs/format.md#fp8-experts)."""
    experts = golden_fp32.backbone.layers[0].mlp.experts
    inter = expected["dequant_l0_e1_gate_proj"].shape[0]
    assert torch.equal(experts.gate_up_proj[1, :inter], expected["dequant_l0_e1_gate_proj"])
    assert torch.equal(experts.gate_up_proj[1, inter:], expected["dequant_l0_e1_up_proj"])
    assert torch.equal(experts.down_proj[1], expected["dequant_l0_e1_down_proj"])


def test_every_expert_is_dequantised_block_by_block(golden_fp32):
    """Independent formulation: re-dequantise every expert tensor from the files with explicit block loops."""
    tensors = {}
    for shard in sorted(GOLDEN_TINY.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    layers = golden_fp32.backbone.layers
    for layer_index, layer in enumerate(layers):
        experts = layer.mlp.experts
        inter = experts.down_proj.shape[-1]
        for expert in range(experts.gate_up_proj.shape[0]):
            for proj, ours in (
                ("gate_proj", experts.gate_up_proj[expert, :inter]),
                ("up_proj", experts.gate_up_proj[expert, inter:]),
                ("down_proj", experts.down_proj[expert]),
            ):
                name = f"model.language_model.layers.{layer_index}.mlp.experts.{expert}.{proj}.weight"
                fp8, scale = tensors[name].float(), tensors[name + "_scale_inv"]
                reference = torch.empty_like(fp8)
                for bi in range(scale.shape[0]):
                    for bj in range(scale.shape[1]):
                        block = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
                        reference[block] = fp8[block] * scale[bi, bj]
                assert torch.equal(ours, reference), name


def test_backbone_final_norm_hidden_states_match_golden(golden_fp32, expected):
    """Tolerance from the golden README: atol 1e-4, rtol 1e-4 (2x the float32 noise of two references)."""
    rows = expected["tf_input_embeds"].shape[0]
    with torch.no_grad():
        out = golden_fp32.backbone(inputs_embeds=expected["tf_input_embeds"][None], position_ids=torch.arange(rows)[None])
    torch.testing.assert_close(out.last_hidden_state[0], expected["tf_hidden"], atol=1e-4, rtol=1e-4)


def test_parameters_land_in_their_final_places(golden_fp32):
    tensors = {}
    for shard in sorted(GOLDEN_TINY.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    pairs = {
        "lm_head.weight": golden_fp32.lm_head.weight,
        "audio_decoder.codebook_embeddings.weight": golden_fp32.tower.codebook_embeddings.weight,
        "audio_decoder_mtp_shared.layers.1.transformer_layer.attention.wqkv.weight":
            golden_fp32.tower.shared_layers[1].transformer_layer.attention.wqkv.weight,
        "audio_decoder_mtp.layers.8.codebook_embedding.weight": golden_fp32.tower.residual_layers[8].codebook_embedding.weight,
        "audio_decoder_mtp.heads.3.weight": golden_fp32.tower.heads[3].weight,
        "model.language_model.layers.3.self_attn.q_norm.weight": golden_fp32.backbone.layers[3].self_attn.q_norm.weight,
    }
    for name, parameter in pairs.items():
        assert torch.equal(parameter, tensors[name].float()), name


# ---------------------------------------------------------------------------------------------------------------
# The tiny checkpoint writer
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


def test_written_checkpoint_has_the_original_layout(written):
    config = json.load(open(f"{written}/config.json"))
    assert config["model_type"] == "fish_omni" and config["text_config"]["model_type"] == "fish_omni_text"
    assert config["quantization_config"]["quant_method"] == "bsgemm-moe"
    index = json.load(open(f"{written}/model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    name = "model.language_model.layers.0.mlp.experts.1.gate_proj.weight"
    with safe_open(f"{written}/{index['weight_map'][name]}", framework="pt") as f:
        assert f.get_tensor(name).dtype == torch.float8_e4m3fn
        assert f.get_tensor(name + "_scale_inv").dtype == torch.float32
    golden_names = set(json.load(open(GOLDEN_TINY / "model.safetensors.index.json"))["weight_map"])
    assert set(index["weight_map"]) == golden_names
    codec = torch.load(f"{written}/codec.pth", weights_only=True)
    golden_codec = torch.load(GOLDEN_TINY / "codec.pth", weights_only=True)
    assert set(codec) == set(golden_codec)
    tokenizer = AutoTokenizer.from_pretrained(written)
    assert tokenizer.convert_tokens_to_ids("<|semantic:0|>") == config["semantic_start_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == config["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|speaker:15|>") != tokenizer.unk_token_id


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_checkpoint_loads_like_the_golden_one(written, dtype):
    model, info = _load(written, dtype=dtype)
    _assert_complete(info)
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())


def test_writer_is_deterministic_per_seed(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=7)
    b = write_tiny_checkpoint(tmp_path / "b", seed=7)
    for shard in sorted((tmp_path / "a").glob("*.safetensors")):
        assert (tmp_path / "b" / shard.name).read_bytes() == shard.read_bytes()
    assert a != b


@pytest.mark.parametrize("k", [0, 2])
def test_writer_supports_every_vq_backbone_codebooks(tmp_path, k):
    placement = "mtp_shared_pre" if k == 0 else "backbone_partial"
    path = write_tiny_checkpoint(
        tmp_path, audio_decoder_config={"vq_backbone_codebooks": k, "vq_feature_placement": placement}
    )
    model, info = _load(path)
    _assert_complete(info)
    assert model.config.audio_decoder_config.vq_backbone_codebooks == k


def test_fp8_blockwise_quantisation_round_trip():
    weight = torch.randn(300, 200) * torch.linspace(0.01, 3, 200)
    fp8, scale = quantize_fp8_blockwise(weight)
    assert scale.shape == (3, 2)
    restored = fp8.float() * scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of each block's largest magnitude.
    block_max = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200] * 448
    assert ((restored - weight).abs() <= block_max / 16 + 1e-12).all()


# ---------------------------------------------------------------------------------------------------------------
# Bad checkpoints: clear errors before any weight is read
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def golden_copy(tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(GOLDEN_TINY, target)
    for path in target.iterdir():
        path.chmod(0o644)
    return target


def _rewrite_shard(directory, edit):
    """Apply `edit(tensors)` to the shard holding the first weights and save it back."""
    shard = directory / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_missing_shard(golden_copy):
    (golden_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(Drama3CheckpointError, match="model-00002-of-00002.safetensors"):
        FishOmniForSpeech.from_pretrained(golden_copy)


def _drop_first(suffix):
    def edit(tensors):
        del tensors[next(k for k in tensors if k.endswith(suffix))]

    return edit


def _shrink_first(suffix):
    def edit(tensors):
        name = next(k for k in tensors if k.endswith(suffix))
        tensors[name] = tensors[name][:-1].clone()

    return edit


@pytest.mark.parametrize(
    "edit,message",
    [
        (_drop_first("input_layernorm.weight"), "missing tensors.*input_layernorm"),
        (_shrink_first("post_attention_layernorm.weight"),
         r"post_attention_layernorm.weight has shape \[255\], expected \[256\]"),
        (_drop_first("_scale_inv"), "FP8 tensors without their `weight_scale_inv`"),
    ],
    ids=["missing-tensor", "wrong-shape", "fp8-without-scale"],
)
def test_bad_tensors_are_refused_before_loading(golden_copy, edit, message):
    _rewrite_shard(golden_copy, edit)
    with pytest.raises(Drama3CheckpointError, match=message):
        FishOmniForSpeech.from_pretrained(golden_copy)


def test_unknown_tensor(golden_copy):
    _rewrite_shard(golden_copy, lambda tensors: tensors.update({"audio_decoder_mtp.heads.99.weight": torch.zeros(2)}))
    with pytest.raises(Drama3CheckpointError, match="does not describe.*heads.99"):
        FishOmniForSpeech.from_pretrained(golden_copy)


def test_missing_codec_file(golden_copy):
    (golden_copy / "codec.pth").unlink()
    with pytest.raises(Drama3CheckpointError, match="codec.pth"):
        FishOmniForSpeech.from_pretrained(golden_copy)


class _Exploit:
    def __reduce__(self):
        return (print, ("pickle payload executed",))


def test_codec_pth_with_a_pickled_object_is_refused(golden_copy, capsys):
    state = torch.load(golden_copy / "codec.pth", weights_only=True)
    state["payload"] = _Exploit()
    with open(golden_copy / "codec.pth", "wb") as f:
        pickle.dump(state, f, protocol=2)  # torch.save's protocol: the file looks like a checkpoint but holds an object
    with pytest.raises(Exception) as error:
        FishOmniForSpeech.from_pretrained(golden_copy)
    assert "pickle payload executed" not in capsys.readouterr().out
    assert "codec.pth" in str(error.value)


def test_a_codec_pth_that_does_not_fit_the_config_is_refused_before_the_weights_load(golden_copy, monkeypatch):
    state = torch.load(golden_copy / "codec.pth", weights_only=True)
    del state["decoder.model.6.conv.bias"]
    torch.save(state, golden_copy / "codec.pth")
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(FishDACLoadError, match="decoder.model.6.conv.bias"):
        FishOmniForSpeech.from_pretrained(golden_copy)


def test_codec_pth_that_is_not_a_state_dict_is_refused(golden_copy):
    torch.save([torch.zeros(3)], golden_copy / "codec.pth")
    with pytest.raises(Exception, match="state dict"):
        FishOmniForSpeech.from_pretrained(golden_copy)
