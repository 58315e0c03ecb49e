"""Giving back the checkpoint's mapped pages during a CPU-path load (mapped_pages.py), and the load in the checkpoint's
bfloat16 that needs it (cpu_path.load_dtype): the model it makes equals a float32 load converted, tensor for tensor.

What is resident is read per map from /proc/self/smaps, so these tests need Linux; elsewhere `PageRelease` does
nothing and they are skipped.
"""

import os
import shutil
import sys

import pytest
import torch
from torch import nn
from transformers.core_model_loading import MergeModulelist

from tests.conftest import GOLDEN_TINY
from transformers_drama3 import FishOmniForSpeech, mapped_pages, modeling_drama3
from transformers_drama3.checkpoint_mapping import checkpoint_shards
from transformers_drama3.cpu_path import ENVIRONMENT_VARIABLE, apply_cpu_path, load_dtype
from transformers_drama3.generation.stored_steps import model_description
from transformers_drama3.mapped_pages import (PAGE, MergeReleasingSources, PageRelease, file_maps, unviewed_pages,
                                               viewed_ranges)
from transformers_drama3.testing import write_tiny_checkpoint

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")


@pytest.fixture
def golden_copy(tmp_path) -> str:
    """The golden checkpoint copied to files of this test's own: no other model of the process maps them."""
    return shutil.copytree(GOLDEN_TINY, tmp_path / "tiny")


@pytest.fixture
def default_path(monkeypatch):
    """The CPU path a plain load takes (the suite pins float32 for its exact comparisons: conftest.py)."""
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)


def resident_bytes(paths: list[str]) -> int:
    """This process's resident bytes in its maps of the files `paths` (the `Rss:` lines of /proc/self/smaps)."""
    wanted, total, counting = {os.path.realpath(path) for path in paths}, 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):  # a map's header line
                counting = len(fields) == 6 and fields[5] in wanted
            elif counting and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_unviewed_pages_are_the_whole_pages_between_views():
    base = 1000 * PAGE
    maps = [(base, base + 10 * PAGE)]
    # Nothing viewed: the whole map.
    assert unviewed_pages(maps, []) == maps
    # A view inside pages 2-3 (starting mid-page 2, ending mid-page 4): pages 0-1 and 5-9 are free; 2, 3 and 4 hold
    # bytes of the view.
    view = (base + 2 * PAGE + 100, base + 4 * PAGE + 1)
    assert unviewed_pages(maps, [view]) == [(base, base + 2 * PAGE), (base + 5 * PAGE, base + 10 * PAGE)]
    # Two views sharing a page, one at the map's start and one running past its end: only the pages between.
    views = [(base, base + PAGE + 8), (base + PAGE + 8, base + 2 * PAGE), (base + 7 * PAGE, base + 12 * PAGE)]
    assert unviewed_pages(maps, views) == [(base + 2 * PAGE, base + 7 * PAGE)]
    # A gap shorter than a page between two views frees nothing; views of another map change nothing here.
    views = [(base, base + 5 * PAGE - 8), (base + 5 * PAGE + 8, base + 10 * PAGE), (base + 20 * PAGE, base + 30 * PAGE)]
    assert unviewed_pages(maps, views) == []
    # Two maps: each gets its own runs.
    maps = [(base, base + 2 * PAGE), (base + 4 * PAGE, base + 6 * PAGE)]
    assert unviewed_pages(maps, [(base + PAGE, base + 5 * PAGE)]) == [(base, base + PAGE), (base + 5 * PAGE, base + 6 * PAGE)]


class Holder(nn.Module):
    """A module viewing some tensors (as a half-converted model does)."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        for index, tensor in enumerate(tensors):
            self.register_buffer(f"t{index}", tensor)


@linux_only
def test_pages_no_tensor_views_are_given_back_and_viewed_ones_keep_their_values(golden_copy):
    shards = checkpoint_shards(str(golden_copy))
    model = FishOmniForSpeech.from_pretrained(golden_copy, dtype=torch.bfloat16)  # bfloat16 weights stay map views
    mapped = [t for t in model.parameters() if viewed_ranges(Holder([t]), file_maps(shards))]
    assert sum(t.nbytes for t in mapped) > 4 * 2**20, "transformers no longer keeps bfloat16 weights as map views"
    for tensor in mapped:
        tensor.float().sum()  # read every page
    read = resident_bytes(shards)
    assert read >= sum(t.nbytes for t in mapped) - len(mapped) * PAGE
    kept = mapped[: len(mapped) // 2]
    with torch.no_grad():
        kept[0][0] = 12.5  # changed in memory (a private copy of its page): never read back from the file
    expected = [t.clone() for t in kept]
    PageRelease(Holder(kept), shards)()
    # What stays resident: the kept tensors' pages (each may share a page with a neighbour at either end).
    assert resident_bytes(shards) <= sum(t.nbytes for t in kept) + 2 * len(kept) * PAGE < read
    assert all(torch.equal(t, e) for t, e in zip(kept, expected))
    del model


@linux_only
def test_the_loader_gives_back_each_layers_expert_pages_once_it_has_stacked_them(tmp_path, monkeypatch):
    """A plain bfloat16 load (the FP8 experts are read through the map and stacked, one layer at a time): with the
    release, the experts' pages are not resident after the load (up to a page at either end of each expert's tensor);
    the loaded model is the same tensor for tensor."""
    loads = {}
    for name in ("released", "kept"):
        if name == "kept":
            monkeypatch.setattr(modeling_drama3, "releasing_merges", lambda *args: None)
        path = shutil.copytree(GOLDEN_TINY, tmp_path / name)
        model = FishOmniForSpeech.from_pretrained(path, dtype=torch.bfloat16)
        loads[name] = (model, resident_bytes(checkpoint_shards(str(path))))
    (released, released_bytes), (kept, kept_bytes) = loads["released"], loads["kept"]
    experts = [t for name, t in released.named_parameters() if ".experts." in name]
    pieces = sum(t.shape[0] for t in experts)  # the checkpoint's tensors: one per expert
    assert released_bytes <= kept_bytes - sum(t.nbytes for t in experts) + 2 * pieces * PAGE
    theirs = kept.state_dict()
    assert all(torch.equal(t, theirs[name]) for name, t in released.state_dict().items())


def test_a_merge_that_releases_stacks_as_transformers_merge_does():
    merge = MergeModulelist(dim=0)
    sources = {"a.*.w": [torch.randn(3, 5), torch.randn(3, 5)], "b.*.w": [torch.randn(2, 4)]}
    copies = {key: [t.clone() for t in value] for key, value in sources.items()}
    ours = MergeReleasingSources(merge, []).convert(sources, source_patterns=["a.*.w", "b.*.w"],
                                                    target_patterns=["a.w", "b.w"])
    theirs = merge.convert(copies, source_patterns=["a.*.w", "b.*.w"], target_patterns=["a.w", "b.w"])
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@linux_only
@pytest.mark.parametrize("path", ["float16", "int8"])
def test_a_cpu_path_load_gives_pages_back_as_it_converts_and_keeps_no_view_of_the_checkpoint(
    default_path, golden_copy, monkeypatch, path
):
    """Released after every module here (`RELEASE_EVERY` 0): before each release at most the module just converted
    is resident beyond the weights not yet converted (2 MiB bounds the tiny model's largest module; the whole
    checkpoint is 20 MB), after it none (each view may keep a page at either end); after the load, nothing at all
    (every weight is the model's own copy, so the maps are closed)."""
    shards = checkpoint_shards(str(golden_copy))
    monkeypatch.setattr(mapped_pages, "RELEASE_EVERY", 0)
    before, after = [], []
    release = mapped_pages.PageRelease.__call__

    def excess(model) -> int:
        viewed = viewed_ranges(model, file_maps(shards))
        return resident_bytes(shards) - sum(end - start + 2 * PAGE for start, end in viewed)

    def checked(self):
        before.append(excess(self.model))
        release(self)
        after.append(excess(self.model))

    monkeypatch.setattr(mapped_pages.PageRelease, "__call__", checked)
    model = FishOmniForSpeech.from_pretrained(golden_copy, cpu_path=path)
    assert len(after) > len(model.backbone.layers) and max(after) <= 0
    assert max(before) <= 2 * 2**20
    assert viewed_ranges(model, file_maps(shards)) == []
    assert resident_bytes(shards) == 0


def converted_float32_load(path: str, weight_format: str):
    model = FishOmniForSpeech.from_pretrained(path, dtype=torch.float32)
    apply_cpu_path(model, weight_format)
    return model


@pytest.mark.parametrize("weight_format", ["float16", "int8"])
@pytest.mark.parametrize("experts", ["fp8", "plain"])
def test_a_bfloat16_checkpoint_converted_from_its_map_equals_its_float32_load_converted(
    default_path, tmp_path, weight_format, experts
):
    """The same tensors (values and dtypes), configuration and stored-step key as the former way: the whole
    checkpoint loaded in float32, then converted."""
    path = str(GOLDEN_TINY) if experts == "fp8" else write_tiny_checkpoint(tmp_path / "plain", quantization_config=None)
    assert load_dtype(weight_format, checkpoint_shards(path)) == torch.bfloat16
    model = FishOmniForSpeech.from_pretrained(path, cpu_path=weight_format)
    reference = converted_float32_load(path, weight_format)
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("codec.")}
    theirs = {k: v for k, v in reference.state_dict().items() if not k.startswith("codec.")}
    assert ours.keys() == theirs.keys()
    different = [k for k in ours if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert different == []
    assert model.config.to_dict() == reference.config.to_dict()
    assert model_description(model) == model_description(reference)


def test_a_float32_checkpoint_is_loaded_in_float32(default_path, tmp_path):
    plain = write_tiny_checkpoint(tmp_path / "plain", quantization_config=None)
    FishOmniForSpeech.from_pretrained(plain, dtype=torch.float32).save_pretrained(tmp_path / "float32")
    shards = checkpoint_shards(str(tmp_path / "float32"))
    assert load_dtype("float16", shards) == load_dtype("int8", shards) == torch.float32
    assert load_dtype("bfloat16", shards) == torch.bfloat16
    assert load_dtype("float32", checkpoint_shards(str(GOLDEN_TINY))) == torch.float32
    model = FishOmniForSpeech.from_pretrained(tmp_path / "float32", cpu_path="float16")
    reference = converted_float32_load(str(tmp_path / "float32"), "float16")
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (name, a), b in
               zip(model.state_dict().items(), reference.state_dict().values()) if not name.startswith("codec."))
