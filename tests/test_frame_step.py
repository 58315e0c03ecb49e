"""The one frame step (`FrameState.step`) and the loop around it, against independent formulations.

- Greedy frames equal a reference built from the teacher-forced `forward` alone, without any cache: every main token
  and every code is the argmax of a full uncached pass over the prompt and the frames so far.
- Every frame's hidden state equals the full uncached `forward`'s across an attention-window crossing (256 -> 512
  rows, the state growing mid-request).
- What a CUDA graph capture relies on: every buffer updated in place, one traced graph without breaks.
- States: dropped after an eager call, one request per model at a time, nothing left behind by a failed request.

The equality checks run the golden tiny checkpoint in float64 with the eager experts loop. The step and the uncached
forward compute the same sums in another order (cached vs full attention, the recurrent vs the chunked gated-delta
rule), so they differ by rounding only (tests/tolerances.py: 2 * u * R * max|reference|, R the reduction lengths from
the input embedding to the final norm). transformers' reference gated-delta kernels compute in float32 whatever the
dtype, so u is float32's here although the model runs in float64 (about 2e-6 is seen against a bound of about 5e-3);
a wrong row, mask, position or cache slot changes hidden states by O(1).
"""

import contextlib
import copy
import threading

import pytest
import torch

from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.generation.cuda_graphs import StepGraphs, captured_experts
from transformers_drama3.generation.state import WINDOW_CHUNK, FrameState, attention_window, row_limit
from transformers_drama3.generation.engine import Drama3Engine
from transformers_drama3.generation.rules import Drama3FrameSampling, frame_criteria
from transformers_drama3.generation.runner import FrameRunner, KeptStates, kept_states
from transformers_drama3.generation import generation_settings
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig
from transformers_drama3.streaming import Drama3AudioStreamer

from .conftest import GOLDEN_TINY, left_padded
from .tolerances import backbone_reductions, codebook_logit_reductions, reordering_tolerance



@pytest.fixture(scope="module")
def model(golden_model):
    return golden_model  # the session's (conftest.py): the experts' setting changed here is always restored


@pytest.fixture(scope="module")
def model64():
    # Experts dequantised at load: these tests compare the step with uncached passes over every row (160 of them for
    # 16 frames), which would dequantise every FP8 layer again on each pass; the FP8-kept path has its own tests.
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float64,
                                              quantization_config=BsgemmMoeConfig(dequantize=True))
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model


@pytest.fixture(scope="module")
def prompt(expected):
    return expected["prompt_a_rows"][None]


def no_eos(model):
    """A context in which the EOS row of lm_head is zero (its logit 0, far below the semantic tokens' here), so greedy
    runs do not stop early."""
    eos = model.config.eos_token_id
    original = model.lm_head.weight[eos].detach().clone()

    class Restore:
        def __enter__(self):
            with torch.no_grad():
                model.lm_head.weight[eos] = 0.0

        def __exit__(self, *exc):
            with torch.no_grad():
                model.lm_head.weight[eos] = original

    return Restore()


# ---------------------------------------------------------------------------------------------------------------
# Independent formulations
# ---------------------------------------------------------------------------------------------------------------


def uncached_greedy_frames(model, prompt: torch.Tensor, frames: int) -> torch.Tensor:
    """Greedy decoding from `forward` alone, no cache: the main token is the argmax of the last row's main logits;
    code j + 1 is the argmax of head j's logits for the new row, teacher-forced with the codes chosen so far (the
    codes after it do not reach head j: the tower is causal over codebooks)."""
    rows = prompt.clone()  # [1, T, 11]
    start = model.config.semantic_start_token_id
    candidates = model.main_candidate_ids()
    for _ in range(frames):
        with torch.no_grad():
            main = candidates[model(rows).main_logits[0, -1].argmax()]
        if main == model.config.eos_token_id:
            break
        row = torch.zeros(1, 1, 11, dtype=torch.long)
        row[0, 0, 0], row[0, 0, 1] = main, main - start
        for j in range(model.config.num_codebooks - 1):
            with torch.no_grad():
                head = model(torch.cat((rows, row), dim=1)).codebook_logits[0, -1, j]
            row[0, 0, 2 + j] = head.argmax()
        rows = torch.cat((rows, row), dim=1)
    return rows[0, prompt.shape[1] :]


def test_greedy_frames_equal_the_uncached_teacher_forced_reference(model64, prompt):
    out = model64.generate(prompt, do_sample=False, max_new_tokens=16, output_audio=False)
    reference = uncached_greedy_frames(model64, prompt, 16)
    assert out.codes[0].shape[1] == reference.shape[0] > 0
    assert torch.equal(out.sequences[0, prompt.shape[1] :], reference)


def test_hidden_states_across_an_attention_window_crossing_equal_the_uncached_forward(model64, expected, monkeypatch):
    """250 prompt rows and 12 frames: the 7th frame's row is row 257, so the step moves from the 256-row window to
    the 512-row one and the state grows mid-request. Every frame's hidden state equals the full uncached forward's
    over the prompt and the frames (within rounding: module docstring), not only the argmax."""
    rows = torch.cat([expected["prompt_b_rows"]] * 4)[:250][None]
    hidden, capacities, step = [], [], FrameState.step

    def recording_step(state, visible, sampling, stopping, hook=None):
        step(state, visible, sampling, stopping, hook)
        hidden.append(state.hidden.clone())
        capacities.append(state.capacity)

    monkeypatch.setattr(FrameState, "step", recording_step)
    with no_eos(model64):
        out = model64.generate(rows, do_sample=False, max_new_tokens=12, output_audio=False)
        with torch.no_grad():
            full = model64(out.sequences).last_hidden_state[0]  # [250 + 12, D]
    assert out.finish_reason == ["length"] and len(hidden) == 12
    assert capacities[:6] == [256] * 6 and capacities[6:] == [512] * 6  # row 256 is the 7th frame's
    # Frame k's step feeds row 250 + k back: its hidden state is the full pass's at that row (the last frame's row,
    # fed back after the last frame, has no counterpart in `sequences` beyond it).
    text_config = model64.config.text_config
    for k in range(11):
        # float32's u: the gated-delta kernels' precision (module docstring).
        tolerance = reordering_tolerance(full[250 + k].float(), backbone_reductions(text_config, 251 + k))
        torch.testing.assert_close(hidden[k][0], full[250 + k], **tolerance, msg=f"frame {k + 1}")


# ---------------------------------------------------------------------------------------------------------------
# What a CUDA graph capture relies on
# ---------------------------------------------------------------------------------------------------------------


def loaded_state(model, prompt, **settings):
    """A state holding `prompt` after its prefill, with the window of its first step."""
    settings = generation_settings(model.generation_config, max_new_tokens=8, **settings)
    mask = torch.ones(prompt.shape[:2], dtype=torch.long)
    with torch.no_grad():
        prefill = model(prompt, mask, use_cache=True, logits_to_keep=1)
    visible = attention_window(prompt.shape[1] + 1, row_limit(model.config.text_config.max_position_embeddings))
    state = FrameState(model, 1, visible, settings.ras_window, prefill.cache)
    state.start_at(prompt.shape[1])
    row = torch.zeros(1, dtype=torch.long)
    state.admit(row, prefill, prompt, model.row_positions(mask), mask, [8])
    state.sampler.set_rows(row, settings)
    return state, visible


def step_rules(model) -> tuple:
    """The sampling rule and device criteria a step runs (those of an engine with the model's settings)."""
    return Drama3FrameSampling(), frame_criteria(model, model.generation_config)


def state_tensors(state) -> dict[str, torch.Tensor]:
    tensors = {name: value for name, value in vars(state).items() if isinstance(value, torch.Tensor)}
    for prefix, cache in (("backbone", state.cache), ("tower", state.tower_cache)):
        for index, layer in enumerate(cache.layers):
            for name in ("keys", "values", "cumulative_length"):
                if getattr(layer, name, None) is not None:
                    tensors[f"{prefix}.{index}.{name}"] = getattr(layer, name)
            for name in ("conv_states", "recurrent_states"):
                for state_idx, value in getattr(layer, name, {}).items():
                    if value is not None:
                        tensors[f"{prefix}.{index}.{name}.{state_idx}"] = value
    return tensors


def test_step_updates_every_buffer_in_place(model, prompt):
    """A replayed graph reads and writes the addresses seen at capture: the step must never rebind a buffer."""
    state, visible = loaded_state(model, prompt)
    before = {name: (tensor, tensor.data_ptr()) for name, tensor in state_tensors(state).items()}
    snapshot = {name: tensor.clone() for name, (tensor, _) in before.items()}
    state.sampler.fill_noise(state.noise, torch.Generator().manual_seed(0))
    with torch.no_grad():
        state.step(visible, *step_rules(model))
    after = state_tensors(state)
    assert after.keys() == before.keys()
    for name, (tensor, pointer) in before.items():
        assert after[name] is tensor and tensor.data_ptr() == pointer, name
    changed = {name for name, (tensor, _) in before.items() if not torch.equal(tensor, snapshot[name])}
    # Every kind of state moved: the new row, the slot, the caches (KV and linear attention), the RAS window.
    assert {"new_rows", "write_at", "position", "hidden", "history", "valid", "count"} <= changed
    assert any(name.endswith("recurrent_states.0") for name in changed)
    assert any(name.startswith("tower.") and name.endswith("keys") for name in changed)


def test_step_traces_as_one_graph_without_breaks(model, prompt):
    """TorchDynamo traces the whole sampled step as a single graph: no host synchronisation, no shape or value read
    back to Python, which is what a CUDA graph capture (and torch.compile) needs. The eager experts loop reads the
    routing on the host, so this runs the experts a capture uses."""
    with captured_experts(model):
        state, visible = loaded_state(model, prompt)
        with torch.no_grad():
            explanation = torch._dynamo.explain(state.step)(visible, *step_rules(model))
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [reason.reason for reason in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_graphs_are_captured_with_batched_mm_experts_and_the_choice_is_restored(model):
    seen = []
    with captured_experts(model):
        seen.append(model.backbone.config._experts_implementation)
    assert seen == ["batched_mm"] and model.backbone.config._experts_implementation == "eager"
    with pytest.raises(RuntimeError, match="inside"), captured_experts(model):
        raise RuntimeError("inside")
    assert model.backbone.config._experts_implementation == "eager"


def test_the_compiled_step_gives_the_eager_frames(model, prompt):
    """`compile_step` runs the step through torch.compile (here the `aot_eager` backend: dynamo's single graph and
    its functionalised in-place updates of the state, without inductor's minutes of code generation; inductor runs in
    benchmarks/frame_step.py and on the GPU check). Greedy frames equal the eager step's golden ones."""
    with captured_experts(model):
        out = model.generate(prompt, do_sample=False, max_new_tokens=16, compile_step="aot_eager", output_audio=False)
    torch._dynamo.reset()
    assert out.finish_reason == ["eos"]
    assert torch.equal(out.sequences, model.generate(prompt, do_sample=False, max_new_tokens=16, output_audio=False).sequences)


def test_compile_step_must_be_a_bool_or_a_backend_name(model, prompt):
    with pytest.raises(ValueError, match="compile_step must be True, False or a torch.compile backend name"):
        model.generate(prompt, compile_step=3, max_new_tokens=2)


# ---------------------------------------------------------------------------------------------------------------
# States across calls
# ---------------------------------------------------------------------------------------------------------------


def test_eager_calls_keep_no_state_and_memory_follows_the_frames(model, prompt, monkeypatch):
    """Without CUDA graphs a call's states are dropped at its end; a huge max_new_tokens sizes nothing: the state
    holds one window of cache positions and the output the frames made (the golden run stops after 12 frames)."""
    capacities = []
    close = FrameRunner.close

    def spy(runner):
        capacities.append(runner.state.capacity if runner.state is not None else None)
        close(runner)

    monkeypatch.setattr(FrameRunner, "close", spy)
    out = model.generate(prompt, do_sample=False, max_new_tokens=10**9, output_audio=False)
    assert out.finish_reason == ["eos"] and out.codes[0].shape[1] == 12
    assert out.sequences.shape[1] == prompt.shape[1] + 12
    assert capacities == [WINDOW_CHUNK]  # the smallest attention window holds prompt and frames
    assert kept_states(model).states == {}


def test_threads_generate_at_once_and_a_nested_call_runs(model, prompt, expected):
    """Two threads generating at once with one model each get what they get alone (a call's eager state is its
    own); a `generate` from inside a running one (a streamer) runs too."""
    other = expected["prompt_b_rows"][None]
    alone = [model.generate(p, do_sample=False, max_new_tokens=10, output_audio=False) for p in (prompt, other)]
    results = [None, None]

    def run(index, rows):
        results[index] = model.generate(rows, do_sample=False, max_new_tokens=10, output_audio=False)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate((prompt, other))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for together, single in zip(results, alone):
        assert torch.equal(together.sequences, single.sequences)

    nested = []

    class Nested(Drama3AudioStreamer):
        def put(self, value):
            if value.dim() == 2 and not nested:  # at the first frame (the prompt rows come first, [B, T, 11])
                nested.append(model.generate(other, do_sample=False, max_new_tokens=10, output_audio=False).sequences)
            super().put(value)

    outer = model.generate(prompt, do_sample=False, max_new_tokens=10, streamer=Nested(model.codec), output_audio=False)
    assert torch.equal(outer.sequences, alone[0].sequences)
    assert len(nested) == 1 and torch.equal(nested[0], alone[1].sequences)


def test_a_failed_request_leaves_nothing_behind(model, prompt):
    """A streamer error stops a request mid-way; the next request is unaffected."""

    class Failing(Drama3AudioStreamer):
        frames = 0

        def put(self, value):
            self.frames += 1
            if self.frames == 3:
                raise RuntimeError("listener went away")
            super().put(value)

    before = model.generate(prompt, seed=1, max_new_tokens=12, output_audio=False)
    with pytest.raises(RuntimeError, match="listener went away"):
        model.generate(prompt, seed=3, max_new_tokens=11, streamer=Failing(model.codec, 5))
    assert torch.equal(model.generate(prompt, seed=1, max_new_tokens=12, output_audio=False).sequences, before.sequences)


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs (run on a GPU machine: `python -m pytest tests/test_frame_step.py -k cuda`)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_give_the_eager_frames(expected):
    """On CUDA, `fast_decode=True` replays captured graphs: greedy and seeded runs (other sampling settings replay the
    same graphs), a padded batch that shrinks bucket by bucket (a capture per bucket, one mid-request), and overlapped
    streaming give the eager step's frames; states and graphs are kept for the next call and freed by
    `reset_frame_states`."""
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, device_map="cuda")
    model.set_experts_implementation("batched_mm")  # what a captured step runs: the same numbers both ways
    a = expected["prompt_a_rows"]
    prompt = a[None].cuda()

    def both(*args, **kwargs):
        eager = model.generate(*args, **kwargs, output_audio=False)
        graphs = model.generate(*args, **kwargs, fast_decode=True, output_audio=False)
        assert graphs.finish_reason == eager.finish_reason
        assert torch.equal(graphs.sequences, eager.sequences)

    both(prompt, do_sample=False, max_new_tokens=16)
    assert kept_states(model).states and all(s.graphs for s in kept_states(model).states.values())
    for seed in range(3):
        both(prompt, seed=seed, max_new_tokens=24)

    def graphs_now() -> set[int]:
        return {id(graph) for state in kept_states(model).states.values() for graph in state.graphs.values()}

    model.generate(prompt, seed=0, max_new_tokens=24, fast_decode=True, output_audio=False)
    captured = graphs_now()
    other = dict(temperature=0.6, top_p=0.8, top_k=7, codebook_temperature=0.7)  # the sampler's tensors change
    fast = model.generate(prompt, seed=1, max_new_tokens=24, fast_decode=True, output_audio=False, **other)
    assert graphs_now() <= captured  # other settings replay the graphs captured for the defaults
    assert torch.equal(fast.sequences, model.generate(prompt, seed=1, max_new_tokens=24, output_audio=False, **other).sequences)
    batch, mask = left_padded(a, torch.cat((a[:1], a[4:])), torch.cat((a[:1], a[8:])))
    both(batch.cuda(), attention_mask=mask.cuda(), do_sample=False, max_new_tokens=30, stop_check_interval=2)
    assert {key[0] for key in kept_states(model).states} >= {4, 2, 1}
    inline = Drama3AudioStreamer(model.codec, chunk_frames=3)
    overlapped = Drama3AudioStreamer(model.codec, chunk_frames=3, overlap=True)
    model.generate(prompt, do_sample=False, max_new_tokens=11, streamer=inline, fast_decode=True)
    model.reset_frame_states()
    model.generate(prompt, do_sample=False, max_new_tokens=11, streamer=overlapped, fast_decode=True)
    assert all(torch.equal(x, y) for x, y in zip(inline.chunks, overlapped.chunks)) and len(inline.chunks) > 2
    model.reset_frame_states()
    assert kept_states(model).states == {}


class StandInCapture:
    """torch.cuda's stream and graph calls as a CPU run can take them, for `test_nothing_compiles_inside_a_capture`:
    a capture runs its step (where a compile would happen; a real capture would launch its kernels into the graph),
    a replay runs the captured step again. It counts the graphs TorchDynamo made inside captures and elsewhere."""

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other) -> None:
            pass

    class Graph:
        step = None

        def replay(self) -> None:
            self.step()

    def __init__(self, monkeypatch):
        self.inside = self.outside = self.captures = 0
        self.keys: set[tuple] = set()
        monkeypatch.setattr(torch.cuda, "Stream", self.Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", self.Graph)
        monkeypatch.setattr(torch.cuda, "graph", self.capture_region)
        capture = StepGraphs.capture

        def recording(graphs, model, step, device):
            graph = capture(graphs, model, step, device)
            graph.step = step
            return graph

        monkeypatch.setattr(StepGraphs, "capture", recording)

    @staticmethod
    def graphs_made() -> int:
        return torch._dynamo.utils.counters["stats"]["unique_graphs"]

    @contextlib.contextmanager
    def capture_region(self, graph, **kwargs):
        before = self.graphs_made()
        yield
        self.inside += self.graphs_made() - before
        self.captures += 1


def test_nothing_compiles_inside_a_capture(model, prompt, monkeypatch):
    """With CUDA graphs and a compiled step (`fast_decode=True, compile_step=True`, the defaults' sampling), each
    variant of the step (argmax-only, sampling) compiles in the state's warm-up, outside any capture: a compile inside
    `torch.cuda.graph` would launch its first kernels into the graph. Run on the CPU with torch.cuda's capture calls
    stood in for (`StandInCapture`) and dynamo's `eager` backend (tracing without code generation)."""
    torch._dynamo.reset()
    stand_in = StandInCapture(monkeypatch)
    defaults = generation_settings(model.generation_config)
    runner = FrameRunner(model, Drama3FrameSampling(), frame_criteria(model, defaults), graphs=True,
                         compile_step="eager", kept=KeptStates(model))
    engine = Drama3Engine(model, runner=runner)
    try:
        with captured_experts(model):
            before = stand_in.graphs_made()
            greedy = engine.add_request(prompt, max_new_tokens=3, do_sample=False)
            engine.run_until_idle()
            sampled = engine.add_request(prompt, max_new_tokens=3, seed=0)
            engine.run_until_idle()
            warmed = stand_in.graphs_made() - before - stand_in.inside
    finally:
        torch._dynamo.reset()
    assert [engine.get_result(key).error for key in (greedy, sampled)] == [None, None]
    assert stand_in.captures >= 2  # the argmax-only step and the sampling one were captured
    assert stand_in.inside == 0, f"{stand_in.inside} graph(s) compiled inside a capture"
    assert warmed >= 2  # both variants compiled, in the warm-up


def test_a_model_that_generated_can_be_deep_copied(model, prompt):
    model.generate(prompt, do_sample=False, max_new_tokens=2, output_audio=False)
    copied = copy.deepcopy(model)  # the states hold a lock, which cannot be copied: a copy starts without them
    assert torch.equal(copied.generate(prompt, do_sample=False, max_new_tokens=4, output_audio=False).sequences,
                       model.generate(prompt, do_sample=False, max_new_tokens=4, output_audio=False).sequences)


def test_every_frames_codebook_logits_equal_the_uncached_teacher_forced_ones(model64, prompt, monkeypatch):
    """The tower's head logits of every generated frame (codes 1..9, each from the codes drawn before it) equal the
    teacher-forced tower logits of one uncached pass over the prompt and the frames (within rounding), so no cache
    slot, mask entry or position of the tower is off, even where it would not change an argmax."""
    heads, decode = [], type(model64.tower).decode_codes

    def recording(tower, *args, **kwargs):
        codes, logits = decode(tower, *args, **kwargs)
        heads.append(logits.clone())
        return codes, logits

    monkeypatch.setattr(type(model64.tower), "decode_codes", recording)
    with no_eos(model64):
        out = model64.generate(prompt, do_sample=False, max_new_tokens=8, output_audio=False)
        with torch.no_grad():
            full = model64(out.sequences).codebook_logits[0]  # [T + 8, NCB - 1, V]
    rows = prompt.shape[1]
    for k in range(8):  # frame k is row rows + k, predicted from row rows + k - 1
        reference = full[rows + k]
        tolerance = reordering_tolerance(reference.float(),
                                         codebook_logit_reductions(model64.config, rows + k + 1))
        torch.testing.assert_close(heads[k][0], reference, **tolerance, msg=f"frame {k + 1}")
