"""bitsandbytes 8-/4-bit on CPU over the bsgemm-moe checkpoint, the FP8 kernel fallback, quantization conflicts.

Tolerances are per weight, from the quantisation grids themselves: int8 rounds `W / (row absmax / 127)` to the
nearest integer, so `|W - W8 * absmax / 127| <= absmax / 254`; 4-bit rounds each block of 64 weights, scaled by the
block absmax, to the nearest of 16 code values, so the error is at most half the widest gap of the code times the
block absmax (1/6 for fp4, 0.152 for nf4). The effect on logits (measured, not asserted) is in docs/hardware.md.
"""

import logging

import bitsandbytes as bnb
import pytest
import torch
from transformers import BitsAndBytesConfig
from transformers.utils.quantization_config import FineGrainedFP8Config

from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig, BsgemmMoeHfQuantizer, prepare_quantization

from .conftest import GOLDEN_TINY

pytestmark = pytest.mark.filterwarnings("ignore:MatMul8bitLt")  # bnb's note that fp32 inputs run as fp16

GREEDY_FRAMES = 8


@pytest.fixture(scope="module")
def reference():
    return FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32)


def _load(quantization_config):
    model, info = FishOmniForSpeech.from_pretrained(
        GOLDEN_TINY, dtype=torch.float32, quantization_config=quantization_config, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model


def _dense_linears(model):
    """(name, module) of the backbone's linears: attention, linear attention, shared expert and its gate."""
    return [(name, module) for name, module in model.backbone.named_modules() if "Linear" in type(module).__name__]


def _dequantised_8bit(parameter) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, error bound) of an `Int8Params` weight: int8 rows times row absmax / 127, bound absmax / 254."""
    absmax = parameter.SCB.float()[:, None]  # [out, 1]
    return parameter.data.float() * absmax / 127, absmax / 254


def _dequantised_4bit(parameter, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, error bound) of a `Params4bit` weight: bound = half the widest code gap times the block absmax."""
    state = parameter.quant_state
    weight = bnb.functional.dequantize_4bit(parameter.data, state).float().reshape(shape)
    code = state.code.sort().values
    half_gap = (code[1:] - code[:-1]).max() / 2
    absmax = weight.reshape(-1, state.blocksize).abs().amax(-1, keepdim=True)  # [blocks, 1]
    return weight, (half_gap * absmax).expand(-1, state.blocksize).reshape(shape)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(BitsAndBytesConfig(load_in_8bit=True), id="8bit"),
        pytest.param(BitsAndBytesConfig(load_in_4bit=True), id="4bit-fp4"),
        pytest.param(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"), id="4bit-nf4"),
    ],
)
def test_bitsandbytes_quantises_the_dense_backbone_linears_only(config, reference, expected):
    model = _load(config)
    assert model.config.quantization_config.quant_method == "bitsandbytes"
    assert model.config.quantization_config.llm_int8_skip_modules == ["lm_head", "tower"]
    eight_bit = config.load_in_8bit
    quantized_class = bnb.nn.Linear8bitLt if eight_bit else bnb.nn.Linear4bit

    linears = _dense_linears(model)
    assert linears and all(isinstance(module, quantized_class) for _, module in linears)
    reference_modules = dict(reference.backbone.named_modules())
    for name, module in linears:
        original = reference_modules[name].weight
        weight, bound = (_dequantised_8bit(module.weight) if eight_bit
                         else _dequantised_4bit(module.weight, original.shape))
        assert ((weight - original).abs() <= bound * (1 + 1e-5) + 1e-7).all(), name

    # Full precision, bit-equal to the plain load: experts (dequantised FP8), tower, lm_head, codec.
    for ours, theirs in ((model.backbone.layers[0].mlp.experts, reference.backbone.layers[0].mlp.experts),
                         (model.tower, reference.tower), (model.lm_head, reference.lm_head), (model.codec, reference.codec)):
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))

    prompt = expected["prompt_a_rows"][None, -12:]  # the prompt's end, up to `<|voice|>`: short, so fast
    out = model.generate(prompt, do_sample=False, max_new_tokens=GREEDY_FRAMES)
    assert out.sequences.shape[1] <= prompt.shape[1] + GREEDY_FRAMES
    assert all(code.shape[0] == 10 and torch.isfinite(audio).all() for code, audio in zip(out.codes, out.audio))


def test_a_user_skip_list_replaces_the_default_but_the_codec_stays_plain():
    model = _load(BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"]))
    assert isinstance(model.tower.heads[0], bnb.nn.Linear8bitLt)
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, bnb.nn.Linear8bitLt)
    assert not any(isinstance(module, bnb.nn.Linear8bitLt) for module in model.codec.modules())
    assert model.config.quantization_config.llm_int8_skip_modules == ["lm_head"]  # the codec needs no entry


def test_prepare_quantization_leaves_the_callers_objects_alone(reference):
    config = BitsAndBytesConfig(load_in_8bit=True)
    checkpoint_config = reference.config.__class__.from_pretrained(GOLDEN_TINY)
    new_config, quantization = prepare_quantization(checkpoint_config, config)
    assert config.llm_int8_skip_modules is None
    assert checkpoint_config.quantization_config["quant_method"] == "bsgemm-moe"
    assert not hasattr(new_config, "quantization_config") or new_config.quantization_config is None
    assert quantization.quant_method == "bsgemm-moe+bitsandbytes_8bit"


def test_forcing_dequantisation_is_accepted(reference):
    model = _load(BsgemmMoeConfig(dequantize=True))
    assert torch.equal(model.backbone.layers[1].mlp.experts.down_proj, reference.backbone.layers[1].mlp.experts.down_proj)


def test_another_quantization_method_gives_transformers_conflict_error():
    with pytest.raises(ValueError, match="quantized with BsgemmMoeConfig but you are passing a FineGrainedFP8Config"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, quantization_config=FineGrainedFP8Config())


# ---------------------------------------------------------------------------------------------------------------
# FP8 kernel fallback (an FP8-capable GPU is simulated: validate_environment only asks torch.cuda)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fp8_capable_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))


def test_missing_fp8_kernel_falls_back_to_dequantising_with_one_warning(fp8_capable_gpu, monkeypatch, caplog):
    monkeypatch.setattr("transformers_drama3.quantization_bsgemm.fp8_kernel_problem", lambda: "ImportError: no kernels")
    quantizer = BsgemmMoeHfQuantizer(BsgemmMoeConfig(), pre_quantized=True)
    with caplog.at_level(logging.WARNING):
        quantizer.validate_environment(device_map={"": 0})
    assert quantizer.quantization_config.dequantize
    assert "FP8 expert kernel is unavailable (ImportError: no kernels)" in caplog.text


def test_available_fp8_kernel_keeps_the_experts_fp8(fp8_capable_gpu, monkeypatch):
    monkeypatch.setattr("transformers_drama3.quantization_bsgemm.fp8_kernel_problem", lambda: None)
    quantizer = BsgemmMoeHfQuantizer(BsgemmMoeConfig(), pre_quantized=True)
    quantizer.validate_environment(device_map={"": 0})
    assert not quantizer.quantization_config.dequantize


def test_kernel_probe_reports_a_missing_kernels_package_instead_of_raising(monkeypatch):
    from transformers.integrations import finegrained_fp8

    from transformers_drama3.quantization_bsgemm import fp8_kernel_problem

    monkeypatch.setattr(finegrained_fp8, "_FINEGRAINED_FP8", None)
    monkeypatch.setattr(finegrained_fp8, "is_kernels_available", lambda: False)
    assert fp8_kernel_problem().startswith("ImportError: finegrained-fp8 kernel unavailable")
