"""`save_pretrained` round trips: what is written, and that `from_pretrained(saved)` (no flag) gives the same outputs.

Tolerance: exact equality. The weights are written in the model's own dtype and read back without any conversion
(dequantised FP8 experts are saved dequantised, kept ones as shipped), and the same computation runs on them.
"""

import json

import pytest
import torch
from safetensors import safe_open

from transformers_drama3 import FishOmniForSpeech, compat
from transformers_drama3.codec_file import original_codec_key_shapes
from transformers_drama3.codec_layout import FishDACLoadError, load_codec_state_dict, load_codec_weights
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig
from transformers_drama3.testing import write_tiny_checkpoint

from .conftest import GOLDEN_TINY


DEQUANTISED = BsgemmMoeConfig(dequantize=True)


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory):
    """A bf16 checkpoint in the original layout without FP8 experts (no quantization_config)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("plain"), seed=0, quantization_config=None)


def _tensor_names(directory) -> dict[str, str]:
    """Name -> safetensors dtype of every tensor in the saved shards."""
    names = {}
    for shard in directory.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            names.update({key: f.get_slice(key).get_dtype() for key in f.keys()})
    return names


def _assert_same_outputs(model, reloaded, prompt):
    with torch.no_grad():
        before, after = model(prompt), reloaded(prompt)
    assert torch.equal(before.main_logits, after.main_logits)
    assert torch.equal(before.codebook_logits, after.codebook_logits)
    codes = prompt[0, 4:, 1:].T[None]  # [1, NCB, 6]
    assert torch.equal(model.codec.decode(codes).audio_values[:, 0], reloaded.codec.decode(codes).audio_values[:, 0])


@pytest.mark.parametrize(
    "source, dtype",
    [("fp8", torch.float32), ("fp8", torch.bfloat16), ("plain", torch.bfloat16)],
    ids=["dequantised-fp8-float32", "dequantised-fp8-bfloat16", "bf16-checkpoint"],
)
def test_round_trip_gives_identical_outputs(source, dtype, plain_checkpoint, prompt, tmp_path):
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY if source == "fp8" else plain_checkpoint, dtype=dtype,
                                              quantization_config=DEQUANTISED if source == "fp8" else None)
    model.save_pretrained(tmp_path)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("quantization_config") is None  # the experts were written dequantised
    assert config["dtype"] == str(dtype).removeprefix("torch.")
    names = _tensor_names(tmp_path)
    original = json.loads((GOLDEN_TINY / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(names) == {name for name in original if not name.endswith("_scale_inv")}  # original names
    assert set(names.values()) == {"F32" if dtype == torch.float32 else "BF16"}
    codec_state = load_codec_state_dict(tmp_path / "codec.pth")
    assert codec_state.keys() == original_codec_key_shapes(model.codec.config).keys()  # the original layout

    # the saved dtype, asked for: without a GPU a load without `dtype` is float32 (docs/usage.md#loading)
    reloaded, info = FishOmniForSpeech.from_pretrained(tmp_path, dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert reloaded.lm_head.weight.dtype == dtype and next(reloaded.codec.parameters()).dtype == torch.float32
    _assert_same_outputs(model, reloaded, prompt)


def test_module_name_layout_loads_too(prompt, tmp_path):
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, quantization_config=DEQUANTISED)
    model.save_pretrained(tmp_path, save_original_format=False)
    assert "backbone.layers.0.mlp.experts.gate_up_proj" in _tensor_names(tmp_path)
    _assert_same_outputs(model, FishOmniForSpeech.from_pretrained(tmp_path), prompt)


def test_an_offloaded_model_saves_what_it_computes_with(prompt, tmp_path):
    model = FishOmniForSpeech.from_pretrained(
        GOLDEN_TINY, dtype=torch.float32, device_map={"": "disk"}, offload_folder=tmp_path / "offload",
        quantization_config=DEQUANTISED,
    )
    with pytest.warns(UserWarning, match="offloaded modules"):
        model.save_pretrained(tmp_path / "saved")
    _assert_same_outputs(model, FishOmniForSpeech.from_pretrained(tmp_path / "saved"), prompt)


def test_fp8_experts_kept_as_shipped_are_saved_as_shipped(tmp_path, prompt):
    """A model whose experts stayed FP8 writes them back in the checkpoint's own layout (one FP8 tensor and its
    block scales per expert, `bsgemm-moe` in config.json), and loads back to the same bytes."""
    if not compat.kept_fp8_scales_save_with_their_shape():
        pytest.skip("this transformers refuses the save (tests/test_compat.py checks the refusal)")
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "bsgemm-moe"
    original = json.loads((GOLDEN_TINY / "model.safetensors.index.json").read_text())["weight_map"]
    names = _tensor_names(tmp_path)
    assert set(names) == set(original)
    assert {dtype for name, dtype in names.items() if ".mlp.experts." in name} == {"F8_E4M3", "F32"}
    reloaded = FishOmniForSpeech.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    _assert_same_outputs(model, reloaded, prompt)


# ---------------------------------------------------------------------------------------------------------------
# codec.pth in either layout
# ---------------------------------------------------------------------------------------------------------------


def test_codec_weights_load_from_either_layout():
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY)
    folded = {name: tensor.clone() for name, tensor in model.codec.state_dict().items()}
    for parameter in model.codec.parameters():
        parameter.data.zero_()
    load_codec_weights(model.codec, folded)
    assert all(torch.equal(model.codec.state_dict()[name], tensor) for name, tensor in folded.items())

    load_codec_weights(model.codec, load_codec_state_dict(GOLDEN_TINY / "codec.pth"))  # the original layout
    assert all(torch.equal(model.codec.state_dict()[name], tensor) for name, tensor in folded.items())

    del folded["decoder.output_conv.weight"]
    with pytest.raises(FishDACLoadError, match="decoder.output_conv.weight"):
        load_codec_weights(model.codec, folded)
