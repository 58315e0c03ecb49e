"""Continuous batching (`Drama3Engine`): requests admitted between frames get the frames they get alone.

The reference of every comparison is `generate` on the request alone (batch 1), an independent path: it prefills
and admits the whole batch at once, and its sequence sits at slot 0 of a state of its own. The engine's sequences sit
in rows of a shared state, at slots shifted to end with the running ones, next to other sequences with other
settings. Codes are compared exactly: the golden tiny model runs in float64, where the differences that batching and
shifting can make (summation order over masked slots whose weights are exactly zero, and over rows computed in one
matrix product) are ~1e-16 relative, far below the smallest gap between two logits that decides a draw here (the
greedy and seeded runs below are checked against `generate`, so a flip would show as a failure, not pass unseen).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import RequestStatus
from transformers.generation.continuous_batching.utils import WorkloadHints

from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.generation.engine import Drama3Engine
from transformers_drama3.generation import DRAMA3_GENERATION_DEFAULTS

from .conftest import GOLDEN_TINY
from .host_reads import device_reads


@pytest.fixture(scope="module")
def model(golden_float64_model):
    return golden_float64_model


@pytest.fixture(scope="module")
def prompts(engine_prompts):
    return engine_prompts


def alone(model, rows, **settings):
    out = model.generate(rows[None], output_audio=False, **settings)
    return out.codes[0], out.finish_reason[0]


def test_requests_admitted_mid_flight_get_their_frames_alone(model, prompts):
    """A greedy request, then a sampled one admitted after 3 frames, then one with other settings after 5: each
    gives the codes and finish reason of `generate` alone with its settings and seed."""
    requests = [
        dict(do_sample=False, max_new_tokens=20),
        dict(seed=7, max_new_tokens=18),
        dict(seed=3, temperature=0.7, top_p=0.8, top_k=20, ras_window=4, codebook_temperature=0.9, max_new_tokens=16),
    ]
    engine = Drama3Engine(model, max_batch=4)
    ids = [engine.add_request(prompts[0], **requests[0])]
    for _ in range(3):
        engine.step()
    ids.append(engine.add_request(prompts[1], **requests[1]))
    for _ in range(2):
        engine.step()
    ids.append(engine.add_request(prompts[2], **requests[2]))
    engine.run_until_idle()
    results = [engine.get_result(request_id) for request_id in ids]
    for rows, settings, result in zip(prompts, requests, results):
        codes, reason = alone(model, rows, **settings)
        assert result.finish_reason == reason
        assert torch.equal(result.codes, codes)
    assert engine.running == 0 and engine.queued == 0 and not engine.requests


def test_a_long_prompt_admitted_after_short_ones_moves_them_and_all_keep_their_frames(model, prompts, expected):
    """A prompt longer than the slots in use makes the runner move the running sequences to later slots."""
    long_prompt = torch.cat([expected["prompt_b_rows"]] * 3)[:40]
    engine = Drama3Engine(model, max_batch=2)
    first = engine.add_request(prompts[1], do_sample=False, max_new_tokens=12)
    engine.step()
    second = engine.add_request(long_prompt, do_sample=False, max_new_tokens=12)
    engine.run_until_idle()
    for request_id, rows in ((first, prompts[1]), (second, long_prompt)):
        codes, reason = alone(model, rows, do_sample=False, max_new_tokens=12)
        result = engine.get_result(request_id)
        assert (result.finish_reason, result.prompt_rows) == (reason, rows.shape[0])
        assert torch.equal(result.codes, codes)


def test_a_newcomer_takes_a_free_slot_and_a_longer_prompt_moves_the_others_in_place(model, prompts, expected):
    """Admission writes the newcomer into a free slot: no state is built and no running sequence is copied. A prompt
    longer than the cache positions before the next frame's moves the running sequences' attention rows later in the
    same state (`FrameState.shift`), and every request still gets its frames alone."""
    long_prompt = torch.cat([expected["prompt_b_rows"]] * 3)[:40]
    engine = Drama3Engine(model, max_batch=8)
    runner = engine.runner
    ids = [engine.add_request(rows, do_sample=False, max_new_tokens=12) for rows in prompts]
    engine.step()  # all three admitted (1, then 2, then 4 slots: a build per capacity), one frame made
    assert (runner.state.batch, runner.builds, runner.moved_bytes) == (4, 3, runner.moved_bytes)
    builds, moved, state = runner.builds, runner.moved_bytes, runner.state
    ids.append(engine.add_request(prompts[1], do_sample=False, max_new_tokens=12))
    engine.step()  # a free slot: nothing built, nothing of the others copied
    assert (runner.builds, runner.moved_bytes, runner.state) == (builds, moved, state)
    engine.cancel_request(ids.pop())  # its slot is free again
    engine.step()
    ids.append(engine.add_request(long_prompt, do_sample=False, max_new_tokens=12))
    engine.step()  # 40 rows do not fit before the next frame's position: the others move later, in place
    assert runner.builds == builds and runner.state is state and runner.moved_bytes > moved
    engine.run_until_idle()
    for rows, request_id in zip([*prompts, long_prompt], ids):
        codes, reason = alone(model, rows, do_sample=False, max_new_tokens=12)
        result = engine.get_result(request_id)
        assert result.finish_reason == reason and torch.equal(result.codes, codes)


def test_states_are_built_only_when_the_capacity_changes(model, prompts):
    """Six requests arriving one per frame, then leaving: a state build per change of slots or cache length, none
    for an admission into a free slot or a release (before: 11 states for the same run)."""
    engine = Drama3Engine(model, max_batch=8)
    runner, shapes = engine.runner, []
    for index in range(6):
        engine.add_request(prompts[index % 3], do_sample=False, max_new_tokens=8 + 2 * index)
        engine.step()
        shapes.append((runner.state.batch, runner.state.capacity))
    while engine.step():
        if runner.state is not None:
            shapes.append((runner.state.batch, runner.state.capacity))
    changes = sum(1 for before, after in zip(shapes, shapes[1:]) if before != after)
    assert runner.builds == 1 + changes and runner.builds <= 5, shapes
    assert runner.state is None  # emptied with more than one slot: dropped (a request alone gets one slot)
    engine.add_request(prompts[0], do_sample=False, max_new_tokens=4)
    engine.run_until_idle()
    kept, builds = runner.state, runner.builds
    assert kept.batch == 1  # a state of one slot is kept for the next request
    engine.add_request(prompts[1], do_sample=False, max_new_tokens=4)
    engine.run_until_idle()
    assert runner.state is kept and runner.builds == builds
    engine.stop()
    assert runner.state is None  # stop frees it


def test_max_batch_queues_the_rest_and_admits_them_as_rows_free(model, prompts):
    engine = Drama3Engine(model, max_batch=2)
    ids = [engine.add_request(rows, do_sample=False, max_new_tokens=6) for rows in prompts]
    engine.step()
    assert engine.running == 2 and engine.queued == 1
    engine.run_until_idle()
    results = {request_id: engine.get_result(request_id) for request_id in ids}
    for rows, request_id in zip(prompts, ids):
        assert torch.equal(results[request_id].codes, alone(model, rows, do_sample=False, max_new_tokens=6)[0])


def test_a_request_queued_at_the_front_is_admitted_before_those_waiting(model, prompts):
    engine = Drama3Engine(model, max_batch=1)
    engine.add_request(prompts[0], request_id="running", do_sample=False, max_new_tokens=2)
    engine.step()
    engine.add_request(prompts[1], request_id="waiting", do_sample=False, max_new_tokens=2)
    engine.add_request(prompts[2], request_id="front", do_sample=False, max_new_tokens=2, front=True)
    engine.step()  # the running request makes its last frame and leaves
    engine.step()  # its row goes to the front request
    assert [[r.request_id for r in a.requests] for a in engine.waiting] == [["waiting"]]
    assert "front" in engine.runner.running


def test_cancel_while_waiting_and_while_running(model, prompts):
    engine = Drama3Engine(model, max_batch=1)
    running = engine.add_request(prompts[0], do_sample=False, max_new_tokens=30)
    waiting = engine.add_request(prompts[1], do_sample=False, max_new_tokens=30)
    for _ in range(4):
        engine.step()
    engine.cancel_request(waiting)
    engine.cancel_request(running)
    engine.step()
    cancelled_running, cancelled_waiting = engine.get_result(running), engine.get_result(waiting)
    assert cancelled_running.finish_reason == cancelled_waiting.finish_reason == "cancelled"
    assert cancelled_running.frames == 4 and cancelled_waiting.frames == 0
    full = alone(model, prompts[0], do_sample=False, max_new_tokens=30)[0]
    assert torch.equal(cancelled_running.codes, full[:, :4])  # the frames made before the cancel
    assert engine.running == 0 and not engine.requests
    engine.cancel_request("no-such-request")  # ignored


def test_a_thread_streams_frames_and_callbacks_see_each_frame(model, prompts):
    frames, finished = [], threading.Event()
    with Drama3Engine(model, max_batch=2) as engine:
        streamed = engine.add_request(prompts[0], do_sample=False, max_new_tokens=9, streaming=True)
        called = engine.add_request(prompts[1], seed=1, max_new_tokens=9,
                                    on_frame=lambda request_id, codes: frames.append(codes),
                                    on_finish=lambda result: finished.set())
        *outputs, result = engine.request_id_iter(streamed)
        assert finished.wait(60)
    assert all(output.status == RequestStatus.DECODING and output.codes is None for output in outputs)
    assert [output.generated_tokens for output in outputs] == [result.generated_tokens[:n] for n in range(1, result.frames + 1)]
    assert torch.equal(torch.stack([output.frame for output in outputs], 1), result.codes)
    with pytest.raises(KeyError, match="no request"):
        engine.get_result(streamed)  # the stream handed it out
    assert torch.equal(torch.stack(frames, 1), alone(model, prompts[1], seed=1, max_new_tokens=9)[0])
    with pytest.raises(KeyError, match="no request"):
        engine.get_result(called)  # handed to on_finish, not kept


def test_a_failing_callback_fails_its_request_only(model, prompts):
    def boom(request_id, codes):
        raise RuntimeError("listener went away")

    engine = Drama3Engine(model, max_batch=2)
    bad = engine.add_request(prompts[0], do_sample=False, max_new_tokens=8, on_frame=boom)
    good = engine.add_request(prompts[1], do_sample=False, max_new_tokens=8)
    engine.run_until_idle()
    assert engine.get_result(bad).finish_reason == "failed"
    result = engine.get_result(good)
    assert torch.equal(result.codes, alone(model, prompts[1], do_sample=False, max_new_tokens=8)[0])


def test_bad_requests_are_refused_before_any_work(model, prompts):
    engine = Drama3Engine(model)
    with pytest.raises(ValueError, match="one prompt"):
        engine.add_request(torch.zeros(2, 5, 11, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request(prompts[0], temperature=-1.0)
    with pytest.raises(TypeError, match="num_beams"):
        engine.add_request(prompts[0], num_beams=2)
    with pytest.raises(ValueError, match="seed or generator"):
        engine.add_request(prompts[0], seed=1, generator=torch.Generator())
    engine.add_request(prompts[0], request_id="x", max_new_tokens=1)
    with pytest.raises(ValueError, match="already"):
        engine.add_request(prompts[0], request_id="x")
    with pytest.raises(ValueError, match="max_batch"):
        Drama3Engine(model, max_batch=0)
    assert engine.queued == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_engine_admits_mid_flight_and_gives_the_eager_frames(expected):
    """On CUDA, an engine with `fast_decode=True` replays captured steps over power-of-two rows: requests admitted
    mid-flight (the state grows to 2 and 4 rows; one long prompt moves the others to later slots), with mixed
    settings, give the frames eager `generate` gives each alone (run on a GPU machine: `-k cuda`)."""
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, device_map="cuda")
    model.set_experts_implementation("batched_mm")  # what a captured step runs: the same numbers both ways
    a, b = expected["prompt_a_rows"], expected["prompt_b_rows"]
    prompts = [a[:10], b[:6], torch.cat([b] * 3)[:40], a[:8]]
    settings = [dict(do_sample=False, max_new_tokens=24), dict(seed=1, max_new_tokens=20),
                dict(seed=2, temperature=0.7, top_k=20, max_new_tokens=16), dict(do_sample=False, max_new_tokens=12)]
    engine = Drama3Engine(model, max_batch=4, fast_decode=True)
    ids = []
    for rows, kwargs in zip(prompts, settings):
        ids.append(engine.add_request(rows.cuda(), **kwargs))
        for _ in range(3):
            engine.step()
    engine.run_until_idle()
    for rows, kwargs, request_id in zip(prompts, settings, ids):
        result = engine.get_result(request_id)
        eager = model.generate(rows[None].cuda(), output_audio=False, **kwargs)
        assert result.finish_reason == eager.finish_reason[0]
        assert torch.equal(result.codes, eager.codes[0].cpu())
    assert any(state.graphs for state in engine.runner.kept.states.values())  # kept, with their graphs


def test_the_engine_never_steps_from_a_reader_and_says_who_must(model, prompts):
    """Readers only wait: without the engine's thread, a result not ready is an error naming what to do, and a
    result waited for with a timeout comes back None (nobody stepped)."""
    engine = Drama3Engine(model, max_batch=2)
    request_id = engine.add_request(prompts[1], do_sample=False, max_new_tokens=3, streaming=True)
    with pytest.raises(RuntimeError, match="run_until_idle"):
        engine.get_result(request_id)
    with pytest.raises(RuntimeError, match="run_until_idle"):
        list(engine.request_id_iter(request_id))
    assert engine.get_result(request_id, timeout=0.05) is None and engine.queued == 1  # not stepped by the reader
    engine.run_until_idle()
    result = engine.get_result(request_id)
    *outputs, last = engine.request_id_iter(request_id)  # the stream keeps its own end
    assert torch.equal(torch.stack([output.frame for output in outputs], 1), result.codes)
    assert last.request_id == request_id and torch.equal(last.codes, result.codes)


def test_a_streaming_request_that_finished_before_its_reader_keeps_its_frames(model, prompts):
    """The lost streaming request: with the thread running, a one-frame request ends before anyone reads it; its
    stream and its result are still there, once each."""
    with Drama3Engine(model) as engine:
        request_id = engine.add_request(prompts[1], do_sample=False, max_new_tokens=1, streaming=True)
        result = engine.get_result(request_id, timeout=60)
        outputs = list(engine.request_id_iter(request_id))
    assert result.frames == 1 and torch.equal(outputs[0].frame[:, None], result.codes)
    with pytest.raises(ValueError, match="not a streaming request"):
        list(engine.request_id_iter(request_id))  # read once
    assert result.is_finished() and result.generated_tokens == [model.config.semantic_start_token_id +
                                                                int(result.codes[0, 0])]


def test_unread_results_are_kept_up_to_keep_results(model, prompts):
    engine = Drama3Engine(model, keep_results=2)
    ids = [engine.add_request(prompts[1], do_sample=False, max_new_tokens=1, streaming=True) for _ in range(3)]
    engine.run_until_idle()
    with pytest.raises(KeyError, match="keep_results"):
        engine.get_result(ids[0])  # the oldest unread one was dropped
    with pytest.raises(ValueError, match="keep_results"):
        list(engine.request_id_iter(ids[0]))
    assert [engine.get_result(i).frames for i in ids[1:]] == [1, 1]
    with pytest.raises(ValueError, match="keep_results"):
        Drama3Engine(model, keep_results=0)


def test_stop_means_stop_while_its_thread_is_still_finishing_a_frame(model, prompts):
    """stop(block=False) while the thread is inside a frame: until the thread has ended nobody else may step the
    engine, restart it or add to it; then the caller may step it again."""
    inside, release = threading.Event(), threading.Event()

    def slow(request_id, codes):
        inside.set()
        release.wait(30)

    engine = Drama3Engine(model).start()
    engine.add_request(prompts[1], do_sample=False, max_new_tokens=50, on_frame=slow)
    assert inside.wait(60)
    engine.stop(block=False)
    assert engine.is_running()
    with pytest.raises(RuntimeError, match="thread steps"):
        engine.step()
    with pytest.raises(RuntimeError, match="still stopping"):
        engine.start()
    with pytest.raises(RuntimeError, match="stopping"):
        engine.add_request(prompts[1])
    engine.stop(timeout=0.01)  # a join that times out changes nothing
    assert engine.is_running()
    release.set()
    engine.stop(hard_stop=True)  # what runs is cancelled (a plain stop would let it finish)
    assert not engine.is_running() and engine.get_result().finish_reason == "cancelled"
    request_id = engine.add_request(prompts[1], do_sample=False, max_new_tokens=2)
    engine.run_until_idle()
    assert engine.get_result(request_id).frames == 2


def test_the_engines_own_settings_are_refused_per_request(model, prompts):
    engine = Drama3Engine(model)
    for name, value in (("fast_decode", True), ("compile_step", True), ("stop_check_interval", 1),
                        ("output_scores", True)):
        with pytest.raises(ValueError, match=f"{name} is not a request's setting"):
            engine.add_request(prompts[1], **{name: value})
    with pytest.raises(ValueError, match="output_scores"):
        Drama3Engine(model, generation_config=GenerationConfig(**DRAMA3_GENERATION_DEFAULTS | {"output_scores": True}))
    assert engine.queued == 0


def test_generate_batch_is_transformers_api_with_drama3_results(model, prompts):
    """`model.generate_batch` (transformers' signature) gives, in input order, each prompt's frames alone with its
    seed, as transformers-shaped results with codes and their audio."""
    results = model.generate_batch(prompts[:2], max_new_tokens=5, seed=[4, 9], progress_bar=False)
    assert len(results) == 2
    for rows, seed, (request_id, result) in zip(prompts, [4, 9], results.items()):
        codes, reason = alone(model, rows, seed=seed, max_new_tokens=5)
        assert result.request_id == request_id and result.status == RequestStatus.FINISHED and result.error is None
        assert torch.equal(result.codes, codes) and result.finish_reason == reason
        assert result.prompt_ids == rows[:, 0].tolist() and len(result.generated_tokens) == codes.shape[1]
        assert torch.equal(result.audio, model.codec.decode(codes[None]).audio_values[0, 0])


def test_continuous_batching_context_manager_runs_a_started_engine_and_stops_it(model, prompts):
    # `auto_switch_to_flash=False` (a field from transformers 5.2x on) is what the engine does anyway: accepted.
    consistent = {"auto_switch_to_flash": False} if "auto_switch_to_flash" in {
        field.name for field in dataclasses.fields(ContinuousBatchingConfig)} else {}
    config = ContinuousBatchingConfig(max_requests_per_batch=2, **consistent)
    with model.continuous_batching_context_manager(continuous_batching_config=config) as engine:
        assert engine.is_running() and engine.max_batch == 2
        request_id = engine.add_request(prompts[1], seed=5, max_new_tokens=5, record_timestamps=True)
        result = engine.get_result(request_id)
    assert not engine.is_running()
    assert torch.equal(result.codes, alone(model, prompts[1], seed=5, max_new_tokens=5)[0])
    assert len(result.timestamps) == result.frames and result.lifespan[0] <= result.timestamps[0] <= result.lifespan[1]


def test_init_continuous_batching_takes_transformers_signature_and_refuses_what_cannot_apply(model):
    engine = model.init_continuous_batching(None, None, WorkloadHints(num_requests=3), keep_results=4)
    assert (engine.max_batch, engine.keep_results) == (3, 4)
    assert model.init_continuous_batching(max_batch=2).max_batch == 2
    with pytest.raises(ValueError, match="num_blocks"):
        model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(num_blocks=16))
    with pytest.raises(ValueError, match="disagree"):
        model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=2),
                                       max_batch=4)
    with pytest.raises(ValueError, match="one frame step"):
        model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=(True, False)))
    with pytest.raises(TypeError, match="page_size"):
        model.init_continuous_batching(page_size=16)


def test_each_engine_frame_is_read_back_once(model, prompts):
    """A frame of running requests, streamed and called back included, reads its outputs to the host once."""
    engine = Drama3Engine(model, max_batch=2)
    engine.add_request(prompts[0], do_sample=False, max_new_tokens=20, streaming=True)
    engine.add_request(prompts[1], seed=2, max_new_tokens=20, on_frame=lambda request_id, codes: None)
    engine.step()  # both admitted
    assert [device_reads(engine.step) for _ in range(3)] == [1, 1, 1]
