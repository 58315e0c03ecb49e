"""Attention kernels chosen at load (`attn_implementation=`): they reach the backbone and the tower, give the same
frames, and what a captured step cannot run is refused before any work.

Tolerance: eager attention (matmul, float32 softmax, matmul) and sdpa compute the same float32 sums in another order,
so their logits differ by rounding only (tests/tolerances.py); a mask or a scale that differs between the kernels
changes them by O(1).
"""

import pytest
import torch
from transformers import AutoModel

from transformers_drama3 import FishOmniForSpeech

from .conftest import GOLDEN_TINY
from .tolerances import codebook_logit_reductions, main_logit_reductions, reordering_tolerance



@pytest.fixture(scope="module")
def models():
    loaded = {}
    for implementation in ("eager", "sdpa"):
        model = AutoModel.from_pretrained(GOLDEN_TINY, dtype=torch.float32, attn_implementation=implementation)
        model.set_experts_implementation("eager")  # the golden values' experts loop
        loaded[implementation] = model
    return loaded


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_chosen_kernel_reaches_backbone_and_tower(models, implementation):
    config = models[implementation].config
    assert config._attn_implementation == implementation
    assert config.text_config._attn_implementation == implementation
    assert config.audio_decoder_config._attn_implementation == implementation


def test_the_default_is_sdpa_everywhere():
    config = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32).config
    assert config._attn_implementation == config.text_config._attn_implementation == "sdpa"
    assert config.audio_decoder_config._attn_implementation == "sdpa"


def test_kernels_give_the_same_logits_and_the_golden_frames(models, expected):
    rows = expected["tf_rows"][None]
    with torch.no_grad():
        eager, sdpa = models["eager"](rows), models["sdpa"](rows)
    config, length = models["eager"].config, rows.shape[1]
    torch.testing.assert_close(sdpa.main_logits, eager.main_logits,
                               **reordering_tolerance(eager.main_logits, main_logit_reductions(config, length)))
    torch.testing.assert_close(sdpa.codebook_logits, eager.codebook_logits,
                               **reordering_tolerance(eager.codebook_logits, codebook_logit_reductions(config, length)))
    for model in models.values():
        out = model.generate(expected["prompt_a_rows"][None], do_sample=False, max_new_tokens=16, output_audio=False)
        assert torch.equal(out.codes[0].T, expected["greedy_codes"])


def test_switching_after_load_reaches_the_tower(models, expected):
    model = models["sdpa"]
    try:
        model.set_attn_implementation("eager")
        assert model.tower.config._attn_implementation == "eager"
        with torch.no_grad():
            logits = model(expected["tf_rows"][None]).main_logits
            reference = models["eager"](expected["tf_rows"][None]).main_logits
        torch.testing.assert_close(logits, reference, atol=0, rtol=0)  # the same kernels now: bit for bit
    finally:
        model.set_attn_implementation("sdpa")


def test_a_missing_flash_attention_package_is_transformers_clear_error():
    with pytest.raises(ImportError, match="FlashAttention2"):
        AutoModel.from_pretrained(GOLDEN_TINY, dtype=torch.float32, attn_implementation="flash_attention_2")


def test_cuda_graphs_refuse_flash_attention_and_dispatched_models_before_any_work(models, expected, monkeypatch):
    model, prompt = models["sdpa"], expected["prompt_a_rows"][None]
    monkeypatch.setattr(model.backbone, "forward", lambda *a, **k: pytest.fail("the prefill ran"))
    monkeypatch.setattr(model.config.text_config, "_attn_implementation_internal", "flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        model.generate(prompt, fast_decode=True, max_new_tokens=2)
    monkeypatch.setattr(model.config.text_config, "_attn_implementation_internal", "sdpa")
    monkeypatch.setattr(model, "hf_device_map", {"backbone": "cpu", "tower": "disk"}, raising=False)
    with pytest.raises(ValueError, match="whole model on one device"):
        model.generate(prompt, fast_decode=True, max_new_tokens=2)
