"""Response audio: the formats the server answers in, whether they stream, and at what rate.

Every format is encoded by `audio_io.AudioEncoder`, the encoder `drama3-tts` writes its files and `-o -` with, so a
response is byte for byte the file the CLI writes (an Ogg's serial apart, when streamed). `pcm` is 16-bit
little-endian mono without a header. `opus` is Ogg Opus at 48 kHz (Opus codes no 44.1 kHz); every other format is
at the model's 44.1 kHz, except `pcm` for a request naming one of OpenAI's model ids (`tts-1`, ...), which gets
OpenAI's 24 kHz so that code written for OpenAI plays it at the right speed. `X-Sample-Rate` says the rate.

Streaming (`stream`, default: the format's own, as OpenAI answers): `pcm`, `mp3` and `opus` carry no length and
stream as the audio is made. `wav` is sent complete by default, with the real RIFF and data sizes; with
`"stream": true` it streams, and its sizes are then 0xFFFFFFFF (unknown). `flac` is always sent complete (its
header holds the length, and libsndfile cannot read a FLAC stream without it). MP3 needs libsndfile >= 1.1 built
with LAME/mpg123, Opus one with libopus, as in the `soundfile` wheels on PyPI; the server checks what the installed
build can write and refuses the others with a clear 400.

`aac` is AAC-LC in ADTS frames (`audio/aac`, what OpenAI's `aac` is), 128 kb/s mono at 44.1 kHz, encoded by
FFmpeg's AAC encoder through PyAV (`pip install av`, in the `serve` extra; libsndfile has no AAC). ADTS carries no
length, so it streams by default. The decoded audio starts with the encoder's priming of `AAC_PRIMING` samples, as
every AAC file does; players skip it.
"""

from __future__ import annotations

import importlib.util
import io
from dataclasses import dataclass

import numpy as np

from ..audio_io import AudioEncoder, audio_file_format
from .errors import APIError

OPENAI_PCM_RATE = 24000  # the rate of OpenAI's `pcm`: for requests that name an OpenAI model id
AAC_BIT_RATE = 128_000  # bits per second of `aac` (mono)
AAC_PRIMING = 1024  # samples of encoder delay at the start of FFmpeg's AAC-LC output (one frame)


@dataclass(frozen=True)
class ResponseFormat:
    """How one `response_format` is answered: its media type, whether it streams unless told otherwise, and
    whether it can stream at all."""

    media_type: str
    streams_by_default: bool
    can_stream: bool = True


RESPONSE_FORMATS = {
    "wav": ResponseFormat("audio/wav", False),
    "pcm": ResponseFormat("audio/pcm", True),
    "flac": ResponseFormat("audio/flac", False, can_stream=False),
    "mp3": ResponseFormat("audio/mpeg", True),
    "opus": ResponseFormat("audio/ogg", True),
    "aac": ResponseFormat("audio/aac", True),
}
SSE_FORMATS = ("pcm", "wav")  # what `stream_format="sse"` can carry in its deltas


def encoder_missing(name: str) -> str | None:
    """Why this installation cannot encode format `name` (None: it can)."""
    if name == "aac":
        return None if importlib.util.find_spec("av") else "aac needs PyAV (pip install av)"
    try:
        audio_file_format(f"audio.{name}")
    except ValueError as error:
        return str(error)
    return None


def available_formats() -> list[str]:
    """The response formats this installation can produce."""
    return [name for name in RESPONSE_FORMATS if encoder_missing(name) is None]


def check_response_format(name: str, stream_format: str, stream: bool | None) -> ResponseFormat:
    """The `ResponseFormat` of a request; 400 for an unknown format, one this libsndfile cannot write, one that
    cannot go in server-sent events, or `stream: true` for a format that cannot stream."""
    if name not in RESPONSE_FORMATS:
        raise APIError(400, f"unsupported response_format {name!r}; use one of {available_formats()}",
                       "response_format", "unsupported_format")
    spec = RESPONSE_FORMATS[name]
    missing = encoder_missing(name)
    if missing is not None:
        raise APIError(400, f"response_format {name!r}: {missing.replace('; or use .wav', '')}; this installation "
                       f"can write {available_formats()}", "response_format", "format_unavailable")
    if stream_format == "sse" and name not in SSE_FORMATS:
        raise APIError(400, f"stream_format 'sse' carries {list(SSE_FORMATS)} audio; got response_format {name!r} "
                       "(use stream_format 'audio' for it)", "response_format", "unsupported_format")
    if stream and not spec.can_stream:
        raise APIError(400, f"response_format {name!r} is sent complete, never streamed: leave out \"stream\", or "
                       f"stream one of {[each for each, f in RESPONSE_FORMATS.items() if f.can_stream]}", "stream",
                       "unsupported_value")
    return spec


class AdtsEncoder:
    """Float audio in pieces -> AAC-LC in ADTS frames, with `AudioEncoder`'s interface (`encode`, `finish`,
    `streamed`, `sampling_rate`). PyAV's encoder regroups the pieces into AAC's 1024-sample frames, so the bytes do
    not depend on how the audio is cut."""

    def __init__(self, sampling_rate: int, streamed: bool):
        import av  # imported on first use: only `aac` needs it

        self.av, self.streamed, self.sampling_rate = av, streamed, sampling_rate
        self.buffer, self.sent, self.samples = io.BytesIO(), 0, 0
        self.container = av.open(self.buffer, mode="w", format="adts")
        self.stream = self.container.add_stream("aac", rate=sampling_rate, layout="mono")
        self.stream.codec_context.bit_rate = AAC_BIT_RATE

    def encode(self, samples) -> bytes:
        """Add float samples `[n]`; the ADTS frames completed so far (none until `finish` when not streamed)."""
        chunk = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
        if len(chunk):
            frame = self.av.AudioFrame.from_ndarray(chunk[None], format="fltp", layout="mono")  # [1, n] planar
            frame.sample_rate, frame.pts = self.sampling_rate, self.samples
            self.samples += len(chunk)
            self.mux(frame)
        return self.taken() if self.streamed else b""

    def finish(self) -> bytes:
        """The encoder's last frames."""
        self.mux(None)
        self.container.close()
        return self.taken()

    def mux(self, frame) -> None:
        for packet in self.stream.encode(frame):
            self.container.mux(packet)

    def taken(self) -> bytes:
        data = self.buffer.getvalue()[self.sent :]
        self.sent += len(data)
        return data


def response_encoder(name: str, model_rate: int, streamed: bool, openai_model: bool = False):
    """The encoder of one response (an `AudioEncoder`, or an `AdtsEncoder` for `aac`): `name` at the rate it is
    sent at (see the module's docstring)."""
    if name == "aac":
        return AdtsEncoder(model_rate, streamed)
    output_rate = OPENAI_PCM_RATE if openai_model and name == "pcm" else None
    return AudioEncoder(name, model_rate, streamed, output_rate=output_rate)
