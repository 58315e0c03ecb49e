"""The CPU path (cpu_path.py, cpu_weights.py): which path a CPU load takes, and its products and frames against the
float32 reference.

Which path runs is read from the model (`model.cpu_path`), never from a CPU flag: "auto" is float16 on every CPU.

Tolerances are first-order rounding bounds of the formats (unit roundoff u: float16 2^-11, bfloat16 2^-8):
- a float16 product of up to `FLOAT16_ROWS` rows rounds each weight and each input by at most u relative,
  accumulates in float32 and rounds its output by u: `|y' - y| <= 2u * sum_i |x_i w_i| + u |y|`; one of more rows
  rounds only the weights: `|y' - y| <= u * sum_i |x_i w_i|`; float32's own rounding, at most `K * 2^-24 *
  sum_i |x_i w_i|` for K inputs, is added to both;
- an int8 product rounds each weight of row r by at most `s_r / 2` (s_r its row's scale). Through
  `_weight_int8pack_mm` it also rounds its bfloat16 input by u and its bfloat16 output by u:
  `|y' - y| <= s_r / 2 * sum_i |x_i| + u * sum_i |x_i w_i| + u |y|`. Through fbgemm (`int8_linear`) it rounds each
  input of a row by at most `m / STEPS` (m the row's largest |x_i|, STEPS = 2 * 63 * 126^2 for its three 7-bit parts,
  cpu_weights.py) against the rounded weights w'; its float32 work (the parts' scaling, one rounding of each part's
  product and scale, the parts' sum, the final scale) is about 10 roundings of at most `sum_i |x_i w'_i|`, bounded
  here by 16: `|y' - y| <= s_r / 2 * sum_i |x_i| + m / STEPS * sum_i |w'_i| + 16 * 2^-24 * sum_i |x_i w'_i|`.
Greedy frames: the fast path's frames equal the reference's up to the first frame where the reference's top-2 margin
is within twice the largest logit difference measured between the two paths on the reference's own frames (a flip
needs the two logits to move by half the margin each), plus `MARGIN` for the step's float32 reordering.
"""

import numpy
import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.moe import grouped_mm_experts_forward

from tests.conftest import GOLDEN_TINY
from tests.tolerances import codec_decode_reductions, reordering_tolerance
from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.cpu_path import ENVIRONMENT_VARIABLE, apply_cpu_path, resolve_cpu_path
from transformers_drama3 import cpu_weights
from transformers_drama3.cpu_weights import (FLOAT16_ROWS, LEVELS, PACKED_INT8, PARTS, CpuEmbedding, CpuExperts,
                                             CpuLinear, int8_linear, packed_weight, quantize_rows, stored)

FLOAT16_U = 2.0**-11
BFLOAT16_U = 2.0**-8
MARGIN = 1e-3  # float32 reordering between a step and the teacher-forced pass (tests/test_sampling_law.py)
STEPS = 2 * LEVELS * (2 * LEVELS) ** (PARTS - 1)  # fbgemm's int8 products: an input's rounding is at most m / STEPS
# The int8 products' kernels this torch has: fbgemm's (`packed`) where it is built in, torch's weight-only one always.
INT8_KERNELS = [True, False] if PACKED_INT8 else [False]


@pytest.fixture
def default_path(monkeypatch):
    """The CPU path a plain load takes (the suite pins float32 for its exact comparisons: conftest.py)."""
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)


def product_bound(x: torch.Tensor, weight: torch.Tensor, fast: CpuLinear) -> torch.Tensor:
    """The first-order rounding bound of the module docstring for `x [n, in] @ weight.T` computed by `fast`, per
    output `[n, out]`."""
    magnitude = x.abs() @ weight.abs().T  # [n, out] sum_i |x_i w_i|
    exact = (x @ weight.T).abs()
    if fast.weight_format == "float16":
        float32_rounding = x.shape[-1] * 2.0**-24 * magnitude
        if x.shape[0] <= FLOAT16_ROWS:
            return 2 * FLOAT16_U * magnitude + FLOAT16_U * exact + float32_rounding
        return FLOAT16_U * magnitude + float32_rounding
    weights_rounding = x.abs().sum(-1, keepdim=True) * fast.scale.float()[None] / 2
    if not fast.packed:
        return weights_rounding + BFLOAT16_U * (magnitude + exact)
    return weights_rounding + fbgemm_bound(x, fast.weight.float() * fast.scale.float()[:, None])


def fbgemm_bound(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """The module docstring's bound `[n, out]` of `int8_linear(x [n, in])` against `x @ rounded.T`, `rounded [out, in]`
    its weights w' as stored (int8 codes times their row's scale)."""
    inputs_rounding = x.abs().amax(-1, keepdim=True) / STEPS * rounded.abs().sum(-1)[None]
    return inputs_rounding + 16 * 2.0**-24 * (x.abs() @ rounded.abs().T)


def test_a_plain_load_on_a_cpu_takes_the_float16_path(default_path):
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY)
    assert model.cpu_path == resolve_cpu_path() == "float16"
    weight = model.tower.residual_layers[0].transformer_layer.feed_forward.w1.weight
    assert weight.dtype == torch.float16
    assert next(model.codec.parameters()).dtype == torch.float32


def codec_linears(codec) -> dict[str, torch.nn.Module]:
    return {path: module for path, module in codec.named_modules() if isinstance(module, (torch.nn.Linear, CpuLinear))}


@pytest.mark.parametrize("path", ["float16", "int8"])
def test_the_codec_decoding_transformer_is_float16_and_decodes_as_float32_on_rounded_weights(default_path, path):
    """On the float16 and int8 paths the codec's `quantizer.post_module` linears hold float16 weights widened to
    float32 at each product (cpu_path.narrow_codec), read from a map of `codec.pth` of their own: the audio is then
    the float32 codec's with those weights rounded to float16, bit for bit (the same float32 products), streamed
    audio still equals one-shot audio to float32 reordering, and the encoding side is the float32 one."""
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path=path)
    reference = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="float32").codec
    linears = codec_linears(model.codec)
    narrowed = {name for name, module in linears.items() if isinstance(module, CpuLinear)}
    assert narrowed and all(name.startswith("quantizer.post_module.") for name in narrowed)
    assert narrowed == {name for name in codec_linears(reference) if name.startswith("quantizer.post_module.")}
    assert all(linears[name].widened and linears[name].weight.dtype == torch.float16 for name in narrowed)
    others = [p for name, p in model.codec.named_parameters() if name.rsplit(".", 1)[0] not in narrowed]
    assert others and all(p.dtype == torch.float32 for p in others) and model.codec.dtype == torch.float32
    with torch.no_grad():
        for name in narrowed:
            reference.get_submodule(name).weight.copy_(reference.get_submodule(name).weight.half().float())
    codes = torch.randint(0, 16, (1, model.config.codec_config.num_codebooks, 9))
    audio = model.codec.decode(codes).audio_values
    assert torch.equal(audio, reference.decode(codes).audio_values)
    stream = model.codec.stream()
    streamed = torch.cat([stream.decode(codes[..., start : start + 2]).audio_values for start in range(0, 9, 2)], -1)
    torch.testing.assert_close(streamed, audio, **reordering_tolerance(audio, codec_decode_reductions(model.codec)))
    waveform = torch.randn(1, 3 * model.config.codec_config.frame_length) * 0.1
    sampling_rate = model.config.codec_config.sample_rate
    assert torch.equal(model.codec.encode(waveform, sampling_rate).audio_codes,
                       reference.encode(waveform, sampling_rate).audio_codes)


def test_a_widened_linear_is_float16_only():
    with pytest.raises(ValueError, match="only float16 weights can be widened"):
        CpuLinear(torch.nn.Linear(8, 4), "int8", widened=True)


def test_the_path_can_be_chosen_and_an_explicit_dtype_keeps_a_plain_load(default_path, monkeypatch):
    assert FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32).cpu_path is None
    reference = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="float32")
    assert reference.cpu_path == "float32" and reference.lm_head.weight.dtype == torch.float32
    assert isinstance(reference.tower.heads[0], torch.nn.Linear)
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "int8")
    quantised = FishOmniForSpeech.from_pretrained(GOLDEN_TINY)
    assert quantised.cpu_path == "int8" and quantised.tower.heads[0].weight.dtype == torch.int8
    with pytest.raises(ValueError, match="refuses|save"):
        quantised.save_pretrained("/nonexistent")


def test_bad_paths_are_refused_before_loading(default_path, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="cpu_path must be one of auto, bfloat16, float16, int8, float32"):
        FishOmniForSpeech.from_pretrained(tmp_path / "missing", cpu_path="fast")
    with pytest.raises(ValueError, match="device_map"):
        FishOmniForSpeech.from_pretrained(tmp_path / "missing", cpu_path="float16", device_map={"": "disk"})
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "int4")
    with pytest.raises(ValueError, match=ENVIRONMENT_VARIABLE):
        FishOmniForSpeech.from_pretrained(tmp_path / "missing")


@pytest.mark.parametrize("rows", [1, FLOAT16_ROWS, FLOAT16_ROWS + 1, 10])
@pytest.mark.parametrize("weight_format,packed", [("float16", False)] + [("int8", kernel) for kernel in INT8_KERNELS])
@pytest.mark.parametrize("outlier", [False, True])
def test_a_cpu_linear_is_within_its_rounding_bound(weight_format, packed, rows, outlier, monkeypatch):
    """Also with one input of a row 300 times the others (a real model's activations have such outliers): the int8
    products' input rounding is relative to a row's largest value."""
    monkeypatch.setattr(cpu_weights, "PACKED_INT8", packed)
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    torch.nn.init.normal_(linear.weight, std=0.3, generator=generator)
    x = torch.randn(1, rows, 64, generator=generator)
    if outlier:
        x[0, :, 5] = 300.0
    fast = CpuLinear(linear, weight_format)
    assert fast.packed == packed
    with torch.no_grad():
        expected, actual = linear(x), fast(x)
        bound = product_bound(x.view(-1, 64), linear.weight, fast).view(1, rows, 48)
    assert actual.dtype == torch.float32
    assert ((actual - expected).abs() <= bound).all()
    assert (actual - expected).abs().max() > 0  # the weights really are rounded


@pytest.mark.skipif(not PACKED_INT8, reason="this torch has no fbgemm: the int8 products are torch's weight-only ones")
def test_fbgemm_int8_products_round_their_inputs_far_less_than_bfloat16():
    """Against the rounded weights themselves, where only the inputs' rounding is left: `int8_linear` within
    `m / STEPS` per input (module docstring), and at least 50x closer than the bfloat16 inputs of
    `_weight_int8pack_mm` on the same weights (measured 300x-8000x: `m / STEPS` against 2^-9 |x_i|)."""
    generator = torch.Generator().manual_seed(2)
    codes, scale = quantize_rows(torch.randn(256, 512, generator=generator), torch.float32)
    rounded = codes.double() * scale.double()[:, None]  # [out, in]
    x = torch.randn(4, 512, generator=generator)
    x[1, 3] = -300.0  # an outlier in one row
    x[2] = 0.0  # a row of zeros
    expected = x.double() @ rounded.T
    fbgemm = int8_linear(x, codes, scale).double()
    bfloat16 = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), codes, scale.bfloat16()).double()
    assert ((fbgemm - expected).abs() <= fbgemm_bound(x.double(), rounded)).all()
    assert torch.equal(fbgemm[2], torch.zeros(256, dtype=torch.float64))
    assert (fbgemm - expected).abs().max() * 50 < (bfloat16 - expected).abs().max()


@pytest.mark.skipif(not PACKED_INT8, reason="this torch has no fbgemm: the int8 products are torch's weight-only ones")
def test_a_packed_weight_is_made_once_and_never_taken_for_a_later_weight_at_its_address():
    """`packed_weight` keeps one packed copy per weight; once a weight's tensors are freed, a new weight at the same
    addresses gets its own, so its products are its own. The same addresses for sure: each weight's tensors are made
    over the same two numpy buffers (torch's allocator does not reliably hand a freed address back)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=generator)
    codes_memory, scale_memory = numpy.empty((32, 64), numpy.int8), numpy.empty(32, numpy.float32)
    addresses = set()
    for _ in range(3):
        new_codes, new_scale = quantize_rows(torch.randn(32, 64, generator=generator), torch.float32)
        codes_memory[...], scale_memory[...] = new_codes.numpy(), new_scale.numpy()
        codes, scale = torch.from_numpy(codes_memory), torch.from_numpy(scale_memory)
        addresses.add((codes.data_ptr(), scale.data_ptr()))
        assert packed_weight(codes, scale) is packed_weight(codes, scale)
        rounded = codes.double() * scale.double()[:, None]
        error = (int8_linear(x, codes, scale).double() - x.double() @ rounded.T).abs()
        assert (error <= fbgemm_bound(x.double(), rounded)).all()
        del codes, scale
    assert len(addresses) == 1


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("weight_format", ["float16", "int8"])
def test_cpu_experts_equal_transformers_experts_on_the_same_rounded_weights(golden_model, weight_format, tokens):
    """The decode loop (3 tokens x 2 experts < 4 experts) and the per-expert prefill (a token count with more pairs
    than experts) against transformers' grouped_mm forward on the stored weights, dequantised: only the inputs' and
    outputs' rounding differ."""
    experts = golden_model.backbone.layers[0].mlp.experts
    config = golden_model.config.text_config
    fast = CpuExperts.from_experts(experts, config, weight_format)
    generator = torch.Generator().manual_seed(1)
    count = tokens if tokens * config.num_experts_per_tok < config.num_experts else 7
    hidden = torch.randn(count, config.hidden_size, generator=generator)
    index = torch.stack([torch.randperm(config.num_experts, generator=generator)[: config.num_experts_per_tok]
                         for _ in range(count)])
    weights = torch.rand(count, config.num_experts_per_tok, generator=generator)

    class Rounded:  # the stored weights in float32, as transformers' forward reads them
        has_gate, has_bias, is_transposed, has_post_expert_norm, _is_expert_parallel = True, False, False, False, False
        num_experts, _apply_gate = config.num_experts, fast._apply_gate
        gate_up_proj = fast.dequantized("gate_up_proj", None, torch.float32)
        down_proj = fast.dequantized("down_proj", None, torch.float32)

    with torch.no_grad():
        expected = grouped_mm_experts_forward(Rounded, hidden, index, weights)
        actual = fast(hidden, index, weights)
    u = FLOAT16_U if weight_format == "float16" else BFLOAT16_U
    bound = torch.zeros(count, config.hidden_size, dtype=torch.float64)
    for token in range(count):
        for k, expert in enumerate(index[token].tolist()):
            bound[token] += weights[token, k] * pair_bound(hidden[token].double(), Rounded.gate_up_proj[expert].double(),
                                                           Rounded.down_proj[expert].double(), u)
    assert ((actual - expected).abs() <= bound).all()


@pytest.mark.parametrize("weight_format", ["float16", "int8"])
def test_quantised_experts_converted_a_few_at_a_time_equal_the_whole_layer_converted(golden_model, weight_format,
                                                                                       monkeypatch):
    """`from_experts` dequantises the FP8 experts a few at a time (the load's peak memory): bit for bit what storing
    the whole layer's float32 weights gives, with chunks that do not divide the experts (4 experts, 3 at a time)."""
    experts = golden_model.backbone.layers[0].mlp.experts
    monkeypatch.setattr(cpu_weights, "DEQUANTISED_EXPERTS", 3)
    fast = CpuExperts.from_experts(experts, golden_model.config.text_config, weight_format)
    for name in ("gate_up_proj", "down_proj"):
        whole = stored(experts.dequantized(name, None, torch.float32), weight_format)
        kept = (getattr(fast, name), getattr(fast, f"{name}_scale"))
        for expected, actual in zip(whole, kept):
            assert actual.dtype == expected.dtype and torch.equal(actual, expected)
        assert (kept[1] is None) == (len(whole) == 1)


def pair_bound(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, u: float) -> torch.Tensor:
    """First-order bound `[H]` of one (token, expert) pair's output error when each product's input and output are
    rounded with unit roundoff `u` (the weights being the same): through `g = gate_up @ x`, the gate
    `a = silu(g_gate) * g_up` (|silu'| <= 1.1) and `down @ a`."""
    g = gate_up @ x
    g_error = u * (gate_up.abs() @ x.abs()) + u * g.abs()
    gate, up = g.chunk(2)
    gate_error, up_error = g_error.chunk(2)
    a = F.silu(gate) * up
    a_error = 1.1 * gate_error * up.abs() + F.silu(gate).abs() * up_error
    return down.abs() @ a_error + u * (down.abs() @ a.abs()) + u * (down @ a).abs()


def check_margin_rule(reference, fast, expected: torch.Tensor, actual: torch.Tensor, prompt: int,
                      margin: float = MARGIN) -> float:
    """The module docstring's rule for greedy frames: `expected` `[P + n, 11]` made by `reference`, `actual` by a
    fast path whose teacher-forced logits are `fast`'s (`margin`: what the fast path's step may add by reordering
    float32 work). Returns the share of the reference's decisions the rule covers."""
    with torch.no_grad():
        ours, theirs = fast(expected[None]), reference(expected[None])
    frames = len(expected) - prompt
    main, heads = theirs.main_logits[0, prompt - 1 : -1], theirs.codebook_logits[0, prompt:]  # decisions of frames 1..n
    # Per frame: the largest difference of its logits between the two paths (main token and its 9 codes).
    difference = torch.maximum((ours.main_logits - theirs.main_logits)[0, prompt - 1 : -1].abs().amax(-1),
                               (ours.codebook_logits - theirs.codebook_logits)[0, prompt:].abs().amax((-2, -1)))
    top_main, top_heads = main.topk(2).values, heads.topk(2).values
    margins = torch.minimum(top_main[:, 0] - top_main[:, 1], (top_heads[..., 0] - top_heads[..., 1]).amin(-1))
    close = (margins[:frames] < 2 * difference[:frames] + margin).nonzero()
    decided = int(close[0, 0]) if len(close) else frames
    assert torch.equal(actual[: prompt + decided], expected[: prompt + decided])
    # Every decision of the reference's frames that the rule covers is the fast path's too (teacher-forced: the tiny
    # model's random heads have near ties in most frames, which end the generated comparison early).
    choices = torch.cat((main[:frames].argmax(-1, keepdim=True), heads[:frames].argmax(-1)), 1)  # [frames, NCB]
    fast_choices = torch.cat((ours.main_logits[0, prompt - 1 : -1][:frames].argmax(-1, keepdim=True),
                              ours.codebook_logits[0, prompt:][:frames].argmax(-1)), 1)
    gaps = torch.cat(((top_main[:, 0] - top_main[:, 1])[:frames, None], (top_heads[..., 0] - top_heads[..., 1])[:frames]), 1)
    covered = gaps > 2 * difference[:frames, None] + margin  # [frames, 1 + NCB - 1]
    assert torch.equal(choices[covered], fast_choices[covered])
    return covered.float().mean().item()


@pytest.mark.parametrize("path", ["float16", "bfloat16"])
def test_greedy_frames_equal_the_float32_path_up_to_the_margin_rule(golden_processor, path):
    reference = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="float32")
    fast = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path=path)
    inputs = golden_processor("Hello there, how are you today?")
    expected = reference.generate(**inputs, max_new_tokens=16, do_sample=False, output_audio=False).sequences[0]
    actual = fast.generate(**inputs, max_new_tokens=16, do_sample=False, output_audio=False).sequences[0]
    covered = check_margin_rule(reference, fast, expected, actual, inputs["input_ids"].shape[1])
    # float16's rounding leaves most decisions covered, bfloat16's (8x coarser) fewer: the check is not empty. (int8's
    # rounding covers none on this model: it is not a default path for that reason, docs/performance.md.)
    assert covered > (0.5 if path == "float16" else 0.1), covered


def test_tables_exact_in_bfloat16_are_kept_so_and_look_up_the_float32_rows(golden_model):
    """The golden checkpoint's tables are bfloat16: kept in 16 bits, they give the float32 load's rows bit for bit."""
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="float16")
    ids = torch.arange(model.tower.codebook_embeddings.num_embeddings).view(4, -1)
    for name in ("tower.codebook_embeddings", "tower.residual_layers.0.codebook_embedding",
                 "tower.shared_layers.1.semantic_embedding", "backbone.embed_tokens"):
        table, reference = model.get_submodule(name), golden_model.get_submodule(name)
        assert isinstance(table, CpuEmbedding) and table.weight.dtype == torch.bfloat16
        rows = ids.clamp(max=table.num_embeddings - 1)
        assert torch.equal(table(rows), reference(rows)) and table(rows).dtype == torch.float32
    assert model.tower.compute_dtype == torch.float32


def test_apply_cpu_path_on_a_built_model_converts_in_place(golden_model):
    model = FishOmniForSpeech(golden_model.config).eval()
    apply_cpu_path(model, "float16")
    assert model.cpu_path == "float16"
    assert isinstance(model.backbone.layers[0].mlp.experts, CpuExperts)
    assert all(isinstance(head, CpuLinear) for head in model.tower.heads)
    assert isinstance(model.codec.quantizer.post_module.layers[0].attention.wqkv, CpuLinear)  # from its own weights
    # Random float32 tables hold values bfloat16 cannot: they stay as they are.
    assert type(model.tower.codebook_embeddings) is torch.nn.Embedding
    with pytest.raises(ValueError, match="apply_cpu_path takes one of"):
        apply_cpu_path(model, "auto")
    assert stored(torch.ones(2, 8), "int8")[0].dtype == torch.int8
    assert stored(torch.ones(2, 8), "int8", torch.float32)[1].dtype == torch.float32
