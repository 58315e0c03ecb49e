"""A folder of recordings -> a `datasets` dataset of Drama 3 training examples, saved on disk (`drama3-prepare`).

Each example holds the frame rows inference uses, plus labels for `FishOmniForSpeech.forward`'s loss:

    rows   = prompt rows (Drama3Processor.build_prompt_rows: system turn, optional references, the transcript)
             + the clip's audio rows [semantic_start + c0, c0, ..., c9] + the end-of-speech row [<|im_end|>, 0, ...]
    labels = rows with main id -100 on the prompt rows

so the loss trains exactly what generation produces: the main token of every audio row and of the end-of-speech
row, and codebooks 1..9 of every audio row (docs/finetuning.md).

The codec encodes the clips in batches of similar length. Each clip's codes are kept in `OUT_DIR/codes/` as soon as
its batch is done, so an interrupted or repeated run encodes only what is missing. Clips that cannot be used are
listed with their reason in `OUT_DIR/skipped.tsv` (and returned), never silently dropped.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Array2D, Dataset, Features, Value, load_from_disk
from tqdm.auto import tqdm

from ..audio_io import audio_file_info, read_audio_file, resample_audio, write_atomically
from ..configuration_drama3 import FishOmniConfig
from ..device_placement import execution_device
from ..codec_file import CODEC_FILE, read_codec_file
from ..modeling_codec import FishDACCodec
from ..input_checks import IGNORE_INDEX
from ..processing_drama3 import Drama3Processor
from ..speaker_tags import MAX_SPEAKER_ID, SPEAKER_TAG, WHITE_SPACE
from .recordings import Recording, SkippedClip, find_recordings

DATASET_DIR = "dataset"
CODES_DIR = "codes"
SKIPPED_FILE = "skipped.tsv"
DEFAULT_MAX_SECONDS = 30.0


@dataclass
class PreparedDataset:
    """What `prepare_dataset` returns: the dataset (also saved in `path`), and the clips left out with their reasons."""

    dataset: Dataset
    skipped: list[SkippedClip]
    path: Path


def example_features(row_width: int) -> Features:
    """Columns of a prepared dataset: `input_ids` and `labels` `[rows, row_width]` (int32), the clip's `name`, the
    `text` spoken (with its speaker tag) and its length in `seconds`."""
    rows = Array2D(shape=(None, row_width), dtype="int32")
    return Features({"input_ids": rows, "labels": rows, "name": Value("string"), "text": Value("string"),
                     "seconds": Value("float32")})


def speech_example(prompt_rows: torch.Tensor, codes: torch.Tensor, semantic_start_id: int, eos_token_id: int) -> dict:
    """Training rows and labels of one clip.

    prompt_rows `[P, 1 + K]` (from `Drama3Processor.build_prompt_rows`), codes `[K, frames]` -> `input_ids` and
    `labels` `[P + frames + 1, 1 + K]`: the prompt, the audio rows, the end-of-speech row; labels are the rows with
    main id -100 on the prompt (those rows are given, not generated).
    """
    audio = torch.cat((codes[:1] + semantic_start_id, codes)).T  # [frames, 1 + K]
    end = prompt_rows.new_zeros(1, prompt_rows.shape[1])  # [1, 1 + K]
    end[0, 0] = eos_token_id
    rows = torch.cat((prompt_rows, audio.to(prompt_rows.dtype), end))  # [P + frames + 1, 1 + K]
    labels = rows.clone()
    labels[: prompt_rows.shape[0], 0] = IGNORE_INDEX
    return {"input_ids": rows, "labels": labels}


def load_codec_and_processor(model: str | os.PathLike, device: str | torch.device | None = None):
    """The codec (float32, eval mode, on `device`) and the processor of a Drama 3 checkpoint, without the 35B model.

    `model` is a checkpoint directory or a Hub repository id; for a Hub id only the config, tokenizer files and
    `codec.pth` are downloaded.
    """
    directory = Path(model)
    if not directory.is_dir():
        from huggingface_hub import snapshot_download

        directory = Path(snapshot_download(str(model), allow_patterns=["*.json", CODEC_FILE]))
    config = FishOmniConfig.from_pretrained(directory)
    state_dict = read_codec_file(str(directory), config.codec_config)
    codec = FishDACCodec.from_codec_state_dict(state_dict, config.codec_config)
    codec = codec.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    processor = Drama3Processor.from_pretrained(directory, codec=codec)
    return codec, processor


def prepare_dataset(
    data_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    model: str | os.PathLike | None = None,
    *,
    codec: FishDACCodec | None = None,
    processor: Drama3Processor | None = None,
    speaker: int = 0,
    references: Sequence[Any] = (),
    max_seconds: float = DEFAULT_MAX_SECONDS,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    show_progress: bool = True,
) -> PreparedDataset:
    """Encode the recordings of `data_dir` and save a training dataset in `out_dir/dataset`.

    Args:
        data_dir: the recordings (see `recordings.find_recordings` for the layouts).
        out_dir: where the dataset (`dataset/`, read it with `datasets.load_from_disk`), the codes cache (`codes/`),
            and the list of skipped clips (`skipped.tsv`) go. Running again with the same `out_dir` reuses the
            codes already encoded.
        model: checkpoint directory or Hub id whose codec and tokenizer to use (not needed when `codec` and
            `processor` are given, e.g. `model.codec` of a loaded model).
        speaker: speaker id 0..15 put in front of transcripts that do not start with a speaker tag (0, as in
            inference, by default).
        references: voice references put in every prompt, as `Drama3Processor` takes them (a `Drama3Voice`, or a
            dict with "transcript" and "audio" or "codes"); encoded once. Fine-tune with the references you will
            generate with.
        max_seconds: longer clips are skipped (the memory of a training step grows with the longest example).
        batch_size: clips per codec call (clips of similar length are batched together).
        device: where the codec runs when it is loaded here (default: CUDA if available, else the CPU).
        show_progress: a tqdm bar over the clips to encode.
    """
    if isinstance(speaker, bool) or not isinstance(speaker, int) or not 0 <= speaker <= MAX_SPEAKER_ID:
        raise ValueError(f"speaker must be an integer 0..{MAX_SPEAKER_ID}, got {speaker!r}")
    if not max_seconds > 0:
        raise ValueError(f"max_seconds must be positive, got {max_seconds!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if (codec is None) != (processor is None):
        raise ValueError("give both `codec` and `processor` (e.g. model.codec and the model's processor), or neither")
    if codec is None:
        if model is None:
            raise ValueError("give `model` (a checkpoint directory or Hub id), or `codec` and `processor`")
        codec, processor = load_codec_and_processor(model, device)
    out_dir = Path(out_dir)
    recordings, skipped = find_recordings(data_dir)
    if processor.codec is None:  # a processor without a codec encodes reference audio with this one
        processor = processor.with_codec(codec)
    voices = [_as_voice(reference, processor) for reference in references]
    processor.build_prompt_rows("<|speaker:0|> a", references=voices)  # a bad reference fails here, not per clip

    out_dir.mkdir(parents=True, exist_ok=True)
    _check_codes_cache(out_dir, codec)
    plans, refused = _plan(recordings, processor, voices, speaker, max_seconds)
    skipped += refused
    skipped += _encode_missing(plans, out_dir / CODES_DIR, codec, batch_size, show_progress)
    skipped.sort(key=lambda clip: clip.name)
    _write_skipped(out_dir / SKIPPED_FILE, skipped)

    ready = [plan for plan in plans if _codes_path(out_dir / CODES_DIR, plan.recording).is_file()]
    if not ready:
        raise ValueError(f"no usable clip in {str(data_dir)!r}: every clip was skipped (see {out_dir / SKIPPED_FILE})")
    dataset = _save_dataset(ready, out_dir, processor)
    return PreparedDataset(dataset=dataset, skipped=skipped, path=out_dir / DATASET_DIR)


# ------------------------------------------------------------------------------------------------------------------
# Checks made before any clip is encoded
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """A clip that passed the checks made from its transcript and its audio file's header."""

    recording: Recording
    text: str  # the transcript with its speaker tag
    prompt_rows: torch.Tensor  # [P, 1 + K]
    samples: int
    sampling_rate: int


def _as_voice(reference: Any, processor: Drama3Processor) -> Any:
    """A reference given as audio, encoded once into a `Drama3Voice`; other references as they are."""
    if isinstance(reference, dict) and reference.get("audio") is not None and reference.get("codes") is None:
        unknown = set(reference) - {"transcript", "audio", "sampling_rate"}
        if unknown:
            raise ValueError(
                f"a reference has unknown keys {sorted(unknown)}; use 'transcript', 'audio', 'sampling_rate'"
            )
        return processor.create_voice(reference.get("transcript"), reference["audio"], reference.get("sampling_rate"))
    return reference


def _tagged(text: str, speaker: int) -> str:
    """`text` with `<|speaker:N|> ` in front unless it starts with a speaker tag."""
    if SPEAKER_TAG.match(text.lstrip(WHITE_SPACE)):
        return text
    return f"<|speaker:{speaker}|> {text}"


def _plan(recordings, processor, voices, speaker, max_seconds) -> tuple[list[_Plan], list[SkippedClip]]:
    """Prompt rows and audio header of every recording; clips that cannot be used get a reason instead."""
    plans, skipped = [], []
    for recording in recordings:
        text = _tagged(recording.transcript, speaker)
        try:
            processor.check_text(recording.transcript, "the transcript")  # positions in the transcript as written
            prompt = processor.build_prompt_rows(text, references=voices)
        except ValueError as error:
            skipped.append(SkippedClip(recording.name, f"unusable transcript: {error}"))
            continue
        try:
            samples, rate = audio_file_info(recording.audio_path, recording.name)
        except (OSError, ValueError) as error:
            skipped.append(SkippedClip(recording.name, f"unreadable audio: {error}"))
            continue
        if samples == 0:
            skipped.append(SkippedClip(recording.name, "empty audio: the file holds no samples"))
        elif samples / rate > max_seconds:
            reason = f"too long: {samples / rate:.1f} s > max_seconds = {max_seconds:g} s"
            skipped.append(SkippedClip(recording.name, reason))
        else:
            plans.append(_Plan(recording, text, prompt, samples, rate))
    return plans, skipped


# ------------------------------------------------------------------------------------------------------------------
# Encoding, with a codes cache
# ------------------------------------------------------------------------------------------------------------------


def codec_fingerprint(codec: FishDACCodec) -> str:
    """sha256 of the codec's weights and config: codes in a cache made by another codec must not be reused."""
    digest = hashlib.sha256(json.dumps(codec.config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in sorted(codec.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _check_codes_cache(out_dir: Path, codec: FishDACCodec) -> None:
    """Create `codes/` for this codec, or check that the existing one was made by it."""
    codes_dir = out_dir / CODES_DIR
    stamp = codes_dir / "codec.sha256"
    fingerprint = codec_fingerprint(codec)
    if stamp.is_file():
        if stamp.read_text().strip() != fingerprint:
            raise ValueError(
                f"{codes_dir} holds codes made by another codec (another checkpoint): prepare into a new OUT_DIR, "
                "or delete that folder to encode everything again"
            )
        return
    codes_dir.mkdir(exist_ok=True)
    write_atomically(stamp, lambda f: f.write(fingerprint.encode()))


def _codes_path(codes_dir: Path, recording: Recording) -> Path:
    """Cache file of a clip's codes: named after the clip, its audio file's size and modification time, so that a
    changed file is encoded again."""
    stat = recording.audio_path.stat()
    key = hashlib.sha256(f"{recording.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    return codes_dir / f"{key}.npy"


def _encode_missing(plans: list[_Plan], codes_dir: Path, codec: FishDACCodec, batch_size: int,
                    show_progress: bool) -> list[SkippedClip]:
    """Encode the clips without cached codes, shortest first in batches; return the clips whose samples are unusable."""
    missing = sorted((plan for plan in plans if not _codes_path(codes_dir, plan.recording).is_file()),
                     key=lambda plan: plan.samples / plan.sampling_rate)
    skipped = []
    with tqdm(total=len(missing), unit="clip", desc="encoding", disable=not show_progress) as bar:
        for start in range(0, len(missing), batch_size):
            batch = []
            for plan in missing[start : start + batch_size]:
                audio, reason = _read_clip(plan, codec.config.sample_rate)
                if reason is None:
                    batch.append((plan, audio))
                else:
                    skipped.append(SkippedClip(plan.recording.name, reason))
            for (plan, _), codes in zip(batch, encode_clips(codec, [audio for _, audio in batch]) if batch else []):
                array = codes.numpy().astype(np.int16)  # [K, frames]; codebook ids < 2^15
                write_atomically(_codes_path(codes_dir, plan.recording), lambda f, a=array: np.save(f, a))
            bar.update(len(missing[start : start + batch_size]))
    return skipped


def _read_clip(plan: _Plan, sample_rate: int) -> tuple[torch.Tensor | None, str | None]:
    """Mono float32 samples `[L]` at the codec's rate, or the reason the clip cannot be used."""
    try:
        samples, rate = read_audio_file(plan.recording.audio_path, plan.recording.name)
    except (RuntimeError, ValueError, OSError) as error:  # soundfile's errors are RuntimeErrors
        return None, f"unreadable audio: {error}"
    if not np.isfinite(samples).all():
        return None, "unreadable audio: the samples contain NaN or infinite values"
    if not np.any(samples):
        return None, "empty audio: every sample is zero"
    return resample_audio(torch.from_numpy(samples), rate, sample_rate), None


def encode_clips(codec: FishDACCodec, clips: list[torch.Tensor]) -> list[torch.Tensor]:
    """Codes `[K, ceil(L_i / frame_length)]` of mono clips `[L_i]` at the codec's sample rate, in one codec call.

    The clips are right-padded with zeros to a common length. Every codec block is causal, so a frame's codes depend
    only on samples up to its end and padding after a clip does not change its codes.
    """
    if not clips:
        return []
    frame = codec.config.frame_length
    batch = torch.zeros(len(clips), max(clip.shape[0] for clip in clips))  # [B, L]
    for index, clip in enumerate(clips):
        batch[index, : clip.shape[0]] = clip
    audio = batch[:, None].to(execution_device(codec))  # [B, 1, L]: the codec's [batch, channels, samples]
    codes = codec.encode(audio, codec.config.sample_rate).audio_codes.cpu()  # [B, K, frames]
    return [codes[index, :, : math.ceil(clip.shape[0] / frame)] for index, clip in enumerate(clips)]


# ------------------------------------------------------------------------------------------------------------------
# Output files
# ------------------------------------------------------------------------------------------------------------------


def _examples(plans: list[_Plan], codes_dir: str, semantic_start_id: int, eos_token_id: int) -> Iterator[dict]:
    for plan in plans:
        codes = torch.from_numpy(np.load(_codes_path(Path(codes_dir), plan.recording)).astype(np.int64))
        example = speech_example(plan.prompt_rows, codes, semantic_start_id, eos_token_id)
        yield {"input_ids": example["input_ids"].int().numpy(), "labels": example["labels"].int().numpy(),
               "name": plan.recording.name, "text": plan.text, "seconds": plan.samples / plan.sampling_rate}


def _save_dataset(plans: list[_Plan], out_dir: Path, processor: Drama3Processor) -> Dataset:
    """Write the examples to `out_dir/dataset` (replacing an older one only once the new one is complete)."""
    final = out_dir / DATASET_DIR
    staging = Path(tempfile.mkdtemp(prefix=".dataset-", dir=out_dir))
    try:
        dataset = Dataset.from_generator(
            _examples,
            features=example_features(processor.row_width),
            gen_kwargs={"plans": plans, "codes_dir": str(out_dir / CODES_DIR),
                        "semantic_start_id": processor.semantic_start_id, "eos_token_id": processor.eos_token_id},
            cache_dir=str(staging / "cache"),
        )
        dataset.save_to_disk(str(staging / DATASET_DIR))
        del dataset
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging / DATASET_DIR, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return load_from_disk(str(final))


def _write_skipped(path: Path, skipped: list[SkippedClip]) -> None:
    text = io.StringIO()
    writer = csv.writer(text, delimiter="\t", lineterminator="\n")
    writer.writerow(["clip", "reason"])
    writer.writerows((clip.name, " ".join(clip.reason.split())) for clip in skipped)
    write_atomically(path, lambda f: f.write(text.getvalue().encode()))


__all__ = [
    "DEFAULT_MAX_SECONDS", "PreparedDataset", "codec_fingerprint", "encode_clips", "example_features",
    "load_codec_and_processor", "prepare_dataset", "speech_example",
]
