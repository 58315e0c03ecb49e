"""Running the frame step fast: `generate(..., fast_decode=True)` (a CUDA graph per frame) and `compile_step=True`
(torch.compile first), against the eager step: same settings, same frames.

    python examples/fast_decode.py [--model fishaudio/drama-3] [--batch 4] [--frames 64] [--compile]

Runs a greedy batch each way, checks that the frames are identical, and prints the time per frame of each. The
first call of a way also compiles and captures, so it is timed apart (later calls reuse both). On a CPU there is no
graph to capture: `fast_decode=True` runs the same eager step there. `--compile` adds the compiled step (minutes of
compiling on a CPU). Without `--model` the embedded tiny random checkpoint is used.
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
    parser.add_argument("--compile", action="store_true", help="also run the compiled step (compile_step=True)")
    args = parser.parse_args()

    model, processor = load_model_and_processor(args.model)
    texts = [f"<|speaker:{i % 2}|> This is sentence number {i + 1}, spoken as fast as the model can."
             for i in range(args.batch)]
    inputs = processor(texts).to(model.device)
    settings = {"do_sample": False, "max_new_tokens": args.frames, "output_audio": False}
    ways = {"eager step": {}, "fast_decode=True": {"fast_decode": True}}
    if args.compile:
        ways["fast_decode + compile_step"] = {"fast_decode": True, "compile_step": True}

    eager, eager_s = timed_generate(model, inputs, **settings)
    frames = max(codes.shape[1] for codes in eager.codes)
    print(f"{args.batch} texts, up to {frames} frames each; one frame is "
          f"{1e3 * 2048 / model.config.sampling_rate:.1f} ms of audio")
    print(f"{'eager step':<28}{1e3 * eager_s / frames:8.1f} ms per frame")
    for name, way in list(ways.items())[1:]:
        _, cold_s = timed_generate(model, inputs, **way, **settings)  # compiles / captures
        out, warm_s = timed_generate(model, inputs, **way, **settings)
        same = all(torch.equal(a, b) for a, b in zip(eager.codes, out.codes))
        print(f"{name:<28}{1e3 * warm_s / frames:8.1f} ms per frame ({eager_s / warm_s:.2f}x the eager step; first "
              f"call {cold_s:.1f} s); identical frames: {same}")
    model.reset_frame_states()  # frees the states and graphs kept for later calls


if __name__ == "__main__":
    main()
