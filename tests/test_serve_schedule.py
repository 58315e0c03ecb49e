"""The server's scheduler (serving/worker.py on `Drama3Engine`), with a real uvicorn and httpx: a request sent while
another streams is admitted at the next frame and gives the bytes it gives alone; clients that leave while waiting
or while running free their place and leave the others unaffected; a long input's next text chunk is re-admitted
with its history while other requests run, and is still spoken as `synthesize` speaks it.

"Alone" is the same request sent to the same server once it is idle (same seed and settings: equal bytes, as in
tests/test_serve.py). Each scenario starts a long streamed request (BACKGROUND_FRAMES greedy frames: the tiny model
does not stop by itself that early) and reads its first audio, so that it is running when the others arrive."""

import asyncio
import time

import httpx
import numpy as np
import pytest

from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.thread import ServerThread
from transformers_drama3.synthesis import synthesize

from .conftest import GOLDEN_TINY
from .test_serve import AUTH, KEY, MODEL, TIMEOUT, pcm16, reference  # noqa: F401 (reference: a fixture)

BACKGROUND_FRAMES, SHORT_FRAMES, CHUNK_BYTES = 150, 6, 40


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(model=str(GOLDEN_TINY), model_name=MODEL, api_key=KEY, max_batch=4,
                              max_frames=BACKGROUND_FRAMES, chunk_bytes=CHUNK_BYTES)
    with ServerThread(settings).wait_until_ready(TIMEOUT) as running:
        yield running


def body(**fields) -> dict:
    return {"model": MODEL, "voice": "default", "response_format": "pcm", **fields}


BACKGROUND = body(input="Hello there.", temperature=0, max_new_tokens=BACKGROUND_FRAMES)


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def running_ids(server) -> set[str]:
    return {job.request_id for job in server.service.worker.running}


async def with_background(server, scenario):
    """`scenario(client, background_id)` while the background request streams; the background's client then
    leaves. Returns what the scenario returns."""
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as client:
        request = client.build_request("POST", "/v1/audio/speech", json=BACKGROUND)
        background = await client.send(request, stream=True)
        chunks = background.aiter_raw()  # kept: a dropped iterator closes the response
        try:
            await anext(chunks)  # its first audio: it is running
            return await scenario(client, background.headers["x-request-id"])
        finally:
            await background.aclose()


def alone(server, fields: dict) -> bytes:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as client:
        response = client.post("/v1/audio/speech", json=fields)
    assert response.status_code == 200, response.text
    return response.content


def wait_idle(server) -> None:
    worker = server.service.worker
    deadline = time.monotonic() + TIMEOUT
    while not (worker.idle and worker.engine.running == 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.idle and worker.engine.running == 0 and worker.engine.queued == 0


def test_requests_admitted_mid_flight_give_their_audio_alone(server):
    """A greedy and a seeded sampled request, with settings unlike the running greedy one's, sent while it streams:
    both are answered while it still runs, with the bytes each gives alone."""
    short = [body(input="Good morning.", temperature=0, max_new_tokens=SHORT_FRAMES),
             body(input="Did you hear that?", seed=21, temperature=0.7, top_p=0.9, top_k=20,
                  max_new_tokens=SHORT_FRAMES)]

    async def scenario(client, background_id):
        responses = await asyncio.gather(*(client.post("/v1/audio/speech", json=fields) for fields in short))
        return responses, background_id in running_ids(server)

    responses, still_running = asyncio.run(asyncio.wait_for(with_background(server, scenario), TIMEOUT))
    assert still_running  # the short requests did not wait for the long one
    wait_idle(server)
    for fields, response in zip(short, responses):
        assert response.status_code == 200, response.text
        assert response.content == alone(server, fields), fields


def test_clients_that_leave_while_waiting_and_while_running_free_their_place(server, monkeypatch):
    """With one row, a request waits behind the running one; its client leaves (it is dropped from the queue, the
    running one goes on), then the running one's client leaves (its row frees at the next frame): a request sent
    after them gives its audio alone, and nothing is left waiting or running."""
    worker = server.service.worker
    monkeypatch.setattr(worker.engine, "max_batch", 1)
    metrics = worker.metrics
    cancelled = metrics.cancelled
    after = body(input="Another request.", temperature=0, max_new_tokens=SHORT_FRAMES)

    async def scenario(client, background_id):
        waiting = asyncio.create_task(client.post("/v1/audio/speech", json=body(input="Waiting.", temperature=0)))
        await until(lambda: worker.engine.queued == 1, "the second request to wait for the row")
        waiting.cancel()  # its client leaves while it waits
        await until(lambda: metrics.cancelled == cancelled + 1, "the waiting request to be dropped")
        assert background_id in running_ids(server) and worker.engine.queued == 0

    asyncio.run(asyncio.wait_for(with_background(server, scenario), TIMEOUT))  # then the running one's client leaves
    response = alone(server, after)  # waits for the row of the request that left
    assert metrics.cancelled == cancelled + 2
    wait_idle(server)
    monkeypatch.undo()
    assert response == alone(server, after)


def test_long_text_is_re_admitted_chunk_by_chunk_while_others_run_and_spoken_like_synthesize(server, reference):
    text = "The first sentence is here. A second one follows it. And then a third."
    fields = body(input=text, temperature=0, max_new_tokens=5)

    async def scenario(client, background_id):
        response = await client.post("/v1/audio/speech", json=fields)
        return response, background_id in running_ids(server)

    response, still_running = asyncio.run(asyncio.wait_for(with_background(server, scenario), TIMEOUT))
    assert still_running and response.status_code == 200, response.text
    model, processor = reference
    expected = synthesize(model, processor, text, chunk_bytes=CHUNK_BYTES, do_sample=False, max_new_tokens=5,
                          show_progress=False)
    assert len(expected.texts) > 1
    assert np.array_equal(np.frombuffer(response.content, dtype="<i2"), pcm16(expected.audio))
    wait_idle(server)
