"""Response audio: the formats the server answers in, and their bytes.

`wav` and `pcm` stream as the audio is generated: 16-bit little-endian mono samples at the model's rate (44.1 kHz),
after a 44-byte WAV header for `wav`. A streamed WAV cannot know its length up front, so its RIFF and data sizes are
0xFFFFFFFF, the usual convention for WAV on a pipe (libsndfile, ffmpeg and Python's `wave` read it to the end of
the data). `flac`, `mp3` and `opus` are encoded when the speech is complete, by libsndfile through `soundfile`
(already a dependency): MP3 needs libsndfile >= 1.1 built with LAME/mpg123 and Opus one built with libopus, as in
the `soundfile` wheels on PyPI; the server checks what the installed build can write and refuses the others with a
clear 400. Opus only takes 8/12/16/24/48 kHz, so `opus` is resampled to 48 kHz (Ogg container).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np
import torch

from ..audio_io import resample_audio, soundfile
from .errors import APIError

RAW_RATE = 44100  # headerless PCM records no rate: any value gives the same bytes
STREAMED_WAV_SIZE = 0xFFFFFFFF  # RIFF and data sizes of a WAV whose length is unknown when the header is sent


@dataclass(frozen=True)
class ResponseFormat:
    """How one `response_format` is answered: its media type, whether it streams, and its libsndfile format."""

    media_type: str
    streams: bool
    file_format: str | None = None  # soundfile (format, subtype) of the formats encoded at the end
    subtype: str | None = None
    sampling_rate: int | None = None  # a rate the encoder needs (Opus); None: the model's


RESPONSE_FORMATS = {
    "wav": ResponseFormat("audio/wav", True),
    "pcm": ResponseFormat("audio/pcm", True),
    "flac": ResponseFormat("audio/flac", False, "FLAC", "PCM_16"),
    "mp3": ResponseFormat("audio/mpeg", False, "MP3", "MPEG_LAYER_III"),
    "opus": ResponseFormat("audio/ogg", False, "OGG", "OPUS", sampling_rate=48000),
}
SSE_FORMATS = ("pcm", "wav")  # what `stream_format="sse"` can carry in its deltas


def available_formats() -> list[str]:
    """The response formats this installation can produce."""
    return [name for name, spec in RESPONSE_FORMATS.items() if spec.file_format is None
            or soundfile().check_format(spec.file_format, spec.subtype)]


def check_response_format(name: str, stream_format: str) -> ResponseFormat:
    """The `ResponseFormat` of a request; 400 for an unknown format, one this libsndfile cannot write, or one that
    cannot go in server-sent events."""
    if name not in RESPONSE_FORMATS:
        raise APIError(400, f"unsupported response_format {name!r}; use one of {available_formats()}",
                       "response_format", "unsupported_format")
    spec = RESPONSE_FORMATS[name]
    if name not in available_formats():
        raise APIError(400, f"response_format {name!r} needs a libsndfile with a {spec.file_format}/{spec.subtype} "
                       f"encoder (libsndfile >= 1.1, as in the soundfile wheels: pip install -U soundfile); this "
                       f"installation can write {available_formats()}", "response_format", "format_unavailable")
    if stream_format == "sse" and name not in SSE_FORMATS:
        raise APIError(400, f"stream_format 'sse' carries {list(SSE_FORMATS)} audio; got response_format {name!r} "
                       "(use stream_format 'audio' for it)", "response_format", "unsupported_format")
    return spec


def pcm16(chunk: torch.Tensor) -> bytes:
    """Float audio `[samples]` -> 16-bit little-endian PCM bytes, converted by libsndfile (clipped to [-1, 1]) as
    every other file the package writes, so a streamed WAV has the samples of `processor.save_audio`'s WAV."""
    samples = np.clip(chunk.detach().to(device="cpu", dtype=torch.float32).numpy(), -1.0, 1.0)
    buffer = io.BytesIO()
    soundfile().write(buffer, samples, RAW_RATE, format="RAW", subtype="PCM_16", endian="LITTLE")
    return buffer.getvalue()


def streamed_wav_header(sampling_rate: int) -> bytes:
    """The 44-byte header of a mono 16-bit PCM WAV of unknown length."""
    block = 2  # bytes per sample frame: one channel of 16 bits
    return (
        b"RIFF" + struct.pack("<I", STREAMED_WAV_SIZE) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sampling_rate, sampling_rate * block, block, 16)
        + b"data" + struct.pack("<I", STREAMED_WAV_SIZE)
    )


def encode_audio_file(audio: torch.Tensor, sampling_rate: int, spec: ResponseFormat) -> bytes:
    """Complete speech `[samples]` as the bytes of a `flac`, `mp3` or `opus` file."""
    if spec.sampling_rate is not None and spec.sampling_rate != sampling_rate:
        audio = resample_audio(audio.to(torch.float32), sampling_rate, spec.sampling_rate)
        sampling_rate = spec.sampling_rate
    samples = np.clip(audio.detach().to(device="cpu", dtype=torch.float32).numpy(), -1.0, 1.0)
    buffer = io.BytesIO()
    soundfile().write(buffer, samples, sampling_rate, format=spec.file_format, subtype=spec.subtype)
    return buffer.getvalue()
