"""Speak on a CPU: the CPU path a plain load takes here, against the float32 reference, on the same text.

    python examples/cpu_path.py [--model fishaudio/drama-3] [--text "Hello there."] [--output cpu.wav]

On a machine without a GPU `from_pretrained` without a dtype takes the CPU path (`model.cpu_path`: "float16" on
every CPU: float16 weights over float32 activations), and its frame step runs compiled once a compiled step is
stored: the first run compiles it in a background process for the runs after it (docs/usage.md, "The CPU path").
`cpu_path="float32"` (or `DRAMA3_CPU_PATH=float32`) opts out. Without `--model` it uses the embedded tiny random
checkpoint: it runs anywhere in seconds and speaks noise.
"""

import time

import soundfile

from transformers_drama3 import Drama3Processor, FishOmniForSpeech
from transformers_drama3.testing import default_tiny_checkpoint
from example_setup import example_parser


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--text", default="Hello there! How are you today?")
    parser.add_argument("--output", default="cpu.wav")
    args = parser.parse_args()
    path = args.model or default_tiny_checkpoint()
    frames = 16 if args.model is None else 2048  # the tiny checkpoint rarely ends on its own

    for choice in ("auto", "float32"):
        model = FishOmniForSpeech.from_pretrained(path, cpu_path=choice).eval()
        processor = Drama3Processor.from_pretrained(path, codec=model.codec)
        inputs = processor(args.text)
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=frames, do_sample=False)
        seconds = time.perf_counter() - start
        audio = out.audio[0].numpy()
        print(f"cpu_path={choice!r} ran {model.cpu_path}: {len(audio) / 44100:.2f} s of audio in {seconds:.2f} s")
        if choice == "auto":
            soundfile.write(args.output, audio, 44100)
            print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
