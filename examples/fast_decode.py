"""The fast decode path: `generate(..., fast_decode=True)` against the regular loop, same settings, same frames.

    python examples/fast_decode.py [--model fishaudio/drama-3] [--batch 4] [--frames 64]

Runs a greedy batch on both paths, checks that the frames are identical, and prints the time per frame of each.
On a GPU the fast path replays one captured CUDA graph per frame; its first call also allocates its state and
captures the graph, so it is timed apart (later calls reuse both). On a CPU there is no graph and the two paths
cost about the same. Without `--model` the embedded tiny random checkpoint is used.
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
    _, cold_s = timed_generate(model, inputs, fast_decode=True, **settings)  # builds the state (and captures)
    fast, fast_s = timed_generate(model, inputs, fast_decode=True, **settings)

    same = all(torch.equal(a, b) for a, b in zip(regular.codes, fast.codes))
    frames = max(codes.shape[1] for codes in regular.codes)
    print(f"{args.batch} texts, up to {frames} frames each; identical frames on both paths: {same}")
    print(f"regular loop:           {1e3 * regular_s / frames:8.1f} ms per frame")
    print(f"fast path, first call:  {1e3 * cold_s / frames:8.1f} ms per frame (allocates its state"
          f"{', captures the CUDA graph' if torch.cuda.is_available() else ''})")
    print(f"fast path, later calls: {1e3 * fast_s / frames:8.1f} ms per frame ({regular_s / fast_s:.2f}x the regular loop)")
    print(f"one frame is {1e3 * 2048 / model.config.sampling_rate:.1f} ms of audio")
    model.reset_fast_decode()  # frees the fast path's buffers and graphs


if __name__ == "__main__":
    main()
