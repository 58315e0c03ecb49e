"""A dialogue between two speakers: speaker tags in the text, `synthesize` for one continuous waveform.

    python examples/dialogue.py [--model fishaudio/drama-3] [--output dialogue.wav]

`<|speaker:N|>` (N = 0..15) starts a speaker's turn; bracket cues like `[laughing]` and paired tags like
`<whisper>...</whisper>` are plain text the model understands. Without `--model` it uses the embedded tiny random
checkpoint (fast; it speaks noise).
"""

import argparse

import torch

import transformers_drama3  # noqa: F401  (registers Drama 3 with AutoModel / AutoProcessor)
from transformers import AutoModel, AutoProcessor
from transformers_drama3.synthesis import synthesize
from transformers_drama3.testing import default_tiny_checkpoint

DIALOGUE = (
    "<|speaker:0|> Did you buy the bread? "
    "<|speaker:1|> [laughing] Of course I did. Two loaves, still warm. "
    "<|speaker:0|> <whisper>Then hide one before the kids find it.</whisper>"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory or Hub id (default: the embedded tiny checkpoint)")
    parser.add_argument("--output", default="dialogue.wav")
    args = parser.parse_args()

    path = args.model or default_tiny_checkpoint()
    gpu = torch.cuda.is_available()
    model = AutoModel.from_pretrained(path, dtype=torch.bfloat16 if gpu else torch.float32,
                                      device_map="cuda" if gpu else None)
    processor = AutoProcessor.from_pretrained(path)

    settings = {"max_new_tokens": 12} if args.model is None else {}  # the tiny checkpoint rarely stops by itself
    speech = synthesize(model, processor, DIALOGUE, seed=0, **settings)
    processor.save_audio(speech.audio, args.output)
    print(f"{args.output}: {speech.duration:.2f} s in {len(speech.texts)} chunk(s)")


if __name__ == "__main__":
    main()
