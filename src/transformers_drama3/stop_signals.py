"""The stop signals of `drama3-tts` (SIGTERM, SIGHUP): while a run goes on they unwind it like Ctrl-C, so that its
temporary files are removed, and `main` reports them as one line with status 128 + N."""

from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = ("SIGTERM", "SIGHUP")  # what process managers and closing terminals send


class Stopped(BaseException):
    """The process got a stop signal (SIGTERM, SIGHUP): unwind like Ctrl-C, so temporary files are removed.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signal_number: int):
        super().__init__(signal_number)
        self.signal_number = signal_number


@contextlib.contextmanager
def stop_signals_raise():
    """While running, SIGTERM and SIGHUP raise `Stopped` in the main thread (their default is to end the process at
    once, leaving temporary files behind); a repeated signal is ignored while the first one unwinds."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return
    numbers = [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]

    def stop(number, frame):
        for each in numbers:
            signal.signal(each, signal.SIG_IGN)
        raise Stopped(number)

    previous = {number: signal.signal(number, stop) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


__all__ = ["STOP_SIGNALS", "Stopped", "stop_signals_raise"]
