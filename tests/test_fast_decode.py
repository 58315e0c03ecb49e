"""The fast decode path (`generate(..., fast_decode=True)`) against the regular path: golden greedy frames, seeded
sampling, padded batches that shrink bucket by bucket, streaming, the context limit, state reuse, and the properties
a CUDA graph capture relies on (one traced graph, every buffer updated in place). CPU only: the graph capture itself
runs on CUDA devices (docs/performance.md has the GPU check)."""

import threading

import pytest
import torch

from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.fast_decode import (
    FastFrameDecoder, StaticFrameState, bucket_size, capacity_for, captured_experts, fast_decoder, visible_rows,
)
from transformers_drama3.generation_drama3 import _FrameLoop
from transformers_drama3.streaming import Drama3AudioStreamer
from transformers_drama3.testing import write_tiny_checkpoint

from .conftest import GOLDEN_TINY, golden_generation_model, left_padded


@pytest.fixture(scope="module")
def model():
    model = golden_generation_model()
    yield model
    model.reset_fast_decode()  # free the states (and graphs) this module built


@pytest.fixture(scope="module")
def prompt(expected):
    return expected["prompt_a_rows"][None]


def both_paths(model, *args, **kwargs):
    """The same `generate` call on the regular and on the fast path."""
    return model.generate(*args, **kwargs), model.generate(*args, fast_decode=True, **kwargs)


def assert_same_generation(regular, fast):
    assert fast.finish_reason == regular.finish_reason
    assert torch.equal(fast.sequences, regular.sequences)
    for fast_codes, codes in zip(fast.codes, regular.codes):
        assert torch.equal(fast_codes, codes)


# ---------------------------------------------------------------------------------------------------------------
# Same frames as the regular path
# ---------------------------------------------------------------------------------------------------------------


def test_greedy_fast_path_reproduces_golden(model, prompt, expected):
    regular, fast = both_paths(model, prompt, do_sample=False, max_new_tokens=16)
    assert fast.finish_reason == ["eos"]
    assert torch.equal(fast.codes[0].T, expected["greedy_codes"])
    assert_same_generation(regular, fast)
    # Same codes through the same codec: the audio is bit-identical.
    assert torch.equal(fast.audio[0], regular.audio[0])


@pytest.mark.parametrize("seed", range(4))
def test_seeded_sampling_draws_the_same_frames(model, prompt, seed):
    """One uniform noise tensor per frame from the same generator: batch-1 runs are identical on both paths."""
    assert_same_generation(*both_paths(model, prompt, seed=seed, max_new_tokens=24))


def test_sampling_without_ras_window(model, prompt):
    assert_same_generation(*both_paths(model, prompt, seed=5, max_new_tokens=10, ras_window=0))


def test_padded_batch_shrinks_bucket_by_bucket(model, expected):
    """Three left-padded prompts (bucket 4, one padding copy) that end after 12, 7 and 18 frames: the running ones
    move to buckets 2 and 1 at stop checks, and every sequence still gets the regular path's greedy frames."""
    a = expected["prompt_a_rows"]
    batch, mask = left_padded(a, torch.cat((a[:1], a[4:])), torch.cat((a[:1], a[8:])))
    model.reset_fast_decode()
    regular, fast = both_paths(
        model, batch, attention_mask=mask, do_sample=False, max_new_tokens=30, stop_check_interval=2
    )
    assert_same_generation(regular, fast)
    assert [codes.shape[1] for codes in fast.codes] == [12, 7, 18] and fast.finish_reason == ["eos"] * 3
    assert {bucket for bucket, _ in model._fast_decoder.states} == {4, 2, 1}


def test_batch_of_two_samples_and_stops_like_generate(model, expected):
    """Bucket 2 holds exactly the batch, so even sampled runs match the regular path until a sequence leaves."""
    batch, mask = left_padded(expected["prompt_a_rows"], expected["prompt_b_rows"])
    regular, fast = both_paths(model, batch, attention_mask=mask, seed=2, max_new_tokens=6, stop_check_interval=6)
    assert_same_generation(regular, fast)


def test_streamed_audio_equals_the_regular_stream(model, prompt):
    regular_streamer = Drama3AudioStreamer(model.codec, chunk_frames=3, first_chunk_frames=1)
    fast_streamer = Drama3AudioStreamer(model.codec, chunk_frames=3, first_chunk_frames=1)
    regular = model.generate(prompt, seed=3, max_new_tokens=11, streamer=regular_streamer)
    fast = model.generate(prompt, seed=3, max_new_tokens=11, streamer=fast_streamer, fast_decode=True)
    assert_same_generation(regular, fast)
    assert [c.shape for c in fast_streamer.chunks] == [c.shape for c in regular_streamer.chunks]
    assert torch.equal(torch.cat(fast_streamer.chunks), torch.cat(regular_streamer.chunks))


def test_context_limit(tmp_path, expected):
    """59 prompt rows in a context of 64: 6 frames, the last one not fed back, as on the regular path."""
    small = FishOmniForSpeech.from_pretrained(
        write_tiny_checkpoint(tmp_path, seed=2, text_config={"max_position_embeddings": 64}), dtype=torch.float32
    )
    regular, fast = both_paths(small, expected["prompt_a_rows"][None], seed=0, max_new_tokens=50)
    assert fast.finish_reason == ["context"]
    assert_same_generation(regular, fast)


def test_single_prompt_row(model):
    """One prompt row: the tower's prefill is empty, its static cache starts at row 0."""
    row = torch.zeros(1, 1, 11, dtype=torch.long)
    row[..., 0] = 5
    assert_same_generation(*both_paths(model, row, do_sample=False, max_new_tokens=6))


# ---------------------------------------------------------------------------------------------------------------
# State kept between calls
# ---------------------------------------------------------------------------------------------------------------


def test_state_is_reused_then_grown_then_freed(model, prompt):
    model.reset_fast_decode()
    model.generate(prompt, do_sample=False, max_new_tokens=4, fast_decode=True)
    decoder = model._fast_decoder
    state = decoder.states[(1, 16)]
    assert state.capacity == capacity_for(prompt.shape[1] + 4)
    model.generate(prompt, do_sample=False, max_new_tokens=8, fast_decode=True)
    assert model._fast_decoder is decoder and decoder.states[(1, 16)] is state  # same buffers, no reallocation
    long_prompt = prompt.expand(1, -1, -1).repeat(1, 5, 1)  # 355 rows: more than the state holds
    assert_same_generation(*both_paths(model, long_prompt, do_sample=False, max_new_tokens=4))
    assert decoder.states[(1, 16)].capacity == capacity_for(long_prompt.shape[1] + 4) > state.capacity
    model.reset_fast_decode()
    assert model._fast_decoder is None


def test_changed_weights_are_used(model, prompt):
    """The candidate rows of lm_head are copied at every call, so an in-place update of the weights counts."""
    model.generate(prompt, do_sample=False, max_new_tokens=3, fast_decode=True)
    original = model.lm_head.weight.detach().clone()
    try:
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)
        assert_same_generation(*both_paths(model, prompt, do_sample=False, max_new_tokens=8))
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(original)


def test_replaced_parameters_rebuild_the_decoder(model, prompt):
    model.generate(prompt, do_sample=False, max_new_tokens=2, fast_decode=True)
    decoder = fast_decoder(model)
    original = model.tower.heads[0].weight
    try:
        model.tower.heads[0].weight = torch.nn.Parameter(original.detach().clone())
        assert fast_decoder(model) is not decoder
    finally:
        model.tower.heads[0].weight = original


def test_a_failed_request_leaves_nothing_behind(model, prompt):
    """A streamer error stops a request mid-way; the next request loads its own rows over the state."""

    class Failing(Drama3AudioStreamer):
        def put(self, value):
            if len(self._pending) == 2:
                raise RuntimeError("listener went away")
            super().put(value)

    with pytest.raises(RuntimeError, match="listener went away"):
        model.generate(prompt, seed=3, max_new_tokens=11, fast_decode=True, streamer=Failing(model.codec, 5))
    assert model._fast_decoder._owner is None  # released
    assert_same_generation(*both_paths(model, prompt, seed=1, max_new_tokens=12))


def test_threads_take_turns_and_nested_calls_are_refused(model, prompt, expected):
    """Two threads generating at once on the fast path wait for each other (they share the model's state) and get
    what they get alone; a fast-path `generate` from inside a running one (a streamer) is refused."""
    other = expected["prompt_b_rows"][None]
    alone = [model.generate(p, do_sample=False, max_new_tokens=10, fast_decode=True) for p in (prompt, other)]
    results = [None, None]

    def run(index, rows):
        results[index] = model.generate(rows, do_sample=False, max_new_tokens=10, fast_decode=True)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate((prompt, other))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for together, single in zip(results, alone):
        assert_same_generation(single, together)

    class Nested(Drama3AudioStreamer):
        def put(self, value):
            model.generate(prompt, max_new_tokens=2, fast_decode=True)

    with pytest.raises(RuntimeError, match="from inside a running fast-path generate"):
        model.generate(prompt, seed=0, max_new_tokens=4, fast_decode=True, streamer=Nested(model.codec))
    assert model._fast_decoder._owner is None


# ---------------------------------------------------------------------------------------------------------------
# What a CUDA graph capture relies on
# ---------------------------------------------------------------------------------------------------------------


def _loaded_state(model, prompt, **settings):
    settings = model._generation_settings(None, {"max_new_tokens": 8, **settings})
    loop = _FrameLoop(model, settings, prompt, torch.ones(prompt.shape[:2], dtype=torch.long), None, None)
    state = FastFrameDecoder(model).state(1, capacity_for(prompt.shape[1] + 8), settings.ras_window, loop.cache)
    state.load_prefill(loop)
    return state, loop.sampler, visible_rows(prompt.shape[1] + 1, state.capacity)


def _state_tensors(state) -> dict[str, torch.Tensor]:
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
    state, sampler, visible = _loaded_state(model, prompt)
    before = {name: (tensor, tensor.data_ptr()) for name, tensor in _state_tensors(state).items()}
    snapshot = {name: tensor.clone() for name, (tensor, _) in before.items()}
    state.noise.uniform_(generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        state.step(sampler, visible)
    after = _state_tensors(state)
    assert after.keys() == before.keys()
    for name, (tensor, pointer) in before.items():
        assert after[name] is tensor and tensor.data_ptr() == pointer, name
    changed = {name for name, (tensor, _) in before.items() if not torch.equal(tensor, snapshot[name])}
    # Every kind of state moved: the new row, the slot, the caches (KV and linear attention), the RAS window.
    assert {"new_rows", "slot", "position", "hidden", "history", "valid"} <= changed
    assert any(name.endswith("recurrent_states.0") for name in changed)
    assert any(name.startswith("tower.") and name.endswith("keys") for name in changed)


def test_step_traces_as_one_graph_without_breaks(model, prompt):
    """TorchDynamo traces the whole sampled step as a single graph: no host synchronisation, no shape or value
    read back to Python, which is what a CUDA graph capture needs (the eager experts loop is not capturable, the
    fast path uses `batched_mm` on CUDA)."""
    model.set_experts_implementation("batched_mm")
    try:
        state, sampler, visible = _loaded_state(model, prompt)
        with torch.no_grad():
            explanation = torch._dynamo.explain(state.step)(sampler, visible)
    finally:
        model.set_experts_implementation("eager")
        torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [reason.reason for reason in explanation.break_reasons]
    assert explanation.graph_count == 1


# ---------------------------------------------------------------------------------------------------------------
# Helpers and bad inputs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (16, 16), (17, 32)])
def test_bucket_size(batch, bucket):
    assert bucket_size(batch) == bucket


def test_capacity_is_allocated_in_chunks():
    assert capacity_for(1) == capacity_for(256) == 256 and capacity_for(257) == 512 and capacity_for(2098) == 2304


@pytest.mark.parametrize("rows,window", [(1, 256), (256, 256), (257, 512), (600, 1024), (2049, 2304), (2304, 2304)])
def test_attention_window_doubles_up_to_the_capacity(rows, window):
    assert visible_rows(rows, 2304) == window


def test_request_crossing_an_attention_window_keeps_the_hidden_states(model, expected, monkeypatch):
    """250 prompt rows: the 7th frame's row is row 257, so the step moves from the 256-row attention window to the
    512-row one mid-request. Every frame's backbone hidden state equals the regular path's (1e-4; both are float32
    over the same rows, the fast one with masked padding slots), not only the argmax. EOS's lm_head row is zeroed
    so the run cannot stop early."""
    rows = torch.cat([expected["prompt_b_rows"]] * 4)[:250][None]
    hidden = {"regular": [], "fast": []}
    feed_back, step = _FrameLoop._feed_back, StaticFrameState.step

    def regular_feed_back(loop, new_rows):
        feed_back(loop, new_rows)
        hidden["regular"].append(loop.hidden.clone())

    def fast_step(state, sampler, visible):
        step(state, sampler, visible)
        hidden["fast"].append(state.hidden.clone())

    monkeypatch.setattr(_FrameLoop, "_feed_back", regular_feed_back)
    monkeypatch.setattr(StaticFrameState, "step", fast_step)
    eos = model.config.eos_token_id
    original = model.lm_head.weight[eos].detach().clone()
    try:
        with torch.no_grad():
            model.lm_head.weight[eos] = 0.0
        regular, fast = both_paths(model, rows, do_sample=False, max_new_tokens=12, output_audio=False)
    finally:
        with torch.no_grad():
            model.lm_head.weight[eos] = original
    assert fast.finish_reason == ["length"]
    assert_same_generation(regular, fast)
    assert len(hidden["regular"]) == 11 and len(hidden["fast"]) == 12  # the fast step also feeds the last frame
    for index, (fast_hidden, regular_hidden) in enumerate(zip(hidden["fast"], hidden["regular"])):
        torch.testing.assert_close(fast_hidden, regular_hidden, atol=1e-4, rtol=1e-4, msg=f"frame {index + 1}")


def test_fast_decode_must_be_a_bool(model, prompt):
    with pytest.raises(ValueError, match="fast_decode must be True or False"):
        model.generate(prompt, fast_decode="yes", max_new_tokens=2)


def test_dispatched_model_is_refused_before_any_work(model, prompt, monkeypatch):
    monkeypatch.setattr(model, "hf_device_map", {"backbone": "cpu", "tower": "disk"}, raising=False)
    monkeypatch.setattr(model.backbone, "forward", lambda *a, **k: pytest.fail("the prefill ran"))
    with pytest.raises(ValueError, match="whole model on one device"):
        model.generate(prompt, fast_decode=True, max_new_tokens=2)


def test_attention_kernel_without_masks_is_refused(model, prompt, monkeypatch):
    monkeypatch.setattr(model.config.text_config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        model.generate(prompt, fast_decode=True, max_new_tokens=2)


def test_graphs_are_captured_with_batched_mm_experts_and_the_choice_is_restored(model):
    """The eager experts loop reads the routing on the host; a capture runs `batched_mm`, then the user's choice
    (here the golden `eager`) is back for the prefill and the regular path."""
    seen = []
    with captured_experts(model):
        seen.append(model.backbone.config._experts_implementation)
    assert seen == ["batched_mm"] and model.backbone.config._experts_implementation == "eager"
    with pytest.raises(RuntimeError, match="inside"), captured_experts(model):
        raise RuntimeError("inside")
    assert model.backbone.config._experts_implementation == "eager"


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs (run on a GPU machine: `python -m pytest tests/test_fast_decode.py -k cuda`)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_give_the_regular_frames(expected):
    """On CUDA the fast path replays captured graphs: greedy and seeded runs, and a padded batch that shrinks
    bucket by bucket (a capture per bucket, one mid-request), give the regular path's frames."""
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, device_map="cuda")
    model.set_experts_implementation("batched_mm")  # what a captured step runs: the same numbers on both paths
    a = expected["prompt_a_rows"]
    prompt = a[None].cuda()
    assert_same_generation(*both_paths(model, prompt, do_sample=False, max_new_tokens=16))
    assert model._fast_decoder.states[(1, 16)].graphs  # the frames came from graph replays
    for seed in range(3):
        assert_same_generation(*both_paths(model, prompt, seed=seed, max_new_tokens=24))
    batch, mask = left_padded(a, torch.cat((a[:1], a[4:])), torch.cat((a[:1], a[8:])))
    regular, fast = both_paths(
        model, batch.cuda(), attention_mask=mask.cuda(), do_sample=False, max_new_tokens=30, stop_check_interval=2
    )
    assert_same_generation(regular, fast)
    assert all(state.graphs for state in model._fast_decoder.states.values())
    # The codec decoding on its own stream in a worker thread while graphs replay (and get captured: new state).
    model.reset_fast_decode()
    inline = Drama3AudioStreamer(model.codec, chunk_frames=3)
    overlapped = Drama3AudioStreamer(model.codec, chunk_frames=3, overlap=True)
    a_run = model.generate(prompt, do_sample=False, max_new_tokens=11, streamer=inline, fast_decode=True)
    model.reset_fast_decode()
    b_run = model.generate(prompt, do_sample=False, max_new_tokens=11, streamer=overlapped, fast_decode=True)
    assert_same_generation(a_run, b_run)
    assert all(torch.equal(x, y) for x, y in zip(overlapped.chunks, inline.chunks)) and len(inline.chunks) > 1
