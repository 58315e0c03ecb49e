"""Audio files in and out, resampling, and atomic file writes.

soundfile (libsndfile) is imported on first use, so importing the package needs no audio I/O library. Files are
written atomically (`write_atomically`): a failed or interrupted write never leaves a half-written file behind.
"""

from __future__ import annotations

import math
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch
import torch.nn.functional as F

# Writable audio files: suffix -> (soundfile format, subtype).
AUDIO_FILE_FORMATS = {".wav": ("WAV", "PCM_16"), ".flac": ("FLAC", "PCM_16"), ".ogg": ("OGG", "VORBIS")}


def soundfile():
    """The soundfile module, imported on first use."""
    import soundfile as module

    return module


def audio_file_format(path: str | os.PathLike) -> tuple[str, str]:
    """(soundfile format, subtype) to write `path` with, from its suffix; a clear error for an unknown suffix."""
    suffix = Path(path).suffix.lower()
    if suffix not in AUDIO_FILE_FORMATS:
        raise ValueError(f"cannot tell the audio format of {str(path)!r}: use one of {sorted(AUDIO_FILE_FORMATS)}")
    file_format, subtype = AUDIO_FILE_FORMATS[suffix]
    if not soundfile().check_format(file_format, subtype):
        raise ValueError(f"this soundfile/libsndfile build cannot write {file_format} ({subtype}); use .wav")
    return file_format, subtype


# Sampling rates audio is read at or resampled from: telephone-band recordings up to 768 kHz studio audio. Outside,
# a resampling to 44.1 kHz would need an absurd filter or output (a 1 Hz "recording" becomes 44100x longer).
MIN_SAMPLING_RATE, MAX_SAMPLING_RATE = 1000, 768000


def check_sampling_rate(sampling_rate: Any, where: str) -> int:
    """`sampling_rate` as an int in [MIN_SAMPLING_RATE, MAX_SAMPLING_RATE] Hz, or a ValueError naming `where`."""
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer)) or sampling_rate <= 0:
        raise ValueError(f"{where}: sampling_rate must be a positive integer; got {sampling_rate!r}")
    if not MIN_SAMPLING_RATE <= sampling_rate <= MAX_SAMPLING_RATE:
        raise ValueError(
            f"{where}: sampling_rate {sampling_rate} Hz is outside [{MIN_SAMPLING_RATE}, {MAX_SAMPLING_RATE}] Hz"
        )
    return int(sampling_rate)


def audio_file_info(path: str | os.PathLike, where: str) -> tuple[int, int]:
    """(samples, sampling rate) of an audio file, read from its header only; clear errors for a missing or
    unreadable file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{where}: audio file {str(path)!r} does not exist")
    try:
        info = soundfile().info(str(path))
    except soundfile().LibsndfileError as error:
        raise ValueError(f"{where}: cannot read audio file {str(path)!r}: {error}") from error
    return info.frames, info.samplerate


def read_audio_file(path: str | os.PathLike, where: str) -> tuple[np.ndarray, int]:
    """Float32 mono samples `[L]` (channels averaged) and the sampling rate of an audio file."""
    samples, rate = soundfile().read(str(path), dtype="float32", always_2d=True)  # [L, C]
    if samples.shape[0] == 0:
        raise ValueError(f"{where}: audio file {str(path)!r} holds no samples")
    return np.ascontiguousarray(samples.mean(axis=1), dtype=np.float32), rate


def write_audio(path: str | os.PathLike, audio: Any, sampling_rate: int) -> Path:
    """Write float audio `[samples]` or `[channels, samples]` to `path`, atomically.

    The format follows the suffix: `.wav` (16-bit PCM), `.flac` (16-bit), `.ogg` (Vorbis). Samples are clipped to
    [-1, 1]. The file appears complete or not at all; an existing file is replaced only on success.
    """
    file_format, subtype = audio_file_format(path)
    rate = check_sampling_rate(sampling_rate, "save_audio")
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().to(device="cpu", dtype=torch.float32).numpy()
    samples = np.asarray(audio, dtype=np.float32)
    if samples.ndim == 2:
        samples = samples.T  # soundfile wants [samples, channels]
    elif samples.ndim != 1:
        raise ValueError(f"audio must be [samples] or [channels, samples]; got shape {samples.shape}")
    if not np.isfinite(samples).all():
        raise ValueError("audio contains NaN or infinite values")
    samples = np.clip(samples, -1.0, 1.0)
    return write_atomically(path, lambda file: soundfile().write(file, samples, rate, format=file_format, subtype=subtype))


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call `write(file)` on a temporary file next to `path`, then rename it to `path`.

    The rename is atomic on one file system: readers see either the old file or the complete new one. If `write`
    raises, the temporary file is removed, an existing file at `path` is left untouched, and the error propagates.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"cannot write to {str(path)!r}: it is a directory; give a file name")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {str(path)!r}: the directory {str(path.parent)!r} does not exist")
    temporary = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        with open(temporary, "xb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


_RESAMPLE_ZERO_CROSSINGS = 32  # sinc lobes kept on each side of a tap
_RESAMPLE_ROLLOFF = 0.945  # cutoff as a fraction of the lower Nyquist frequency
_RESAMPLE_KAISER_BETA = 10.0  # Kaiser window shape (~100 dB stopband)


def resample_audio(audio: torch.Tensor, orig_rate: int, target_rate: int) -> torch.Tensor:
    """Band-limited resampling of `[..., samples]` from `orig_rate` to `target_rate` Hz (our own, no scipy/torchaudio).

    Polyphase windowed-sinc interpolation: the rates are reduced by their gcd to `down -> up`, output sample `n`
    sits at input time `n * down / up`, and each of the `up` phases has its own Kaiser-windowed sinc kernel
    (cutoff 0.945 of the lower Nyquist frequency, 32 zero crossings per side, beta 10). Computed in float64;
    the output has `ceil(samples * target_rate / orig_rate)` samples and the input's dtype.
    """
    if orig_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} -> {target_rate}")
    if orig_rate == target_rate:
        return audio
    check_sampling_rate(orig_rate, "resample_audio")
    check_sampling_rate(target_rate, "resample_audio")
    divisor = math.gcd(orig_rate, target_rate)
    down, up = orig_rate // divisor, target_rate // divisor
    cutoff = _RESAMPLE_ROLLOFF * min(1.0, up / down)  # in cycles per two input samples (1 = input Nyquist)
    half_width = _RESAMPLE_ZERO_CROSSINGS / cutoff  # kernel half-length in input samples
    reach = math.ceil(half_width)
    taps = torch.arange(-reach, down + reach, dtype=torch.float64)  # input offsets m around j * down
    phases = torch.arange(up, dtype=torch.float64)[:, None] * down / up  # [up, 1] fractional input positions
    t = phases - taps  # [up, taps] distance from output time to each tap
    window = torch.special.i0(_RESAMPLE_KAISER_BETA * torch.sqrt((1 - (t / half_width) ** 2).clamp(min=0)))
    window = torch.where(t.abs() <= half_width, window / torch.special.i0(torch.tensor(_RESAMPLE_KAISER_BETA)), 0)
    kernels = (cutoff * torch.sinc(cutoff * t) * window)[:, None, :]  # [up, 1, taps]

    leading, samples = audio.shape[:-1], audio.shape[-1]
    out_samples = -(-samples * up // down)
    steps = -(-out_samples // up)
    x = audio.reshape(-1, 1, samples).to(torch.float64)  # [signals, 1, samples]
    right = max(0, (steps - 1) * down + kernels.shape[-1] - (samples + reach))
    x = F.pad(x, (reach, right))
    y = F.conv1d(x, kernels.to(x.device), stride=down)[..., :steps]  # [signals, up, steps]
    y = y.transpose(1, 2).reshape(-1, steps * up)[:, :out_samples]
    return y.reshape(*leading, out_samples).to(audio.dtype)


__all__ = [
    "AUDIO_FILE_FORMATS", "audio_file_format", "audio_file_info", "check_sampling_rate", "read_audio_file",
    "resample_audio", "write_atomically", "write_audio",
]
