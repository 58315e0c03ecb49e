"""Stream audio while it is generated: `Drama3AudioStreamer` with `model.generate` running in a thread.

    python examples/streaming.py [--model fishaudio/drama-3] [--output streamed.wav]

The streamer hands out float32 chunks (the first after one frame, then every 7 frames, ~0.33 s); here they are
appended to a WAV file as they arrive, which is where a player or a network socket would take them. The chunks
together equal the audio of a non-streamed run. Without `--model` the embedded tiny random checkpoint is used.
"""

import threading
import time

import soundfile

from transformers_drama3 import Drama3AudioStreamer
from example_setup import example_parser, load_model_and_processor


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--text", default="Streaming means the first words play while the rest is still being made.")
    parser.add_argument("--output", default="streamed.wav")
    args = parser.parse_args()

    model, processor = load_model_and_processor(args.model)
    settings = {"max_new_tokens": 24} if args.model is None else {}  # the tiny checkpoint rarely stops by itself

    inputs = processor(args.text).to(model.device)
    streamer = Drama3AudioStreamer(model.codec, chunk_frames=7, first_chunk_frames=1)
    generation = threading.Thread(target=model.generate, kwargs={**inputs, "streamer": streamer, "seed": 0, **settings})
    start = time.perf_counter()
    generation.start()
    with soundfile.SoundFile(args.output, "w", model.config.sampling_rate, 1, "PCM_16") as wav:
        for index, chunk in enumerate(streamer):  # ends when generation ends
            wav.write(chunk.numpy())
            print(f"chunk {index}: {len(chunk) / model.config.sampling_rate:.2f} s of audio "
                  f"after {time.perf_counter() - start:.2f} s")
    generation.join()
    print(f"{args.output}: {sum(len(c) for c in streamer.chunks) / model.config.sampling_rate:.2f} s")


if __name__ == "__main__":
    main()
