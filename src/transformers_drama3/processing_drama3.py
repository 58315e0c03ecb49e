"""Drama3Processor: text (+ voice references) -> Drama 3 prompt frame rows, and frames -> audio files.

The prompt follows `reference-bracket-v1` (docs/processor.md). Every literal segment is tokenized on its own, without
special-token insertion, because tokenizing the joined string changes ids at the seams. A prompt is a sequence
of frame rows of width `1 + num_codebooks`: a text row is `[token_id, 0, ..., 0]`, an audio row is
`[semantic_start + c0, c0, ..., c9]`.

Caller text (the text to speak, reference transcripts, history turns) can never become a control token other
than a valid speaker tag `<|speaker:0|>`..`<|speaker:15|>`: such text is refused by a string check and the
token ids of every caller segment are checked again after tokenization.

The texts and every reference of a request (its file header or array, its length) are checked before any audio is
encoded, and the prompt's length (`max_prompt_rows`) before it reaches a model. Long text is split by
`chunking.split_text` into chunks that each start with their speaker tag; a chunk is generated with earlier chunks
as `history` turns. Audio files are read and written by `audio_io`.
"""

from __future__ import annotations

import copy
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature
from transformers.processing_utils import ProcessorMixin
from transformers.utils import logging

from .audio_io import (
    audio_file_header,
    audio_file_name,
    audio_value,
    check_audio_layout,
    check_sampling_rate,
    read_audio_file,
    write_audio,
)
from .chunking import split_text
from .codes import check_codes
from .frame_rows import left_pad_rows  # noqa: F401  (its home is frame_rows.py; imported from here before)
from .speaker_tags import MAX_SPEAKER_ID, SPEAKER_TAG, WHITE_SPACE, tag_text, tag_transcript
from .voice import Drama3Voice

logger = logging.get_logger(__name__)

STRUCTURAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|voice|>", "<|text|>", "<|interleave|>")
SEMANTIC_PREFIX = "<|semantic:"
SEMANTIC_START_TOKEN = "<|semantic:0|>"
END_OF_SPEECH_TOKEN = "<|im_end|>"

# Literal segments of reference-bracket-v1 (docs/processor.md), in prompt order.
SYSTEM_START = "<|im_start|>system\n"
INSTRUCTION = "convert the provided text to speech"
REFERENCE_INSTRUCTION = "convert the provided text to speech reference to the following:"
TURN_END = "<|im_end|>\n"
USER_START = "<|im_start|>user\n"
VOICE_START = "<|im_start|>assistant\n<|voice|>"


NO_CODEC = ("needs the codec: give the processor the model's (Drama3Processor.from_pretrained(path, codec=model.codec), "
            "or processor.codec = model.codec)")


def _reference_segment(number: int, transcript: str) -> str:
    return f"\n\n[Reference {number}]\nText: {transcript}\nSpeech: "


class Drama3Processor(ProcessorMixin):
    r"""Builds Drama 3 prompts (`reference-bracket-v1`) and turns generated frames into audio files.

    Args:
        tokenizer: the checkpoint's fast tokenizer; the semantic band, `<|im_end|>` and the speaker tags are read
            from it, so the processor works without the model config.
        num_codebooks: codec codes per frame (10 for Drama 3); frame rows are `1 + num_codebooks` wide.
        sampling_rate: sample rate of the codec's audio (44100), the default of `save_audio`.
        frame_length: audio samples per codec frame (2048); used for the reference length limit.
        max_reference_seconds: longest accepted reference (60 s, the serving limit); 10-30 s works best.
        max_prompt_rows: longest accepted prompt, in frame rows (8192, the serving limit): references, history
            and text together.
        codec: the model's codec (`model.codec`), which turns reference audio into codes (`encode_audio`) and frames
            into audio (`frames_to_audio`); only those two need it. Not saved with the processor: its weights are
            the model's (`codec.pth`). Give it here, to `from_pretrained(path, codec=model.codec)`, or set
            `processor.codec = model.codec`.

    Call it as `processor(text, references=None, history=None, return_tensors="pt")`.
    """

    def __init__(
        self,
        tokenizer,
        num_codebooks: int = 10,
        sampling_rate: int = 44100,
        frame_length: int = 2048,
        max_reference_seconds: float = 60.0,
        max_prompt_rows: int = 8192,
        codec: Any = None,
    ):
        super().__init__(tokenizer)
        self.codec = codec
        self.num_codebooks = num_codebooks
        self.sampling_rate = sampling_rate
        self.frame_length = frame_length
        self.max_reference_seconds = max_reference_seconds
        self.max_prompt_rows = max_prompt_rows
        self._read_token_ids()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, codec: Any = None, **kwargs) -> Drama3Processor:
        """transformers' `ProcessorMixin.from_pretrained`, then `codec` (the model's) attached: it must reach neither
        the tokenizer's keywords nor any saved config."""
        processor = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        processor.codec = codec
        return processor

    def to_dict(self) -> dict[str, Any]:
        """transformers' processor config, without the codec (the model's weights, never copied or saved here)."""
        without_codec = object.__new__(type(self))
        without_codec.__dict__ = {key: value for key, value in self.__dict__.items() if key != "codec"}
        return ProcessorMixin.to_dict(without_codec)

    def with_codec(self, codec: Any) -> Drama3Processor:
        """This processor with `codec`: a shallow copy (the tokenizer is shared), `self` left as it is."""
        bound = copy.copy(self)
        bound.codec = codec
        return bound

    def _read_token_ids(self) -> None:
        """Find the semantic band, end of speech and speaker tags in the tokenizer, and the ids to refuse."""
        vocab = self.tokenizer.get_vocab()

        def token_id(token: str) -> int:
            if token not in vocab:
                raise ValueError(f"the tokenizer has no {token} token: it is not a Drama 3 tokenizer")
            return vocab[token]

        self.semantic_start_id = token_id(SEMANTIC_START_TOKEN)
        count = 1
        while vocab.get(f"<|semantic:{count}|>") == self.semantic_start_id + count:
            count += 1
        self.semantic_vocab_size = count
        self.eos_token_id = token_id(END_OF_SPEECH_TOKEN)
        self.speaker_token_ids = {token_id(f"<|speaker:{n}|>") for n in range(MAX_SPEAKER_ID + 1)}
        special = {i for i, token in self.tokenizer.added_tokens_decoder.items() if token.special}
        self._refused_ids = (special | set(self.tokenizer.all_special_ids)) - self.speaker_token_ids
        # Special tokens outside the semantic band: refused as strings too (the band is refused by its prefix).
        self._refused_strings = sorted(
            self.tokenizer.convert_ids_to_tokens(i)
            for i in self._refused_ids
            if not self.semantic_start_id <= i < self.semantic_start_id + count
        )

    @property
    def row_width(self) -> int:
        return 1 + self.num_codebooks

    # -- safe text -------------------------------------------------------------------------------------------

    def check_text(self, text: str, where: str = "text") -> None:
        """Raise unless `text` is non-empty caller text with no control token other than valid speaker tags."""
        if not isinstance(text, str):
            raise TypeError(f"{where} must be a string; got {type(text).__name__}")
        if not text.strip(WHITE_SPACE):
            raise ValueError(f"{where} is empty or only white space: {text!r}")
        for marker in (*STRUCTURAL_TOKENS, SEMANTIC_PREFIX, *self._refused_strings):
            position = text.find(marker)
            if position >= 0:
                quoted = _excerpt(text, position) if marker.startswith("<|") else marker
                raise ValueError(
                    f"{where} contains the control token {quoted!r} (at character {position}); "
                    f"control tokens are written by the processor and are not allowed in caller text"
                )
        for match in re.finditer(r"<\|speaker", text):
            if not SPEAKER_TAG.match(text, match.start()):
                raise ValueError(
                    f"{where} contains the invalid speaker tag {_excerpt(text, match.start())!r}; write "
                    f"<|speaker:N|> with N in 0..{MAX_SPEAKER_ID} and no leading zero"
                )

    def _caller_rows(self, segment: str, where: str) -> torch.Tensor:
        """Text rows of a segment holding caller text; refused if any of its ids is a control token."""
        ids = self.tokenizer.encode(segment, add_special_tokens=False)
        refused = [i for i in ids if i in self._refused_ids]
        if refused:
            token = self.tokenizer.convert_ids_to_tokens(refused[0])
            raise ValueError(f"{where} tokenizes to the control token {token!r}, which caller text must not produce")
        return self._text_rows(ids)

    # -- rows ------------------------------------------------------------------------------------------------

    def _text_rows(self, ids: list[int]) -> torch.Tensor:
        rows = torch.zeros(len(ids), self.row_width, dtype=torch.long)  # [n, 1 + K]
        rows[:, 0] = torch.tensor(ids, dtype=torch.long)
        return rows

    def _literal_rows(self, segment: str) -> torch.Tensor:
        return self._text_rows(self.tokenizer.encode(segment, add_special_tokens=False))

    def _audio_rows(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [K, frames] -> rows [frames, 1 + K] = [semantic_start + c0, c0..c9]."""
        return torch.cat([codes[:1] + self.semantic_start_id, codes]).T

    def build_prompt_rows(
        self,
        text: str,
        references: Any = None,
        history: Sequence | None = None,
    ) -> torch.Tensor:
        """Prompt rows `[T, 1 + num_codebooks]` of one request (see `__call__` for the arguments)."""
        references, history = self._as_list(references), list(history or ())
        self.check_request(text, references, history)
        return self._prompt_rows(text, references, history, index=None)

    def check_request(self, text: str, references: Any = None, history: Sequence | None = None,
                      index: int | None = None) -> None:
        """Raise a clear error for anything wrong with one request, without encoding audio or touching a model.

        Checks the text, every reference (`check_reference`: file headers or arrays, lengths) and history turn, and
        that the processor has a codec when a reference is audio. `index` is the request's place in a batch (for
        messages).
        """
        at = "" if index is None else f"[{index}]"
        self.check_text(text, f"text{at}")
        references = self._as_list(references)
        for n, reference in enumerate(references):
            self.check_reference(reference, f"references{at}[{n}]")
        for n, turn in enumerate(history or ()):
            self._resolve_history_turn(turn, f"history{at}[{n}]")
        audio = [n for n, ref in enumerate(references) if isinstance(ref, Mapping) and ref.get("audio") is not None]
        if audio and self.codec is None:
            raise ValueError(f"references{at}[{audio[0]}]: turning reference audio into codes {NO_CODEC}; or give "
                             "precomputed 'codes' or a saved Drama3Voice instead of audio")

    def reference_prefix_rows(self, references: Any) -> torch.Tensor:
        """The first rows `[P, 1 + num_codebooks]` of every prompt with these references first: the system start,
        the instruction and each reference's transcript and codes (pieces 1, 2 and 2a of docs/format.md, "Prompt
        layout"). Nothing request-specific comes before them, so their model caches can be computed once and reused
        (`PromptCache`). Audio references are encoded with the processor's codec."""
        references = self._as_list(references)
        for n, reference in enumerate(references):
            self.check_reference(reference, f"references[{n}]")
        parts = [self._resolve_reference(ref, f"references[{n}]") for n, ref in enumerate(references)]
        return self._reference_block_rows(parts, "")

    def _reference_block_rows(self, parts: list[tuple[str, torch.Tensor]], at: str) -> torch.Tensor:
        """Rows of prompt pieces 1, 2 and 2a for resolved references `(transcript, codes)`."""
        instruction = REFERENCE_INSTRUCTION if parts else INSTRUCTION
        rows = [self._literal_rows(SYSTEM_START), self._literal_rows(instruction)]
        for n, (transcript, codes) in enumerate(parts):
            segment = _reference_segment(n + 1, tag_transcript(transcript))
            rows += [self._caller_rows(segment, f"references{at}[{n}].transcript"), self._audio_rows(codes)]
        return torch.cat(rows)

    def _prompt_rows(self, text: str, references: list, history: list, index: int | None) -> torch.Tensor:
        """Rows `[T, 1 + K]` of one checked request; `index` is its place in a batch (None for a single text)."""
        at = "" if index is None else f"[{index}]"
        parts = [self._resolve_reference(ref, f"references{at}[{n}]") for n, ref in enumerate(references)]
        turns = [self._resolve_history_turn(turn, f"history{at}[{n}]") for n, turn in enumerate(history)]
        rows = [self._reference_block_rows(parts, at), self._literal_rows(TURN_END)]
        for n, (turn_text, codes) in enumerate(turns):
            rows += [self._literal_rows(USER_START), self._caller_rows(tag_text(turn_text), f"history{at}[{n}] text")]
            rows += [self._literal_rows(TURN_END), self._literal_rows(VOICE_START), self._audio_rows(codes)]
            rows.append(self._literal_rows(TURN_END))
        rows += [self._literal_rows(USER_START), self._caller_rows(tag_text(text), f"text{at}")]
        rows += [self._literal_rows(TURN_END), self._literal_rows(VOICE_START)]
        prompt = torch.cat(rows)  # [T, 1 + K]
        if prompt.shape[0] > self.max_prompt_rows:
            raise ValueError(
                f"the prompt of text{at} has {prompt.shape[0]} rows; Drama 3 reads at most {self.max_prompt_rows} "
                "(max_prompt_rows): shorten the text (synthesize splits long text into chunks) or use fewer or "
                "shorter references"
            )
        return prompt

    def __call__(
        self,
        text: str | Sequence[str],
        references: Any = None,
        history: Sequence | None = None,
        return_tensors: str = "pt",
    ) -> BatchFeature:
        r"""Build left-padded prompt rows for one text or a batch of texts.

        Args:
            text: the text to speak (`str`) or a batch (list of `str`). A text without a leading speaker tag gets
                `<|speaker:0|> ` in front.
            references: voice references. For one text: a reference or a list of them; for a batch: a list with
                one entry (a reference, a list of them, or None) per text. A reference is a `Drama3Voice`, or a
                dict with `"transcript"` and either `"codes"` (int `[10, frames]`) or `"audio"` (a file path, or a
                float array `[samples]` / `[channels, samples]` with `"sampling_rate"`).
            history: earlier turns, each `(text, codes [10, frames])`, a dict with `"text"` and `"codes"`, or a
                `Drama3Voice`; inserted after the system turn (docs/format.md#long-text). For a batch: one list
                per text.
            return_tensors: `"pt"` or `"np"`.

        Returns:
            `BatchFeature` with `input_ids` `[B, T, 1 + num_codebooks]` and `attention_mask` `[B, T]`; shorter
            prompts are left-padded with all-zero rows (mask 0).
        """
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np'; got {return_tensors!r}")
        texts = self._as_batch(text)
        batch_references = self._per_text(references, text, "references", self._as_list)
        batch_history = self._per_text(history, text, "history", lambda turns: list(turns or ()))
        single = isinstance(text, str)
        for index, (item, refs, turns) in enumerate(zip(texts, batch_references, batch_history)):
            self.check_request(item, refs, turns, index=None if single else index)
        prompts = [
            self._prompt_rows(item, refs, turns, index=None if single else index)
            for index, (item, refs, turns) in enumerate(zip(texts, batch_references, batch_history))
        ]
        input_ids, attention_mask = self._left_pad(prompts)
        return BatchFeature({"input_ids": input_ids, "attention_mask": attention_mask}, tensor_type=return_tensors)

    @staticmethod
    def _as_batch(text: Any) -> list[str]:
        if isinstance(text, str):
            return [text]
        if not isinstance(text, (list, tuple)):
            raise TypeError(f"text must be a string or a list of strings; got {type(text).__name__}")
        if not text:
            raise ValueError("text is an empty batch: give at least one string")
        for index, item in enumerate(text):
            if not isinstance(item, str):
                raise TypeError(f"text[{index}] must be a string; got {type(item).__name__}")
        return list(text)

    @staticmethod
    def _as_list(references: Any) -> list:
        """One text's references as a list (None -> [], a single reference -> [it])."""
        if references is None:
            return []
        if isinstance(references, (Mapping, Drama3Voice)):
            return [references]
        if isinstance(references, (list, tuple)):
            return list(references)
        raise TypeError(
            f"references must be a Drama3Voice, a dict or a list of them; got {type(references).__name__}"
        )

    @staticmethod
    def _per_text(value: Any, text: Any, name: str, as_list) -> list[list]:
        """Spread `references` / `history` over the batch: one entry per text."""
        if isinstance(text, str):
            return [as_list(value)]
        if value is None:
            return [[] for _ in text]
        if not isinstance(value, (list, tuple)) or len(value) != len(text):
            raise ValueError(f"for a batch of {len(text)} texts, {name} must be a list with one entry per text")
        return [as_list(entry) for entry in value]

    def _left_pad(self, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack rows `[T_i, 1 + K]` into `[B, T, 1 + K]` with all-zero pad rows on the left, and the mask `[B, T]`."""
        length = max(rows.shape[0] for rows in prompts)
        input_ids = torch.zeros(len(prompts), length, self.row_width, dtype=torch.long)
        attention_mask = torch.zeros(len(prompts), length, dtype=torch.long)
        for index, rows in enumerate(prompts):
            input_ids[index, length - rows.shape[0] :] = rows
            attention_mask[index, length - rows.shape[0] :] = 1
        return input_ids, attention_mask

    # -- references and history ------------------------------------------------------------------------------

    def check_reference(self, reference: Any, where: str = "reference") -> None:
        """Raise a clear error for a reference that cannot be used, without encoding it (no codec needed).

        Checks its form, its transcript (`check_text`), its codes (`check_codes`) or its audio: a file must exist,
        be readable audio with samples and last at most `max_reference_seconds` (only its header is read); an array
        must be float `[samples]` or `[channels, samples]`, finite, with a valid `sampling_rate`, and not too long.
        """
        if isinstance(reference, Drama3Voice):
            self.check_text(reference.transcript, f"{where}.transcript")
            self.check_codes(reference.codes, f"{where}.codes", reference=True)
            return
        if not isinstance(reference, Mapping):
            raise TypeError(
                f"{where} must be a Drama3Voice or a dict with 'transcript' and 'codes' or 'audio'; "
                f"got {type(reference).__name__}"
            )
        unknown = set(reference) - {"transcript", "codes", "audio", "sampling_rate"}
        if unknown:
            raise ValueError(
                f"{where} has unknown keys {sorted(unknown)}; use 'transcript', 'codes', 'audio', 'sampling_rate'"
            )
        if "transcript" not in reference:
            raise ValueError(f"{where} has no 'transcript': give the text spoken in the reference audio")
        self.check_text(reference["transcript"], f"{where}.transcript")
        has_codes, has_audio = reference.get("codes") is not None, reference.get("audio") is not None
        if has_codes and has_audio:
            raise ValueError(f"{where} has both 'codes' and 'audio'; give one of them")
        if has_codes:
            self.check_codes(reference["codes"], f"{where}.codes", reference=True)
        elif has_audio:
            self.check_audio(reference["audio"], reference.get("sampling_rate"), where)
        else:
            raise ValueError(
                f"{where} has a transcript but no 'audio' or 'codes': give the reference audio (a file path, or an "
                f"array with 'sampling_rate'), its codes [{self.num_codebooks}, frames], or use a saved Drama3Voice"
            )

    def _resolve_reference(self, reference: Any, where: str) -> tuple[str, torch.Tensor]:
        """A checked reference as `(transcript, codes [K, frames])`, encoding audio through the codec when needed."""
        if isinstance(reference, Drama3Voice):
            return reference.transcript, self.check_codes(reference.codes, f"{where}.codes", reference=True)
        if reference.get("codes") is not None:
            return reference["transcript"], self.check_codes(reference["codes"], f"{where}.codes", reference=True)
        codes = self.encode_audio(reference["audio"], reference.get("sampling_rate"), where=where)
        return reference["transcript"], codes

    def _resolve_history_turn(self, turn: Any, where: str) -> tuple[str, torch.Tensor]:
        """A history turn as `(text, codes [K, frames])`."""
        if isinstance(turn, Drama3Voice):
            text, codes = turn.transcript, turn.codes
        elif isinstance(turn, Mapping) and set(turn) == {"text", "codes"}:
            text, codes = turn["text"], turn["codes"]
        elif isinstance(turn, (list, tuple)) and len(turn) == 2:
            text, codes = turn
        else:
            raise TypeError(f"{where} must be (text, codes), a dict with 'text' and 'codes', or a Drama3Voice")
        self.check_text(text, f"{where} text")
        return text, self.check_codes(codes, f"{where} codes")

    def check_codes(self, codes: Any, where: str = "codes", reference: bool = False) -> torch.Tensor:
        """Validate codec codes `[num_codebooks, frames]` (`codes.check_codes`), at least one frame, and return them
        as a CPU int64 tensor.

        Ids must lie in `[0, semantic_vocab_size)`; a reference must also be at most `max_reference_seconds` long.
        """
        codes = check_codes(codes, self.num_codebooks, where, vocab_size=self.semantic_vocab_size)
        if codes.shape[1] == 0:
            raise ValueError(f"{where} has no frames: codes are [{self.num_codebooks}, frames] with at least one frame")
        # Encoding pads audio to whole frames: allow the frames of a reference of the maximum length.
        max_frames = math.ceil(self.max_reference_seconds * self.sampling_rate / self.frame_length)
        if reference and codes.shape[1] > max_frames:
            seconds = codes.shape[1] * self.frame_length / self.sampling_rate
            raise ValueError(
                f"{where} has {codes.shape[1]} frames ({seconds:.1f} s); references may be at most "
                f"{self.max_reference_seconds:g} s ({max_frames} frames): trim it"
            )
        return codes.cpu()

    def _check_duration(self, samples: int, sampling_rate: int, where: str) -> None:
        """Refuse a reference longer than `max_reference_seconds`."""
        seconds = samples / sampling_rate
        if seconds > self.max_reference_seconds:
            raise ValueError(
                f"{where} is {seconds:.1f} s long; references may be at most {self.max_reference_seconds:g} s "
                f"(10-30 s works best): trim it"
            )

    # -- audio in --------------------------------------------------------------------------------------------

    def encode_audio(self, audio: Any, sampling_rate: int | None = None, where: str = "audio") -> torch.Tensor:
        """Reference audio -> codes `[num_codebooks, frames]` through the processor's `codec.encode`.

        `audio` is a file path or an audio file's bytes (read with soundfile), a `datasets.Audio` value
        (`audio_io.audio_value`), or a float array / tensor `[samples]` or `[channels, samples]` with
        `sampling_rate`. Channels are averaged to mono here and the codec resamples to its 44.1 kHz; a warning
        says so when that happens to a recording with several channels or a lower rate.
        """
        if self.codec is None:
            raise ValueError(f"{where}: turning reference audio into codes {NO_CODEC}; or give precomputed 'codes' "
                             "or a saved Drama3Voice instead of audio")
        self.check_audio(audio, sampling_rate, where)
        samples, sampling_rate, channels = self._mono_audio(audio, sampling_rate, where)  # [L]
        for note in self.conversion_notes(channels, sampling_rate, where):
            logger.warning(note)
        with torch.inference_mode():
            mono = torch.from_numpy(samples)[None]  # [1, L]: one recording, [channels, samples]
            codes = self.codec.encode(mono, sampling_rate).audio_codes  # [1, K, frames]
        return self.check_codes(codes[0].cpu(), f"{where} (encoded)")

    def check_audio(self, audio: Any, sampling_rate: int | None = None, where: str = "audio") -> None:
        """Raise a clear error for reference audio that cannot be encoded (see `check_reference`); a file's samples
        are not read, only its header."""
        audio, sampling_rate = audio_value(audio, sampling_rate, where)
        if isinstance(audio, (str, os.PathLike, bytes)):
            info = audio_file_header(audio, where)
            if sampling_rate is not None and sampling_rate != info.samplerate:
                raise ValueError(
                    f"{where}: 'sampling_rate' {sampling_rate} differs from the file's {info.samplerate} Hz; "
                    "leave it out"
                )
            if info.frames == 0:
                raise ValueError(f"{where}: audio file {audio_file_name(audio)} holds no samples")
            self._check_duration(info.frames, info.samplerate, where)
            return
        if sampling_rate is None:
            raise ValueError(f"{where}: an audio array needs its 'sampling_rate'")
        sampling_rate = check_sampling_rate(sampling_rate, where)
        samples = audio.detach().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
        if not np.issubdtype(samples.dtype, np.floating):
            raise ValueError(f"{where}: audio must be a float array with values in [-1, 1]; got dtype {samples.dtype}")
        check_audio_layout(samples.shape, where)
        self._check_duration(samples.shape[-1], sampling_rate, where)
        if not np.isfinite(samples).all():
            raise ValueError(f"{where}: audio contains NaN or infinite values")

    def _mono_audio(self, audio: Any, sampling_rate: int | None, where: str) -> tuple[np.ndarray, int, int]:
        """Float32 mono samples `[L]` of checked audio, their rate, and the number of channels they were mixed from."""
        audio, sampling_rate = audio_value(audio, sampling_rate, where)
        if isinstance(audio, (str, os.PathLike, bytes)):
            channels = audio_file_header(audio, where).channels
            samples, sampling_rate = read_audio_file(audio, where)
            return samples, sampling_rate, channels
        samples = audio.detach().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
        channels = 1 if samples.ndim == 1 else samples.shape[0]
        mono = samples if samples.ndim == 1 else samples.mean(axis=0)
        return np.ascontiguousarray(mono, dtype=np.float32), int(sampling_rate), channels

    def conversion_notes(self, channels: int, sampling_rate: int, where: str) -> list[str]:
        """What encoding does to reference audio of `channels` at `sampling_rate` that its owner should know: mixed
        down to mono, or resampled from a lower rate than the codec's (a note, or none). `encode_audio` logs it."""
        changes = []
        if channels > 1:
            changes.append(f"its {channels} channels are averaged to mono")
        if sampling_rate < self.sampling_rate:
            changes.append(
                f"its {sampling_rate} Hz are resampled to {self.sampling_rate} Hz, which cannot restore the high "
                "frequencies it lacks (the cloned voice may sound muffled: use a recording of 44.1 kHz or more if "
                "you have one)"
            )
        return [f"{where}: {'; '.join(changes)}."] if changes else []

    def create_voice(
        self,
        transcript: str,
        audio: Any,
        sampling_rate: int | None = None,
        name: str | None = None,
    ) -> Drama3Voice:
        """Encode reference audio once into a reusable `Drama3Voice` (save it with `voice.save(path)`)."""
        self.check_text(transcript, "transcript")
        codes = self.encode_audio(audio, sampling_rate)
        return Drama3Voice(codes=codes, transcript=transcript, name=name)

    # -- long text -------------------------------------------------------------------------------------------

    def split_text(self, text: str, max_bytes: int = 300, max_speakers: int = 3) -> list[str]:
        """Check `text` like any caller text, then split it into chunks (see the module function `split_text`)."""
        self.check_text(text)
        return split_text(text, max_bytes=max_bytes, max_speakers=max_speakers)

    # -- audio out -------------------------------------------------------------------------------------------

    def frames_to_codes(self, frames: Any) -> torch.Tensor:
        """Frames `[T, 1 + K]` -> codes `[K, n]` of the audio rows (text and padding rows are dropped)."""
        frames = torch.as_tensor(frames)
        if frames.ndim == 3 and frames.shape[0] == 1:
            frames = frames[0]
        if frames.ndim != 2 or frames.shape[1] != self.row_width:
            raise ValueError(
                f"frames must have shape [T, {self.row_width}] (use batch_frames_to_audio for [B, T, {self.row_width}]); "
                f"got {tuple(frames.shape)}"
            )
        main = frames[:, 0]
        audio_rows = (main >= self.semantic_start_id) & (main < self.semantic_start_id + self.semantic_vocab_size)
        return frames[audio_rows, 1:].T.to(device="cpu", dtype=torch.long)  # [K, n]

    def frames_to_audio(self, frames: Any) -> torch.Tensor:
        """Generated frames `[T, 1 + K]` -> float32 audio `[n * frame_length]` through the processor's
        `codec.decode` (CPU)."""
        if self.codec is None:
            raise ValueError(f"turning frames into audio {NO_CODEC}")
        codes = self.frames_to_codes(frames)  # [K, n]
        if codes.shape[1] == 0:
            return torch.zeros(0, dtype=torch.float32)
        with torch.inference_mode():
            audio = self.codec.decode(codes[None]).audio_values  # [1, 1, n * frame_length]
        return audio[0].reshape(-1).to(device="cpu", dtype=torch.float32)

    def batch_frames_to_audio(self, frames: Any) -> list[torch.Tensor]:
        """A batch of frames `[B, T, 1 + K]` (or a list of `[T_i, 1 + K]`) -> one audio tensor per sequence."""
        if isinstance(frames, torch.Tensor) and frames.ndim != 3:
            raise ValueError(f"batch_frames_to_audio takes frames [B, T, {self.row_width}]; got {tuple(frames.shape)}")
        return [self.frames_to_audio(sequence) for sequence in frames]

    def save_audio(self, audio: Any, path: str | os.PathLike, sampling_rate: int | None = None) -> Path:
        """Write float audio `[samples]` or `[channels, samples]` to `path`, atomically (`audio_io.write_audio`).

        The format follows the suffix: `.wav` (16-bit PCM), `.flac` (16-bit), `.ogg` (Vorbis). Samples are clipped
        to [-1, 1]. The file appears complete or not at all; an existing file is replaced only on success.
        """
        return write_audio(path, audio, self.sampling_rate if sampling_rate is None else sampling_rate)


def _excerpt(text: str, start: int) -> str:
    """The part of `text` from `start` to the end of the `<|...|>` there (at most 40 characters)."""
    end = text.find("|>", start)
    end = end + 2 if 0 <= end < start + 38 else start + 40
    return text[start:end]
