"""The runner of the frame step: the running sequences in the slots of one `FrameState` (state.py), admitted, moved
and released between frames, and the step over them (eager, compiled, stored, or CUDA graph replays).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from transformers import StoppingCriteriaList
from transformers.utils import logging

from .cuda_graphs import FREE_SLOT, StepGraphs
from .rules import Drama3FrameSampling
from .state import FrameState, attention_window, row_limit
from .stored_steps import (MAX_SLOTS, RECHECK_S, compile_request, model_description, state_description, step_key,
                           store_for)

logger = logging.get_logger(__name__)


class KeptStates:
    """Frame states and their CUDA graphs, kept between the calls of one owner (a model's `generate` calls with
    `fast_decode=True` on CUDA, or one engine) so that later calls replay graphs already captured.

    States are kept per (slots, RAS window, scores) and lent to one runner at a time. Graph calls of `generate` on one
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
        return self.states.pop(key) if state is not None and state.capacity >= capacity else None

    def give_back(self, key: tuple, state: FrameState) -> None:
        """Keep `state` for later calls (the larger one when one is kept already)."""
        kept = self.states.get(key)
        if kept is None or kept.capacity <= state.capacity:
            self.states[key] = state

    def clear(self) -> None:
        """Let every kept state and captured graph go (their device memory is freed once nothing holds them)."""
        self.states.clear()
        self.graphs = StepGraphs()


def kept_states(model) -> KeptStates:
    """The model's `KeptStates`, rebuilt when its parameters were replaced or moved since the last call."""
    kept = getattr(model, "_kept_frame_states", None)
    if kept is None or kept.fingerprint != KeptStates.model_fingerprint(model):
        kept = model._kept_frame_states = KeptStates(model)
    return kept


class FrameRunner:
    """Running sequences, each under a key of its caller's, in the slots of one `FrameState`, and the one frame step
    over them (module docstring).

    `sampling` and `stopping`: the rule and the device criteria the step calls (rules.py). `graphs`: replay the step
    as CUDA graphs, kept in `kept`; `compile_step`: `torch.compile` the step first (True: inductor, or a backend's
    name); `scores`: keep each step's main-token logits; `admits_later`: sequences may join after the first admission
    (an engine's runner; not a `generate` batch's); `one_stream`: every slot draws from `generator` (None: torch's
    default stream) instead of its own. A captured or compiled step attends over `attention_window` cache positions
    (a few shapes), an eager one over exactly the positions in use. A model on the CPU path with neither graphs nor
    `compile_step` runs the stored compiled step of each state of up to `MAX_SLOTS` slots where its step store has one
    (stored_steps.py), else the eager step.

    Failures: a method that raises either leaves the runner as it was (a state that could not be built or filled) or
    drops the state, with every sequence in it (a step or an in-place move that stopped half-way); `running` then says
    which sequences are left. `builds` counts the states built, `moved_bytes` the bytes of running sequences' caches
    copied into another state or to later cache positions (not a newcomer's own prefill), `stored_frames` the steps a
    stored compiled step ran.
    """

    def __init__(self, model, sampling: Drama3FrameSampling, stopping: StoppingCriteriaList, graphs: bool = False,
                 compile_step: bool | str = False, scores: bool = False, kept: KeptStates | None = None,
                 admits_later: bool = True, one_stream: bool = False, generator: torch.Generator | None = None):
        if graphs and kept is None:
            raise ValueError("a runner with CUDA graphs needs a KeptStates to hold them")
        self.model, self.sampling, self.stopping = model, sampling, stopping
        self.graphs, self.scores, self.kept = graphs, scores, kept
        self.compile_backend = "inductor" if compile_step is True else (compile_step or None)
        self.store = store_for(model) if not graphs and not self.compile_backend else None
        # Without later admissions (a `generate` batch) a state shrinks as soon as a smaller one holds the running
        # sequences; with them, only when a quarter or fewer of its slots are in use (no rebuild back and forth).
        self.shrink_factor = 4 if admits_later else 2
        self.cap = row_limit(model.config.text_config.max_position_embeddings)
        self.state: FrameState | None = None
        self.keys: list = []  # per slot: the key of its sequence, None for a free slot
        self.first: list[int] = []  # per slot: the first cache position its sequence uses
        self.generators: list = []  # per slot: its torch.Generator (None: torch's default stream, or free)
        # One random stream for all slots instead (a `generate` call given one generator, or none: torch's default).
        self.one_stream, self.shared_generator = one_stream, generator
        self.layout = 0  # changes whenever slots change owner: callers cache slot indexes on it
        self.longest_prompt = 0  # the longest prompt admitted: a new state starts with room for one as long
        self.builds = self.moved_bytes = 0
        self.stored_frames = 0  # steps run by a stored compiled step (stored_steps.py)

    # -- what runs ------------------------------------------------------------------------------------------------

    @property
    def running(self) -> list:
        """Keys of the sequences in the state, in slot order."""
        return [key for key in self.keys if key is not None]

    def taken(self) -> tuple[list[int], list]:
        """Slots holding a sequence, and their keys."""
        slots = [slot for slot, key in enumerate(self.keys) if key is not None]
        return slots, [self.keys[slot] for slot in slots]

    # -- states ---------------------------------------------------------------------------------------------------

    def _new_state(self, slots: int, capacity: int, ras_window: int, template) -> FrameState:
        state = self.kept.lend((slots, ras_window, self.scores), capacity) if self.kept is not None else None
        if state is None:
            state = FrameState(self.model, slots, capacity, ras_window, template, self.scores)
            self.builds += 1
            if self.graphs:  # a new state's warm-up steps overwrite it: before any sequence is in it
                function = self._function(state)
                self.kept.graphs.warm_up(self.model, state, lambda: function(state.capacity), state.hidden.device)
        return state

    def _let_go(self, state: FrameState | None) -> None:
        if state is not None and self.kept is not None:
            self.kept.give_back((state.batch, state.ras_window, self.scores), state)

    def _move(self, extra: int = 0, pointer: int = 0, ras_window: int = 0, template=None) -> None:
        """Move the running sequences into a new state with free slots for `extra` more, its next cache position at
        least `pointer`, a RAS window of at least `ras_window`; positions no running sequence uses any more are
        dropped."""
        old = self.state
        slots, keys = self.taken()
        if old is not None:
            lowest = min((self.first[slot] for slot in slots), default=old.pointer)
            pointer = max(old.pointer - lowest, pointer)
            ras_window = max(ras_window, old.ras_window)
            template = old.cache
        # Exactly the slots asked for in the first eager state, else a power of two (few CUDA graphs; room to grow).
        count = len(slots) + extra
        size = max(count, 1) if old is None and not self.graphs else 1 << max(count - 1, 0).bit_length()
        state = self._new_state(size, attention_window(pointer + 1, self.cap), ras_window, template)
        if old is not None and slots:
            shift = pointer - old.pointer
            self.moved_bytes += state.take(old, torch.tensor(slots, device=old.write_at.device), shift)
            self.first = [self.first[slot] + shift for slot in slots]
        else:
            state.start_at(pointer)
            self.first = []
        free = size - len(slots)
        self.keys = keys + [None] * free
        self.first += [pointer] * free
        self.generators = [self.generators[slot] for slot in slots] + [None] * free
        self.state = state
        self.layout += 1
        self._let_go(old)

    def admit(self, keys: list, prefill, input_ids, attention_mask, settings: list, generators: list,
              frame_limits: list[int]) -> None:
        """Admit the sequences of one prefill between two frames into free slots: `keys` `[n]` (new), its output
        `prefill`, prompt rows `[n, T, 1 + NCB]`, full mask `[n, T]`, one settings object (a GenerationConfig) per
        sequence, one generator (or None) per sequence and the most frames each may make."""
        count, prompt_length = input_ids.shape[:2]
        self.longest_prompt = max(self.longest_prompt, prompt_length)
        # A RAS window longer than the context sees all of it: no state needs more.
        ras_window = min(max((settings_i.ras_window for settings_i in settings), default=0), self.cap)
        state = self.state
        if state is None or self.keys.count(None) < count or state.ras_window < ras_window:
            self._move(extra=count, pointer=self.longest_prompt if state is None else prompt_length,
                       ras_window=ras_window, template=prefill.cache)
        elif not self.running:  # an empty state starts again, with room for the longest prompt seen
            start = self.longest_prompt
            if start + 1 > state.capacity:
                self._move(extra=count, pointer=start, ras_window=ras_window, template=prefill.cache)
            else:
                state.start_at(start)
                self.first = [start] * state.batch
        elif state.pointer < prompt_length:
            self._make_earlier_room(prompt_length - state.pointer)
        state = self.state
        slots = [slot for slot, key in enumerate(self.keys) if key is None][:count]
        index = torch.tensor(slots, device=state.write_at.device)
        try:
            state.admit(index, prefill, input_ids, self.model.row_positions(attention_mask), attention_mask,
                        frame_limits)
            for slot, settings_i in zip(slots, settings):
                state.sampler.set_rows(torch.tensor([slot], device=state.write_at.device), settings_i)
        except BaseException:
            state.ended[index] = True  # the slots stay free; the running sequences were not touched
            raise
        for slot, key, generator in zip(slots, keys, generators):
            self.keys[slot], self.first[slot] = key, state.pointer - prompt_length
            self.generators[slot] = generator
        self.layout += 1

    def _make_earlier_room(self, positions: int) -> None:
        """Give a newcomer `positions` more cache positions before the next frame's: the running sequences' cached
        rows move that much later, in place when the state's cache is long enough, else into a longer state."""
        state = self.state
        if state.pointer + positions + 1 > state.capacity:
            self._move(pointer=state.pointer + positions)
            return
        lowest = min(self.first[slot] for slot in self.taken()[0])
        try:
            self.moved_bytes += state.shift(lowest, positions)
        except BaseException:
            self.close(keep=False)  # the rows moved half-way: the running sequences are lost
            raise
        self.first = [first + positions for first in self.first]
        self.layout += 1

    def release(self, keys) -> None:
        """Free the slots of the sequences `keys` (ended or cancelled); move the rest to a smaller state when a
        quarter or fewer of the slots remain in use (half without later admissions). A state emptied of its last
        sequence is kept for the next admission when it has one slot, else dropped (`close`)."""
        index = self._slots_of(keys)  # None without a state too (it has no keys then)
        if index is None:
            return
        self.state.ended[index] = True
        self.state.sampler.set_rows(index, FREE_SLOT)  # a free slot costs no sampling work
        for slot in index.tolist():
            self.keys[slot], self.generators[slot] = None, None
        self.layout += 1
        running = len(self.running)
        if not running and self.state.batch > 1:
            self.close()  # the next request alone must not pay for empty slots (a state of one slot is kept)
        elif running and running <= self.state.batch // self.shrink_factor:
            try:
                self._move()
            except Exception as error:  # noqa: BLE001  (the larger state holds the same sequences: they go on)
                logger.warning("the frame state could not shrink to %d sequences (%s): it keeps its %d slots",
                               running, error, self.state.batch)

    def close(self, keep: bool = True) -> None:
        """Drop the state: kept for later calls where the runner keeps states, unless `keep` is False (a state
        left half-updated by a failure, or an owner that stops for good: then every kept state goes too)."""
        if keep:
            self._let_go(self.state)
        elif self.kept is not None:
            self.kept.clear()
        self.state, self.keys, self.first, self.generators = None, [], [], []
        self.layout += 1

    # -- the step -------------------------------------------------------------------------------------------------

    def _function(self, state: FrameState):
        """The step of `state` with the runner's rules, compiled by torch.compile with the runner's backend (kept on
        the state) when it has one: `function(visible, main_logits_hook=None)`."""
        if self.compile_backend and self.compile_backend not in state.compiled:
            state.compiled[self.compile_backend] = torch.compile(state.step, fullgraph=True, dynamic=False,
                                                                 backend=self.compile_backend)
        step = state.compiled[self.compile_backend] if self.compile_backend else state.step
        return lambda visible, hook=None: step(visible, self.sampling, self.stopping, hook)

    def _stored_step(self, state: FrameState, positions: int):
        """The stored compiled step of `state` and its attention window for `positions` rows, or None (a missing
        one is asked for, and looked for again every `RECHECK_S` seconds while the state runs)."""
        window = attention_window(positions, self.cap)
        slot = ("stored", window, state.sampler.key)
        key, step, checked = state.compiled.get(slot, (None, None, None))
        if step is None and (checked is None or time.monotonic() - checked > RECHECK_S):
            if key is None:
                key = step_key(model_description(self.model),
                               state_description(state, window, self.sampling, self.stopping))
            step = self.store.load(key)
            if step is None:
                self.store.compile_later(compile_request(self.model, state, window, self.sampling), key)
            state.compiled[slot] = (key, step, time.monotonic())
        return (step, window) if step is not None else None

    def make_room(self) -> None:
        """Move the sequences into a state with a longer cache if the next step's row does not fit (before a step)."""
        if self.state.pointer + 1 > self.state.capacity:
            self._move()

    def step(self, main_logits_hook=None) -> None:
        """One frame for every running sequence (`state.new_rows`, `state.made`, `state.ended` then hold it)."""
        self.make_room()
        state = self.state
        rows = state.pointer + 1  # cache rows in use after this step: a captured or compiled step sees a window
        visible = attention_window(rows, self.cap) if self.graphs or self.compile_backend else rows
        function = self._function(state)
        state.sampler.fill_noise(state.noise, self.shared_generator if self.one_stream else self.generators)
        if self.graphs:
            key = (state.sampler.key, visible)
            if key not in state.graphs:
                state.graphs[key] = self.kept.graphs.capture(self.model, lambda: function(visible), state.hidden.device)
            state.graphs[key].replay()
        elif (self.store is not None and main_logits_hook is None and state.batch <= MAX_SLOTS
              and (stored := self._stored_step(state, rows))):
            with torch.no_grad():
                stored[0](state, stored[1], self.sampling, self.stopping)
            self.stored_frames += 1
        else:
            function(visible, main_logits_hook)
        state.pointer += 1

    def outputs(self) -> torch.Tensor:
        """The last step's outputs, on the device: `[b, 1 + NCB + 3]`, per slot its new row, then whether it made a
        frame, whether it has ended, and its frames so far (a caller reads them to the host in one transfer)."""
        state = self.state
        flags = torch.stack((state.made.long(), state.ended.long(), state.count), 1)  # [b, 3]
        return torch.cat((state.new_rows, flags), 1)

    def _slots_of(self, keys) -> torch.Tensor | None:
        """Slots `[n]` of the sequences `keys` (None when none of them is in the state)."""
        wanted = set(keys)
        slots = [slot for slot, key in enumerate(self.keys) if key in wanted]
        return torch.tensor(slots, device=self.state.write_at.device) if slots else None

    def stop(self, keys) -> None:
        """End the sequences `keys` at this frame (their flags say so in the next outputs)."""
        index = self._slots_of(keys)
        if index is not None:
            self.state.ended[index] = True


def check_cuda_graphs(model) -> None:
    """Refuse, before any work, what a captured step cannot run: a model dispatched over several devices (offload
    hooks move weights during the step) or attention kernels that take no padding mask of fixed shape."""
    devices = sorted({str(device) for device in (getattr(model, "hf_device_map", None) or {}).values()})
    if len(devices) > 1:
        raise ValueError(
            "fast_decode=True captures the frame step as a CUDA graph and needs the whole model on one device, but it "
            f"is dispatched over {devices}; use fast_decode=False with offloading"
        )
    attention = model.config.text_config._attn_implementation
    if attention is not None and "flash" in attention:
        raise ValueError(
            f"fast_decode=True captures the frame step as a CUDA graph, which needs attention with a fixed-shape "
            f"mask; {attention!r} unpads rows on the host. Load with attn_implementation='sdpa' (or use "
            "fast_decode=False)"
        )


__all__ = ["FrameRunner", "KeptStates", "check_cuda_graphs", "kept_states"]
