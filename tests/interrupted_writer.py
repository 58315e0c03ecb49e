"""The child of tests/test_interrupted_writes.py: `python interrupted_writer.py DIR SUFFIX...`.

For each round it names the suffix and how long one write takes (`writing .flac 0.031`), then writes the same audio
to `DIR/speech.SUFFIX` with `write_audio` over and over until a SIGINT from the parent stops it, and reports the
outcome on one line: `ok` when the interrupt came out as KeyboardInterrupt, no temporary file is left and the file is
absent or complete (byte for byte the first write's), else `bad` and what went wrong. It reads a line from standard
input before each round; end of input ends it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from transformers_drama3.audio_io import write_audio

RATE = 44100


def main(directory: str, suffixes: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the parent asks for the stack when an answer does not come
    folder = Path(directory)
    audio = (0.3 * np.sin(np.arange(3 * RATE) * 0.05)).astype(np.float32)  # 3 s: a write of a few tens of ms
    complete = {}
    for suffix in suffixes:
        started = time.perf_counter()
        complete[suffix] = write_audio(folder / f"reference{suffix}", audio, RATE).read_bytes()
        complete[f"{suffix} seconds"] = time.perf_counter() - started
    for line in sys.stdin:
        suffix = line.strip()
        target = folder / f"speech{suffix}"
        target.unlink(missing_ok=True)
        try:  # the announcement inside: the parent's signal may come as soon as it has read it
            print(f"writing {suffix} {complete[f'{suffix} seconds']:.4f}", flush=True)
            while True:
                write_audio(target, audio, RATE)
        except KeyboardInterrupt:
            pass
        except BaseException as error:  # noqa: BLE001  (what the parent must hear about, whatever it is)
            print(f"bad {suffix} {type(error).__name__}: {error}", flush=True)
            continue
        left = sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))
        if left:
            print(f"bad {suffix} temporary files left: {left}", flush=True)
        elif target.exists() and target.read_bytes() != complete[suffix]:
            print(f"bad {suffix} a partial file", flush=True)
        else:
            print(f"ok {suffix}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
