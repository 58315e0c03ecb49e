"""How far bf16, bitsandbytes and the quantised routed experts move the teacher-forced logits from float32.

Loads a checkpoint in float32 with the FP8 experts dequantised (`BsgemmMoeConfig(dequantize=True)`) as the
reference, then each other way of loading it, runs the teacher-forced forward over the golden prompt
(`prompt_a_rows`, 59 rows) and prints, for the main-token logits and the codebook logits (rows 1.., row 0 has
none): the max absolute difference, the relative L2 error ||q - ref|| / ||ref|| and the share of rows whose argmax
is unchanged. `--geometry tiny` is `tests/fixtures/tiny`; `--geometry topology` writes a random checkpoint with the
real topology at narrow widths (40 layers with their pattern, 256 experts top-8, the 13-layer tower, 10 codebooks
of 4096; hidden 256, experts of 64 so that double quantisation's 16,384-weight groups fit) into a temporary
directory. The weights are random, so the figures show the size of the effect, not the audio quality of the real
model. The codec in bf16 is measured on the decoded audio of the prompt's codes (relative L2 against float32).

    python benchmarks/quantisation_error.py
    python benchmarks/quantisation_error.py --geometry topology
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import BitsAndBytesConfig

import transformers_drama3  # noqa: F401 - registers the Drama 3 classes
from configs import TOPOLOGY_CONFIG
from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig
from transformers_drama3.testing import write_tiny_checkpoint

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
DEQUANTISED = BsgemmMoeConfig(dequantize=True)
CASES = {
    "bf16 (no quantisation)": {"dtype": torch.bfloat16, "quantization_config": DEQUANTISED},
    "FP8 experts kept (float32)": {},
    "bnb 8-bit": {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)},
    "bnb 8-bit, tower too": {"quantization_config": BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])},
    "bnb 4-bit fp4": {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)},
    "bnb 4-bit nf4": {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")},
    "bnb 4-bit nf4, double quantisation": {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)},
    "24 GB configuration (nf4 + double quant, tower 4-bit, candidate lm_head rows)": {
        "quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                  bnb_4bit_use_double_quant=True, llm_int8_skip_modules=["lm_head"]),
        "candidate_head_rows_only": True},
}
TOPOLOGY = {
    "text_config": {**TOPOLOGY_CONFIG["text_config"], "num_hidden_layers": 40, "num_experts": 256,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64},
    "audio_decoder_config": {**TOPOLOGY_CONFIG["audio_decoder_config"], "n_layer": 4, "shared_enrichment_layers": 4,
                             "vocab_size": 4096},
    "codec_config": {"quantizer": {"codebook_size": 4096, "semantic_codebook_size": 4096}},
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


def codec_error(path, prompt) -> str:
    """Relative L2 error of the prompt's audio decoded by the codec in bf16 against float32."""
    codec = FishOmniForSpeech.from_pretrained(path, dtype=torch.float32, quantization_config=DEQUANTISED).codec
    codes = prompt[0, :, 1:][prompt[0, :, 0] >= 421].T[None]  # [1, NCB, audio rows]: the semantic band starts at 421
    with torch.no_grad():
        reference = codec.decode(codes).audio_values
        ours = codec.to(torch.bfloat16).decode(codes).audio_values.float()
    return f"{((ours - reference).norm() / reference.norm()).item():.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=["tiny", "topology"], default="tiny")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="MatMul8bitLt")
    prompt = load_file(FIXTURES / "expected.safetensors")["prompt_a_rows"][None]  # [1, 59, 11]
    with tempfile.TemporaryDirectory() as directory:
        path = FIXTURES / "tiny" if args.geometry == "tiny" else write_tiny_checkpoint(directory, seed=0, **TOPOLOGY)
        reference = FishOmniForSpeech.from_pretrained(path, dtype=torch.float32, quantization_config=DEQUANTISED)
        main_ref, codebook_ref = logits(reference, prompt)
        del reference
        print(f"{args.geometry}: reference float32, max |main logit| {main_ref.abs().max():.2f}, "
              f"max |codebook logit| {codebook_ref.abs().max():.2f}")
        print("| load | main: max abs diff, rel. L2, same argmax | codebooks: max abs diff, rel. L2, same argmax |")
        print("| --- | --- | --- |")
        for name, kwargs in CASES.items():
            kwargs = {"dtype": torch.float32, **kwargs}
            main, codebook = logits(FishOmniForSpeech.from_pretrained(path, **kwargs), prompt)
            print(f"| {name} | {compare(main, main_ref)} | {compare(codebook, codebook_ref)} |", flush=True)
        print(f"codec in bf16: relative L2 error of the decoded audio {codec_error(path, prompt)}")


if __name__ == "__main__":
    main()
