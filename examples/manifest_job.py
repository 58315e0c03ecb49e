"""Speak a list of texts into a folder of files with a manifest job, then run it again: done items are skipped.

    python examples/manifest_job.py [--model fishaudio/drama-3] [--output-dir lines/]

The manifest (JSON Lines, one item a line) is written here: a narration, a dialogue and a line in FLAC. Each item
becomes `ID.FORMAT` in the output folder and a record in `results.jsonl`; the items of one chunk are generated
together, batched by length. The same job from the command line, also under `torchrun` over several GPUs:
`drama3-tts --model DIR --manifest lines.jsonl --output-dir lines/` (docs/scaling.md). Without `--model` the
embedded tiny random checkpoint is used (fast; it speaks noise).
"""

import json
from pathlib import Path

from transformers_drama3.jobs import records_in, run_manifest
from example_setup import example_parser, load_model_and_processor

ITEMS = [
    {"id": "narration", "text": "The lighthouse keeper woke before dawn, as he had every day for thirty years."},
    {"id": "dialogue", "text": "<|speaker:0|> Did you buy the bread? <|speaker:1|> Of course I did.", "seed": 7},
    {"id": "promo", "text": "Now with more voices.", "format": "flac", "temperature": 0.7},
]


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--output-dir", type=Path, default=Path("lines"))
    args = parser.parse_args()

    model, processor = load_model_and_processor(args.model)
    settings = {"max_new_tokens": 6} if args.model is None else {}  # the tiny checkpoint rarely stops by itself
    args.output_dir.mkdir(parents=True, exist_ok=True)
    manifest = args.output_dir / "lines.jsonl"
    manifest.write_text("".join(json.dumps(item) + "\n" for item in ITEMS), encoding="utf-8")

    summary = run_manifest(model, processor, manifest, args.output_dir, seed=1, **settings)
    print(f"{summary.done} made, {summary.failed} failed ({summary.seconds:.2f} s of audio)")
    for record in records_in(summary.results):
        print(f"  {record['file']:16s} {record['frames']:3d} frames, {record['seconds']:.2f} s, "
              f"{record['finish_reason']}")
    again = run_manifest(model, processor, manifest, args.output_dir, seed=1, **settings)
    print(f"again: {again.done} made, {again.skipped} already done")


if __name__ == "__main__":
    main()
