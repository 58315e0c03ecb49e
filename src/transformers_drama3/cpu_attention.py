"""Attention on the CPU path: transformers' `sdpa`, with a decode step's query heads packed as rows of their key/value
head.

The backbone's full-attention layers and the tower share each key/value head among a group of query heads (8 query
heads per key/value head at the real width). For a one-row query with a mask, which is every frame step (the mask
hides the cache window's unused rows), transformers' `sdpa` copies each key/value head once for every query head of
its group (`repeat_kv`) before calling torch's kernel when the step is compiled, as the CPU path's step is (an eager
step of transformers 5.25 and later packs the group instead): 8x the window's keys and values written and read again,
in every such layer, every step. Here the group's query heads become the query rows of their key/value head (a view),
so torch's kernel reads each key and value once for all of them. Against the copies the sums of a row are the same
products in another order: float32 reordering (tests/test_cpu_attention.py). One layer at the real width, window
256 / 1024 / 4096 rows, 1 thread: 0.63 / 5.8 / 76 ms with the copies, 0.18 / 0.73 / 2.9 ms packed
(benchmarks/cpu_attention.py; docs/performance.md, "Attention in a decode step").

`CPU_ATTENTION` is registered with transformers' attention and mask interfaces at import; the CPU path
(`cpu_path.apply_cpu_path`) puts a model loaded with `sdpa` on it. Anything else (several query rows, no mask or a
mask per head, a tensor off the CPU, a layer without groups, options that `sdpa` handles) goes to transformers' `sdpa`
unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

CPU_ATTENTION = "drama3_cpu_sdpa"


def cpu_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """`sdpa_attention_forward` (query `[b, Hq, rows, d]`, key and value `[b, Hkv, keys, d]`) -> (`[b, rows, Hq, d]`,
    None), with a one-row query's groups packed as rows of their key/value head on a CPU (module docstring)."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = all(kwargs.get(name) in (None, False) for name in ("position_bias", "softcap", "output_attentions"))
    one_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    if not (groups > 1 and plain and one_mask and query.device.type == "cpu" and query.shape[2] == 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, dim = query.shape
    # Query head h attends with key/value head h // groups (`repeat_kv`'s order): a group's heads are rows of it.
    packed = query.reshape(batch, heads // groups, groups, dim)  # [b, Hkv, groups, d]
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling)  # [b, Hkv, groups, d]; the mask [b, 1, 1, keys] broadcasts
    return out.reshape(batch, 1, heads, dim), None


AttentionInterface.register(CPU_ATTENTION, cpu_sdpa_forward)
AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)

__all__ = ["CPU_ATTENTION", "cpu_sdpa_forward"]
