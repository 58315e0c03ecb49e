"""The CPU path's attention (cpu_attention.py): transformers' `sdpa` with a decode step's query heads packed as rows
of their key/value head.

Tolerances: the packed heads compute each output row's sums (the scores over head_dim products, the output over the
window's rows) with the same products as `sdpa` on copied heads, in another order: the reordering bound of
tests/tolerances.py over those reductions; the model's main-token logits, the bound over every reduction of a step
(`main_logit_reductions`). Greedy frames are the golden ones, as for every other attention kernel
(tests/test_attention_backends.py).
"""

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tests.conftest import GOLDEN_TINY
from tests.tolerances import main_logit_reductions, reordering_tolerance
from transformers_drama3 import FishOmniForSpeech, cpu_attention
from transformers_drama3.cpu_attention import CPU_ATTENTION, cpu_sdpa_forward


class Grouped(torch.nn.Module):
    """An attention layer as the kernels see it: query heads in groups of `num_key_value_groups` per key/value head."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def copied_heads_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`sdpa` as a compiled step ran it before the CPU path's attention: a one-row query with a mask attends over
    each key/value head copied once per query head of its group; anything else is transformers' `sdpa`."""
    if query.shape[2] != 1 or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = module.num_key_value_groups
    out = torch.nn.functional.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups),
                                                           attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


COPIED_HEADS = "test_copied_heads_sdpa"
AttentionInterface.register(COPIED_HEADS, copied_heads_forward)
AttentionMaskInterface.register(COPIED_HEADS, sdpa_mask)


def decode_inputs(window: int, batch: int = 2, kv_heads: int = 2, groups: int = 8, dim: int = 64):
    """One query row, a window of keys, and an additive mask hiding each sequence's unused rows."""
    generator = torch.Generator().manual_seed(window)
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=generator)
    key, value = (torch.randn(batch, kv_heads, window, dim, generator=generator) for _ in range(2))
    used = torch.tensor([window - 3, window // 2])[:batch, None]  # rows in use per sequence
    mask = torch.where(torch.arange(window)[None] < used, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    return query, key, value, mask


@pytest.mark.parametrize("window", [16, 256, 1024])
def test_a_decode_step_equals_sdpa_on_copied_heads_up_to_reordering(window):
    query, key, value, mask = decode_inputs(window)
    module = Grouped(8)
    out, weights = cpu_sdpa_forward(module, query, key, value, mask, scaling=0.125)
    assert weights is None and out.shape == (2, 1, 16, 64) and out.is_contiguous()
    for reference_forward in (copied_heads_forward, sdpa_attention_forward):
        reference, _ = reference_forward(module, query, key, value, mask, scaling=0.125)
        torch.testing.assert_close(out, reference, **reordering_tolerance(reference, 64 + window))
    # Query head 8 reads key/value head 1 (8 // 8), not head 0 (8 % 2, an interleaved grouping): O(1) apart.
    lone = torch.nn.functional.scaled_dot_product_attention(query[:, 8:9], key[:, 1:2], value[:, 1:2],
                                                            attn_mask=mask, scale=0.125)  # [b, 1, 1, d]
    torch.testing.assert_close(out[:, :, 8:9], lone.transpose(1, 2), **reordering_tolerance(lone, 64 + window))


@pytest.mark.parametrize("case", ["two rows", "no mask", "a mask per head", "no groups", "softcap"])
def test_everything_else_goes_to_transformers_sdpa(case, monkeypatch):
    query, key, value, mask = decode_inputs(32)
    module, kwargs = Grouped(8), {}
    if case == "two rows":
        query, mask = query.expand(-1, -1, 2, -1), mask.expand(-1, -1, 2, -1)
    elif case == "no mask":
        mask = None
    elif case == "a mask per head":
        mask = mask.expand(-1, 16, -1, -1)
    elif case == "no groups":
        module, key, value = Grouped(1), repeat_kv(key, 8), repeat_kv(value, 8)
    else:
        kwargs = {"softcap": 30.0}
    calls = []
    monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or ("sdpa", None))
    assert cpu_sdpa_forward(module, query, key, value, mask, scaling=0.125, **kwargs) == ("sdpa", None)
    assert calls == [{"dropout": 0.0, "scaling": 0.125, **kwargs}]


def test_the_cpu_path_puts_sdpa_models_on_it_and_keeps_other_kernels():
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY)  # the suite's CPU path (float32: conftest.py)
    assert model.cpu_path is not None
    assert model.config.text_config._attn_implementation == CPU_ATTENTION
    assert model.tower.config._attn_implementation == CPU_ATTENTION
    assert "attn_implementation" not in str(model.config.to_dict())  # nothing of it is saved
    eager = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, attn_implementation="eager")
    assert eager.cpu_path is not None and eager.tower.config._attn_implementation == "eager"


def test_greedy_frames_are_the_golden_ones_and_logits_equal_copied_heads_up_to_reordering(expected):
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY)  # the suite's CPU path (float32), on CPU_ATTENTION
    model.set_experts_implementation("eager")  # the golden values' experts loop
    prompt = expected["prompt_a_rows"][None]
    outputs = {}
    for implementation in (CPU_ATTENTION, COPIED_HEADS):
        model.config._attn_implementation = implementation
        outputs[implementation] = model.generate(prompt, do_sample=False, max_new_tokens=16, output_audio=False,
                                                 output_scores=True, return_dict_in_generate=True)
    fast, reference = outputs[CPU_ATTENTION], outputs[COPIED_HEADS]
    assert torch.equal(fast.codes[0].T, expected["greedy_codes"])
    rows = prompt.shape[1] + len(reference.scores)
    for a, b in zip(fast.scores, reference.scores, strict=True):  # main-token candidate logits [1, V + 1] per frame
        torch.testing.assert_close(a, b, **reordering_tolerance(b, main_logit_reductions(model.config, rows)))
