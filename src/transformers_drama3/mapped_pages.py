"""Giving back the pages of a memory-mapped checkpoint that a CPU-path load has read and no longer needs.

transformers reads safetensors through a memory map, and a tensor already in the dtype asked for stays a view of that
map (the parameter is the file's bytes). Every page read through the map counts in the process's resident memory
until the map is closed, which happens only when its last view goes. The CPU path's conversion (cpu_path.py) reads
each bfloat16 weight once and keeps a float16 or int8 copy of it: without help, the pages it read would stay resident
beside the copies, the whole checkpoint on top of the converted model at the end of the conversion (and so in the
load's peak).

Two kinds of pages are given back, with `madvise(MADV_DONTNEED)`:
- while transformers loads, each expert's own pages once the loader has stacked that layer's experts into one tensor
  (`MergeReleasingSources`, in place of transformers' `MergeModulelist` for one load): the read pages of a layer's
  experts and their stacked copy would otherwise both stay until the load ends, twice the experts' bytes at its peak
  (64 GB for the real model's FP8 experts);
- during the CPU path's conversion, the pages of the checkpoint's maps that no tensor of the model views any more
  (`PageRelease`): the weights converted already.
A page some tensor still views is never released (a page is released only when every byte of it belongs to tensors
that were copied and are dropped), so a weight is never read back from the file behind a change made to it in
memory. What is released stays in the kernel's page cache (a second load reads it from memory); only this process's
hold on it goes. Neither safetensors nor transformers has a call for this (their maps are internal),
hence `madvise` through ctypes. Linux only: elsewhere, or where the call fails, nothing is released and the load is
the same, with a higher peak.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

import torch
from torch import nn
from transformers.core_model_loading import MergeModulelist

# Converted bytes between two releases: a release walks every tensor of the model (a few thousand at the real size),
# so it runs every so many converted bytes rather than after each module; the pages read since the last release add
# at most this much to the peak.
RELEASE_EVERY = 256 * 2**20
PAGE = mmap.PAGESIZE


def file_maps(paths: list[str]) -> list[tuple[int, int]]:
    """The address ranges `[start, end)` of this process's maps of the files `paths` (`/proc/self/maps`; [] where
    there is none)."""
    wanted = {os.path.realpath(path) for path in paths}
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:  # not Linux
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() in wanted:
            start, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@functools.cache
def _madvise():
    """libc's `madvise` (looked up once), or None where it cannot be called (not Linux)."""
    if not hasattr(mmap, "MADV_DONTNEED") or not os.path.exists("/proc/self/maps"):
        return None
    function = ctypes.CDLL(None, use_errno=True).madvise  # the process's own symbols, libc's among them
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return function


def storage_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte range `[start, end)` of `tensor`'s whole storage."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def in_maps(address: int, maps: list[tuple[int, int]]) -> bool:
    """Whether `address` lies in one of the ranges `maps`."""
    return any(low <= address < high for low, high in maps)


def whole_pages(start: int, end: int) -> tuple[int, int] | None:
    """The run of whole pages `[first, last)` inside the bytes `[start, end)`, or None when no page fits."""
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    return (first, last) if last > first else None


def give_back(runs) -> None:
    """`madvise(MADV_DONTNEED)` over each page run `(first, last)` (nothing where `_madvise` is None)."""
    madvise = _madvise()
    if madvise is None:
        return
    for first, last in runs:
        madvise(first, last - first, mmap.MADV_DONTNEED)  # a failure only leaves the pages resident


def viewed_ranges(model: nn.Module, maps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges `[start, end)` of the storages of `model`'s parameters and buffers that lie in `maps`, sorted."""
    tensors = (*model.parameters(), *model.buffers())
    ranges = [storage_range(tensor) for tensor in tensors if tensor.device.type == "cpu"]
    return sorted((start, end) for start, end in ranges if in_maps(start, maps))


def unviewed_pages(maps: list[tuple[int, int]], viewed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs of whole pages `[start, end)` of `maps` that hold no byte of a `viewed` range (sorted by start)."""
    gaps = []
    for low, high in maps:
        cursor = low
        for start, end in viewed:
            if end <= cursor:
                continue
            if start >= high:
                break
            if start > cursor:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        if cursor < high:
            gaps.append((cursor, high))
    return [run for run in (whole_pages(*gap) for gap in gaps) if run is not None]


def release_tensor_pages(tensors: list[torch.Tensor], checkpoint_files: list[str]) -> None:
    """Give back the whole pages inside the storages of `tensors` that lie in `checkpoint_files`' maps. The caller
    holds `tensors` (so their maps stay open) and vouches that no other tensor views those storages."""
    if _madvise() is None or not tensors:
        return
    maps = file_maps(checkpoint_files)
    ranges = [storage_range(tensor) for tensor in tensors if tensor.device.type == "cpu"]
    runs = [whole_pages(start, end) for start, end in ranges if in_maps(start, maps)]
    give_back([run for run in runs if run is not None])


class MergeReleasingSources(MergeModulelist):
    """transformers' `MergeModulelist` (stacks the tensors of a list, as the loader stacks a layer's experts) that then
    gives back its sources' pages in `checkpoint_files`' maps (`release_tensor_pages`): the stack copied them, and
    each checkpoint tensor goes to one converter only. A source passed through unstacked is kept whole."""

    def __init__(self, merge: MergeModulelist, checkpoint_files: list[str]):
        super().__init__(dim=merge.dim)
        self.checkpoint_files = checkpoint_files

    def convert(self, input_dict, *args, **kwargs):
        sources = [tensor for value in input_dict.values()
                   for tensor in (value if isinstance(value, (list, tuple)) else [value])]
        merged = super().convert(input_dict, *args, **kwargs)
        kept = {storage_range(tensor)[0] for tensor in merged.values()}
        release_tensor_pages([t for t in sources if storage_range(t)[0] not in kept], self.checkpoint_files)
        return merged


def releasing_merges(weight_mapping: list, checkpoint_files: list[str]) -> None:
    """Put `MergeReleasingSources` in place of every `MergeModulelist` of the converters in `weight_mapping`, in
    place (transformers builds that list afresh for each load, from copies of its registered converters)."""
    for transform in weight_mapping or []:
        operations = getattr(transform, "operations", None)
        if operations:
            transform.operations = [MergeReleasingSources(op, checkpoint_files) if type(op) is MergeModulelist else op
                                    for op in operations]


class PageRelease:
    """Releases the pages of `checkpoint_files`' maps that `model` no longer views (module docstring): at once when
    called, and through `converted(module)` every `RELEASE_EVERY` bytes of modules converted."""

    def __init__(self, model: nn.Module, checkpoint_files: list[str]):
        self.model, self.files, self.pending = model, list(checkpoint_files), 0

    def __call__(self) -> None:
        self.pending = 0
        if _madvise() is None:
            return
        # Read afresh each time: a map whose last view went is closed, and its addresses may then hold new memory.
        maps = file_maps(self.files)
        give_back(unviewed_pages(maps, viewed_ranges(self.model, maps)))

    def converted(self, module: nn.Module) -> None:
        """Count the bytes of a module just replaced; release once `RELEASE_EVERY` have been counted."""
        self.pending += sum(t.nbytes for t in module.parameters() if t.device.type == "cpu")
        if self.pending >= RELEASE_EVERY:
            self()


__all__ = ["MergeReleasingSources", "PageRelease", "RELEASE_EVERY", "file_maps", "give_back", "in_maps",
           "release_tensor_pages", "releasing_merges", "storage_range", "unviewed_pages", "viewed_ranges",
           "whole_pages"]
