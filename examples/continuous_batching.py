"""Continuous batching from Python: requests join the running batch at the next frame, each with its own settings.

    python examples/continuous_batching.py [--model fishaudio/drama-3]

`Drama3Engine` runs the frames in a background thread. A long request starts; two short ones with other sampling
settings arrive while it speaks and are admitted between two frames, without waiting for it. Each request's frames
are decoded to audio as they come (`Drama3AudioStreamer`, one per request) and written to its own WAV file. Without
`--model` the embedded tiny random checkpoint is used (it speaks noise).
"""

import threading
import time

import soundfile
import torch

from transformers_drama3 import Drama3AudioStreamer, Drama3Engine
from example_setup import example_parser, load_model_and_processor


def main() -> None:
    args = example_parser(__doc__).parse_args()
    model, processor = load_model_and_processor(args.model)
    frames = (40, 12, 12) if args.model is None else (None, None, None)  # the tiny checkpoint rarely stops by itself
    requests = [
        ("long.wav", "This is the long one: it keeps speaking while the others join.", {"seed": 0}),
        ("greedy.wav", "A short greedy reply.", {"do_sample": False}),
        ("warm.wav", "A short, warmer one.", {"seed": 1, "temperature": 0.8, "top_p": 0.8}),
    ]
    start = time.perf_counter()
    done = threading.Event()
    streams, first_audio, left = {}, {}, [len(requests)]

    def on_frame(request_id, codes):  # in the engine's thread
        streams[request_id].put(codes[None])  # [1, NCB]

    def on_finish(result):  # once per request, whatever ended it (a failure too: then result.error says why)
        streams[result.request_id].end()
        print(f"{result.request_id}: {result.frames} frames, {result.finish_reason}, first audio after "
              f"{first_audio.get(result.request_id, float('nan')):.2f} s" + (f": {result.error}" if result.error else ""))
        left[0] -= 1
        if not left[0]:
            done.set()

    with Drama3Engine(model, max_batch=4) as engine:
        for index, ((name, text, settings), limit) in enumerate(zip(requests, frames)):
            if index:
                time.sleep(0.3)  # the others arrive while the first one speaks
            chunks = []

            def on_audio(sequence, chunk, name=name, chunks=chunks):
                if chunk is None:
                    audio = torch.cat(chunks) if chunks else torch.zeros(0)
                    soundfile.write(name, audio.numpy(), model.config.sampling_rate)
                    return
                first_audio.setdefault(name, time.perf_counter() - start)
                chunks.append(chunk)

            inputs = processor(text)
            request_id = name
            streams[request_id] = Drama3AudioStreamer(model.codec, on_audio=on_audio)
            engine.add_request(inputs["input_ids"][0], request_id=request_id, max_new_tokens=limit,
                               on_frame=on_frame, on_finish=on_finish, **settings)
        done.wait()


if __name__ == "__main__":
    main()
