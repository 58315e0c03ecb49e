"""The CPU path's linear attention (cpu_linear_attention.py): transformers' gated delta rule layer with a one-token
step of its own.

Tolerances: the step computes the rule's products in another order (the key's and the query's reads of the state as
one batched product, the output as `decay * q^T S + (q . k) delta`), so against transformers' rule it differs by
float32 reordering: the bound of tests/tolerances.py over the step's reductions (the L2 norms, the two reads and
`q . k`, each over the key head dimension: 4 dk), and through a backbone the bound over every reduction of a step
(`backbone_reductions`). A wrong formula (a missing decay, a wrong head grouping) moves the outputs by O(1).
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet, Qwen3_5MoeTextModel

from tests.conftest import GOLDEN_TINY
from tests.tolerances import backbone_reductions, reordering_tolerance
from transformers_drama3 import Drama3Processor, FishOmniForSpeech, cpu_linear_attention
from transformers_drama3.compat import backbone_cache_argument, one_token_state
from transformers_drama3.cpu_linear_attention import CpuGatedDeltaNet, gated_delta_step, use_cpu_linear_attention


def tiny_backbone() -> Qwen3_5MoeTextModel:
    """Two linear-attention layers (2 key heads, 4 value heads: groups of 2) and one full-attention layer. Not the
    golden geometry: its single key head would serve both value heads whichever way heads were grouped."""
    config = Qwen3_5MoeTextConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=3, layer_types=["linear_attention"] * 2 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_num_value_heads=4, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    return Qwen3_5MoeTextModel(config).eval()


def states(cache, layers: int) -> list[torch.Tensor]:
    """The recurrent states of the first `layers` (linear-attention) layers of `cache`."""
    return [one_token_state(SimpleNamespace(layer_idx=i), cache) for i in range(layers)]


def test_one_step_of_the_rule_equals_transformers_rule_up_to_reordering():
    generator = torch.Generator().manual_seed(0)
    b, key_heads, value_heads, dk, dv = 2, 2, 4, 16, 8
    query, key = (torch.randn(b, 1, key_heads, dk, generator=generator) for _ in range(2))
    value = torch.randn(b, 1, value_heads, dv, generator=generator)
    g, beta = -torch.rand(b, 1, value_heads, generator=generator), torch.rand(b, 1, value_heads, generator=generator)
    state = torch.randn(b, value_heads, dk, dv, generator=generator)
    # The query and key heads repeated for their value heads, as 5.17's layer does before calling the rule (newer
    # versions repeat them inside it, which then does nothing).
    expected, expected_state = modeling.torch_recurrent_gated_delta_rule(
        query.repeat_interleave(2, dim=2), key.repeat_interleave(2, dim=2), value, g=g, beta=beta,
        initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, new_state = gated_delta_step(query, key, value, g, beta, state)
    torch.testing.assert_close(out, expected, **reordering_tolerance(expected, 4 * dk))
    torch.testing.assert_close(new_state, expected_state, **reordering_tolerance(expected_state, 4 * dk))
    # Key head h serves value heads 2h and 2h + 1: pairing them otherwise changes the output at O(1).
    swapped, _ = gated_delta_step(query.flip(2), key.flip(2), value, g, beta, state)
    assert (swapped - expected).abs().max() > 0.1


def test_decode_steps_of_the_cpu_layer_equal_transformers_layer_and_leave_the_same_states():
    """A prefill of 6 rows, then two one-token steps (the second reads the convolution and recurrent states the
    first left), batch of 2."""
    plain = tiny_backbone()
    fast = copy.deepcopy(plain)
    assert use_cpu_linear_attention(fast) == 2
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    keyword = backbone_cache_argument()
    cache, fast_cache = DynamicCache(config=plain.config), DynamicCache(config=plain.config)
    with torch.no_grad():
        prefill = plain(input_ids=ids[:, :6], use_cache=True, **{keyword: cache})
        fast_prefill = fast(input_ids=ids[:, :6], use_cache=True, **{keyword: fast_cache})
        # A prefill is transformers' forward itself.
        assert torch.equal(fast_prefill.last_hidden_state, prefill.last_hidden_state)
        for row in (6, 7):
            before = [state.clone() for state in states(fast_cache, 2)]
            expected = plain(input_ids=ids[:, row:row + 1], use_cache=True, **{keyword: cache}).last_hidden_state
            actual = fast(input_ids=ids[:, row:row + 1], use_cache=True, **{keyword: fast_cache}).last_hidden_state
            tolerance = reordering_tolerance(expected, backbone_reductions(plain.config, row + 1))
            torch.testing.assert_close(actual, expected, **tolerance)
            for old, theirs, ours in zip(before, states(cache, 2), states(fast_cache, 2)):
                assert (ours - old).abs().max() > 1e-3  # the step moved the state
                torch.testing.assert_close(ours, theirs, **reordering_tolerance(
                    theirs, backbone_reductions(plain.config, row + 1)))


def test_generation_on_the_float16_path_takes_the_one_token_step_and_float32_keeps_transformers_layer(monkeypatch):
    calls = []
    step = cpu_linear_attention.gated_delta_step
    monkeypatch.setattr(cpu_linear_attention, "gated_delta_step", lambda *args: calls.append(1) or step(*args))
    fast = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="float16")
    reference = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="float32")
    linear = [layer.linear_attn for layer in fast.backbone.layers if hasattr(layer, "linear_attn")]
    assert linear and all(type(layer) is CpuGatedDeltaNet for layer in linear)
    assert all(type(layer.linear_attn) is Qwen3_5MoeGatedDeltaNet
               for layer in reference.backbone.layers if hasattr(layer, "linear_attn"))
    inputs = Drama3Processor.from_pretrained(GOLDEN_TINY)("Hello there.")
    fast.generate(**inputs, max_new_tokens=3, do_sample=False, output_audio=False)
    # Each of the 3 frames is fed back as one row through every linear-attention layer's one-token step.
    assert len(calls) == 3 * len(linear)


def test_a_layer_under_an_accelerate_hook_keeps_transformers_forward():
    backbone = tiny_backbone()
    hooked = backbone.layers[1].linear_attn
    hooked.conv1d._hf_hook = object()  # as accelerate marks a module it offloads
    assert use_cpu_linear_attention(backbone) == 1
    assert type(backbone.layers[0].linear_attn) is CpuGatedDeltaNet
    assert type(hooked) is Qwen3_5MoeGatedDeltaNet


@pytest.mark.parametrize("rows", [1, 3])
def test_without_a_stored_state_the_cpu_layer_is_transformers_layer(rows):
    backbone = tiny_backbone()
    layer = backbone.layers[0].linear_attn
    hidden = torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = layer(hidden_states=hidden)
        use_cpu_linear_attention(backbone)
        assert torch.equal(layer(hidden_states=hidden), expected)


def test_a_decode_step_reads_its_mask_whether_passed_by_name_or_by_position():
    """transformers' layer takes `(hidden_states, cache, attention_mask)`: a mask given by position masks the padded
    sequence's row as one given by name does (a zero row for the second sequence here)."""
    backbone = tiny_backbone()
    use_cpu_linear_attention(backbone)
    layer = backbone.layers[0].linear_attn
    cache = DynamicCache(config=backbone.config)
    with torch.no_grad():
        backbone(input_ids=torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3)), use_cache=True,
                 **{backbone_cache_argument(): cache})
        hidden, mask = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(4)), torch.tensor([[1], [0]])
        by_name = layer(hidden, copy.deepcopy(cache), attention_mask=mask)
        by_position = layer(hidden, copy.deepcopy(cache), mask)
        unmasked = layer(hidden, copy.deepcopy(cache))
    assert torch.equal(by_position, by_name)
    assert torch.equal(by_name[0], unmasked[0]) and not torch.equal(by_name[1], unmasked[1])
