"""The engine as transformers' continuous-batching manager, name for name, and as `generate`'s own hooks say.

transformers' documented calls (its continuous-batching guide: `generate_batch`, `continuous_batching_context_manager`
with iteration, `init_continuous_batching` + `start` / `stop`, streaming with `request_id_iter`) run here unchanged,
with Drama 3 engine_prompts (frame rows) where transformers passes token ids. Settings merge once, the way `generate` merges
them, so `generate` and `generate_batch` give equal frames for equal settings and seeds. Codes are compared exactly
in float64 (test_engine.py's docstring gives the reason).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.continuous_batching import RequestStatus

from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.generation import Drama3Engine, generation_settings
from transformers_drama3.generation.rules import Drama3FrameLimit, Drama3FrameSampling, frame_criteria
from transformers_drama3.generation.runner import FrameRunner, KeptStates

from .conftest import GOLDEN_TINY


@pytest.fixture(scope="module")
def model(golden_float64_model):
    return golden_float64_model



@pytest.mark.parametrize("config", [GenerationConfig(), GenerationConfig(max_new_tokens=6, do_sample=False),
                                    GenerationConfig(max_new_tokens=5, temperature=0.8, top_k=20)],
                         ids=["empty", "greedy", "sampled"])
def test_generate_and_generate_batch_give_equal_frames_for_one_config_and_seeds(model, engine_prompts, config):
    """One merge of the settings: Drama 3's defaults < the model's generation config < the call's, whichever door.
    `GenerationConfig()` keeps Drama 3's defaults (its values equal to transformers' own are no choice)."""
    limit = {} if config.max_new_tokens is not None and config.max_new_tokens < 20 else {"max_new_tokens": 6}
    results = model.generate_batch(engine_prompts[:2], generation_config=config, seed=[3, 4], output_audio=False, **limit)
    for rows, seed, result in zip(engine_prompts, [3, 4], results.values()):
        alone = model.generate(rows[None], generation_config=config, seed=seed, output_audio=False, **limit)
        assert result.finish_reason == alone.finish_reason[0] and torch.equal(result.codes, alone.codes[0])


def test_transformers_documented_calls_run_unchanged(model, engine_prompts):
    """The calls of transformers' continuous-batching guide, as written there."""
    generation_config = GenerationConfig(max_new_tokens=6, eos_token_id=model.config.eos_token_id, do_sample=False)
    outputs = model.generate_batch(inputs=engine_prompts, generation_config=generation_config)
    assert len(outputs) == 3 and all(output.status == RequestStatus.FINISHED for output in outputs.values())

    with model.continuous_batching_context_manager(generation_config=generation_config) as manager:
        manager.add_request(input_ids=engine_prompts[2], request_id="long", max_new_tokens=8)
        manager.add_request(input_ids=engine_prompts[0], request_id="short_0", max_new_tokens=3)
        manager.add_request(input_ids=engine_prompts[1], request_id="short_1", max_new_tokens=3)
        finished = {result.request_id: result for result in manager}  # ends once every request has been read
    assert set(finished) == {"long", "short_0", "short_1"} and finished["short_0"].frames <= 3

    manager = model.init_continuous_batching(generation_config=generation_config)
    manager.start()
    manager.add_request(input_ids=engine_prompts[1], request_id="streamed", streaming=True)
    frames = []
    for chunk in manager.request_id_iter(request_id="streamed"):
        frames += [chunk.frame] if chunk.frame is not None else []  # Drama 3's frames, where text has tokens
        if chunk.status == RequestStatus.FINISHED:
            break
    ids = manager.add_requests(inputs=engine_prompts[:2])
    manager.cancel_request(request_id=ids[1])
    assert manager.get_result(request_id=ids[0]).request_id == ids[0]
    manager.stop()
    manager.destroy()
    assert torch.equal(torch.stack(frames, 1), chunk.codes) and chunk.frames == len(frames)
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()


def test_a_subclass_hook_decides_the_frame_limit_that_runs(model, engine_prompts):
    """The frame limit that runs is the one `_get_stopping_criteria` returned: a subclass that returns another
    limit changes the run."""

    class TwoFrames(FishOmniForSpeech):
        def _get_stopping_criteria(self, generation_config, stopping_criteria=None, **kwargs):
            context = self.config.text_config.max_position_embeddings
            return StoppingCriteriaList([c if not isinstance(c, Drama3FrameLimit) else Drama3FrameLimit(2, context)
                                         for c in super()._get_stopping_criteria(generation_config, stopping_criteria)])

    limited = TwoFrames.from_pretrained(GOLDEN_TINY, dtype=torch.float64)
    limited.set_experts_implementation("eager")
    out = limited.generate(engine_prompts[0][None], do_sample=False, max_new_tokens=10, output_audio=False)
    assert out.codes[0].shape[1] == 2 and out.finish_reason == ["length"]
    full = model.generate(engine_prompts[0][None], do_sample=False, max_new_tokens=10, output_audio=False)
    assert torch.equal(out.codes[0], full.codes[0][:, :2])


def test_stop_finishes_what_runs_and_hard_stop_cancels_it(model, engine_prompts):
    """transformers' stop: by default the requests queued and running finish; `hard_stop=True` cancels them."""
    engine = Drama3Engine(model, max_batch=1).start()
    first = engine.add_request(engine_prompts[0], do_sample=False, max_new_tokens=5)
    second = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=5)
    engine.stop()
    assert [engine.get_result(i).finish_reason in ("eos", "length") for i in (first, second)] == [True, True]
    engine.start()
    running = engine.add_request(engine_prompts[0], do_sample=False, max_new_tokens=400, streaming=True)
    next(engine.request_id_iter(running))
    engine.stop(hard_stop=True)
    assert engine.get_result(running).finish_reason == "cancelled"


def test_an_engine_kept_for_the_next_session_is_the_one_init_returns(model, engine_prompts):
    engine = model.init_continuous_batching(max_batch=2)
    with engine:
        engine.get_result(engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=2))
    engine.stop(keep_for_next_session=True)
    assert model.init_continuous_batching() is engine
    with model.continuous_batching_context_manager(persistent_manager=True) as again:
        assert again is engine
    model.destroy_cached_continuous_batching_manager()
    assert model.init_continuous_batching() is not engine


def test_result_handlers_are_called_on_the_callers_event_loop(model, engine_prompts):
    async def speak(engine):
        loop, seen, done = asyncio.get_running_loop(), [], asyncio.Event()

        def handler(output):
            assert asyncio.get_running_loop() is loop  # delivered on the caller's loop
            seen.append(output)
            if output.is_finished():
                done.set()

        request_id = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=4, streaming=True)
        engine.register_result_handler(request_id, handler)
        await asyncio.wait_for(done.wait(), 60)
        return request_id, seen

    with Drama3Engine(model) as engine:
        request_id, seen = asyncio.run(speak(engine))
        with pytest.raises(KeyError):
            engine.get_result(request_id)  # the handler got it
    assert seen[-1].is_finished() and all(not output.is_finished() for output in seen[:-1])
    assert torch.equal(torch.stack([output.frame for output in seen[:-1]], 1), seen[-1].codes)
    with pytest.raises(RuntimeError, match="coroutine"):
        Drama3Engine(model).register_result_handler("x", print)


def test_warmup_compiles_both_kinds_of_step_before_the_first_request(model, engine_prompts):
    """With a compiled step (dynamo's `eager` backend here: tracing without code generation), `warmup` runs a greedy
    and a sampled request alone, and the state it leaves serves the next request alone; an eager engine has nothing
    to warm up."""
    eager = Drama3Engine(model)
    eager.warmup()
    assert eager.runner.state is None and eager.runner.builds == 0
    torch._dynamo.reset()
    try:
        engine = Drama3Engine(model, compile_step="eager")
        engine.warmup()
        state = engine.runner.state
        assert state is not None and state.compiled and engine.runner.builds == 1
        request_id = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=3)
        engine.run_until_idle()
        assert engine.runner.builds == 1 and engine.get_result(request_id).frames == 3
    finally:
        torch._dynamo.reset()


def test_every_request_finishes_once_whatever_the_order_of_its_ends(model, engine_prompts):
    """Frames read back every 40 frames: a request whose EOS is not read yet when it is cancelled ends with its EOS
    (once: one `on_finish`, one end of its stream)."""
    finished = []
    engine = Drama3Engine(model, stop_check_interval=40)
    eos = model.generate(engine_prompts[1][None], do_sample=False, max_new_tokens=40, output_audio=False)
    assert eos.finish_reason == ["eos"]
    request_id = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=40, on_finish=finished.append)
    streamed = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=40, streaming=True)
    for _ in range(eos.codes[0].shape[1] + 1):
        engine.step()  # the frames, then the EOS step: nothing read back yet
    assert bool(engine.runner.state.ended.all()) and not finished and engine.running == 2
    engine.cancel_request(request_id)
    engine.cancel_request(streamed)
    engine.run_until_idle()
    assert [result.finish_reason for result in finished] == ["eos"]
    ends = [output for output in engine.request_id_iter(streamed) if output.is_finished()]
    assert [end.finish_reason for end in ends] == ["eos"]


def test_cancelling_one_request_of_a_batch_before_admission_leaves_the_others_exact(model, engine_prompts):
    rows = torch.stack([engine_prompts[0], engine_prompts[0][:10]])  # two engine_prompts of 10 rows
    engine = Drama3Engine(model)
    ids = engine.add_batch(rows, None, generation_settings(model.generation_config, do_sample=False, max_new_tokens=5))
    engine.cancel_request(ids[0])
    engine.run_until_idle()
    assert engine.get_result(ids[0]).finish_reason == "cancelled"
    result = engine.get_result(ids[1])
    alone = model.generate(engine_prompts[0][None], do_sample=False, max_new_tokens=5, output_audio=False)
    assert result.finish_reason == alone.finish_reason[0] and torch.equal(result.codes, alone.codes[0])


def test_callbacks_run_outside_the_engines_lock(model, engine_prompts):
    """An `on_finish` that calls the engine (a request cancelled while waiting) does not deadlock."""
    engine = Drama3Engine(model, max_batch=1)
    engine.add_request(engine_prompts[0], do_sample=False, max_new_tokens=2)
    answered = threading.Event()

    def again(result):
        engine.cancel_request("nothing")
        engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=1, request_id="after")
        answered.set()

    waiting = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=2, on_finish=again)
    engine.cancel_request(waiting)
    stepper = threading.Thread(target=engine.run_until_idle, daemon=True)
    stepper.start()
    stepper.join(60)
    assert not stepper.is_alive() and answered.is_set()
    assert engine.get_result("after").frames == 1


def test_stop_frees_the_kept_frame_states_unless_kept_for_the_next_session(model, engine_prompts):
    """An engine whose runner keeps states between requests (as one with CUDA graphs does) lets them go at `stop()`,
    and keeps them with `keep_for_next_session=True`."""
    for keep in (False, True):
        runner = FrameRunner(model, Drama3FrameSampling(), frame_criteria(model, model.generation_config),
                             kept=KeptStates(model))
        engine = Drama3Engine(model, runner=runner)
        request_id = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=2)
        engine.run_until_idle()
        assert engine.get_result(request_id).frames == 2
        engine.stop(keep_for_next_session=keep)
        assert bool(runner.kept.states) == keep and runner.state is None
    model.destroy_cached_continuous_batching_manager()
