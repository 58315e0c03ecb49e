"""The runner of the frame step: the frame states a model keeps, their CUDA graphs, and the loop of one call.

`FrameLoop` runs one `generate` call after its prefill: it loads the batch into a `FrameState` (frame_step.py), runs
its step once per frame (eagerly, compiled, or as CUDA graph replays through `FrameStates.runner`), writes the
frames into the outputs, streams them, runs the stopping criteria and retires finished sequences.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers.utils import logging

from .cuda_graphs import StepGraphs
from .frame_step import FrameState, attention_window, row_limit
from .sampling import FrameSampler

logger = logging.get_logger(__name__)

FINISH_EOS, FINISH_LENGTH, FINISH_CONTEXT, FINISH_STOP = "eos", "length", "context", "stop"
OUTPUT_CHUNK_FRAMES = 256  # the output buffer grows by this many frames: memory follows the frames made


class FrameStates:
    """A model's frame states between calls, and the captured CUDA graphs of their steps.

    With CUDA graphs (`fast_decode=True` on CUDA) states are kept per batch bucket (1, 2, 4, ...: a batch is padded
    with copies of its first sequence, marked ended) and reused by later calls, with their graphs; otherwise every
    call builds states of its exact batch size and drops them at its end. One request runs at a time: calls from
    other threads wait their turn, a call from inside a running one (a streamer calling `generate`) is refused.
    """

    def __init__(self, model):
        self.model = model
        self.fingerprint = self.model_fingerprint(model)
        self.states: dict[tuple, FrameState] = {}
        self.graphs = StepGraphs()
        self.samplers: dict[tuple, FrameSampler] = {}
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread running a request

    def __deepcopy__(self, memo):
        """A copied model starts without states (they are rebuilt for it on its first call)."""
        return None

    @staticmethod
    def model_fingerprint(model) -> tuple:
        """Changes when parameters are replaced or moved (a captured graph reads them at fixed addresses)."""
        return tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters())

    @contextlib.contextmanager
    def in_use(self, keep: bool):
        """Hold the states for one request; `keep=False` drops them at its end."""
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "generate() was called from inside a running generate() of the same model (e.g. from a streamer): "
                "a model generates one request at a time; run the nested call after the first one returns"
            )
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None
                if not keep:
                    self.states.clear()
                    self.samplers.clear()

    def state(self, batch: int, capacity: int, ras_window: int, template, scores: bool) -> FrameState:
        """The state of `batch` sequences with room for at least `capacity` rows, built when missing or too small."""
        key = (batch, ras_window, scores)
        state = self.states.get(key)
        if state is None or state.capacity < capacity:
            self.states.pop(key, None)  # free the old buffers first
            state = self.states[key] = FrameState(self.model, batch, capacity, ras_window, template, scores)
        return state

    def sampler(self, batch: int, ras_window: int, device: torch.device) -> FrameSampler:
        """The sampler of the states of `batch` rows: one kept per size, as the captured steps read its tensors."""
        key = (batch, ras_window)
        if key not in self.samplers:
            self.samplers[key] = FrameSampler(batch, ras_window, device)
        return self.samplers[key]

    def runner(self, state: FrameState, sampler: FrameSampler, visible: int, graphs: bool, hook=None,
               compile_backend: str | None = None):
        """A callable running one step of `state` over `visible` cache rows: a CUDA graph replay with `graphs`, else
        the step itself; compiled first with `compile_backend` (`torch.compile(fullgraph=True)`: one graph, its
        element-wise chains fused by inductor). A new state's first capture runs warm-up steps that overwrite it: get
        the first runner of a state before loading sequences into it."""
        function = compiled_step(state, compile_backend) if compile_backend else state.step
        step = lambda: function(sampler, visible, hook)  # noqa: E731
        if not graphs:
            return step
        key = (sampler.key, visible)
        if key not in state.graphs:
            state.graphs[key] = self.graphs.capture(self.model, step, state.hidden.device, warm_up=not state.graphs)
        return state.graphs[key].replay


def compiled_step(state: FrameState, backend: str):
    """`state.step` compiled by torch.compile with `backend`, kept on the state (each window, and greedy or sampled,
    is compiled on its first use; other sampling settings reuse it)."""
    if state.compiled.get(backend) is None:
        state.compiled[backend] = torch.compile(state.step, fullgraph=True, dynamic=False, backend=backend)
    return state.compiled[backend]


def frame_states(model) -> FrameStates:
    """The model's `FrameStates`, rebuilt when its parameters were replaced or moved since the last call."""
    states = getattr(model, "_frame_states", None)
    if states is None or states.fingerprint != FrameStates.model_fingerprint(model):
        states = model._frame_states = FrameStates(model)
    return states


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
        return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**64

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
    """One `generate` call after its prefill: the running batch, its state, outputs, streaming and stopping."""

    def __init__(self, model, settings, prefill, input_ids, attention_mask, generators, streamer, logits_processor,
                 stopping_criteria):
        self.model, self.settings, self.streamer = model, settings, streamer
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.prefill, self.generators = prefill, generators
        batch, self.rows, width = input_ids.shape
        self.limit = model.config.text_config.max_position_embeddings
        # Frames this call can make: max_new_tokens, or up to the context (the last frame is not fed back).
        self.frames = min(settings.max_new_tokens, self.limit - self.rows + 1)
        self.positions = model.row_positions(attention_mask)  # [B, T]
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

    def _bucket(self, running: int) -> int:
        """Rows of a state for `running` sequences: a power of two with CUDA graphs (few graphs), else exact."""
        return 1 << max(running - 1, 0).bit_length() if self.graphs else running

    def _room(self, step: int) -> None:
        """Make sure the output buffer has a column for frame `step`."""
        if self.rows + step >= self.sequences.shape[1]:
            more = min(OUTPUT_CHUNK_FRAMES, self.frames - step)
            self.sequences = torch.cat((self.sequences, self.sequences.new_zeros(self.sequences.shape[0], more, self.sequences.shape[2])), 1)

    def run(self, on_step) -> None:
        states = frame_states(self.model)
        with states.in_use(keep=self.graphs):
            self._run(states, on_step)

    def _row_generators(self, members: list[int], batch: int):
        if not isinstance(self.generators, list):
            return self.generators
        return [self.generators[i] for i in members] + [None] * (batch - len(members))

    def _main_logits_hook(self):
        """The hook running the user's logits processors inside a step, on the whole batch's view (None without any):
        rows of sequences not in the state are zeros."""
        if not self.logits_processor:
            return None

        def hook(logits: torch.Tensor) -> torch.Tensor:  # [state rows, V + 1]
            count = len(self.members)
            full = logits.new_zeros(len(self.lengths), logits.shape[1])  # [B, V + 1]
            full[self.member_index] = logits[:count]
            processed = self.logits_processor(self.sequences[:, : self.rows + self.step], full)
            out = logits.clone()
            out[:count] = processed[self.member_index].to(out.dtype)
            return out

        return hook

    def _run(self, states: FrameStates, on_step) -> None:
        prefill, settings = self.prefill, self.settings
        cap = row_limit(self.limit)

        def runner(state: FrameState, visible: int):
            self.sampler = states.sampler(state.batch, ras_window, state.noise.device)  # every row: this call's settings
            self.sampler.set_rows(slice(None), settings)
            return states.runner(state, self.sampler, visible, self.graphs, self._main_logits_hook(), self.compile_backend)

        # A RAS window longer than a request's rows sees all of them: the buffer never needs more than the context.
        ras_window = min(settings.ras_window, self.limit)

        def state_for(batch: int, capacity: int, template) -> FrameState:
            return states.state(batch, capacity, ras_window, template, self.need_scores)

        def window(rows: int) -> int:
            """Rows a step attends over when `rows` are in use: a captured or compiled step keeps its shape for a
            while (`attention_window`: a few distinct shapes, so few graphs and compilations); an eager one reads
            exactly the rows in use."""
            return attention_window(rows, cap) if self.graphs or self.compile_backend else rows

        batch = len(self.lengths)
        visible = window(self.rows + 1)  # rows in use after the first step
        state = state_for(self._bucket(batch), attention_window(self.rows + 1, cap), prefill.cache)
        self.members = list(range(batch))  # original index of state row i, for the first len(members) rows
        self.member_index = torch.arange(batch, device=state.slot.device)
        self.step = 0
        run = runner(state, visible)  # before loading: a first capture overwrites the state (see `runner`)
        state.load_prefill(
            prefill.cache, prefill.tower_cache, prefill.last_hidden_state[:, -1], self.input_ids, self.positions,
            self.attention_mask, ras_window,
        )
        for step in range(self.frames):
            self.step = step
            rows = self.rows + step + 1  # this step's new row is row rows - 1
            if rows > state.capacity:  # grow: the same sequences in a state with room for the next window
                bigger = state_for(state.batch, attention_window(rows, cap), state.cache)
                run = runner(bigger, window(rows))
                bigger.load_from(state, torch.arange(state.batch, device=state.slot.device))
                state = bigger
            elif window(rows) != visible:
                run = runner(state, window(rows))
            visible = window(rows)
            self.sampler.fill_noise(state.noise, self._row_generators(self.members, state.batch))
            ended_before = state.ended[: len(self.members)].clone() if state.scores is not None else None
            run()
            self._record(state, step, ended_before)
            on_step(1)
            if step + 1 == self.frames or (step + 1) % self.check_every:
                continue
            running = self._retire(state, None)  # the one host sync of the interval
            if not running:
                break
            if self._bucket(len(running)) < state.batch:  # shrink: the running sequences move to a smaller state
                keep = torch.tensor([self.members.index(i) for i in running], device=state.slot.device)
                smaller = state_for(self._bucket(len(running)), state.capacity, state.cache)
                run = runner(smaller, visible)
                smaller.load_from(state, keep)
                state = smaller
                self.members, self.member_index = running, torch.tensor(running, device=state.slot.device)
            # Otherwise the ended sequences stay in the state, as ended rows, until the bucket shrinks.
        self._retire(state, FINISH_LENGTH if self.frames == settings.max_new_tokens else FINISH_CONTEXT)
        # Scores of the steps that decided something: up to each sequence's last frame, and its EOS step.
        decided = [n + (reason == FINISH_EOS) for n, reason in zip(self.lengths, self.finish_reason)]
        del self.scores[max(decided, default=0) :]

    def _record(self, state: FrameState, step: int, ended_before: torch.Tensor | None) -> None:
        """Write the step's frames into the outputs; stream them; run the stopping criteria; keep the scores (of the
        sequences that had not ended before this step)."""
        members, member_index = self.members, self.member_index
        count = len(members)
        self._room(step)
        made = ~state.ended[:count]  # [n] a frame was made (not EOS, not ended before)
        rows = state.new_rows[:count]
        self.sequences[member_index, self.rows + step] = torch.where(made[:, None], rows, 0)
        scores = None
        if state.scores is not None:
            scores = state.scores.new_zeros(len(self.lengths), state.scores.shape[1])  # [B, V + 1]
            scores[member_index.to(scores.device)] = state.scores[:count].masked_fill(ended_before[:, None].to(scores.device), 0)
            if self.settings.output_scores:
                self.scores.append(scores)
        if self.streamer is not None and bool(made.any()):
            codes = rows.new_full((len(self.lengths), rows.shape[1] - 1), -1)  # [B, NCB]
            codes[member_index] = torch.where(made[:, None], rows[:, 1:], -1)
            self.streamer.put(codes)
        if self.stopping_criteria:
            stop = self.stopping_criteria(self.sequences[:, : self.rows + step + 1], scores)
            stop = torch.as_tensor(stop, device=made.device).expand(len(self.lengths))[member_index] & made
            if bool(stop.any()):
                stopping = stop.nonzero()[:, 0]
                state.ended[stopping] = True
                self.stopped.update(members[i] for i in stopping.tolist())

    def _retire(self, state: FrameState, reason_for_running: str | None) -> list[int]:
        """Record the lengths and finish reasons of sequences that ended (of all, with `reason_for_running` for those
        still running); returns the ones still running."""
        members = self.members
        ended = state.ended[: len(members)].tolist()
        counts = state.count[: len(members)].tolist()
        running = []
        for original, has_ended, count in zip(members, ended, counts):
            if has_ended or reason_for_running is not None:
                self.lengths[original] = count
                if original in self.stopped:
                    self.finish_reason[original] = FINISH_STOP
                else:
                    self.finish_reason[original] = FINISH_EOS if has_ended else reason_for_running
            else:
                running.append(original)
        return running


__all__ = ["FINISH_CONTEXT", "FINISH_EOS", "FINISH_LENGTH", "FINISH_STOP", "FrameLoop", "FrameStates",
           "check_cuda_graphs", "frame_states", "request_generators"]
