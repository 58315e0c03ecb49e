"""What the playground page (ui.py) does, on the server's own objects: no Gradio here, and no HTTP call to itself.

`Playground` speaks through the checks and the worker of `POST /v1/audio/speech` (`make_job`, `GenerationWorker`),
enrols and deletes voices as `/v1/voices` does (`enrol_recording`, `VoiceLibrary`), previews text with the checks of
a request's input (`split_input`) and reads the status the way `/metrics` does. Errors are the server's `APIError`s,
whose messages are what an HTTP client reads; the page shows them beside the field they name (ui_fields.py). The
takes' files live in one folder, removed when the server shuts down (`close`, called by ui.py's lifespan). A
finished request is a `Take`: its request fields (with the seed actually used) and its audio as wav, mp3 and flac
files, encoded by the encoder of the HTTP responses, so a take's wav is byte for byte what the same request over HTTP
returns.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import soundfile
import torch

from ..audio_io import AudioEncoder
from ..generation import DRAMA3_GENERATION_DEFAULTS
from .app import MORE_SAMPLING, enrol_recording, make_job, ready_service, split_input
from .audio_encoding import available_formats
from .errors import APIError
from .schemas import SpeechRequest
from .ui_player import LiveTakes
from .worker import JobDone

TAKE_FORMATS = ("wav", "mp3", "flac")  # downloads offered for each take (those this libsndfile can write)
MAX_TAKES = 20  # per page: older takes and their files are dropped
# The shortest recording the page enrols: under 2 s a voice has too little to copy (10-30 s works best). The HTTP
# API's POST /v1/voices leaves it to its clients.
MIN_RECORDING_SECONDS = 2.0


def check_length(recording: str) -> None:
    """400 for a recording shorter than MIN_RECORDING_SECONDS (an unreadable one is left to the server's checks)."""
    try:
        info = soundfile.info(recording)
    except (soundfile.LibsndfileError, RuntimeError, TypeError):
        return
    seconds = info.frames / info.samplerate if info.samplerate > 0 else 0.0
    if seconds < MIN_RECORDING_SECONDS:
        raise APIError(400, f"the recording is {seconds:.1f} s long; a voice needs at least "
                       f"{MIN_RECORDING_SECONDS:g} s: the model copies a voice from what it hears in the recording, "
                       "and a shorter one gives it too little to go on (10-30 s works best)", "audio",
                       "audio_too_short")


@dataclass
class Take:
    """One finished request of the page: `fields` is its request body (the seed it used included)."""

    number: int
    fields: dict
    files: dict[str, Path]  # format -> file
    seconds: float  # of audio
    first_audio_s: float  # from the click's arrival to the first audio chunk
    real_time_factor: float  # generation time / audio time

    @property
    def label(self) -> str:
        text = self.fields["input"]
        text = text if len(text) <= 40 else text[:39] + "…"
        return f"#{self.number} · {self.fields['voice']} · seed {self.fields['seed']} · {text}"

    def summary(self) -> str:
        return (f"Take #{self.number}: {self.seconds:.2f} s of audio · first audio after "
                f"{self.first_audio_s * 1000:.0f} ms · real-time factor {self.real_time_factor:.2f}")


@dataclass
class Speaking:
    """A request in flight: its first-audio time once known, and the audio so far (float32 chunks)."""

    started: float = field(default_factory=time.perf_counter)
    first_audio_s: float | None = None
    chunks: list[torch.Tensor] = field(default_factory=list)
    seed: int | None = None


class Playground:
    """The page's actions on one server (a FastAPI app made by `create_app`)."""

    def __init__(self, app, takes_dir: Path | None = None):
        self.app = app
        self.settings, self.voices, self.metrics = app.state.settings, app.state.voices, app.state.metrics
        self.takes_dir = Path(takes_dir or tempfile.mkdtemp(prefix="drama3-takes-"))
        self.takes_dir.mkdir(parents=True, exist_ok=True)
        self.live = LiveTakes()  # the takes the page's live player is speaking (ui_player.py)
        # The live route's key with --api-key: only a page past the login gets it. Derived from the API key, so a page
        # left open while the server restarts still holds a valid one.
        key = self.settings.api_key
        self.page_key = "" if key is None else hmac.new(key.encode(), b"drama3 page", hashlib.sha256).hexdigest()

    def service(self):
        return ready_service(self.app)

    def defaults(self) -> dict:
        """The model's sampling settings (the package's defaults while it loads); frames capped at --max-frames."""
        config = self.app.state.service.model.generation_config if self.app.state.service is not None else None
        values = {name: getattr(config, name, default) if config is not None else default
                  for name, default in DRAMA3_GENERATION_DEFAULTS.items()}
        values["max_new_tokens"] = min(values["max_new_tokens"], self.settings.max_frames)
        values["top_k"] = values["top_k"] or 0
        return values

    # -- text ------------------------------------------------------------------------------------------------

    def preview(self, text: str) -> list[str]:
        """The chunks the server will speak (each with its speaker tag), by the checks of a request's `input`
        (`split_input`); the server's 413 or 400 for text it refuses."""
        if not text.strip():
            raise APIError(400, "write something to say first", "input", "invalid_text")
        return split_input(text, self.service(), self.settings)

    # -- voices ----------------------------------------------------------------------------------------------

    def voice_names(self) -> list[str]:
        return self.voices.names()

    @property
    def saves_voices(self) -> bool:
        return self.voices.directory is not None

    async def enrol(self, name: str, transcript: str, recording: str | None, replace: bool = False
                    ) -> tuple[str, list[str]]:
        """Enrol the recording file `recording` as voice `name` (the checks and messages of `POST /v1/voices`, and
        the page's least length); its name and the server's notes on the recording (resampled, mixed to mono)."""
        service = self.service()
        if not self.saves_voices:
            raise APIError(400, "this server saves no voices: start it with --voices DIR", code="voices_disabled")
        if not recording:
            raise APIError(400, "upload or record the voice first (WAV, FLAC, OGG or MP3)", "audio",
                           "missing_parameter")
        await asyncio.to_thread(check_length, recording)
        name = name.strip()
        _, notes = await enrol_recording(service, self.voices, self.settings, name, transcript,
                                         lambda: asyncio.to_thread(Path(recording).read_bytes), replace=replace)
        return name, notes

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(self.voices.delete, name)

    # -- speech ----------------------------------------------------------------------------------------------

    def request_fields(self, text: str, voice: str, settings: dict) -> dict:
        """The request body of a take: the served model, the text, the voice and the page's settings (None: left out
        so that the server's default applies; so are the RAS and codebook settings at the model's values, which keeps
        the copied code short)."""
        fields = {"model": self.settings.model_name, "input": text, "voice": voice or "default",
                  "response_format": "wav"}
        defaults = self.defaults()
        fields.update({name: value for name, value in settings.items()
                       if value is not None and not (name in MORE_SAMPLING and value == defaults[name])})
        return fields

    async def speak(self, fields: dict, speaking: Speaking):
        """Queue the request and yield its float32 audio chunks `[samples]` as they are decoded; the job is cancelled
        when the caller stops iterating (the page's Stop)."""
        service = self.service()
        body = SpeechRequest.model_validate(fields)
        job = await asyncio.to_thread(make_job, body, service, self.settings, self.voices, asyncio.get_running_loop())
        speaking.seed = job.seed
        service.worker.submit(job)
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, APIError):
                    raise event
                if isinstance(event, JobDone):
                    return
                if speaking.first_audio_s is None:
                    speaking.first_audio_s = time.perf_counter() - speaking.started
                    self.metrics.observe_start(job.queued_at, job.started_at, job.first_audio_at)
                speaking.chunks.append(event)
                yield event
        finally:
            job.cancel()  # no effect on a finished job; stops one the page gave up on

    async def keep(self, number: int, fields: dict, speaking: Speaking) -> Take:
        """The page's take `number`: the finished request, its audio written as files."""
        rate = self.service().model.config.sampling_rate
        audio = torch.cat([torch.zeros(0), *speaking.chunks])  # [samples]
        folder = Path(tempfile.mkdtemp(prefix="take-", dir=self.takes_dir))
        formats = [name for name in TAKE_FORMATS if name in available_formats()]

        def write() -> dict[str, Path]:
            files = {}
            for name in formats:
                encoder = AudioEncoder(name, rate, streamed=False)  # the encoder of the HTTP responses
                files[name] = folder / f"drama3-take-{number}.{name}"
                files[name].write_bytes(encoder.encode(audio) + encoder.finish())
            return files

        files = await asyncio.to_thread(write)
        seconds = audio.shape[0] / rate
        elapsed = time.perf_counter() - speaking.started
        return Take(number, {**fields, "seed": speaking.seed}, files, seconds, speaking.first_audio_s or elapsed,
                    elapsed / seconds if seconds else float("nan"))

    def forget(self, take: Take) -> None:
        """Remove a take's files (it fell out of the page's history)."""
        if take.files:
            shutil.rmtree(next(iter(take.files.values())).parent, ignore_errors=True)

    def close(self) -> None:
        """Remove every take's files (the server is shutting down)."""
        shutil.rmtree(self.takes_dir, ignore_errors=True)

    # -- status ----------------------------------------------------------------------------------------------

    def status(self) -> dict:
        """What the page's status line shows: the model and how it runs, the queue and the batch, now."""
        state = self.app.state
        if state.service is None:
            return {"state": "failed to load" if state.load_error else "loading", "model": self.settings.model_name,
                    "error": state.load_error}
        model, worker = state.service.model, state.service.worker
        snapshot = worker.snapshot()
        quantization = getattr(model.config, "quantization_config", None)
        if isinstance(quantization, dict):
            quantization = quantization.get("quant_method")
        return {"state": "draining" if state.draining else "ready", "model": self.settings.model_name,
                "device": str(model.input_device), "dtype": str(model.dtype).removeprefix("torch."),
                "quantization": str(getattr(quantization, "quant_method", quantization) or "none"),
                "queued": snapshot["queued"], "running": snapshot["running"],
                "occupancy": f"{snapshot['running_sequences']}/{worker.max_batch}"}
