"""Where `drama3-tts` puts its audio: a file written atomically, standard output as the audio is made, or both.

    -o speech.mp3                      the file, written when the speech is complete (atomically)
    -o speech.mp3 --stream             the file, written as the audio is made into a temporary file renamed at the end;
                                       and, when standard output is a pipe, the audio there too (| ffplay -)
    -o -                               standard output only, as the audio is made (--format, default wav)

Every byte comes from `audio_io`'s encoders, the ones the server answers with: a file through `AudioFileWriter`
(what `write_audio` uses, so a streamed file equals an unstreamed one), standard output through `AudioEncoder`
(a WAV there has the sizes 0xFFFFFFFF of a WAV of unknown length, which players and Python's `wave` read to the end).

A reader that closes standard output early (`| head -c 5000`, a player that quits) is no failure: `-o -` stops
generating and the run ends quietly with status 0, as `cat` does; `--stream -o FILE` stops sending and finishes the file.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
from pathlib import Path

STDOUT = Path("-")  # `-o -`
STDOUT_FORMATS = ("wav", "pcm", "mp3", "opus", "ogg")  # the formats that can go down a pipe as they are made


class ReaderGone(BaseException):
    """Standard output's reader closed it while `-o -` was streaming: `main` ends quietly with status 0.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way takes it for a failure."""


def silence_stdout() -> None:
    """Point standard output at the null device, so that the interpreter's last flush of a closed pipe at exit
    prints no "Exception ignored ... BrokenPipeError" (the way Python's signal documentation recommends)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def stdout_is_pipe() -> bool:
    """Standard output is a pipe or socket (a player reads it), not a terminal, a file or a test's capture."""
    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # replaced by an object without a file descriptor
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def stdout_is_terminal() -> bool:
    try:
        return os.isatty(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        return False


def stream_to_outputs(path: Path | None, stdout_format: str | None, model, run):
    """Call `run(streamer)` while a thread writes the streamer's audio chunks as they arrive: into `path` (None:
    no file) and, in `stdout_format` (None: not there), to standard output, flushed after every chunk.

    The file's chunks go to a temporary file next to `path` that is renamed over it at the end (`write_atomically`),
    so a failed or stopped run leaves nothing behind, and through `AudioFileWriter`, so the finished file is byte for
    byte the file a run without streaming writes.
    """
    from .audio_io import AudioEncoder, AudioFileWriter, write_atomically
    from .streaming import Drama3AudioStreamer

    reader_gone = threading.Event()  # set by the writer thread when standard output's reader has closed it

    class Streamer(Drama3AudioStreamer):
        def put(self, value) -> None:
            if reader_gone.is_set() and path is None:  # nobody will hear the rest: stop generating
                raise ReaderGone
            super().put(value)

    streamer = Streamer(model.codec, overlap=True)  # the codec decodes while the next frames are made
    rate = model.config.sampling_rate
    encoder = None if stdout_format is None else AudioEncoder(stdout_format, rate, streamed=True)
    result, failures = [], []

    def write(file) -> None:
        with contextlib.nullcontext() if file is None else AudioFileWriter(file, path, rate) as sound:
            writer = threading.Thread(target=drain, args=(streamer, sound, encoder, failures, reader_gone),
                                      daemon=True)
            writer.start()
            try:
                result.append(run(streamer))  # synthesize ends the stream, also on errors
            finally:
                streamer.end()  # a second end is harmless; it only guarantees that the writer stops
                writer.join()
            if failures:
                raise failures[0]
        if encoder is not None and not reader_gone.is_set():
            send_or_note_gone(encoder.finish(), reader_gone)
        if reader_gone.is_set() and path is None:
            raise ReaderGone

    if path is None:
        write(None)
    else:
        write_atomically(path, write)
    return result[0]


def send(data: bytes) -> None:
    """Bytes to standard output, at once (a player is waiting for them)."""
    if data:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def send_or_note_gone(data: bytes, reader_gone: threading.Event) -> None:
    """`send`, and if standard output's reader has closed it: set `reader_gone` and silence standard output."""
    try:
        send(data)
    except BrokenPipeError:
        silence_stdout()
        reader_gone.set()


def drain(streamer, sound, encoder, failures: list, reader_gone: threading.Event) -> None:
    """Write audio chunks from `streamer` into the open `AudioFileWriter` `sound` and through `encoder` to standard
    output until the stream ends (a writer thread; either may be None). A closed standard output sets
    `reader_gone` and ends the sending, not the file."""
    try:
        for chunk in streamer:
            samples = chunk.numpy()
            if sound is not None:
                sound.write(samples)
            if encoder is not None and not reader_gone.is_set():
                send_or_note_gone(encoder.encode(samples), reader_gone)
    except Exception as error:  # re-raised by the generating thread
        failures.append(error)
