"""`ServerThread`: the speech server running in a background thread of this process (notebooks, tests, benchmarks).

    with ServerThread(ServerSettings(model="fishaudio/drama-3")) as server:
        openai.OpenAI(base_url=server.url + "/v1", api_key="-").audio.speech.create(...)
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from .app import create_app
from .settings import ServerSettings


class ServerThread:
    """uvicorn serving `create_app(settings)` in a daemon thread, on `host` and a free port (`url`).

    `wait_until_ready` blocks until `GET /health` answers 200 and raises if the model fails to load; `stop` shuts the
    server down. As a context manager it does both.
    """

    def __init__(self, settings: ServerSettings, host: str = "127.0.0.1", log_level: str = "warning"):
        self.app = create_app(settings)
        self.socket = socket.socket()
        self.socket.bind((host, 0))
        self.url = "http://%s:%d" % (host, self.socket.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()

    @property
    def service(self):
        """The loaded `SpeechService` (model, processor, worker), or None while loading."""
        return self.app.state.service

    def health(self) -> int | None:
        """The status of `GET /health`, or None if the server does not answer yet."""
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code
        except httpx.TransportError:
            return None

    def wait_until_ready(self, timeout: float = 600) -> ServerThread:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.app.state.load_error:
                raise RuntimeError(f"the model failed to load: {self.app.state.load_error}")
            if self.health() == 200:
                return self
            time.sleep(0.1)
        raise TimeoutError(f"the server was not ready within {timeout} s")

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
        self.socket.close()

    def __enter__(self) -> ServerThread:
        return self.wait_until_ready()

    def __exit__(self, *exc_info) -> None:
        self.stop()
