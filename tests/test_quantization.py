"""bitsandbytes 8-/4-bit on CPU over the bsgemm-moe checkpoint (dense linears, and 4-bit routed experts), both CPU
4-bit paths, generation against the full-precision copy, the FP8 kernel fallback, quantization conflicts.

bitsandbytes' two CPU 4-bit paths: a `Linear4bit` reads `has_avx512bf16()` once, when it is built (the name
`bitsandbytes.nn.modules.has_avx512bf16`; the native library answers with the CPU's AVX512-BF16 flag). With it,
the first forward call in eval mode without gradients repacks the weight for a bf16 kernel, which needs the output
size to be a multiple of 32 and the input size even; without it, the weight is dequantised for a float32 matmul.
tests/conftest.py pins the dequantising path for every test by patching that name; the packed kernel is AVX512-BF16
machine code, so the tests marked `bnb_packed_cpu` run it where the CPU has the flag and are skipped elsewhere, while
the packing itself (plain torch, where bitsandbytes checks the shapes) is applied to every 4-bit weight on every CPU.
Each comparison takes its tolerance from the path the forward calls actually took (`_four_bit_path_taken`).

Geometry: in the golden tiny checkpoint `in_proj_a` / `in_proj_b` have 2 outputs (2 value heads), which the packed
kernel cannot take. The quantisation tests load a tiny checkpoint with 32 value heads of width 8 instead, so that,
as in the real model, only `shared_expert_gate` (hidden -> 1) is kept out of 4-bit (`prepare_quantization`).

Tolerances are per weight, from the quantisation grids themselves: int8 rounds `W / (row absmax / 127)` to the
nearest integer, so `|W - W8 * absmax / 127| <= absmax / 254`; 4-bit rounds each block of 64 weights, scaled by the
block absmax, to the nearest of 16 code values, so the error is at most half the widest gap of the code times the
block absmax (1/6 for fp4, 0.152 for nf4). On top: float32 rounding of the scaling on both sides, 5 u of the
absmax (`GRID_SLACK`). The effect on logits (measured, not asserted) is in docs/hardware.md.
"""

import copy
import logging

import bitsandbytes as bnb
import pytest
import torch
from torch import nn
from transformers import BitsAndBytesConfig
from transformers.utils.quantization_config import FineGrainedFP8Config

from transformers_drama3 import FishOmniConfig, FishOmniForSpeech
from transformers_drama3.quantization_bsgemm import (
    BNB_SKIP_MODULES,
    BsgemmMoeConfig,
    BsgemmMoeHfQuantizer,
    cpu_unpackable_4bit_linears,
    prepare_quantization,
    skip_patterns,
)
from transformers_drama3.quantized_experts import Bnb4bitSelectedExperts, Fp8SelectedExperts, QuantizedExperts
from transformers_drama3.testing import write_tiny_checkpoint

from .conftest import GOLDEN_TINY
from .tolerances import codebook_logit_reductions, main_logit_reductions, reordering_tolerance, unit_roundoff

pytestmark = pytest.mark.filterwarnings("ignore:MatMul8bitLt")  # bnb's note that fp32 inputs run as fp16

GREEDY_FRAMES = 4  # enough to run every quantised linear through both the prefill and the frame steps
# Linear attention with 32 value heads: in_proj_a / in_proj_b get 32 outputs, like the real model's.
FITTING_GEOMETRY = {"text_config": {"linear_num_value_heads": 32, "linear_value_head_dim": 8}}
PACKED = pytest.mark.bnb_packed_cpu  # tests/conftest.py: the packed AVX512-BF16 path, where the CPU has it
# Float32 rounding on top of the grid bound, in units of the scale (absmax): two roundings on bitsandbytes' side
# (the scale and the scaled weight that is rounded to the grid), two in the dequantisation (code times scale, the
# division by 127 for int8), one in the comparison; each at most u times the absmax.
GRID_SLACK = 5 * unit_roundoff(torch.float32)


def _meta_model(config):
    """The skeleton `from_pretrained` quantises: on the meta device, without the codec (it joins after loading)."""
    with torch.device("meta"):
        return FishOmniForSpeech(config, with_codec=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fitting"), seed=3, **FITTING_GEOMETRY)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return FishOmniForSpeech.from_pretrained(checkpoint, dtype=torch.float32)


def _load(quantization_config, checkpoint=GOLDEN_TINY):
    model, info = FishOmniForSpeech.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=quantization_config, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model


def _dense_linears(model):
    """(name, module) of the backbone's linears: attention, linear attention, shared expert and its gate."""
    return [(name, module) for name, module in model.backbone.named_modules() if isinstance(module, nn.Linear)]


def _dequantised_8bit(parameter) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, error bound) of an `Int8Params` weight: int8 rows times row absmax / 127, bound absmax / 254."""
    absmax = parameter.SCB.float()[:, None]  # [out, 1]
    return parameter.data.float() * absmax / 127, absmax / 254 + GRID_SLACK * absmax


def _dequantised_4bit(parameter, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, error bound) of a `Params4bit` weight: bound = half the widest code gap times the block absmax."""
    state = parameter.quant_state
    weight = bnb.functional.dequantize_4bit(parameter.data, state).float().reshape(shape)
    code = state.code.sort().values
    half_gap = (code[1:] - code[:-1]).max() / 2
    absmax = weight.reshape(-1, state.blocksize).abs().amax(-1, keepdim=True)  # [blocks, 1]
    return weight, ((half_gap + GRID_SLACK) * absmax).expand(-1, state.blocksize).reshape(shape)


QUANTISATIONS = [pytest.param(BitsAndBytesConfig(load_in_8bit=True), None, id="8bit")] + [
    pytest.param(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind), path, id=f"4bit-{kind}-{path}",
                 marks=[PACKED] if path == "packed" else [])
    for kind in ("fp4", "nf4")
    for path in ("dequantising", "packed")
]


def _full_precision_copy(model, checkpoint):
    """The same model with every quantised module replaced by its plain counterpart holding the quantised weights
    dequantised in float32 (the arithmetic of bitsandbytes' CPU paths and of `quantized_experts`): an independent
    formulation of what the quantised model computes. Built from a dequantising load of the same checkpoint."""
    plain = FishOmniForSpeech.from_pretrained(checkpoint, dtype=torch.float32,
                                              quantization_config=BsgemmMoeConfig(dequantize=True))
    plain_modules = dict(plain.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, bnb.nn.Linear8bitLt):  # bitsandbytes' CPU 8-bit matmul: CB * (SCB / 127)
                weight = module.weight.data.to(torch.float32).mul_(module.weight.SCB.unsqueeze(1).mul(1.0 / 127.0))
                plain_modules[name].weight.copy_(weight)
            elif isinstance(module, bnb.nn.Linear4bit):
                state = module.weight.quant_state
                assert not getattr(state, "packing_format_for_cpu", False), "copy before the first forward call"
                plain_modules[name].weight.copy_(bnb.functional.dequantize_4bit(module.weight.data, state).float())
            elif isinstance(module, QuantizedExperts):
                for projection in ("gate_up_proj", "down_proj"):
                    getattr(plain_modules[name], projection).copy_(module.dequantized(projection, None, torch.float32))
    return plain


@pytest.mark.parametrize(("config", "path"), QUANTISATIONS)
def test_bitsandbytes_quantises_the_dense_linears_and_the_routed_experts(config, path, checkpoint, reference,
                                                                         expected):
    """8-bit: dense linears 8-bit, experts FP8 as shipped. 4-bit: dense linears and routed experts 4-bit, each weight
    within its grid bound of the full-precision one. Then generation, against the full-precision copy of the
    quantised model (`_full_precision_copy`): the same greedy frames, and main-token logits within float32 rounding
    of another matmul order (`reordering_tolerance`); on the packed AVX512-BF16 path the 4-bit linears compute in
    bf16, so the bound takes bf16's unit roundoff and the teacher-forced logits are compared."""
    model = _load(config, checkpoint)
    eight_bit = config.load_in_8bit
    assert model.config.quantization_config.quant_method == "bitsandbytes"
    # 4-bit also keeps shared_expert_gate (hidden -> 1) in full precision: the packed CPU kernel cannot take it.
    kept = [] if eight_bit else ["shared_expert_gate"]
    assert model.config.quantization_config.llm_int8_skip_modules == BNB_SKIP_MODULES + kept
    quantized_class = bnb.nn.Linear8bitLt if eight_bit else bnb.nn.Linear4bit

    linears = _dense_linears(model)
    quantised = [(name, module) for name, module in linears if not name.endswith("shared_expert_gate") or eight_bit]
    assert len(quantised) > len(linears) / 2 and all(isinstance(module, quantized_class) for _, module in quantised)
    assert all(type(module) is nn.Linear for name, module in linears if (name, module) not in quantised)
    reference_modules = dict(reference.backbone.named_modules())
    for name, module in quantised:
        original = reference_modules[name].weight
        weight, bound = (_dequantised_8bit(module.weight) if eight_bit
                         else _dequantised_4bit(module.weight, original.shape))
        assert ((weight - original).abs() <= bound).all(), name
    for layer, reference_layer in zip(model.backbone.layers, reference.backbone.layers):
        experts, reference_experts = layer.mlp.experts, reference_layer.mlp.experts  # the reference keeps FP8
        assert isinstance(experts, Fp8SelectedExperts if eight_bit else Bnb4bitSelectedExperts)
        assert not any(parameter.requires_grad for parameter in experts.parameters())
        for projection in ("gate_up_proj", "down_proj"):
            original = reference_experts.dequantized(projection, None, torch.float32)
            if eight_bit:
                assert torch.equal(getattr(experts, projection).view(torch.uint8),
                                   getattr(reference_experts, projection).view(torch.uint8))
            else:
                weight, bound = _dequantised_4bit(getattr(experts, projection), original.shape)
                assert ((weight - original).abs() <= bound).all(), projection
    # Every 4-bit linear of the model takes the repacking the AVX512-BF16 kernel does at the first forward call
    # (plain torch, so it runs on any CPU; bitsandbytes asserts the shape there). On copies: the forward below must
    # see the untouched weights.
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            packed, _ = bnb.functional._convert_weight_packed_for_cpu(
                module.weight.data.clone(), copy.deepcopy(module.weight.quant_state)
            )
            assert packed.shape == (module.out_features, module.in_features // 2), name
    # Full precision, bit-equal to the plain load: tower, lm_head, codec.
    for ours, theirs in ((model.tower, reference.tower), (model.lm_head, reference.lm_head), (model.codec, reference.codec)):
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))

    plain = _full_precision_copy(model, checkpoint)
    prompt = expected["prompt_a_rows"][None, -12:]  # the prompt's end, up to `<|voice|>`: short, so fast
    out = model.generate(prompt, do_sample=False, max_new_tokens=GREEDY_FRAMES, output_scores=True)
    assert all(code.shape[0] == 10 and torch.isfinite(audio).all() for code, audio in zip(out.codes, out.audio))
    assert _four_bit_path_taken(model) == path  # the path tests/conftest.py pinned (or the marker chose)
    _assert_generates_what_the_full_precision_copy_computes(model, plain, out, prompt)


def _four_bit_path_taken(model) -> str | None:
    """The CPU path the forward calls took through the model's `Linear4bit`s: "packed" where bitsandbytes repacked
    their weights for its AVX512-BF16 kernel, else "dequantising"; None without 4-bit linears."""
    packed = {bool(getattr(module.weight.quant_state, "packing_format_for_cpu", False))
              for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)}
    assert len(packed) <= 1, "some 4-bit linears were repacked and others not"
    return None if not packed else ("packed" if packed.pop() else "dequantising")


def _int8_activation_tolerance(model, reference: torch.Tensor) -> dict:
    """bitsandbytes' CPU 8-bit inference (LLM.int8) also rounds each linear's input rows to int8 (`absmax / 127`
    steps, via float16): a relative error of at most 1/254 of the row scale per 8-bit linear, adding up to first
    order along the path (the error model of tests/tolerances.py), bounded by all the model's 8-bit linears."""
    linears = sum(isinstance(module, bnb.nn.Linear8bitLt) for module in model.modules())
    return {"atol": linears / 254 * reference.abs().max().item(), "rtol": 0.0}


def _assert_generates_what_the_full_precision_copy_computes(model, plain, out, prompt):
    """4-bit (bitsandbytes dequantises the weight, then a float32 matmul): the copy gives the same greedy frames and
    main-token logits within `reordering_tolerance`; where the forward calls took the packed AVX512-BF16 path (bf16
    compute) and with 8-bit linears (int8 activations) the teacher-forced logits of the generated frames are
    compared within bf16 rounding and `_int8_activation_tolerance` respectively."""
    rows = out.sequences.shape[1]
    int8 = any(isinstance(module, bnb.nn.Linear8bitLt) for module in model.modules())
    if int8:  # bitsandbytes' two CPU int8 matmuls (AVX-512 or not) give the same exact int32 sums only below 2**24
        widest = max(module.in_features for module in model.modules() if isinstance(module, bnb.nn.Linear8bitLt))
        assert widest * 127**2 < 2**24, "an int8 input this wide makes the 8-bit result depend on the CPU"
    if _four_bit_path_taken(model) == "packed" or int8:
        with torch.no_grad():
            ours, theirs = model(out.sequences), plain(out.sequences)
        compared = [("main_logits", main_logit_reductions(model.config, rows))]
        if not int8:  # the int8 bound is first order: through the 13 tower layers' norms it does not hold
            compared.append(("codebook_logits", codebook_logit_reductions(model.config, rows)))
        for name, reductions in compared:
            reference = getattr(theirs, name)
            tolerance = (_int8_activation_tolerance(model, reference) if int8
                         else reordering_tolerance(reference.bfloat16(), reductions))
            torch.testing.assert_close(getattr(ours, name), reference, **tolerance)
        return
    theirs = plain.generate(prompt, do_sample=False, max_new_tokens=GREEDY_FRAMES, output_scores=True)
    assert torch.equal(out.sequences, theirs.sequences)
    for ours_scores, their_scores in zip(out.scores, theirs.scores):
        torch.testing.assert_close(ours_scores, their_scores,
                                   **reordering_tolerance(their_scores, main_logit_reductions(model.config, rows)))


# docs/hardware.md's 24 GB configuration: nf4 with double quantisation, the tower 4-bit too.
TWENTY_FOUR_GB = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    llm_int8_skip_modules=["lm_head"])


@pytest.mark.parametrize("config", [
    pytest.param(BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"]), id="8bit-tower"),
    pytest.param(TWENTY_FOUR_GB, id="4bit-24gb"),
    pytest.param(TWENTY_FOUR_GB, id="4bit-24gb-packed", marks=PACKED),
])
def test_the_quantised_towers_of_docs_generate_what_their_full_precision_copy_computes(config, checkpoint, expected):
    """The settings docs/hardware.md offers with the tower quantised too: the 8-bit tower (its int8 weights gave the
    frame step's tower cache no floating dtype) and the 24 GB configuration (nf4 with double quantisation, the
    tower 4-bit, only the candidate rows of lm_head), on each 4-bit CPU path the machine has."""
    candidate_rows = config.load_in_4bit
    model, info = FishOmniForSpeech.from_pretrained(checkpoint, dtype=torch.float32, quantization_config=config,
                                                    candidate_head_rows_only=candidate_rows, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert isinstance(model.tower.heads[0], bnb.nn.Linear8bitLt if config.load_in_8bit else bnb.nn.Linear4bit)
    plain = _full_precision_copy(model, checkpoint)
    if candidate_rows:
        plain.keep_candidate_head_rows()
    prompt = expected["prompt_a_rows"][None, -12:]
    out = model.generate(prompt, do_sample=False, max_new_tokens=GREEDY_FRAMES, output_scores=True)
    _assert_generates_what_the_full_precision_copy_computes(model, plain, out, prompt)


def test_4bit_keeps_the_linears_the_packed_cpu_kernel_cannot_take_in_full_precision():
    golden = FishOmniForSpeech.config_class.from_pretrained(GOLDEN_TINY)
    model = _meta_model(golden)
    unfit = ["in_proj_b", "in_proj_a", "shared_expert_gate"]  # 2, 2 and 1 outputs
    _, four_bit = prepare_quantization(golden, BitsAndBytesConfig(load_in_4bit=True), model)
    assert four_bit.llm_int8_skip_modules == BNB_SKIP_MODULES + unfit
    _, own_list = prepare_quantization(golden, BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["lm_head"]),
                                       model)
    assert own_list.llm_int8_skip_modules == ["lm_head"] + unfit  # the tower's linears all fit
    _, eight_bit = prepare_quantization(golden, BitsAndBytesConfig(load_in_8bit=True), model)
    assert eight_bit.llm_int8_skip_modules == BNB_SKIP_MODULES


def test_the_real_model_keeps_only_its_shared_expert_gates_out_of_4bit():
    config = FishOmniConfig()  # the real geometry
    model = _meta_model(config)
    unfit = cpu_unpackable_4bit_linears(model, BNB_SKIP_MODULES)
    layers = config.text_config.num_hidden_layers
    assert unfit == [f"backbone.layers.{index}.mlp.shared_expert_gate" for index in range(layers)]
    _, four_bit = prepare_quantization(config, BitsAndBytesConfig(load_in_4bit=True), model)
    assert four_bit.llm_int8_skip_modules == BNB_SKIP_MODULES + ["shared_expert_gate"]


def test_a_skip_pattern_never_keeps_a_linear_that_fits():
    """A module name shared with a linear that fits would keep that one too: such modules are listed in full."""
    model = nn.ModuleDict({"a": nn.ModuleDict({"gate": nn.Linear(64, 1)}),
                           "b": nn.ModuleDict({"gate": nn.Linear(64, 64)})})
    unfit = cpu_unpackable_4bit_linears(model, [])
    assert unfit == ["a.gate"]
    assert skip_patterns(model, unfit, []) == ["a.gate"]
    model["b"]["gate"] = nn.Linear(64, 3)
    assert skip_patterns(model, cpu_unpackable_4bit_linears(model, []), []) == ["gate"]


def test_a_user_skip_list_replaces_the_default_but_the_codec_stays_plain():
    model = _load(BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"]))
    assert isinstance(model.tower.heads[0], bnb.nn.Linear8bitLt)
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, bnb.nn.Linear8bitLt)
    assert not any(isinstance(module, bnb.nn.Linear8bitLt) for module in model.codec.modules())
    assert model.config.quantization_config.llm_int8_skip_modules == ["lm_head"]  # the codec needs no entry


def test_prepare_quantization_leaves_the_callers_objects_alone():
    config = BitsAndBytesConfig(load_in_8bit=True)
    checkpoint_config = FishOmniForSpeech.config_class.from_pretrained(GOLDEN_TINY)
    new_config, quantization = prepare_quantization(checkpoint_config, config, _meta_model(checkpoint_config))
    assert config.llm_int8_skip_modules is None
    assert checkpoint_config.quantization_config["quant_method"] == "bsgemm-moe"
    assert not hasattr(new_config, "quantization_config") or new_config.quantization_config is None
    assert quantization.quant_method == "bsgemm-moe+bitsandbytes_8bit"


def test_forcing_dequantisation_is_accepted(reference, checkpoint):
    model = _load(BsgemmMoeConfig(dequantize=True), checkpoint)
    experts, reference_experts = model.backbone.layers[1].mlp.experts, reference.backbone.layers[1].mlp.experts
    assert type(experts) is not Fp8SelectedExperts and isinstance(reference_experts, Fp8SelectedExperts)
    assert torch.equal(experts.down_proj, reference_experts.dequantized("down_proj", None, torch.float32))


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


def test_missing_fp8_kernel_keeps_the_experts_fp8_on_the_selected_path(fp8_capable_gpu, monkeypatch, caplog):
    monkeypatch.setattr("transformers_drama3.quantization_bsgemm.fp8_kernel_problem", lambda: "ImportError: no kernels")
    quantizer = BsgemmMoeHfQuantizer(BsgemmMoeConfig(), pre_quantized=True)
    with caplog.at_level(logging.INFO):
        quantizer.validate_environment(device_map={"": 0})
    assert not quantizer.quantization_config.dequantize and quantizer.selected_experts
    assert "FP8 expert kernel is not used (ImportError: no kernels)" in caplog.text


def test_available_fp8_kernel_keeps_the_experts_fp8(fp8_capable_gpu, monkeypatch):
    monkeypatch.setattr("transformers_drama3.quantization_bsgemm.fp8_kernel_problem", lambda: None)
    quantizer = BsgemmMoeHfQuantizer(BsgemmMoeConfig(), pre_quantized=True)
    quantizer.validate_environment(device_map={"": 0})
    assert not quantizer.quantization_config.dequantize and not quantizer.selected_experts


def test_kernel_probe_reports_a_missing_kernels_package_instead_of_raising(monkeypatch):
    from transformers.integrations import finegrained_fp8

    from transformers_drama3.quantization_bsgemm import fp8_kernel_problem

    monkeypatch.setattr(finegrained_fp8, "_FINEGRAINED_FP8", None)
    monkeypatch.setattr(finegrained_fp8, "is_kernels_available", lambda: False)
    assert fp8_kernel_problem().startswith("ImportError: finegrained-fp8 kernel unavailable")
