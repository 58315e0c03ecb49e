"""`DrainingServer`: uvicorn's server with a graceful drain on SIGTERM.

On the first SIGTERM the app starts draining (`start_draining`: new requests get 503 `draining`, `/health` answers
503 `{"status": "draining"}` so a load balancer stops sending traffic) while running requests go on; the server shuts
down once no request is waiting or running, or after `drain_seconds`, whichever comes first. Ctrl+C (SIGINT) and a
second SIGTERM stop it at once, as uvicorn does.
"""

from __future__ import annotations

import signal
import time

import uvicorn

from .app import drained, start_draining


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_seconds: float):
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and self.drain_deadline is None and self.drain_seconds > 0:
            self.drain_deadline = time.monotonic() + self.drain_seconds
            start_draining(self.config.app)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s): stop once a drain is over."""
        if self.drain_deadline is not None and not self.should_exit:
            self.should_exit = drained(self.config.app) or time.monotonic() > self.drain_deadline
        return await super().on_tick(counter)


__all__ = ["DrainingServer"]
