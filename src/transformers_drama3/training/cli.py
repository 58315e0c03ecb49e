"""`drama3-prepare`: turn a folder of recordings into a Drama 3 training dataset.

    drama3-prepare my_voice/ prepared/ --model fishaudio/drama-3
    drama3-prepare my_voice/ prepared/ --tiny          # the embedded tiny checkpoint's codec: try the recipe on a CPU
    drama3-prepare LJSpeech-1.1/ lj/ --model fishaudio/drama-3 --max-seconds 20 --batch-size 16
    drama3-prepare clips/ prepared/ --model DIR --reference ref.wav --reference-text "What is said in ref.wav."

The dataset goes to OUT_DIR/dataset (`datasets.load_from_disk`), the clips left out and why to OUT_DIR/skipped.tsv.
Running the same command again encodes only the clips that are not encoded yet. Errors print one line on stderr and
exit with status 1 (2 for a malformed command line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..voice import Drama3Voice
from .prepare import DEFAULT_MAX_SECONDS, DATASET_DIR, SKIPPED_FILE, prepare_dataset

FAILURE, INTERRUPTED = 1, 130
SKIPPED_SHOWN = 10


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drama3-prepare",
        description="Encode a folder of recordings with transcripts into a Drama 3 fine-tuning dataset.",
        epilog="layouts: clip.wav + clip.txt (or clip.lab) side by side, or a metadata.csv with file|text lines "
               "(LJSpeech)\n\nexamples:\n" + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("data_dir", type=Path, metavar="DATA_DIR", help="folder of recordings and transcripts")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="where the dataset and the codes cache go")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory or Hub id whose codec and tokenizer to use (only the "
                        "codec, config and tokenizer are read)")
    source.add_argument("--tiny", action="store_true",
                        help="use the embedded tiny random checkpoint (for trying the fine-tuning recipe on a CPU)")
    parser.add_argument("--speaker", type=int, choices=range(16), default=0, metavar="N",
                        help="speaker tag <|speaker:N|> for transcripts without one (default 0)")
    parser.add_argument("--reference", action="append", default=[], metavar="AUDIO",
                        help="reference recording put in every prompt; repeatable, one --reference-text each")
    parser.add_argument("--reference-text", action="append", default=[], metavar="TEXT",
                        help="what is said in the matching --reference")
    parser.add_argument("--voice", action="append", default=[], type=Path, metavar="FILE",
                        help="saved voice file (drama3-tts --save-voice) put in every prompt; repeatable")
    parser.add_argument("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS,
                        help=f"skip longer clips (default {DEFAULT_MAX_SECONDS:g})")
    parser.add_argument("--batch-size", type=int, default=8, help="clips per codec call (default 8)")
    parser.add_argument("--device", help='where the codec runs: "cpu", "cuda", ... (default: cuda if available)')
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar or messages")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.reference) != len(args.reference_text):
        parser.error(f"every --reference needs its --reference-text: got {len(args.reference)} --reference and "
                     f"{len(args.reference_text)} --reference-text")
    if args.max_seconds <= 0 or args.batch_size < 1:
        parser.error("--max-seconds must be > 0 and --batch-size >= 1")
    try:
        references = [{"transcript": text, "audio": audio} for audio, text in zip(args.reference, args.reference_text)]
        references += [Drama3Voice.load(path) for path in args.voice]
        if args.tiny:
            from ..testing import default_tiny_checkpoint

        prepared = prepare_dataset(
            args.data_dir, args.out_dir, default_tiny_checkpoint() if args.tiny else args.model, speaker=args.speaker, references=references,
            max_seconds=args.max_seconds, batch_size=args.batch_size, device=args.device, show_progress=not args.quiet,
        )
    except KeyboardInterrupt:
        print("drama3-prepare: interrupted (the clips encoded so far are kept: run again to continue)", file=sys.stderr)
        return INTERRUPTED
    except (OSError, ValueError, TypeError, torch.OutOfMemoryError) as error:
        print(f"drama3-prepare: error: {error}", file=sys.stderr)
        return FAILURE
    if not args.quiet:
        seconds = sum(prepared.dataset["seconds"])
        print(f"{len(prepared.dataset)} examples ({seconds / 60:.1f} min of audio) in {args.out_dir / DATASET_DIR}",
              file=sys.stderr)
        if prepared.skipped:
            print(f"{len(prepared.skipped)} clips skipped (all listed in {args.out_dir / SKIPPED_FILE}):",
                  file=sys.stderr)
            for clip in prepared.skipped[:SKIPPED_SHOWN]:
                print(f"  {clip.name}: {clip.reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
