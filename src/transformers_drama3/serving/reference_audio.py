"""Audio that clients send (request references and voice uploads): bytes of an audio file -> float32 mono samples.

The length is read from the file's header and checked against the server's limit before the samples are decoded,
so an over-long upload costs no decoding. The codec encodes the samples later, in the generation thread.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from ..audio_io import soundfile
from .errors import APIError


def decode_base64_audio(text: str, where: str) -> bytes:
    """The bytes of a base64 field (or of a `data:...;base64,` URL); 400 if it is not base64."""
    if text.startswith(("http://", "https://", "file:", "/", "./")):
        raise APIError(400, f"{where} looks like a URL or a path; this server fetches nothing and reads no files: "
                       "send the audio file itself, base64-encoded", where, "invalid_audio")
    if text.startswith("data:") and ";base64," in text:
        text = text.partition(";base64,")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as error:
        raise APIError(400, f"{where} is not valid base64: {error}", where, "invalid_audio") from error


def read_audio_bytes(data: bytes, where: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """Float32 samples `[channels, L]` and the rate of an audio file's bytes (WAV, FLAC, OGG, MP3); the processor
    mixes them to mono and says so (`Drama3Processor.conversion_notes`), as it does for a Python caller.

    400 if the bytes are not a readable audio file or hold no samples; 413 if it is longer than `max_seconds`.
    """
    if not data:
        raise APIError(400, f"{where} is empty: send an audio file (WAV, FLAC, OGG or MP3)", where, "invalid_audio")
    sf = soundfile()
    try:
        info = sf.info(io.BytesIO(data))
        frames, rate = info.frames, info.samplerate
    except (sf.LibsndfileError, RuntimeError, TypeError) as error:
        reason = getattr(error, "error_string", None) or "its format is not recognised"  # no "<BytesIO at 0x...>"
        raise APIError(400, f"{where} is not a readable audio file (WAV, FLAC, OGG or MP3): "
                       f"{reason.rstrip('.').lower()}", where, "invalid_audio") from error
    if rate <= 0 or frames <= 0:
        raise APIError(400, f"{where} holds no audio samples", where, "invalid_audio")
    if frames / rate > max_seconds:
        raise APIError(413, f"{where} is {frames / rate:.1f} s long; references may be at most {max_seconds:g} s "
                       "(10-30 s works best): trim it", where, "audio_too_long")
    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)  # [L, channels]
    except (sf.LibsndfileError, RuntimeError) as error:
        reason = getattr(error, "error_string", None) or "decoding failed"
        raise APIError(400, f"{where} cannot be decoded: {reason}", where, "invalid_audio") from error
    if samples.shape[0] == 0:
        raise APIError(400, f"{where} holds no audio samples", where, "invalid_audio")
    if not np.isfinite(samples).all():
        raise APIError(400, f"{where} contains NaN or infinite samples", where, "invalid_audio")
    return np.ascontiguousarray(samples.T, dtype=np.float32), int(rate)  # [channels, L]
