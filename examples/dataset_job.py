"""Speak the rows of a 🤗 dataset into an audio dataset, then read it back.

    python examples/dataset_job.py [--model fishaudio/drama-3] [--output-dataset speech/]
                                   [--reference me.wav --reference-text "What is said in it."]

A small dataset of texts is made here (in your own job: `datasets.load_dataset(...)`, a parquet file, a Hub id).
`run_dataset` speaks every row and writes the input columns plus `audio` (44.1 kHz), `frames`, `finish_reason`,
`seed` and `error` with `save_to_disk`; run it again and only rows not made yet are spoken. With `--reference`, the
rows get an audio column (`datasets.Audio`) holding the recording and a column with its transcript, and every row is
cloned from them (`reference_audio` and `reference_transcript` in `columns`); the column is read with soundfile. The same job from the
command line, also under `accelerate launch` or on a Ray cluster: docs/scaling.md. Without `--model` the embedded
tiny random checkpoint is used (fast; it speaks noise).
"""

import io
from pathlib import Path

import datasets
import soundfile

from transformers_drama3.jobs_dataset import run_dataset
from transformers_drama3.jobs_items import undecoded
from example_setup import example_parser, load_model_and_processor

ROWS = {
    "line_id": ["intro", "question", "answer"],
    "text": ["Welcome back to the show.", "<|speaker:0|> Did you see the match? <|speaker:1|> Every minute of it.",
             "It was the best game of the season."],
    "episode": [12, 12, 12],
}


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--output-dataset", type=Path, default=Path("speech"))
    parser.add_argument("--reference", type=Path, help="a recording of the voice to clone (10-30 s works best)")
    parser.add_argument("--reference-text", help="what is said in --reference")
    args = parser.parse_args()
    if (args.reference is None) != (args.reference_text is None):
        parser.error("--reference and --reference-text go together")
    if args.reference is not None and not args.reference.is_file():
        parser.error(f"--reference {str(args.reference)!r}: no such file")

    model, processor = load_model_and_processor(args.model)
    settings = {"max_new_tokens": 6} if args.model is None else {}  # the tiny checkpoint rarely stops by itself
    texts = datasets.Dataset.from_dict(ROWS)
    columns = {"id": "line_id", "text": "text"}
    if args.reference is not None:  # a reference per row, as a dataset of recordings has it
        clip = {"bytes": args.reference.read_bytes(), "path": args.reference.name}
        texts = texts.add_column("clip", [clip] * len(texts)).cast_column("clip", datasets.Audio())
        texts = texts.add_column("clip_text", [args.reference_text] * len(texts))
        columns.update(reference_audio="clip", reference_transcript="clip_text")
    summary = run_dataset(model, processor, texts, args.output_dataset, columns=columns, seed=1, **settings)
    print(f"{summary.done} rows spoken, {summary.skipped} done before, {summary.failed} failed")

    speech = datasets.load_from_disk(str(args.output_dataset))
    print(speech)
    # Audio decodes with torchcodec when it is installed; the stored file bytes read with soundfile anywhere
    # (`undecoded`: every audio column cast to datasets.Audio(decode=False)).
    for row in undecoded(speech):
        samples, rate = soundfile.read(io.BytesIO(row["audio"]["bytes"]))
        print(f"  {row['line_id']:9s} {len(samples) / rate:.2f} s, {row['frames']} frames, {row['finish_reason']}")


if __name__ == "__main__":
    main()
