"""The fast decode path of `generate(..., fast_decode=True)`: one frame step over preallocated state, captured as a
CUDA graph on CUDA devices.

The prefill runs as in the regular path (`_FrameLoop`); its caches are then copied into a `StaticFrameState`:
transformers' `StaticCache` for the backbone (full-attention KV and linear-attention states), static layers for the
tower, and fixed buffers for the last hidden state, row, position, RAS window, slot mask, noise and outputs.
`StaticFrameState.step` is one whole frame (main-token logits from the V + 1 candidate rows of `lm_head`, the
main-token draw, the tower's codes with their draws, the new row's backbone step). It never changes a shape, never
reads a value back to the host and updates every buffer in place, so a CUDA graph captured once replays it. The
randomness of a frame is one uniform tensor filled outside the graph (`FrameSampler`), so seeds work as usual.
Attention reads a window of the preallocated rows (256 doubled until the rows in use fit, `visible_rows`): one graph
per window, switched as a request grows.

Batches run in buckets of 1, 2, 4, 8, ... sequences: a batch is padded with copies of its first sequence (marked
ended), and when enough sequences have ended, the running ones move to the smaller bucket's state at a stop check.
States and graphs stay on the model (`FastFrameDecoder`) for later calls; `model.reset_fast_decode()` frees them.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from transformers import StaticCache
from transformers.cache_utils import Cache, StaticLayer

from .sampling import FrameSampler
from .modeling_tower import rotary_angles

CAPACITY_CHUNK = 256  # cache rows are allocated in multiples of this
CAPTURE_WARMUP_STEPS = 2  # eager steps on a side stream before a capture (lazy inits, library workspaces)
# The routed experts inside a captured step: static shapes and no host reads (the eager loop reads the routing on
# the host, and grouped_mm's fallback, used where torch's grouped GEMM is not, reads its offsets there).
CAPTURED_EXPERTS = "batched_mm"


def bucket_size(batch: int) -> int:
    """The smallest power of two >= `batch`: the batch size a state is built for."""
    return 1 << max(batch - 1, 0).bit_length()


def capacity_for(rows: int) -> int:
    """Cache rows to allocate for `rows` rows: rounded up to a multiple of `CAPACITY_CHUNK`."""
    return -(-rows // CAPACITY_CHUNK) * CAPACITY_CHUNK


def visible_rows(rows: int, capacity: int) -> int:
    """Cache rows a step attends over when `rows` are in use: `CAPACITY_CHUNK` doubled until it holds them, at most
    `capacity`. Attention then costs about what the request uses, with a handful of distinct step shapes (graphs)."""
    window = CAPACITY_CHUNK
    while window < rows:
        window *= 2
    return min(window, capacity)


class WindowedStaticLayer(StaticLayer):
    """transformers' `StaticLayer` (fixed buffers, in-place writes) that returns only its first `visible_rows` slots,
    set before each step, so attention skips the unused end of the preallocated capacity."""

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.visible_rows = max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # [B, KV, capacity, hd]
        return keys[:, :, : self.visible_rows], values[:, :, : self.visible_rows]


def _seq_length(layer) -> int:
    """Rows held by a cache layer with keys (dynamic, static or tower), as a Python int."""
    return int(layer.get_seq_length())


def copy_cache_rows(target: Cache, source: Cache, index: torch.Tensor) -> None:
    """Copy the sequences `index` `[b]` of `source` into the preallocated layers of `target` (batch b), in place.

    `source` may be dynamic (the prefill's caches) or static (another bucket's state): attention layers copy their
    valid rows and set the row counter, linear-attention layers their conv and recurrent states.
    """
    for target_layer, layer in zip(target.layers, source.layers):
        if isinstance(target_layer, StaticLayer):
            rows = _seq_length(layer) if getattr(layer, "keys", None) is not None else 0  # 0: an empty layer
            if rows:
                target_layer.keys[:, :, :rows].copy_(layer.keys[:, :, :rows].index_select(0, index))
                target_layer.values[:, :, :rows].copy_(layer.values[:, :, :rows].index_select(0, index))
            target_layer.cumulative_length.fill_(rows)
        for name in ("conv_states", "recurrent_states"):
            for state_idx, state in getattr(layer, name, {}).items():
                if state is not None:
                    getattr(target_layer, name)[state_idx].copy_(state.index_select(0, index))


def allocate_like(target: Cache, source: Cache, batch: int) -> None:
    """Allocate every layer of `target` for `batch` sequences, with the shapes and dtypes of `source`'s layers."""
    for target_layer, layer in zip(target.layers, source.layers):
        if getattr(layer, "keys", None) is not None:
            keys, values = layer.keys, layer.values  # [B, KV, rows, hd]
            target_layer.lazy_initialization(
                keys.new_empty(batch, keys.shape[1], 1, keys.shape[3]),
                values.new_empty(batch, values.shape[1], 1, values.shape[3]),
            )
        conv, recurrent = getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})
        for state_idx in conv:
            if conv[state_idx] is None:
                continue
            target_layer.lazy_initialization(
                conv_states=conv[state_idx].new_empty(batch, *conv[state_idx].shape[1:]),
                recurrent_states=recurrent[state_idx].new_empty(batch, *recurrent[state_idx].shape[1:]),
                state_idx=state_idx,
            )
            # Decode steps take the one-row update path, which reads this flag.
            target_layer.has_previous_state[state_idx] = True


class StaticFrameState:
    """Everything one frame step reads and writes, at fixed addresses, for `batch` sequences and `capacity` rows.

    The backbone's layers take their shapes and dtypes from `backbone_template`, a filled cache (the prefill's, or
    another bucket's). Load sequences into the state with `load_prefill` or `load_from`.
    """

    def __init__(self, model, batch: int, capacity: int, ras_window: int, backbone_template: Cache):
        config = model.config
        device = model.lm_head.weight.device
        self.model, self.batch, self.capacity, self.ras_window = model, batch, capacity, ras_window
        self.candidates = model.main_candidate_ids(device)  # [V + 1]
        num_candidates = self.candidates.numel()
        hidden_size = config.text_config.hidden_size
        # Main-token logits from the V + 1 candidate rows only (a plain Linear; a quantised head runs whole).
        plain_head = type(model.lm_head) is nn.Linear and model.lm_head.weight.device.type != "meta"
        self.head_weight = model.lm_head.weight.new_empty(num_candidates, hidden_size) if plain_head else None

        self.cache = StaticCache(config=config.text_config, max_cache_len=capacity)
        for index, layer in enumerate(self.cache.layers):  # full attention: windowed; linear attention: as built
            if type(layer) is StaticLayer:
                self.cache.layers[index] = WindowedStaticLayer(capacity)
        allocate_like(self.cache, backbone_template, batch)
        self.tower_cache = Cache(layers=[WindowedStaticLayer(capacity) for _ in range(model.tower.num_layers)])
        tower = model.tower.config
        tower_dtype = model.tower.heads[0].weight.dtype
        like = torch.empty(batch, tower.n_local_heads, 1, tower.head_dim, dtype=tower_dtype, device=device)
        for layer in self.tower_cache.layers:
            layer.lazy_initialization(like, like)

        long = dict(dtype=torch.long, device=device)
        self.hidden = torch.zeros(batch, hidden_size, dtype=model.lm_head.weight.dtype, device=device)  # [b, D]
        self.row = torch.zeros(batch, 1 + config.num_codebooks, **long)  # [b, 1 + NCB] the last row
        self.position = torch.zeros(batch, **long)  # [b] the last row's position
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # [b, C] slots holding real rows
        self.slot = torch.zeros(1, **long)  # the backbone slot of the next row
        self.history = torch.full((batch, ras_window), -1, **long)  # [b, W] RAS window (candidate columns)
        self.noise = torch.zeros(batch, config.num_codebooks, num_candidates, device=device)  # [b, NCB, V + 1]
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)  # [b] EOS drawn (or a padding copy)
        self.new_rows = torch.zeros(batch, 1 + config.num_codebooks, **long)  # [b, 1 + NCB] output of the step
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

    # ------------------------------------------------------------------------------------------------------------
    # Loading sequences
    # ------------------------------------------------------------------------------------------------------------

    def _padded(self, index: torch.Tensor) -> torch.Tensor:
        """`index` `[n]` padded to `[batch]` with its first entry (the padding rows copy a real sequence)."""
        return torch.cat((index, index[:1].expand(self.batch - index.numel())))

    def _load_rows(self, index, cache, tower_cache, hidden, row, position, valid, history, ended, slot: int) -> None:
        count = index.numel()
        index = self._padded(index)
        copy_cache_rows(self.cache, cache, index)
        copy_cache_rows(self.tower_cache, tower_cache, index)
        self.valid.zero_()
        self.valid[:, :slot].copy_(valid[:, :slot].index_select(0, index))
        self.hidden.copy_(hidden.index_select(0, index))
        self.row.copy_(row.index_select(0, index))
        self.position.copy_(position.index_select(0, index))
        self.history.fill_(-1)
        if self.ras_window:
            history = history[:, -self.ras_window :]
            self.history[:, self.ras_window - history.shape[1] :].copy_(history.index_select(0, index))
        self.ended.copy_(ended.index_select(0, index))
        self.ended[count:] = True
        self.slot.fill_(slot)
        if self.head_weight is not None:  # refreshed every call: the weights may have changed
            self.head_weight.copy_(self.model.lm_head.weight.index_select(0, self.candidates))

    def load_prefill(self, loop) -> None:
        """Take the sequences of a `_FrameLoop` right after its prefill."""
        index = torch.arange(loop.hidden.shape[0], device=self.slot.device)
        mask = loop.mask if loop.mask is not None else torch.ones_like(self.valid[: index.numel(), : loop.slots])
        self._load_rows(
            index, loop.cache, loop.tower_cache, loop.hidden, loop.row, loop.position, mask.bool(), loop.history,
            loop.ended, loop.slots,
        )

    def load_from(self, other: StaticFrameState, keep: torch.Tensor) -> None:
        """Take the sequences `keep` `[n]` (n <= batch) of another state, in that order."""
        self._load_rows(
            keep, other.cache, other.tower_cache, other.hidden, other.row, other.position, other.valid, other.history,
            other.ended, int(other.slot),
        )

    # ------------------------------------------------------------------------------------------------------------
    # The frame step
    # ------------------------------------------------------------------------------------------------------------

    def step(self, sampler: FrameSampler, visible: int) -> None:
        """One frame for every sequence of the state, in place: writes `new_rows` and advances every buffer.

        Attention reads the first `visible` cache rows, which must hold every row in use after this step (see
        `visible_rows`).
        """
        model = self.model
        for layer in (*self.cache.layers, *self.tower_cache.layers):
            if isinstance(layer, WindowedStaticLayer):
                layer.visible_rows = visible
        valid = self.valid[:, :visible]  # [b, visible]
        if self.head_weight is not None:
            logits = nn.functional.linear(self.hidden, self.head_weight).float()  # [b, V + 1]
        else:
            logits = model.main_logits(self.hidden, self.candidates).float()
        noise = self.noise if sampler.do_sample else None
        column = sampler.main(logits, self.history, noise)  # [b]
        main = self.candidates[column]
        tower_config = model.tower.config
        rope = rotary_angles(self.position[:, None], tower_config.rotary_dim, tower_config.rope_base)
        codes, _ = model.tower.decode_codes(
            self.hidden, self.row, main, rope, valid[:, None, None, :], self.tower_cache,
            lambda head_logits, index: sampler.codebook(head_logits, index, noise),
        )  # [b, NCB]
        if self.ras_window:
            self.history.copy_(torch.cat((self.history[:, 1:], column[:, None]), dim=1))
        self.ended.logical_or_(column == 0)
        new_rows = torch.cat((main[:, None], codes), dim=1)  # [b, 1 + NCB]
        self.new_rows.copy_(new_rows)

        # Feed the new rows back: one backbone step at the next slot.
        self.valid.index_fill_(1, self.slot, True)
        self.position.add_(1)
        bias = torch.zeros(valid.shape, dtype=self.hidden.dtype, device=valid.device)
        bias = bias.masked_fill(~valid, torch.finfo(bias.dtype).min)[:, None, None, :]  # [b, 1, 1, visible]
        masks = {"full_attention": bias, "linear_attention": None}
        hidden = model.run_backbone(new_rows[:, None], self.position[:, None], masks, self.cache)  # [b, 1, D]
        self.hidden.copy_(hidden[:, 0])
        self.row.copy_(new_rows)
        self.slot.add_(1)


class FastFrameDecoder:
    """The states (one per batch bucket and RAS window) and CUDA graphs of a model's fast decode path.

    `cuda_graphs=False` runs the static step eagerly on CUDA too (for comparisons); on other devices it always does.
    """

    def __init__(self, model, cuda_graphs: bool = True):
        self.model = model
        self.cuda_graphs = cuda_graphs
        self.fingerprint = self.model_fingerprint(model)
        self.states: dict[tuple[int, int], StaticFrameState] = {}
        self.pool = None  # CUDA graph memory pool shared by every capture
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread running a request

    @contextlib.contextmanager
    def in_use(self):
        """One request at a time owns the states: calls from other threads wait their turn; a call from inside a
        running request (a streamer calling `generate`) is an error, as it would overwrite the running state."""
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "generate(fast_decode=True) was called from inside a running fast-path generate (e.g. from a "
                "streamer): the fast path holds one request per model at a time; use fast_decode=False there"
            )
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    @staticmethod
    def model_fingerprint(model) -> tuple:
        """Changes when parameters are replaced or moved (a captured graph reads them at fixed addresses)."""
        return tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters())

    def state(self, batch: int, capacity: int, ras_window: int, backbone_template: Cache) -> StaticFrameState:
        """The state of bucket `batch` (a power of two) with room for `capacity` rows, built when missing or small."""
        state = self.states.get((batch, ras_window))
        if state is None or state.capacity < capacity:
            self.states.pop((batch, ras_window), None)  # free the old buffers first
            state = StaticFrameState(self.model, batch, capacity, ras_window, backbone_template)
            self.states[(batch, ras_window)] = state
        return state

    def runner(self, state: StaticFrameState, sampler: FrameSampler, visible: int):
        """A callable running one frame step of `state` over `visible` cache rows: a graph replay on CUDA, else the
        eager step.

        The first capture for a state runs warm-up steps that overwrite it: get the first runner of a new state
        before loading sequences into it. Later captures only record (nothing runs), so they may come mid-request.
        """
        step = lambda: state.step(sampler, visible)  # noqa: E731
        if state.hidden.device.type != "cuda" or not self.cuda_graphs:
            return step
        key = (sampler.key, visible)
        if key not in state.graphs:
            state.graphs[key] = self._capture(step, state.hidden.device, warm_up=not state.graphs)
        return state.graphs[key].replay

    def _capture(self, step, device: torch.device, warm_up: bool) -> torch.cuda.CUDAGraph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with captured_experts(self.model):
            return self._warm_up_and_capture(step, device, warm_up)

    def _warm_up_and_capture(self, step, device: torch.device, warm_up: bool) -> torch.cuda.CUDAGraph:
        if warm_up:
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(CAPTURE_WARMUP_STEPS):
                    step()
            torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a streamer's codec worker (`Drama3AudioStreamer(overlap=True)`) may keep decoding on its own
        # stream while this thread captures.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step()
        return graph


def fast_decoder(model) -> FastFrameDecoder:
    """The model's `FastFrameDecoder`, rebuilt when its parameters changed since the last call."""
    decoder = getattr(model, "_fast_decoder", None)
    if decoder is None or decoder.fingerprint != FastFrameDecoder.model_fingerprint(model):
        decoder = model._fast_decoder = FastFrameDecoder(model)
    return decoder


@contextlib.contextmanager
def captured_experts(model):
    """The backbone's experts run as `CAPTURED_EXPERTS` inside, as the model's own setting after: graphs are captured
    with it, while the prefill and the regular path keep the implementation the user chose."""
    chosen = model.backbone.config._experts_implementation
    if chosen != CAPTURED_EXPERTS:
        model.set_experts_implementation(CAPTURED_EXPERTS)
    try:
        yield
    finally:
        if chosen != CAPTURED_EXPERTS:
            model.set_experts_implementation(chosen)


def check_fast_decode(model) -> None:
    """Refuse what the fast path cannot run, before any work: offloaded or split models, attention kernels that
    ignore a 4-D mask."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map and len({str(v) for v in device_map.values()}) > 1:
        raise ValueError(
            "fast_decode=True needs the whole model on one device, but it is dispatched over "
            f"{sorted({str(v) for v in device_map.values()})}; use fast_decode=False with offloading"
        )
    attention = model.config.text_config._attn_implementation
    if attention not in (None, "eager", "sdpa"):
        raise ValueError(
            f"fast_decode=True runs the backbone with 'sdpa' or 'eager' attention (it passes a 4-D slot mask), got "
            f"{attention!r}; load with attn_implementation='sdpa'"
        )


def run_fast(loop, on_step) -> None:
    """Run the frames of a prefilled `_FrameLoop` on the fast path; fills `loop.frames`, `lengths`, `finish_reason`."""
    settings = loop.settings
    frames = min(settings.max_new_tokens, loop.limit - loop.slots + 1)  # the regular path's length/context stop
    decoder = fast_decoder(loop.model)
    with decoder.in_use():
        recorded = _run_frames(decoder, loop, frames, on_step)
    loop.end_at_first_eos(recorded, length_limited=frames == settings.max_new_tokens)


def _run_frames(decoder: FastFrameDecoder, loop, frames: int, on_step) -> list[int]:
    """Up to `frames` steps, recorded into `loop.frames`; returns the frames recorded per sequence. Sequences stay
    in their state after an EOS until a stop check finds that the running ones fit a smaller bucket."""
    settings, sampler = loop.settings, loop.sampler
    batch, device = loop.hidden.shape[0], loop.hidden.device
    capacity = capacity_for(loop.slots + frames)
    visible = visible_rows(loop.slots + 1, capacity)  # rows in use after the first step
    state = decoder.state(bucket_size(batch), capacity, settings.ras_window, loop.cache)
    run = decoder.runner(state, sampler, visible)  # before loading: see runner()
    state.load_prefill(loop)
    members = list(range(batch))  # original index of state row i, for the first len(members) rows
    member_index = torch.arange(batch, device=device)
    recorded = [0] * batch
    for step in range(frames):
        if visible_rows(loop.slots + step + 1, capacity) != visible:  # this step's new row is row slots + step
            visible = visible_rows(loop.slots + step + 1, capacity)
            run = decoder.runner(state, sampler, visible)
        if settings.do_sample:
            state.noise.uniform_(generator=loop.generator)
        run()
        loop.frames[member_index, step] = state.new_rows[: len(members)]
        for original in members:
            recorded[original] = step + 1
        if loop.streamer is not None and not bool(state.ended[0]):
            loop.streamer.put(state.new_rows[:1, 1:].clone())
        on_step(1)
        if step + 1 == frames or (step + 1) % settings.stop_check_interval:
            continue
        running = (~state.ended[: len(members)]).nonzero()[:, 0]  # the one host sync of the interval
        if running.numel() == 0:
            break
        if bucket_size(running.numel()) < state.batch:
            smaller = decoder.state(bucket_size(running.numel()), capacity, settings.ras_window, state.cache)
            run = decoder.runner(smaller, sampler, visible)
            smaller.load_from(state, running)
            state, members = smaller, [members[i] for i in running.tolist()]
            member_index = torch.tensor(members, device=device)
    return recorded
