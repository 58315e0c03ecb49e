"""The runner of the frame step: the sequences being generated, the state they are in, and the step over them.

`FrameRunner` holds the running sequences of one caller (a `generate` call, or the engine of engine.py) in one
`FrameState` (frame_step.py) and runs its step once per frame: eagerly, compiled (`torch.compile`), or as CUDA graph
replays (cuda_graphs.py). Sequences are admitted from a prefill between two frames (into free rows, or by moving the
running ones into a state with more rows) and released when they end; the runner moves them into a bigger state when
they need more slots, and into a smaller one when few remain, so a CUDA graph runs over a power-of-two number of rows.

`FrameLoop` is one `generate` call after its prefill: a fixed batch admitted at once, its outputs, streaming,
stopping criteria and the retirement of finished sequences.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import torch
from transformers.utils import logging

from .cuda_graphs import StepGraphs
from .frame_step import FrameState, attention_window, row_limit
from .settings_checks import SEED_RANGE, is_integer

logger = logging.get_logger(__name__)

FINISH_EOS, FINISH_LENGTH, FINISH_CONTEXT, FINISH_STOP = "eos", "length", "context", "stop"
OUTPUT_CHUNK_FRAMES = 256  # the output buffer grows by this many frames: memory follows the frames made
GREEDY = SimpleNamespace(do_sample=False)  # the settings of a free row


class KeptStates:
    """Frame states and their CUDA graphs, kept between the calls of one owner (a model's `generate` calls with
    `fast_decode=True` on CUDA, or one engine) so that later calls replay graphs already captured.

    States are kept per (rows, RAS window, scores) and lent to one runner at a time. Graph calls of `generate` on one
    model take turns (`in_use`): they share these states and one graph memory pool.
    """

    def __init__(self, model):
        self.fingerprint = self.model_fingerprint(model)
        self.states: dict[tuple, FrameState] = {}
        self.graphs = StepGraphs()
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread using them

    def __deepcopy__(self, memo):
        """A copied model starts without kept states (they are rebuilt for it on its first call)."""
        return None

    @staticmethod
    def model_fingerprint(model) -> tuple:
        """Changes when parameters are replaced or moved (a captured graph reads them at fixed addresses)."""
        return tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters())

    @contextlib.contextmanager
    def in_use(self):
        """Hold the kept states for one call; a call from inside a running one (a streamer calling `generate`) is
        refused, calls from other threads wait."""
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "generate(fast_decode=True) was called from inside a running one on the same model (e.g. from a "
                "streamer): its captured graphs are in use; run the nested call after the first one returns"
            )
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield self
            finally:
                self._owner = None

    def lend(self, key: tuple, capacity: int) -> FrameState | None:
        """The kept state under `key` if it has room for `capacity` slots (it leaves the store), else None."""
        state = self.states.get(key)
        if state is not None and state.capacity >= capacity:
            return self.states.pop(key)
        return None

    def give_back(self, key: tuple, state: FrameState) -> None:
        """Keep `state` for later calls (the larger one when one is kept already)."""
        kept = self.states.get(key)
        if kept is None or kept.capacity <= state.capacity:
            self.states[key] = state


def kept_states(model) -> KeptStates:
    """The model's `KeptStates`, rebuilt when its parameters were replaced or moved since the last call."""
    kept = getattr(model, "_kept_frame_states", None)
    if kept is None or kept.fingerprint != KeptStates.model_fingerprint(model):
        kept = model._kept_frame_states = KeptStates(model)
    return kept


class FrameRunner:
    """Running sequences, each under a key of its caller's, in one `FrameState`, and the one frame step over them.

    `graphs`: replay the step as CUDA graphs, kept in `kept` (states have a power-of-two number of rows, so that few
    graphs serve any number of sequences); `compile_backend`: `torch.compile` the step first; `scores`: keep each
    step's main-token logits. A captured or compiled step attends over `attention_window` slots (a few shapes), an
    eager one over exactly the slots in use.
    """

    def __init__(self, model, graphs: bool = False, compile_backend: str | None = None, scores: bool = False,
                 kept: KeptStates | None = None):
        if graphs and kept is None:
            raise ValueError("a runner with CUDA graphs needs a KeptStates to hold them")
        self.model, self.graphs, self.compile_backend, self.scores, self.kept = model, graphs, compile_backend, scores, kept
        self.cap = row_limit(model.config.text_config.max_position_embeddings)
        self.state: FrameState | None = None
        self.keys: list = []  # per state row: the key of its sequence, None for a free row
        self.first: list[int] = []  # per state row: the first slot its sequence uses
        self.limits: list[int] = []  # per state row: the most frames its sequence may make
        self.generators: list = []  # per state row: its torch.Generator (None: torch's default stream, or free)
        # One random stream for all rows instead (a `generate` call given one generator, or none: torch's default).
        self.one_stream, self.shared_generator = False, None
        self.layout = 0  # changes whenever rows change owner: callers cache row indexes on it

    # -- what runs ------------------------------------------------------------------------------------------------

    @property
    def running(self) -> list:
        """Keys of the sequences in the state, in row order."""
        return [key for key in self.keys if key is not None]

    def rows(self) -> tuple[list[int], list]:
        """State rows holding a sequence, and their keys."""
        rows = [row for row, key in enumerate(self.keys) if key is not None]
        return rows, [self.keys[row] for row in rows]

    def _bucket(self, count: int) -> int:
        """Rows of a state for `count` sequences: a power of two with CUDA graphs (few graphs), else exact."""
        return 1 << max(count - 1, 0).bit_length() if self.graphs else max(count, 1)

    def _window(self, slots: int) -> int:
        return attention_window(slots, self.cap) if self.graphs or self.compile_backend else slots

    # -- states ---------------------------------------------------------------------------------------------------

    def _new_state(self, batch: int, capacity: int, ras_window: int, template) -> FrameState:
        key = (batch, ras_window, self.scores)
        state = self.kept.lend(key, capacity) if self.kept is not None else None
        if state is None:
            state = FrameState(self.model, batch, capacity, ras_window, template, self.scores)
            if self.graphs:  # a new state's warm-up steps overwrite it: before any sequence is in it
                function = self._compiled(state) if self.compile_backend else state.step
                self.kept.graphs.warm_up(self.model, lambda: function(state.capacity), state.hidden.device)
        return state

    def _let_go(self, state: FrameState | None) -> None:
        if state is not None and self.kept is not None:
            self.kept.give_back((state.batch, state.ras_window, self.scores), state)

    def _move(self, extra: int = 0, pointer: int = 0, ras_window: int = 0, template=None) -> None:
        """Move the running sequences into a new state with free rows for `extra` more, its next slot at least
        `pointer`, a RAS window of at least `ras_window`; slots no running sequence uses any more are dropped."""
        old = self.state
        rows, keys = self.rows()
        if old is not None:
            lowest = min((self.first[row] for row in rows), default=old.pointer)
            pointer = max(old.pointer - lowest, pointer)
            ras_window = max(ras_window, old.ras_window)
            template = old.cache
        batch = self._bucket(len(rows) + extra)
        state = self._new_state(batch, attention_window(pointer + 1, self.cap), ras_window, template)
        if old is not None and rows:
            shift = pointer - old.pointer
            state.take(old, torch.tensor(rows, device=old.slot.device), shift)
            self.first = [self.first[row] + shift for row in rows]
        else:
            state.start_at(pointer)
            self.first = []
        free = batch - len(rows)
        self.keys = keys + [None] * free
        self.first += [pointer] * free
        self.limits = [self.limits[row] for row in rows] + [0] * free
        self.generators = [self.generators[row] for row in rows] + [None] * free
        self.state = state
        self.layout += 1
        self._let_go(old)

    def admit(self, keys: list, prefill, input_ids, attention_mask, settings: list, generators: list,
              frame_limits: list[int]) -> None:
        """Admit the sequences of one prefill between two frames: `keys` `[n]` (new), its output `prefill`, prompt
        rows `[n, T, 1 + NCB]`, full mask `[n, T]`, one settings object (a GenerationConfig) per sequence, one
        generator (or None) per sequence and the most frames each may make."""
        count, width = input_ids.shape[:2]
        # A RAS window longer than the context sees all of it: no state needs more.
        ras_window = min(max((settings_i.ras_window for settings_i in settings), default=0), self.cap)
        state = self.state
        free = [row for row, key in enumerate(self.keys) if key is None]
        if state is None or len(free) < count or state.pointer < width or state.ras_window < ras_window:
            self._move(extra=count, pointer=width, ras_window=ras_window, template=prefill.cache)
            state = self.state
            free = [row for row, key in enumerate(self.keys) if key is None]
        rows = free[:count]
        index = torch.tensor(rows, device=state.slot.device)
        state.admit(index, prefill, input_ids, self.model.row_positions(attention_mask), attention_mask, frame_limits)
        for row, key, settings_i, generator, limit in zip(rows, keys, settings, generators, frame_limits):
            state.sampler.set_rows(torch.tensor([row], device=state.slot.device), settings_i)
            self.keys[row], self.first[row], self.limits[row] = key, state.pointer - width, limit
            self.generators[row] = generator
        self.layout += 1

    def release(self, keys) -> None:
        """Free the rows of the sequences `keys` (ended or cancelled); move the rest to a smaller state when a
        smaller one holds them."""
        index = self._rows_of(keys) if self.state is not None else None
        if index is None:
            return
        self.state.ended[index] = True
        self.state.sampler.set_rows(index, GREEDY)  # a free row costs no sampling work
        for row in index.tolist():
            self.keys[row], self.generators[row] = None, None
        self.layout += 1
        running = len(self.running)
        if not running:
            self.close()
        elif self._bucket(running) < self.state.batch:
            self._move()

    def close(self) -> None:
        """Drop the state (kept for later calls where the runner keeps states)."""
        self._let_go(self.state)
        self.state, self.keys, self.first, self.limits, self.generators = None, [], [], [], []
        self.layout += 1

    # -- the step -------------------------------------------------------------------------------------------------

    def _compiled(self, state: FrameState):
        """`state.step` compiled by torch.compile with the runner's backend, kept on the state."""
        if state.compiled.get(self.compile_backend) is None:
            state.compiled[self.compile_backend] = torch.compile(state.step, fullgraph=True, dynamic=False,
                                                                 backend=self.compile_backend)
        return state.compiled[self.compile_backend]

    def make_room(self) -> None:
        """Move the sequences into a state with more slots if the next step's row does not fit (before a step)."""
        if self.state.pointer + 1 > self.state.capacity:
            self._move()

    def step(self, main_logits_hook=None) -> None:
        """One frame for every running sequence (`state.new_rows`, `state.made`, `state.ended` then hold it)."""
        self.make_room()
        state = self.state
        visible = self._window(state.pointer + 1)
        function = self._compiled(state) if self.compile_backend else state.step
        state.sampler.fill_noise(state.noise, self.shared_generator if self.one_stream else self.generators)
        if self.graphs:
            key = (state.sampler.key, visible)
            if key not in state.graphs:
                state.graphs[key] = self.kept.graphs.capture(self.model, lambda: function(visible), state.hidden.device)
            state.graphs[key].replay()
        else:
            function(visible, main_logits_hook)
        state.pointer += 1

    def read(self) -> torch.Tensor:
        """The last step's outputs on the host, in one read: `[b, 1 + NCB + 3]`, per state row its new row, then
        whether it made a frame, whether it has ended, and its frames so far."""
        state = self.state
        flags = torch.stack((state.made.long(), state.ended.long(), state.count), 1)  # [b, 3]
        return torch.cat((state.new_rows, flags), 1).cpu()

    def finished(self, outputs: torch.Tensor | None = None) -> list[tuple]:
        """`(key, frames, at_limit)` of the sequences that have ended (EOS, their frame limit, or `stop`), from
        `outputs` (`read()`'s, when the caller has them) or one host read of the state's flags."""
        rows, keys = self.rows()
        if not rows:
            return []
        if outputs is None:
            flags = torch.stack((self.state.ended.long(), self.state.count), 1).cpu()  # [b, 2]
        else:
            flags = outputs[:, -2:]
        return [(key, int(flags[row, 1]), int(flags[row, 1]) >= self.limits[row])
                for row, key in zip(rows, keys) if bool(flags[row, 0])]

    def _rows_of(self, keys) -> torch.Tensor | None:
        """State rows `[n]` of the sequences `keys` (None when none of them is in the state)."""
        wanted = set(keys)
        rows = [row for row, key in enumerate(self.keys) if key in wanted]
        return torch.tensor(rows, device=self.state.slot.device) if rows else None

    def stop(self, keys) -> None:
        """End the sequences `keys` at this frame (they are reported by `finished`)."""
        index = self._rows_of(keys)
        if index is not None:
            self.state.ended[index] = True


def check_cuda_graphs(model) -> None:
    """Refuse, before any work, what a captured step cannot run: a model dispatched over several devices (offload
    hooks move weights during the step) or attention kernels that take no padding mask of fixed shape."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map and len({str(v) for v in device_map.values()}) > 1:
        raise ValueError(
            "fast_decode=True captures the frame step as a CUDA graph and needs the whole model on one device, but it "
            f"is dispatched over {sorted({str(v) for v in device_map.values()})}; use fast_decode=False with offloading"
        )
    attention = model.config.text_config._attn_implementation
    if attention is not None and "flash" in attention:
        raise ValueError(
            f"fast_decode=True captures the frame step as a CUDA graph, which needs attention with a fixed-shape "
            f"mask; {attention!r} unpads rows on the host. Load with attn_implementation='sdpa' (or use "
            "fast_decode=False)"
        )


def request_generators(seed, generator, batch: int, device: torch.device):
    """The random streams of a call: None (torch's default), one `torch.Generator`, or a list of one per sequence
    (from `seed` as an int or a list of ints, or `generator` as a Generator or a list)."""
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    def valid_seed(value) -> bool:  # what torch.Generator.manual_seed takes: a 64-bit integer
        return is_integer(value) and SEED_RANGE[0] <= value <= SEED_RANGE[1]

    if isinstance(seed, (list, tuple)):
        if len(seed) != batch or not all(valid_seed(s) for s in seed):
            raise ValueError(f"seed as a list needs one 64-bit integer per sequence ({batch}), got {seed!r}")
        return [torch.Generator(device=device).manual_seed(s) for s in seed]
    if seed is not None:
        if not valid_seed(seed):
            raise ValueError(f"seed must be a 64-bit integer (or a list of one per sequence), got {seed!r}")
        return torch.Generator(device=device).manual_seed(seed)
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch or not all(isinstance(g, torch.Generator) for g in generator):
            raise ValueError(f"generator as a list needs one torch.Generator per sequence ({batch})")
        return list(generator)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator (or a list of one per sequence), got {type(generator).__name__}")
    return generator


class FrameLoop:
    """One `generate` call after its prefill: the whole batch admitted into a `FrameRunner` at once, its outputs,
    streaming, stopping criteria and the retirement of finished sequences."""

    def __init__(self, model, settings, limit, prefill, input_ids, attention_mask, generators, streamer,
                 logits_processor, stopping_criteria):
        self.model, self.settings, self.streamer = model, settings, streamer
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.prefill, self.generators = prefill, generators
        batch, self.rows, width = input_ids.shape
        # Frames this call can make and the finish reason at that limit (generate's `Drama3FrameLimit`).
        self.frames, self.limit_reason = limit.frames, limit.reason
        self.input_ids, self.attention_mask = input_ids, attention_mask
        # Prompt rows then the generated rows, grown in chunks (`_room`).
        self.sequences = torch.cat((input_ids, input_ids.new_zeros(batch, min(self.frames, OUTPUT_CHUNK_FRAMES), width)), 1)
        self.lengths = [0] * batch
        self.finish_reason: list[str | None] = [None] * batch
        self.stopped: set[int] = set()  # sequences a stopping criterion ended
        self.scores: list[torch.Tensor] = []
        self.graphs = settings.fast_decode and model.input_device.type == "cuda"
        if self.graphs and logits_processor:
            logger.warning_once("a logits_processor runs in Python between the step's parts: the frame step runs "
                                "eagerly, without CUDA graphs")
            self.graphs = False
        # A user's logits processor is Python run inside the step: it cannot be compiled with it either.
        compile_step = settings.compile_step if not logits_processor else False
        self.compile_backend = "inductor" if compile_step is True else (compile_step or None)
        self.need_scores = settings.output_scores or bool(stopping_criteria)
        # Calls that look at every frame on the host anyway also retire finished sequences at every frame.
        self.check_every = 1 if streamer is not None or logits_processor or stopping_criteria else settings.stop_check_interval
        self._index_layout, self._rows, self._keys, self._members = None, None, None, None  # `_index`'s cache

    def _room(self, step: int) -> None:
        """Make sure the output buffer has a column for frame `step`."""
        if self.rows + step >= self.sequences.shape[1]:
            more = min(OUTPUT_CHUNK_FRAMES, self.frames - step)
            self.sequences = torch.cat((self.sequences, self.sequences.new_zeros(self.sequences.shape[0], more, self.sequences.shape[2])), 1)

    def _index(self, runner: FrameRunner) -> tuple[torch.Tensor, torch.Tensor, list]:
        """State rows `[n]` of the running sequences and their batch indexes `[n]` (device tensors, cached)."""
        if self._index_layout != runner.layout:
            rows, keys = runner.rows()
            device = runner.state.slot.device
            self._rows, self._keys, self._members = torch.tensor(rows, device=device), torch.tensor(keys, device=device), keys
            self._index_layout = runner.layout
        return self._rows, self._keys, self._members

    def run(self, on_step) -> None:
        kept = kept_states(self.model) if self.graphs else None
        with kept.in_use() if kept is not None else contextlib.nullcontext():
            runner = FrameRunner(self.model, self.graphs, self.compile_backend, self.need_scores, kept)
            try:
                self._run(runner, on_step)
            finally:
                runner.close()

    def _main_logits_hook(self, runner: FrameRunner):
        """The hook running the user's logits processors inside a step, on the whole batch's view (None without any):
        rows of sequences not running are zeros."""
        if not self.logits_processor:
            return None

        def hook(logits: torch.Tensor) -> torch.Tensor:  # [state rows, V + 1]
            rows, keys, _ = self._index(runner)
            full = logits.new_zeros(len(self.lengths), logits.shape[1])  # [B, V + 1]
            full[keys] = logits[rows]
            processed = self.logits_processor(self.sequences[:, : self.rows + self.step], full)
            out = logits.clone()
            out[rows] = processed[keys].to(out.dtype)
            return out

        return hook

    def _run(self, runner: FrameRunner, on_step) -> None:
        batch = len(self.lengths)
        generators = self.generators if isinstance(self.generators, list) else [None] * batch
        if not isinstance(self.generators, list):
            runner.one_stream, runner.shared_generator = True, self.generators
        settings = [self.settings] * batch
        runner.admit(list(range(batch)), self.prefill, self.input_ids, self.attention_mask, settings, generators,
                     [self.frames] * batch)
        hook = self._main_logits_hook(runner)
        self.step = 0
        for step in range(self.frames):
            self.step = step
            runner.make_room()
            ended_before = runner.state.ended.clone() if runner.state.scores is not None else None
            runner.step(hook)
            outputs = self._record(runner, step, ended_before)
            on_step(1)
            if step + 1 == self.frames or (step + 1) % self.check_every:
                continue
            self._retire(runner, runner.finished(outputs))  # the one host read of the interval (or of the frame)
            if not runner.running:
                break
        self._retire(runner, runner.finished())
        # Scores of the steps that decided something: up to each sequence's last frame, and its EOS step.
        decided = [n + (reason == FINISH_EOS) for n, reason in zip(self.lengths, self.finish_reason)]
        del self.scores[max(decided, default=0) :]

    def _record(self, runner: FrameRunner, step: int, ended_before: torch.Tensor | None) -> torch.Tensor | None:
        """Write the step's frames into the outputs; stream them; run the stopping criteria; keep the scores (of the
        sequences that had not ended before this step). With a streamer, returns the frame's outputs as read to the
        host (`runner.read()`, the frame's one host read), which also decide who finished."""
        state = runner.state
        rows, keys, members = self._index(runner)
        self._room(step)
        made = state.made[rows]  # [n] a frame was made (not EOS, not ended before)
        new_rows = state.new_rows[rows]
        self.sequences[keys, self.rows + step] = torch.where(made[:, None], new_rows, 0)
        scores = None
        if state.scores is not None:
            scores = state.scores.new_zeros(len(self.lengths), state.scores.shape[1])  # [B, V + 1]
            kept = state.scores[rows.to(scores.device)].masked_fill(ended_before[rows].to(scores.device)[:, None], 0)
            scores[keys.to(scores.device)] = kept
            if self.settings.output_scores:
                self.scores.append(scores)
        outputs = None
        if self.streamer is not None:
            outputs = runner.read()  # [b, 1 + NCB + 3] on the host
            slots = runner.rows()[0]  # [n] the running sequences, in `members` order
            if any(bool(outputs[slot, -3]) for slot in slots):  # one made a frame
                running = outputs[slots]  # [n, 1 + NCB + 3]
                codes = outputs.new_full((len(self.lengths), running.shape[1] - 4), -1)  # [B, NCB]
                codes[members] = torch.where(running[:, -3, None].bool(), running[:, 1:-3], -1)
                self.streamer.put(codes)
        if self.stopping_criteria:
            stop = self.stopping_criteria(self.sequences[:, : self.rows + step + 1], scores)
            stop = torch.as_tensor(stop, device=made.device).expand(len(self.lengths))[keys] & made
            if bool(stop.any()):
                stopping = [members[i] for i in stop.nonzero()[:, 0].tolist()]
                runner.stop(stopping)
                self.stopped.update(stopping)
                outputs = None  # the flags read before the criteria no longer say who ended
        return outputs

    def _retire(self, runner: FrameRunner, finished: list[tuple]) -> None:
        """Record the lengths and finish reasons of the sequences that ended, and free their rows."""
        for key, frames, at_limit in finished:
            self.lengths[key] = frames
            if key in self.stopped:
                self.finish_reason[key] = FINISH_STOP
            else:
                self.finish_reason[key] = self.limit_reason if at_limit else FINISH_EOS
        runner.release([key for key, _, _ in finished])


__all__ = ["FINISH_CONTEXT", "FINISH_EOS", "FINISH_LENGTH", "FINISH_STOP", "FrameLoop", "FrameRunner", "KeptStates",
           "check_cuda_graphs", "kept_states", "request_generators"]
