"""Every user path end to end on one device: the first stage of benchmarks/gpu_check.sh (the GPU acceptance run).

    PYTHONPATH=src python benchmarks/gpu_paths.py                  # on the GPU machine (about 90 s)
    PYTHONPATH=src python benchmarks/gpu_paths.py --device cpu     # a dry run of the same script on a CPU

Prints one line per item, `PASS name (seconds)` or `FAIL name (seconds): the error`, then a count. The items:
  - on the golden tiny checkpoint (tests/fixtures/tiny), loaded with `device_map=device` in float32 and in bfloat16:
    `drama3-tts` with `--reference` and `--stream`; the pipeline; `synthesize` of a long text with a saved voice;
    `drama3-serve` on loopback (voice enrolment, 8 concurrent streamed requests, the WebSocket route, the batch route);
    the engine with `fast_decode=True`; `generate` with `compile_step=True` (float32 only, and last: compiling takes
    the most time); 3 LoRA training steps with the `Trainer` and the collator; a manifest job;
  - greedy frames of the device in float32 (TF32 off) against the CPU in float32 on the golden checkpoint: equal up to
    the first frame where some head's top-2 logit margin on the CPU is below MARGIN (see `MARGIN`);
  - at real width with 4 backbone layers (random weights; `--wide topology` on a CPU), with the routed experts FP8
    kept and bitsandbytes 4-bit: `generate`, the engine with `fast_decode=True`, the overlapped streamer, and the
    real codec encoding a recording from the CPU;
  - tensor parallel over 2 ranks under torchrun, when the machine has 2 GPUs (NCCL refuses two ranks on one GPU).
On a CPU the CUDA-only parts are said to be skipped (CUDA graphs fall back to eager steps by themselves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
RESULTS: list[tuple[str, bool]] = []


def item(name: str, function, *args) -> None:
    """Run one item and print PASS or FAIL with its error."""
    start = time.perf_counter()
    try:
        note = function(*args)
        RESULTS.append((name, True))
        print(f"PASS {name} ({time.perf_counter() - start:.1f} s){f': {note}' if note else ''}", flush=True)
    except Exception as error:  # noqa: BLE001  (every item is reported, and the next one runs)
        RESULTS.append((name, False))
        where = traceback.extract_tb(error.__traceback__)[-1]
        print(f"FAIL {name} ({time.perf_counter() - start:.1f} s): {type(error).__name__}: {error} "
              f"[{Path(where.filename).name}:{where.lineno}]", flush=True)


def skip(name: str, reason: str) -> None:
    print(f"SKIP {name}: {reason}", flush=True)


def tone(seconds: float = 1.0) -> np.ndarray:
    from transformers_drama3.testing import sine_recording

    return sine_recording(seconds, RATE)


def wav_bytes(seconds: float = 1.0) -> bytes:
    from transformers_drama3.testing import sine_wav

    return sine_wav(seconds, RATE)


# -- the items on a loaded checkpoint ------------------------------------------------------------------------------


def cli_clone_and_stream(device: str, dtype: str, folder: Path) -> str:
    from transformers_drama3 import cli

    reference, output = folder / "me.wav", folder / f"cli-{dtype}.wav"
    reference.write_bytes(wav_bytes())
    status = cli.main(["--model", str(GOLDEN_TINY), "--device", device, "--dtype", dtype, "--quiet", "--seed", "0",
                       "--max-new-tokens", str(FRAMES), "--reference", str(reference), "--reference-text", "Hi.",
                       "--stream", "-o", str(output), "Hello there."])
    assert status == 0, f"exit status {status}"
    return f"{soundfile.info(str(output)).frames} samples"


def pipeline_run(device: str, dtype: str) -> str:
    from transformers import pipeline

    tts = pipeline("text-to-speech", model=str(GOLDEN_TINY), device=device, dtype=getattr(torch, dtype))
    out = tts("Hello there.", generate_kwargs={"max_new_tokens": FRAMES, "do_sample": False})
    assert out["audio"].size > 0
    return f"{out['audio'].size} samples"


def synthesize_with_voice(model, processor, folder: Path) -> str:
    from transformers_drama3.synthesis import synthesize
    from transformers_drama3.voice import Drama3Voice

    path = folder / "me.voice.safetensors"
    processor.create_voice("This is my voice.", tone(), RATE).save(path)
    text = " ".join(["First part of it, a longer one.", "Second part of it, longer too.", "And a third."] * 2)
    speech = synthesize(model, processor, text, references=[Drama3Voice.load(path)], chunk_bytes=80,
                        max_new_tokens=FRAMES, seed=0, show_progress=False)
    assert len(speech.texts) > 1 and speech.audio.device.type == "cpu" and speech.audio.numel() > 0
    return f"{len(speech.texts)} chunks, {speech.audio.numel()} samples"


def engine_fast_decode(model, prompts: list[torch.Tensor]) -> str:
    """`prompts`: prompt rows `[1, T, 1 + NCB]` on the CPU, as the server hands them to the engine."""
    from transformers_drama3.engine import Drama3Engine

    engine = Drama3Engine(model, max_batch=4, fast_decode=True)
    ids = [engine.add_request(prompt, max_new_tokens=FRAMES, seed=index) for index, prompt in enumerate(prompts)]
    engine.run_until_idle()  # no thread of its own: this caller steps it
    results = [engine.get_result(request_id) for request_id in ids]
    assert all(r.error is None and r.codes.device.type == "cpu" for r in results), [r.error for r in results]
    audio = model.codec.decode(results[0].codes[None]).audio_values
    return f"{sum(r.frames for r in results)} frames, audio on {audio.device}"


def generate_compiled(device: str) -> str:
    from transformers_drama3.loading import load_model
    from transformers_drama3.processing_drama3 import Drama3Processor

    model = load_model(str(GOLDEN_TINY), device, torch.float32)
    inputs = Drama3Processor.from_pretrained(GOLDEN_TINY)(["Hello there.", "Yes."])
    output = model.generate(**inputs, max_new_tokens=FRAMES, compile_step=True, seed=[1, 2])
    return f"{output.sequences.shape[1]} rows, audio on {output.audio[0].device}"


def streamed_overlap(model, prompt: torch.Tensor) -> str:
    from transformers_drama3.streaming import Drama3AudioStreamer

    streamer = Drama3AudioStreamer(model.codec, chunk_frames=2, overlap=True)
    model.generate(prompt, max_new_tokens=FRAMES, do_sample=False, streamer=streamer)
    assert streamer.chunks and all(chunk.device.type == "cpu" for chunk in streamer.chunks)
    return f"{len(streamer.chunks)} chunks"


def lora_steps(model, processor, folder: Path) -> str:
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    from transformers_drama3.training.collator import Drama3SpeechCollator
    from transformers_drama3.training.lora import drama3_lora_config
    from transformers_drama3.training.prepare import speech_example

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
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
    peft_model.unload()
    return "losses " + ", ".join(f"{loss:.3f}" for loss in losses)


def manifest_job(model, processor, folder: Path) -> str:
    from transformers_drama3.jobs import run_manifest

    (folder / "me.wav").write_bytes(wav_bytes())
    items = [{"id": "a", "text": "Hello there."}, {"id": "b", "text": "Yes.", "seed": 3},
             {"id": "c", "text": "No.", "references": [{"audio": "me.wav", "transcript": "Hi."}]}]
    manifest = folder / "jobs.jsonl"
    manifest.write_text("".join(json.dumps(entry) + "\n" for entry in items))
    summary = run_manifest(model, processor, manifest, tempfile.mkdtemp(dir=folder), batch_size=2, show_progress=False,
                           max_new_tokens=FRAMES)
    assert summary.failed == 0 and summary.done == 3, summary
    return f"{summary.done} items"


def server_paths(device: str, dtype: str, folder: Path) -> str:
    import httpx
    from websockets.sync.client import connect

    from transformers_drama3.serving import ServerSettings
    from transformers_drama3.serving.thread import ServerThread

    voices = folder / f"voices-{dtype}"
    voices.mkdir(exist_ok=True)
    settings = ServerSettings(model=str(GOLDEN_TINY), model_name="drama3", device=device, dtype=dtype,
                              voices_dir=voices, max_frames=FRAMES, max_batch=8)
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
                    return len(await response.aread())

        async def eight() -> list[int]:
            return await asyncio.gather(*(streamed(index) for index in range(8)))

        sizes = asyncio.run(eight())
        assert all(size > 0 for size in sizes), sizes
        batch = http.post("/v1/audio/speech/batch", json={"model": "drama3", "response_format": "pcm", "items": [
            {"input": "Yes.", "seed": 1}, {"input": "No.", "voice": "me"}]})
        assert batch.status_code == 200, batch.text
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
    return f"8 streams of {min(sizes)}-{max(sizes)} bytes, batch of 2, a WebSocket session of {audio} bytes"


def greedy_frames_match_the_cpu(device: str) -> str:
    """Greedy frames of `device` (float32, TF32 off) against the CPU's, up to the first close call (MARGIN)."""
    from transformers_drama3 import FishOmniForSpeech
    from transformers_drama3.processing_drama3 import Drama3Processor

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    processor = Drama3Processor.from_pretrained(GOLDEN_TINY)
    inputs = processor("Hello there, how are you today?")
    frames = 24
    cpu = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32).eval()
    expected = cpu.generate(**inputs, max_new_tokens=frames, do_sample=False, output_audio=False).sequences[0]
    with torch.no_grad():
        out = cpu(expected[None])
    prompt = inputs["input_ids"].shape[1]
    main = out.main_logits[0, prompt - 1 : -1].topk(2).values  # [n, 2] the decisions of frames 1..n
    heads = out.codebook_logits[0, prompt:].topk(2).values  # [n, NCB - 1, 2]
    margins = torch.minimum((main[:, 0] - main[:, 1]), (heads[..., 0] - heads[..., 1]).amin(-1)[: len(main)])
    close = (margins < MARGIN).nonzero()
    decided = int(close[0, 0]) if len(close) else len(margins)
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, device_map=device).eval()
    actual = model.generate(**inputs, max_new_tokens=frames, do_sample=False, output_audio=False).sequences[0].cpu()
    same = prompt + decided
    assert torch.equal(actual[:same], expected[:same]), "frames differ before the first close call"
    rows = min(len(actual), len(expected))
    leading = int((actual[:rows] == expected[:rows]).all(-1).long().cumprod(0).sum()) - prompt
    return f"the {decided} frames decided by > {MARGIN:g} are equal; {leading} of {len(expected) - prompt} equal in all"


# -- the run ---------------------------------------------------------------------------------------------------------


def tiny_items(device: str, dtype: str, folder: Path) -> None:
    from transformers_drama3.loading import load_model
    from transformers_drama3.processing_drama3 import Drama3Processor

    item(f"tiny {dtype}: drama3-tts --reference --stream", cli_clone_and_stream, device, dtype, folder)
    item(f"tiny {dtype}: pipeline", pipeline_run, device, dtype)
    item(f"tiny {dtype}: drama3-serve (enrol, 8 streams, batch, WebSocket)", server_paths, device, dtype, folder)
    model = load_model(str(GOLDEN_TINY), device, getattr(torch, dtype))
    processor = Drama3Processor.from_pretrained(GOLDEN_TINY, codec=model.codec)
    item(f"tiny {dtype}: synthesize with a saved voice", synthesize_with_voice, model, processor, folder)
    prompts = [processor(text)["input_ids"] for text in ["Hello there.", "Yes.", "Good morning to you all.", "No!"]]
    item(f"tiny {dtype}: engine fast_decode=True", engine_fast_decode, model, prompts)
    item(f"tiny {dtype}: streamer overlap=True", streamed_overlap, model, prompts[0])
    item(f"tiny {dtype}: manifest job", manifest_job, model, processor, folder)
    item(f"tiny {dtype}: 3 LoRA steps (Trainer + collator)", lora_steps, model, processor, folder)


def wide_items(device: str, wide: str) -> None:
    """`generate`, the engine, the overlapped streamer and the codec's encoding of a CPU recording at real width, 4
    layers, experts FP8 kept and bitsandbytes 4-bit (random weights and text prompts: the real tokenizer is not here,
    so no voice prompt)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from configs import build_model, model_config, random_prompt
    from expert_formats import experts_modules, fp8_experts, four_bit_experts

    config = model_config(wide, layers=4)
    model = build_model(config, torch.device(device), torch.bfloat16, seed=0, codec_weights=False)
    prompts = [random_prompt(config, rows, 1, torch.device("cpu"), seed) for seed, rows in enumerate((12, 7, 20, 9))]
    kept = {name: fp8_experts(plain, device) for name, plain in experts_modules(model).items()}
    for form in ("fp8-kept", "nf4"):
        for name, experts in kept.items():
            parent, _, child = name.rpartition(".")
            replacement = experts if form == "fp8-kept" else four_bit_experts(experts, "nf4", device)
            setattr(model.backbone.get_submodule(parent), child, replacement)
        label = f"{wide} width, 4 layers, {form}"
        item(f"{label}: generate", lambda: str(tuple(model.generate(prompts[0], max_new_tokens=FRAMES).audio[0].shape)))
        item(f"{label}: engine fast_decode=True", engine_fast_decode, model, prompts)
        item(f"{label}: streamer overlap=True", streamed_overlap, model, prompts[1])
    item(f"{wide} width: codec encodes a CPU recording", lambda: str(tuple(
        model.codec.encode(torch.from_numpy(tone()), RATE).audio_codes.shape)))


def tensor_parallel(folder: Path) -> str:
    output = folder / "tp.wav"
    command = ["torchrun", "--nproc-per-node", "2", "-m", "transformers_drama3.cli", "--model", str(GOLDEN_TINY),
               "--max-new-tokens", str(FRAMES), "--seed", "0", "--quiet", "-o", str(output), "Hello there."]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return f"{soundfile.info(str(output)).frames} samples"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    parser.add_argument("--wide", default=None, help="the wide geometry: real (default on cuda) or topology (on cpu)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for a dry run")
    wide = args.wide or ("real" if cuda else "topology")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        # Most decisive first: the stage's time limit may cut the last items (each line is printed as it ends).
        tiny_items(args.device, "float32", Path(folder))
        item("greedy frames: device float32 (TF32 off) == CPU float32", greedy_frames_match_the_cpu, args.device)
        try:  # its setup (bitsandbytes, the random model) is not an item of its own: a failure there is one line
            wide_items(args.device, wide)
        except Exception as error:  # noqa: BLE001
            RESULTS.append((f"{wide} width", False))
            print(f"FAIL {wide} width, 4 layers: {type(error).__name__}: {error}", flush=True)
        tiny_items(args.device, "bfloat16", Path(folder))
        if cuda:
            item("tiny float32: generate compile_step=True", generate_compiled, args.device)
        else:
            skip("generate compile_step=True", "compiling for the CPU takes minutes here; the suite covers it")
        if cuda and torch.cuda.device_count() >= 2:
            item("torchrun: 2-rank tensor parallel", tensor_parallel, Path(folder))
        else:
            skip("torchrun: 2-rank tensor parallel", "needs 2 GPUs (NCCL refuses two ranks on one GPU); the suite "
                 "runs it on 2 CPU processes (tests/test_parallel.py)")
    failed = [name for name, passed in RESULTS if not passed]
    seconds = time.perf_counter() - start
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed in {seconds:.0f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
