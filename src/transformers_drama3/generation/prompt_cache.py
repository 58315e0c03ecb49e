"""Prefix caches: the backbone and tower caches of a prompt's first rows, computed once and reused by many requests.

A saved voice's rows (docs/format.md, "Prompt layout", pieces 1, 2 and 2a) start every request with that voice:
`generate(..., prompt_cache=cache)` prefills from a copy of their caches and runs over the remaining rows only.
`PromptCacheStore` keeps caches under a memory bound, evicting the least recently used.

    prefix = processor.reference_prefix_rows([voice])            # [P, 11]
    cache = PromptCache.build(model, prefix)
    inputs = processor("Hello there.", references=[voice])
    model.generate(**inputs, prompt_cache=cache)                 # the frames of model.generate(**inputs)
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch


def tensor_bytes(value, seen: set | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from `value` (a cache, its layers, lists, dicts, tuples;
    configs left out)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        if ("storage", storage.data_ptr()) in seen or value.device.type == "meta":
            return 0
        seen.add(("storage", storage.data_ptr()))
        return storage.nbytes()
    if isinstance(value, dict):
        return sum(tensor_bytes(item, seen) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item, seen) for item in value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return sum(tensor_bytes(item, seen) for key, item in vars(value).items() if key != "config")
    return 0


@dataclass(eq=False)
class PromptCache:
    """The caches of one sequence after the prefix `rows` `[P, 1 + NCB]` (batch 1, on the model's device).

    `cache` is the backbone's `DynamicCache` (P rows), `tower_cache` the tower's `Drama3TowerCache` (P - 1 rows plus
    the pending last row, which the next pass labels). Never changed after `build`: `copies` gives each call its own.
    """

    rows: torch.Tensor  # [P, 1 + NCB] on the CPU
    cache: object
    tower_cache: object
    nbytes: int  # memory the two caches hold (their preallocated room included)

    @classmethod
    @torch.no_grad()
    def build(cls, model, rows: torch.Tensor) -> PromptCache:
        """Run the teacher-forced forward over the prefix `rows` `[P, 1 + NCB]` with caches (no padding: one
        sequence), keeping only the caches."""
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"a prompt cache is built from the frame rows of one prefix [rows, 1 + NCB], got {shape}")
        if rows.shape[0] < 1:
            raise ValueError("a prompt cache needs at least one prefix row")
        output = model(rows[None], use_cache=True, logits_to_keep=1)
        return cls(rows.detach().to("cpu", torch.long).clone(), output.cache, output.tower_cache,
                   tensor_bytes((output.cache, output.tower_cache)))

    @property
    def length(self) -> int:
        return self.rows.shape[0]

    def check(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Raise a `ValueError` unless every sequence of the batch `[B, T, 1 + NCB]` (mask `[B, T]`) starts with
        exactly the cached rows, unpadded, and has at least one row after them."""
        if input_ids.shape[-1] != self.rows.shape[-1]:
            raise ValueError(f"the prompt cache holds rows of width {self.rows.shape[-1]}, input_ids has rows of "
                             f"width {input_ids.shape[-1]}")
        if input_ids.shape[1] <= self.length:
            raise ValueError(f"the prompt cache holds {self.length} rows but the prompt has {input_ids.shape[1]}: "
                             "a prompt must have at least one row after the cached prefix (its text and "
                             "'<|im_start|>assistant\\n<|voice|>')")
        padded = (attention_mask[:, : self.length] == 0).any(-1)  # [B]
        if bool(padded.any()):
            index = int(padded.nonzero()[0, 0])
            raise ValueError(
                f"sequence {index} of the batch is left-padded inside the cached prefix ({self.length} rows): a "
                "prompt cache continues every sequence from the same cached rows, so the batch's prompts must have "
                "equal lengths (generate them one at a time, or without prompt_cache)"
            )
        differs = (input_ids[:, : self.length] != self.rows.to(input_ids.device)).any(-1)  # [B, P]
        if bool(differs.any()):
            index, row = (int(i) for i in differs.nonzero()[0])
            raise ValueError(
                f"row {row} of sequence {index} differs from the prompt cache's prefix: the cache was built for other "
                "rows (another voice or reference); build it from processor.reference_prefix_rows(references) of the "
                "same references"
            )

    def copies(self, batch: int) -> tuple[object, object]:
        """Fresh backbone and tower caches for `batch` sequences, each a copy of the cached one (the call extends
        them in place; this cache stays as it was)."""
        cache, tower_cache = copy.deepcopy((self.cache, self.tower_cache))
        if batch > 1:  # `reorder_cache` is the one batch operation every layer kind has (linear attention included)
            first = torch.zeros(batch, dtype=torch.long)
            cache.reorder_cache(first)
            tower_cache.reorder_cache(first)
        return cache, tower_cache


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_cache: PromptCache | None):
    """The prefill before the frames (`model.prefill`) over prompt rows `[B, T, 1 + NCB]` and their full mask
    `[B, T]`, both checked by `model.checked_inputs`. With `prompt_cache` (checked against them by the caller,
    `PromptCache.check`) it continues from copies of the cached prefix and runs over the rows after it (the output's
    `last_hidden_state` then covers those rows only)."""
    if prompt_cache is None:
        return model.prefill(input_ids, attention_mask)
    cache, tower_cache = prompt_cache.copies(input_ids.shape[0])
    return model.prefill(input_ids[:, prompt_cache.length :], attention_mask, cache, tower_cache)


class PromptCacheStore:
    """Prompt caches by key, within `max_bytes`: the least recently used are evicted first (thread-safe).

    `get(key, build)` returns the cache stored under `key`, or builds it with `build()` and stores it. A cache larger
    than the whole bound is returned without being stored. Key caches on what determines their rows (e.g. a voice
    file's content hash), never on a name that can be given to other content.
    """

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0 (0 stores nothing), got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[Hashable, PromptCache] = OrderedDict()  # least recently used first
        self.hits = self.misses = self.evictions = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def get(self, key: Hashable, build: Callable[[], PromptCache]) -> PromptCache:
        with self._lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
                self.hits += 1
                return entry
            self.misses += 1
        entry = build()  # outside the lock: a build runs the model
        self.put(key, entry)
        return entry

    def put(self, key: Hashable, entry: PromptCache) -> None:
        """Store `entry`, evicting the least recently used caches until the bound holds."""
        with self._lock:
            self.entries.pop(key, None)
            if entry.nbytes > self.max_bytes:
                return
            while self.entries and self.nbytes + entry.nbytes > self.max_bytes:
                self.entries.popitem(last=False)
                self.evictions += 1
            self.entries[key] = entry

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self.entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions}


__all__ = ["PromptCache", "PromptCacheStore", "prefill"]
