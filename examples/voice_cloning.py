"""Clone a voice from a short recording and its transcript, save the voice, and speak new text with it.

    python examples/voice_cloning.py [--model fishaudio/drama-3] [--audio me.wav --transcript "What I say."]

A reference of 10-30 s works best (at most 60 s). The codec turns it into codes once; the saved voice file
(`.safetensors`, about 100 KB a minute) is reused without the audio. Without `--audio` a generated tone stands in
for the recording; without `--model` the embedded tiny random checkpoint is used (fast; it speaks noise).
"""

import numpy as np

from transformers_drama3.synthesis import synthesize
from transformers_drama3.voice import Drama3Voice
from example_setup import example_parser, load_model_and_processor


def tone(seconds: float = 2.0, rate: int = 44100) -> np.ndarray:
    """A stand-in recording: a 220 Hz tone with a slow tremolo, float32 [samples]."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 2 * t))).astype(np.float32)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--audio", help="reference recording (any format soundfile reads)")
    parser.add_argument("--transcript", default="This is my voice, recorded on a quiet afternoon.")
    parser.add_argument("--text", default="Hello again! This sentence was never recorded.")
    parser.add_argument("--output", default="cloned.wav")
    parser.add_argument("--voice-file", default="my.voice.safetensors")
    args = parser.parse_args()

    model, processor = load_model_and_processor(args.model)
    settings = {"max_new_tokens": 12} if args.model is None else {}  # the tiny checkpoint rarely stops by itself

    # 1. Encode the reference once and keep it as a voice file.
    audio, rate = (args.audio, None) if args.audio else (tone(), 44100)
    voice = processor.create_voice(args.transcript, audio, sampling_rate=rate)  # by the processor's codec
    voice.save(args.voice_file)
    print(f"{args.voice_file}: {voice.codes.shape[1]} frames of reference")

    # 2. Speak with it. A dict {"transcript", "audio"} works too: synthesize encodes it once per call.
    speech = synthesize(model, processor, args.text, references=[Drama3Voice.load(args.voice_file)], seed=0, **settings)
    processor.save_audio(speech.audio, args.output)
    print(f"{args.output}: {speech.duration:.2f} s")


if __name__ == "__main__":
    main()
