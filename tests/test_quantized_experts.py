"""Quantised routed experts (`quantized_experts`): FP8 kept as shipped and bitsandbytes 4-bit, on the path that
dequantises only the selected experts, against transformers' own experts holding the same weights dequantised.

Tolerance of the module checks: both sides multiply the same float32 weights (the quantised experts dequantise
with the very arithmetic the reference weights were made with), in another order (a bmm per (token, expert) pair
vs transformers' loop or grouped GEMM): `reordering_tolerance` over the reductions of one expert, hidden +
intermediate + the top-k sum. Whole-model checks use the backbone and tower reductions of `tests/tolerances.py`.
The greedy golden frames of the FP8-kept model (the default load on a CPU) are checked by
`tests/test_generation.py::test_greedy_generation_reproduces_golden`, and its compiled step by
`tests/test_frame_step.py::test_the_compiled_step_gives_the_eager_frames`.
"""

import bitsandbytes as bnb
import pytest
import torch
from transformers import BitsAndBytesConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

from transformers_drama3 import FishOmniConfig, FishOmniForSpeech
from transformers_drama3.modeling_drama3 import CandidateRowsHead
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig, prepare_quantization
from transformers_drama3.quantized_experts import Bnb4bitSelectedExperts, Fp8SelectedExperts, QuantizedExperts
from transformers_drama3.testing import quantize_fp8_blockwise

from .conftest import GOLDEN_TINY
from .tolerances import codebook_logit_reductions, codec_decode_reductions, main_logit_reductions, reordering_tolerance

# The golden tiny checkpoint's expert geometry.
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 256, 128, 4, 2
FORMATS = ["fp8", "nf4", "nf4-double", "fp4", "fp4-double"]


def _text_config() -> Qwen3_5MoeTextConfig:
    config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                                  num_experts_per_tok=TOP_K)
    config._experts_implementation = "batched_mm"  # what a captured step asks for: the quantised experts ignore it
    return config


def _quantised_experts(kind: str) -> QuantizedExperts:
    """Experts of the tiny geometry with random weights in format `kind`."""
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.05
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.05
    config = _text_config()
    if kind == "fp8":
        experts = Fp8SelectedExperts(config)
        # As the checkpoint ships them: gate and up rows quantised apart, per expert.
        for name, weight, halves in (("gate_up_proj", gate_up, 2), ("down_proj", down, 1)):
            pieces = [quantize_fp8_blockwise(part) for expert in weight for part in expert.chunk(halves)]
            getattr(experts, name).data = torch.stack([p[0] for p in pieces]).view(weight.shape)
            getattr(experts, f"{name}_scale_inv").data = torch.stack([p[1] for p in pieces]).view(EXPERTS, -1, pieces[0][1].shape[-1])
        return experts
    quant_type, _, double = kind.partition("-")
    experts = Bnb4bitSelectedExperts(config, quant_type=quant_type, compress_statistics=bool(double))
    for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        setattr(experts, name, bnb.nn.Params4bit(weight, requires_grad=False, quant_type=quant_type,
                                                 compress_statistics=bool(double)).to("cpu"))
    return experts


def _plain_copy(experts: QuantizedExperts) -> Qwen3_5MoeExperts:
    """transformers' own experts holding `experts`' weights dequantised whole (float32)."""
    config = _text_config()
    config._experts_implementation = "eager"
    plain = Qwen3_5MoeExperts(config)
    for name in ("gate_up_proj", "down_proj"):
        getattr(plain, name).data = experts.dequantized(name, None, torch.float32)
    return plain


def _routing(tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=generator)
    index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=generator)
    return hidden, index, weights


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize(("tokens", "path"), [(1, "selected"), (16, "selected"), (16, "whole-layer")])
def test_quantised_experts_equal_transformers_experts_on_the_same_weights(kind, tokens, path, monkeypatch):
    """Batch 1 and 16 (one token each: a frame step), on the selected path and on the whole-layer path a prefill
    takes (one token, 2 pairs < 4 experts, always takes the selected one); at the tiny size 16 tokens make 32 pairs
    > 4 experts, so the selected path is forced for them by raising the threshold."""
    monkeypatch.setattr(QuantizedExperts, "pairs_per_expert_before_dequantising_all", 1 if path == "whole-layer" else 64)
    experts = _quantised_experts(kind)
    reference = _plain_copy(experts)
    hidden, index, weights = _routing(tokens, seed=tokens)
    with torch.no_grad():
        expected = reference(hidden, index, weights)
        torch.testing.assert_close(experts(hidden, index, weights), expected,
                                   **reordering_tolerance(expected, HIDDEN + INTERMEDIATE + TOP_K))


@pytest.mark.parametrize("kind", ["fp8", "nf4-double"])
def test_the_selected_path_compiles_into_one_graph(kind, monkeypatch):
    """torch.compile(fullgraph=True) (the `aot_eager` backend: dynamo's one graph, no compiler) of both paths: no
    graph break, no host read, the eager numbers."""
    experts = _quantised_experts(kind)
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    for tokens in (1, 16):  # selected, then whole layer (32 pairs >= 4 experts)
        hidden, index, weights = _routing(tokens, seed=tokens)
        with torch.no_grad():
            expected = experts(hidden, index, weights)
            torch.testing.assert_close(compiled(hidden, index, weights), expected,
                                       **reordering_tolerance(expected, HIDDEN + INTERMEDIATE + TOP_K))


def test_pairs_routed_to_another_ranks_experts_add_nothing():
    """Expert parallelism marks pairs routed elsewhere with ids >= the local expert count: they contribute zero."""
    experts = _quantised_experts("fp8")
    hidden, index, weights = _routing(3, seed=5)
    elsewhere = index.clone()
    elsewhere[:, 1] = EXPERTS  # the second choice of every token lives on another rank
    with torch.no_grad():
        only_first = experts(hidden, index[:, :1], weights[:, :1])
        torch.testing.assert_close(experts(hidden, elsewhere, weights), only_first,
                                   **reordering_tolerance(only_first, HIDDEN + INTERMEDIATE + TOP_K))


# ---------------------------------------------------------------------------------------------------------------
# The FP8-kept model (the default load without an FP8 GPU kernel) against dequantising at load
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dequantised():
    return FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32,
                                             quantization_config=BsgemmMoeConfig(dequantize=True))


def test_fp8_kept_matches_dequantising_at_load_in_float32(golden_model, dequantised, expected):
    """Same weights, dequantised later: the logits differ by float32 rounding of another matmul order only."""
    assert isinstance(golden_model.backbone.layers[0].mlp.experts, Fp8SelectedExperts)
    rows = expected["tf_rows"][None, -40:]
    with torch.no_grad():
        kept, reference = golden_model(rows), dequantised(rows)
    config = golden_model.config
    torch.testing.assert_close(kept.main_logits, reference.main_logits,
                               **reordering_tolerance(reference.main_logits, main_logit_reductions(config, rows.shape[1])))
    torch.testing.assert_close(
        kept.codebook_logits, reference.codebook_logits,
        **reordering_tolerance(reference.codebook_logits, codebook_logit_reductions(config, rows.shape[1])))


def test_fp8_kept_holds_one_byte_per_expert_weight(golden_model, dequantised):
    kept = golden_model.backbone.layers[0].mlp.experts
    assert kept.gate_up_proj.dtype == torch.float8_e4m3fn and not kept.gate_up_proj.requires_grad
    assert kept.gate_up_proj.shape == dequantised.backbone.layers[0].mlp.experts.gate_up_proj.shape
    assert kept.gate_up_proj_scale_inv.shape == (EXPERTS, 2, 2)  # gate and up: one 128-row block each, 2 column blocks


def test_4bit_experts_need_whole_blocks_per_expert():
    """Double quantisation groups 256 block scales: an expert of 96 x 256 weights (384 blocks) would share a group
    with its neighbour, so the load is refused before any weight is read."""
    config = FishOmniConfig.from_pretrained(GOLDEN_TINY)
    config.text_config.moe_intermediate_size = 96
    with torch.device("meta"):
        skeleton = FishOmniForSpeech(config, with_codec=False)
    with pytest.raises(ValueError, match="not a multiple of 16384.*bnb_4bit_use_double_quant=False"):
        prepare_quantization(config, BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True), skeleton)
    prepare_quantization(config, BitsAndBytesConfig(load_in_4bit=True), skeleton)  # 64-weight blocks fit


# ---------------------------------------------------------------------------------------------------------------
# Only the candidate rows of lm_head
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def candidate_rows_model():
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, candidate_head_rows_only=True)
    model.set_experts_implementation("eager")
    return model


def test_candidate_rows_head_gives_the_same_logits_and_frames(candidate_rows_model, golden_model, prompt):
    head = candidate_rows_model.lm_head
    assert isinstance(head, CandidateRowsHead) and head.weight.shape == (1 + 64, HIDDEN)  # EOS + the band
    with torch.no_grad():
        assert torch.equal(candidate_rows_model(prompt).main_logits, golden_model(prompt).main_logits)
    ours = candidate_rows_model.generate(prompt, do_sample=False, max_new_tokens=6, output_audio=False)
    theirs = golden_model.generate(prompt, do_sample=False, max_new_tokens=6, output_audio=False)
    assert torch.equal(ours.sequences, theirs.sequences)


def test_candidate_rows_head_cannot_be_saved_or_made_from_a_quantised_head(candidate_rows_model, tmp_path):
    with pytest.raises(ValueError, match="keeps only the candidate rows of lm_head"):
        candidate_rows_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="lm_head as a plain linear in memory, but it is Linear8bitLt"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, candidate_head_rows_only=True,
                                          quantization_config=BitsAndBytesConfig(load_in_8bit=True,
                                                                                 llm_int8_skip_modules=["tower"]))


def test_a_bf16_codec_decodes_the_frames_within_bf16_rounding(candidate_rows_model, prompt):
    """`model.codec.to(torch.bfloat16)` (docs/hardware.md): the same frames, the audio within bf16 rounding along the
    codec's reductions (`reordering_tolerance` with bf16's unit roundoff)."""
    out = candidate_rows_model.generate(prompt, do_sample=False, max_new_tokens=4)
    codec = candidate_rows_model.codec
    try:
        codec.to(torch.bfloat16)
        bf16 = candidate_rows_model.generate(prompt, do_sample=False, max_new_tokens=4)
    finally:
        codec.float()
    assert torch.equal(bf16.sequences, out.sequences)
    reference = out.audio[0]
    torch.testing.assert_close(bf16.audio[0].float(), reference,
                               **reordering_tolerance(reference.bfloat16(), codec_decode_reductions(codec)))


@pytest.mark.parametrize("kind", ["fp8", "nf4-double"])
def test_quantised_experts_pass_the_gradients_of_transformers_experts(kind):
    """Frozen quantised experts still carry gradients to their input, those of the dequantised experts (LoRA trains
    the layers around them): what lets `Trainer` accept such a model."""
    experts = _quantised_experts(kind)
    reference = _plain_copy(experts)
    hidden, index, weights = _routing(16, seed=5)
    gradients = []
    for module in (experts, reference):
        leaf = hidden.clone().requires_grad_()
        module(leaf, index, weights).square().sum().backward()
        gradients.append(leaf.grad)
    # forward and backward: two passes through the same reductions
    torch.testing.assert_close(gradients[0], gradients[1],
                               **reordering_tolerance(gradients[1], 2 * (HIDDEN + INTERMEDIATE + TOP_K)))


def test_trainer_accepts_adapters_on_fp8_experts_kept_as_shipped():
    """transformers 5.17's FP8 quantizer declares its models untrainable; the experts this package keeps FP8 are
    (the test above), on every version."""
    from peft import get_peft_model
    from transformers.trainer_utils import validate_quantization_for_training

    from transformers_drama3.training import drama3_lora_config

    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32)
    assert isinstance(model.backbone.layers[0].mlp.experts, Fp8SelectedExperts) and model.hf_quantizer.is_trainable
    validate_quantization_for_training(get_peft_model(model, drama3_lora_config("default", r=4, lora_alpha=8)))
