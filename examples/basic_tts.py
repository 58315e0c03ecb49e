"""Speak one sentence with `pipeline("text-to-speech")` and write a WAV file.

    python examples/basic_tts.py [--model fishaudio/drama-3] [--text "Hello there."] [--output hello.wav]

Without `--model` it uses the embedded tiny random checkpoint: it runs anywhere in seconds and speaks noise.
"""

import soundfile

import transformers_drama3  # noqa: F401  (registers Drama 3 with AutoModel / AutoProcessor / pipeline)
from transformers import pipeline
from transformers_drama3.testing import default_tiny_checkpoint
from example_setup import example_parser


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--text", default="Hello there! How are you today?")
    parser.add_argument("--output", default="hello.wav")
    args = parser.parse_args()

    tts = pipeline("text-to-speech", model=args.model or default_tiny_checkpoint())
    # Drama 3 settings go in generate_kwargs; the tiny checkpoint rarely ends on its own, so cap it at 16 frames.
    generate_kwargs = {"max_new_tokens": 16} if args.model is None else {}
    out = tts(args.text, generate_kwargs=generate_kwargs, forward_params={"seed": 0})

    soundfile.write(args.output, out["audio"], out["sampling_rate"])
    print(f"{args.output}: {len(out['audio']) / out['sampling_rate']:.2f} s at {out['sampling_rate']} Hz")


if __name__ == "__main__":
    main()
