"""CUDA graphs: `generate(..., fast_decode=True)` against the eager frame step, same settings, same frames.

    python examples/fast_decode.py [--model fishaudio/drama-3] [--batch 4] [--frames 64]

Runs a greedy batch both ways, checks that the frames are identical, and prints the time per frame of each. On a
CUDA device `fast_decode=True` replays the frame step as a captured CUDA graph; its first call also builds the frame
state and captures the graph, so it is timed apart (later calls reuse both). Elsewhere (a CPU, offloading) it runs
the same eager step, so both cost the same. Without `--model` the embedded tiny random checkpoint is used.
"""

import time

import torch

from example_setup import example_parser, load_model_and_processor


def timed_generate(model, inputs, **settings):
    """`generate` and the seconds it took (the device synchronised at the end)."""
    start = time.perf_counter()
    out = model.generate(**inputs, **settings)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--batch", type=int, default=4, help="texts generated together (default 4)")
    parser.add_argument("--frames", type=int, default=64, help="frames per text (default 64, ~3 s of audio)")
    args = parser.parse_args()

    model, processor = load_model_and_processor(args.model)
    texts = [f"<|speaker:{i % 2}|> This is sentence number {i + 1}, spoken as fast as the model can."
             for i in range(args.batch)]
    inputs = processor(texts).to(model.device)
    settings = {"do_sample": False, "max_new_tokens": args.frames, "output_audio": False}

    regular, regular_s = timed_generate(model, inputs, **settings)
    _, cold_s = timed_generate(model, inputs, fast_decode=True, **settings)  # on CUDA: builds the state, captures
    fast, fast_s = timed_generate(model, inputs, fast_decode=True, **settings)

    same = all(torch.equal(a, b) for a, b in zip(regular.codes, fast.codes))
    frames = max(codes.shape[1] for codes in regular.codes)
    print(f"{args.batch} texts, up to {frames} frames each; identical frames on both paths: {same}")
    print(f"eager step:                   {1e3 * regular_s / frames:8.1f} ms per frame")
    print(f"fast_decode=True, first call: {1e3 * cold_s / frames:8.1f} ms per frame"
          f"{' (builds the state, captures the CUDA graph)' if model.device.type == 'cuda' else ''}")
    print(f"fast_decode=True, later:      {1e3 * fast_s / frames:8.1f} ms per frame ({regular_s / fast_s:.2f}x the eager step)")
    print(f"one frame is {1e3 * 2048 / model.config.sampling_rate:.1f} ms of audio")
    model.reset_frame_states()  # frees the kept frame states and CUDA graphs


if __name__ == "__main__":
    main()
