"""Random JSON at every route of `drama3-serve` (hypothesis), on a real server with the golden tiny checkpoint: the
answer is a success or a 4xx in the OpenAI error shape, a 400 always naming the field (`param`); never a 5xx, an
error logged as unexpected, or a WebSocket closed with 1011. Requests that pass every check are generated, so the
server makes at most 2 frames per text chunk (`max_frames`) to keep the run within seconds."""

from __future__ import annotations

import json
import logging
import math
import string
from urllib.parse import quote

import httpx
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.schemas import ReferenceAudio, SpeechRequest
from transformers_drama3.serving.thread import ServerThread
from transformers_drama3.voice import Drama3Voice

from .conftest import GOLDEN_TINY

MODEL = "drama3-tiny"
TIMEOUT = 60
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from([2**63, 2**64, 10**20, -1, 0, 1, 2, 3]),
    st.floats(), st.sampled_from([1e308, -1e308, 1e-50, 3.5e38, math.inf, 0.0, 0.5, 1.0]),
    st.text(max_size=8), st.sampled_from(["7", "yes", "true", "", "default", "mp3", "aac", "pcm", "sse", "narrator",
                                          "\ud800", "a\x00b"]),  # a lone surrogate (JSON can carry one), a NUL
)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)
TEXT = st.one_of(st.sampled_from(["Hi.", "Hello there.", "<|speaker:1|> Hi.", "Say <|im_end|>.", "   ", "",
                                  "Hi \ud800.", "\x00"]),
                 st.text(max_size=12))
# Values a field takes when it is right, so that many requests get past the checks and are generated.
VALID = {
    "voice": st.sampled_from(["default", "narrator", "alloy", {"id": "narrator"}]),
    "speaker": st.sampled_from(["default", "narrator"]),
    "response_format": st.sampled_from(["pcm", "wav", "mp3", "aac", "opus", "flac"]),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**64 - 1), "max_new_tokens": st.integers(1, 2), "stream": st.booleans(),
    "stream_format": st.sampled_from(["audio", "sse"]), "speed": st.just(1.0), "repetition_penalty": st.just(1.0),
    "language": st.text(max_size=4), "instructions": st.just(""),
}
FIELDS = sorted({*SpeechRequest.model_fields, "speaker"} - {"input", "model", "references"})
REFERENCE_FIELDS = sorted({*ReferenceAudio.model_fields, "data", "text"})


def speech_fields(with_model: bool = True):
    """A speech request's fields: `input` and `model` mostly right, up to 2 other fields, each a right value or any
    JSON value."""
    values = st.fixed_dictionaries({}, optional={name: VALID.get(name, JSON) | JSON for name in FIELDS})
    references = st.lists(st.fixed_dictionaries({}, optional={name: JSON for name in REFERENCE_FIELDS}), max_size=1)
    base = st.fixed_dictionaries({"input": TEXT}, optional={"references": references})
    model = st.one_of(st.just(MODEL), st.just(MODEL), st.sampled_from(["tts-1", "whisper-1"]), JSON)
    head = st.fixed_dictionaries({"model": model})
    return st.builds(lambda a, b, c: {**a, **b, **c}, head if with_model else st.just({}), base,
                     values.map(lambda d: dict(list(d.items())[:2])))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    voices = tmp_path_factory.mktemp("voices")
    codes = torch.randint(0, 64, (10, 8), generator=torch.Generator().manual_seed(0))
    Drama3Voice(codes, "This is how I sound.").save(voices / "narrator.safetensors")
    options = ServerSettings(model=str(GOLDEN_TINY), model_name=MODEL, voices_dir=voices, max_frames=2,
                             max_text_chars=64, chunk_bytes=64, max_queue=4, max_reference_seconds=1.0,
                             max_body_bytes=200_000)
    with ServerThread(options).wait_until_ready(TIMEOUT) as running:
        yield running


class Unexpected(logging.Handler):
    """Records of errors the server logged as unexpected (a traceback went to the log instead of a clear answer)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def unexpected():
    handler = Unexpected()
    loggers = [logging.getLogger(name) for name in ("transformers_drama3", "uvicorn.error", "uvicorn.asgi")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield client


def assert_answer(response: httpx.Response, unexpected: Unexpected) -> None:
    """A success, or a 4xx OpenAI error whose 400s name the field; nothing logged as unexpected."""
    event(f"status {response.status_code}")  # pytest --hypothesis-show-statistics: how many got through
    assert response.status_code < 500, response.text
    assert not unexpected.records, [record.getMessage() for record in unexpected.records]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if response.status_code == 400:
            assert isinstance(error["param"], str) and error["param"], error
            event(f"400 {error['param']}")


def body_of(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # NaN and Infinity too: Python's json reads them


@settings(FUZZ, max_examples=60)
@given(body=st.one_of(speech_fields(), speech_fields(), speech_fields(), JSON,
                     st.binary(max_size=20).map(lambda b: b"\x00" + b)))
def test_speech_route(http, unexpected, body):
    data = body if isinstance(body, bytes) else body_of(body)
    response = http.post("/v1/audio/speech", content=data, headers={"content-type": "application/json"})
    assert_answer(response, unexpected)


@settings(FUZZ, max_examples=25)
@given(items=st.lists(speech_fields(with_model=False), max_size=6), top=st.dictionaries(
    st.sampled_from(["response_format", "model", "stream"]), JSON, max_size=2))
def test_batch_route(http, unexpected, items, top):
    body = {"model": MODEL, **top, "items": items}
    response = http.post("/v1/audio/speech/batch", content=body_of(body), headers={"content-type": "application/json"})
    assert_answer(response, unexpected)
    if response.status_code == 200:
        assert len(response.json()["data"]) == len(items)


NAMES = st.one_of(st.sampled_from(["narrator", "new", "..", "a/b", "default"]), st.text(string.printable, max_size=8))


@settings(FUZZ, max_examples=25)
@given(name=NAMES, fields=st.dictionaries(st.sampled_from(["name", "transcript"]), st.text(max_size=8)),
       audio=st.one_of(st.none(), st.binary(max_size=64)), method=st.sampled_from(["POST", "PUT", "GET", "DELETE"]))
def test_voice_routes(http, unexpected, name, fields, audio, method):
    files = None if audio is None else {"audio": ("a.wav", audio, "audio/wav")}
    name = "other" if name == "narrator" and method == "DELETE" else name  # the voice the other examples speak with
    if method == "POST":
        response = http.post("/v1/voices", data=fields, files=files)
    else:
        path = f"/v1/voices/{quote(name, safe='') or 'x'}"
        response = http.request(method, path, data=fields if method == "PUT" else None,
                                files=files if method == "PUT" else None)
    assert_answer(response, unexpected)


@settings(FUZZ, max_examples=10)
@given(path=st.sampled_from(["/health", "/v1/models", "/v1/voices", "/metrics"]), query=st.text(max_size=10))
def test_read_routes(http, unexpected, path, query):
    assert_answer(http.get(path, params={"q": query}), unexpected)


MESSAGES = st.one_of(
    st.fixed_dictionaries({"type": st.just("text.append"), "text": st.one_of(TEXT, JSON)}),
    st.sampled_from([{"type": "text.flush"}, {"type": "text.done"}]),
    JSON,
)


@settings(FUZZ, max_examples=20)
@given(start=st.one_of(speech_fields().map(lambda fields: {"type": "session.start", **fields}),
                       speech_fields().map(lambda fields: {"type": "session.start", "model": MODEL, **fields}), JSON),
       messages=st.lists(MESSAGES, max_size=4))
def test_websocket_sessions(server, unexpected, start, messages):
    """A session ends with session.done, or with an error event (a 4xx naming the field when it is 400) and a
    policy close (1008); never 1011."""
    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    events = []
    with connect(url, open_timeout=TIMEOUT, close_timeout=TIMEOUT) as socket:
        try:
            for message in [start, *messages, {"type": "text.done"}]:
                socket.send(json.dumps(message, allow_nan=True))
        except ConnectionClosed:
            pass  # the server refused a message and closed: its error event is read below
        try:
            for received in socket:
                if isinstance(received, str):
                    events.append(json.loads(received))
        except ConnectionClosed:
            pass
    assert socket.close_code in (1000, 1008), (socket.close_code, events)
    assert not unexpected.records, [record.getMessage() for record in unexpected.records]
    event(f"close {socket.close_code}")
    errors = [item["error"] for item in events if item["type"] == "error"]
    assert (errors == []) == (socket.close_code == 1000) and (errors or events[-1]["type"] == "session.done")
    for error in errors:
        assert error["type"] != "server_error", error
        if error["type"] == "invalid_request_error":
            assert error["param"], error


def test_the_issues_requests(http, unexpected):
    """The reported cases, one by one: each a 400 naming the field (the issue's 500 and unnamed 400 included)."""
    cases = [({"temperature": 1e308}, "temperature"), ({"top_k": 10**20}, "top_k"),
             ({"max_new_tokens": True}, "max_new_tokens"), ({"stream": "yes"}, "stream"), ({"seed": "7"}, "seed"),
             ({"temperature": math.nan}, "temperature")]
    for fields, param in cases:
        response = http.post("/v1/audio/speech", content=body_of({"model": MODEL, "input": "Hi", **fields}),
                             headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    empty = http.post("/v1/audio/speech", content=b"", headers={"content-type": "application/json"})
    assert empty.status_code == 400 and "body is empty" in empty.json()["error"]["message"]
    assert empty.json()["error"]["param"] == "body" and not unexpected.records
