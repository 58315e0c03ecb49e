"""Fine-tuning: data preparation (`drama3-prepare`), the collator, LoRA presets with peft, the Trainer, gradient
checkpointing, merging and saving in the original layout.

Everything runs on the golden tiny checkpoint with synthetic recordings made here (sine sweeps plus noise).
Tolerances: outputs of the same weights computed in another order (a padded batch against single examples, a merged
LoRA weight `W + s B A` against `x W + s (x A) B`) differ by float32 rounding only; main logits are compared with
the forward tests' self-consistency atol of 1e-4 and codebook logits with the golden README's 2e-3 (the random tiny
tower amplifies float32 noise about 20 times more than the backbone does), far below the O(0.1-1) change of any
wrong row, mask or weight.
"""

import copy
import csv
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import soundfile
import torch
from peft import PeftModel, get_peft_model
from safetensors import safe_open
from transformers import Trainer, TrainingArguments

from transformers_drama3 import Drama3Processor, FishOmniForSpeech
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig
from transformers_drama3.training import (
    LORA_PRESETS,
    Drama3SpeechCollator,
    checkpointing_arguments,
    disable_checkpointing,
    drama3_lora_config,
    enable_checkpointing,
    find_recordings,
    prepare_dataset,
)
from transformers_drama3.training import cli as prepare_cli
from transformers_drama3.training import prepare as prepare_module

from .conftest import GOLDEN_TINY

# Fine-tuning needs the routed experts dequantised at load (kept FP8 experts are frozen; docs/finetuning.md).
DEQUANTISED = BsgemmMoeConfig(dequantize=True)

MAIN_ATOL, CODEBOOK_ATOL = 1e-4, 2e-3
GOOD_CLIPS = {  # name -> (transcript, seconds, sampling rate, transcript suffix)
    "a.wav": ("Hello there, how are you today?", 0.30, 24000, ".txt"),
    "b.flac": ("The quick brown fox jumps over the lazy dog.", 0.45, 44100, ".lab"),
    "c.wav": ("Did you hear that?", 0.25, 16000, ".txt"),
    "sub/d.wav": ("<|speaker:3|> Good morning, everyone.", 0.40, 22050, ".txt"),
    "e.wav": ("Nice to meet you.", 0.35, 24000, ".txt"),
    "f.wav": ("Thanks for waiting, we can start now.", 0.50, 24000, ".txt"),
}
BAD_CLIPS = {  # name -> a word its reason must contain
    "broken.wav": "unreadable",
    "empty.wav": "empty",
    "silent.wav": "empty",
    "long.wav": "too long",
    "untitled.wav": "no transcript",
    "blank.wav": "transcript missing",
    "control.wav": "control token '<|im_end|>' (at character 4)",  # where it is in the transcript file
}
MAX_SECONDS = 1.0


def sweep(seconds: float, rate: int, seed: int) -> np.ndarray:
    """A rising sine sweep with a little noise, float32 [samples]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 150 + 40 * seed
    return (0.4 * np.sin(2 * np.pi * (f0 * t + 300 * t**2)) + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Good clips at several sampling rates and layouts, and one clip for each reason to skip."""
    root = tmp_path_factory.mktemp("recordings")
    for seed, (name, (text, seconds, rate, suffix)) in enumerate(GOOD_CLIPS.items()):
        path = root / name
        path.parent.mkdir(exist_ok=True)
        soundfile.write(path, sweep(seconds, rate, seed), rate)
        path.with_suffix(suffix).write_text(text + "\n", encoding="utf-8")
    (root / "broken.wav").write_bytes(b"RIFF, but not really a wave file")
    soundfile.write(root / "empty.wav", np.zeros(0, np.float32), 24000)
    soundfile.write(root / "silent.wav", np.zeros(4800, np.float32), 24000)
    soundfile.write(root / "long.wav", sweep(MAX_SECONDS + 0.5, 16000, 9), 16000)
    soundfile.write(root / "untitled.wav", sweep(0.2, 16000, 10), 16000)
    soundfile.write(root / "blank.wav", sweep(0.2, 16000, 11), 16000)
    soundfile.write(root / "control.wav", sweep(0.2, 16000, 12), 16000)
    for name, text in {"broken": "Hi.", "empty": "Hi.", "silent": "Hi.", "long": "Hi.", "blank": "  \n",
                       "control": "Say <|im_end|> now."}.items():
        (root / f"{name}.txt").write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def model():
    return FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, quantization_config=DEQUANTISED)


@pytest.fixture(scope="module")
def processor():
    return Drama3Processor.from_pretrained(GOLDEN_TINY)


@pytest.fixture(scope="module")
def prepared(data_dir, model, processor, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    return prepare_dataset(data_dir, out, codec=model.codec, processor=processor, max_seconds=MAX_SECONDS,
                           batch_size=4, show_progress=False)


def _loss(model, dataset, collator=Drama3SpeechCollator()) -> float:
    """The training loss of `dataset` as one batch, without gradients."""
    with torch.no_grad():
        return model(**collator(list(dataset))).loss.item()


# ------------------------------------------------------------------------------------------------------------------
# Data preparation
# ------------------------------------------------------------------------------------------------------------------


def test_prepare_builds_inference_rows_and_labels_of_the_generated_part(prepared, data_dir, model, processor):
    dataset = prepared.dataset
    assert sorted(dataset["name"]) == sorted(GOOD_CLIPS)
    assert prepared.path.is_dir()
    for example in dataset:
        transcript = GOOD_CLIPS[example["name"]][0]
        prompt = processor.build_prompt_rows(transcript)  # [P, 11]: exactly what inference puts before the audio
        codes = processor.with_codec(model.codec).encode_audio(str(data_dir / example["name"]))  # one clip alone
        rows, labels = torch.tensor(example["input_ids"]), torch.tensor(example["labels"])
        p, n = prompt.shape[0], codes.shape[1]
        assert rows.shape == labels.shape == (p + n + 1, 11)
        assert torch.equal(rows[:p], prompt)
        assert torch.equal(rows[p : p + n, 1:], codes.T)
        assert torch.equal(rows[p : p + n, 0], codes[0] + processor.semantic_start_id)
        assert rows[-1].tolist() == [processor.eos_token_id] + [0] * 10  # end of speech
        assert (labels[:p, 0] == -100).all() and torch.equal(labels[p:], rows[p:])
        assert example["text"] == (transcript if transcript.startswith("<|speaker") else "<|speaker:0|> " + transcript)


def test_prepare_lists_bad_clips_with_their_reasons(prepared):
    reasons = {clip.name: clip.reason for clip in prepared.skipped}
    assert set(reasons) == set(BAD_CLIPS)
    for name, word in BAD_CLIPS.items():
        assert word in reasons[name], reasons[name]
    with open(prepared.path.parent / "skipped.tsv", newline="", encoding="utf-8") as file:
        listed = {row["clip"]: row["reason"] for row in csv.DictReader(file, delimiter="\t")}
    assert listed == reasons


def test_a_second_run_resumes_without_encoding_again(prepared, data_dir, model, processor, monkeypatch, tmp_path):
    def run():
        return prepare_dataset(data_dir, tmp_path, codec=model.codec, processor=processor, max_seconds=MAX_SECONDS,
                               batch_size=4, show_progress=False)

    encoded = []
    encode = prepare_module.encode_clips
    monkeypatch.setattr(prepare_module, "encode_clips",
                        lambda codec, clips: encoded.append(len(clips)) or encode(codec, clips))
    run()
    assert sum(encoded) == len(GOOD_CLIPS) and max(encoded) <= 4  # batched (silent.wav is dropped once read)
    encoded.clear()
    again = run()
    assert encoded == []
    assert again.dataset["input_ids"] == prepared.dataset["input_ids"]

    # An interrupted run keeps what it encoded: only the clip whose codes are missing is encoded again.
    cached = sorted((tmp_path / "codes").glob("*.npy"))
    assert len(cached) == len(GOOD_CLIPS)
    cached[0].unlink()
    again = run()
    assert encoded == [1]
    assert again.dataset["input_ids"] == prepared.dataset["input_ids"]


def test_codes_of_another_codec_are_not_reused(prepared, data_dir, model, processor):
    other = copy.deepcopy(model.codec)
    with torch.no_grad():
        other.decoder.output_conv.weight.add_(0.01)
    with pytest.raises(ValueError, match="another codec"):
        prepare_dataset(data_dir, prepared.path.parent, codec=other, processor=processor, show_progress=False)


def test_speaker_tags_and_references_are_put_in_every_prompt(data_dir, model, processor, tmp_path):
    reference = {"transcript": "This is my voice.", "audio": str(data_dir / "a.wav")}
    result = prepare_dataset(data_dir, tmp_path, codec=model.codec, processor=processor, speaker=2,
                             references=[reference], max_seconds=MAX_SECONDS, show_progress=False)
    voice = processor.with_codec(model.codec).create_voice(reference["transcript"], reference["audio"])
    for example in result.dataset:
        transcript = GOOD_CLIPS[example["name"]][0]
        expected_text = transcript if transcript.startswith("<|speaker") else "<|speaker:2|> " + transcript
        prompt = processor.build_prompt_rows(expected_text, references=[voice])
        assert example["text"] == expected_text
        assert torch.equal(torch.tensor(example["input_ids"])[: prompt.shape[0]], prompt)
        # The references are given, not learned.
        assert (torch.tensor(example["labels"])[: prompt.shape[0], 0] == -100).all()


def test_metadata_csv_in_the_ljspeech_layout(tmp_path):
    (tmp_path / "wavs").mkdir()
    for name in ("LJ001-0001", "LJ001-0002", "LJ001-0003"):
        soundfile.write(tmp_path / "wavs" / f"{name}.wav", sweep(0.2, 22050, 0), 22050)
    (tmp_path / "metadata.csv").write_text(
        "LJ001-0001|Printing, in the 1st sense|Printing, in the first sense\n"
        'LJ001-0002|He said "no" twice.\n'
        "LJ001-0003|\n"
        "LJ009-9999|No such recording.\n"
        "LJ001-0002|Listed again.\n",
        encoding="utf-8",
    )
    recordings, skipped = find_recordings(tmp_path)
    assert [(r.name, r.transcript) for r in recordings] == [
        ("LJ001-0001", "Printing, in the first sense"),  # the normalised column when there is one
        ("LJ001-0002", 'He said "no" twice.'),
    ]
    assert recordings[0].audio_path == tmp_path / "wavs" / "LJ001-0001.wav"
    assert [(s.name, s.reason.split(":")[0]) for s in skipped] == [
        ("LJ001-0002", "listed twice in metadata.csv"), ("LJ001-0003", "transcript missing"),
        ("metadata.csv line 4: LJ009-9999", "audio file not found"),
    ]


def test_bad_arguments_fail_before_any_work(data_dir, model, processor, tmp_path):
    with pytest.raises(ValueError, match="speaker must be an integer 0..15"):
        prepare_dataset(data_dir, tmp_path, codec=model.codec, processor=processor, speaker=16)
    with pytest.raises(ValueError, match="give `model`"):
        prepare_dataset(data_dir, tmp_path)
    with pytest.raises(ValueError, match="give both"):
        prepare_dataset(data_dir, tmp_path, codec=model.codec)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_dataset(tmp_path / "missing", tmp_path, codec=model.codec, processor=processor)
    with pytest.raises(ValueError, match="no 'transcript'|must be a string"):
        prepare_dataset(data_dir, tmp_path, codec=model.codec, processor=processor,
                        references=[{"codes": torch.zeros(10, 3, dtype=torch.long)}])
    assert not any(tmp_path.iterdir())  # nothing written


def test_the_command_prepares_and_reports(data_dir, tmp_path, capsys):
    status = prepare_cli.main([str(data_dir), str(tmp_path), "--model", str(GOLDEN_TINY), "--max-seconds",
                               str(MAX_SECONDS), "--device", "cpu"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert f"{len(GOOD_CLIPS)} examples" in err and f"{len(BAD_CLIPS)} clips skipped" in err
    assert (tmp_path / "dataset").is_dir() and (tmp_path / "skipped.tsv").is_file()
    assert prepare_cli.main([str(tmp_path / "nowhere"), str(tmp_path), "--model", str(GOLDEN_TINY)]) == 1
    assert "drama3-prepare: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        prepare_cli.main([str(data_dir), str(tmp_path), "--model", "x", "--reference", "r.wav"])
    assert usage.value.code == 2


# ------------------------------------------------------------------------------------------------------------------
# Collator
# ------------------------------------------------------------------------------------------------------------------


def test_collator_left_pads_and_a_padded_batch_computes_what_each_example_does(prepared, model):
    examples = [prepared.dataset[i] for i in range(3)]
    batch = Drama3SpeechCollator(pad_to_multiple_of=8)(examples)
    lengths = [len(example["input_ids"]) for example in examples]
    rows = batch["input_ids"].shape[1]
    assert rows % 8 == 0 and rows >= max(lengths)
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for index, length in enumerate(lengths):
        pad = rows - length
        assert (batch["attention_mask"][index, :pad] == 0).all() and (batch["labels"][index, :pad, 0] == -100).all()
        assert (batch["input_ids"][index, :pad] == 0).all()
        assert batch["labels"][index, pad:].tolist() == examples[index]["labels"]
    with torch.no_grad():
        together = model(**batch)
        for index, length in enumerate(lengths):
            alone = model(**Drama3SpeechCollator()([examples[index]]))
            torch.testing.assert_close(together.main_logits[index, -length:], alone.main_logits[0],
                                       atol=MAIN_ATOL, rtol=0)
            torch.testing.assert_close(together.codebook_logits[index, -length + 1 :], alone.codebook_logits[0, 1:],
                                       atol=CODEBOOK_ATOL, rtol=0)


def test_collator_refuses_mismatched_examples():
    with pytest.raises(ValueError, match="shape of input_ids"):
        Drama3SpeechCollator()([{"input_ids": [[1] + [0] * 10] * 3, "labels": [[1] + [0] * 10] * 2}])
    with pytest.raises(KeyError, match="labels"):
        Drama3SpeechCollator()([{"input_ids": [[1] + [0] * 10]}])
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        Drama3SpeechCollator(pad_to_multiple_of=0)


# ------------------------------------------------------------------------------------------------------------------
# LoRA, Trainer, checkpointing, merging
# ------------------------------------------------------------------------------------------------------------------


def _fresh_model():
    return FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32, quantization_config=DEQUANTISED)


def test_presets_adapt_backbone_and_tower_but_never_the_codec(prepared, model):
    peft_model = get_peft_model(_fresh_model(), drama3_lora_config("experts"))
    adapted = {name.rsplit(".lora_", 1)[0] for name, _ in peft_model.named_parameters() if ".lora_" in name}
    assert not any(".codec." in name for name in adapted)
    assert any(".tower.heads." in name for name in adapted) and any(".tower.shared_layers." in name for name in adapted)
    assert any("mlp.shared_expert.down_proj" in name for name in adapted)
    assert any("self_attn.q_proj" in name for name in adapted)
    assert any("linear_attn.in_proj_qkv" in name for name in adapted)
    assert any("mlp.experts" in name for name in adapted)  # the fused 3-D expert tensors
    trainable = {name for name, parameter in peft_model.named_parameters() if parameter.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)

    # LoRA B starts at zero: the adapted model computes exactly what the base model does.
    batch = Drama3SpeechCollator()([prepared.dataset[i] for i in range(3)])
    with torch.no_grad():
        base, adapted_out = model(**batch), peft_model(**batch)
    assert torch.equal(base.main_logits, adapted_out.main_logits)
    assert torch.equal(base.codebook_logits, adapted_out.codebook_logits)
    assert torch.equal(base.loss, adapted_out.loss)

    assert peft_model.get_input_embeddings() is peft_model.get_base_model().backbone.embed_tokens
    small = get_peft_model(_fresh_model(), drama3_lora_config("attention"))
    assert not any("tower" in name or "expert" in name for name, _ in small.named_parameters() if ".lora_" in name)


def test_preset_errors():
    with pytest.raises(ValueError, match="unknown LoRA preset"):
        drama3_lora_config("everything")
    with pytest.raises(ValueError, match="lora_dropout=0"):
        drama3_lora_config("experts", lora_dropout=0.1)
    with pytest.raises(ValueError, match="comes from the preset"):
        drama3_lora_config(target_modules=["wqkv"])
    assert set(LORA_PRESETS) == {"attention", "default", "experts"}


def test_checkpointing_recomputes_layers_and_gives_the_same_gradients(prepared):
    """The backbone's decoder layers and the tower's layers run again during backward, and the gradients do not
    change: the recomputation runs the same kernels on the same inputs, so only the order in which autograd adds up
    gradient contributions may differ (float32 rounding of each gradient's own size: rtol 1e-5)."""
    peft_model = get_peft_model(_fresh_model(), drama3_lora_config("experts", init_lora_weights=False))
    peft_model.train()
    batch = Drama3SpeechCollator()([prepared.dataset[i] for i in range(3)])
    inner = peft_model.get_base_model()
    runs = {"backbone": 0, "tower": 0}
    inner.backbone.layers[0].mlp.register_forward_pre_hook(
        lambda *_: runs.__setitem__("backbone", runs["backbone"] + 1))
    inner.tower.residual_layers[0].transformer_layer.register_forward_pre_hook(
        lambda *_: runs.__setitem__("tower", runs["tower"] + 1))

    def gradients():
        peft_model.zero_grad(set_to_none=True)
        runs.update(backbone=0, tower=0)
        peft_model(**batch).loss.backward()
        return {name: p.grad.clone() for name, p in peft_model.named_parameters() if p.requires_grad}, dict(runs)

    plain, plain_runs = gradients()
    enable_checkpointing(peft_model)
    checkpointed, checkpointed_runs = gradients()
    disable_checkpointing(peft_model)
    assert plain_runs == {"backbone": 1, "tower": 1} and checkpointed_runs == {"backbone": 2, "tower": 2}
    assert plain.keys() == checkpointed.keys()
    for name, gradient in plain.items():
        torch.testing.assert_close(checkpointed[name], gradient, rtol=1e-5, atol=1e-5 * gradient.abs().max().item())


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """A LoRA model ("experts" preset) after 5 Trainer steps with checkpointing, and its loss before and after."""
    peft_model = get_peft_model(_fresh_model(), drama3_lora_config("experts"))
    before = _loss(peft_model, prepared.dataset)
    arguments = TrainingArguments(
        output_dir=str(tmp_path_factory.mktemp("run")), max_steps=5, per_device_train_batch_size=2,
        learning_rate=2e-3, warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        seed=0, **checkpointing_arguments(),
    )
    trainer = Trainer(model=peft_model, args=arguments, train_dataset=prepared.dataset,
                      data_collator=Drama3SpeechCollator())
    trainer.train()
    peft_model.eval()
    return peft_model, before, _loss(peft_model, prepared.dataset), trainer


def test_five_trainer_steps_lower_the_training_loss(trained):
    peft_model, before, after, trainer = trained
    assert trainer.state.global_step == 5
    assert all(entry["loss"] > 0 for entry in trainer.state.log_history if "loss" in entry)
    assert after < before - 0.1, (before, after)  # a real step down, not rounding


def test_merged_model_matches_adapters_and_saves_in_the_original_layout(trained, prepared, processor, tmp_path):
    peft_model, *_ = trained
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    peft_model.save_pretrained(adapter_dir)
    batch = Drama3SpeechCollator()([prepared.dataset[i] for i in range(3)])
    prompt = processor("Nice to meet you.")["input_ids"]  # [1, T, 11]
    with torch.no_grad():
        adapted = peft_model(**batch)
        adapted_frames = peft_model.generate(prompt, do_sample=False, max_new_tokens=6, output_audio=False).sequences

    # The adapter alone loads onto a fresh base model and generates the same frames.
    base = _fresh_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # peft reads `is_gradient_checkpointing`: no deprecation note
        assert not base.is_gradient_checkpointing
        base.backbone.gradient_checkpointing = True  # what enabling it sets (the method's name differs by version)
        assert base.is_gradient_checkpointing
        base.backbone.gradient_checkpointing = False
        loaded = PeftModel.from_pretrained(base, adapter_dir).eval()
    assert torch.equal(loaded.generate(prompt, do_sample=False, max_new_tokens=6, output_audio=False).sequences,
                       adapted_frames)

    merged = loaded.merge_and_unload()  # the adapter as saved and loaded, folded into the weights
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert merged.backbone.layers[0].mlp.experts.gate_up_proj.dim() == 3
    with torch.no_grad():
        out = merged(**batch)
    torch.testing.assert_close(out.main_logits, adapted.main_logits, atol=MAIN_ATOL, rtol=0)
    torch.testing.assert_close(out.codebook_logits, adapted.codebook_logits, atol=CODEBOOK_ATOL, rtol=0)

    merged.save_pretrained(merged_dir)
    original = json.loads((GOLDEN_TINY / "model.safetensors.index.json").read_text())["weight_map"]
    saved = set()
    for shard in merged_dir.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as file:
            saved.update(file.keys())
    assert saved == {name for name in original if not name.endswith("_scale_inv")}  # original names, per expert
    reloaded, info = FishOmniForSpeech.from_pretrained(merged_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        merged_frames = merged.generate(prompt, do_sample=False, max_new_tokens=6, output_audio=False).sequences
        assert torch.equal(reloaded.generate(prompt, do_sample=False, max_new_tokens=6, output_audio=False).sequences,
                           merged_frames)
        assert torch.equal(reloaded(**batch).main_logits, out.main_logits)


def test_drama3_prepare_imports_neither_peft_nor_bitsandbytes():
    """bitsandbytes prints a line about its CPU kernels when imported (peft imports it): `drama3-prepare` and the
    dataset side of `transformers_drama3.training` never import them (the LoRA names, which this module imports
    at its top, load them on first use)."""
    script = (
        "import sys\nfrom transformers_drama3.training import cli, prepare_dataset\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('loaded:', sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "loaded: []" in result.stdout and "usage: drama3-prepare" in result.stdout, result.stdout + result.stderr
