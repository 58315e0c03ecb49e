"""Fine-tune Drama 3 on your recordings with LoRA: data folder -> prepared dataset -> Trainer -> merged checkpoint
-> speech from the fine-tuned model.

    python examples/finetune_lora.py --model fishaudio/drama-3 --data my_voice/ --output finetuned/
    python examples/finetune_lora.py            # tiny random checkpoint and generated clips: the recipe in ~1 min

`--data` is a folder of `clip.wav` + `clip.txt` (or `.lab`) pairs, or an LJSpeech `metadata.csv` (docs/finetuning.md).
Without it, a few generated tones with made-up transcripts stand in for recordings. Written to `--output`:
`prepared/` (the dataset and the codes cache; a rerun reuses them), `adapter/` (the LoRA adapter, loadable with
`PeftModel.from_pretrained`), `merged/` (a full checkpoint in the original Drama 3 layout, with its processor:
`AutoProcessor.from_pretrained(merged)` loads it) and `sample.wav`.
On a GPU the model trains in bfloat16; on a CPU in float32.
"""

import math
import time
from pathlib import Path

import numpy as np
import soundfile
import torch
from peft import get_peft_model
from transformers import AutoModel, AutoProcessor, Trainer, TrainingArguments

from example_setup import checkpoint_path, example_parser
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig
from transformers_drama3.training import (
    Drama3SpeechCollator,
    LORA_PRESETS,
    checkpointing_arguments,
    drama3_lora_config,
    prepare_dataset,
)

STAND_IN_LINES = [
    "Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.", "Did you hear that?",
    "Good morning, everyone.", "Nice to meet you.", "Thanks for waiting, we can start now.",
    "This is my voice, recorded on a quiet afternoon.", "She whispered softly, then laughed out loud!",
    "Numbers: one, two, three.", "Hear what? I heard nothing at all.", "Speech is sound shaped by words.",
    "A voice carries feeling, rhythm and breath.",
]


def write_stand_in_recordings(folder: Path) -> Path:
    """Short gliding tones with transcripts, in the clip.wav + clip.txt layout (a stand-in for real recordings)."""
    folder.mkdir(parents=True, exist_ok=True)
    rate = 24000
    for index, line in enumerate(STAND_IN_LINES):
        t = np.arange(int((0.6 + 0.05 * index) * rate)) / rate
        pitch = 140 + 15 * index
        audio = 0.3 * np.sin(2 * np.pi * (pitch * t + 40 * t**2)) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
        soundfile.write(folder / f"line{index:02d}.wav", audio.astype(np.float32), rate)
        (folder / f"line{index:02d}.txt").write_text(line, encoding="utf-8")
    return folder


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--data", type=Path, help="folder of recordings with transcripts (default: generated tones)")
    parser.add_argument("--output", type=Path, default=Path("finetuned"))
    parser.add_argument("--preset", choices=sorted(LORA_PRESETS), default="default", help="what LoRA adapts")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="default: 2e-4 for a real checkpoint, 2e-3 for the tiny one")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: --epochs)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--text", default="Hello again, this sentence was never recorded.")
    args = parser.parse_args()
    tiny = args.model is None
    path = checkpoint_path(args.model)
    gpu = torch.cuda.is_available()
    started = time.perf_counter()

    # 1. Data: encode every clip once with the codec (the 35B model is not loaded for this).
    data = args.data or write_stand_in_recordings(args.output / "stand-in-recordings")
    prepared = prepare_dataset(data, args.output / "prepared", path)
    for clip in prepared.skipped:
        print(f"skipped {clip.name}: {clip.reason}")
    held_out = max(1, math.ceil(0.1 * len(prepared.dataset)))
    split = prepared.dataset.train_test_split(test_size=held_out, seed=0)
    print(f"{len(split['train'])} training and {len(split['test'])} held-out examples")

    # 2. The model with LoRA adapters (the base weights stay frozen).
    # The routed experts dequantised at load: adapters on them (the "experts" preset) need full-precision tensors.
    model = AutoModel.from_pretrained(path, dtype=torch.bfloat16 if gpu else torch.float32,
                                      device_map="cuda" if gpu else None,
                                      quantization_config=BsgemmMoeConfig(dequantize=True))
    processor = AutoProcessor.from_pretrained(path)
    model = get_peft_model(model, drama3_lora_config(args.preset, r=args.rank, lora_alpha=2 * args.rank))
    model.print_trainable_parameters()

    # 3. Train with the transformers Trainer: labels are in the examples, the model returns the loss.
    training = TrainingArguments(
        output_dir=str(args.output / "checkpoints"),
        num_train_epochs=args.epochs,
        max_steps=args.max_steps or -1,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate or (2e-3 if tiny else 2e-4),
        lr_scheduler_type="cosine",
        warmup_steps=0 if tiny else 50,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=gpu,
        dataloader_pin_memory=gpu,
        logging_steps=1 if tiny else 10,
        eval_strategy="epoch",
        prediction_loss_only=True,  # the held-out loss; the logits are not kept
        save_strategy="no",
        report_to=[],
        **checkpointing_arguments(),
    )
    trainer = Trainer(model=model, args=training, train_dataset=split["train"], eval_dataset=split["test"],
                      data_collator=Drama3SpeechCollator())
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    print(f"held-out loss {before:.3f} -> {after:.3f}")

    # 4. Keep the adapter, and a merged checkpoint in the original layout (loads with or without this package).
    model.save_pretrained(args.output / "adapter")
    merged = model.merge_and_unload()
    merged.save_pretrained(args.output / "merged")
    processor.save_pretrained(args.output / "merged")

    # 5. Speak with the merged checkpoint, as any Drama 3 checkpoint.
    finetuned = AutoModel.from_pretrained(args.output / "merged", dtype=torch.bfloat16 if gpu else torch.float32,
                                          device_map="cuda" if gpu else None).eval()
    processor = AutoProcessor.from_pretrained(args.output / "merged")  # saved beside the weights
    inputs = processor(args.text)
    settings = {"max_new_tokens": 12} if tiny else {}  # the tiny checkpoint rarely stops by itself
    speech = finetuned.generate(**inputs, seed=0, **settings)
    processor.save_audio(speech.audio[0], args.output / "sample.wav")
    print(f"{args.output / 'sample.wav'}: {speech.audio[0].shape[0] / processor.sampling_rate:.2f} s; "
          f"finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
