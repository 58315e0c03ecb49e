"""A dialogue between two speakers: speaker tags in the text, `synthesize` for one continuous waveform.

    python examples/dialogue.py [--model fishaudio/drama-3] [--output dialogue.wav]

`<|speaker:N|>` (N = 0..15) starts a speaker's turn; bracket cues like `[laughing]` and paired tags like
`<whisper>...</whisper>` are plain text the model understands. Without `--model` it uses the embedded tiny random
checkpoint (fast; it speaks noise).
"""

from transformers_drama3.synthesis import synthesize
from example_setup import example_parser, load_model_and_processor

DIALOGUE = (
    "<|speaker:0|> Did you buy the bread? "
    "<|speaker:1|> [laughing] Of course I did. Two loaves, still warm. "
    "<|speaker:0|> <whisper>Then hide one before the kids find it.</whisper>"
)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--output", default="dialogue.wav")
    args = parser.parse_args()

    model, processor = load_model_and_processor(args.model)

    settings = {"max_new_tokens": 12} if args.model is None else {}  # the tiny checkpoint rarely stops by itself
    speech = synthesize(model, processor, DIALOGUE, seed=0, **settings)
    processor.save_audio(speech.audio, args.output)
    print(f"{args.output}: {speech.duration:.2f} s in {len(speech.texts)} chunk(s)")


if __name__ == "__main__":
    main()
