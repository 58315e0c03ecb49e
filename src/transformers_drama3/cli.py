"""`drama3-tts`: speak text with Drama 3 from the command line.

    drama3-tts --tiny "Hello there." --output hello.wav --max-new-tokens 32
    drama3-tts --model fishaudio/drama-3 --text-file story.txt --output story.flac --seed 1
    drama3-tts --model DIR "<|speaker:0|> Hi! <|speaker:1|> Hello." -o dialogue.mp3 --voice me.voice.safetensors
    drama3-tts --tiny "Hello there." -o - | ffplay -nodisp -autoexit -
    torchrun --nproc-per-node 2 -m transformers_drama3.cli --model DIR "Hello." -o hello.wav --parallel tensor
    drama3-tts --model DIR --manifest jobs.jsonl --output-dir out/ --seed 1   (docs/scaling.md)
    drama3-tts --model DIR --dataset texts.parquet --output-dataset out/      (docs/scaling.md)

Everything about a request is checked before the model loads: the command line, the sampling settings (by
`generation_settings`, the model's own rules), the device, the text, the output path, the checkpoint's location,
reference recordings and voice files. An error prints one line on stderr and exits with status 1 (2 for a malformed
command line, 130 on Ctrl-C, 128 + N when stopped by signal N, e.g. 143 for SIGTERM). The output file is written
atomically, so a failed, interrupted or stopped run leaves no partial file; `-o -` and `--stream` send the audio to
standard output as it is made (cli_output.py). Warnings of transformers and Drama 3 are
said once each, as `note:` lines between the progress bars, not inside them.

Under `torchrun` the model is split over the ranks (`--parallel`, docs/hardware.md): rank 0 alone reads the text
and voice files, checks the output path, prints and writes; every rank computes the same frames.

Nothing heavy is imported until the command line has been parsed: `--help` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
from pathlib import Path

from .chunking import MIN_CHUNK_BYTES
from .cli_jobs import (
    ONE_ACCELERATE_PROCESS,
    JobInput,
    add_job_arguments,
    check_job_usage,
    failed_message,
    is_job,
    one_accelerate_process,
)
from .cli_output import STDOUT, STDOUT_FORMATS, ReaderGone, stdout_is_pipe, stdout_is_terminal, stream_to_outputs
from .loading import (
    default_threads_wait_passively,
    dtype_label,
    is_kernel_fallback,
    load_model,
    load_parallel_model,
    missing_kernel_packages,
    resolve_device_and_dtype,
    under_torchrun,
)
from .stop_signals import Stopped, stop_signals_raise

FAILURE, INTERRUPTED = 1, 130
VOICE_FILE_SUFFIX = ".safetensors"
SAMPLING_FLAGS = ("temperature", "top_p", "top_k")  # main-token sampling, meaningless with --greedy


class CommandError(Exception):
    """A failure reported as one line on stderr with exit status 1."""


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
    parser.add_argument("-o", "--output", type=Path, metavar="FILE",
                        help="audio file to write: .wav, .flac, .ogg, .mp3, .opus or .pcm (raw 16-bit); - for standard "
                        "output, as the audio is made (--format)")
    parser.add_argument("--format", choices=STDOUT_FORMATS,
                        help="the audio format on standard output (-o -, or --stream into a pipe; default wav)")
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
                       help=f"save the single --reference as a voice file (FILE{VOICE_FILE_SUFFIX}); the text is then "
                       "optional")

    sampling = parser.add_argument_group(
        "sampling", "defaults: the checkpoint's generation config (docs/usage.md, 'Sampling settings')")
    sampling.add_argument("--seed", type=int, help="make the run reproducible")
    sampling.add_argument("--greedy", action="store_true", help="always take the most likely token (no sampling)")
    sampling.add_argument("--temperature", type=float, help="main-token temperature (> 0)")
    sampling.add_argument("--top-p", type=float, help="main-token top-p, in (0, 1]")
    sampling.add_argument("--top-k", type=int, help="main-token top-k (default: no limit)")
    sampling.add_argument("--max-new-tokens", type=int, metavar="FRAMES",
                          help="most frames per chunk (21.5 frames = 1 s; default 2048)")
    sampling.add_argument("--chunk-bytes", type=int, default=300, metavar="BYTES",
                          help=f"long text is spoken in chunks of at most this many UTF-8 bytes (default 300, at "
                          f"least {MIN_CHUNK_BYTES})")

    add_job_arguments(parser)

    run = parser.add_argument_group("running")
    run.add_argument("--stream", action="store_true",
                     help="write the audio while it is generated (the file appears, complete, at the end) and, when "
                     "standard output is a pipe, send it there too: ... --stream | ffplay -nodisp -autoexit -")
    run.add_argument("--fast-decode", action="store_true",
                     help="on a GPU: capture the frame step once as a CUDA graph and replay it every frame "
                          "(docs/usage.md)")
    run.add_argument("--compile-step", action="store_true",
                     help="torch.compile the frame step first (fewer, fused kernels; compiling takes minutes)")
    run.add_argument("--device", default="auto", help='"cpu", "cuda", "cuda:1", ... (default: cuda if available)')
    run.add_argument("--parallel", choices=["tensor", "expert"],
                     help="under torchrun: split the backbone over the ranks by tensor parallelism or by whole experts "
                     "(default: expert); each rank uses GPU LOCAL_RANK, or the CPU")
    run.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                     help="weights dtype (default: bfloat16 on a GPU; on the CPU the CPU path: float16 weights over "
                          "float32, see DRAMA3_CPU_PATH; float32 for the exact reference); the codec stays float32")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bars or messages")
    run.add_argument("--summary", action="store_true", help="load the checkpoint, print a model summary and exit")
    return parser


def check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Command-line shape errors (exit status 2); nothing is imported or read."""
    if not (args.model or args.tiny):
        parser.error("choose a checkpoint: --model PATH_OR_HUB_ID, or --tiny for the embedded random one")
    if args.parallel is not None and not under_torchrun():
        parser.error("--parallel splits the model over the processes of a torchrun launch: "
                     "torchrun --nproc-per-node N -m transformers_drama3.cli ...")
    if under_torchrun() and args.device != "auto":
        parser.error("under torchrun each rank uses GPU LOCAL_RANK (or the CPU): leave --device out")
    if is_job(args):
        check_job_usage(parser, args)
        return
    if args.summary:
        speech_flags = (("TEXT", args.text), ("--text-file", args.text_file), ("--output", args.output),
                        ("--reference", args.reference), ("--voice", args.voice), ("--save-voice", args.save_voice))
        given = [flag for flag, value in speech_flags if value]
        if given:
            parser.error(f"--summary only describes the checkpoint and speaks nothing: leave out {', '.join(given)}")
        return
    if args.text is not None and args.text_file is not None:
        parser.error("give the text either as an argument or with --text-file, not both")
    has_text = args.text is not None or args.text_file is not None
    if not has_text and args.save_voice is None:
        parser.error("no text to speak: give TEXT, - (standard input) or --text-file FILE")
    if has_text and args.output is None:
        parser.error("--output FILE is required: where to write the speech (.wav, .flac, .ogg, .mp3, .opus; - for "
                     "standard output)")
    if args.format is not None and args.output != STDOUT and not args.stream:
        parser.error("--format is the format of the audio on standard output (-o -, or --stream into a pipe); a "
                     "file's format is its suffix")
    if args.output == STDOUT and stdout_is_terminal():
        parser.error("-o - writes audio to standard output, which is a terminal here: pipe it into a player "
                     "(| ffplay -nodisp -autoexit -) or redirect it into a file")
    if args.output is not None and not has_text:
        parser.error("--output needs text to speak: give TEXT, - (standard input) or --text-file FILE")
    if len(args.reference) != len(args.reference_text):
        parser.error(f"every --reference needs its --reference-text: got {len(args.reference)} --reference and "
                     f"{len(args.reference_text)} --reference-text")
    if args.save_voice is not None and len(args.reference) != 1:
        parser.error(f"--save-voice saves one --reference; got {len(args.reference)}")
    if args.save_voice is not None and args.save_voice.suffix.lower() != VOICE_FILE_SUFFIX:
        parser.error(f"--save-voice writes a voice file, not audio: name it *{VOICE_FILE_SUFFIX} "
                     f"(got {str(args.save_voice)!r})")
    if args.greedy:
        given = [f"--{name.replace('_', '-')}" for name in SAMPLING_FLAGS if getattr(args, name) is not None]
        if given:
            parser.error(f"--greedy always takes the most likely token, so {' and '.join(given)} would change nothing: "
                         "leave out one or the other")
    if args.chunk_bytes < MIN_CHUNK_BYTES:
        parser.error(f"--chunk-bytes must be at least {MIN_CHUNK_BYTES}; got {args.chunk_bytes}")


def generation_flags(args: argparse.Namespace) -> dict:
    """The sampling and decoding flags that were given, as `generate` keywords."""
    settings = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "max_new_tokens": args.max_new_tokens}
    settings = {key: value for key, value in settings.items() if value is not None}
    if args.greedy:
        settings["do_sample"] = False
    if args.fast_decode:
        settings["fast_decode"] = True
    if args.compile_step:
        settings["compile_step"] = True
    return settings


def check_generation_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """`generation_flags`, checked by `generation_settings` against the Drama 3 defaults: the same rules `generate`
    applies, before any model loads. An out-of-range value is a usage error (exit status 2, one line) naming its flag."""
    from transformers import GenerationConfig

    from .generation import DRAMA3_GENERATION_DEFAULTS, generation_settings
    from .settings_checks import check_seed

    flags = generation_flags(args)
    try:
        generation_settings(GenerationConfig(**DRAMA3_GENERATION_DEFAULTS), **flags)
        if getattr(args, "seed", None) is not None:
            check_seed(args.seed, "--seed")
    except (TypeError, ValueError) as error:
        message = str(error).replace("do_sample=False", "--greedy")
        for name in flags:  # the setting's name as the flag the user typed
            message = re.sub(rf"(?<![\w-]){name}\b", "--" + name.replace("_", "-"), message)
        parser.exit(2, f"{parser.prog}: error: {message}\n")  # one line: the usage would hide it
    return flags


def _read_text(args: argparse.Namespace) -> str | None:
    try:
        if args.text_file is not None:
            return args.text_file.read_text(encoding="utf-8")
        if args.text == "-":
            return sys.stdin.buffer.read().decode("utf-8") if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    except UnicodeDecodeError as error:
        source = f"--text-file {str(args.text_file)!r}" if args.text_file is not None else "standard input"
        raise CommandError(f"{source} is not UTF-8 text ({error.reason} at byte {error.start}): convert it to UTF-8, "
                           "e.g. with iconv -t UTF-8") from None
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


def is_main_process() -> bool:
    """Rank 0 under torchrun (and every single process): the one that reads input, prints and writes."""
    if not under_torchrun():
        return True
    from . import parallel

    return parallel.is_main_process()


def main(argv: list[str] | None = None) -> int:
    default_threads_wait_passively()
    parser = build_parser()
    args = parser.parse_args(argv)
    check_usage(parser, args)
    try:
        with stop_signals_raise(), _Notes.collecting(args.quiet) as notes:
            flags = check_generation_flags(parser, args)
            if under_torchrun():
                from . import parallel
                from .jobs import JOB_COLLECTIVE_TIMEOUT

                # A manifest job's ranks meet only at its end, after their last batches, which may differ by hours.
                parallel.init_process_group(timeout=JOB_COLLECTIVE_TIMEOUT if is_job(args) else None)
                notes.quiet = args.quiet = args.quiet or not parallel.is_main_process()  # one voice: rank 0's
            return _run(args, flags, notes)
    except ReaderGone:  # `-o - | head`: the reader has what it wanted
        return 0
    except KeyboardInterrupt:
        print("drama3-tts: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Stopped as stop:
        print(f"drama3-tts: stopped by {signal.Signals(stop.signal_number).name}", file=sys.stderr)
        return 128 + stop.signal_number
    except _reported_errors() as error:
        if is_main_process():
            print(f"drama3-tts: error: {error}", file=sys.stderr)
        return FAILURE


def _reported_errors() -> tuple[type[BaseException], ...]:
    """The errors `main` reports as one line: ours, bad input, files, and running out of memory (torch's error, when
    torch has been imported at all)."""
    torch = sys.modules.get("torch")
    return (CommandError, OSError, ValueError) + ((torch.OutOfMemoryError,) if torch is not None else ())


class _Notes(logging.Handler):
    """Collects the warnings that transformers and Drama 3 log during a run, so that the CLI says each once, as a
    `note:` line, when no progress bar is drawing (`say_all`), in place of transformers' own printing."""

    def __init__(self, quiet: bool):
        super().__init__(logging.ERROR if quiet else logging.WARNING)
        self.quiet = quiet
        self.messages: list[str] = []
        self.said: set[str] = set()
        self.on_cpu = True  # linear-attention kernels exist for GPUs only: no note about them on a CPU
        self.kernel_fallback = False  # transformers said that a kernel package is missing (`is_kernel_fallback`)

    @classmethod
    @contextlib.contextmanager
    def collecting(cls, quiet: bool):
        from transformers.utils import logging as transformers_logging

        notes = cls(quiet)
        verbosity, bars = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
        loggers = [logging.getLogger("transformers"), logging.getLogger(__package__)]
        transformers_logging.disable_default_handler()
        if quiet:
            transformers_logging.set_verbosity_error()
            transformers_logging.disable_progress_bar()
        for logger in loggers:
            logger.addHandler(notes)
        try:
            yield notes
        finally:
            for logger in loggers:
                logger.removeHandler(notes)
            transformers_logging.enable_default_handler()
            transformers_logging.set_verbosity(verbosity)
            if bars:
                transformers_logging.enable_progress_bar()
            notes.say_all()

    def emit(self, record: logging.LogRecord) -> None:
        if is_kernel_fallback(record):
            self.kernel_fallback = True
        else:
            self.messages.append(record.getMessage())

    def say(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr)

    def say_all(self) -> None:
        """Print the notes collected so far, each once; transformers' notes about missing GPU kernels are gathered
        into one (and left out on a CPU, where those kernels do not exist)."""
        lines, self.messages = self.messages, []
        missing = missing_kernel_packages() if self.kernel_fallback and not self.on_cpu else []
        if missing:
            lines.append(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed, so the "
                         "linear-attention layers run their reference PyTorch code (correct, but slower): "
                         f"pip install {' '.join(missing)}")
        for line in dict.fromkeys(lines):
            if line not in self.said:
                self.said.add(line)
                self.say(f"note: {line}")


def _run(args: argparse.Namespace, flags: dict, notes: _Notes) -> int:
    from .processing_drama3 import Drama3Processor
    from .voice import Drama3Voice

    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    notes.on_cpu = device == "cpu"
    if is_job(args):
        return _run_job(args, flags, notes, device, dtype)
    text, voices = _on_main_process(_read_inputs, args)
    path = _checkpoint(args)
    if args.summary:
        model = _load(args, notes, path, device, dtype)
        if is_main_process():
            print(model_summary(model))
        return 0

    processor = _loaded(Drama3Processor.from_pretrained, path)
    if text is not None:
        processor.split_text(text, max_bytes=args.chunk_bytes)  # refuses empty or unsafe text before loading
    for number, (audio, transcript) in enumerate(zip(args.reference, args.reference_text), start=1):
        processor.check_text(transcript, f"--reference-text {number}")
        processor.check_audio(audio, where=f"--reference {number}")
    for file, voice in zip(args.voice, voices):
        processor.check_reference(voice, f"--voice {file}")
    model = _load(args, notes, path, device, dtype)
    processor.codec = model.codec

    references = [  # encoded once, here, so that notes about the recordings come before the progress bars
        {"transcript": transcript, "codes": processor.encode_audio(audio, where=f"--reference {n}")}
        for n, (audio, transcript) in enumerate(zip(args.reference, args.reference_text), start=1)
    ] + voices
    notes.say_all()
    if args.save_voice is not None:
        voice = Drama3Voice(codes=references[0]["codes"], transcript=references[0]["transcript"])
        if is_main_process():
            voice.save(args.save_voice)
        notes.say(f"saved the voice to {args.save_voice}")
    if text is None:
        return 0
    speech = _speak(args, flags, model, processor, text, references)
    notes.say_all()
    _say_finish_reasons(notes, speech.finish_reasons, model.generation_config.max_new_tokens, flags)
    chunks = len(speech.texts)
    where = "the speech to standard output" if args.output == STDOUT else args.output
    notes.say(f"wrote {where}: {speech.duration:.2f} s, {speech.num_frames} frames, "
              f"{chunks} chunk{'s' if chunks != 1 else ''}")
    return 0


def _run_job(args: argparse.Namespace, flags: dict, notes: _Notes, device, dtype) -> int:
    """`--manifest` / `--dataset`: every line or row and the items' files checked before the model loads, then the
    job (`transformers_drama3.jobs`); under torchrun a whole model per rank unless --parallel splits one over all."""
    from .jobs import plan_job, run_job
    from .processing_drama3 import Drama3Processor

    if one_accelerate_process():
        notes.say(f"note: {ONE_ACCELERATE_PROCESS}")
    job = JobInput(args, flags)
    items, problems = _on_main_process(job.read)  # before any download
    if problems:
        _on_main_process(_refuse_rows, args, items, problems, job.name)
    path = _checkpoint(args)
    processor = _loaded(Drama3Processor.from_pretrained, path)
    copies = 1
    if under_torchrun() and args.parallel is None:
        from . import parallel

        copies = parallel.world_size()
    plan = _on_main_process(lambda: plan_job(items, job.files_dir, processor, batch_size=args.batch_size,
                                             chunk_bytes=args.chunk_bytes, shares=copies))
    if copies > 1:
        notes.say(f"loading {args.model or 'the tiny checkpoint'}: a whole model on each of {copies} ranks")
        model = _loaded(load_model, path, device, dtype)
    else:
        model = _load(args, notes, path, device, dtype)
    summary = run_job(model, processor, plan, show_progress=not args.quiet)
    written = job.finish(plan.items, processor) if is_main_process() else None
    notes.say_all()
    notes.say(f"{summary.done} items spoken ({summary.seconds:.1f} s of audio), {summary.skipped} done before, "
              f"{summary.failed} failed: {written}")
    if summary.failed:
        raise CommandError(failed_message(summary))
    return 0


def _refuse_rows(args: argparse.Namespace, items: list, problems: list[str], what: str) -> None:
    """Raise the problems of a job's input (`what`) in one message: those of the lines or rows that made no item,
    and the text checks of the others (`read_items`), for which the processor's files alone are fetched, not the
    model. Without a processor (a checkpoint not found), the rows' problems alone."""
    from .jobs import read_items
    from .jobs_items import problems_error
    from .processing_drama3 import Drama3Processor

    try:
        processor = Drama3Processor.from_pretrained(args.model or _checkpoint(args))
    except (OSError, ValueError):
        raise problems_error(problems, what) from None
    read_items(items, range(len(items)), processor, args.chunk_bytes, problems, what)


def _read_inputs(args: argparse.Namespace) -> tuple[str | None, list]:
    """The text and the voice files, with the output paths checked (run by rank 0 alone under torchrun)."""
    from .audio_io import audio_file_format
    from .voice import Drama3Voice

    text = _read_text(args)
    for output in (args.output, args.save_voice):
        if output is not None and output != STDOUT:
            check_writable(output)
    if args.output is not None and args.output != STDOUT:
        audio_file_format(args.output)
    if args.output == STDOUT or args.stream:
        audio_file_format(f"stdout.{args.format or 'wav'}")
    return text, [Drama3Voice.load(file) for file in args.voice]


def _on_main_process(function, *args):
    """`function(*args)` on rank 0 alone under torchrun, its result (or error) shared with every rank."""
    if not under_torchrun():
        return function(*args)
    from . import parallel

    return parallel.run_on_main_process(function, *args)


def _checkpoint(args: argparse.Namespace) -> str:
    """The local directory of the checkpoint: `--model` (a directory, or a Hub repository found in the cache or
    downloaded now, once) or the embedded tiny one. Everything after reads that directory, never the network."""
    if args.tiny:
        from .testing import default_tiny_checkpoint

        return default_tiny_checkpoint()
    from .checkpoint_location import checkpoint_directory

    return _loaded(checkpoint_directory, args.model)


def _load(args, notes: _Notes, path, device, dtype):
    name, dtype_name = args.model or "the tiny checkpoint", dtype_label(dtype)
    if under_torchrun():
        from . import parallel

        mode = args.parallel or "expert"
        notes.say(f"loading {name} split over {parallel.world_size()} ranks ({mode} parallel, {dtype_name})")
        model = _loaded(load_parallel_model, path, dtype, mode == "expert")
    else:
        notes.say(f"loading {name} on {device} ({dtype_name})")
        model = _loaded(load_model, path, device, dtype)
    notes.say_all()
    return model


def _loaded(load, path: str, *args):
    """`load(path, *args)`, with loading errors (missing files, bad checkpoint, unknown repository) named as such."""
    try:
        return load(path, *args)
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot load {path!r}: {error}") from error


def _say_finish_reasons(notes: _Notes, reasons: list[str], default_frames: int, flags: dict) -> None:
    """One note for all the chunks that stopped at a limit instead of at the end of speech."""
    advice = {
        "length": (f"the {flags.get('max_new_tokens', default_frames)}-frame limit",
                   "raise --max-new-tokens if speech was cut"),
        "context": ("the backbone's context", "give less text per chunk with a smaller --chunk-bytes"),
    }
    for reason, (limit, remedy) in advice.items():
        cut = [index for index, each in enumerate(reasons) if each == reason]
        if not cut:
            continue
        which = "the speech" if len(reasons) == 1 else f"{len(cut)} of {len(reasons)} chunks ({chunk_ranges(cut)})"
        notes.say(f"note: {which} stopped at {limit} before the end of speech: {remedy}")


def chunk_ranges(indices: list[int]) -> str:
    """Zero-based indices as one-based ranges: [0, 1, 2, 5] -> "1-3, 6" (at most 5 ranges, then "...")."""
    spans: list[list[int]] = []
    for index in indices:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    words = [f"{a + 1}" if a == b else f"{a + 1}-{b + 1}" for a, b in spans]
    return ", ".join(words[:5] + (["..."] if len(words) > 5 else []))


def _speak(args, flags, model, processor, text, references):
    from .synthesis import synthesize

    options = dict(chunk_bytes=args.chunk_bytes, seed=args.seed, show_progress=not args.quiet, **flags)
    to_stdout = args.output == STDOUT or (args.stream and stdout_is_pipe())
    if not is_main_process() or not (args.stream or to_stdout):  # under torchrun only rank 0 writes
        speech = synthesize(model, processor, text, references, **options)
        if is_main_process():
            processor.save_audio(speech.audio, args.output, speech.sampling_rate)
        return speech
    return stream_to_outputs(None if args.output == STDOUT else args.output,
                             (args.format or "wav") if to_stdout else None, model,
                             lambda streamer: synthesize(model, processor, text, references, streamer=streamer,
                                                         **options))


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
