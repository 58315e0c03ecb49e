"""Every user path end to end on one device, in groups: the check stages of benchmarks/gpu_check.sh (the GPU run).

    PYTHONPATH=src python benchmarks/gpu_paths.py --group paths               # on the GPU machine
    PYTHONPATH=src python benchmarks/gpu_paths.py --group paths --device cpu  # a dry run of the same group on a CPU

Each group is one stage of gpu_check.sh, with a time limit of its own. It prints `PLAN name` for each of its items
first, then one line per item as it ends: `PASS name (seconds): what was checked`, `FAIL name (seconds): the error
[file:line]`, or `SKIP name (skipped): why`; then a count, and exits 1 when an item failed. gpu_check.sh reads these lines: an
item planned but never reported (the stage's limit cut it off) is a FAIL there. No item writes binary data to the
output: audio goes to files and is read back.

Groups, on the golden tiny checkpoint (tests/fixtures/tiny) loaded with `device_map=device`:
  - `paths`, in bfloat16: `drama3-tts --reference --stream` into a pipe (the piped and the written file compared);
    the pipeline; `synthesize` of a long text with a saved voice; `drama3-serve` on loopback (voice enrolment, 8
    concurrent streams, the batch route, every response format the installation has, the WebSocket route); the
    engine; the overlapped streamer; a manifest job; 3 LoRA steps with the `Trainer`; then bfloat16 against float32
    on the device (logits within `BF16_LOGITS`, greedy frames equal up to the first frame some head's top-2 margin
    does not decide by `BF16_MARGIN`);
  - `paths-float32`: greedy frames of the device against the CPU's (float32, TF32 off; the margin rule with
    `MARGIN`), then the CLI, the pipeline, the engine and the overlapped streamer in float32;
  - `graphs`: `fast_decode=True` (CUDA graphs): greedy and seeded frames equal the eager step's on the device, the
    engine with 4 requests; on CUDA each counts the graph replays (none would mean the graphs were not used);
  - `compiled`: `compile_step=True` greedy frames against the eager step's (margin rule), and the engine with
    `fast_decode=True, compile_step=True` and Drama 3's sampling (the default settings); inductor on CUDA, dynamo's
    `eager` backend on a CPU (inductor takes minutes there; dynamo's tracing of each variant is the same);
  - `wide`: real width with 4 backbone layers (random weights; the real topology at narrow width on a CPU), routed
    experts FP8 kept and bitsandbytes 4-bit: `generate`, the engine with `fast_decode=True`, the overlapped streamer,
    and the codec encoding a recording from the CPU;
  - `parallel`: tensor parallel over 2 ranks under torchrun, when the machine has 2 GPUs.
Every audio output is checked to be non-empty and free of NaN and Inf; every engine result to have no error and at
least one frame. A part that needs a package this installation lacks is skipped by name (`SKIP`), saying which.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import soundfile
import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_TINY = ROOT / "tests" / "fixtures" / "tiny"
FRAMES = 6
RATE = 16000
# Greedy frames on two devices agree while every argmax is decided by more than the two devices' rounding apart.
# float32 logits of the tiny model are O(1-10) and its depth is 4 + 13 layers: reordered float32 sums differ by about
# 1e-6 relative, so 1e-5 absolute; MARGIN is 100 times that. Frames after the first closer call are not compared.
MARGIN = 1e-3
# bfloat16 against float32 on the device. bfloat16 keeps 8 significant bits (unit roundoff 2^-8), and the tiny model's
# random weights amplify a difference layer by layer (about 1.25x per tower layer), so its logits differ by a sizeable
# fraction: 0.08 (main) and 0.23 (codebooks) of their norm, measured on a CPU. Logits unrelated to the model's, of the
# same size, are sqrt(2) of the norm apart: BF16_LOGITS = 0.5 tells the two apart (a wrong cast, a float32 buffer
# read as bfloat16 or weights not loaded fail it). Frames decided by more than BF16_MARGIN must also be equal.
BF16_LOGITS = 0.5
BF16_MARGIN = 0.5
RESULTS: list[tuple[str, str]] = []  # (name, "PASS" | "FAIL" | "SKIP")
GRAPH_REPLAYS = [0]  # CUDA graph replays so far (counted on CUDA only)


# -- items ------------------------------------------------------------------------------------------------------------


class Skip(Exception):
    """Raised by an item that cannot run here (a package it needs is not installed): reported as SKIP."""


def needs(*modules: str) -> None:
    """Skip the item unless every one of `modules` imports."""
    lacking = [reason for reason in map(missing, modules) if reason]
    if lacking:
        raise Skip("; ".join(lacking))


def item(name: str, function, *args) -> None:
    """Run one item and print PASS, SKIP or FAIL with its error."""
    start = time.perf_counter()
    try:
        note = function(*args)
        RESULTS.append((name, "PASS"))
        print(f"PASS {name} ({time.perf_counter() - start:.1f} s){f': {note}' if note else ''}", flush=True)
    except Skip as reason:
        skip(name, str(reason))
    except Exception as error:  # noqa: BLE001  (every item is reported, and the next one runs)
        RESULTS.append((name, "FAIL"))
        where = traceback.extract_tb(error.__traceback__)[-1]
        print(f"FAIL {name} ({time.perf_counter() - start:.1f} s): {type(error).__name__}: {error} "
              f"[{Path(where.filename).name}:{where.lineno}]", flush=True)


def skip(name: str, reason: str) -> None:
    RESULTS.append((name, "SKIP"))
    print(f"SKIP {name} (skipped): {reason}", flush=True)


def missing(module: str) -> str | None:
    """Why `module` cannot be imported here (None when it can)."""
    try:
        __import__(module)
    except ImportError as error:
        return f"{module} is not installed here ({error})"
    return None


def finite(audio, what: str = "audio") -> int:
    """Assert that `audio` (a tensor or an array) is non-empty and free of NaN and Inf; its sample count."""
    samples = np.asarray(audio.float().cpu() if isinstance(audio, torch.Tensor) else audio, dtype=np.float32)
    assert samples.size > 0, f"{what} is empty"
    assert np.isfinite(samples).all(), f"{what} holds {int((~np.isfinite(samples)).sum())} NaN/Inf samples"
    return samples.size


def tone(seconds: float = 1.0) -> np.ndarray:
    from transformers_drama3.testing import sine_recording

    return sine_recording(seconds, RATE)


def wav_bytes(seconds: float = 1.0) -> bytes:
    from transformers_drama3.testing import sine_wav

    return sine_wav(seconds, RATE)


def count_graph_replays() -> None:
    """Count every `CUDAGraph.replay` from now on in `GRAPH_REPLAYS` (CUDA only)."""
    replay = torch.cuda.CUDAGraph.replay

    def counted(graph):
        GRAPH_REPLAYS[0] += 1
        return replay(graph)

    torch.cuda.CUDAGraph.replay = counted


def replays_since(before: int, device: str) -> str:
    """Assert that CUDA graphs were replayed since `before` (on CUDA); a note saying how many."""
    if not device.startswith("cuda"):
        return "no CUDA: eager steps"
    replays = GRAPH_REPLAYS[0] - before
    assert replays > 0, "no CUDA graph was replayed: fast_decode ran eager steps"
    return f"{replays} graph replays"


@functools.cache
def loaded(device: str, dtype: str):
    """(model, processor) on `device` in `dtype`, loaded as the CLI and the server load them (once per run)."""
    from transformers_drama3.loading import load_model
    from transformers_drama3.processing_drama3 import Drama3Processor

    model = load_model(str(GOLDEN_TINY), device, getattr(torch, dtype))
    return model, Drama3Processor.from_pretrained(GOLDEN_TINY, codec=model.codec)


def greedy_reference(model, inputs, frames: int, margin: float) -> tuple[torch.Tensor, int]:
    """`model`'s greedy rows `[T + n, 1 + NCB]` (on the CPU) and how many of its n frames every head decides by more
    than `margin` (its top-2 logit gap, from one teacher-forced pass over them): those must be equal elsewhere."""
    sequences = model.generate(**inputs, max_new_tokens=frames, do_sample=False, output_audio=False).sequences[0]
    with torch.no_grad():
        out = model(sequences[None])
    prompt = inputs["input_ids"].shape[1]
    main = out.main_logits[0, prompt - 1 : -1].float().topk(2).values  # [n, 2] the decisions of frames 1..n
    heads = out.codebook_logits[0, prompt:].float().topk(2).values  # [n, NCB - 1, 2]
    margins = torch.minimum(main[:, 0] - main[:, 1], (heads[..., 0] - heads[..., 1]).amin(-1)[: len(main)])
    close = (margins < margin).nonzero()
    return sequences.cpu(), int(close[0, 0]) if len(close) else len(margins)


def agree(actual: torch.Tensor, expected: torch.Tensor, decided: int, prompt: int, margin: float) -> str:
    """Assert that greedy rows `actual` equal `expected` over the prompt and its first `decided` frames."""
    same = prompt + decided
    assert torch.equal(actual.cpu()[:same], expected[:same]), f"frames differ within the {decided} decided by > {margin:g}"
    rows = min(len(actual), len(expected))
    leading = int((actual.cpu()[:rows] == expected[:rows]).all(-1).long().cumprod(0).sum()) - prompt
    return f"the {decided} frames decided by > {margin:g} are equal; {leading} of {len(expected) - prompt} in all"


def prompts_of(processor) -> list[torch.Tensor]:
    return [processor(text)["input_ids"] for text in ["Hello there.", "Yes.", "Good morning to you all.", "No!"]]


def engine_run(model, prompts: list[torch.Tensor], **engine_kwargs) -> tuple[list, str]:
    """4 requests through a `Drama3Engine` stepped by this thread; each must end without error with >= 1 frame. The
    results and a note."""
    from transformers_drama3.generation.engine import Drama3Engine

    engine = Drama3Engine(model, max_batch=4, **engine_kwargs)
    ids = [engine.add_request(prompt, max_new_tokens=FRAMES, seed=index) for index, prompt in enumerate(prompts)]
    engine.run_until_idle()
    results = [engine.get_result(request_id) for request_id in ids]
    assert all(r.error is None for r in results), [r.error for r in results]
    assert all(r.frames >= 1 and r.codes.device.type == "cpu" for r in results), [(r.frames, r.codes.device) for r in results]
    finite(model.codec.decode(results[0].codes[None]).audio_values, "decoded audio")
    return results, f"{sum(r.frames for r in results)} frames"


# -- group `paths` ------------------------------------------------------------------------------------------------


def cli_clone_and_stream(device: str, dtype: str, folder: Path) -> str:
    """`drama3-tts --stream` into a pipe, as a user runs it into a player: the piped WAV and the file agree."""
    reference, output = folder / "me.wav", folder / f"cli-{dtype}.wav"
    reference.write_bytes(wav_bytes())
    command = [sys.executable, "-m", "transformers_drama3.cli", "--model", str(GOLDEN_TINY), "--device", device,
               "--dtype", dtype, "--quiet", "--seed", "0", "--max-new-tokens", str(FRAMES), "--reference",
               str(reference), "--reference-text", "Hi.", "--stream", "-o", str(output), "Hello there."]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300)
    assert result.returncode == 0, f"exit status {result.returncode}: {result.stderr.decode(errors='replace')[-1500:]}"
    piped, _ = soundfile.read(io.BytesIO(result.stdout), dtype="float32")
    written, _ = soundfile.read(str(output), dtype="float32")
    assert len(piped) == len(written), f"{len(piped)} samples piped, {len(written)} written"
    return f"{finite(written)} samples, the same piped"


def pipeline_run(device: str, dtype: str) -> str:
    from transformers import pipeline

    tts = pipeline("text-to-speech", model=str(GOLDEN_TINY), device=device, dtype=getattr(torch, dtype))
    out = tts("Hello there.", generate_kwargs={"max_new_tokens": FRAMES, "do_sample": False})
    return f"{finite(out['audio'])} samples"


def synthesize_with_voice(device: str, dtype: str, folder: Path) -> str:
    from transformers_drama3.synthesis import synthesize
    from transformers_drama3.voice import Drama3Voice

    model, processor = loaded(device, dtype)
    path = folder / "me.voice.safetensors"
    processor.create_voice("This is my voice.", tone(), RATE).save(path)
    text = " ".join(["First part of it, a longer one.", "Second part of it, longer too.", "And a third."] * 2)
    speech = synthesize(model, processor, text, references=[Drama3Voice.load(path)], chunk_bytes=80,
                        max_new_tokens=FRAMES, seed=0, show_progress=False)
    assert len(speech.texts) > 1 and speech.audio.device.type == "cpu"
    return f"{len(speech.texts)} chunks, {finite(speech.audio)} samples"


def engine_eager(device: str, dtype: str) -> str:
    model, processor = loaded(device, dtype)
    return engine_run(model, prompts_of(processor))[1]


def streamed_overlap(model, prompt: torch.Tensor) -> str:
    from transformers_drama3.streaming import Drama3AudioStreamer

    streamer = Drama3AudioStreamer(model.codec, chunk_frames=2, overlap=True)
    model.generate(prompt, max_new_tokens=FRAMES, do_sample=False, streamer=streamer)
    assert streamer.chunks and all(chunk.device.type == "cpu" for chunk in streamer.chunks)
    return f"{len(streamer.chunks)} chunks, {finite(torch.cat(streamer.chunks, -1))} samples"


def manifest_job(device: str, dtype: str, folder: Path) -> str:
    from transformers_drama3.jobs import run_manifest

    (folder / "me.wav").write_bytes(wav_bytes())
    items = [{"id": "a", "text": "Hello there."}, {"id": "b", "text": "Yes.", "seed": 3},
             {"id": "c", "text": "No.", "references": [{"audio": "me.wav", "transcript": "Hi."}]}]
    manifest = folder / "jobs.jsonl"
    manifest.write_text("".join(json.dumps(entry) + "\n" for entry in items))
    out = Path(tempfile.mkdtemp(dir=folder))
    summary = run_manifest(*loaded(device, dtype), manifest, out, batch_size=2, show_progress=False,
                           max_new_tokens=FRAMES)
    assert summary.failed == 0 and summary.done == 3, summary
    samples = sum(finite(soundfile.read(str(path), dtype="float32")[0], path.name) for path in out.glob("*.wav"))
    return f"{summary.done} items, {samples} samples"


def lora_steps(device: str, dtype: str, folder: Path) -> str:
    needs("datasets", "peft")
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    from transformers_drama3.training.collator import Drama3SpeechCollator
    from transformers_drama3.training.lora import drama3_lora_config
    from transformers_drama3.training.prepare import speech_example

    model, processor = loaded(device, dtype)
    generator = torch.Generator().manual_seed(0)
    examples = [speech_example(processor.build_prompt_rows(text), torch.randint(0, 8, (model.config.num_codebooks, n),
                                                                              generator=generator),
                               processor.semantic_start_id, processor.eos_token_id)
                for text, n in [("Hello there.", 5), ("Yes.", 3), ("Good morning.", 4), ("No.", 2)]]
    dataset = Dataset.from_list([{key: value.tolist() for key, value in example.items()} for example in examples])
    peft_model = get_peft_model(model, drama3_lora_config("attention"))
    arguments = TrainingArguments(output_dir=str(folder / "run"), max_steps=3, per_device_train_batch_size=2,
                                  learning_rate=2e-3, save_strategy="no", report_to=[], logging_steps=1,
                                  use_cpu=model.device.type == "cpu")
    trainer = Trainer(model=peft_model, args=arguments, train_dataset=dataset, data_collator=Drama3SpeechCollator())
    try:
        trainer.train()
    finally:
        peft_model.unload()  # the shared model is used by later items
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
    return "losses " + ", ".join(f"{loss:.3f}" for loss in losses)


def decoded(body: bytes, response_format: str) -> int:
    """Samples of a response body in `response_format`, checked finite (aac: its ADTS frames are counted)."""
    if response_format == "pcm":
        return finite(np.frombuffer(body, dtype="<i2").astype(np.float32), "pcm")
    if response_format == "aac":
        assert body[:2] in (b"\xff\xf1", b"\xff\xf9"), "no ADTS frame at the start"
        return len(body)
    samples, _ = soundfile.read(io.BytesIO(body), dtype="float32")
    return finite(samples, response_format)


def server_paths(device: str, dtype: str, folder: Path) -> str:
    needs("fastapi", "uvicorn", "websockets", "multipart")
    import httpx
    from websockets.sync.client import connect

    from transformers_drama3.serving import ServerSettings
    from transformers_drama3.serving.audio_encoding import RESPONSE_FORMATS, available_formats
    from transformers_drama3.serving.thread import ServerThread

    voices = folder / f"voices-{dtype}"
    voices.mkdir(exist_ok=True)
    settings = ServerSettings(model=str(GOLDEN_TINY), model_name="drama3", device=device, dtype=dtype,
                              voices_dir=voices, max_frames=FRAMES, max_batch=8)
    formats = available_formats()
    with ServerThread(settings).wait_until_ready(120) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        enrolled = http.post("/v1/voices", data={"name": "me", "transcript": "This is my voice."},
                             files={"audio": ("me.wav", wav_bytes(), "audio/wav")})
        assert enrolled.status_code == 201, enrolled.text

        async def streamed(index: int) -> int:
            body = {"model": "drama3", "input": f"Hello number {index}.", "voice": "me", "stream": True,
                    "response_format": "pcm", "seed": index}
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                async with client.stream("POST", "/v1/audio/speech", json=body) as response:
                    assert response.status_code == 200, await response.aread()
                    return decoded(await response.aread(), "pcm")

        async def eight() -> list[int]:
            return await asyncio.gather(*(streamed(index) for index in range(8)))

        sizes = asyncio.run(eight())
        batch = http.post("/v1/audio/speech/batch", json={"model": "drama3", "response_format": "pcm", "items": [
            {"input": "Yes.", "seed": 1}, {"input": "No.", "voice": "me"}]})
        assert batch.status_code == 200, batch.text
        for response_format in formats:
            response = http.post("/v1/audio/speech", json={"model": "drama3", "input": "Yes.", "seed": 2,
                                                           "response_format": response_format})
            assert response.status_code == 200, f"{response_format}: {response.text}"
            decoded(response.content, response_format)
    with ServerThread(settings).wait_until_ready(120) as server:
        with connect(server.url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=120) as socket:
            socket.send(json.dumps({"type": "session.start", "model": "drama3", "voice": "me"}))
            assert json.loads(socket.recv(timeout=120))["type"] == "session.created"
            socket.send(json.dumps({"type": "text.append", "text": "Hello there. How are you?"}))
            socket.send(json.dumps({"type": "text.done"}))
            audio, event = 0, {}
            while event.get("type") not in ("session.done", "error"):
                message = socket.recv(timeout=120)
                if isinstance(message, bytes):
                    audio += len(message)
                else:
                    event = json.loads(message)
            assert event["type"] == "session.done" and audio > 0, event
    lacking = sorted(set(RESPONSE_FORMATS) - set(formats))
    return (f"8 streams of {min(sizes)}-{max(sizes)} samples, batch of 2, formats {', '.join(formats)}"
            f"{f' (not here: {lacking})' if lacking else ''}, a WebSocket session of {audio} bytes")


def frames_against_cpu(device: str) -> str:
    """Greedy frames of `device` (float32, TF32 off) against the CPU's, up to the first close call (MARGIN)."""
    from transformers_drama3 import FishOmniForSpeech

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    _, processor = loaded(device, "float32")
    inputs = processor("Hello there, how are you today?")
    cpu = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32).eval()
    expected, decided = greedy_reference(cpu, inputs, 24, MARGIN)
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, device_map=device).eval()
    actual = model.generate(**inputs, max_new_tokens=24, do_sample=False, output_audio=False).sequences[0]
    return agree(actual, expected, decided, inputs["input_ids"].shape[1], MARGIN)


def bf16_against_float32(device: str) -> str:
    """bfloat16 against float32 on `device`: the teacher-forced logits of float32's greedy rows finite and within
    BF16_LOGITS of float32's (relative to their norm), and greedy frames equal up to the first close call
    (BF16_MARGIN)."""
    float32, processor = loaded(device, "float32")
    inputs = processor("Hello there, how are you today?")
    expected, decided = greedy_reference(float32, inputs, 24, BF16_MARGIN)
    bf16, _ = loaded(device, "bfloat16")
    with torch.no_grad():
        reference, low = float32(expected[None]), bf16(expected[None])
    errors = []
    for name in ("main_logits", "codebook_logits"):
        exact, rounded = getattr(reference, name).float(), getattr(low, name).float()
        finite(rounded, f"bfloat16 {name}")
        errors.append(((rounded - exact).norm() / exact.norm()).item())
        assert errors[-1] <= BF16_LOGITS, f"{name}: bfloat16 is {errors[-1]:.3g} of float32's norm away"
    actual = bf16.generate(**inputs, max_new_tokens=24, do_sample=False, output_audio=False).sequences[0]
    note = agree(actual, expected, decided, inputs["input_ids"].shape[1], BF16_MARGIN)
    return f"logits {errors[0]:.2g} (main), {errors[1]:.2g} (codebooks) of float32's norm away; {note}"


def streamed_overlap_tiny(device: str, dtype: str) -> str:
    model, processor = loaded(device, dtype)
    return streamed_overlap(model, prompts_of(processor)[0])


def paths(device: str, folder: Path) -> list:
    """Every user path in bfloat16, the dtype a GPU user loads (then bfloat16 against float32)."""
    label = "tiny bfloat16"
    return [(f"{label}: drama3-tts --reference --stream (into a pipe)", cli_clone_and_stream, device, "bfloat16",
             folder),
            (f"{label}: pipeline", pipeline_run, device, "bfloat16"),
            (f"{label}: drama3-serve (enrol, 8 streams, batch, formats, WebSocket)", server_paths, device, "bfloat16",
             folder),
            (f"{label}: synthesize with a saved voice", synthesize_with_voice, device, "bfloat16", folder),
            (f"{label}: engine", engine_eager, device, "bfloat16"),
            (f"{label}: streamer overlap=True", streamed_overlap_tiny, device, "bfloat16"),
            (f"{label}: manifest job", manifest_job, device, "bfloat16", folder),
            (f"{label}: 3 LoRA steps (Trainer + collator)", lora_steps, device, "bfloat16", folder),
            ("greedy frames: device bfloat16 ~ device float32", bf16_against_float32, device)]


def paths_float32(device: str, folder: Path) -> list:
    """The paths whose numbers are compared across devices, in float32 (the reference dtype)."""
    label = "tiny float32"
    return [("greedy frames: device float32 (TF32 off) == CPU float32", frames_against_cpu, device),
            (f"{label}: drama3-tts --reference --stream (into a pipe)", cli_clone_and_stream, device, "float32",
             folder),
            (f"{label}: pipeline", pipeline_run, device, "float32"),
            (f"{label}: engine", engine_eager, device, "float32"),
            (f"{label}: streamer overlap=True", streamed_overlap_tiny, device, "float32")]


# -- groups `graphs` and `compiled` -------------------------------------------------------------------------------


def fast_against_eager(device: str, dtype: str, **fast) -> str:
    """Greedy and seeded frames of `generate(**fast)` against the eager step's on the same device: equal (CUDA graphs
    replay the eager step's kernels: `fast_decode` alone), or up to the first close call (a compiled step's fused
    kernels round differently)."""
    model, processor = loaded(device, dtype)
    model.set_experts_implementation("batched_mm")  # what a captured step runs: the same kernels both ways
    inputs = processor("Hello there, how are you today?")
    prompt = inputs["input_ids"].shape[1]
    before = GRAPH_REPLAYS[0]
    if fast.get("compile_step"):
        expected, decided = greedy_reference(model, inputs, 16, MARGIN)
        actual = model.generate(**inputs, max_new_tokens=16, do_sample=False, output_audio=False, **fast).sequences[0]
        note = agree(actual, expected, decided, prompt, MARGIN)
    else:
        for settings in ({"do_sample": False}, {"seed": 0}, {"seed": 1, "temperature": 0.7, "top_k": 7}):
            eager = model.generate(**inputs, max_new_tokens=16, output_audio=False, **settings).sequences
            graphs = model.generate(**inputs, max_new_tokens=16, output_audio=False, **settings, **fast).sequences
            assert torch.equal(graphs.cpu(), eager.cpu()), f"frames differ with {settings}"
        note = "greedy and 2 seeded runs equal"
    return f"{note}; {replays_since(before, device)}"


def engine_fast(device: str, dtype: str, **fast) -> str:
    model, processor = loaded(device, dtype)
    before = GRAPH_REPLAYS[0]
    note = engine_run(model, prompts_of(processor), **fast)[1]
    return f"{note}; {replays_since(before, device)}"


def graphs(device: str, folder: Path) -> list:
    return [("tiny float32: generate fast_decode=True == eager", fast_against_eager, device, "float32",
             {"fast_decode": True}),
            ("tiny float32: engine fast_decode=True", engine_fast, device, "float32", {"fast_decode": True}),
            ("tiny bfloat16: generate fast_decode=True == eager", fast_against_eager, device, "bfloat16",
             {"fast_decode": True})]


def compiled(device: str, folder: Path) -> list:
    backend = True if device.startswith("cuda") else "eager"  # True: inductor
    name = "inductor" if backend is True else backend
    return [(f"tiny float32: generate compile_step ({name}) ~ eager", fast_against_eager, device, "float32",
             {"compile_step": backend}),
            (f"tiny float32: engine fast_decode=True, compile_step ({name}), sampling", engine_fast, device, "float32",
             {"fast_decode": True, "compile_step": backend})]


# -- groups `wide` and `parallel` -----------------------------------------------------------------------------------


def wide(device: str, folder: Path) -> list:
    """At real width (the real topology at narrow width on a CPU), 4 layers, experts FP8 kept and bitsandbytes 4-bit:
    random weights and text prompts (the real tokenizer is not here, so no voice prompt)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from configs import build_model, model_config, random_prompt

    width = "real" if device.startswith("cuda") else "topology"
    state = {}

    def build() -> str:
        config = model_config(width, layers=4)
        state["model"] = build_model(config, torch.device(device), torch.bfloat16, seed=0, codec_weights=False)
        state["prompts"] = [random_prompt(config, rows, 1, torch.device("cpu"), seed)
                            for seed, rows in enumerate((12, 7, 20, 9))]
        return f"{sum(p.numel() for p in state['model'].parameters()) / 1e9:.2f} B parameters"

    def experts_as(form: str) -> None:
        if form == "nf4":
            needs("bitsandbytes")
        from expert_formats import experts_modules, fp8_experts, four_bit_experts

        model = state["model"]
        kept = state.setdefault("kept", {name: fp8_experts(plain, device) for name, plain in experts_modules(model).items()})
        for name, experts in kept.items():
            parent, _, child = name.rpartition(".")
            replacement = experts if form == "fp8-kept" else four_bit_experts(experts, "nf4", device)
            setattr(model.backbone.get_submodule(parent), child, replacement)

    def generate(form: str) -> str:
        experts_as(form)
        return f"{finite(state['model'].generate(state['prompts'][0], max_new_tokens=FRAMES).audio[0])} samples"

    items = [(f"{width} width, 4 layers: random model", build)]
    for form in ("fp8-kept", "nf4"):
        label = f"{width} width, 4 layers, {form}"
        items += [(f"{label}: generate", generate, form),
                  (f"{label}: engine fast_decode=True", lambda: engine_fast_on(state, device)),
                  (f"{label}: streamer overlap=True", lambda: streamed_overlap(state["model"], state["prompts"][1]))]
    items.append((f"{width} width: codec encodes a CPU recording", lambda: str(tuple(
        state["model"].codec.encode(torch.from_numpy(tone()), RATE).audio_codes.shape))))
    return items


def engine_fast_on(state: dict, device: str) -> str:
    before = GRAPH_REPLAYS[0]
    note = engine_run(state["model"], state["prompts"], fast_decode=True)[1]
    return f"{note}; {replays_since(before, device)}"


def tensor_parallel(folder: Path) -> str:
    output = folder / "tp.wav"
    command = ["torchrun", "--nproc-per-node", "2", "-m", "transformers_drama3.cli", "--model", str(GOLDEN_TINY),
               "--max-new-tokens", str(FRAMES), "--seed", "0", "--quiet", "-o", str(output), "Hello there."]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return f"{finite(soundfile.read(str(output), dtype='float32')[0])} samples"


def parallel(device: str, folder: Path) -> list:
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        return [("torchrun: 2-rank tensor parallel", tensor_parallel, folder)]
    skip("torchrun: 2-rank tensor parallel", "needs 2 GPUs (NCCL refuses two ranks on one GPU); the suite runs it on "
         "2 CPU processes (tests/test_parallel.py)")
    return []


GROUPS = {"paths": paths, "paths-float32": paths_float32, "graphs": graphs, "compiled": compiled, "wide": wide,
          "parallel": parallel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", required=True, choices=sorted(GROUPS), help="the items to run")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for a dry run")
    if cuda:
        count_graph_replays()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        items = GROUPS[args.group](args.device, Path(folder))
        for name, *_ in items:
            print(f"PLAN {name}", flush=True)
        for name, function, *arguments in items:
            keywords = arguments.pop() if arguments and isinstance(arguments[-1], dict) else {}
            item(name, functools.partial(function, **keywords), *arguments)
    counts = {status: sum(1 for _, s in RESULTS if s == status) for status in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    sys.exit(1 if counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
