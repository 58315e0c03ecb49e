"""Resampling side by side: the package's former polyphase windowed-sinc filter against `soxr` (HQ and VHQ).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/resampling.py

Quality, on known signals (float64 in, the error against the exact continuous signal away from the edges):
  - passband: a 1 kHz and a 15 kHz sine resampled; the largest error against the sine evaluated at the output times;
  - stop band: a tone above the new Nyquist frequency (48 -> 44.1 kHz: 23 kHz; 44.1 -> 24 kHz: 12.5 kHz) must vanish:
    its residual level in dB relative to the tone (lower is better).
Speed: 10 s of noise at the rate changes the package makes (16 and 48 kHz references -> 44.1 kHz for the codec,
44.1 -> 24/48 kHz for the server's pcm/opus), best of 5, float32 as the package calls it.
"""

from __future__ import annotations

import math
import time

import numpy as np
import soxr
import torch
import torch.nn.functional as F

SECONDS = 10
EDGE = 2000  # output samples left out at each end: the filters' start-up


def polyphase_sinc(audio: torch.Tensor, orig_rate: int, target_rate: int) -> torch.Tensor:
    """The package's former `resample_audio` (Kaiser-windowed sinc, 32 zero crossings, rolloff 0.945, beta 10),
    kept here only to measure it against soxr."""
    divisor = math.gcd(orig_rate, target_rate)
    down, up = orig_rate // divisor, target_rate // divisor
    cutoff = 0.945 * min(1.0, up / down)
    half_width = 32 / cutoff
    reach = math.ceil(half_width)
    taps = torch.arange(-reach, down + reach, dtype=torch.float64)
    phases = torch.arange(up, dtype=torch.float64)[:, None] * down / up
    t = phases - taps
    window = torch.special.i0(10.0 * torch.sqrt((1 - (t / half_width) ** 2).clamp(min=0)))
    window = torch.where(t.abs() <= half_width, window / torch.special.i0(torch.tensor(10.0)), 0)
    kernels = (cutoff * torch.sinc(cutoff * t) * window)[:, None, :]
    samples = audio.shape[-1]
    out_samples = -(-samples * up // down)
    steps = -(-out_samples // up)
    x = audio.reshape(1, 1, samples).to(torch.float64)
    right = max(0, (steps - 1) * down + kernels.shape[-1] - (samples + reach))
    y = F.conv1d(F.pad(x, (reach, right)), kernels, stride=down)[..., :steps]
    return y.transpose(1, 2).reshape(-1)[:out_samples].to(audio.dtype)


RESAMPLERS = {
    "polyphase sinc (former)": lambda x, a, b: polyphase_sinc(torch.from_numpy(x), a, b).numpy(),
    "soxr HQ": lambda x, a, b: soxr.resample(x, a, b, quality="HQ"),
    "soxr VHQ": lambda x, a, b: soxr.resample(x, a, b, quality="VHQ"),
}


def tone(frequency: float, rate: int, samples: int) -> np.ndarray:
    return np.sin(2 * np.pi * frequency * np.arange(samples) / rate)


def passband_error(resample, frequency: float, orig: int, target: int) -> float:
    x = tone(frequency, orig, orig * 2)
    y = resample(x, orig, target)
    expected = tone(frequency, target, len(y))
    return float(np.abs(y - expected)[EDGE:-EDGE].max())


def stopband_db(resample, frequency: float, orig: int, target: int) -> float:
    x = tone(frequency, orig, orig * 2)
    y = resample(x, orig, target)[EDGE:-EDGE]
    return float(20 * np.log10(max(np.sqrt(np.mean(y**2)) / np.sqrt(0.5), 1e-30)))


def speed_ms(resample, orig: int, target: int) -> float:
    x = np.random.default_rng(0).standard_normal(orig * SECONDS).astype(np.float32) * 0.1
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        resample(x, orig, target)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'resampler':<24} {'1 kHz err':>10} {'15 kHz err':>10} {'48->44.1 stop':>14} {'44.1->24 stop':>14}"
          f" {'16->44.1':>9} {'48->44.1':>9} {'44.1->24':>9} {'44.1->48':>9}  (errors of a unit sine; dB; ms/10 s)")
    for name, resample in RESAMPLERS.items():
        quality = [passband_error(resample, 1000, 44100, 48000), passband_error(resample, 15000, 48000, 44100),
                   stopband_db(resample, 23000, 48000, 44100), stopband_db(resample, 12500, 44100, 24000)]
        speeds = [speed_ms(resample, a, b) for a, b in ((16000, 44100), (48000, 44100), (44100, 24000),
                                                        (44100, 48000))]
        print(f"{name:<24} {quality[0]:>10.1e} {quality[1]:>10.1e} {quality[2]:>14.1f} {quality[3]:>14.1f}"
              + "".join(f" {value:>9.1f}" for value in speeds))


if __name__ == "__main__":
    main()
