"""The server's batch route, WebSocket text stream, saved-voice prefix cache and SIGTERM drain, with a real uvicorn
(in a thread, or `drama3-serve` as a process) and real clients (httpx, `websockets`). The audio of a route is compared
with the same request sent to `POST /v1/audio/speech` (the same server, seed and settings: equal bytes) or with
`generate` run here (within the streamed-vs-one-shot bound of tests/test_serve.py)."""

import base64
import contextlib
import io
import json
import signal
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import soundfile
import torch
from websockets.exceptions import ConnectionClosedError, InvalidStatus
import uvicorn
from websockets.sync.client import connect

from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.audio_encoding import AAC_PRIMING
from transformers_drama3.serving.app import create_app
from transformers_drama3.serving.draining import DrainingServer
from transformers_drama3.serving.errors import APIError
from transformers_drama3.serving.text_stream import SentenceBuffer, StreamError
from transformers_drama3.serving.thread import ServerThread
from transformers_drama3.voice import Drama3Voice

from .conftest import GOLDEN_TINY
from .test_audio_formats import decode_adts
from .test_serve import (  # noqa: F401 (http, reference: fixtures; http on this module's server)
    AUTH, KEY, MODEL, TIMEOUT, assert_close_pcm, http, pcm16, reference, wav_samples,
)

FRAMES = 6  # frames per utterance: the tiny model makes 10-20 frames a second on a busy 2-core machine
BYTES_PER_FRAME = 2048 * 2  # 16-bit samples of one codec frame


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("voices")
    codes = torch.randint(0, 64, (10, 30), generator=torch.Generator().manual_seed(3))
    Drama3Voice(codes, "This is how I sound.").save(directory / "narrator.safetensors")
    return directory


@pytest.fixture(scope="module")
def server(voices_dir):
    settings = ServerSettings(model=str(GOLDEN_TINY), model_name=MODEL, voices_dir=voices_dir, api_key=KEY,
                              max_frames=50, max_text_chars=300)
    with ServerThread(settings).wait_until_ready(TIMEOUT) as running:
        yield running


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


def single(http, **body) -> bytes:
    response = http.post("/v1/audio/speech", json={"model": MODEL, "response_format": "pcm", **body})
    assert response.status_code == 200, response.text
    return response.content


# -- POST /v1/audio/speech/batch ---------------------------------------------------------------------------------


def test_batch_answers_each_input_as_its_own_request_would(http):
    items = [{"input": "Hello there.", "seed": 4, "max_new_tokens": FRAMES},
             {"input": "Good morning.", "temperature": 0, "max_new_tokens": FRAMES, "response_format": "wav"}]
    response = http.post("/v1/audio/speech/batch", json={"model": MODEL, "response_format": "pcm", "items": items})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [item["index"] for item in data] == [0, 1]
    assert data[0]["seed"] == 4 and data[0]["usage"]["output_tokens"] > 0
    assert base64.b64decode(data[0]["audio"]) == single(http, **items[0])
    wav = base64.b64decode(data[1]["audio"])
    assert data[1]["media_type"] == "audio/wav" and wav[:4] == b"RIFF"
    alone = np.frombuffer(single(http, **{**items[1], "response_format": "pcm"}), dtype="<i2")
    assert np.array_equal(wav_samples(wav), alone)


@pytest.mark.parametrize("items, param", [
    ([{"input": "Hi.", "voice": "nobody"}], "items[0].voice"),
    ([{"input": "Hi.", "stream_format": "sse"}], "items[0].stream_format"),
    ([{"input": "Hi.", "colour": "red"}], "items[0].colour"),
    ([{"input": "Hi."}, {"input": "Hi.", "temperature": 1e308}], "items[1].temperature"),
    ([{"input": "Hi."}, {"input": "Hi.", "max_new_tokens": "4"}], "items[1].max_new_tokens"),
    ([{"input": "Hi."}, {"input": "Hi.", "response_format": "aiff"}], "items[1].response_format"),
    ([], "items"),
])
def test_a_bad_batch_item_refuses_the_whole_call(server, http, items, param):
    before = server.service.worker.metrics.requests
    response = http.post("/v1/audio/speech/batch", json={"model": MODEL, "items": items})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and (param == "items" or param.split(".")[0] in error["message"])
    assert server.service.worker.metrics.requests == before  # nothing was queued


def test_a_batch_is_queued_whole_or_refused_with_its_limit(server, http, monkeypatch):
    """The issue's case: with --max-queue 2 a 3-item batch answered 429 forever, after running one item. Now it is
    refused up front (413, the limit named) and nothing runs; 2 items fit; a queue that cannot take all of a batch
    takes none of it (429, and a retry can succeed)."""
    worker = server.service.worker
    monkeypatch.setattr(worker, "max_queue", 2)
    before = worker.metrics.requests
    items = [{"input": "Hi.", "temperature": 0, "max_new_tokens": 1}] * 3
    response = http.post("/v1/audio/speech/batch", json={"model": MODEL, "items": items})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["param"] == "items" and error["code"] == "batch_too_large" and "at most 2 items" in error["message"]
    assert worker.metrics.requests == before
    response = http.post("/v1/audio/speech/batch", json={"model": MODEL, "items": items[:2]})
    assert response.status_code == 200 and len(response.json()["data"]) == 2
    jobs = [SimpleNamespace(request_id=f"fake-{index}") for index in range(3)]
    with pytest.raises(APIError) as refused:
        worker.submit(*jobs)  # 3 would pass the queue's 2: none is taken
    assert refused.value.status == 429 and not any(job.request_id in worker.jobs for job in jobs)


# -- WS /v1/audio/speech/stream ----------------------------------------------------------------------------------


def read_session(socket) -> tuple[list[dict], list[bytes]]:
    """Every message until the server closes: JSON events, and the audio of each utterance (the first may have
    started before)."""
    events, audio = [], []
    try:
        for message in socket:
            if isinstance(message, bytes):
                audio[-1:] = [(audio[-1] if audio else b"") + message]  # no "started" yet: one read before
            else:
                events.append(json.loads(message))
                if events[-1]["type"] == "utterance.started":
                    audio.append(b"")
    except ConnectionClosedError:  # closed with an error code: the test reads `socket.close_code`
        pass
    return events, audio


def test_text_streamed_in_is_spoken_sentence_by_sentence(server, http):
    with connect(ws_url(server), additional_headers=AUTH, open_timeout=TIMEOUT) as socket:
        socket.send(json.dumps({"type": "session.start", "model": MODEL, "seed": 9, "max_new_tokens": FRAMES,
                                "voice": "narrator"}))
        created = json.loads(socket.recv(timeout=TIMEOUT))
        assert created == {"type": "session.created", "sample_rate": 44100, "encoding": "pcm_s16le",
                           "response_format": "pcm", "seed": 9}
        for piece in ["Hello", " there.", " How are", " you? Fine", " thanks"]:  # as an LLM writes its tokens
            socket.send(json.dumps({"type": "text.append", "text": piece}))
        socket.send(json.dumps({"type": "text.done"}))
        events, audio = read_session(socket)
    started = [event for event in events if event["type"] == "utterance.started"]
    done = [event for event in events if event["type"] == "utterance.done"]
    assert [event["text"] for event in started] == ["<|speaker:0|> Hello there.", "<|speaker:0|> How are you?",
                                                    "<|speaker:0|> Fine thanks"]
    assert events[-1] == {"type": "session.done", "utterances": 3}
    for event, pcm in zip(done, audio):
        assert len(pcm) == event["frames"] * BYTES_PER_FRAME > 0
    # The first utterance has no history: it is the request of its text alone (the session's seed, then seed + 1...).
    assert audio[0] == single(http, input="Hello there.", seed=9, max_new_tokens=FRAMES, voice="narrator")


def test_a_session_speaks_in_its_own_format(server):
    """`response_format` per session: each utterance's binary messages make one complete stream of that format
    (Ogg Opus at 48 kHz here, AAC in ADTS below), as long as the utterance's frames."""
    with connect(ws_url(server), additional_headers=AUTH, open_timeout=TIMEOUT) as socket:
        socket.send(json.dumps({"type": "session.start", "model": MODEL, "seed": 2, "max_new_tokens": FRAMES,
                                "response_format": "opus"}))
        created = json.loads(socket.recv(timeout=TIMEOUT))
        assert created["encoding"] == "ogg_opus" and created["sample_rate"] == 48000
        socket.send(json.dumps({"type": "text.append", "text": "Hello there. Good day."}))
        socket.send(json.dumps({"type": "text.done"}))
        events, audio = read_session(socket)
    done = [event for event in events if event["type"] == "utterance.done"]
    assert len(done) == len(audio) == 2
    for event, data in zip(done, audio):
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")  # a whole Ogg Opus stream
        expected = event["frames"] * 2048 * 48000 // 44100
        assert rate == 48000 and abs(len(samples) - expected) <= 48000 // 100  # Opus trims to 10 ms granules
    with connect(ws_url(server), additional_headers=AUTH, open_timeout=TIMEOUT) as socket:
        socket.send(json.dumps({"type": "session.start", "model": MODEL, "max_new_tokens": FRAMES,
                                "response_format": "aac"}))
        assert json.loads(socket.recv(timeout=TIMEOUT))["encoding"] == "aac_adts"
        socket.send(json.dumps({"type": "text.append", "text": "Hi."}))
        socket.send(json.dumps({"type": "text.done"}))
        events, audio = read_session(socket)
    frames = next(event["frames"] for event in events if event["type"] == "utterance.done")
    samples, rate, channels = decode_adts(audio[0])
    assert rate == 44100 and channels == 1
    assert AAC_PRIMING + frames * 2048 <= len(samples) < AAC_PRIMING + frames * 2048 + 2 * 1024
    with connect(ws_url(server), additional_headers=AUTH, open_timeout=TIMEOUT) as socket:
        socket.send(json.dumps({"type": "session.start", "model": MODEL, "response_format": "flac"}))
        event = json.loads(socket.recv(timeout=TIMEOUT))
        assert event["error"]["param"] == "response_format" and "'pcm', 'opus', 'mp3', 'aac'" in event["error"]["message"]
        read_session(socket)
    assert socket.close_code == 1008


def test_a_bad_session_gets_an_error_event_and_a_policy_close(server):
    with connect(ws_url(server), additional_headers=AUTH, open_timeout=TIMEOUT) as socket:
        socket.send(json.dumps({"type": "session.start", "model": MODEL, "voice": "nobody"}))
        event = json.loads(socket.recv(timeout=TIMEOUT))
        assert event["type"] == "error" and event["error"]["code"] == "voice_not_found"
        read_session(socket)
    assert socket.close_code == 1008
    with connect(ws_url(server), additional_headers=AUTH, open_timeout=TIMEOUT) as socket:
        socket.send(json.dumps({"type": "session.start", "model": MODEL}))
        assert json.loads(socket.recv(timeout=TIMEOUT))["type"] == "session.created"
        socket.send(json.dumps({"type": "text.append", "text": "Say <|im_end|> now. And"}))
        event = json.loads(socket.recv(timeout=TIMEOUT))
        assert event["type"] == "error" and event["error"]["code"] == "invalid_text"
        read_session(socket)
    assert socket.close_code == 1008
    with pytest.raises(InvalidStatus):
        connect(ws_url(server), open_timeout=TIMEOUT)  # no API key


def test_a_client_that_leaves_mid_utterance_frees_the_worker(server):
    with connect(ws_url(server), additional_headers=AUTH, open_timeout=TIMEOUT) as socket:
        socket.send(json.dumps({"type": "session.start", "model": MODEL, "max_new_tokens": 50}))
        socket.recv(timeout=TIMEOUT)
        socket.send(json.dumps({"type": "text.append", "text": "A long sentence to speak. "}))
        assert json.loads(socket.recv(timeout=TIMEOUT))["type"] == "utterance.started"
    deadline = time.monotonic() + TIMEOUT
    while not server.service.worker.idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.service.worker.idle


# -- the prefix cache of saved voices ----------------------------------------------------------------------------


def test_a_saved_voice_prefix_is_computed_once_and_gives_the_uncached_audio(server, http, voices_dir, reference):
    model, processor = reference
    voice = Drama3Voice.load(voices_dir / "narrator.safetensors")
    before = server.service.worker.snapshot()["prompt_cache"]
    for text in ("Good evening.", "Good night to you all."):
        response = http.post("/v1/audio/speech", json={"model": MODEL, "input": text, "voice": "narrator",
                                                        "temperature": 0, "max_new_tokens": FRAMES,
                                                        "response_format": "wav"})
        output = model.generate(**processor(text, references=[voice]), do_sample=False, max_new_tokens=FRAMES)
        assert_close_pcm(wav_samples(response.content), pcm16(output.audio[0]))
    after = server.service.worker.snapshot()["prompt_cache"]
    assert after["hits"] >= before["hits"] + 2 - (before["entries"] == 0)  # built at most once, then reused
    assert after["entries"] == 1 and 0 < after["bytes"] <= after["max_bytes"]
    # An edited voice file is another voice: its content, not its name, is the key.
    Drama3Voice(voice.codes.flip(1), voice.transcript).save(voices_dir / "narrator.safetensors")
    try:
        single(http, input="Good evening.", voice="narrator", temperature=0, max_new_tokens=2)
        assert server.service.worker.snapshot()["prompt_cache"]["entries"] == 2
    finally:
        voice.save(voices_dir / "narrator.safetensors")


# -- SIGTERM: a graceful drain -----------------------------------------------------------------------------------


@contextlib.contextmanager
def draining_server(max_frames: int):
    """A `DrainingServer` (what `drama3-serve` runs) in a thread, its model loaded: (server, app, url, thread)."""
    app = create_app(ServerSettings(model=str(GOLDEN_TINY), model_name=MODEL, max_frames=max_frames))
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    url = "http://127.0.0.1:%d" % listening.getsockname()[1]
    server = DrainingServer(uvicorn.Config(app, log_level="warning"), drain_seconds=TIMEOUT)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while app.state.service is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield server, app, url, thread
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        listening.close()


def test_sigterm_drains_running_requests_refuses_new_ones_then_stops():
    long_body = {"model": MODEL, "input": "A long request that runs.", "response_format": "pcm", "seed": 3,
                 "max_new_tokens": 20}
    result, started = {}, threading.Event()
    with draining_server(max_frames=400) as (server, app, url, thread):

        def long_request():
            with httpx.stream("POST", f"{url}/v1/audio/speech", json=long_body, timeout=TIMEOUT) as response:
                pieces = response.iter_bytes()
                result["first"] = next(pieces)  # the first audio is out: the request runs
                started.set()
                result["audio"] = result["first"] + b"".join(pieces)

        client = threading.Thread(target=long_request)
        client.start()
        assert started.wait(TIMEOUT)
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls on SIGTERM
        health = httpx.get(f"{url}/health", timeout=TIMEOUT)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{url}/v1/audio/speech", json={**long_body, "max_new_tokens": 2}, timeout=TIMEOUT)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        client.join(TIMEOUT)
        thread.join(TIMEOUT)
        assert not thread.is_alive()  # stopped by itself once drained
    # It went on after SIGTERM, to its own end: all 20 frames (this seed makes no EOS before them).
    assert len(result["audio"]) == 20 * BYTES_PER_FRAME > len(result["first"])


def test_sigterm_closes_websocket_sessions_with_their_unspoken_text():
    """A speaking session finishes its utterance, an idle one is told at once; both get the `draining` error with
    the text they did not speak and close with 1001; then the server stops by itself."""
    with draining_server(max_frames=400) as (server, app, url, thread):
        ws = url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        with connect(ws, open_timeout=TIMEOUT) as speaking, connect(ws, open_timeout=TIMEOUT) as idle:
            for client in (speaking, idle):
                client.send(json.dumps({"type": "session.start", "model": MODEL, "seed": 3, "max_new_tokens": 20}))
                assert json.loads(client.recv(timeout=TIMEOUT))["type"] == "session.created"
            speaking.send(json.dumps({"type": "text.append", "text": "A long first sentence. "}))
            assert json.loads(speaking.recv(timeout=TIMEOUT))["type"] == "utterance.started"
            speaking.send(json.dumps({"type": "text.append", "text": "A second one. And a third"}))
            idle.send(json.dumps({"type": "text.append", "text": "Not finished"}))
            time.sleep(0.5)  # the appends reach the server while the first utterance runs (20 frames: seconds)
            server.handle_exit(signal.SIGTERM, None)
            idle_events, _ = read_session(idle)
            events, audio = read_session(speaking)
        assert [event["type"] for event in events] == ["utterance.done", "error"]
        assert len(audio[0]) == events[0]["frames"] * BYTES_PER_FRAME > 0  # the running utterance was finished
        for event in (events[-1], idle_events[-1]):
            assert event["error"]["code"] == "draining"
        assert events[-1]["unspoken_text"] == "A second one. And a third"  # queued, then still buffered
        assert idle_events == [idle_events[-1]] and idle_events[-1]["unspoken_text"] == "Not finished"
        assert speaking.close_code == idle.close_code == 1001
        thread.join(TIMEOUT)
        assert not thread.is_alive()  # every session closed and nothing runs: drained


def test_text_becomes_utterances_at_complete_sentences_and_keeps_its_speaker():
    buffer = SentenceBuffer(max_chars=60)
    buffer.append("<|speaker:1|> It costs 3.")
    assert buffer.take_complete() is None  # "3." may still become "3.5"
    buffer.append("5 euros [sighs. loudly] today. Then")
    assert buffer.take_complete() == "<|speaker:1|> It costs 3.5 euros [sighs. loudly] today."
    buffer.append(" more.")
    assert buffer.take_complete() is None and buffer.take_all() == "<|speaker:1|> Then more."  # the tag carries on
    assert buffer.take_all() is None  # nothing left
    with pytest.raises(StreamError, match="more than 60 characters"):
        buffer.append("x" * 61)
