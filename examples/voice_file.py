"""Make a reusable voice file from a reference recording, then use it in a prompt.

    python examples/voice_file.py [--model fishaudio/drama-3] [--audio me.wav --transcript "What I say in me.wav."]

Without `--audio` it uses a generated 3-second tone; without `--model` the embedded tiny random checkpoint, so the
script runs anywhere. Only the codec is loaded (a voice needs nothing else); with a whole model at hand, use
`model.codec`.
"""

import tempfile
from pathlib import Path

import numpy as np

import transformers_drama3  # noqa: F401  (registers the Drama 3 classes)
from transformers_drama3.checkpoint_location import checkpoint_directory
from transformers_drama3.configuration_drama3 import FishOmniConfig
from transformers_drama3.modeling_codec import FishDACCodec
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.voice import Drama3Voice
from example_setup import checkpoint_path, example_parser


def load_codec(checkpoint: Path) -> FishDACCodec:
    """The codec alone (a full model load gives the same object as `model.codec`)."""
    config = FishOmniConfig.from_pretrained(checkpoint)
    return FishDACCodec.from_codec_file(checkpoint / "codec.pth", config.codec_config)


def tone(seconds: float = 3.0, rate: int = 44100) -> np.ndarray:
    """A stand-in recording: a 220 Hz tone with a slow tremolo, float32 [samples]."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 2 * t))).astype(np.float32)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--audio", help="reference recording (10-30 s works best, at most 60 s)")
    parser.add_argument("--transcript", default="This is my voice, recorded on a quiet afternoon.")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "drama3-demo")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    checkpoint = Path(checkpoint_directory(checkpoint_path(args.model)))  # a Hub id is downloaded (or cached) once
    processor = Drama3Processor.from_pretrained(checkpoint, codec=load_codec(checkpoint))

    # 1. Encode the reference once and save it.
    audio, rate = (args.audio, None) if args.audio else (tone(), 44100)
    voice = processor.create_voice(args.transcript, audio, sampling_rate=rate, name="demo")
    path = voice.save(args.out / "demo.voice.safetensors")
    print(f"voice: {voice.codes.shape[1]} frames -> {path} ({path.stat().st_size} bytes)")

    # 2. Later: load it and build a prompt; no audio and no codec needed.
    voice = Drama3Voice.load(path)
    inputs = processor("<|speaker:0|> Hello, this is a cloned voice.", references=[voice])
    print(f"prompt rows: {tuple(inputs['input_ids'].shape)}")

    # 3. Listen to what the codes hold: decode them and write a WAV file.
    frames = processor.build_prompt_rows("x", references=[voice])  # the reference's audio rows are in here
    wav = processor.save_audio(processor.frames_to_audio(frames), args.out / "voice-decoded.wav")
    print(f"decoded reference: {wav}")


if __name__ == "__main__":
    main()
