"""`drama3-serve`: a real uvicorn server on 127.0.0.1 with the golden tiny checkpoint, spoken to over HTTP by httpx
and the official `openai` client. Audio is compared with `generate` / `synthesize` run here on a second copy of the
checkpoint; requests ask for few frames (the tiny model makes 10-20 frames a second on a busy 2-core machine)."""

import asyncio
import base64
import io
import json
import re
import signal
import socket
import subprocess
import sys
import time
import wave

import httpx
import numpy as np
import openai
import pytest
import soundfile
import soxr
import torch

from transformers_drama3 import loading
from transformers_drama3.testing import sine_wav
from transformers_drama3.audio_io import OGG_SERIAL, set_ogg_serial
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.audio_encoding import AAC_PRIMING
from transformers_drama3.serving import cli as serving_cli
from transformers_drama3.serving.thread import ServerThread
from transformers_drama3.synthesis import synthesize
from transformers_drama3.voice import Drama3Voice

from .conftest import GOLDEN_TINY, default_sigint, wait_until_healthy
from .test_audio_formats import decode_adts

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "drama3-tiny"
TIMEOUT = 120  # seconds any one HTTP exchange may take before the test fails
MAX_TEXT_CHARS, MAX_BODY_BYTES, MAX_FRAMES, MAX_REFERENCE_SECONDS, CHUNK_BYTES = 400, 400_000, 200, 2.0, 40
# Streamed decoding differs from one decode of all frames by at most 5e-5 in float32 (tests/test_codec.py,
# test_streaming_matches_one_shot_float32): 1.64 steps of libsndfile's 1/32768, so rounded 16-bit samples differ by
# at most 2.
STREAMED_VS_ONE_SHOT_LSB = 2


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def server(voices_dir):
    settings = ServerSettings(
        model=str(GOLDEN_TINY), model_name=MODEL, voices_dir=voices_dir, api_key=KEY, max_batch=16,
        max_text_chars=MAX_TEXT_CHARS, max_body_bytes=MAX_BODY_BYTES, max_frames=MAX_FRAMES,
        max_reference_seconds=MAX_REFERENCE_SECONDS, chunk_bytes=CHUNK_BYTES, voice_aliases={"nova": "me"},
    )
    with ServerThread(settings).wait_until_ready(TIMEOUT) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    # A new connection per request: a kept-alive one could be closed by uvicorn (5 s idle timeout) while the test
    # computes its reference between two requests, racing the next request ("Server disconnected").
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT, limits=limits) as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    """A second copy of the checkpoint, loaded as the server loads it, to compute the expected audio here."""
    return loading.load_model(str(GOLDEN_TINY), "cpu", torch.float32), Drama3Processor.from_pretrained(GOLDEN_TINY)


def pcm16(audio: torch.Tensor) -> np.ndarray:
    """16-bit samples of float audio as libsndfile writes them, as in every audio file the package writes."""
    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(audio.numpy(), -1, 1), 44100, format="RAW", subtype="PCM_16", endian="LITTLE")
    return np.frombuffer(buffer.getvalue(), dtype="<i2")


def generated(reference, text: str, **settings) -> tuple[torch.Tensor, np.ndarray]:
    """`generate` on the reference copy: (codes [10, n], 16-bit audio of one decode of all frames)."""
    model, processor = reference
    output = model.generate(**processor(text), **settings)
    return output.codes[0], pcm16(output.audio[0])


def speech(http, **body) -> httpx.Response:
    return http.post("/v1/audio/speech", json={"model": MODEL, "voice": "default", **body})


def wav_samples(data: bytes) -> np.ndarray:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == 44100
    return samples


def assert_close_pcm(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert np.abs(actual.astype(np.int32) - expected.astype(np.int32)).max(initial=0) <= STREAMED_VS_ONE_SHOT_LSB


# -- the openai client, streaming formats -----------------------------------------------------------------------


def test_openai_client_wav_equals_generate(server, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    settings = {"seed": 2, "max_new_tokens": 12}
    response = client.audio.speech.create(model=MODEL, voice="default", input="Hello there.", response_format="wav",
                                          extra_body=settings)
    codes, expected = generated(reference, "Hello there.", **settings)
    assert codes.shape[1] > 0
    assert_close_pcm(wav_samples(response.content), expected)

    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="default", input="Hello there.", response_format="wav", extra_body=settings
    ) as streamed:
        assert streamed.headers["x-seed"] == "2"
        data = b"".join(streamed.iter_bytes())
    assert data == response.content


def test_pcm_stream_and_sse_concatenate_to_the_wav(http):
    body = {"input": "Hello there.", "temperature": 0, "max_new_tokens": 10}
    wav = speech(http, response_format="wav", **body)
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"

    with http.stream("POST", "/v1/audio/speech", json={"model": MODEL, "response_format": "pcm", **body}) as pcm:
        assert pcm.status_code == 200 and pcm.headers["x-sample-rate"] == "44100"
        pieces = list(pcm.iter_bytes())
    assert b"".join(pieces) == wav.content[44:]  # the WAV header is 44 bytes

    events = []
    with http.stream("POST", "/v1/audio/speech",
                     json={"model": MODEL, "response_format": "pcm", "stream_format": "sse", **body}) as sse:
        assert sse.headers["content-type"].startswith("text/event-stream")
        for line in sse.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    assert [event["type"] for event in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    assert len(events) > 2  # audio comes in several deltas
    assert b"".join(base64.b64decode(event["audio"]) for event in events[:-1]) == wav.content[44:]
    assert events[-1]["usage"]["output_tokens"] == 10 and len(wav.content[44:]) == 10 * 2048 * 2


@pytest.mark.parametrize("response_format", ["flac", "mp3", "opus"])
def test_encoded_formats(http, response_format):
    response = speech(http, input="Hello there.", temperature=0, max_new_tokens=4, response_format=response_format)
    assert response.status_code == 200, response.text
    samples, rate = soundfile.read(io.BytesIO(response.content), dtype="float32")
    assert rate == (48000 if response_format == "opus" else 44100)
    assert samples.shape[0] >= 4 * 2048 * rate // 44100 * 0.9  # lossy encoders may trim a little padding


def test_aac_for_the_openai_client(server, http):
    """OpenAI's `aac`: ADTS frames (`audio/aac`), streamed by default and byte for byte the complete response, that
    decode to the speech's length after the encoder's priming."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    body = {"input": "Hello there.", "temperature": 0, "max_new_tokens": 4}
    streamed = client.audio.speech.create(model=MODEL, voice="default", response_format="aac",
                                          input=body["input"], extra_body={"temperature": 0, "max_new_tokens": 4})
    complete = speech(http, **body, response_format="aac", stream=False)
    assert complete.status_code == 200 and complete.headers["content-type"] == "audio/aac"
    assert streamed.content == complete.content
    frames = len(speech(http, **body, response_format="pcm").content) // (2048 * 2)
    samples, rate, channels = decode_adts(complete.content)
    assert rate == 44100 and channels == 1 and frames > 0
    assert AAC_PRIMING + frames * 2048 <= len(samples) < AAC_PRIMING + frames * 2048 + 2 * 1024


def test_missing_encoder_is_a_clear_error(http, monkeypatch):
    check_format = soundfile.check_format
    monkeypatch.setattr(soundfile, "check_format", lambda f, s=None: f != "MP3" and check_format(f, s))
    error = speech(http, input="Hi.", response_format="mp3").json()["error"]
    assert error["code"] == "format_unavailable" and "MP3" in error["message"] and "soundfile" in error["message"]


def int16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")


def resampling_rounding_bound(orig: int, target: int) -> int:
    """Largest difference, in 16-bit steps, between resampling rounded 16-bit audio and rounding resampled audio:
    each input sample is off by at most 0.5 step, which the (linear) resampler turns into at most 0.5 times the
    largest L1 norm of its rows of taps; the output's own rounding adds 0.5. The rows are measured by resampling
    unit impulses, one column each (soxr's filter is not published as taps)."""
    size = 600
    columns = [soxr.resample(np.eye(size, dtype=np.float64)[:, i], orig, target, quality="VHQ") for i in range(size)]
    rows = np.abs(np.stack(columns, axis=1))[50:-50]  # [output samples, input impulses], away from the edges
    return int(np.ceil(0.5 * rows.sum(axis=1).max() + 0.5))


def test_openai_client_as_openai_documents_it(server):
    """`voice="alloy"`, `model="tts-1"`: pcm at OpenAI's 24 kHz (the same speech as our 44.1 kHz, resampled), and
    mp3 as a complete file or streamed."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    settings = {"extra_body": {"temperature": 0, "max_new_tokens": 6}}
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="Hello there.",
                                                           response_format="pcm", **settings) as streamed:
        assert streamed.headers["x-sample-rate"] == "24000"
        at_24k = int16(b"".join(streamed.iter_bytes()))
    native = client.audio.speech.create(model=MODEL, voice="default", input="Hello there.", response_format="pcm",
                                        **settings)
    at_44k = int16(native.content)
    expected = soxr.resample(at_44k.astype(np.float64), 44100, 24000, quality="VHQ")
    assert at_24k.shape == expected.shape == (round(len(at_44k) * 24000 / 44100),)
    assert np.abs(at_24k - expected).max() <= resampling_rounding_bound(44100, 24000)

    mp3 = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello there.", response_format="mp3",
                                     **settings)
    samples, rate = soundfile.read(io.BytesIO(mp3.content), dtype="int16")
    assert rate == 44100 and samples.shape[0] >= len(at_44k)  # the encoder adds its padding
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="Hello there.",
                                                           response_format="mp3", **settings) as streamed:
        streamed_mp3 = b"".join(streamed.iter_bytes())
    # The stream keeps libsndfile's first MPEG frame as first written (128 kb/s: 144 * 128000 // 44100 bytes);
    # the complete file's holds the Xing length header. Every frame after it is the same.
    first_frame = 144 * 128000 // 44100
    assert len(streamed_mp3) == len(mp3.content) and streamed_mp3[first_frame:] == mp3.content[first_frame:]


def test_streamed_opus_is_the_complete_file_but_its_serial(http):
    body = {"input": "Hello there.", "temperature": 0, "max_new_tokens": 6, "response_format": "opus"}
    with http.stream("POST", "/v1/audio/speech", json={"model": MODEL, **body}) as streamed:
        assert streamed.headers["x-sample-rate"] == "48000"
        data = io.BytesIO(b"".join(streamed.iter_bytes()))
    complete = speech(http, stream=False, **body)
    set_ogg_serial(data, OGG_SERIAL)
    assert data.getvalue() == complete.content


def test_every_wav_reads_with_the_wave_module(http):
    body = {"input": "Hello there.", "temperature": 0, "max_new_tokens": 5, "response_format": "wav"}
    complete = speech(http, **body)
    with wave.open(io.BytesIO(complete.content)) as reader:
        assert reader.getframerate() == 44100 and reader.getnframes() == 5 * 2048
        samples = reader.readframes(reader.getnframes())
    assert complete.headers["content-length"] == str(len(complete.content))
    with http.stream("POST", "/v1/audio/speech", json={"model": MODEL, "stream": True, **body}) as streamed:
        data = b"".join(streamed.iter_bytes())
    with wave.open(io.BytesIO(data)) as reader:  # sizes unknown (0xFFFFFFFF): read to the end of the data
        assert reader.readframes(reader.getnframes()) == samples


def test_sglang_omni_request_fields(http):
    """A request as sglang-omni's clients write it: `speaker`, `stream`, `references` with `data`/`text` (or
    `ref_audio`/`ref_text`), `language`, `repetition_penalty` 1.0."""
    audio = base64.b64encode(sine_wav(1.0)).decode()
    common = {"input": "Hello there.", "speaker": "default", "stream": True, "response_format": "pcm",
              "language": "English", "repetition_penalty": 1.0, "temperature": 0, "max_new_tokens": 4}
    pieces = []
    with http.stream("POST", "/v1/audio/speech", json={"model": MODEL, **common, "references": [
            {"data": f"data:audio/wav;base64,{audio}", "text": "This is my voice.", "media_type": "audio/wav"}]}) as sg:
        assert sg.status_code == 200 and sg.headers["x-sample-rate"] == "44100"
        pieces = list(sg.iter_bytes())
    with_ref = http.post("/v1/audio/speech", json={"model": MODEL, **common, "ref_audio": audio,
                                                   "ref_text": "This is my voice."})
    ours = speech(http, input="Hello there.", temperature=0, max_new_tokens=4, response_format="pcm",
                  references=[{"audio": audio, "transcript": "This is my voice."}])
    assert b"".join(pieces) == with_ref.content == ours.content and len(ours.content) == 4 * 2048 * 2


def test_top_k_zero_means_no_limit(http):
    body = {"input": "Hello there.", "seed": 3, "max_new_tokens": 4, "response_format": "pcm"}
    assert speech(http, top_k=0, **body).content == speech(http, **body).content


def test_ras_and_codebook_settings_reach_generate(http, reference):
    """Drama 3's other sampling settings, sent over HTTP, give `generate`'s audio with the same settings, which is
    not the audio of the model's defaults."""
    body = {"input": "Hello there.", "seed": 5, "max_new_tokens": 8}
    more = {"ras_window": 4, "ras_temperature": 0.5, "ras_top_k": 3, "ras_top_p": 0.5, "codebook_temperature": 0.7,
            "codebook_top_k": 2, "codebook_top_p": 0.6}
    response = speech(http, response_format="wav", **body, **more)
    assert response.status_code == 200, response.text
    _, expected = generated(reference, body["input"], seed=5, max_new_tokens=8, **more)
    _, defaults = generated(reference, body["input"], seed=5, max_new_tokens=8)
    assert_close_pcm(wav_samples(response.content), expected)
    assert expected.shape != defaults.shape or not np.array_equal(expected, defaults)


def test_errors_in_the_users_terms(http):
    form = http.post("/v1/audio/speech", data={"model": MODEL, "input": "Hi."})
    assert form.status_code == 400 and "must be a JSON object" in form.json()["error"]["message"]
    upload = http.post("/v1/voices", data={"name": "notaudio", "transcript": "Hi."},
                       files={"audio": ("a.wav", b"this is text, not audio", "audio/wav")})
    message = upload.json()["error"]["message"]
    assert upload.status_code == 400 and "not a readable audio file" in message and "BytesIO" not in message


# -- batching, long text, disconnects, failures -----------------------------------------------------------------


def test_concurrent_requests_are_batched_and_each_gets_its_own_audio(server, reference):
    """16 greedy requests at once, with different texts and frame limits: all complete, each equal to the same
    request sent alone, and they shared frame steps."""
    texts = [f"Request number {n}." for n in range(16)]
    limits = [4 + n % 3 for n in range(16)]

    async def send_all():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as client:
            return await asyncio.gather(*[
                client.post("/v1/audio/speech", json={"model": MODEL, "input": text, "temperature": 0,
                                                      "max_new_tokens": limit, "response_format": "pcm"})
                for text, limit in zip(texts, limits)
            ])

    responses = asyncio.run(asyncio.wait_for(send_all(), TIMEOUT))
    assert max(server.service.worker.metrics.occupancy) > 1
    for text, limit, response in zip(texts, limits, responses):
        assert response.status_code == 200, response.text
        codes, expected = generated(reference, text, do_sample=False, max_new_tokens=limit)
        assert codes.shape[1] <= limit
        assert_close_pcm(np.frombuffer(response.content, dtype="<i2"), expected)


def test_a_response_ends_when_its_own_sequence_ends(server):
    """A 3-frame request sent while a long one runs gets its whole response while the long one is still generating."""
    long_body = {"model": MODEL, "input": "Hello there.", "temperature": 0, "max_new_tokens": MAX_FRAMES,
                 "response_format": "pcm"}
    short_body = {"model": MODEL, "input": "Short one.", "temperature": 0, "max_new_tokens": 3,
                  "response_format": "pcm"}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as client:
            long_task = asyncio.create_task(client.send(client.build_request("POST", "/v1/audio/speech",
                                                                            json=long_body), stream=True))
            short = await client.post("/v1/audio/speech", json=short_body)
            frames = {job.request_id: job.frames for job in server.service.worker.running}
            long = await long_task
            await long.aclose()  # leave: the long request is stopped
            return short, long.headers["x-request-id"], frames

    short, long_id, frames = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    assert short.status_code == 200 and len(short.content) == 3 * 2048 * 2
    assert frames[long_id] < MAX_FRAMES  # the long one was still generating when the short one was answered


def test_seeded_sampling_inside_a_batch_equals_alone(server):
    async def send(seeds):
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as client:
            return await asyncio.gather(*[
                client.post("/v1/audio/speech", json={"model": MODEL, "input": "Hello there.", "seed": seed,
                                                      "max_new_tokens": 8, "response_format": "pcm"})
                for seed in seeds])

    together = asyncio.run(asyncio.wait_for(send([5, 6, 7]), TIMEOUT))
    alone = [asyncio.run(asyncio.wait_for(send([seed]), TIMEOUT))[0] for seed in (5, 6, 7)]
    assert [r.content for r in together] == [r.content for r in alone]


def test_long_text_is_spoken_in_chunks_like_synthesize(http, reference):
    text = "The first sentence is here. A second one follows it. And then a third."
    response = speech(http, input=text, seed=11, max_new_tokens=5, response_format="pcm")
    model, processor = reference
    expected = synthesize(model, processor, text, chunk_bytes=CHUNK_BYTES, seed=11, max_new_tokens=5,
                          show_progress=False)  # one generator over all chunks, as the server keeps one per request
    assert len(expected.texts) > 1
    assert np.array_equal(np.frombuffer(response.content, dtype="<i2"), pcm16(expected.audio))


def test_a_client_that_disconnects_is_dropped_and_does_not_stall_others(server, http):
    """The leaving request (greedy: the tiny model does not stop by itself within MAX_FRAMES frames) is stopped
    soon after its client goes, and a request sent meanwhile completes."""
    metrics = server.service.worker.metrics
    cancelled, frames = metrics.cancelled, metrics.frames
    body = {"model": MODEL, "input": "Hello there.", "temperature": 0, "max_new_tokens": MAX_FRAMES,
            "response_format": "pcm"}
    with http.stream("POST", "/v1/audio/speech", json=body) as leaving:
        next(leaving.iter_raw())  # the first audio arrived: it is generating
    other = speech(http, input="Another request.", temperature=0, max_new_tokens=4, response_format="pcm")
    assert other.status_code == 200 and len(other.content) > 0
    deadline = time.monotonic() + TIMEOUT
    while metrics.cancelled == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics.cancelled == cancelled + 1
    assert metrics.frames - frames < MAX_FRAMES  # the leaving request did not run to its limit


def test_a_failing_request_does_not_stop_the_worker(server, http, monkeypatch):
    model = server.service.model
    prefill = model.prefill
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated failure")
        return prefill(*args, **kwargs)

    monkeypatch.setattr(model, "prefill", fail_once)
    failed = speech(http, input="Hello there.", temperature=0, max_new_tokens=3, response_format="wav")
    assert failed.status_code == 500
    assert failed.json()["error"]["message"] == "generation failed: RuntimeError: simulated failure"
    assert speech(http, input="Hello there.", temperature=0, max_new_tokens=3, response_format="wav").status_code == 200


# -- voices ----------------------------------------------------------------------------------------------------


def test_enrol_a_voice_and_speak_with_it(server, http, voices_dir, reference):
    files = {"audio": ("me.wav", sine_wav(1.0), "audio/wav")}
    created = http.post("/v1/voices", data={"name": "me", "transcript": "This is my voice."}, files=files)
    assert created.status_code == 201, created.text
    assert created.json()["id"] == "me" and (voices_dir / "me.voice.safetensors").is_file()
    assert created.json()["warnings"] == [  # 16 kHz: the processor's own note, as a Python caller gets it
        reference[1].conversion_notes(1, 16000, "audio")[0]] and "16000 Hz are resampled" in created.json()["warnings"][0]
    assert "me" in [voice["id"] for voice in http.get("/v1/voices").json()["data"]]
    again = http.post("/v1/voices", data={"name": "me", "transcript": "Again."}, files=files)
    assert again.status_code == 409

    response = speech(http, input="Hello there.", voice="me", temperature=0, max_new_tokens=4, response_format="wav")
    model, processor = reference
    voice = Drama3Voice.load(voices_dir / "me.voice.safetensors")
    output = model.generate(**processor("Hello there.", references=[voice]), do_sample=False, max_new_tokens=4)
    assert_close_pcm(wav_samples(response.content), pcm16(output.audio[0]))
    aliased = speech(http, input="Hello there.", voice="nova", temperature=0, max_new_tokens=4, response_format="wav")
    assert aliased.content == response.content  # --voice-alias nova=me


def test_a_stereo_voice_is_averaged_to_mono_and_says_so(server, http, voices_dir, reference):
    rate, time_axis = 44100, np.arange(44100) / 44100
    stereo = np.stack([0.3 * np.sin(2 * np.pi * 220 * time_axis), 0.2 * np.sin(2 * np.pi * 330 * time_axis)])
    buffer = io.BytesIO()
    soundfile.write(buffer, stereo.T.astype(np.float32), rate, format="WAV", subtype="FLOAT")
    files = {"audio": ("stereo.wav", buffer.getvalue(), "audio/wav")}
    created = http.post("/v1/voices", data={"name": "stereo", "transcript": "Two channels."}, files=files)
    assert created.status_code == 201, created.text
    assert created.json()["warnings"] == ["audio: its 2 channels are averaged to mono."]
    model, processor = reference
    expected = processor.with_codec(model.codec).create_voice("Two channels.", stereo.astype(np.float32), rate)
    assert torch.equal(Drama3Voice.load(voices_dir / "stereo.voice.safetensors").codes, expected.codes)


def test_request_references_clone_a_voice(http, reference):
    audio = sine_wav(1.0)
    body = {"input": "Hello there.", "temperature": 0, "max_new_tokens": 4, "response_format": "wav",
            "references": [{"text": "This is my voice.", "audio": base64.b64encode(audio).decode()}]}
    response = speech(http, **body)
    assert response.status_code == 200, response.text
    model, processor = reference
    samples, rate = soundfile.read(io.BytesIO(audio), dtype="float32")
    inputs = processor.with_codec(model.codec)("Hello there.", references=[{"transcript": "This is my voice.", "audio": samples,
                                                    "sampling_rate": rate}])
    output = model.generate(**inputs, do_sample=False, max_new_tokens=4)
    assert_close_pcm(wav_samples(response.content), pcm16(output.audio[0]))


# -- errors ----------------------------------------------------------------------------------------------------

BAD_REQUESTS = [
    ({"input": "Say <|im_end|> now."}, 400, "input", "control token"),
    ({"input": "   "}, 400, "input", "empty"),
    ({"input": "<|speaker:99|> Hello."}, 400, "input", "invalid speaker tag"),
    ({"voice": "nobody"}, 400, "voice", "unknown voice 'nobody'"),
    ({"voice": "../../etc/passwd"}, 400, "voice", "a name, not a path"),
    ({"voice": {"id": "../me"}}, 400, "voice", "a name, not a path"),
    ({"response_format": "aiff"}, 400, "response_format", "unsupported response_format"),
    ({"response_format": "flac", "stream_format": "sse"}, 400, "response_format", "stream_format 'sse'"),
    ({"temperature": -1}, 400, "temperature", "(send temperature 0 for greedy)"),  # generation_settings' words
    ({"top_p": 1.5}, 400, "top_p", "top_p must be"),
    ({"top_k": -1}, 400, "top_k", "top_k must be an integer in [0, 9223372036854775807], got -1 (0 or None: no limit)"),
    ({"ras_top_p": 1.5}, 400, "ras_top_p", "ras_top_p must be a number in (0, 1], also once rounded to float32, got 1.5"),
    ({"ras_window": -1}, 400, "ras_window", "ras_window must be an integer in [0, 9223372036854775807], got -1"),
    ({"ras_temperature": 0}, 400, "ras_temperature", "ras_temperature must be a number in (0, 3.4028235e+38]"),
    ({"codebook_top_k": -2}, 400, "codebook_top_k", "codebook_top_k must be an integer in [0,"),
    ({"ras_top_k": "3"}, 400, "ras_top_k", "ras_top_k: Input should be a valid integer, got '3'"),
    # values the frame step's float32 and int64 tensors cannot hold, and types taken for others
    ({"temperature": 1e308}, 400, "temperature", "temperature must be a number in (0, 3.4028235e+38]"),
    ({"top_k": 10**20}, 400, "top_k", "got 100000000000000000000"),
    ({"max_new_tokens": True}, 400, "max_new_tokens", "max_new_tokens: Input should be a valid integer, got True"),
    ({"stream": "yes"}, 400, "stream", "stream: Input should be a valid boolean, got 'yes'"),
    ({"seed": "7"}, 400, "seed", "seed: Input should be a valid integer, got '7'"),
    ({"temperature": "0.5"}, 400, "temperature", "Input should be a valid number"),
    ({"voice": 5}, 400, "voice", "voice: Input should be a valid string"),
    ({"ref_audio": "https://example.com/me.wav", "ref_text": "Hi."}, 400, "ref_audio", "fetches nothing"),
    ({"ref_audio": base64.b64encode(sine_wav(1.0)).decode()}, 400, "ref_text", "empty"),
    ({"response_format": "flac", "stream": True}, 400, "stream", "never streamed"),
    ({"repetition_penalty": 1.2}, 400, "repetition_penalty", "without penalties"),
    ({"max_new_tokens": 0}, 400, "max_new_tokens", "max_new_tokens"),
    ({"max_new_tokens": MAX_FRAMES + 1}, 400, "max_new_tokens", "--max-frames"),
    ({"speed": 1.5}, 400, "speed", "speed 1.5 is not supported"),
    ({"seed": -1}, 400, "seed", "greater than or equal to 0"),
    ({"temprature": 0.5}, 400, "temprature", "unknown field"),
    ({"model": "whisper-1"}, 404, "model", "does not exist"),
    ({"input": "a" * (MAX_TEXT_CHARS + 1)}, 413, "input", "--max-text-chars"),
    ({"references": [{"text": "Hi.", "audio": "not base64!"}]}, 400, "references[0].audio", "not valid base64"),
    ({"references": [{"text": "Hi.", "audio": base64.b64encode(b"no audio").decode()}]}, 400, "references[0].audio",
     "not a readable audio file"),
    ({"references": [{"text": "Hi.", "audio": base64.b64encode(sine_wav(3.0)).decode()}]}, 413, "references[0].audio",
     "at most 2 s"),
    ({"references": [{"text": "<|voice|>", "audio": base64.b64encode(sine_wav(1.0)).decode()}]}, 400,
     "references[0].transcript", "control token"),
]


@pytest.mark.parametrize("body, status, param, message", BAD_REQUESTS, ids=[str(b)[:60] for b, *_ in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(http, body, status, param, message):
    response = speech(http, **{"input": "Hello.", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_api_key_is_required(server):
    missing = httpx.post(f"{server.url}/v1/audio/speech", json={"model": MODEL, "input": "Hi."}, timeout=TIMEOUT)
    wrong = httpx.get(f"{server.url}/v1/voices", headers={"Authorization": "Bearer nope"}, timeout=TIMEOUT)
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["code"] == wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).json()["status"] == "ok"  # no key needed


def test_body_over_the_limit_is_413(http):
    big = base64.b64encode(bytes(MAX_BODY_BYTES)).decode()
    response = speech(http, input="Hi.", references=[{"text": "Hi.", "audio": big}])
    assert response.status_code == 413 and "--max-body-bytes" in response.json()["error"]["message"]
    body = json.dumps({"model": MODEL, "input": "Hi.", "references": [{"text": "Hi.", "audio": big}]}).encode()
    chunked = http.post("/v1/audio/speech", content=iter([body[i : i + 65536] for i in range(0, len(body), 65536)]),
                        headers={"content-type": "application/json"})  # no Content-Length: checked as it arrives
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    upload = http.post("/v1/voices", data={"name": "big", "transcript": "Hi."},
                       files={"audio": ("big.wav", bytes(MAX_BODY_BYTES), "audio/wav")})
    assert upload.status_code == 413


@pytest.mark.parametrize("fields, status, param", [
    ({"name": "../evil", "transcript": "Hi."}, 400, "name"),
    ({"name": "long", "transcript": "Hi."}, 413, "audio"),
    ({"name": "quiet", "transcript": "<|im_start|>"}, 400, "transcript"),
])
def test_bad_voice_uploads(http, fields, status, param):
    seconds = 3.0 if fields["name"] == "long" else 1.0
    response = http.post("/v1/voices", data=fields, files={"audio": ("a.wav", sine_wav(seconds), "audio/wav")})
    assert response.status_code == status and response.json()["error"]["param"] == param


def test_full_queue_is_429(server, http, monkeypatch):
    monkeypatch.setattr(server.service.worker, "max_queue", 0)
    response = speech(http, input="Hi.")
    assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
    assert response.headers["retry-after"] == "1"


def test_a_model_that_cannot_load_is_503(tmp_path):
    running = ServerThread(ServerSettings(model=str(tmp_path / "missing")))
    try:
        with pytest.raises(RuntimeError, match="failed to load"):
            running.wait_until_ready(TIMEOUT)
        response = httpx.post(f"{running.url}/v1/audio/speech", json={"model": "missing", "input": "Hi."},
                              timeout=TIMEOUT)
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_unavailable"
        assert httpx.get(f"{running.url}/health", timeout=TIMEOUT).json()["status"] == "failed"
    finally:
        running.stop()


def metric(text: str, name: str) -> float:
    """The value of one sample line `name ...` of Prometheus text (0 if absent)."""
    found = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(found[0]) if found else 0.0


def test_models_and_prometheus_metrics_count_every_request(server, http):
    assert [model["id"] for model in http.get("/v1/models").json()["data"]] == [MODEL]
    before = http.get("/metrics").text
    bad = 'drama3_http_requests_total{route="/v1/audio/speech",status="400"}'
    ok = 'drama3_http_requests_total{route="/v1/audio/speech",status="200"}'
    assert speech(http, input="Hi.", top_p=2).status_code == 400
    assert speech(http, input="Hi.", temperature=0, max_new_tokens=2, response_format="pcm").status_code == 200
    unauthorised = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT)
    after = http.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain") and unauthorised.status_code == 401
    text = after.text
    assert metric(text, bad) == metric(before, bad) + 1 and metric(text, ok) == metric(before, ok) + 1
    assert metric(text, 'drama3_http_requests_total{route="/metrics",status="401"}') >= 1
    assert metric(text, "drama3_time_to_first_audio_seconds_count") >= 1
    assert metric(text, "drama3_queue_seconds_count") >= 1
    assert metric(text, "drama3_frames_total") >= 2 and metric(text, "drama3_batch_occupancy") >= 0
    assert 1 <= metric(text, "drama3_frame_steps_total") <= metric(text, "drama3_frames_total")
    assert metric(text, 'drama3_speech_requests_total{outcome="completed"}') >= 1


# -- the command line --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_drama3_serve_command(tmp_path):
    """`drama3-serve --tiny` as a user starts it: ready, speaks, logs each request without its text, stops."""
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as output:
        command = [sys.executable, "-m", "transformers_drama3.serving.cli", "--tiny", "--port", str(port),
                   "--max-frames", "8", "--fast-decode"]
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, preexec_fn=default_sigint)
        try:
            # It listens before its imports: the first connection is accepted before the app has started.
            deadline = time.monotonic() + TIMEOUT
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
                    break
                except ConnectionRefusedError:
                    time.sleep(0.01)
            assert "Application startup complete" not in log.read_text()
            url = f"http://127.0.0.1:{port}"
            assert wait_until_healthy(process, url, TIMEOUT), log.read_text()
            response = httpx.post(f"{url}/v1/audio/speech", json={"model": "drama3-tiny", "input": "A secret sentence.",
                                                                  "response_format": "wav", "seed": 0}, timeout=TIMEOUT)
            assert response.status_code == 200 and response.content[:4] == b"RIFF"
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=TIMEOUT)
    text = log.read_text()
    assert process.returncode == 130, text  # stopped by Ctrl+C, after a graceful shutdown
    assert re.search(r"request speech-\w+ done, finish \w+: \d+ frames .* first audio after \d+ ms", text), text
    assert "secret" not in text


def test_drama3_serve_exits_when_the_model_cannot_load(tmp_path, capsys):
    assert serving_cli.main(["--model", str(tmp_path / "none"), "--port", str(free_port())]) == 1
    assert "cannot load" in capsys.readouterr().err
