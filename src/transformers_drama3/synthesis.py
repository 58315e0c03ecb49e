"""Text of any length (and optional voice references) -> one continuous waveform (docs/usage.md#long-text-synthesize).

`synthesize(model, processor, text)` splits the text with `processor.split_text`, generates the chunks one after
another, each with the first chunk and the previous chunk (their text and generated codes) as history turns so the
voice and pace carry over, and decodes all frames through one streaming codec decoder so the chunks join without
a seam. Reference audio is encoded once, not once per chunk. The text and every reference are checked before
anything is encoded or generated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from .device_placement import execution_device
from .generation.sampling import request_generators
from .generation import DRAMA3_GENERATION_DEFAULTS, generation_settings
from .streaming import Drama3AudioStreamer
from .voice import Drama3Voice


@dataclass(eq=False)
class Drama3Speech:
    """What `synthesize` returns.

    audio: float32 `[samples]` on the CPU, all chunks joined. texts: the chunks as spoken (each starts with its
    speaker tag). codes: the generated codes `[num_codebooks, n_i]` of each chunk. finish_reasons: per chunk
    `"eos"`, `"length"` (the chunk hit `max_new_tokens`) or `"context"`.
    """

    audio: torch.Tensor
    sampling_rate: int
    texts: list[str] = field(default_factory=list)
    codes: list[torch.Tensor] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def num_frames(self) -> int:
        return sum(codes.shape[1] for codes in self.codes)

    @property
    def duration(self) -> float:
        """Seconds of audio."""
        return self.audio.shape[0] / self.sampling_rate


class _ChunkStreamer(BaseStreamer):
    """Passes every frame on to `targets` and ignores `end`: `generate` ends its stream after each chunk, while
    `synthesize` ends the streams once, after the last chunk. The prompt rows `[1, T, 1 + NCB]` that `generate` puts
    first are no frames: a `synthesize` streamer gets frames only."""

    def __init__(self, targets: list[BaseStreamer]):
        self.targets = targets

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 3:
            return
        for target in self.targets:
            target.put(value)

    def end(self) -> None:
        pass


def encode_references(processor, references) -> list:
    """`references` as a list (None, one reference, or a list), checked, with every audio reference encoded to codes
    (by the processor's codec).

    Every reference is checked (`processor.check_reference`) before the first is encoded. Audio references become
    `{"transcript", "codes"}` dicts, so a text split into many chunks pays one codec encoding per reference.
    """
    if references is None:
        return []
    if isinstance(references, (Mapping, Drama3Voice)):
        references = [references]
    if not isinstance(references, (list, tuple)):
        raise TypeError(f"references must be a Drama3Voice, a dict or a list of them; got {type(references).__name__}")
    for n, reference in enumerate(references):
        processor.check_reference(reference, f"references[{n}]")
    return [_encoded(processor, reference, f"references[{n}]") for n, reference in enumerate(references)]


def _encoded(processor, reference, where: str):
    if not isinstance(reference, Mapping) or reference.get("audio") is None:
        return reference
    codes = processor.encode_audio(reference["audio"], reference.get("sampling_rate"), where=where)
    rest = {key: value for key, value in reference.items() if key not in ("audio", "sampling_rate")}
    return {**rest, "codes": codes}


def history_turns(texts: list[str], codes: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """History for the next chunk: the first chunk and the previous one, skipping chunks without frames
    (docs/format.md#long-text)."""
    done = list(zip(texts, codes))
    chosen = done[:1] + done[1:][-1:]
    return [(text, frames) for text, frames in chosen if frames.shape[1] > 0]


def synthesize(
    model,
    processor,
    text: str,
    references=None,
    *,
    chunk_bytes: int = 300,
    max_speakers: int = 3,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    streamer: BaseStreamer | None = None,
    show_progress: bool = True,
    **generate_kwargs,
) -> Drama3Speech:
    """Speak `text` of any length with `model` (a `FishOmniForSpeech`) and its `processor`.

    Args:
        text: the text, with speaker tags for dialogue; split into chunks of at most `chunk_bytes` UTF-8 bytes and
            `max_speakers` speakers (`processor.split_text`).
        references: voice references as the processor takes them (dicts with `"transcript"` and `"audio"` or
            `"codes"`, or `Drama3Voice`s); audio is encoded once, by the processor's codec (a processor without
            one uses `model.codec`).
        seed / generator: make the whole run reproducible (one generator serves every chunk).
        streamer: a `Drama3AudioStreamer` receives the audio of all chunks as one stream (it ends after the
            last chunk) and its chunks are the returned audio; any other `BaseStreamer` gets the codes of every
            frame (`[1, num_codebooks]`).
        show_progress: a progress bar: over the chunks, with the audio made so far, for text of several chunks; over
            the frames of the one chunk otherwise.
        generate_kwargs: sampling settings for `model.generate` (`do_sample`, `temperature`, `top_p`,
            `max_new_tokens` per chunk, ...).

    Returns:
        `Drama3Speech` with the joined float32 audio, the chunk texts, their codes and finish reasons.
    """
    audio_stream = streamer if isinstance(streamer, Drama3AudioStreamer) else Drama3AudioStreamer(model.codec)
    streams = [audio_stream] + ([streamer] if streamer is not None and streamer is not audio_stream else [])
    result = Drama3Speech(audio=torch.zeros(0), sampling_rate=model.config.sampling_rate)
    try:  # the streams end whatever happens, so a consumer iterating them never waits forever
        texts = processor.split_text(text, max_bytes=chunk_bytes, max_speakers=max_speakers)
        settings = {key: value for key, value in generate_kwargs.items() if key in DRAMA3_GENERATION_DEFAULTS}
        generation_settings(model.generation_config, **settings)  # bad settings fail before references are encoded
        if processor.codec is None:
            processor = processor.with_codec(model.codec)
        references = encode_references(processor, references)
        device = model.input_device
        generator = request_generators(seed, generator, 1, execution_device(model.lm_head))
        frames_per_second = model.config.sampling_rate / model.config.codec_config.frame_length
        chunks = tqdm(texts, unit="chunk", disable=not show_progress or len(texts) == 1)
        for chunk in chunks:
            inputs = processor(chunk, references=references, history=history_turns(result.texts, result.codes))
            output = model.generate(
                inputs["input_ids"].to(device), inputs["attention_mask"].to(device),
                streamer=_ChunkStreamer(streams), generator=generator, output_audio=False,
                show_progress=show_progress and len(texts) == 1, **generate_kwargs,
            )
            result.texts.append(chunk)
            result.codes.append(output.codes[0].cpu())
            result.finish_reasons.append(output.finish_reason[0])
            chunks.set_postfix_str(f"{result.num_frames / frames_per_second:.1f} s of audio", refresh=False)
    finally:
        for stream in streams:
            stream.end()
    result.audio = torch.cat([torch.zeros(0), *audio_stream.chunks])
    return result


__all__ = ["Drama3Speech", "encode_references", "history_turns", "synthesize"]
