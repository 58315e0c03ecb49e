"""Loading checks that need a GPU: the FP8 experts' fallback, GPU vs CPU logits, and offload next to a GPU.

On a CPU-only machine the offload tests cover disk offload only ("cpu" entries are then the main device). Next to a
GPU, "cpu" entries are real offload (weights in RAM, meta parameters, hooks copying them to the GPU per call), which
this script checks: forward logits, codec audio and greedy generation must equal the all-GPU load exactly. It
also loads the FP8 checkpoint on the GPU (FP8 experts kept when transformers' FP8 kernel can be loaded, else
dequantised with one warning) and compares its logits with a CPU float32 load. Prints one line per check.

    PYTHONPATH=src python benchmarks/gpu_loading_check.py            # on the GPU machine
    PYTHONPATH=src python benchmarks/gpu_loading_check.py --device cpu   # smoke test without a GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time

import torch
import transformers

import transformers_drama3  # noqa: F401 - registers the Drama 3 classes
from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.device_placement import execution_device
from transformers_drama3.quantization_bsgemm import fp8_kernel_problem
from transformers_drama3.testing import write_tiny_checkpoint

FRAMES = 8


def prompt_rows(semantic_start: int) -> torch.Tensor:
    """`[1, 10, 11]`: 4 text rows, then 6 audio rows with random codes."""
    codes = torch.randint(0, 32, (6, 10), generator=torch.Generator().manual_seed(0))
    rows = torch.zeros(10, 11, dtype=torch.long)
    rows[:4, 0] = torch.tensor([1, 5, 7, 9])
    rows[4:, 0], rows[4:, 1:] = semantic_start + codes[:, 0], codes
    return rows[None]


def outputs(model, prompt, device):
    """(main logits, codebook logits, codec audio of the prompt's codes, greedy generation) on CPU."""
    prompt = prompt.to(execution_device(model.backbone.embed_tokens))  # where the model reads its input
    with torch.no_grad():
        forward = model(prompt)
    codec_device = next(model.codec.parameters()).device  # the codec is never offloaded
    audio = model.codec.decode(prompt[0, 4:, 1:].T[None].to(codec_device)).audio_values
    generated = model.generate(prompt, do_sample=False, max_new_tokens=FRAMES)
    return forward.main_logits.cpu(), forward.codebook_logits.cpu(), audio.cpu(), generated


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_fp8_on_gpu(path, prompt, reference, device) -> None:
    start = time.perf_counter()
    model = FishOmniForSpeech.from_pretrained(path, dtype=torch.bfloat16, device_map={"": device})
    experts = model.backbone.layers[0].mlp.experts
    kinds = sorted({str(p.dtype) for p in experts.parameters()})
    main, codebook, audio, _ = outputs(model, prompt, device)
    print(f"FP8 checkpoint, bf16 on {device}: experts {kinds}, load {time.perf_counter() - start:.1f} s, "
          f"main-logit rel. error vs CPU float32 {relative_error(main, reference[0]):.4f}, "
          f"codebook {relative_error(codebook[:, 1:], reference[1][:, 1:]):.4f}, audio max diff "
          f"{(audio - reference[2]).abs().max().item():.2e}")


def check_float32_on_gpu(path, prompt, reference, device):
    model = FishOmniForSpeech.from_pretrained(path, dtype=torch.float32, device_map={"": device})
    result = outputs(model, prompt, device)
    print(f"float32 on {device} vs CPU: main max diff {(result[0] - reference[0]).abs().max().item():.2e}, "
          f"codebook {(result[1] - reference[1]).abs().max().item():.2e}, "
          f"audio {(result[2] - reference[2]).abs().max().item():.2e}")
    return result


def check_offload(path, prompt, in_memory, device, name, **placement) -> None:
    with tempfile.TemporaryDirectory() as folder:
        model = FishOmniForSpeech.from_pretrained(path, dtype=torch.float32, offload_folder=folder, **placement)
        main, codebook, audio, generated = outputs(model, prompt, device)
    same = {
        "main": torch.equal(main, in_memory[0]),
        "codebook": torch.equal(codebook, in_memory[1]),
        "audio": torch.equal(audio, in_memory[2]),
        "greedy codes": all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(generated.codes, in_memory[3].codes)),
        "greedy audio": all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(generated.audio, in_memory[3].audio)),
    }
    print(f"offload {name}: map {getattr(model, 'hf_device_map', None)}, codec on {next(model.codec.parameters()).device}, "
          f"identical to in-memory: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    main_device = device.index if gpu else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(device) + ' cc ' + str(torch.cuda.get_device_capability(device)) if gpu else 'cpu'}, "
          f"kernels package: {importlib.util.find_spec('kernels') is not None}, FP8 kernel problem: {fp8_kernel_problem()}")

    with tempfile.TemporaryDirectory() as path:
        write_tiny_checkpoint(path, seed=0)
        cpu_model = FishOmniForSpeech.from_pretrained(path, dtype=torch.float32)
        prompt = prompt_rows(cpu_model.config.semantic_start_token_id)
        reference = outputs(cpu_model, prompt, "cpu")
        del cpu_model

        check_fp8_on_gpu(path, prompt, reference, main_device)
        in_memory = check_float32_on_gpu(path, prompt, reference, main_device)
        mixed = {"backbone.embed_tokens": main_device, "backbone.layers.0": main_device, "backbone.layers.1": "cpu",
                 "backbone.layers.2": "disk", "backbone.layers.3": main_device, "backbone.norm": main_device,
                 "backbone.rotary_emb": main_device, "lm_head": "cpu", "tower": "disk"}
        check_offload(path, prompt, in_memory, main_device, "gpu+cpu+disk", device_map=mixed)
        layers_in_ram = {"backbone.embed_tokens": main_device, "backbone.layers": "cpu", "backbone.norm": main_device,
                         "backbone.rotary_emb": main_device, "lm_head": "cpu", "tower": "cpu"}
        check_offload(path, prompt, in_memory, main_device, "layers, lm_head, tower in RAM", device_map=layers_in_ram)
        check_offload(path, prompt, in_memory, main_device, "auto", device_map="auto",
                      max_memory={main_device: "20MB", "cpu": "12MB"} if gpu else {"cpu": "12MB"})


if __name__ == "__main__":
    main()
