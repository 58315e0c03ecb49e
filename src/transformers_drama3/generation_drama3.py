"""Speech generation for Drama 3: settings, the frame loop around the one frame step, stopping, batching, outputs.

`FishOmniForSpeech.generate(input_ids, ...)` runs the teacher-forced `forward` over the prompt rows once (the
prefill: backbone and tower caches), loads the sequences into a `FrameState` and runs `FrameState.step`
(frame_step.py) once per frame: main token with repetition-aware sampling -> tower codes -> the new row fed back to
the backbone (docs/format.md, "Prefill and decoding"). Everything per frame stays on the device; the host looks at
the stop flags every `stop_check_interval` frames, and finished sequences then leave the batch. With
`fast_decode=True` on a CUDA device each step is a CUDA graph replay (cuda_graphs.py); everywhere else the same step
runs eagerly.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput, logging

from . import compat
from .cuda_graphs import StepGraphs
from .device_placement import execution_device
from .frame_rows import left_pad_rows, padded_on_the_right
from .frame_step import FrameState, attention_window, row_limit
from .parallel import check_fast_decode_allowed, shared_seed
from .prompt_cache import PromptCache, prefill
from .sampling import FrameSampler

logger = logging.get_logger(__name__)

# Drama 3 settings kept on `model.generation_config` (defaults of the official server; docs/format.md, "Sampling").
DRAMA3_GENERATION_DEFAULTS = {
    "do_sample": True,
    "max_new_tokens": 2048,  # frames: 2048 frames = 95 s of audio
    "temperature": 1.0,  # main token
    "top_p": 0.9,
    "top_k": 0,  # 0 (or None): no top-k for the main token; a cap of 30 makes reference-free takes fall silent
    "ras_window": 16,
    "ras_temperature": 1.0,
    "ras_top_k": 30,
    "ras_top_p": 0.95,
    "codebook_temperature": 1.0,
    "codebook_top_k": 30,  # capped at 30
    "codebook_top_p": 0.9,
    "stop_check_interval": 8,  # frames between two host checks of the stop flags
    "fast_decode": False,  # on CUDA: capture the frame step once as a CUDA graph and replay it (cuda_graphs.py)
    "compile_step": False,  # torch.compile the frame step first (True: inductor; or a torch.compile backend's name)
    "return_dict_in_generate": True,
    "output_scores": False,  # the main-token candidate logits of every frame, in `Drama3GenerateOutput.scores`
}
# transformers' generation settings that mean nothing for frames, but that pipelines and configs carry.
_IGNORED_SETTINGS = ("pad_token_id", "bos_token_id", "eos_token_id", "use_cache", "transformers_version", "_from_model_config")
FINISH_EOS, FINISH_LENGTH, FINISH_CONTEXT, FINISH_STOP = "eos", "length", "context", "stop"
OUTPUT_CHUNK_FRAMES = 256  # the output buffer grows by this many frames: memory follows the frames made


@dataclass
class Drama3GenerateOutput(ModelOutput):
    """What `generate` returns.

    sequences: `[B, T + N, 1 + NCB]` prompt rows followed by the generated frame rows (rows after a sequence's
        end are zeros). codes: per sequence `[NCB, n_i]` (c0..c9 of each generated frame). audio: per sequence
        float32 `[n_i * frame_length]` (None with `output_audio=False`). finish_reason: per sequence `"eos"`,
        `"length"` (max_new_tokens), `"context"` (the backbone's max_position_embeddings) or `"stop"` (a stopping
        criterion). scores (`output_scores=True`): per frame, the main-token candidate logits `[B, V + 1]` (after any
        `logits_processor`; column 0 is EOS, column `1 + c` is `<|semantic:c|>`; rows of sequences that had already
        ended are zeros).
    """

    sequences: torch.LongTensor | None = None
    codes: list[torch.LongTensor] | None = None
    audio: list[torch.Tensor] | None = None
    finish_reason: list[str] | None = None
    scores: tuple[torch.Tensor, ...] | None = None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_settings(values: dict) -> None:
    """Raise a `ValueError` naming the first Drama 3 generation setting in `values` that is out of range (types
    included: a string, a NaN or an infinity is never a valid number)."""
    if not _is_int(values["max_new_tokens"]) or values["max_new_tokens"] < 1:
        raise ValueError(f"max_new_tokens (frames) must be an integer >= 1, got {values['max_new_tokens']!r}")
    if not _is_int(values["stop_check_interval"]) or values["stop_check_interval"] < 1:
        raise ValueError(f"stop_check_interval must be an integer >= 1, got {values['stop_check_interval']!r}")
    if not isinstance(values["compile_step"], (bool, str)):
        raise ValueError(f"compile_step must be True, False or a torch.compile backend name, got {values['compile_step']!r}")
    for name in ("fast_decode", "do_sample", "return_dict_in_generate", "output_scores"):
        if not isinstance(values[name], bool):
            raise ValueError(f"{name} must be True or False, got {values[name]!r}")
    if not _is_int(values["ras_window"]) or values["ras_window"] < 0:
        raise ValueError(f"ras_window must be an integer >= 0, got {values['ras_window']!r}")
    if not values["do_sample"]:
        return
    for name in ("temperature", "ras_temperature", "codebook_temperature"):
        if not _is_number(values[name]) or values[name] <= 0:
            raise ValueError(f"{name} must be a finite number > 0 when sampling (use do_sample=False for greedy), "
                             f"got {values[name]!r}")
    for name in ("top_p", "ras_top_p", "codebook_top_p"):
        if not _is_number(values[name]) or not 0 < values[name] <= 1:
            raise ValueError(f"{name} must be a number in (0, 1], got {values[name]!r}")
    for name in ("top_k", "ras_top_k", "codebook_top_k"):
        if values[name] is not None and (not _is_int(values[name]) or values[name] < 0):
            raise ValueError(f"{name} must be an integer >= 1 (0 or None for no limit), got {values[name]!r}")


def generation_settings(
    base: GenerationConfig, generation_config: GenerationConfig | None = None, **kwargs
) -> GenerationConfig:
    """`base` (a model's generation config) updated with `generation_config` and per-call keywords, checked.

    The one place where Drama 3's generation settings are validated: `generate` calls it, and so can a front end
    (the CLI, a server) before loading a model, with `GenerationConfig(**DRAMA3_GENERATION_DEFAULTS)` as `base`.
    Raises `TypeError` for an unknown keyword and `ValueError` for a value out of range or a transformers setting
    that does not apply to Drama 3 (beams, penalties, ...), naming the setting.
    """
    settings = copy.deepcopy(base)
    for key, value in DRAMA3_GENERATION_DEFAULTS.items():  # a generation_config.json may lack our keys (or unset them)
        if getattr(settings, key, None) is None:
            setattr(settings, key, value)
    if generation_config is not None:
        # transformers' own defaults filled in (pipelines of some versions do it) set nothing.
        neutral = compat.generation_defaults()
        given = {key: value for key, value in generation_config.to_diff_dict().items()
                 if key in DRAMA3_GENERATION_DEFAULTS or (value is not None and value != neutral.get(key))}
        unsupported = sorted(set(given) - set(DRAMA3_GENERATION_DEFAULTS) - set(_IGNORED_SETTINGS))
        if unsupported:
            raise ValueError(
                f"generation_config sets {unsupported}, which Drama 3 generation does not use; it accepts "
                f"{sorted(DRAMA3_GENERATION_DEFAULTS)} (see docs/usage.md, 'Sampling settings')"
            )
        check_settings({**settings.to_dict(), **given})
        settings.update(**given)
    for key in _IGNORED_SETTINGS:
        kwargs.pop(key, None)
    unknown = sorted(set(kwargs) - set(DRAMA3_GENERATION_DEFAULTS))
    if unknown:
        raise TypeError(
            f"generate() got unknown or unsupported arguments {unknown}; Drama 3 generation accepts "
            f"{sorted(DRAMA3_GENERATION_DEFAULTS)} (plus input_ids, attention_mask, generation_config, "
            "logits_processor, stopping_criteria, streamer, seed, generator, output_audio, show_progress, prompt_cache)"
        )
    check_settings({**settings.to_dict(), **kwargs})
    settings.update(**kwargs)
    return settings


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

    def state(self, batch: int, capacity: int, ras_window: int, template, scores: bool) -> FrameState:
        """The state of `batch` sequences with room for at least `capacity` rows, built when missing or too small."""
        key = (batch, ras_window, scores)
        state = self.states.get(key)
        if state is None or state.capacity < capacity:
            self.states.pop(key, None)  # free the old buffers first
            state = self.states[key] = FrameState(self.model, batch, capacity, ras_window, template, scores)
        return state

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
    """`state.step` compiled by torch.compile with `backend`, kept on the state (each window and sampling setting is
    compiled on its first use)."""
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
        return _is_int(value) and -(2**63) <= value < 2**64

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
        self.sampler = FrameSampler(settings)
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


class Drama3GenerationMixin(GenerationMixin):
    """`generate` for `FishOmniForSpeech`: transformers' `GenerationMixin`, with Drama 3's frame loop as the decoding
    method it runs."""

    def _init_generation_config(self) -> None:
        """Put the Drama 3 defaults on `generation_config` where it sets nothing (a loaded `generation_config.json`
        wins)."""
        for key, value in DRAMA3_GENERATION_DEFAULTS.items():
            if getattr(self.generation_config, key, None) is None:
                setattr(self.generation_config, key, value)
        self.generation_config.eos_token_id = self.config.eos_token_id

    def adjust_generation_fn(self, *args, **kwargs):
        """transformers' loading of the checkpoint's generation config (`from_pretrained`), then the Drama 3
        defaults for what it leaves unset."""
        super().adjust_generation_fn(*args, **kwargs)
        self._init_generation_config()

    def reset_frame_states(self) -> None:
        """Free the frame states and captured CUDA graphs that `generate(..., fast_decode=True)` keeps on a CUDA
        device for later calls (they are rebuilt on the next such call)."""
        self._frame_states = None

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,  # [B, T, 1 + NCB] prompt frame rows from Drama3Processor
        attention_mask: torch.Tensor | None = None,  # [B, T], 0 = left padding
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        streamer: BaseStreamer | None = None,
        seed: int | list[int] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_audio: bool = True,
        show_progress: bool = False,
        prompt_cache: PromptCache | None = None,
        **kwargs,
    ) -> Drama3GenerateOutput | torch.LongTensor:
        """Generate speech frames (and their audio) for a batch of left-padded prompts.

        Settings come from `model.generation_config` (Drama 3 defaults) updated by `generation_config` and by
        keywords (`temperature`, `top_p`, `top_k`, `ras_*`, `codebook_*`, `max_new_tokens`, `do_sample`,
        `output_scores`, `return_dict_in_generate`, ...); an unknown keyword is an error. `do_sample=False` is greedy
        everywhere (no RAS). `seed` (or a `torch.Generator`) makes a run reproducible; a list of seeds (or
        generators), one per sequence, gives each sequence the frames it gets alone with that seed.

        `logits_processor` (a `LogitsProcessorList`) is applied to the main-token candidate logits `[B, V + 1]` of each
        frame before Drama 3's sampling rule, called with the rows generated so far (`[B, T + n, 1 + NCB]`);
        `stopping_criteria` (a `StoppingCriteriaList`) is called after each frame with the rows including it and
        that frame's candidate logits, and a sequence it marks ends with finish reason `"stop"`. `streamer` gets
        `put(codes [B, NCB])` per frame (-1 rows for sequences without a frame) and `end()`. `fast_decode=True`
        replays the frame step as a CUDA graph on a CUDA device (docs/usage.md). `prompt_cache` (a `PromptCache` of
        the prompt's first rows, prompt_cache.py) starts the prefill from a copy of its caches instead of recomputing
        those rows. Returns a `Drama3GenerateOutput`
        (or only `sequences` with `return_dict_in_generate=False`).
        """
        settings = generation_settings(self.generation_config, generation_config, **kwargs)
        if logits_processor is not None and not isinstance(logits_processor, LogitsProcessorList):
            logits_processor = LogitsProcessorList(logits_processor)
        if stopping_criteria is not None and not isinstance(stopping_criteria, StoppingCriteriaList):
            stopping_criteria = StoppingCriteriaList(stopping_criteria)
        if isinstance(attention_mask, torch.Tensor) and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 3:
            # Padding on the right (transformers' pipeline collator pads that way, with its pad id in every column)
            # moves to the left, as all-zero rows; padding inside a sequence is refused below.
            if attention_mask.shape == input_ids.shape[:2] and padded_on_the_right(attention_mask):
                input_ids, attention_mask = left_pad_rows(input_ids, attention_mask)
        attention_mask, _ = self.checked_inputs(input_ids, attention_mask)  # before any work; one host read
        batch = input_ids.shape[0]
        input_ids = input_ids.to(self.input_device, torch.long)
        seed = shared_seed(self, seed, generator)  # split over ranks: every rank draws the same noise
        generators = request_generators(seed, generator, batch, execution_device(self.lm_head))
        if settings.fast_decode:
            check_fast_decode_allowed(self)
            check_cuda_graphs(self)

        prefilled = prefill(self, input_ids, attention_mask, prompt_cache)
        loop = FrameLoop(self, settings, prefilled, input_ids, attention_mask, generators, streamer, logits_processor,
                         stopping_criteria)
        try:
            with tqdm(total=loop.frames, unit="frame", disable=not show_progress, leave=False) as bar:
                loop.run(on_step=bar.update)
        finally:
            if streamer is not None:
                streamer.end()

        rows = loop.rows
        sequences = loop.sequences[:, : rows + max(loop.lengths, default=0)]
        codes = [sequences[i, rows : rows + n, 1:].T.contiguous() for i, n in enumerate(loop.lengths)]  # [NCB, n_i]
        if not settings.return_dict_in_generate:
            return sequences
        audio = [self.codec.decode(c[None].to(execution_device(self.codec))).audio_values[0, 0] for c in codes] if output_audio else None
        return Drama3GenerateOutput(
            sequences=sequences, codes=codes, audio=audio, finish_reason=loop.finish_reason,
            scores=tuple(loop.scores) if settings.output_scores else None,
        )


__all__ = ["DRAMA3_GENERATION_DEFAULTS", "Drama3GenerateOutput", "Drama3GenerationMixin", "generation_settings"]
