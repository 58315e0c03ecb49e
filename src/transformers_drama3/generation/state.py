"""The one frame step of Drama 3 generation and the state it runs over, in fixed buffers updated in place (no shape
change, no host read), so the same step runs eagerly, compiled, or as a CUDA graph (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import StaticCache, StoppingCriteriaList
from transformers.cache_utils import Cache, StaticLayer

from ..device_placement import execution_device
from ..modeling_tower import additive_mask, rotary_angles
from .rules import Drama3FrameSampling
from .sampling import FrameSampler

WINDOW_CHUNK = 256  # the smallest attention window; windows double from here

# A hook on the main-token logits of a step: logits [b, V + 1] float32 -> logits [b, V + 1] (user logits processors).
MainLogitsHook = Callable[[torch.Tensor], torch.Tensor]


def attention_window(rows: int, limit: int) -> int:
    """Cache rows a step attends over when `rows` rows are in use: `WINDOW_CHUNK` doubled until it holds them, at
    most `limit` (the most rows a request can ever use)."""
    window = WINDOW_CHUNK
    while window < rows:
        window *= 2
    return min(window, limit)


def row_limit(max_positions: int) -> int:
    """The most cache rows a request can use: every position of the context, plus the row a step writes after the
    last frame (fed back, never read), rounded up to `WINDOW_CHUNK`."""
    return -(-(max_positions + 1) // WINDOW_CHUNK) * WINDOW_CHUNK


class WindowedStaticLayer(StaticLayer):
    """transformers' `StaticLayer` (fixed buffers, in-place writes) returning only its first `visible_rows` positions,
    set before each step, so attention skips the unused end of the buffers."""

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.visible_rows = max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # [B, KV, capacity, hd]
        return keys[:, :, : self.visible_rows], values[:, :, : self.visible_rows]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.visible_rows, 0


def copy_cache_rows(target: Cache, source: Cache, source_index, target_index, shift: int) -> int:
    """Copy the sequences `source_index` `[n]` of `source` into slots `target_index` `[n]` of `target`'s
    preallocated layers, in place, moving every cached row by `shift` cache positions; returns the bytes copied.

    `source` may be dynamic (a prefill's caches) or static (another state). Attention layers copy their rows
    `[max(0, -shift), held)` to `[.. + shift, held + shift)` and set the row counter to `held + shift` (the counter is
    shared by all the sequences of a layer: a state's sequences end at the same cache position, whatever their lengths);
    linear-attention layers copy their conv and recurrent states.
    """
    copied = 0
    for target_layer, layer in zip(target.layers, source.layers):
        if isinstance(target_layer, StaticLayer):
            held = int(layer.get_seq_length()) if getattr(layer, "keys", None) is not None else 0  # 0: empty
            start = max(0, -shift)
            if held > start:
                index = source_index.to(layer.keys.device)
                into = target_index.to(target_layer.keys.device)
                for name in ("keys", "values"):
                    rows = getattr(layer, name)[:, :, start:held].index_select(0, index)  # [n, KV, rows, hd]
                    getattr(target_layer, name)[:, :, start + shift : held + shift].index_copy_(0, into, rows)
                    copied += rows.numel() * rows.element_size()
            target_layer.cumulative_length.fill_(held + shift)
        for name in ("conv_states", "recurrent_states"):
            for state_idx, state in getattr(layer, name, {}).items():
                if state is not None:
                    into = getattr(target_layer, name)[state_idx]
                    rows = state.index_select(0, source_index.to(state.device))
                    into.index_copy_(0, target_index.to(into.device), rows)
                    copied += rows.numel() * rows.element_size()
    return copied


def allocate_like(target: Cache, source: Cache, batch: int) -> None:
    """Allocate every layer of `target` for `batch` sequences, with the shapes, dtypes and devices of `source`'s."""
    for target_layer, layer in zip(target.layers, source.layers):
        if getattr(layer, "keys", None) is not None:  # keys and values [B, KV, rows, hd]
            target_layer.lazy_initialization(*(like.new_empty(batch, like.shape[1], 1, like.shape[3])
                                               for like in (layer.keys, layer.values)))
        for state_idx, conv in getattr(layer, "conv_states", {}).items():
            if conv is None:
                continue
            recurrent = layer.recurrent_states[state_idx]
            target_layer.lazy_initialization(conv_states=conv.new_empty(batch, *conv.shape[1:]),
                                             recurrent_states=recurrent.new_empty(batch, *recurrent.shape[1:]),
                                             state_idx=state_idx)
            # Decode steps take the one-row update path, which reads this flag.
            target_layer.has_previous_state[state_idx] = True


def step_mask(valid: torch.Tensor, dtype: torch.dtype, attention: str | None) -> torch.Tensor:
    """The attention mask of one step's query row from the cache-position mask `valid` `[b, visible]` (True: real row).

    Kernels that take a 4-D mask (sdpa, eager, ...) get an additive bias `[b, 1, 1, visible]` (0, or the dtype's
    minimum where a position holds no row); flash-attention kernels take the 2-D padding mask `[b, visible]` itself.
    """
    if attention is not None and "flash" in attention:
        return valid.long()
    return additive_mask(valid, dtype)[:, None, None, :]


class FrameState:
    """Everything one frame step reads and writes, at fixed addresses, for `batch` sequences (slots) and `capacity`
    cache positions.

    The backbone's layers take their shapes, dtypes and devices from `template`, a filled backbone cache (the
    prefill's, or another state's). Every slot starts free (ended); sequences come in between two steps with `admit`
    (from a prefill, into free slots) or `take` (from another state, when the runner moves them to a state of
    another size).
    """

    def __init__(self, model, batch: int, capacity: int, ras_window: int, template: Cache, scores: bool = False):
        config = model.config
        self.model, self.batch, self.capacity, self.ras_window = model, batch, capacity, ras_window
        device = model.input_device  # frame rows live where the embedding runs
        head_device = execution_device(model.lm_head)
        self.candidates = model.main_candidate_ids(head_device)  # [V + 1]
        num_candidates = self.candidates.numel()
        hidden_size = config.text_config.hidden_size
        # The V + 1 candidate rows of lm_head, copied again at every admission (`admit`): the head's other ~248k
        # rows are never read. None for a quantised or offloaded lm_head, which runs whole in `model.main_logits`.
        self.head_weight = model.candidate_head_weight(self.candidates)  # [V + 1, D]

        self.cache = StaticCache(config=config.text_config, max_cache_len=capacity)
        for index, layer in enumerate(self.cache.layers):  # full attention: windowed; linear attention: as built
            if type(layer) is StaticLayer:
                self.cache.layers[index] = WindowedStaticLayer(capacity)
        allocate_like(self.cache, template, batch)
        keys_like = next(layer.keys for layer in template.layers if getattr(layer, "keys", None) is not None)
        tower = model.tower.config
        tower_device = execution_device(model.tower)
        tower_dtype = model.tower.compute_dtype  # its norms' (the CPU path keeps its tables and linears narrower)
        like = torch.empty(batch, tower.n_local_heads, 1, tower.head_dim, dtype=tower_dtype, device=tower_device)
        self.tower_cache = Cache(layers=[WindowedStaticLayer(capacity) for _ in range(model.tower.num_layers)])
        for layer in self.tower_cache.layers:
            layer.lazy_initialization(like, like)

        long = dict(dtype=torch.long, device=device)
        self.hidden = torch.zeros(batch, hidden_size, dtype=keys_like.dtype, device=head_device)  # [b, D]
        self.row = torch.zeros(batch, 1 + config.num_codebooks, **long)  # [b, 1 + NCB] the last row
        self.position = torch.zeros(batch, **long)  # [b] the last row's position
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # [b, C] positions holding rows
        self.write_at = torch.zeros(1, **long)  # the cache position of the next row (the same for every sequence)
        self.pointer = 0  # `write_at` as the host knows it: the runner counts the steps it runs
        self.history = torch.full((batch, ras_window), -1, dtype=torch.long, device=head_device)  # [b, W] RAS window
        self.noise = torch.zeros(batch, config.num_codebooks, num_candidates, device=head_device)  # [b, NCB, V + 1]
        self.ended = torch.ones(batch, dtype=torch.bool, device=device)  # [b] EOS, limit, stopped, or a free row
        self.made = torch.zeros(batch, dtype=torch.bool, device=device)  # [b] the last step made a frame
        self.count = torch.zeros(batch, **long)  # [b] frames produced
        self.frame_limit = torch.zeros(batch, **long)  # [b] frames a sequence may make (max_new_tokens, context)
        self.sampler = FrameSampler(batch, ras_window, head_device)  # per-row sampling settings
        self.new_rows = torch.zeros(batch, 1 + config.num_codebooks, **long)  # [b, 1 + NCB] output of the step
        # [b, V + 1] the step's main-token logits (after any hook), for `output_scores` and stopping criteria.
        self.scores = torch.zeros(batch, num_candidates, device=head_device) if scores else None
        self.graphs: dict[tuple, object] = {}  # captured steps (cuda_graphs.py), per sampling key and window
        self.compiled: dict[str, object] = {}  # `step` compiled by torch.compile, per backend

    # -- sequences in and out -------------------------------------------------------------------------------------

    def start_at(self, pointer: int) -> None:
        """Set the cache position of the next row of an empty state: admitted sequences end just before it."""
        self.pointer = pointer
        self.write_at.fill_(pointer)
        self.ended.fill_(True)

    def admit(self, slots, prefill, input_ids, positions, mask, frame_limits) -> None:
        """Take the sequences of a prefill into the state's slots `slots` `[n]` (slots no running sequence holds).

        `prefill`: the prefill's output (its caches and `last_hidden_state`); `input_ids` its prompt rows
        `[n, T, 1 + NCB]`, `positions` `[n, T]`, `mask` `[n, T]` (1 = a real row), `frame_limits` `[n]` the most
        frames each may make. The prompt's rows land right before the state's next cache position (T <= `pointer`),
        so that a sequence admitted between two frames ends at the same position as the running ones; the positions
        before it are masked, as left padding is.
        """
        count, width = input_ids.shape[:2]
        if width > self.pointer:
            raise ValueError(f"a prompt of {width} rows does not fit before cache position {self.pointer}")
        shift = self.pointer - width
        source = torch.arange(count, device=self.write_at.device)
        slots = slots.to(self.write_at.device)
        copy_cache_rows(self.cache, prefill.cache, source, slots, shift)
        copy_cache_rows(self.tower_cache, prefill.tower_cache, source, slots, shift)
        self.valid.index_fill_(0, slots, False)
        self.valid[:, shift : self.pointer].index_copy_(0, slots, mask.bool().to(self.valid.device))
        model = self.model
        self.hidden.index_copy_(0, slots.to(self.hidden.device), prefill.last_hidden_state[:, -1].to(self.hidden.dtype))
        self.row.index_copy_(0, slots, input_ids[:, -1].to(self.row.device))
        self.position.index_copy_(0, slots, positions[:, -1].to(self.position.device))
        # RAS window: the last prompt rows' main ids as candidate columns (-1 for text slots).
        main = input_ids[:, -min(width, self.ras_window) :, 0] if self.ras_window else input_ids[:, :0, 0]
        columns = torch.where(model.is_audio_row(main), main - model.config.semantic_start_token_id + 1, -1)
        history = torch.full((count, self.ras_window), -1, dtype=torch.long, device=self.history.device)
        history[:, self.ras_window - columns.shape[1] :] = columns.to(history.device)
        self.history.index_copy_(0, slots.to(self.history.device), history)
        self.ended.index_fill_(0, slots, False)
        self.count.index_fill_(0, slots, 0)
        self.frame_limit.index_copy_(0, slots, torch.as_tensor(frame_limits, dtype=torch.long).to(self.write_at.device))
        if self.head_weight is not None:  # refreshed at every admission: the weights may have changed in place
            self.head_weight.copy_(model.candidate_head_weight(self.candidates))

    def take(self, other: FrameState, keep, shift: int) -> int:
        """Take the sequences in slots `keep` `[n]` of another state into slots `[0, n)`, every cached row moved by
        `shift` cache positions (negative: towards position 0, over positions no sequence of `keep` uses); the other
        slots end. Returns the bytes of cache copied."""
        count = keep.numel()
        keep = keep.to(self.write_at.device)
        into = torch.arange(count, device=self.write_at.device)
        self.start_at(other.pointer + shift)
        copied = copy_cache_rows(self.cache, other.cache, keep, into, shift)
        copied += copy_cache_rows(self.tower_cache, other.tower_cache, keep, into, shift)
        start = max(0, -shift)
        self.valid.zero_()
        self.valid[:count, start + shift : self.pointer].copy_(other.valid[:, start : other.pointer].index_select(0, keep))
        for name in ("hidden", "row", "position", "ended", "count", "frame_limit"):
            getattr(self, name)[:count].copy_(getattr(other, name).index_select(0, keep.to(getattr(other, name).device)))
        self.history.fill_(-1)
        width = min(self.ras_window, other.ras_window)
        if width:
            self.history[:count, self.ras_window - width :].copy_(other.history[:, other.ras_window - width :].index_select(0, keep.to(other.history.device)))
        self.sampler.copy_rows(other.sampler, keep)
        if self.head_weight is not None:
            self.head_weight.copy_(other.head_weight)
        return copied

    def shift(self, start: int, positions: int) -> int:
        """Move every sequence's cached rows from cache positions `[start, pointer)` to `positions` later, in place
        (room before the next frame's position for a newcomer with a longer prompt); the cache must be long enough.
        Linear-attention states hold no positions and stay. Returns the bytes of cache copied."""
        end = self.pointer
        if end + positions + 1 > self.capacity:
            raise ValueError(f"a cache of {self.capacity} positions cannot move {end} by {positions}")
        copied = 0
        for layer in (*self.cache.layers, *self.tower_cache.layers):
            if isinstance(layer, StaticLayer):
                for name in ("keys", "values"):
                    buffer = getattr(layer, name)  # [b, KV, capacity, hd]
                    moving = buffer[:, :, start:end].clone()
                    buffer[:, :, start + positions : end + positions].copy_(moving)
                    copied += moving.numel() * moving.element_size()
                layer.cumulative_length.add_(positions)
        moving = self.valid[:, start:end].clone()
        self.valid[:, start:end] = False
        self.valid[:, start + positions : end + positions] = moving
        self.pointer += positions
        self.write_at.fill_(self.pointer)
        return copied

    # -- the frame step --------------------------------------------------------------------------------------------

    def step(self, visible: int, sampling: Drama3FrameSampling, stopping: StoppingCriteriaList,
             main_logits_hook: MainLogitsHook | None = None) -> None:
        """One frame for every sequence of the state, in place: writes `new_rows` and `made`, advances every buffer.

        Attention reads the first `visible` cache rows, which must hold every row in use after this step
        (`attention_window`). `sampling` draws the frame from the per-row settings of `self.sampler`; `stopping`
        (device criteria: EOS, the frame limit) says which sequences end with it. `main_logits_hook` (eager steps
        only: the user's host-side processors) may change the main-token logits before the draw.
        """
        model = self.model
        for layer in (*self.cache.layers, *self.tower_cache.layers):
            if isinstance(layer, WindowedStaticLayer):
                layer.visible_rows = visible
        logits = model.main_logits(self.hidden, self.candidates, self.head_weight).float()  # [b, V + 1]
        if main_logits_hook is not None:
            logits = main_logits_hook(logits)
        if self.scores is not None:
            self.scores.copy_(logits)
        sampler, noise = self.sampler, self.noise
        column = sampling.main(logits, self.history, sampler, noise)  # [b] candidate column (0 = EOS)
        main = self.candidates[column]  # [b] token ids

        attention = model.config.text_config._attn_implementation
        tower_config = model.tower.config
        tower_keys = self.tower_cache.layers[0].keys  # [b, KV, capacity, hd]
        tower_device = tower_keys.device
        # The tower's new row sits at the position of the last row (it lags the backbone by one): it reads the
        # positions in use before this step's new row.
        tower_mask = step_mask(self.valid[:, :visible].to(tower_device), tower_keys.dtype, attention)
        rope = rotary_angles(self.position.to(tower_device)[:, None], tower_config.rotary_dim, tower_config.rope_base)
        codes, _ = model.tower.decode_codes(
            self.hidden.to(tower_device), self.row.to(tower_device), main.to(tower_device), rope, tower_mask,
            self.tower_cache, lambda head_logits, index: sampling.codebook(head_logits, index, sampler, noise),
        )  # [b, NCB]
        if self.ras_window:
            self.history.copy_(torch.cat((self.history[:, 1:], column[:, None]), dim=1))
        new_rows = torch.cat((main[:, None].to(codes.device), codes), dim=1).to(self.new_rows.device)  # [b, 1 + NCB]
        self.new_rows.copy_(new_rows)
        made = ~self.ended & (column != 0).to(self.ended.device)  # [b] a frame (not EOS, not ended before)
        self.made.copy_(made)
        self.count.add_(made.long())
        # Each criterion ORed in as StoppingCriteriaList does, without its all-False start (one kernel fewer).
        stop = None
        for criterion in stopping:
            says = criterion(new_rows, logits, frames_made=self.count, frame_limit=self.frame_limit)  # [b] bool
            stop = says if stop is None else stop | says
        self.ended.logical_or_(stop.to(self.ended.device))

        # Feed the new rows back: one backbone step at the next cache position.
        self.valid.index_fill_(1, self.write_at, True)
        backbone_mask = step_mask(self.valid[:, :visible], self.hidden.dtype, attention)
        backbone_masks = {"full_attention": backbone_mask, "linear_attention": None}
        self.position.add_(1)
        hidden = model.run_backbone(new_rows[:, None], self.position[:, None], backbone_masks, self.cache)  # [b, 1, D]
        self.hidden.copy_(hidden[:, 0])
        self.row.copy_(new_rows)
        self.write_at.add_(1)


__all__ = ["FrameState", "WindowedStaticLayer", "attention_window", "row_limit", "step_mask"]
