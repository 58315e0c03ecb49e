"""accelerate device maps on a CPU-only machine: disk and cpu+disk offload give the in-memory outputs bit for bit;
the codec is never offloaded (a `"codec"` entry places it, or it joins the input device); bad maps fail clearly.

Tolerance: exact equality. Offloading only moves the same weights between RAM, disk and meta tensors; every
computation runs on the CPU with the same kernels in the same order, so any difference would be a placement bug.
"""

import logging

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.codec_file import take_codec_placement
from transformers_drama3.device_placement import execution_device

from .conftest import GOLDEN_TINY

GREEDY_FRAMES = 8
# Backbone layers 1 and 3 and lm_head on disk, the rest in memory. (Every disk-offloaded module re-reads its
# weights from disk at each call, so the tower, called 13 times a frame, stays in memory to keep the test fast.)
CPU_AND_DISK = {
    "backbone.embed_tokens": "cpu",
    "backbone.layers.0": "cpu",
    "backbone.layers.1": "disk",
    "backbone.layers.2": "cpu",
    "backbone.layers.3": "disk",
    "backbone.norm": "cpu",
    "backbone.rotary_emb": "cpu",
    "lm_head": "disk",
    "tower": "cpu",
}


def _outputs(model, prompt, generate: bool):
    """Teacher-forced logits, codec audio of the prompt's audio rows and (if `generate`) a greedy generation."""
    with torch.no_grad():
        forward = model(prompt)
    audio_rows = prompt[0, model.is_audio_row(prompt[0, :, 0])]  # [frames, 11]
    audio = model.codec.decode(audio_rows[:, 1:].T[None]).audio_values[:, 0]
    generated = model.generate(prompt, do_sample=False, max_new_tokens=GREEDY_FRAMES) if generate else None
    return forward, audio, generated


@pytest.fixture(scope="module")
def in_memory(prompt):
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32)
    return _outputs(model, prompt, generate=True)


@pytest.mark.parametrize(
    "placement, generate",
    [
        pytest.param({"device_map": {"": "disk"}}, True, id="disk-only"),
        pytest.param({"device_map": CPU_AND_DISK}, True, id="cpu+disk"),
        pytest.param({"device_map": "auto", "max_memory": {"cpu": "15MB"}}, False, id="auto-max_memory"),
    ],
)
def test_offloaded_model_gives_the_in_memory_outputs(placement, generate, prompt, in_memory, tmp_path):
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, offload_folder=tmp_path, **placement)
    assert "disk" in model.hf_device_map.values()
    assert "codec" not in model.hf_device_map  # transformers placed the model without its codec
    assert {p.device for p in model.codec.parameters()} == {torch.device("cpu")}  # the input device, not offloaded

    forward, audio, generated = _outputs(model, prompt, generate)
    reference_forward, reference_audio, reference_generated = in_memory
    assert torch.equal(forward.main_logits, reference_forward.main_logits)
    assert torch.equal(forward.codebook_logits, reference_forward.codebook_logits)
    assert audio.shape == (1, 6 * 2048) and torch.equal(audio, reference_audio)
    if generate:
        assert torch.equal(generated.sequences, reference_generated.sequences)
        assert all(torch.equal(a, b) for a, b in zip(generated.codes, reference_generated.codes))
        assert all(torch.equal(a, b) for a, b in zip(generated.audio, reference_generated.audio))


def test_a_codec_entry_in_the_device_map_places_the_codec(tmp_path):
    device_map = {"backbone": "cpu", "lm_head": "cpu", "tower": "disk", "codec": "cpu"}
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, device_map=device_map, offload_folder=tmp_path)
    assert {p.device for p in model.codec.parameters()} == {torch.device("cpu")}
    assert device_map["codec"] == "cpu"  # the caller's dict is not modified
    assert model.hf_device_map == {"backbone": "cpu", "lm_head": "cpu", "tower": "disk"}


@pytest.mark.parametrize(
    "device_map",
    [{"backbone": "cpu", "lm_head": "cpu", "tower": "cpu", "codec": "disk"},
     {"backbone": "cpu", "lm_head": "cpu", "tower": "cpu", "codec.encoder": "cpu", "codec.decoder": "disk"}],
    ids=["codec-on-disk", "codec-split"],
)
def test_offloading_or_splitting_the_codec_is_refused_before_loading(device_map, tmp_path, monkeypatch):
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(ValueError, match="codec stays whole on one device"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, device_map=device_map, offload_folder=tmp_path)


def test_unknown_module_name_gives_accelerates_error(tmp_path):
    """A misspelt entry leaves lm_head without a device: accelerate names the parameter."""
    device_map = {"backbone": "disk", "lm_haed": "cpu", "tower": "cpu"}
    with pytest.warns(UserWarning, match="lm_haed"), pytest.raises(ValueError, match="lm_head.weight"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, device_map=device_map, offload_folder=tmp_path)


def test_too_small_max_memory_without_offload_folder_gives_transformers_error():
    with pytest.raises(ValueError, match="offload_folder"):
        FishOmniForSpeech.from_pretrained(GOLDEN_TINY, device_map="auto", max_memory={"cpu": "15MB"})


# ---------------------------------------------------------------------------------------------------------------
# Device-map helpers
# ---------------------------------------------------------------------------------------------------------------


def test_take_codec_placement():
    device_map = {"": "disk", "codec": "cpu"}
    assert take_codec_placement(device_map) == ({"": "disk"}, torch.device("cpu"))
    assert device_map == {"": "disk", "codec": "cpu"}
    assert take_codec_placement({"codec.encoder": "cpu", "codec.decoder": "cpu", "tower": "disk"}) == (
        {"tower": "disk"}, torch.device("cpu"))
    assert take_codec_placement({"codec_extra": "disk"}) == ({"codec_extra": "disk"}, None)  # not the codec
    assert take_codec_placement("auto") == ("auto", None)
    assert take_codec_placement(None) == (None, None)


def test_execution_device_reads_the_hook_not_the_meta_parameters(tmp_path):
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, device_map={"": "disk"}, offload_folder=tmp_path)
    layer = model.backbone.layers[0]
    assert next(layer.parameters()).is_meta
    assert execution_device(layer) == torch.device("cpu")
    assert execution_device(nn.Linear(2, 2, device="meta")) == torch.device("meta")  # no hook: the parameters
