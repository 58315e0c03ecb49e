"""The Drama 3 codebook tower (docs/format.md, "The codebook tower"): shared enrichment layers, residual layers, heads, and their KV cache.

For backbone row `t` (final-norm hidden `h_t`) the tower predicts the codes of the next frame `lab`:

    h_t ─► shared 0 ─► ... ─► shared S-1 ─► residual 0 ─► residual 1 ─► ... ─► residual NCB-2
           ▲ lab.c0    ...    ▲ lab.c0      ▲ lab.c0 │    ▲ lab.c1 │          ▲ lab.c(NCB-2) │
           + x_extra                                 ▼             ▼                         ▼
                                                  head 0 → c1   head 1 → c2    head NCB-2 → c(NCB-1)

Every layer has its own KV cache over all earlier rows of the request, at the backbone's row positions
(`Drama3TowerCache`). Teacher forcing runs the whole stack on known label frames (`Drama3CodebookTower.forward`);
decoding runs it one frame at a time and asks a pluggable sampler for each code (`decode_frame`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import eager_attention_forward
from transformers.utils import ModelOutput

from .configuration_drama3 import Drama3TowerConfig

INIT_STD = 0.02  # standard deviation of a new tower's random weights

# Sampler plugged into `decode_frame`: (head logits [B, V] float32, codebook index 1..NCB-1) -> codes [B] int64.
CodebookSampler = Callable[[torch.Tensor, int], torch.Tensor]


# --------------------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------------------


class Drama3TowerCacheLayer(CacheLayerMixin):
    """KV store of one tower layer: `keys`/`values` `[B, KV, capacity, hd]`, the first `length` rows valid.

    The buffers are preallocated in chunks of `chunk_size` rows and grown (copied into a larger buffer) when a
    write needs more room, never beyond `max_length`; a write past that raises a `ValueError`.
    """

    def __init__(self, max_length: int, chunk_size: int):
        super().__init__()
        self.max_length = max_length
        self.chunk_size = chunk_size
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate empty buffers shaped like `key_states` / `value_states` (one chunk, at most `max_length` rows)."""
        self.device = key_states.device
        self.keys = self._allocate(key_states, min(self.chunk_size, self.max_length))
        self.values = self._allocate(value_states, min(self.chunk_size, self.max_length))
        self.is_initialized = True

    @staticmethod
    def _allocate(like: torch.Tensor, rows: int) -> torch.Tensor:
        batch, heads, _, head_dim = like.shape
        return like.new_zeros(batch, heads, rows, head_dim)

    def _fits(self, states: torch.Tensor, buffer: torch.Tensor | None) -> bool:
        """Whether `states` can be written into `buffer` (same batch, heads, head dim, dtype and device)."""
        return (
            buffer is not None
            and states.shape[:2] == buffer.shape[:2]
            and states.shape[3] == buffer.shape[3]
            and states.dtype == buffer.dtype
            and states.device == buffer.device
        )

    def _grow(self, needed: int) -> None:
        """Reallocate to the smallest multiple of `chunk_size` (capped at `max_length`) holding `needed` rows."""
        rows = min(-(-needed // self.chunk_size) * self.chunk_size, self.max_length)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = self._allocate(old, rows)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[B, KV, T, hd]` new rows; return all valid rows `[B, KV, length + T, hd]`."""
        new_rows = key_states.shape[2]
        if self.length > 0 and not self._fits(key_states, self.keys):
            raise ValueError(
                f"Drama3TowerCache holds {self.keys.shape[0]} sequence(s) with keys {tuple(self.keys.shape[1::2])} "
                f"({self.keys.dtype}, {self.keys.device}) but got {key_states.shape[0]} with "
                f"{tuple(key_states.shape[1::2])} ({key_states.dtype}, {key_states.device}). Use the same batch, "
                "change its batch with `batch_select_indices` / `reorder_cache`, or `reset()` it first."
            )
        if self.length + new_rows > self.max_length:
            raise ValueError(
                f"Drama3TowerCache is full: it holds {self.length} rows and {new_rows} more would exceed its "
                f"max_length = {self.max_length} (the backbone's max_position_embeddings)."
            )
        if not self._fits(key_states, self.keys):
            self.lazy_initialization(key_states, value_states)
        if self.length + new_rows > self.keys.shape[2]:
            self._grow(self.length + new_rows)
        end = self.length + new_rows
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_length

    def reset(self) -> None:
        """Forget every row but keep the buffers for reuse (they are only read up to `length`)."""
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` rows (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of rows to remove, got {tokens_to_remove}")
        self.length = max(self.length + tokens_to_remove, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder (or repeat) the batch entries: new entry `i` is old entry `beam_idx[i]`."""
        if self.is_initialized:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch entries `indices` (long indices or a bool mask)."""
        if self.is_initialized:
            self.keys = self.keys[indices.to(self.keys.device)]
            self.values = self.values[indices.to(self.values.device)]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)


class Drama3TowerCache(Cache):
    """KV cache of the codebook tower: one `Drama3TowerCacheLayer` per tower layer (shared first, then residual).

    It spans the whole request (prompt rows and generated frames), one slot per backbone row, and all sequences
    of a batch share the slot index (left padding aligns them). `max_length` is the backbone's
    `max_position_embeddings`: the cache grows in chunks of `chunk_size` rows up to it and refuses to go further.
    """

    def __init__(self, config: Drama3TowerConfig, max_length: int, chunk_size: int = 256):
        if max_length < 1 or chunk_size < 1:
            raise ValueError(f"max_length ({max_length}) and chunk_size ({chunk_size}) must be positive")
        num_layers = config.shared_enrichment_layers + config.num_codebooks - 1
        super().__init__(layers=[Drama3TowerCacheLayer(max_length, chunk_size) for _ in range(num_layers)])
        self.max_length = max_length
        # The last row seen by a teacher-forced model pass whose label (the next row) has not arrived yet:
        # (hidden [B, 1, D], frame [B, 1, 1 + NCB], position [B, 1]), or None. `FishOmniForSpeech.forward` runs the
        # tower on it when the next rows come, so that incremental passes equal one full pass.
        self.pending_row: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        super().reset()
        self.pending_row = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_pending(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_pending(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._select_pending(lambda t: t.repeat_interleave(repeats, dim=0))

    def _select_pending(self, select: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.pending_row is not None:
            self.pending_row = tuple(select(t) for t in self.pending_row)


# --------------------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------------------


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32, or in its own dtype when that is wider (float64 runs stay float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class Drama3ZeroCenteredNorm(nn.Module):
    """RMSNorm with gain `1 + weight` (weight initialised to 0), computed in float32 and cast back.

    Named without "RMSNorm" on purpose: transformers' default `_init_weights` sets such norms to ones (gain 2
    here); a model owning this tower must initialise these weights to zeros.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = _upcast(x)
        # torch's rms_norm: x * rsqrt(mean(x^2) + eps) * gain, one fused kernel on CUDA (equal bits on the CPU).
        return F.rms_norm(wide, (wide.shape[-1],), 1.0 + self.weight.to(wide.dtype), self.eps).to(x.dtype)


def rotary_angles(position_ids: torch.Tensor, rotary_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[B, T, 1, rotary_dim / 2]` (float32) of positions `[B, T]`, frequencies `base^(-2i/rotary_dim)`."""
    exponents = torch.arange(0, rotary_dim, 2, device=position_ids.device, dtype=torch.float32) / rotary_dim
    angles = position_ids.float()[..., None] * (1.0 / base**exponents)  # [B, T, rotary_dim / 2]
    return angles.cos()[:, :, None], angles.sin()[:, :, None]


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (0,1), (2,3), ... of the first `2 * cos.shape[-1]` dims of `x` `[B, T, heads, hd]`.

    The rotation runs in float32 (or wider) and is cast back to `x`'s dtype.
    """
    rotary_dim = 2 * cos.shape[-1]
    pairs = _upcast(x[..., :rotary_dim]).unflatten(-1, (-1, 2))  # [B, T, heads, rotary_dim / 2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


class Drama3TowerAttention(nn.Module):
    """Gated GQA attention: `wqkv` rows [Q | G | K | V], q/k norm before interleaved partial RoPE, sigmoid gate.

    The attention itself runs through transformers' attention interface, as the backbone's does: the kernel of
    `config._attn_implementation` (`"sdpa"` when unset, `"eager"`, `"flash_attention_2"`, a registered hub kernel).
    """

    is_causal = True  # read by flash-attention kernels; other kernels get the causal part in the mask

    def __init__(self, config: Drama3TowerConfig):
        super().__init__()
        self.config = config
        self.n_head, self.n_kv, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        self.num_key_value_groups = self.n_head // self.n_kv  # read by the attention kernels
        self.scaling = self.head_dim**-0.5
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv * self.head_dim
        self.split_sizes = (q_size, q_size, kv_size, kv_size)
        self.wqkv = nn.Linear(config.dim, sum(self.split_sizes), bias=False)
        self.q_norm = Drama3ZeroCenteredNorm(self.head_dim, config.norm_eps)
        self.k_norm = Drama3ZeroCenteredNorm(self.head_dim, config.norm_eps)
        self.wo = nn.Linear(q_size, config.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, T, 1, rotary_dim / 2]
        mask: torch.Tensor | None,  # `tower_attention_mask`: additive [B or 1, 1, T, keys], or [B, keys] for flash
        cache: Cache | None,
        layer_idx: int,
    ) -> torch.Tensor:
        batch, rows, _ = x.shape
        q, gate, k, v = self.wqkv(x).split(self.split_sizes, dim=-1)
        q = apply_interleaved_rope(self.q_norm(q.view(batch, rows, self.n_head, self.head_dim)), *rope)
        k = apply_interleaved_rope(self.k_norm(k.view(batch, rows, self.n_kv, self.head_dim)), *rope)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, hd]
        v = v.view(batch, rows, self.n_kv, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)  # [B, KV, keys, hd]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation or "sdpa", eager_attention_forward
        )
        attn, _ = attention(self, q, k, v, mask, dropout=0.0, scaling=self.scaling)  # [B, T, H, hd]
        return self.wo(attn.reshape(batch, rows, -1) * torch.sigmoid(gate))


class Drama3TowerFeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`."""

    def __init__(self, config: Drama3TowerConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Drama3TowerBlock(nn.Module):
    """Pre-norm transformer block: `r = x + attn(norm(x))`, `r + ffn(norm(r))`."""

    def __init__(self, config: Drama3TowerConfig):
        super().__init__()
        self.attention_norm = Drama3ZeroCenteredNorm(config.dim, config.norm_eps)
        self.attention = Drama3TowerAttention(config)
        self.ffn_norm = Drama3ZeroCenteredNorm(config.dim, config.norm_eps)
        self.feed_forward = Drama3TowerFeedForward(config)

    def forward(self, x, rope, mask, cache, layer_idx) -> torch.Tensor:
        r = x + self.attention(self.attention_norm(x), rope, mask, cache, layer_idx)
        return r + self.feed_forward(self.ffn_norm(r))


class Drama3TowerLayer(GradientCheckpointingLayer):
    """One tower layer (docs/format.md, "One tower layer"): mixes a code embedding into the hidden state, then a transformer block.

    A `GradientCheckpointingLayer`: after `model.gradient_checkpointing_enable()` a training pass that records
    gradients keeps only the layer's inputs and runs it again during backward.

    `embedding_name` is `"semantic_embedding"` (shared layers) or `"codebook_embedding"` (residual layers), the
    checkpoint's names. The code embedding counts only where the label frame is audio (`is_audio`).
    """

    def __init__(self, config: Drama3TowerConfig, embedding_name: str):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.embedding_name = embedding_name
        self.add_module(embedding_name, nn.Embedding(config.vocab_size, config.dim))
        self.enorm = Drama3ZeroCenteredNorm(config.dim, config.norm_eps)
        self.hnorm = Drama3ZeroCenteredNorm(config.dim, config.norm_eps)
        self.eh_proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.transformer_layer = Drama3TowerBlock(config)
        self.final_layernorm = Drama3ZeroCenteredNorm(config.dim, config.norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, D]
        codes: torch.Tensor,  # [B, T] code this layer consumes (clamped to [0, V-1] here)
        is_audio: torch.Tensor,  # [B, T] bool: the label frame is an audio frame
        extra: torch.Tensor | None,  # [B, T, D] x_extra (shared layer 0 only)
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: Drama3TowerCache | None,
        layer_idx: int,
    ) -> torch.Tensor:
        embedding = getattr(self, self.embedding_name)(codes.clamp(0, self.vocab_size - 1))  # [B, T, D]
        e = embedding * is_audio[..., None].to(embedding.dtype)
        if extra is not None:
            e = e + extra
        m = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(hidden)), dim=-1))
        return self.final_layernorm(self.transformer_layer(m, rope, mask, cache, layer_idx))


# --------------------------------------------------------------------------------------------------------------
# Tower
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Drama3TowerOutput(ModelOutput):
    """Teacher-forced tower output.

    logits: `[B, T, NCB-1, V]` (`T` = the kept rows), `[b, t, j]` = head `j` (predicts codebook `j+1` of the label
        frame of row `t`).
    shared_hidden: `[B, T, D]`, output of the last shared layer.
    cache: the `Drama3TowerCache` passed in, now holding these rows too (None when none was passed). Named
        `cache`, not `past_key_values`: transformers 5.24 renames that `ModelOutput` field to `cache` (and
        keeps `.past_key_values` as an alias), while 5.17 accepts any field name.
    """

    logits: torch.Tensor | None = None
    shared_hidden: torch.Tensor | None = None
    cache: Drama3TowerCache | None = None


def tower_attention_mask(
    attention_mask: torch.Tensor | None, past: int, rows: int, dtype: torch.dtype, device: torch.device,
    implementation: str | None,
) -> torch.Tensor | None:
    """The tower's attention mask for `rows` new rows (slots `past..past+rows-1`), in the form the attention kernel
    of `implementation` takes.

    Flash-attention kernels: the 2-D padding mask `[B, past + rows]` itself (None without padding); they are causal
    on their own (`Drama3TowerAttention.is_causal`). Every other kernel: an additive mask `[B or 1, 1, rows, past +
    rows]` (0 where a key may be attended, the dtype's minimum elsewhere), causal over cache slots, padded keys hidden
    when `attention_mask` (`[B, past + rows]`, 1 = real row) is given. A padded query row still sees itself so that
    its softmax stays finite (its output is never used).
    """
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[1] != past + rows):
        raise ValueError(
            f"attention_mask must be [batch, past + rows] = [batch, {past + rows}] (cache rows {past} + new rows "
            f"{rows}), got {tuple(attention_mask.shape)}"
        )
    if implementation is not None and "flash" in implementation:
        return None if attention_mask is None or bool(attention_mask.all()) else attention_mask.to(device)
    query = torch.arange(past, past + rows, device=device)[:, None]  # [rows, 1]
    key = torch.arange(past + rows, device=device)[None, :]  # [1, past + rows]
    allowed = (key <= query)[None]  # [1, rows, past + rows]
    if attention_mask is not None:
        allowed = (allowed & attention_mask.to(device=device, dtype=torch.bool)[:, None, :]) | (key == query)[None]
    return additive_mask(allowed, dtype)[:, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention bias of a bool mask (True = a key may be attended): 0 there, the dtype's minimum
    elsewhere (finite, so that a row with no key left still has a finite softmax). The tower's masks and the frame
    step's both end here."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


class Drama3CodebookTower(PreTrainedModel):
    """The codebook tower: S shared layers, NCB-1 residual layers and NCB-1 heads (docs/format.md, "The codebook tower").

    Frames are rows `[main_id, c0, ..., c(NCB-1)]` (width `1 + NCB`). A frame is audio when its main id lies in
    the semantic band `[semantic_start_token_id, semantic_start_token_id + V - 1]`. A transformers sub-model (as
    the backbone is): `attn_implementation` reaches it with the checks transformers makes for any model.
    """

    config_class = Drama3TowerConfig
    base_model_prefix = ""
    main_input_name = "hidden_states"
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["Drama3CodebookTower"]  # one device for the whole tower (its layers chain code by code)

    def __init__(self, config: Drama3TowerConfig, semantic_start_token_id: int):
        super().__init__(config)
        self.semantic_start_token_id = semantic_start_token_id
        self.num_codebooks = config.num_codebooks
        self.vocab_size = config.vocab_size
        self.codebook_embeddings = nn.Embedding(config.num_codebooks * config.vocab_size, config.dim)
        self.shared_layers = nn.ModuleList(
            Drama3TowerLayer(config, "semantic_embedding") for _ in range(config.shared_enrichment_layers)
        )
        self.residual_layers = nn.ModuleList(
            Drama3TowerLayer(config, "codebook_embedding") for _ in range(config.num_codebooks - 1)
        )
        self.heads = nn.ModuleList(
            nn.Linear(config.dim, config.vocab_size, bias=False) for _ in range(config.num_codebooks - 1)
        )
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Random weights for a new tower: zero-centred norms at 0 (gain 1), linears and embeddings N(0, 0.02)."""
        if isinstance(module, Drama3ZeroCenteredNorm):
            module.weight.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, INIT_STD)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the tower computes in: its norms' (the CPU path keeps its tables and linears narrower)."""
        return self.residual_layers[0].final_layernorm.weight.dtype

    @property
    def num_layers(self) -> int:
        """Layers with a KV cache: shared then residual (the cache's layer index order)."""
        return len(self.shared_layers) + len(self.residual_layers)

    def is_audio(self, main_ids: torch.Tensor) -> torch.Tensor:
        """Bool mask of main ids inside the semantic band."""
        start = self.semantic_start_token_id
        return (main_ids >= start) & (main_ids < start + self.vocab_size)

    def embed_codes(self, frames: torch.Tensor, codebooks: range) -> torch.Tensor:
        """Sum over `i in codebooks` of codebook `i`'s embedding of `frames[..., 1 + i]` (clamped to [0, V-1]).

        frames `[..., 1 + NCB]` -> `[..., D]` (zeros for an empty range). No audio-row masking here: callers
        zero text rows themselves. Used for the backbone input (codebooks 1..k) and for x_extra (k+1..NCB-1).
        """
        self._check_frames(frames, "frames")
        if codebooks.step != 1 or codebooks.start < 0 or codebooks.stop > self.num_codebooks:
            raise ValueError(f"codebooks must be a unit-step range inside 0..{self.num_codebooks - 1}, got {codebooks}")
        codes = frames[..., 1 + codebooks.start : 1 + codebooks.stop].clamp(0, self.vocab_size - 1)  # [..., n]
        offsets = torch.arange(codebooks.start, codebooks.stop, device=frames.device) * self.vocab_size
        return self.codebook_embeddings(codes + offsets).sum(-2)

    def input_extra(self, input_frames: torch.Tensor) -> torch.Tensor:
        """x_extra `[..., D]` of shared layer 0: codebooks k+1..NCB-1 of audio input frames, zero for text rows."""
        extra = self.embed_codes(input_frames, range(self.config.vq_backbone_codebooks + 1, self.num_codebooks))
        return extra * self.is_audio(input_frames[..., 0])[..., None].to(extra.dtype)

    def _check_frames(self, frames: torch.Tensor, name: str) -> None:
        if frames.shape[-1] != 1 + self.num_codebooks:
            raise ValueError(
                f"{name} must be frame rows [main_id, c0..c{self.num_codebooks - 1}] with last dimension "
                f"{1 + self.num_codebooks}, got shape {tuple(frames.shape)}"
            )

    def _check_cache(self, cache: Drama3TowerCache | None) -> int:
        """Rows already in `cache` (0 without one); rejects a cache built for another tower."""
        if cache is None:
            return 0
        if not isinstance(cache, Drama3TowerCache) or len(cache.layers) != self.num_layers:
            raise ValueError(
                f"cache must be a Drama3TowerCache with {self.num_layers} layers, got {type(cache).__name__}"
                f" with {len(getattr(cache, 'layers', []))}"
            )
        return cache.get_seq_length()

    def _run_shared(self, hidden, c0, is_audio, extra, rope, mask, cache) -> torch.Tensor:
        """Shared layers 0..S-1 on `hidden` `[B, T, D]`, all consuming c0; x_extra enters layer 0 only."""
        for index, layer in enumerate(self.shared_layers):
            hidden = layer(hidden, c0, is_audio, extra if index == 0 else None, rope, mask, cache, index)
        return hidden

    def _run_residual(self, j, hidden, code, is_audio, rope, mask, cache, keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual layer `j` consuming `code` `[B, T]`; returns its output and head `j`'s logits `[B, T, V]` (of the
        last `keep` rows only when `keep` > 0)."""
        index = len(self.shared_layers) + j
        hidden = self.residual_layers[j](hidden, code, is_audio, None, rope, mask, cache, index)
        return hidden, self.heads[j](hidden[:, hidden.shape[1] - keep :] if keep else hidden)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, T, D] backbone final-norm output of rows t
        input_frames: torch.Tensor,  # [B, T, 1 + NCB] rows t
        label_frames: torch.Tensor,  # [B, T, 1 + NCB] rows t + 1 (the frames predicted)
        position_ids: torch.Tensor | None = None,  # [B, T] backbone positions of rows t
        attention_mask: torch.Tensor | None = None,  # [B, past + T], 1 = real row, 0 = left padding
        cache: Drama3TowerCache | None = None,
        logits_to_keep: int = 0,
    ) -> Drama3TowerOutput:
        """Teacher forcing / prefill: head logits of every codebook 1..NCB-1 of every label frame (of the last
        `logits_to_keep` label frames when it is > 0: every layer still runs on every row, for the cache).

        With a cache, each layer attends over its cached rows plus the new ones (causally) and stores the new
        rows; without one, over the new rows only. Default positions: `past..past+T-1` for every sequence.
        """
        self._check_frames(input_frames, "input_frames")
        self._check_frames(label_frames, "label_frames")
        batch, rows, _ = hidden_states.shape
        if input_frames.shape[:2] != (batch, rows) or label_frames.shape[:2] != (batch, rows):
            raise ValueError(
                f"hidden_states {tuple(hidden_states.shape)}, input_frames {tuple(input_frames.shape)} and "
                f"label_frames {tuple(label_frames.shape)} must share [batch, rows]"
            )
        past = self._check_cache(cache)
        device = hidden_states.device
        if position_ids is None:
            position_ids = torch.arange(past, past + rows, device=device).expand(batch, rows)
        rope = rotary_angles(position_ids.to(device), self.config.rotary_dim, self.config.rope_base)
        mask = tower_attention_mask(attention_mask, past, rows, self.compute_dtype, device, self.config._attn_implementation)

        is_audio = self.is_audio(label_frames[..., 0])  # [B, T]
        codes = label_frames[..., 1:]  # [B, T, NCB]
        hidden = self._run_shared(
            hidden_states, codes[..., 0], is_audio, self.input_extra(input_frames), rope, mask, cache
        )
        shared_hidden = hidden
        logits = []
        for j in range(self.num_codebooks - 1):
            hidden, head_logits = self._run_residual(j, hidden, codes[..., j], is_audio, rope, mask, cache, logits_to_keep)
            logits.append(head_logits)
        return Drama3TowerOutput(logits=torch.stack(logits, dim=2), shared_hidden=shared_hidden, cache=cache)

    def decode_frame(
        self,
        hidden_states: torch.Tensor,  # [B, D] backbone final-norm output of the last row
        input_frame: torch.Tensor,  # [B, 1 + NCB] the last row
        main_token: torch.Tensor,  # [B] sampled main token (EOS or a semantic id)
        position_ids: torch.Tensor,  # [B] backbone position of the last row
        attention_mask: torch.Tensor | None,  # [B, past + 1]
        cache: Drama3TowerCache,
        sample_codebook: CodebookSampler,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode the codes of one frame, code by code, adding one row to every layer's cache.

        c0 = clamp(main - semantic_start); the shared layers and residual layer 0 consume it; head `j` gives the
        logits of codebook `j+1`, `sample_codebook(logits [B, V] float32, j + 1)` turns them into codes `[B]`,
        which residual layer `j+1` consumes. A main token outside the band (EOS) zeroes the code embeddings; the
        tower still runs (the caller discards those codes). Returns codes `[B, NCB]` (c0..c(NCB-1)) and the head
        logits `[B, NCB-1, V]`. Everything stays on the device (no host sync).
        """
        self._check_frames(input_frame, "input_frame")
        if cache is None:
            raise ValueError("decode_frame needs the Drama3TowerCache filled by the prefill")
        past = self._check_cache(cache)
        device = hidden_states.device
        rope = rotary_angles(position_ids.to(device)[:, None], self.config.rotary_dim, self.config.rope_base)
        mask = tower_attention_mask(attention_mask, past, 1, self.compute_dtype, device, self.config._attn_implementation)
        return self.decode_codes(hidden_states, input_frame, main_token, rope, mask, cache, sample_codebook)

    def decode_codes(
        self,
        hidden_states: torch.Tensor,  # [B, D]
        input_frame: torch.Tensor,  # [B, 1 + NCB]
        main_token: torch.Tensor,  # [B]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, 1, 1, rotary_dim / 2] of the last row's position
        mask: torch.Tensor | None,  # for the keys the cache returns, as `tower_attention_mask` makes it
        cache: Cache,
        sample_codebook: CodebookSampler,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_frame` with the rotary angles and the mask given: any transformers `Cache` with one layer per
        tower layer works, e.g. the frame step's preallocated static layers (frame_step.py)."""
        is_audio = self.is_audio(main_token)[:, None]  # [B, 1]
        code = (main_token - self.semantic_start_token_id).clamp(0, self.vocab_size - 1)  # [B]
        extra = self.input_extra(input_frame[:, None])  # [B, 1, D]
        hidden = self._run_shared(hidden_states[:, None], code[:, None], is_audio, extra, rope, mask, cache)
        codes, logits = [code], []
        for j in range(self.num_codebooks - 1):
            hidden, head_logits = self._run_residual(j, hidden, codes[-1][:, None], is_audio, rope, mask, cache)
            logits.append(head_logits[:, 0])
            codes.append(sample_codebook(head_logits[:, 0].float(), j + 1))
        return torch.stack(codes, dim=1), torch.stack(logits, dim=1)
