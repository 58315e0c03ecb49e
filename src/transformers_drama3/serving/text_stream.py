"""`WS /v1/audio/speech/stream`: text in as it is written (an LLM's tokens), speech out sentence by sentence.

The client opens a session with the settings of `POST /v1/audio/speech` (everything but `input`), appends text in
pieces of any size, and ends it; each time the text holds complete sentences they are queued as one utterance,
spoken as soon as the previous one is done. Utterances after the first are generated with the session's first and
previous utterances as history turns (as long text is, docs/format.md "Long text"), so the voice carries over; the
session's references are encoded once. docs/serving.md ("Streaming text in over a WebSocket") has the protocol:

    client -> server   {"type": "session.start", "model": ..., "voice": ..., "seed": ..., ...}
                       {"type": "text.append", "text": "..."}   (any number)
                       {"type": "text.flush"}                   (speak what is buffered, complete or not)
                       {"type": "text.done"}                    (no more text)
    server -> client   {"type": "session.created", "sample_rate", "encoding", "response_format", "seed"}
                       {"type": "utterance.started", "index", "text", "request_id"}
                       binary messages: that utterance's audio, as it is generated, in the session's
                       `response_format`: "pcm" (default: 16-bit little-endian mono), or an encoded stream ("opus":
                       Ogg Opus at 48 kHz, "mp3", "aac": ADTS), one complete stream per utterance
                       {"type": "utterance.done", "index", "frames", "finish_reasons"}
                       {"type": "session.done", "utterances"}, then the server closes (1000)
                       {"type": "error", "error": {...}}, then the server closes (1008 bad message, 1011 failure,
                       1001 shutting down; that event also has "unspoken_text", the session's text not spoken)

On SIGTERM the server drains: a session finishes the utterance it is speaking, then (or at once, when it is waiting
for text) sends the `draining` error with every piece of text it has not spoken, and closes with 1001.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from ..audio_io import file_sampling_rate
from ..chunking import complete_sentences_end
from ..speaker_tags import SPEAKER_TAG, WHITE_SPACE
from .audio_encoding import check_response_format, response_encoder
from .errors import APIError, validation_error
from .schemas import SpeechRequest
from .worker import JobDone, SpeechJob

logger = logging.getLogger("transformers_drama3.serving")
CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_POLICY, CLOSE_ERROR = 1000, 1001, 1008, 1011
SEED_MODULUS = 2**64
# A session's audio formats (those that stream) -> the `encoding` that session.created names.
SESSION_ENCODINGS = {"pcm": "pcm_s16le", "opus": "ogg_opus", "mp3": "mp3", "aac": "aac_adts"}


DRAINING = object()  # put on a session's utterance queue when the server starts draining: wakes a waiting session


class StreamError(Exception):
    """Ends a session: the error event to send (with `extra` fields beside `error`) and the close code."""

    def __init__(self, error: APIError, code: int, extra: dict | None = None):
        super().__init__(error.message)
        self.error, self.code, self.extra = error, code, extra or {}


class SentenceBuffer:
    """Text appended piece by piece; `take_complete` returns the complete sentences written so far. Keeps the
    current speaker tag, so an utterance that starts in the middle of a speaker's turn starts with that tag."""

    def __init__(self, max_chars: int):
        self.text, self.speaker, self.max_chars = "", "", max_chars

    def append(self, piece: str) -> None:
        if len(self.text) + len(piece) > self.max_chars:
            raise StreamError(APIError(413, f"more than {self.max_chars} characters of text are waiting for a sentence "
                                       "end (--max-text-chars): send text.flush or end sentences", "text",
                                       "input_too_long"), CLOSE_POLICY)
        self.text += piece

    def take(self, end: int) -> str | None:
        """The text up to `end`, with the speaker tag in force in front; None when it is only white space."""
        taken, self.text = self.text[:end], self.text[end:]
        if not taken.strip(WHITE_SPACE):
            return None
        utterance = taken.strip(WHITE_SPACE)
        if self.speaker and not SPEAKER_TAG.match(utterance):
            utterance = f"{self.speaker} {utterance}"
        tags = SPEAKER_TAG.findall(utterance)
        self.speaker = tags[-1] if tags else self.speaker
        return utterance

    def take_complete(self) -> str | None:
        end = complete_sentences_end(self.text)
        return self.take(end) if end else None

    def take_all(self) -> str | None:
        return self.take(len(self.text))


async def receive_json(websocket: WebSocket) -> dict:
    """The client's next message as a JSON object with a `type` (StreamError otherwise)."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", CLOSE_NORMAL))
    try:
        value = json.loads(message.get("text") or "")
    except ValueError:
        value = None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise StreamError(APIError(400, 'every client message is a JSON object with a "type" (text messages, not '
                                   "binary)", "type", "invalid_message"), CLOSE_POLICY)
    return value


class SpeechStreamSession:
    """One WebSocket session: a reader task buffering text into utterances, and this task speaking them in order.

    `make_job(body)` is the server's checked `SpeechJob` for a `SpeechRequest`; `submit(job)` queues it (both may
    raise `APIError`); `draining()` says whether the server is shutting down (no new utterances are started then);
    the server calls `drain()` when it starts to.
    """

    def __init__(self, websocket: WebSocket, make_job, submit, draining, max_chars: int, sampling_rate: int):
        self.websocket, self.make_job, self.submit, self.draining = websocket, make_job, submit, draining
        self.buffer = SentenceBuffer(max_chars)
        self.sampling_rate = sampling_rate
        self.utterances: asyncio.Queue = asyncio.Queue()  # str, None (text done), an error, or DRAINING
        self.loop = asyncio.get_running_loop()
        self.spoken: list[str] = []  # text chunks spoken so far, for history
        self.codes: list = []  # their codes
        self.references: list | None = None  # the session's references, encoded by its first utterance
        self.job: SpeechJob | None = None

    async def run(self) -> None:
        await self.websocket.accept()
        try:
            body = await self.start()
            reader = asyncio.create_task(self.read())
            try:
                count = await self.speak(body)
            finally:
                reader.cancel()
            await self.send({"type": "session.done", "utterances": count})
            await self.websocket.close(CLOSE_NORMAL)
        except StreamError as error:
            await self.fail(error.error, error.code, error.extra)
        except APIError as error:
            if error.code == "draining":  # a session opened after the drain began
                await self.fail(error, CLOSE_GOING_AWAY)
            else:
                await self.fail(error, CLOSE_POLICY if error.status < 500 else CLOSE_ERROR)
        except WebSocketDisconnect:
            pass  # the client left: the running utterance is cancelled below
        finally:
            if self.job is not None:
                self.job.cancel()

    async def start(self) -> SpeechRequest:
        """The session's settings from its first message, checked as a speech request would be."""
        message = await receive_json(self.websocket)
        if message.pop("type") != "session.start":
            raise StreamError(APIError(400, 'the first message must be {"type": "session.start", "model": ..., ...}',
                                       "type", "invalid_message"), CLOSE_POLICY)
        for field in ("input", "stream_format"):
            if field in message:
                raise StreamError(APIError(400, f"{field!r} is not a session setting: send text in text.append "
                                           "messages; audio always streams", field, "unknown_parameter"),
                                  CLOSE_POLICY)
        try:
            body = SpeechRequest(**{"response_format": "pcm", **message, "input": "-"})
        except ValidationError as error:
            raise StreamError(validation_error(error), CLOSE_POLICY) from None
        if body.response_format not in SESSION_ENCODINGS:
            raise StreamError(APIError(400, f"a session's response_format is one of {list(SESSION_ENCODINGS)}, got "
                                       f"{body.response_format!r}", "response_format", "unsupported_format"),
                              CLOSE_POLICY)
        check_response_format(body.response_format, "audio", True)  # installed encoders (APIError: closes 1008)
        first = await self.make_job(body)  # checks model, voice, references and settings before any text
        body.seed, self.references = first.seed, first.references
        rate = file_sampling_rate(f"audio.{body.response_format}", self.sampling_rate)  # Opus: 48 kHz
        await self.send({"type": "session.created", "sample_rate": rate, "response_format": body.response_format,
                         "encoding": SESSION_ENCODINGS[body.response_format], "seed": first.seed})
        return body

    async def read(self) -> None:
        """Client messages -> utterances on the queue (None: the text is done)."""
        try:
            while True:
                message = await receive_json(self.websocket)
                kind = message["type"]
                if kind == "text.append":
                    if not isinstance(message.get("text"), str):
                        raise StreamError(APIError(400, 'text.append needs a string "text"', "text", "invalid_value"),
                                          CLOSE_POLICY)
                    self.buffer.append(message["text"])
                    utterance = self.buffer.take_complete()
                elif kind in ("text.flush", "text.done"):
                    utterance = self.buffer.take_all()
                else:
                    raise StreamError(APIError(400, f"unknown message type {kind!r}: use text.append, text.flush or "
                                               "text.done", "type", "invalid_message"), CLOSE_POLICY)
                if utterance is not None:
                    self.utterances.put_nowait(utterance)
                if kind == "text.done":
                    self.utterances.put_nowait(None)
                    return
        except (StreamError, WebSocketDisconnect) as error:
            if isinstance(error, WebSocketDisconnect) and self.job is not None:
                self.job.cancel()  # the client is gone: stop its utterance at the next frame
            self.utterances.put_nowait(error)

    async def speak(self, body: SpeechRequest) -> int:
        """Speak utterances in order until the text is done; returns how many were spoken."""
        index = 0
        while True:
            utterance = await self.utterances.get()
            if utterance is None:
                return index
            if isinstance(utterance, BaseException):
                raise utterance
            if utterance is DRAINING or self.draining():
                raise self.going_away(utterance)
            body.input = utterance
            try:
                await self.speak_one(body, index, (body.seed + index) % SEED_MODULUS)
            except APIError as error:
                if error.code == "draining":  # refused before it started: the drain began meanwhile
                    raise self.going_away(utterance) from None
                raise
            index += 1

    def drain(self) -> None:
        """The server starts draining (called from any thread): wake `speak` if it is waiting for text."""
        self.loop.call_soon_threadsafe(self.utterances.put_nowait, DRAINING)

    def going_away(self, utterance) -> StreamError:
        """The drain's error: every piece of text not spoken (`utterance`, the queued ones, the buffer's rest)."""
        pending = [utterance]
        while not self.utterances.empty():
            pending.append(self.utterances.get_nowait())
        pending.append(self.buffer.take_all())
        unspoken = " ".join(piece for piece in pending if isinstance(piece, str))
        error = APIError(503, "the server is shutting down: open a session on another replica and send "
                         "unspoken_text again", code="draining")
        return StreamError(error, CLOSE_GOING_AWAY, {"unspoken_text": unspoken})

    async def speak_one(self, body: SpeechRequest, index: int, seed: int) -> None:
        body = body.model_copy(update={"seed": seed})
        job = await self.make_job(body)
        job.references = self.references  # read once by session.start, encoded by the first utterance
        chunks = job.texts
        job.texts, job.spoken, job.codes = [*self.spoken, *chunks], list(self.spoken), list(self.codes)
        self.job = job
        self.submit(job)
        await self.send({"type": "utterance.started", "index": index, "text": " ".join(chunks),
                         "request_id": job.request_id})
        encoder = self.encoder(body)
        while True:
            event = await job.events.get()
            if isinstance(event, APIError):
                raise StreamError(event, CLOSE_ERROR if event.status >= 500 else CLOSE_POLICY)
            if isinstance(event, JobDone):
                break
            data = encoder.encode(event)
            if data:
                await self.websocket.send_bytes(data)
        rest = encoder.finish()  # the end of this utterance's stream
        if rest:
            await self.websocket.send_bytes(rest)
        await asyncio.to_thread(job.settled.wait)  # its codes are recorded once the worker has finished it
        self.references, self.spoken, self.codes, self.job = job.references, job.spoken, job.codes, None
        await self.send({"type": "utterance.done", "index": index, "frames": event.frames,
                         "finish_reasons": job.finish_reasons})

    def encoder(self, body: SpeechRequest):
        """A new streaming encoder of the session's format, for one utterance."""
        return response_encoder(body.response_format, self.sampling_rate, streamed=True)

    async def send(self, message: dict) -> None:
        await self.websocket.send_text(json.dumps(message))

    async def fail(self, error: APIError, code: int, extra: dict | None = None) -> None:
        """Send the error event (with `extra` fields) and close (the client may be gone already)."""
        try:
            await self.send({"type": "error", **error.body(), **(extra or {})})
            await self.websocket.close(code, reason=error.code or "")
        except (WebSocketDisconnect, RuntimeError):
            pass


__all__ = ["SentenceBuffer", "SpeechStreamSession"]
