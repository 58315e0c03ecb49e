"""The device contract (docs/architecture.md, "Where each tensor lives"): every user path with the model on a second
device, here the stand-in `cuda:0` of tests/stand_in_device.py, whose ops refuse CPU tensors as a GPU does.

Inputs come from the CPU as users give them (numpy audio, files, prompt rows, an engine's codes); each test checks
that the path runs and where its outputs are. What the stand-in cannot run (CUDA graphs, torch.compile, autograd on
the device) is in the GPU acceptance run, benchmarks/gpu_paths.py.
"""

from __future__ import annotations

import base64
import json
import threading

import httpx
import numpy as np
import pytest
import soundfile
import torch
from websockets.sync.client import connect

from transformers_drama3 import FishOmniForSpeech, cli
from transformers_drama3.testing import sine_recording, sine_wav
from transformers_drama3.generation.engine import Drama3Engine
from transformers_drama3.generation.state import FrameState
from transformers_drama3.jobs import run_manifest
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.thread import ServerThread
from transformers_drama3.streaming import Drama3AudioStreamer
from transformers_drama3.synthesis import synthesize
from transformers_drama3.training.collator import Drama3SpeechCollator
from transformers_drama3.training.lora import drama3_lora_config
from transformers_drama3.training.prepare import speech_example
from transformers_drama3.voice import Drama3Voice

from .conftest import GOLDEN_TINY
from .stand_in_device import CUDA_LOG, DEFAULT_STREAM, HOST_READS, STAND_IN, StandInDeviceError, is_stand_in, stand_in_cuda

FRAMES = 3  # frames per request: the paths, not the speech, are under test
RATE = 16000  # the reference recordings' rate: the codec resamples them to 44.1 kHz on the way in


def tone(seconds: float = 0.5) -> np.ndarray:
    """A float32 sine at RATE, as a user's recording arrives (numpy, on the CPU)."""
    return sine_recording(seconds, RATE)


def wav_bytes(seconds: float = 0.5) -> bytes:
    return sine_wav(seconds, RATE)


def on_cpu(tensor: torch.Tensor) -> bool:
    return not is_stand_in(tensor) and tensor.device.type == "cpu"


@pytest.fixture(scope="module")
def stand_in():
    """The stand-in device, on for the whole module (and in every thread the module starts)."""
    with pytest.MonkeyPatch.context() as monkeypatch, stand_in_cuda(monkeypatch):
        yield


@pytest.fixture(scope="module")
def model(stand_in):
    """The golden tiny model moved to the stand-in with `model.to("cuda")`, as a user moves it to a GPU."""
    loaded = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32).eval().requires_grad_(False)
    loaded.to("cuda")  # (frozen first: the stand-in has no autograd)
    assert all(is_stand_in(p) for p in loaded.parameters()) and loaded.input_device == STAND_IN
    return loaded


@pytest.fixture(scope="module")
def processor(model):
    return Drama3Processor.from_pretrained(GOLDEN_TINY, codec=model.codec)


@pytest.fixture
def cuda_log():
    CUDA_LOG.clear()
    return CUDA_LOG


def test_the_stand_in_refuses_what_a_gpu_refuses(stand_in):
    """The check itself can fail: a CPU tensor in a device op, a CPU generator for a device draw, numpy of device
    data. 0-d CPU scalars and CPU index tensors pass, as on a GPU."""
    x = torch.ones(2, 3, device="cuda")
    with pytest.raises(StandInDeviceError, match="same device"):
        x + torch.ones(2, 3)
    with pytest.raises(StandInDeviceError, match="generator"):
        torch.rand(2, device="cuda", generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="numpy"):
        x.numpy()
    assert is_stand_in(x + torch.tensor(2.0)) and is_stand_in(x[torch.tensor([1, 0])])
    assert on_cpu(x.cpu()) and is_stand_in(x.cpu().cuda()) and x.sum().item() == 6


# -- the codec and the processor -----------------------------------------------------------------------------------


def test_codec_takes_audio_and_codes_from_the_cpu(model):
    """encode / decode / streaming decode move their inputs to the codec's device and answer there."""
    codes = model.codec.encode(torch.from_numpy(tone()), RATE).audio_codes  # [1, K, frames]
    assert is_stand_in(codes)
    cpu_codes = codes.cpu()
    audio = model.codec.decode(cpu_codes).audio_values
    assert is_stand_in(audio) and audio.shape[-1] == cpu_codes.shape[-1] * model.config.codec_config.frame_length
    streamed = model.codec.stream().decode(cpu_codes[..., :2]).audio_values
    assert is_stand_in(streamed)
    assert is_stand_in(model.codec.decode(cpu_codes[..., :0]).audio_values)  # no frames: still the codec's device


def test_processor_turns_device_frames_into_cpu_audio(model, processor):
    frames = model.generate(**processor(["Hello there.", "Yes."]), max_new_tokens=FRAMES, do_sample=False,
                            output_audio=False).sequences
    assert is_stand_in(frames)
    audio = processor.frames_to_audio(frames[0])
    assert on_cpu(audio) and audio.dtype == torch.float32 and audio.numel() > 0
    assert all(on_cpu(a) for a in processor.batch_frames_to_audio(frames))


def test_processor_encodes_references_to_cpu_codes(model, processor):
    codes = processor.encode_audio(tone(), RATE)
    assert on_cpu(codes) and codes.shape[0] == model.config.num_codebooks
    inputs = processor("Hello there.", references=[{"audio": tone(), "sampling_rate": RATE, "transcript": "Hi."}])
    assert on_cpu(inputs["input_ids"]) and on_cpu(inputs["attention_mask"])


# -- generation -------------------------------------------------------------------------------------------------------


def test_generate_takes_cpu_prompts_and_answers_on_the_device(model, processor):
    output = model.generate(**processor(["Hello there.", "Yes."]), max_new_tokens=FRAMES, seed=[1, 2])
    assert is_stand_in(output.sequences) and all(is_stand_in(a) for a in output.audio)
    assert all(is_stand_in(c) for c in output.codes)


@pytest.mark.parametrize("overlap", [False, True])
def test_streamer_chunks_come_back_to_the_cpu(model, processor, cuda_log, overlap):
    streamer = Drama3AudioStreamer(model.codec, chunk_frames=2, overlap=overlap)
    model.generate(**processor("Hello there."), max_new_tokens=FRAMES, do_sample=False, streamer=streamer)
    assert streamer.chunks and all(on_cpu(chunk) for chunk in streamer.chunks)
    if overlap:
        # generate hands the streamer each frame's codes from its one host read of the frame, so the frame loop
        # never waits on the codec: any wait is the worker's stream waiting on an event (GPU codes: the tests below).
        generating = threading.current_thread().name
        waits = [(thread, what) for thread, what, _ in cuda_log if "waits" in what]
        assert all(thread != generating and what == "stream side waits on an event" for thread, what in waits)


def test_overlapped_streamer_decodes_cpu_codes_on_its_own_stream(model, monkeypatch):
    """The engine hands the streamer CPU codes: the worker copies them to the codec's device on its own stream."""
    streams = []
    decode = type(model.codec.stream()).decode

    def spy(decoder, codes):
        streams.append(torch.cuda.current_stream())
        return decode(decoder, codes)

    monkeypatch.setattr(type(model.codec.stream()), "decode", spy)
    streamer = Drama3AudioStreamer(model.codec, chunk_frames=1, overlap=True)
    for _ in range(2):
        streamer.put(torch.zeros(1, model.config.num_codebooks, dtype=torch.long))
    streamer.end()
    assert len(streamer.chunks) == 2 and all(on_cpu(chunk) for chunk in streamer.chunks)
    assert streams and all(stream is not DEFAULT_STREAM for stream in streams)


def test_engine_results_are_on_the_cpu_and_decode_on_the_device(model, processor):
    engine = Drama3Engine(model, max_batch=2)
    ids = [engine.add_request(processor(text)["input_ids"], max_new_tokens=FRAMES, seed=3)
           for text in ("Hello there.", "Yes.")]
    engine.run_until_idle()  # no thread of its own: the caller steps it
    results = [engine.get_result(request_id) for request_id in ids]
    assert [result.error for result in results] == [None, None]  # a failed request has CPU codes too: no frames
    assert all(result.frames >= 1 and result.codes.shape[-1] == result.frames for result in results)
    assert all(on_cpu(result.codes) for result in results)
    assert is_stand_in(model.codec.decode(results[0].codes[None]).audio_values)


def test_the_frame_step_reads_nothing_back_from_the_device(model, processor, monkeypatch):
    """`FrameState.step` runs whole on the device: not one of its values (nor transformers' inside it) is read back to
    the host, which is what capturing it as a CUDA graph requires. Counted by the stand-in (`HOST_READS`), for greedy
    and sampled rows in one batch, over every step an engine runs."""
    reads, steps = [], [0]
    step = FrameState.step

    def watched(state, *args, **kwargs):
        before, steps[0] = len(HOST_READS), steps[0] + 1
        try:
            return step(state, *args, **kwargs)
        finally:
            reads.extend(HOST_READS[before:])

    monkeypatch.setattr(FrameState, "step", watched)
    engine = Drama3Engine(model, max_batch=2)
    ids = [engine.add_request(processor("Hello there.")["input_ids"], max_new_tokens=FRAMES, seed=3),
           engine.add_request(processor("Yes.")["input_ids"], max_new_tokens=FRAMES, do_sample=False)]
    engine.run_until_idle()
    assert [engine.get_result(request_id).error for request_id in ids] == [None, None]
    assert steps[0] >= FRAMES and reads == []


def test_synthesize_long_text_with_a_saved_voice(model, processor, tmp_path):
    path = tmp_path / "me.voice.safetensors"
    processor.create_voice("This is my voice.", tone(), RATE).save(path)
    voice = Drama3Voice.load(path)
    speech = synthesize(model, processor, "First part of it, a longer one. Second part of it, longer too.",
                        references=[voice], chunk_bytes=40, max_new_tokens=FRAMES, seed=0)
    assert len(speech.texts) > 1 and on_cpu(speech.audio) and speech.audio.numel() > 0


def test_pipeline(model, processor):
    from transformers import pipeline

    tts = pipeline("text-to-speech", model=model, tokenizer=processor.tokenizer, processor=processor)
    out = tts("Hello there.", generate_kwargs={"max_new_tokens": FRAMES, "do_sample": False})
    assert isinstance(out["audio"], np.ndarray) and out["audio"].size > 0


# -- the command line, jobs and the server ------------------------------------------------------------------------


def test_cli_clones_a_voice_and_streams_on_the_device(stand_in, tmp_path, monkeypatch):
    """`drama3-tts --device cuda` loads the checkpoint onto the device itself (`device_map`), as on a GPU."""
    placed = []
    load = cli.load_model

    def watched(*args, **kwargs):
        loaded = load(*args, **kwargs)
        placed.append(all(is_stand_in(p) for p in loaded.parameters()))
        return loaded

    monkeypatch.setattr(cli, "load_model", watched)
    reference, output = tmp_path / "me.wav", tmp_path / "out.wav"
    reference.write_bytes(wav_bytes())
    args = ["--model", str(GOLDEN_TINY), "--device", "cuda", "--dtype", "float32", "--quiet", "--seed", "0",
            "--max-new-tokens", str(FRAMES), "--reference", str(reference), "--reference-text", "Hi.",
            "-o", str(output), "Hello there."]
    assert cli.main([*args, "--stream"]) == 0
    assert placed == [True] and soundfile.info(str(output)).frames > 0


def test_manifest_job(model, processor, tmp_path):
    (tmp_path / "me.wav").write_bytes(wav_bytes())
    items = [{"id": "a", "text": "Hello there."},
             {"id": "b", "text": "Yes.", "references": [{"audio": "me.wav", "transcript": "Hi."}]}]
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text("".join(json.dumps(item) + "\n" for item in items))
    summary = run_manifest(model, processor, manifest, tmp_path / "out", batch_size=2, show_progress=False,
                           max_new_tokens=FRAMES)
    assert summary.failed == 0 and summary.done == 2, summary


@pytest.fixture
def server(stand_in, tmp_path):
    """`drama3-serve --device cuda`, loading the checkpoint onto the device itself (`device_map`)."""
    settings = ServerSettings(model=str(GOLDEN_TINY), device="cuda", dtype="float32", voices_dir=tmp_path,
                              model_name="drama3", max_frames=FRAMES, max_batch=4)
    with ServerThread(settings).wait_until_ready(600) as running:
        yield running


def test_server_streams_enrols_and_batches(server):
    with httpx.Client(base_url=server.url, timeout=600) as http:
        body = {"model": "drama3", "input": "Hello there.", "max_new_tokens": FRAMES, "response_format": "pcm"}
        with http.stream("POST", "/v1/audio/speech", json={**body, "stream": True}) as pcm:  # the worker's streamer
            assert pcm.status_code == 200, pcm.read()
            assert len(pcm.read()) > 0
        enrolled = http.post("/v1/voices", data={"name": "me", "transcript": "This is my voice."},
                             files={"audio": ("me.wav", wav_bytes(), "audio/wav")})
        assert enrolled.status_code == 201, enrolled.text
        batch = http.post("/v1/audio/speech/batch", json={"model": "drama3", "response_format": "pcm", "items": [
            {"input": "Yes.", "max_new_tokens": FRAMES, "seed": 1}, {"input": "No.", "voice": "me"}]})
        assert batch.status_code == 200, batch.text
        assert all(base64.b64decode(item["audio"]) for item in batch.json()["data"])


def test_server_websocket_session_with_an_enrolled_voice(server):
    with httpx.Client(base_url=server.url, timeout=600) as http:
        enrolled = http.post("/v1/voices", data={"name": "me", "transcript": "This is my voice."},
                             files={"audio": ("me.wav", wav_bytes(), "audio/wav")})
        assert enrolled.status_code == 201, enrolled.text
    with connect(server.url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=600) as socket:
        socket.send(json.dumps({"type": "session.start", "model": "drama3", "max_new_tokens": FRAMES, "voice": "me"}))
        assert json.loads(socket.recv(timeout=600))["type"] == "session.created"
        socket.send(json.dumps({"type": "text.append", "text": "Hello there."}))
        socket.send(json.dumps({"type": "text.done"}))
        audio, event = b"", {}
        while event.get("type") not in ("session.done", "error"):
            message = socket.recv(timeout=600)
            if isinstance(message, bytes):
                audio += message
            else:
                event = json.loads(message)
        assert event["type"] == "session.done" and audio, event


# -- fine-tuning ------------------------------------------------------------------------------------------------------


def test_lora_training_batches_from_the_collator(stand_in, processor):
    """peft's LoRA on a model on the device, fed the collator's CPU batch as the Trainer feeds it (moved to the
    model's device): the loss is computed there. (The stand-in has no autograd: the backward is the GPU run's.)"""
    from peft import get_peft_model

    with torch.no_grad():  # the whole test: the stand-in refuses to build an autograd graph
        model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32).to("cuda")
        peft_model = get_peft_model(model, drama3_lora_config("attention"))
        assert all(is_stand_in(p) for name, p in peft_model.named_parameters() if "lora_" in name)
        config = model.config
        examples = [speech_example(processor.build_prompt_rows(text), torch.randint(0, 8, (config.num_codebooks, n)),
                                   processor.semantic_start_id, processor.eos_token_id)
                    for text, n in (("Hello there.", 3), ("Yes.", 2))]
        batch = Drama3SpeechCollator()(examples)
        assert all(on_cpu(value) for value in batch.values())
        loss = peft_model(**{key: value.to(peft_model.device) for key, value in batch.items()}).loss
    assert is_stand_in(loss) and bool(torch.isfinite(loss))
