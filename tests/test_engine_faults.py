"""Faults inside the engine: whatever raises (an admission, a prefill, a step, the read-back of its outputs, a release,
a state built to grow or shrink, the move of sequences into it, the codec decoding a streamed frame), every waiter is
answered within a bound, every request ends exactly once, the requests not involved go on, and the engine (and the
server) keeps serving.

The faults are injected by replacing each stage with one that raises on chosen calls (`Faults`): `torch.OutOfMemoryError`
where memory is what runs out in practice (a state build), a `RuntimeError` elsewhere. Eight client threads stream,
call back, read late and cancel, as `test_engine_threads.py` does without faults. No wall-clock speed is asserted:
`BOUND` only turns a hang into a failure.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import httpx
import pytest
import torch
from transformers.generation.continuous_batching import RequestStatus

from transformers_drama3 import Drama3AudioStreamer
from transformers_drama3.generation import engine as engine_module
from transformers_drama3.generation.engine import Drama3Engine
from transformers_drama3.generation.runner import FrameRunner
from transformers_drama3.generation.state import FrameState
from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.thread import ServerThread
from transformers_drama3.testing import write_tiny_checkpoint

BOUND = 60  # seconds any waiter may wait before the test calls it a hang
THREADS, REQUESTS_PER_THREAD, MOST_FRAMES = 8, 6, 4
INJECTED = "injected fault"
# stage -> (owner, attribute, error raised there)
STAGES = {
    "admission": (FrameRunner, "admit", RuntimeError),
    "prefill": (engine_module, "prefill", RuntimeError),
    "step": (FrameRunner, "step", RuntimeError),
    "read": (FrameRunner, "outputs", RuntimeError),
    "release": (FrameRunner, "release", RuntimeError),
    "state build": (FrameState, "__init__", torch.OutOfMemoryError),  # growing and shrinking both build one
    "move": (FrameState, "take", torch.OutOfMemoryError),
    "decode": (Drama3AudioStreamer, "_decode", RuntimeError),
}


class Faults:
    """Raise in chosen stages: on the `first`-th call of each, then on a random `rate` of the calls after it."""

    def __init__(self, monkeypatch, stages, seed: int = 0, rate: float = 0.1, first: int = 2):
        self.draw, self.rate, self.first = random.Random(seed), rate, first
        self.calls, self.raised = Counter(), Counter()
        self.lock = threading.Lock()
        self.on = True
        for stage in stages:
            owner, name, error = STAGES[stage]
            monkeypatch.setattr(owner, name, self.faulty(stage, getattr(owner, name), error))

    def faulty(self, stage: str, original, error: type):
        def stand_in(*args, **kwargs):
            with self.lock:
                self.calls[stage] += 1
                fire = self.on and (self.calls[stage] == self.first or self.draw.random() < self.rate)
                self.raised[stage] += fire
            if fire:
                raise error(f"{INJECTED} in {stage}")
            return original(*args, **kwargs)

        return stand_in


@pytest.fixture(scope="module")
def model(plain_tiny_model):
    return plain_tiny_model



def test_every_waiter_is_answered_once_whatever_fails(model, engine_prompts, monkeypatch):
    """Faults in every stage at once, eight clients: each request ends exactly once (one result, one `on_finish`,
    one end of its stream), within `BOUND`, as done or failed with the injected error; then the engine serves a
    request without faults and stops within its timeout."""
    faults = Faults(monkeypatch, STAGES)
    records, errors = [], []

    def client(index: int) -> None:
        draw = random.Random(index)
        try:
            for _ in range(REQUESTS_PER_THREAD):
                kind = draw.choice(("stream", "callback", "plain", "late", "cancel"))
                record = {"kind": kind, "finished": [], "frames": []}
                audio = Drama3AudioStreamer(model.codec, on_audio=lambda sequence, chunk: None)
                request_id = engine.add_request(
                    engine_prompts[draw.randrange(len(engine_prompts))], max_new_tokens=draw.randint(1, MOST_FRAMES),
                    seed=draw.randrange(100), streaming=kind == "stream",
                    on_frame=(lambda _, codes, r=record, a=audio: (r["frames"].append(codes), a.put(codes[None])))
                    if kind == "callback" else None,
                    on_finish=(lambda result, r=record: r["finished"].append(result)) if kind == "callback" else None)
                record["id"] = request_id
                if kind == "stream":
                    record["stream"] = engine.streams[request_id]
                    try:
                        for output in engine.request_id_iter(request_id):
                            record["frames"].append(output.frame) if not output.is_finished() else None
                            record["finished"].append(output) if output.is_finished() else None
                    except Exception as error:  # noqa: BLE001  (a failed request raises its error here)
                        record["raised"] = error
                elif kind == "callback":
                    deadline = time.monotonic() + BOUND
                    while not record["finished"] and time.monotonic() < deadline:
                        time.sleep(0.01)
                else:
                    if kind == "late":
                        time.sleep(draw.uniform(0, 0.05))
                    if kind == "cancel":
                        time.sleep(draw.uniform(0, 0.02))
                        engine.cancel_request(request_id)
                    record["finished"].append(engine.get_result(request_id, timeout=BOUND))
                records.append(record)
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    engine = Drama3Engine(model, max_batch=4)
    engine.start()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND * REQUESTS_PER_THREAD)
    assert not any(thread.is_alive() for thread in threads), "a waiter was never answered"
    assert not errors, errors
    assert len(records) == THREADS * REQUESTS_PER_THREAD
    assert all(faults.raised[stage] > 0 for stage in STAGES), (faults.calls, faults.raised)
    outcomes = Counter()
    for record in records:
        ended = record["finished"] + ([record["raised"]] if "raised" in record else [])
        assert len(ended) == 1 and ended[0] is not None, record  # one end, and nothing left unanswered
        if "raised" in record:  # a failed stream raises its error
            assert INJECTED in str(record["raised"]), record
            outcomes["failed"] += 1
            continue
        result = ended[0]
        assert result.is_finished() and result.request_id == record["id"]
        outcomes[result.finish_reason] += 1
        if result.finish_reason == "failed":
            assert result.status == RequestStatus.FAILED and INJECTED in result.error, result.error
        else:
            assert result.error is None and result.finish_reason in ("eos", "length", "cancelled")
            assert result.finish_reason != "cancelled" or record["kind"] == "cancel"
        if record["kind"] in ("stream", "callback") and result.finish_reason != "failed":
            frames = torch.stack(record["frames"], 1) if record["frames"] else result.codes[:, :0]
            assert torch.equal(frames, result.codes)  # each frame once, none lost
        if record["kind"] == "callback":
            with pytest.raises(KeyError):
                engine.get_result(record["id"])  # handed to on_finish only
    assert outcomes["failed"] > 0 and outcomes["failed"] < len(records), outcomes  # faults hit some, not all
    faults.on = False
    healthy = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=3)
    assert engine.get_result(healthy, timeout=BOUND).finish_reason in ("eos", "length")
    started = time.monotonic()
    engine.stop(timeout=BOUND)
    assert not engine.is_running() and time.monotonic() - started < BOUND
    assert not engine.requests and engine.running == 0
    for record in records:  # no late second end
        assert len(record["finished"]) + ("raised" in record) == 1
        assert "stream" not in record or record["stream"].empty()


def test_a_failed_shrink_keeps_the_larger_state_and_every_request_goes_on(model, engine_prompts, monkeypatch):
    """A request reaches its limit and its slot is released; the smaller state cannot be built (out of memory): the
    state keeps its slots, the finished request has its result and the others their frames alone."""
    alone = model.generate(engine_prompts[1][None], do_sample=False, max_new_tokens=6, output_audio=False)
    engine = Drama3Engine(model, max_batch=4)
    short = [engine.add_request(engine_prompts[0], do_sample=False, max_new_tokens=1) for _ in range(3)]
    long = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=6)
    # Admitting the four builds states of 1, 2 and 4 slots; the fourth build would be the smaller one.
    faults = Faults(monkeypatch, ["state build"], first=4, rate=0.0)
    engine.step()  # all four admitted and a frame made: three end, one of 4 slots left in use
    assert faults.raised["state build"] == 1 and engine.runner.state.batch == 4 and engine.running == 1
    engine.run_until_idle()
    assert [engine.get_result(request_id).finish_reason for request_id in short] == ["length"] * 3
    result = engine.get_result(long)
    assert result.finish_reason == alone.finish_reason[0] and torch.equal(result.codes, alone.codes[0])


def test_cancels_whose_release_fails_answer_every_reader_and_the_engine_goes_on(model, engine_prompts, monkeypatch):
    """Three streaming requests cancelled at once, and the release of their slots raises: they end as cancelled, the
    request still running fails with the error (its state is dropped), every reader's stream ends once, and the next
    request runs."""
    engine = Drama3Engine(model, max_batch=4).start()
    try:
        streams = [engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=400, streaming=True)
                   for _ in range(3)]
        other = engine.add_request(engine_prompts[0], do_sample=False, max_new_tokens=400)
        first = [next(engine.request_id_iter(request_id)) for request_id in streams]  # all three are running
        assert all(output.frame is not None for output in first)
        Faults(monkeypatch, ["release"], first=1, rate=0.0)
        for request_id in streams:
            engine.cancel_request(request_id)
        ends = []
        for request_id in streams:
            *_, last = engine.request_id_iter(request_id)
            ends.append(last.finish_reason)
        assert ends == ["cancelled"] * 3
        failed = engine.get_result(other, timeout=BOUND)
        assert failed.finish_reason == "failed" and INJECTED in failed.error
        again = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=2)
        assert engine.get_result(again, timeout=BOUND).finish_reason in ("eos", "length")
    finally:
        engine.stop(hard_stop=True, timeout=BOUND)
    assert not engine.is_running()


def test_out_of_memory_while_growing_beside_running_requests_waits_for_room(model, engine_prompts, monkeypatch):
    """The state cannot grow for a newcomer while another request runs: the newcomer waits (nothing fails) and is
    admitted once the running request ends, with the frames it makes alone. Alone, it fails."""
    alone = model.generate(engine_prompts[0][None], do_sample=False, max_new_tokens=3, output_audio=False)
    engine = Drama3Engine(model, max_batch=4)
    running = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=4)
    engine.step()  # a state of one slot
    faults = Faults(monkeypatch, ["state build"], first=1, rate=0.0)  # the next build (for two slots) fails once
    newcomer = engine.add_request(engine_prompts[0], do_sample=False, max_new_tokens=3)
    engine.step()
    assert engine.queued == 1 and engine.running == 1  # held back, not failed
    engine.run_until_idle()
    assert faults.raised["state build"] == 1
    assert engine.get_result(running).finish_reason in ("eos", "length")
    result = engine.get_result(newcomer)
    assert result.finish_reason == alone.finish_reason[0] and torch.equal(result.codes, alone.codes[0])
    lonely = Drama3Engine(model, max_batch=4)
    Faults(monkeypatch, ["state build"], first=1, rate=0.0)
    request_id = lonely.add_request(engine_prompts[0], do_sample=False, max_new_tokens=3)
    lonely.run_until_idle()
    failed = lonely.get_result(request_id)
    assert failed.finish_reason == "failed" and isinstance(failed.exception, torch.OutOfMemoryError)


def test_an_engine_that_breaks_answers_everyone_and_refuses_new_requests(model, engine_prompts, monkeypatch):
    """Something the engine cannot recover from (here a BaseException out of its bookkeeping) ends its thread: every
    request, waiting or running, fails with it, readers are answered, new requests are refused naming it, and stop
    returns."""
    engine = Drama3Engine(model, max_batch=1).start()
    running = engine.add_request(engine_prompts[1], do_sample=False, max_new_tokens=400, streaming=True)
    next(engine.request_id_iter(running))
    waiting = engine.add_request(engine_prompts[0], do_sample=False, max_new_tokens=3)

    class Broken(BaseException):
        pass

    def broken(self):
        raise Broken("the bookkeeping broke")

    monkeypatch.setattr(Drama3Engine, "_frame", broken)
    with pytest.raises(Broken):
        list(engine.request_id_iter(running))
    assert engine.get_result(waiting, timeout=BOUND).finish_reason == "failed"
    with pytest.raises(RuntimeError, match="the engine failed and takes no more requests.*bookkeeping broke"):
        engine.add_request(engine_prompts[0])
    engine.stop(timeout=BOUND)
    assert not engine.is_running()


@pytest.fixture
def server(tmp_path):
    settings = ServerSettings(model=str(write_tiny_checkpoint(tmp_path / "tiny", quantization_config=None)),
                              model_name="tiny", max_batch=4, max_frames=8)
    with ServerThread(settings).wait_until_ready(BOUND) as running:
        yield running


def test_the_server_answers_every_request_under_faults_and_stays_healthy(server, monkeypatch):
    """Faults in every stage while eight clients speak (plain, pcm stream, SSE): each gets 200 with its audio, a 5xx
    JSON error, or a stream that ends with an error event or is cut; `/health` stays 200 and a request after the
    faults gets its audio."""
    faults = Faults(monkeypatch, STAGES, seed=1, rate=0.15)
    answers, errors = [], []

    def client(index: int) -> None:
        kind = ("wav", "pcm", "sse")[index % 3]
        body = {"model": "tiny", "input": f"Hello number {index}.", "max_new_tokens": 4, "seed": index,
                "response_format": "wav" if kind == "wav" else "pcm"}
        if kind == "sse":
            body["stream_format"] = "sse"
        try:
            with httpx.Client(base_url=server.url, timeout=BOUND) as http:
                for _ in range(3):
                    try:
                        with http.stream("POST", "/v1/audio/speech", json=body) as response:
                            data = response.read()
                        answers.append((kind, response.status_code, response.headers.get("content-type"), data))
                    except httpx.RemoteProtocolError:  # a raw stream cut after its audio started
                        answers.append((kind, "cut", None, b""))
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND * 3)
    assert not any(thread.is_alive() for thread in threads), "a request was never answered"
    assert not errors, errors
    assert len(answers) == THREADS * 3 and sum(faults.raised.values()) > 0
    for kind, status, content_type, data in answers:
        if status == "cut":
            assert kind == "pcm"
        elif status >= 500:
            assert content_type == "application/json" and b'"error"' in data
        else:
            assert status == 200 and data
            if kind == "sse":
                assert data.rstrip().endswith(b"}") and (b'"speech.audio.done"' in data or b'"type": "error"' in data)
    faults.on = False
    with httpx.Client(base_url=server.url, timeout=BOUND) as http:
        assert http.get("/health").status_code == 200
        after = http.post("/v1/audio/speech", json={"model": "tiny", "input": "After the faults.", "max_new_tokens": 3,
                                                     "response_format": "wav"})
        assert after.status_code == 200 and after.content[:4] == b"RIFF"
