"""`aac` (AAC-LC in ADTS, `serving/audio_encoding.py`'s `AdtsEncoder`, FFmpeg's encoder through PyAV): what it
encodes is what PyAV's decoder gives back, after the encoder's priming, whatever the pieces it was given."""

from __future__ import annotations

import io

import av
import numpy as np

from transformers_drama3.serving.audio_encoding import AAC_PRIMING, AdtsEncoder, response_encoder

RATE = 44100
AAC_FRAME = 1024  # samples per AAC-LC frame


def decode_adts(data: bytes) -> tuple[np.ndarray, int, int]:
    """(float32 samples `[n]`, sampling rate, channels) of an ADTS stream, by PyAV's decoder."""
    with av.open(io.BytesIO(data), format="adts") as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]  # [channels, n] planar float
        return np.concatenate(frames, axis=1)[0], stream.codec_context.sample_rate, stream.codec_context.channels


def tone(seconds: float = 1.0, frequency: float = 440.0) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.5 * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def encoded(samples: np.ndarray, pieces: int, streamed: bool = True) -> bytes:
    encoder = AdtsEncoder(RATE, streamed=streamed)
    data = b"".join(encoder.encode(piece) for piece in np.array_split(samples, pieces))
    return data + encoder.finish()


def test_adts_frames_decode_to_the_tone():
    """Every ADTS frame starts with the 12-bit sync word; the decoded audio is mono 44.1 kHz, the input's length after
    the priming (rounded up to whole frames), and the tone: its spectral peak at 440 Hz and its level within 0.5 dB.
    An AAC-LC encoder keeps a steady tone far inside its band (it low-passes above ~15 kHz) and its quantisation
    noise is well below the tone at 128 kb/s, so neither bound depends on the machine."""
    samples = tone()
    data = encoded(samples, pieces=7)
    assert data[0] == 0xFF and data[1] & 0xF0 == 0xF0
    decoded, rate, channels = decode_adts(data)
    assert rate == RATE and channels == 1
    assert AAC_PRIMING + len(samples) <= len(decoded) < AAC_PRIMING + len(samples) + 2 * AAC_FRAME
    speech = decoded[AAC_PRIMING : AAC_PRIMING + len(samples)]
    spectrum = np.abs(np.fft.rfft(speech))
    assert abs(np.argmax(spectrum) * RATE / len(speech) - 440.0) <= RATE / len(speech)  # one bin
    level = 10 * np.log10(np.mean(speech**2) / np.mean(samples**2))
    assert abs(level) <= 0.5


def test_bytes_do_not_depend_on_the_pieces_or_streaming():
    """The encoder regroups pieces into whole AAC frames, and ADTS has no header to rework at the end: a streamed
    response is byte for byte the complete one, however the audio was cut."""
    samples = tone(0.5, 1000.0)
    one = encoded(samples, pieces=1, streamed=False)
    assert encoded(samples, pieces=13) == one and encoded(samples, pieces=3) == one


def test_response_encoder_chooses_adts_for_aac():
    encoder = response_encoder("aac", RATE, streamed=True)
    assert isinstance(encoder, AdtsEncoder) and encoder.sampling_rate == RATE
    assert encoder.encode(np.zeros(0, dtype=np.float32)) == b""
