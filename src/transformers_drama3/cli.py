"""`drama3-tts`: speak text with Drama 3 from the command line.

    drama3-tts --tiny "Hello there." --output hello.wav --max-new-tokens 32
    drama3-tts --model fishaudio/drama-3 --text-file story.txt --output story.flac --seed 1
    drama3-tts --model DIR "<|speaker:0|> Hi! <|speaker:1|> Hello." -o dialogue.wav --voice me.voice.safetensors
    torchrun --nproc-per-node 2 -m transformers_drama3.cli --model DIR "Hello." -o hello.wav --parallel tensor

Everything that can be checked before loading the model (arguments, text, output path, voice files) is checked
first. Errors print one line on stderr and exit with status 1 (2 for a malformed command line); the output file
is written atomically, so a failed or interrupted run leaves no partial file.

Under `torchrun` the model is split over the ranks (`--parallel`, docs/hardware.md): rank 0 alone reads the text
and voice files, checks the output path, prints and writes; every rank computes the same frames.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from transformers.utils import logging as transformers_logging

from . import parallel
from .audio_io import audio_file_format, write_atomically
from .generation_drama3 import DRAMA3_GENERATION_DEFAULTS as DEFAULTS
from .modeling_drama3 import FishOmniForSpeech
from .processing_drama3 import Drama3Processor
from .streaming import Drama3AudioStreamer
from .synthesis import synthesize
from .testing import default_tiny_checkpoint
from .voice import Drama3Voice

FAILURE, INTERRUPTED = 1, 130
MIN_CHUNK_BYTES = 32


class CommandError(Exception):
    """A failure reported as one line on stderr with exit status 1."""


def _number(kind, check, rule: str):
    """An argparse type: `kind(text)` that must satisfy `check`, else a usage error naming `rule`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {rule}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drama3-tts",
        description="Fish Audio Drama 3 text-to-speech with Hugging Face transformers.",
        epilog="examples:\n" + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", nargs="?", help='text to speak ("-" reads standard input); <|speaker:N|> tags '
                        "switch speakers, [cues] and <tag>...</tag> are understood")
    parser.add_argument("--text-file", type=Path, metavar="FILE", help="read the text from a UTF-8 file")
    parser.add_argument("-o", "--output", type=Path, metavar="FILE", help="audio file to write: .wav, .flac or .ogg")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="checkpoint directory or Hub repository id (e.g. fishaudio/drama-3)")
    source.add_argument("--tiny", action="store_true",
                        help="use the embedded tiny random checkpoint (fast, for trying things out: it speaks noise)")

    voice = parser.add_argument_group("voice")
    voice.add_argument("--reference", action="append", default=[], metavar="AUDIO",
                       help="reference recording to clone (10-30 s works best); repeatable, one --reference-text each")
    voice.add_argument("--reference-text", action="append", default=[], metavar="TEXT",
                       help="what is said in the matching --reference")
    voice.add_argument("--voice", action="append", default=[], metavar="FILE",
                       help="saved voice file (from --save-voice); repeatable")
    voice.add_argument("--save-voice", type=Path, metavar="FILE",
                       help="save the single --reference as a voice file (.safetensors); the text is then optional")

    sampling = parser.add_argument_group("sampling (defaults: the model's generation config)")
    sampling.add_argument("--seed", type=int, help="make the run reproducible")
    sampling.add_argument("--greedy", action="store_true", help="always take the most likely token (no sampling)")
    sampling.add_argument("--temperature", type=_number(float, lambda v: v > 0, "must be > 0"),
                          help=f"main-token temperature (default {DEFAULTS['temperature']})")
    sampling.add_argument("--top-p", type=_number(float, lambda v: 0 < v <= 1, "must be in (0, 1]"),
                          help=f"main-token top-p (default {DEFAULTS['top_p']})")
    sampling.add_argument("--top-k", type=_number(int, lambda v: v >= 1, "must be >= 1"),
                          help=f"main-token top-k (default {DEFAULTS['top_k']}: no limit)")
    sampling.add_argument("--max-new-tokens", type=_number(int, lambda v: v >= 1, "must be >= 1"), metavar="FRAMES",
                          help=f"most frames per chunk (21.5 frames = 1 s; default {DEFAULTS['max_new_tokens']})")
    chunk_bytes = _number(int, lambda v: v >= MIN_CHUNK_BYTES, f"must be >= {MIN_CHUNK_BYTES}")
    sampling.add_argument("--chunk-bytes", type=chunk_bytes, default=300, metavar="BYTES",
                          help="long text is spoken in chunks of at most this many UTF-8 bytes (default 300)")

    run = parser.add_argument_group("running")
    run.add_argument("--stream", action="store_true", help="write the audio while it is generated")
    run.add_argument("--fast-decode", action="store_true",
                     help="preallocated frame step, one CUDA graph per frame on a GPU (docs/usage.md)")
    run.add_argument("--device", default="auto", help='"cpu", "cuda", "cuda:1", ... (default: cuda if available)')
    run.add_argument("--parallel", choices=["tensor", "expert"],
                     help="under torchrun: split the backbone over the ranks by tensor parallelism or by whole experts "
                     "(default: expert); each rank uses GPU LOCAL_RANK, or the CPU")
    run.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                     help="weights dtype (default: bfloat16 on a GPU, float32 on the CPU); the codec stays float32")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bars or messages")
    run.add_argument("--summary", action="store_true", help="load the checkpoint, print a model summary and exit")
    return parser


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Command-line shape errors (exit status 2)."""
    if not (args.model or args.tiny):
        parser.error("choose a checkpoint: --model PATH_OR_HUB_ID, or --tiny for the embedded random one")
    if args.parallel is not None and not parallel.launched_with_torchrun():
        parser.error("--parallel splits the model over the processes of a torchrun launch: "
                     "torchrun --nproc-per-node N -m transformers_drama3.cli ...")
    if parallel.launched_with_torchrun() and args.device != "auto":
        parser.error("under torchrun each rank uses GPU LOCAL_RANK (or the CPU): leave --device out")
    if args.summary:
        return
    if args.text is not None and args.text_file is not None:
        parser.error("give the text either as an argument or with --text-file, not both")
    has_text = args.text is not None or args.text_file is not None
    if not has_text and args.save_voice is None:
        parser.error("no text to speak: give TEXT, - (standard input) or --text-file FILE")
    if has_text and args.output is None:
        parser.error("--output FILE is required: where to write the speech (.wav, .flac or .ogg)")
    if args.output is not None and not has_text:
        parser.error("--output needs text to speak: give TEXT, - (standard input) or --text-file FILE")
    if len(args.reference) != len(args.reference_text):
        parser.error(f"every --reference needs its --reference-text: got {len(args.reference)} --reference and "
                     f"{len(args.reference_text)} --reference-text")
    if args.save_voice is not None and len(args.reference) != 1:
        parser.error(f"--save-voice saves one --reference; got {len(args.reference)}")


def _read_text(args: argparse.Namespace) -> str | None:
    if args.text_file is not None:
        return args.text_file.read_text(encoding="utf-8")
    if args.text == "-":
        return sys.stdin.read()
    return args.text


def check_writable(path: Path) -> None:
    """Refuse, before any work, an output whose directory is missing or not writable (or that is a directory)."""
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {str(path)!r}: it is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {str(path)!r}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write {str(path)!r}: the directory {str(parent)!r} is not writable")


def _resolve_device_and_dtype(args: argparse.Namespace):
    device = args.device
    if device == "auto" and parallel.launched_with_torchrun():
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    elif device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if torch.device(device).type == "cpu" else "bfloat16"
    return device, getattr(torch, dtype)


def load_model(path: str, device: str, dtype):
    """The model on `device` (loaded straight there on an accelerator, so a large checkpoint never sits in RAM)."""
    if torch.device(device).type == "cpu":
        return FishOmniForSpeech.from_pretrained(path, dtype=dtype).eval()
    return FishOmniForSpeech.from_pretrained(path, dtype=dtype, device_map=device).eval()


def load_parallel_model(path: str, dtype, expert_parallel: bool):
    """This rank's share of the model, split over the torchrun ranks (`transformers_drama3.parallel`)."""
    config = parallel.distributed_config(expert_parallel=expert_parallel)
    return FishOmniForSpeech.from_pretrained(path, dtype=dtype, distributed_config=config).eval()


def _say(args: argparse.Namespace, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_usage(parser, args)
    if parallel.launched_with_torchrun():
        parallel.init_process_group()
        args.quiet = args.quiet or not parallel.is_main_process()  # one voice: rank 0's
    try:
        with _transformers_quiet(args.quiet):
            return _run(args)
    except KeyboardInterrupt:
        print("drama3-tts: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (CommandError, OSError, ValueError, torch.OutOfMemoryError) as error:
        if parallel.is_main_process():
            print(f"drama3-tts: error: {error}", file=sys.stderr)
        return FAILURE


@contextlib.contextmanager
def _transformers_quiet(quiet: bool):
    """With `quiet`, silence transformers' warnings and progress bars for the run, then restore them."""
    verbosity, bars = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
    if quiet:
        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()


def _run(args: argparse.Namespace) -> int:
    path = args.model or default_tiny_checkpoint()
    device, dtype = _resolve_device_and_dtype(args)
    if args.summary:
        model = _load(args, path, device, dtype)
        if parallel.is_main_process():
            print(model_summary(model))
        return 0

    text, voices = parallel.run_on_main_process(_read_inputs, args)
    processor = _loaded(Drama3Processor.from_pretrained, path)
    if text is not None:
        processor.split_text(text, max_bytes=args.chunk_bytes)  # refuses empty or unsafe text before loading
    model = _load(args, path, device, dtype)

    references = [{"transcript": t, "audio": a} for a, t in zip(args.reference, args.reference_text)] + voices
    if args.save_voice is not None:
        references[0] = processor.create_voice(args.reference_text[0], args.reference[0], codec=model.codec)
        if parallel.is_main_process():
            references[0].save(args.save_voice)
        _say(args, f"saved the voice to {args.save_voice}")
    if text is None:
        return 0
    speech = _speak(args, model, processor, text, references)
    for index, reason in enumerate(speech.finish_reasons):
        if reason != "eos":
            _say(args, f"note: chunk {index + 1} of {len(speech.texts)} stopped at the {reason} limit before the "
                 "end of speech (raise --max-new-tokens if it was cut)")
    _say(args, f"wrote {args.output}: {speech.duration:.2f} s, {speech.num_frames} frames, "
         f"{len(speech.texts)} chunk{'s' if len(speech.texts) != 1 else ''}")
    return 0


def _read_inputs(args: argparse.Namespace) -> tuple[str | None, list[Drama3Voice]]:
    """The text and the voice files, with the output paths checked (run by rank 0 alone under torchrun)."""
    text = _read_text(args)
    for output in (args.output, args.save_voice):
        if output is not None:
            check_writable(output)
    if args.output is not None:
        audio_file_format(args.output)
    return text, [Drama3Voice.load(file) for file in args.voice]


def _load(args, path, device, dtype):
    if parallel.launched_with_torchrun():
        mode = args.parallel or "expert"
        _say(args, f"loading {path} split over {parallel.world_size()} ranks ({mode} parallel, "
             f"{str(dtype).removeprefix('torch.')})")
        return _loaded(load_parallel_model, path, dtype, mode == "expert")
    _say(args, f"loading {path} on {device} ({str(dtype).removeprefix('torch.')})")
    return _loaded(load_model, path, device, dtype)


def _loaded(load, path: str, *args):
    """`load(path, *args)`, with loading errors (missing files, bad checkpoint, unknown repository) named as such."""
    try:
        return load(path, *args)
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot load {path!r}: {error}") from error


def _generation_settings(args: argparse.Namespace) -> dict:
    """The sampling and decoding flags that were given, as `generate` keywords."""
    settings = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "max_new_tokens": args.max_new_tokens}
    settings = {key: value for key, value in settings.items() if value is not None}
    if args.greedy:
        settings["do_sample"] = False
    if args.fast_decode:
        settings["fast_decode"] = True
    return settings


def _speak(args, model, processor, text, references):
    options = dict(chunk_bytes=args.chunk_bytes, seed=args.seed, show_progress=not args.quiet,
                   **_generation_settings(args))
    if not args.stream or not parallel.is_main_process():  # under torchrun only rank 0 writes
        speech = synthesize(model, processor, text, references, **options)
        if parallel.is_main_process():
            processor.save_audio(speech.audio, args.output, speech.sampling_rate)
        return speech
    return stream_to_file(args.output, model, lambda streamer: synthesize(
        model, processor, text, references, streamer=streamer, **options))


def stream_to_file(path: Path, model, run):
    """Call `run(streamer)` while a thread writes the streamer's audio chunks into `path` as they arrive.

    The chunks go to a temporary file next to `path` that is renamed over it at the end (`write_atomically`), so
    the finished file equals what a non-streamed run writes and a failed run leaves nothing behind.
    """
    import soundfile  # imported on first use, as the processor does

    file_format, subtype = audio_file_format(path)
    streamer = Drama3AudioStreamer(model.codec, overlap=True)  # the codec decodes while the next frames are made
    result, failures = [], []

    def write(file) -> None:
        with soundfile.SoundFile(file, "w", model.config.sampling_rate, 1, subtype, format=file_format) as sound:
            writer = threading.Thread(target=_drain, args=(streamer, sound, failures), daemon=True)
            writer.start()
            try:
                result.append(run(streamer))  # synthesize ends the stream, also on errors
            finally:
                streamer.end()  # a second end is harmless; it only guarantees that the writer stops
                writer.join()
            if failures:
                raise failures[0]

    write_atomically(path, write)
    return result[0]


def _drain(streamer, sound, failures: list) -> None:
    """Write audio chunks from `streamer` into the open sound file until the stream ends (a writer thread)."""
    try:
        for chunk in streamer:
            sound.write(np.clip(chunk.numpy(), -1.0, 1.0))
            sound.flush()
    except Exception as error:  # re-raised by the generating thread
        failures.append(error)


def model_summary(model) -> str:
    """A short, human-readable description of a loaded `FishOmniForSpeech`."""
    config = model.config
    text, tower, codec = config.text_config, config.audio_decoder_config, config.codec_config
    lines = [f"{type(model).__name__} ({config.speech_template_version}, {config.sampling_rate} Hz)"]
    for name, module in model.named_children():
        count = sum(p.numel() for p in module.parameters())
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
        lines.append(f"  {name:<9} {count:>14,d} parameters  {'/'.join(dtypes)}")
    lines += [
        f"  backbone: {text.num_hidden_layers} layers ({text.layer_types.count('full_attention')} full attention), "
        f"hidden {text.hidden_size}, {text.num_experts} experts top-{text.num_experts_per_tok}",
        f"  tower: {tower.shared_enrichment_layers} shared + {tower.num_codebooks - 1} residual layers, "
        f"{tower.num_codebooks} codebooks x {tower.vocab_size}, k = {tower.vq_backbone_codebooks}",
        f"  codec: frame {codec.frame_length} samples ({codec.sample_rate / codec.frame_length:.2f} frames/s)",
        f"  semantic band: ids {config.semantic_start_token_id}..{config.semantic_end_token_id}, "
        f"EOS {config.eos_token_id}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
