"""Audio files in and out, resampling, and atomic file writes.

soundfile (libsndfile) is imported on first use, so importing the package needs no audio I/O library. Files are
written atomically (`write_atomically`): a failed or interrupted write never leaves a half-written file behind.

Written files are reproducible: the same samples give the same bytes, whether they are written at once
(`write_audio`) or chunk by chunk as they are generated (`AudioFileWriter`). Both hand the samples to the encoder in
blocks of one codec frame (`WRITE_BLOCK`), because the Vorbis encoder's output depends on how the samples arrive,
and an Ogg file gets a fixed stream serial number (`OGG_SERIAL`) instead of libsndfile's clock-seeded random one.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch
import torch.nn.functional as F

# Writable audio files: suffix -> (soundfile format, subtype).
AUDIO_FILE_FORMATS = {".wav": ("WAV", "PCM_16"), ".flac": ("FLAC", "PCM_16"), ".ogg": ("OGG", "VORBIS")}
WRITE_BLOCK = 2048  # samples handed to the encoder at a time: one Drama 3 codec frame
OGG_SERIAL = 0x44524133  # b"DRA3" read as a little-endian number: the stream serial of every Ogg file written here


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


def check_audio_layout(shape: tuple[int, ...], where: str, batched: bool = False) -> None:
    """The package's one audio layout, samples last: `[samples]` (mono) or `[channels, samples]` for one recording,
    and `[batch, channels, samples]` for a batch (the codec's, when `batched`). Refuses other ranks, no samples, and a
    recording with at least as many channels as samples: that is `[samples, channels]` (soundfile's order)."""
    layouts = "[samples], [channels, samples] or [batch, channels, samples]" if batched else "[samples] or [channels, samples]"
    if len(shape) not in ((1, 2, 3) if batched else (1, 2)) or 0 in shape:
        raise ValueError(f"{where}: audio must be {layouts}, not empty; got shape {list(shape)}")
    if len(shape) > 1 and shape[-2] >= shape[-1]:
        raise ValueError(f"{where}: audio of shape {list(shape)} has more channels than samples: it looks like "
                         "[samples, channels]; transpose it (audio.T) to [channels, samples]")


def audio_file_header(path: str | os.PathLike, where: str):
    """soundfile's header info of an audio file (`frames`, `samplerate`, `channels`, ...), read without its samples;
    clear errors for a missing, unreadable or non-audio file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{where}: audio file {str(path)!r} does not exist")
    try:
        return soundfile().info(str(path))
    except soundfile().LibsndfileError as error:
        raise ValueError(f"{where}: cannot read audio file {str(path)!r}: {error}") from error


def audio_file_info(path: str | os.PathLike, where: str) -> tuple[int, int]:
    """(samples, sampling rate) of an audio file, read from its header only (`audio_file_header`)."""
    info = audio_file_header(path, where)
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
    [-1, 1]. The file appears complete or not at all; an existing file is replaced only on success. The bytes equal
    those of an `AudioFileWriter` given the same samples in any chunks.
    """
    audio_file_format(path)
    rate = check_sampling_rate(sampling_rate, "save_audio")
    samples = _waveform(audio)
    if samples.ndim == 2:  # [channels, samples] -> soundfile's [samples, channels], or [samples] for one channel
        samples = samples[0] if samples.shape[0] == 1 else samples.T
    elif samples.ndim != 1:
        raise ValueError(f"audio must be [samples] or [channels, samples]; got shape {samples.shape}")
    if not np.isfinite(samples).all():
        raise ValueError("audio contains NaN or infinite values")

    def write(file: BinaryIO) -> None:
        with AudioFileWriter(file, path, rate, channels=1 if samples.ndim == 1 else samples.shape[1]) as writer:
            writer.write(samples)

    return write_atomically(path, write)


def _waveform(audio: Any) -> np.ndarray:
    """`audio` (a tensor, an array or a list of numbers) as a float32 array; one waveform, not a list of them."""
    if isinstance(audio, torch.Tensor):
        return audio.detach().to(device="cpu", dtype=torch.float32).numpy()
    if isinstance(audio, (list, tuple)) and any(isinstance(item, (torch.Tensor, np.ndarray)) for item in audio):
        raise ValueError(
            f"save_audio takes one waveform [samples] (or [channels, samples]); got a list of {len(audio)} arrays "
            "(generate returns one waveform per text in `out.audio`): save each to its own file, e.g. "
            "save_audio(out.audio[0], path)"
        )
    try:
        return np.asarray(audio, dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise ValueError(f"audio must be a float tensor or array [samples] or [channels, samples]: {error}") from error


class AudioFileWriter:
    """An audio file written in pieces (a context manager): `write(samples)` as they come, `close()` at the end.

    `file` is an open binary file (or a path) and `path` names the format (its suffix, see `audio_file_format`).
    Samples `[n]` or `[n, channels]` are clipped to [-1, 1] and handed to the encoder in blocks of `WRITE_BLOCK`, and
    an Ogg file gets the serial `OGG_SERIAL` when closed, so the file's bytes depend on the samples only, not on the
    sizes of the pieces: a streamed file equals the file `write_audio` makes of the same samples.
    """

    def __init__(self, file, path: str | os.PathLike, sampling_rate: int, channels: int = 1):
        file_format, subtype = audio_file_format(path)
        self.file, self.ogg = file, file_format == "OGG"
        self.sound = soundfile().SoundFile(file, "w", sampling_rate, channels, subtype, format=file_format)
        self.pending = np.zeros((0,) if channels == 1 else (0, channels), dtype=np.float32)  # < WRITE_BLOCK samples

    def write(self, samples: np.ndarray) -> None:
        samples = np.concatenate([self.pending, np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)])
        whole = len(samples) - len(samples) % WRITE_BLOCK
        for start in range(0, whole, WRITE_BLOCK):
            self.sound.write(samples[start : start + WRITE_BLOCK])
        self.pending = samples[whole:]
        self.sound.flush()  # a reader of the growing file (a player) gets what was written so far

    def close(self) -> None:
        try:
            if len(self.pending):
                self.sound.write(self.pending)
        finally:
            self.sound.close()
        if self.ogg:
            set_ogg_serial(self.file, OGG_SERIAL)

    def __enter__(self) -> AudioFileWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.sound.close()  # the file is thrown away (write_atomically): no serial to fix


_BIT_REVERSED_BYTES = bytes(int(f"{value:08b}"[::-1], 2) for value in range(256))


def ogg_crc(page: bytes) -> int:
    """The CRC of an Ogg page (checksum field zeroed): CRC-32 with polynomial 0x04C11DB7, initial value 0, no bit
    reflection and no final XOR. zlib computes the bit-reflected CRC-32 in C; reversing the bits of every input byte
    and of the result turns one into the other (Python has no library for the unreflected variant)."""
    reflected = zlib.crc32(page.translate(_BIT_REVERSED_BYTES), 0xFFFFFFFF) ^ 0xFFFFFFFF  # initial register 0
    return int(f"{reflected:032b}"[::-1], 2)


def set_ogg_serial(file, serial: int) -> None:
    """Rewrite, in place, the stream serial number of every page of the Ogg file `file` (an open binary file or a
    path) and the pages' checksums. libsndfile picks a new random serial for every file it writes, so two files of
    the same audio differ by these bytes alone."""
    with open(file, "r+b") if isinstance(file, (str, os.PathLike)) else contextlib.nullcontext(file) as stream:
        stream.seek(0)
        data = bytearray(stream.read())
        position = 0
        while position < len(data):
            if data[position : position + 4] != b"OggS":
                raise ValueError(f"not an Ogg page at byte {position}")
            segments = data[position + 26]
            end = position + 27 + segments + sum(data[position + 27 : position + 27 + segments])
            struct.pack_into("<I", data, position + 14, serial)
            struct.pack_into("<I", data, position + 22, 0)
            struct.pack_into("<I", data, position + 22, ogg_crc(bytes(data[position:end])))
            position = end
        stream.seek(0)
        stream.write(data)


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
        with open(temporary, "x+b") as file:  # readable too: a writer may rework what it wrote (set_ogg_serial)
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
    "AUDIO_FILE_FORMATS", "OGG_SERIAL", "WRITE_BLOCK", "AudioFileWriter", "audio_file_format", "audio_file_header",
    "audio_file_info", "check_sampling_rate", "ogg_crc", "read_audio_file", "resample_audio", "set_ogg_serial",
    "write_atomically", "write_audio",
]
