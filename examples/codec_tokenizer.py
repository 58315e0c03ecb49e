"""The Fish DAC codec on its own, as an audio tokenizer: audio -> codes -> audio, saved and reloaded like any
transformers model.

    python examples/codec_tokenizer.py [--checkpoint DIR] [--audio speech.wav]

The default checkpoint is the tiny golden one (`tests/fixtures/tiny`, random weights), so the script runs anywhere;
with the real `fishaudio/drama-3` directory it reads the real codec from its `codec.pth`. Without `--audio` it
encodes a generated 2-second tone.
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel

import transformers_drama3  # noqa: F401  (registers fish_dac with AutoConfig / AutoModel)
from transformers_drama3 import FishDACCodec, FishOmniConfig
from transformers_drama3.audio_io import read_audio_file, write_audio

TINY = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=TINY, help="a Drama 3 checkpoint directory")
    parser.add_argument("--audio", help="a recording to encode (any sample rate; stereo is averaged)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "fish-dac-demo")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    # 1. The codec of a Drama 3 checkpoint: its constants from config.json, its weights from codec.pth.
    config = FishOmniConfig.from_pretrained(args.checkpoint).codec_config
    codec = FishDACCodec.from_codec_file(args.checkpoint / "codec.pth", config)

    # 2. Audio [samples] (or [channels, samples]) -> codes [1, 10, frames] -> audio [1, 1, frames * 2048], float32
    #    at 44.1 kHz. encode and decode return output classes, as transformers' DAC does.
    if args.audio:
        audio, rate = read_audio_file(args.audio, "--audio")
    else:
        rate = 44100
        audio = (0.3 * np.sin(2 * np.pi * 220 * np.arange(2 * rate) / rate)).astype(np.float32)
    codes = codec.encode(torch.as_tensor(audio), sampling_rate=rate).audio_codes
    decoded = codec.decode(codes).audio_values
    print(f"{len(audio) / rate:.2f} s of audio -> codes {tuple(codes.shape)} -> audio {tuple(decoded.shape)}")
    write_audio(args.out / "decoded.wav", decoded[0].numpy(), config.sample_rate)  # [channels, samples]

    # 3. Save it as a transformers model (config.json + model.safetensors) and load it back with AutoModel.
    codec.save_pretrained(args.out / "fish-dac")
    reloaded = AutoModel.from_pretrained(args.out / "fish-dac")
    assert torch.equal(reloaded.decode(codes).audio_values, decoded)
    print(f"saved to {args.out / 'fish-dac'}; AutoModel gives a {type(reloaded).__name__} that decodes identically")


if __name__ == "__main__":
    main()
