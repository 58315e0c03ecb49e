"""The engine shared by threads: 8 threads add, cancel, stream and read 200 requests with random settings, lengths
and cancellation times while the engine's thread runs the frames.

What must hold: no exception anywhere; each streamed request's frames are its result's codes (none lost, none
repeated); each callback saw each frame once; every request that was not cancelled gives exactly the frames and
finish reason of `generate` alone with its settings and seed (greedy and seeded sampling), and a cancelled one a
prefix of them. Codes are compared exactly in float64, as in test_engine.py (its docstring gives the reason).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from transformers_drama3.generation.engine import Drama3Engine

THREADS, REQUESTS, MOST_FRAMES = 8, 200, 4
SETTINGS = [dict(do_sample=False), dict(seed=1), dict(seed=2, temperature=0.7, top_k=20, ras_window=4)]


@pytest.fixture(scope="module")
def model(plain_tiny_model):
    return plain_tiny_model


def test_eight_threads_share_one_engine_without_losing_a_frame(model, expected):
    a, b = expected["prompt_a_rows"], expected["prompt_b_rows"]
    prompts = [a[:10], b[:6], torch.cat((b[:4], a[:10])), a[:7]]
    solo = {}  # (prompt, settings) -> codes [NCB, n], finish reason, with at most MOST_FRAMES frames
    for p, rows in enumerate(prompts):
        for s, settings in enumerate(SETTINGS):
            out = model.generate(rows[None], output_audio=False, max_new_tokens=MOST_FRAMES, **settings)
            solo[p, s] = out.codes[0], out.finish_reason[0]
    checked, errors = [], []

    def client(index: int) -> None:
        draw = random.Random(index)
        try:
            left = REQUESTS // THREADS
            while left:
                batch = []
                for _ in range(min(draw.randint(1, 4), left)):
                    p, s, frames = draw.randrange(len(prompts)), draw.randrange(len(SETTINGS)), draw.randint(1, MOST_FRAMES)
                    seen = []
                    kind = draw.choice(("stream", "callback", "plain"))
                    request_id = engine.add_request(
                        prompts[p], max_new_tokens=frames, streaming=kind == "stream",
                        on_frame=(lambda _, codes, seen=seen: seen.append(codes)) if kind == "callback" else None,
                        **SETTINGS[s])
                    batch.append((request_id, p, s, frames, kind, seen, draw.random() < 0.25))
                    left -= 1
                for request_id, *_, cancel in batch:
                    if cancel:
                        time.sleep(draw.uniform(0, 0.02))
                        engine.cancel_request(request_id)
                for request_id, p, s, frames, kind, seen, cancel in batch:
                    if kind == "stream":  # the frames, then the result
                        *outputs, result = engine.request_id_iter(request_id)
                        seen = [output.frame for output in outputs]
                    else:
                        result = engine.get_result(request_id, timeout=300)
                    checked.append((result, seen, kind, p, s, frames, cancel))
        except Exception as error:  # noqa: BLE001  (reported by the test below)
            errors.append(error)

    started = time.perf_counter()
    with Drama3Engine(model, max_batch=8) as engine:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
    print(f"{REQUESTS} requests in {time.perf_counter() - started:.1f} s")
    assert not errors, errors
    assert len(checked) == REQUESTS and len({result.request_id for result, *_ in checked}) == REQUESTS
    cancelled = 0
    for result, streamed, kind, p, s, frames, cancel in checked:
        codes, reason = solo[p, s]
        expected_codes, expected_reason = (codes[:, :frames], "length") if frames <= codes.shape[1] else (codes, reason)
        if kind != "plain":  # streamed or called back: each frame once
            assert torch.equal(torch.stack(streamed, 1) if streamed else codes[:, :0], result.codes)
        if result.finish_reason == "cancelled":
            assert cancel
            cancelled += 1
            assert torch.equal(result.codes, expected_codes[:, : result.frames])
        else:
            assert (result.finish_reason, result.error) == (expected_reason, None)
            assert torch.equal(result.codes, expected_codes)
    assert cancelled > 0 and engine.running == 0 and not engine.requests and not engine.results
