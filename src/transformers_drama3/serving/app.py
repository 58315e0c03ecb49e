"""The FastAPI application of `drama3-serve`: OpenAI's speech endpoint and the server's own routes.

    POST /v1/audio/speech   speech (OpenAI and sglang-omni requests + Drama 3 fields); pcm/mp3/opus/aac stream, wav on
                            request ("stream": true), sse events; flac and wav complete (audio_encoding.py)
    GET  /v1/models         the one model this process serves
    GET  /v1/voices         saved voices;  POST /v1/voices enrols one from an uploaded recording
    GET, PUT, DELETE /v1/voices/{name}   one voice: its details, replace (or create) it, delete it
    POST /v1/audio/speech/batch   several speech requests in one call, answered with base64 audio in JSON
    WS   /v1/audio/speech/stream  text in as it is written, speech out sentence by sentence (text_stream.py)
    GET  /health            200 when the model is loaded, 503 while it loads or drains (never needs the API key)
    GET  /metrics           Prometheus metrics (metrics.py)
    GET  /docs              the API in Swagger UI, whose files the server serves itself (it works offline)

The model loads in the background after the server starts, so `/health` answers during a long load. Every request
is checked completely (key, size, fields, text, voice, references, settings) before it is queued; errors are
OpenAI-shaped JSON (errors.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException

from ..audio_io import AudioEncoder
from ..generation import generation_settings
from ..loading import dtype_label, load_model, resolve_device_and_dtype
from ..processing_drama3 import Drama3Processor
from ..settings_checks import COUNTS, SettingError, is_integer
from .audio_encoding import ResponseFormat, check_response_format, response_encoder
from .errors import APIError, body_too_large, install_error_handlers
from .metrics import PROMETHEUS_TEXT, CountRequests, ServerMetrics
from .reference_audio import decode_base64_audio, read_audio_bytes
from .schemas import BatchSpeechRequest, SpeechRequest
from .settings import ServerSettings
from .text_stream import SpeechStreamSession
from .voices import DEFAULT_VOICE, VoiceLibrary
from .worker import GenerationWorker, JobDone, SpeechJob

logger = logging.getLogger("transformers_drama3.serving")
OPENAI_SPEECH_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # accepted as `model`, so hard-wired clients work
# OpenAI's voice names: each speaks with the voice `--voice-alias NAME=VOICE` gives it, else with `default`.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")
DISCONNECT_POLL_SECONDS = 0.5  # how often a request waiting for audio checks that its client is still there
PROTECTED_PREFIXES = ("/v1/", "/metrics")
# Sampling settings a request may set besides temperature, top_p and top_k: passed on as `generate` names them.
MORE_SAMPLING = ("ras_window", "ras_temperature", "ras_top_k", "ras_top_p", "codebook_temperature", "codebook_top_k",
                 "codebook_top_p")


class StreamAborted(Exception):
    """A streamed response failed after its headers were sent: the connection is closed without the final chunk,
    so the client sees an incomplete body rather than a short but seemingly complete file."""


@dataclass
class SpeechService:
    """What a loaded server holds: the model, its processor and the generation worker."""

    model: object
    processor: Drama3Processor
    worker: GenerationWorker

    @classmethod
    def load(cls, settings: ServerSettings) -> SpeechService:
        device, dtype = resolve_device_and_dtype(settings.device, settings.dtype)
        logger.info("loading %s on %s (%s)", settings.model, device, dtype_label(dtype))
        model = load_model(settings.model, device, dtype)
        processor = Drama3Processor.from_pretrained(settings.model, codec=model.codec)
        processor.max_reference_seconds = settings.max_reference_seconds
        step_options = {"fast_decode": settings.fast_decode, "compile_step": settings.compile_step}
        worker = GenerationWorker(model, processor, settings.max_batch, settings.max_queue, step_options=step_options,
                                  log_text=settings.log_text, prompt_cache_bytes=int(settings.prompt_cache_mb * 2**20))
        return cls(model, processor, worker)


def create_app(settings: ServerSettings, on_load_failure=None) -> FastAPI:
    """The server's FastAPI app. The model loads when the app starts; `on_load_failure(error)` is called if that
    fails (the command line stops the server then)."""
    voices = VoiceLibrary(settings.voices_dir)
    if voices.directory is not None:
        logger.info("voices: %d in %s (shared with every server that uses it)", voices.scan(), voices.directory)

    async def load_and_serve() -> None:
        try:
            service = await asyncio.to_thread(SpeechService.load, settings)
        except Exception as error:  # noqa: BLE001  (reported by /health and the log; the CLI exits)
            logger.error("cannot load %s: %s", settings.model, error)
            app.state.load_error = f"{type(error).__name__}: {error}"
            if on_load_failure is not None:
                on_load_failure(error)
            return
        service.worker.start()
        app.state.service = service
        logger.info("ready: serving %s as %r", settings.model, settings.model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(load_and_serve())
        yield
        service = app.state.service
        if service is not None:
            service.worker.cancel_all()
        task.cancel()
        if service is not None:
            await asyncio.to_thread(service.worker.shutdown)

    # /docs is Swagger UI from fastapi-offline's copy of its files (FastAPI's own page loads them from a CDN, which is
    # a blank page offline); no ReDoc.
    app = FastAPIOffline(title="Drama 3 speech server", lifespan=lifespan, redoc_url=None)
    install_error_handlers(app, settings.max_body_bytes)
    app.add_middleware(RequestGuard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    app.state.service, app.state.load_error = None, None  # the SpeechService once loaded; why loading failed
    app.state.draining = False  # set by `start_draining` (SIGTERM): new requests get 503, running ones finish
    app.state.sessions = set()  # the open WebSocket sessions, told by `start_draining`
    metrics = ServerMetrics(lambda: None if app.state.service is None else app.state.service.worker, settings.max_batch)
    app.add_middleware(CountRequests, metrics=metrics, routes=lambda: {route.path for route in app.routes})

    app.state.settings, app.state.voices, app.state.metrics = settings, voices, metrics  # for the page (ui.py)

    def ready() -> SpeechService:
        return ready_service(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if app.state.draining:
            return JSONResponse({"status": "draining", "model": settings.model_name}, 503)
        if app.state.service is not None:
            return JSONResponse({"status": "ok", "model": settings.model_name})
        status = "failed" if app.state.load_error else "loading"
        return JSONResponse({"status": status, "model": settings.model_name, "error": app.state.load_error}, 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "transformers-drama3"}]}

    @app.get("/v1/voices")
    async def list_voices() -> dict:
        return {"object": "list", "data": await asyncio.to_thread(voices.describe_all)}

    @app.get("/v1/voices/{name}")
    async def voice_details(name: str) -> dict:
        return await asyncio.to_thread(voices.describe, name, 404)

    @app.delete("/v1/voices/{name}")
    async def delete_voice(name: str) -> dict:
        await asyncio.to_thread(voices.delete, name)
        logger.info("deleted voice %r", name)
        return {"id": name, "object": "voice", "deleted": True}

    @app.post("/v1/voices", status_code=201)
    async def enrol_voice(request: Request) -> JSONResponse:
        return await enrol(request, None)

    @app.put("/v1/voices/{name}")
    async def replace_voice(name: str, request: Request) -> JSONResponse:
        return await enrol(request, name)

    async def enrol(request: Request, replacing: str | None) -> JSONResponse:
        """Encode an uploaded recording into a voice and save it: a new name (POST), or `replacing` (PUT: 200 when
        a voice was replaced, 201 when it is new)."""
        service = ready()
        if voices.directory is None:
            raise APIError(400, "this server saves no voices: start it with --voices DIR", "name", "voices_disabled")
        form = await request.form()
        name = replacing if replacing is not None else form.get("name")
        transcript, upload = form.get("transcript"), form.get("audio")
        for field, value in (("name", name), ("transcript", transcript)):
            if not isinstance(value, str):
                raise APIError(400, f"missing form field {field!r}: send multipart fields name, transcript and audio "
                               "(the recording)", field, "missing_parameter")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "missing file field 'audio': upload the recording (WAV, FLAC, OGG or MP3)", "audio",
                           "missing_parameter")
        replaced, notes = await enrol_recording(service, voices, settings, name, transcript, upload.read,
                                                replacing is not None)
        return JSONResponse({**voices.describe(name), **({"warnings": notes} if notes else {})},
                            status_code=200 if replaced else 201)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.text(), media_type=PROMETHEUS_TEXT)

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest, request: Request) -> Response:
        service = ready()
        spec = check_response_format(body.response_format, body.stream_format, body.stream)
        streamed = body.stream_format == "sse" or (spec.streams_by_default if body.stream is None else body.stream)
        encoder = response_encoder(body.response_format, service.model.config.sampling_rate, streamed,
                                   openai_model=body.model in OPENAI_SPEECH_MODELS)
        # Off the event loop: reading reference audio can take a moment, and other responses are streaming.
        job = await asyncio.to_thread(make_job, body, service, settings, voices, asyncio.get_running_loop())
        service.worker.submit(job)
        headers = {"X-Request-Id": job.request_id, "X-Seed": str(job.seed),
                   "X-Sample-Rate": str(encoder.sampling_rate)}
        return await respond(job, body, spec, request, headers, encoder, metrics)

    @app.post("/v1/audio/speech/batch")
    async def speech_batch(body: BatchSpeechRequest, request: Request) -> JSONResponse:
        service = ready()
        if len(body.items) > service.worker.max_queue:  # could never be queued whole: refused, never half run
            raise APIError(413, f"a batch has at most {service.worker.max_queue} items (the server's --max-queue); got "
                           f"{len(body.items)}: split it into several calls", "items", "batch_too_large")
        loop = asyncio.get_running_loop()
        bodies = [item_checked(index, batch_item, body, index) for index in range(len(body.items))]
        specs = [item_checked(index, check_response_format, item.response_format, "audio", None)  # sent complete
                 for index, item in enumerate(bodies)]
        jobs = [await asyncio.to_thread(item_checked, index, make_job, item, service, settings, voices, loop)
                for index, item in enumerate(bodies)]
        service.worker.submit(*jobs)  # all of them or none
        try:
            results = await asyncio.gather(*(batch_result(job, item, spec, request, service.model.config.sampling_rate)
                                             for job, item, spec in zip(jobs, bodies, specs)))
        finally:
            for job in jobs:
                job.cancel()  # no effect on finished jobs; frees the rest if the client left
        data = [{"index": index, **result} for index, result in enumerate(results)]
        return JSONResponse({"object": "list", "model": settings.model_name, "data": data})

    def batch_item(body: BatchSpeechRequest, index: int) -> SpeechRequest:
        item = body.items[index]
        if item.stream_format != "audio":
            raise APIError(400, "items of a batch cannot stream: leave stream_format out (audio comes back as base64 "
                           "in the JSON response)", "stream_format", "unsupported_value")
        fields = item.model_dump(exclude_unset=True)
        fields["model"], fields["response_format"] = item.model or body.model, item.response_format or body.response_format
        return SpeechRequest.model_validate(fields)

    def item_checked(index: int, check, *args):
        """`check(*args)` for item `index` of a batch: its errors name the item (`items[3].temperature`)."""
        try:
            return check(*args)
        except APIError as error:
            param = f"items[{index}].{error.param}" if error.param else f"items[{index}]"
            raise APIError(error.status, f"items[{index}]: {error.message}", param, error.code,
                           error.headers) from error

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket) -> None:
        def open_service() -> SpeechService:
            return ready()

        async def new_job(body: SpeechRequest) -> SpeechJob:
            return await asyncio.to_thread(make_job, body, open_service(), settings, voices, asyncio.get_running_loop())

        def submit(job: SpeechJob) -> None:
            open_service().worker.submit(job)

        service = app.state.service
        rate = service.model.config.sampling_rate if service is not None else 0
        session = SpeechStreamSession(websocket, new_job, submit, lambda: app.state.draining, settings.max_text_chars,
                                      rate)
        app.state.sessions.add(session)
        try:
            await session.run()
        finally:
            app.state.sessions.discard(session)

    return app


def ready_service(app: FastAPI) -> SpeechService:
    """The loaded `SpeechService`, or the 503 that says why there is none (draining, loading, failed to load)."""
    if app.state.draining:
        raise APIError(503, "the server is shutting down: send the request to another replica or retry later",
                       code="draining", headers={"Retry-After": "5"})
    if app.state.service is None:
        if app.state.load_error:
            raise APIError(503, f"the model failed to load: {app.state.load_error}", code="model_unavailable")
        raise APIError(503, "the model is still loading; GET /health answers 200 when it is ready",
                       code="model_loading", headers={"Retry-After": "5"})
    return app.state.service


async def enrol_recording(service: SpeechService, voices: VoiceLibrary, settings: ServerSettings, name: str,
                          transcript: str, read_recording, replace: bool) -> tuple[bool, list[str]]:
    """Check a name and transcript, then read (`await read_recording()`: the file's bytes), length-check, encode and
    save a recording as voice `name`. Returns whether it replaced a voice, and the processor's notes on converting the
    recording (channels averaged, resampled), which the processor logs too."""
    voices.check_new_name(name, replace=replace)
    checked(lambda: service.processor.check_text(transcript, "transcript"), "transcript")
    data = await read_recording()
    samples, rate = await asyncio.to_thread(read_audio_bytes, data, "audio", settings.max_reference_seconds)

    def encode():
        return service.processor.create_voice(transcript, samples, rate, name=name)

    # The generation thread encodes it, between two frames: the model is used by one thread at a time.
    voice = await service.worker.call(encode)
    replaced = await asyncio.to_thread(voices.save, name, voice, replace)
    logger.info("%s voice %r (%d frames)", "replaced" if replaced else "enrolled", name, voice.codes.shape[1])
    return replaced, service.processor.conversion_notes(samples.shape[0], rate, "audio")


def start_draining(app: FastAPI) -> None:
    """Begin a graceful shutdown: new requests get 503 and `/health` says draining; running ones go on; each
    WebSocket session finishes its utterance and closes (any thread, a signal handler too)."""
    app.state.draining = True
    for session in list(app.state.sessions):
        session.drain()
    logger.info("draining: new requests are refused, running requests finish")


def drained(app: FastAPI) -> bool:
    """Whether a draining server has no request left waiting or running and no WebSocket session open."""
    service = app.state.service
    return not app.state.sessions and (service is None or service.worker.idle)


async def batch_result(job: SpeechJob, body: SpeechRequest, spec: ResponseFormat, request: Request,
                       sampling_rate: int) -> dict:
    """One item of a batch response: its audio file as base64, or its error (the other items go on)."""
    events = []
    while not events or not isinstance(events[-1], (JobDone, APIError)):
        events.append(await next_event(job, request))
    if isinstance(events[-1], APIError):
        return {"id": job.request_id, "error": events[-1].body()["error"]}
    audio = torch.cat([torch.zeros(0), *events[:-1]])  # [samples]
    encoder = response_encoder(body.response_format, sampling_rate, streamed=False)  # complete: a WAV's real sizes
    data = await asyncio.to_thread(lambda: encoder.encode(audio) + encoder.finish())
    done = events[-1]
    return {"id": job.request_id, "seed": job.seed, "response_format": body.response_format,
            "media_type": spec.media_type, "audio": base64.b64encode(data).decode("ascii"),
            "usage": {"input_tokens": done.prompt_rows, "output_tokens": done.frames,
                      "total_tokens": done.prompt_rows + done.frames}}


def make_job(body: SpeechRequest, service: SpeechService, settings: ServerSettings, voices: VoiceLibrary,
             loop: asyncio.AbstractEventLoop) -> SpeechJob:
    """A checked `SpeechJob` for a request (its events go to `loop`), or the APIError that says what is wrong."""
    if body.model not in (settings.model_name, settings.model, *OPENAI_SPEECH_MODELS):
        raise APIError(404, f"the model {body.model!r} does not exist; this server speaks with "
                       f"{settings.model_name!r} (GET /v1/models)", "model", "model_not_found")
    texts = split_input(body.input, service, settings)
    if body.speed != 1.0:
        raise APIError(400, f"speed {body.speed} is not supported: Drama 3 speaks at its own pace; send 1.0 or leave "
                       "it out", "speed", "unsupported_value")
    if body.instructions:
        raise APIError(400, "instructions are not supported: Drama 3 follows cues written in the input itself, "
                       "e.g. '[whispering] Come closer.'", "instructions", "unsupported_value")
    if body.repetition_penalty not in (None, 1.0):
        raise APIError(400, f"repetition_penalty {body.repetition_penalty} is not supported: Drama 3 samples without "
                       "penalties; send 1.0 or leave it out", "repetition_penalty", "unsupported_value")
    sampling, max_new_tokens = sampling_settings(body, service, settings)
    references = []
    voice = voices.get(voice_name(body.voice_name, settings.voice_aliases, voices))
    if voice is not None:
        references.append(voice)
    for audio_field, text_field, reference in body.all_references():
        checked(lambda: service.processor.check_text(reference.transcript, text_field), text_field)
        data = decode_base64_audio(reference.audio, audio_field)
        samples, rate = read_audio_bytes(data, audio_field, settings.max_reference_seconds)
        references.append({"transcript": reference.transcript, "audio": samples, "sampling_rate": rate})
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    return SpeechJob(request_id=f"speech-{uuid.uuid4().hex[:16]}", texts=texts, references=references,
                     sampling=sampling, max_new_tokens=max_new_tokens, seed=seed, text_length=len(body.input),
                     loop=loop)


def split_input(text: str, service: SpeechService, settings: ServerSettings) -> list[str]:
    """The chunks a request's `input` is spoken in, or the APIError that says why the server refuses it (longer than
    --max-text-chars, a control token, a bad speaker tag, ...); the playground's preview runs it as it is typed."""
    if len(text) > settings.max_text_chars:
        raise APIError(413, f"input has {len(text)} characters; this server takes at most "
                       f"{settings.max_text_chars} (--max-text-chars)", "input", "input_too_long")
    return checked(lambda: service.processor.split_text(text, max_bytes=settings.chunk_bytes), "input")


def voice_name(name: str, aliases: dict[str, str], voices: VoiceLibrary) -> str:
    """The saved voice a requested name means: its `--voice-alias`, else itself; one of OpenAI's voice names that
    is neither aliased nor saved means `default`."""
    name = aliases.get(name, name)
    if name in OPENAI_VOICES and name not in voices.names():
        return DEFAULT_VOICE
    return name


def sampling_settings(body: SpeechRequest, service: SpeechService, settings: ServerSettings) -> tuple[dict, int]:
    """The request's sampling settings and its frame limit, checked by `generation_settings`
    as `generate` would check them; `temperature` 0 means greedy decoding."""
    requested = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "max_new_tokens",
                                                           *MORE_SAMPLING)}
    requested = {name: value for name, value in requested.items() if value is not None}
    if requested.get("temperature") == 0:
        requested.pop("temperature")
        requested["do_sample"] = False
    frames = requested.get("max_new_tokens")
    if is_integer(frames) and not COUNTS["max_new_tokens"] <= frames <= settings.max_frames:
        raise APIError(400, f"max_new_tokens must be an integer in [{COUNTS['max_new_tokens']}, {settings.max_frames}] "
                       f"(the server's --max-frames), got {frames}", "max_new_tokens", "invalid_value")
    try:
        checked_settings = generation_settings(service.model.generation_config, **requested)
    except (TypeError, ValueError) as error:
        message = str(error).replace("use do_sample=False", "send temperature 0")  # the HTTP API's word for it
        param = error.setting if isinstance(error, SettingError) else next(iter(requested), None)
        raise APIError(400, message, param, "invalid_value") from error
    if checked_settings.do_sample:
        sampling = {"do_sample": True, "temperature": checked_settings.temperature, "top_p": checked_settings.top_p,
                    "top_k": checked_settings.top_k or None,  # 0 and None both mean no limit
                    **{name: getattr(checked_settings, name) for name in MORE_SAMPLING if name in requested}}
    else:
        sampling = {"do_sample": False}
    max_new_tokens = requested.get("max_new_tokens", min(checked_settings.max_new_tokens, settings.max_frames))
    return sampling, max_new_tokens


def checked(call, param: str):
    """`call()`, with the processor's ValueError/TypeError (bad text, bad speaker tag, control tokens) as a 400."""
    try:
        return call()
    except (ValueError, TypeError) as error:
        raise APIError(400, str(error), param, "invalid_text") from error


async def next_event(job: SpeechJob, request: Request):
    """The job's next event, cancelling the job if the client disconnects while it waits."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise APIError(499, "the client disconnected", code="cancelled") from None


async def respond(job: SpeechJob, body: SpeechRequest, spec: ResponseFormat, request: Request, headers: dict,
                  encoder: AudioEncoder, metrics: ServerMetrics) -> Response:
    """The response of a queued job. Nothing is sent before its first event, so a request that fails before any
    audio gets a proper error status; after that, a streamed format and `sse` go out as audio is decoded, and a
    complete one is encoded once the speech is."""
    try:
        first = await next_event(job, request)
    except BaseException:
        job.cancel()
        raise
    if isinstance(first, APIError):
        raise first
    metrics.observe_start(job.queued_at, job.started_at, job.first_audio_at)
    if body.stream_format == "sse":
        return StreamingResponse(sse_events(job, first, encoder), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})
    if encoder.streamed:
        return StreamingResponse(audio_bytes(job, first, encoder), media_type=spec.media_type, headers=headers)
    chunks = [first]
    try:
        while not isinstance(chunks[-1], (JobDone, APIError)):
            chunks.append(await next_event(job, request))
    except BaseException:
        job.cancel()
        raise
    if isinstance(chunks[-1], APIError):
        raise chunks[-1]
    audio = torch.cat([torch.zeros(0), *chunks[:-1]])  # [samples]
    data = await asyncio.to_thread(lambda: encoder.encode(audio) + encoder.finish())
    return Response(data, media_type=spec.media_type, headers=headers)


async def audio_bytes(job: SpeechJob, event, encoder: AudioEncoder):
    """The body of a streamed response: the encoder's bytes as the audio is decoded."""
    try:
        while not isinstance(event, JobDone):
            if isinstance(event, APIError):
                raise StreamAborted(f"request {job.request_id} failed after its audio started: {event.message}")
            data = encoder.encode(event)
            if data:
                yield data
            event = await job.events.get()
        yield encoder.finish()
    finally:
        job.cancel()  # no effect once the job is done; stops it if the client went away


async def sse_events(job: SpeechJob, event, encoder: AudioEncoder):
    """Server-sent events: `speech.audio.delta` (base64 of the next bytes of the pcm/wav stream), then
    `speech.audio.done` with usage (prompt rows in, frames out), or an `error` event."""

    def message(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def delta(data: bytes) -> str:
        return message({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})

    try:
        while not isinstance(event, JobDone):
            if isinstance(event, APIError):
                yield message({"type": "error", **event.body()})
                return
            data = encoder.encode(event)
            if data:
                yield delta(data)
            event = await job.events.get()
        rest = encoder.finish()
        if rest:
            yield delta(rest)
        usage = {"input_tokens": event.prompt_rows, "output_tokens": event.frames,
                 "total_tokens": event.prompt_rows + event.frames}
        yield message({"type": "speech.audio.done", "usage": usage})
    finally:
        job.cancel()


class RequestGuard:
    """ASGI middleware run before any route reads a body: the API key (when the server has one) on `/v1/...` and
    `/metrics` (`/health` never needs it), and the body limit: a `Content-Length` over it is refused before the body
    is read, and a body sent without one is stopped as soon as it passes the limit. Both answer 413 in the OpenAI
    shape (FastAPI's own `max_body_size` answers a declared length in plain text, hence this middleware)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = self.refusal(scope["path"], headers.get(b"authorization", b"").decode("latin-1"),
                                 headers.get(b"content-length", b"").decode("latin-1"))
            if error is not None:
                return await error.response()(scope, receive, send)
            receive = self.limited(receive)
        elif scope["type"] == "websocket":  # the key only: a WebSocket has no request body
            headers = dict(scope["headers"])
            error = self.refusal(scope["path"], headers.get(b"authorization", b"").decode("latin-1"), "")
            if error is not None:
                await receive()  # websocket.connect
                return await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
        await self.app(scope, receive, send)

    def limited(self, receive):
        """`receive` that raises a 413 once the body passes the limit (FastAPI passes the HTTPException on to the
        error handlers while it reads the body)."""
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413)
            return message

        return receive_within_limit

    def refusal(self, path: str, authorization: str, content_length: str) -> APIError | None:
        if self.api_key is not None and path.startswith(PROTECTED_PREFIXES):
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return APIError(401, "no API key: send the header 'Authorization: Bearer YOUR_KEY'",
                                code="invalid_api_key")
            if not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                return APIError(401, "incorrect API key", code="invalid_api_key")
        if content_length.isdigit() and int(content_length) > self.max_body_bytes:
            return body_too_large(self.max_body_bytes)
        return None


__all__ = ["MORE_SAMPLING", "RequestGuard", "SpeechService", "create_app", "drained", "enrol_recording", "make_job", "ready_service",
           "split_input", "start_draining"]
