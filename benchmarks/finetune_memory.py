"""Memory of LoRA fine-tuning of the real-size Drama 3 model, per LoRA preset, batch and checkpointing setting.

Three parts, all for bf16 base weights with LoRA weights in float32 and bf16 autocast (`TrainingArguments(bf16=True)`):

- **weights**: the frozen model, from its parameter counts (as in benchmarks/model_size.py: bf16, codec float32);
- **LoRA states**: trainable parameters per preset, counted by peft's own `get_peft_model` on the real-size model
  built on the meta device, times 16 bytes (float32 weight, gradient and AdamW's two moments);
- **activations**: the bytes autograd keeps for backward, measured with saved-tensor hooks during a forward pass of
  a *real-width* model on the CPU (one linear-attention and one full-attention backbone layer, the real 13-layer
  tower, a small vocabulary and codec), per region (each backbone layer kind, the tower, the rest), then scaled to the
  real depth (30 linear-attention + 10 full-attention layers). Each region is measured at two lengths (64 and 128
  rows) and split into a part per row and a fixed part. The fixed part is the merged weights of all experts that
  peft builds when the routed experts are adapted; it grows with the number of experts, so it is measured with 32
  and 64 experts and extrapolated linearly to 256 (those runs use a tower with a narrow feed-forward, and take the
  tower's figures from the "default" preset, which adapts the tower alike). The backbone runs the reference PyTorch
  kernels (no flash-linear-attention).

With checkpointing, each of the 53 checkpointed layers keeps only its input (`[rows, 2048]` bf16) and one layer is
recomputed at a time during backward; the peak adds that layer's activations. Not counted: transients that are not
saved for backward, gradients of activations during backward (with the experts adapted, the gradient of one layer's
merged experts) and allocator fragmentation.

    python benchmarks/finetune_memory.py     # the tables of docs/finetuning.md (4 to 8 minutes on 2 cores)
    python benchmarks/finetune_memory.py --rows 256 --json memory.json
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import torch
from peft import get_peft_model
from torch import nn

from model_size import GB, parameter_groups, weight_bytes
from transformers_drama3 import FishOmniConfig, FishOmniForSpeech
from transformers_drama3.testing import TINY_CONFIG
from transformers_drama3.training import Drama3SpeechCollator, drama3_lora_config, speech_example

LORA_STATE_BYTES = 16  # float32 weight + gradient + AdamW exp_avg + exp_avg_sq
MEASURE_VOCAB, MEASURE_SEMANTIC_START, MEASURE_EOS = 5248, 1024, 5
PROMPT_ROWS = 32


def measurement_config(num_experts: int, real_tower: bool) -> FishOmniConfig:
    """The real geometry with two backbone layers (one of each kind), `num_experts` experts, a small vocabulary and
    the tiny codec (neither changes what a layer keeps for backward); the real tower, or a narrow one."""
    real = FishOmniConfig()
    text = real.text_config.to_dict()
    text.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=num_experts,
                vocab_size=MEASURE_VOCAB)
    tower = real.audio_decoder_config.to_dict()
    if not real_tower:
        tower.update({key: TINY_CONFIG["audio_decoder_config"][key]
                      for key in ("intermediate_size",)})
    codec = copy.deepcopy(TINY_CONFIG["codec_config"])
    codec["quantizer"]["semantic_codebook_size"] = real.audio_decoder_config.vocab_size
    return FishOmniConfig(
        text_config=text, audio_decoder_config=tower, codec_config=codec,
        semantic_start_token_id=MEASURE_SEMANTIC_START,
        semantic_end_token_id=MEASURE_SEMANTIC_START + real.audio_decoder_config.vocab_size - 1,
        eos_token_id=MEASURE_EOS,
    )


def random_model(config: FishOmniConfig) -> FishOmniForSpeech:
    """A bf16 model with small random weights, allocated once (built on the meta device, then materialised)."""
    with torch.device("meta"):
        model = FishOmniForSpeech(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log") or parameter.dim() == 1:
                parameter.zero_()  # zero-centred norms, decay rates: harmless values
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    model.backbone.rotary_emb = type(model.backbone.rotary_emb)(config.text_config)  # its buffers are computed
    return model


class SavedTensorBytes:
    """Bytes of the storages autograd saves for backward, by region: the innermost marked module that is running
    (else "other"). Parameters and buffers do not count; a storage counts once, for the first region that saves it."""

    def __init__(self, model: nn.Module, regions: dict[str, list[nn.Module]]):
        self.excluded = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.seen: set[int] = set()
        self.kept: list[torch.Tensor] = []  # every saved tensor stays alive: no address is reused while counting
        self.bytes: Counter = Counter()
        self.stack = ["other"]
        for name, modules in regions.items():
            for module in modules:
                module.register_forward_pre_hook(lambda *_, name=name: self.stack.append(name))
                module.register_forward_hook(self._leave)

    def _leave(self, *_) -> None:  # a forward hook: returns None, so the module's output stays as it is
        self.stack.pop()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded and pointer not in self.seen:
            self.seen.add(pointer)
            self.bytes[self.stack[-1]] += storage.nbytes()
        self.kept.append(tensor)
        return tensor


def training_batch(rows: int, config: FishOmniConfig) -> dict[str, torch.Tensor]:
    """One example of `rows` rows: a prompt of text rows, random audio rows, the end-of-speech row."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.zeros(PROMPT_ROWS, 1 + config.num_codebooks, dtype=torch.long)
    prompt[:, 0] = torch.randint(10, MEASURE_SEMANTIC_START, (PROMPT_ROWS,), generator=generator)
    codes = torch.randint(0, config.codebook_size, (config.num_codebooks, rows - PROMPT_ROWS - 1), generator=generator)
    return Drama3SpeechCollator()([speech_example(prompt, codes, config.semantic_start_token_id, config.eos_token_id)])


def measure(preset: str, num_experts: int, rows: int, real_tower: bool = True) -> Counter:
    """Saved-tensor bytes per region of one forward pass (batch 1, `rows` rows) with LoRA `preset`."""
    config = measurement_config(num_experts, real_tower)
    model = get_peft_model(random_model(config), drama3_lora_config(preset))
    inner = model.get_base_model()
    counter = SavedTensorBytes(model, {
        "linear_attention_layer": [inner.backbone.layers[0]],
        "full_attention_layer": [inner.backbone.layers[1]],
        "tower": [inner.tower],
    })
    model.train()
    counting = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor)
    with torch.autocast("cpu", dtype=torch.bfloat16), counting:
        model(**training_batch(rows, config))
    return counter.bytes


def measure_apart(*args) -> Counter:
    """`measure` in a fresh process: the model's memory goes back to the system afterwards (a long-lived process keeps
    freed blocks, and several models of 2-4 GB one after the other would add up)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure, *args).result()


def lora_parameters(preset: str, rank: int) -> int:
    with torch.device("meta"):
        model = FishOmniForSpeech(FishOmniConfig())
    peft_model = get_peft_model(model, drama3_lora_config(preset, r=rank))
    return sum(parameter.numel() for parameter in peft_model.parameters() if parameter.requires_grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128,
                        help="rows of the longer measured example; the other has half as many (default 128)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    real = FishOmniConfig()
    text = real.text_config
    full_layers = text.layer_types.count("full_attention")
    linear_layers = len(text.layer_types) - full_layers
    tower_layers = real.audio_decoder_config.shared_enrichment_layers + real.num_codebooks - 1

    with torch.device("meta"):
        groups = parameter_groups(FishOmniForSpeech(real))
    weights = weight_bytes(groups, "bf16 (FP8 experts dequantised)")
    presets = ("attention", "default", "experts")
    lora = {preset: lora_parameters(preset, args.rank) for preset in presets}

    # Saved bytes of a region = fixed + per_row * rows; fixed is the merged expert weights when experts are adapted.
    regions = ("linear_attention_layer", "full_attention_layer", "tower", "other")
    fixed, per_row = {}, {}
    short, long = args.rows // 2, args.rows
    for preset in presets:
        # The experts preset adapts the tower like "default": its tower is measured there, with a narrow one here.
        real_tower = preset != "experts"
        at_short, at_long = measure_apart(preset, 32, short, real_tower), measure_apart(preset, 32, long, real_tower)
        per_row[preset] = {region: (at_long[region] - at_short[region]) / (long - short) for region in regions}
        fixed[preset] = {region: max(0.0, at_long[region] - per_row[preset][region] * long) for region in regions}
        if preset == "experts":  # the merged expert weights grow with the number of experts: extrapolate to 256
            more = measure_apart(preset, 64, long, real_tower)
            for region in ("linear_attention_layer", "full_attention_layer"):
                fixed[preset][region] += (more[region] - at_long[region]) * (text.num_experts - 32) / 32
            per_row[preset]["tower"], fixed[preset]["tower"] = per_row["default"]["tower"], fixed["default"]["tower"]
        print(f"{preset}: bytes per row {({k: round(v) for k, v in per_row[preset].items()})}, "
              f"fixed GB {({k: round(v / GB, 3) for k, v in fixed[preset].items()})}")

    checkpoint_input = text.hidden_size * 2  # bf16 hidden state kept per checkpointed layer and row

    def activations(preset: str, rows: int, checkpointing: bool) -> float:
        def layer(region: str, count: int = 1) -> float:  # one layer of `region` (the tower: all 13 / count)
            return (fixed[preset][region] + rows * per_row[preset][region]) / count

        other = layer("other")
        if not checkpointing:
            backbone = linear_layers * layer("linear_attention_layer") + full_layers * layer("full_attention_layer")
            return other + backbone + layer("tower")
        largest = max(layer("linear_attention_layer"), layer("full_attention_layer"), layer("tower", tower_layers))
        return other + rows * (linear_layers + full_layers + tower_layers) * checkpoint_input + largest

    print(f"\nfrozen weights (bf16, codec float32): {weights / GB:.1f} GB")
    print("| preset | LoRA parameters (rank %d) | LoRA weights + grads + AdamW (GB) |\n| --- | --- | --- |" % args.rank)
    for preset in presets:
        print(f"| {preset} | {lora[preset] / 1e6:.1f} M | {lora[preset] * LORA_STATE_BYTES / GB:.2f} |")
    shapes = (1024, 4096, 8192)
    print("\n| preset | checkpointing | " + " | ".join(f"{rows} rows" for rows in shapes) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in shapes) + " |")
    table = {}
    for preset in presets:
        for checkpointing in (True, False):
            totals = [(weights + lora[preset] * LORA_STATE_BYTES + activations(preset, rows, checkpointing)) / GB
                      for rows in shapes]
            table[f"{preset}, checkpointing={checkpointing}"] = dict(zip(shapes, totals))
            activation = [activations(preset, rows, checkpointing) / GB for rows in shapes]
            print(f"| {preset} | {'on' if checkpointing else 'off'} | "
                  + " | ".join(f"{t:.1f} ({a:.1f})" for t, a in zip(totals, activation)) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"weights_gb": weights / GB, "lora_parameters": lora, "saved_bytes_per_row": per_row,
                       "saved_bytes_fixed": fixed,
                       "total_gb": table, "measured_rows": args.rows, "rank": args.rank}, f, indent=2)


if __name__ == "__main__":
    main()
