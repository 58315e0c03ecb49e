"""Speak a long text: `synthesize` splits it into chunks and keeps the voice steady across them.

    python examples/long_text.py [--model fishaudio/drama-3] [--text-file story.txt] [--output story.wav]

Each chunk (at most `--chunk-bytes` UTF-8 bytes, cut after sentences) is generated with the first chunk and the
previous one as history, and all chunks are decoded as one stream, so the result is one continuous waveform. A
progress bar counts the chunks. Without `--model` the embedded tiny random checkpoint is used (fast; it speaks
noise).
"""

from pathlib import Path


from transformers_drama3.synthesis import synthesize
from example_setup import example_parser, load_model_and_processor

STORY = (
    "The lighthouse keeper woke before dawn, as he had every day for thirty years. "
    "He climbed the spiral stairs, counting them out of habit: one hundred and twelve. "
    "At the top, the lamp was still turning, patient and bright, sweeping the grey water. "
    "Far out, a small boat was heading for the harbour, its engine coughing in the cold. "
    "He watched it until it passed the rocks, then poured himself a cup of tea and smiled."
)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--text-file", type=Path, help="UTF-8 text to speak (default: a short story)")
    parser.add_argument("--chunk-bytes", type=int, default=300)
    parser.add_argument("--output", default="story.wav")
    args = parser.parse_args()

    model, processor = load_model_and_processor(args.model)
    settings = {"max_new_tokens": 6} if args.model is None else {}  # the tiny checkpoint rarely stops by itself

    text = args.text_file.read_text(encoding="utf-8") if args.text_file else STORY
    speech = synthesize(model, processor, text, chunk_bytes=args.chunk_bytes, seed=0, **settings)
    for chunk, codes, reason in zip(speech.texts, speech.codes, speech.finish_reasons):
        print(f"{codes.shape[1]:5d} frames ({reason:6s}) {chunk[:70]}")
    processor.save_audio(speech.audio, args.output)
    print(f"{args.output}: {speech.duration:.2f} s")


if __name__ == "__main__":
    main()
