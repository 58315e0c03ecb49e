"""How far bitsandbytes (and bf16) move the teacher-forced logits of the tiny golden checkpoint from float32.

Loads `tests/fixtures/tiny` in float32 as the reference, then with each quantisation, runs the teacher-forced
forward over the golden prompt (`prompt_a_rows`, 59 rows) and prints, for the main-token logits and the codebook
logits (rows 1.., row 0 has none): the max absolute difference, the relative L2 error ||q - ref|| / ||ref|| and
the share of rows whose argmax is unchanged. The tiny model has random weights, so the figures show the size of
the effect, not the audio quality of the real model.

    python benchmarks/quantisation_error.py
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import BitsAndBytesConfig

import transformers_drama3  # noqa: F401 - registers the Drama 3 classes
from transformers_drama3 import FishOmniForSpeech

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
CASES = {
    "bf16 (no quantisation)": {"dtype": torch.bfloat16},
    "bnb 8-bit": {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)},
    "bnb 8-bit, tower too": {"quantization_config": BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])},
    "bnb 4-bit fp4": {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)},
    "bnb 4-bit nf4": {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")},
}


def logits(model, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model(prompt)
    return out.main_logits.float(), out.codebook_logits[:, 1:].float()


def compare(ours: torch.Tensor, reference: torch.Tensor) -> str:
    max_abs = (ours - reference).abs().max().item()
    relative = ((ours - reference).norm() / reference.norm()).item()
    same_argmax = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return f"{max_abs:.2f} | {relative:.3f} | {100 * same_argmax:.0f} %"


def main() -> None:
    warnings.filterwarnings("ignore", message="MatMul8bitLt")
    prompt = load_file(FIXTURES / "expected.safetensors")["prompt_a_rows"][None]  # [1, 59, 11]
    path = FIXTURES / "tiny"
    main_ref, codebook_ref = logits(FishOmniForSpeech.from_pretrained(path, dtype=torch.float32), prompt)
    print(f"reference float32: max |main logit| {main_ref.abs().max():.2f}, max |codebook logit| {codebook_ref.abs().max():.2f}")
    print("| load | main: max abs diff, rel. L2, same argmax | codebooks: max abs diff, rel. L2, same argmax |")
    print("| --- | --- | --- |")
    for name, kwargs in CASES.items():
        kwargs = {"dtype": torch.float32, **kwargs}
        main, codebook = logits(FishOmniForSpeech.from_pretrained(path, **kwargs), prompt)
        print(f"| {name} | {compare(main, main_ref)} | {compare(codebook, codebook_ref)} |")


if __name__ == "__main__":
    main()
