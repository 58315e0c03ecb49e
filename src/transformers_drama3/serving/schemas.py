"""Request bodies of the speech server (pydantic models).

`SpeechRequest` is OpenAI's `POST /v1/audio/speech` body (`model`, `input`, `voice`, `response_format`, `speed`,
`stream_format`, `instructions`) plus the fields of the official Drama 3 server's request: `references`, `seed`,
`temperature`, `top_p`, `top_k`, `max_new_tokens`. Types (and the seed's range) are checked here; the other ranges
and the rules between fields are checked by the server with the package's own validation (`generation_settings`, the
processor's text checks), so they read the same as in Python. Unknown fields are refused, so a misspelt setting is never silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field


class VoiceID(BaseModel):
    """OpenAI's custom-voice form of `voice`: `{"id": "NAME"}`."""

    model_config = ConfigDict(extra="forbid")
    id: str


class ReferenceAudio(BaseModel):
    """A voice reference sent with the request: an audio file (WAV, FLAC, OGG or MP3) as base64, and what is said
    in it (`transcript`, or `text` as the official server calls it)."""

    model_config = ConfigDict(extra="forbid")
    audio: str = Field(description="base64 of an audio file")
    transcript: str = Field(validation_alias=AliasChoices("transcript", "text"))


class SpeechRequest(BaseModel):
    """The body of `POST /v1/audio/speech`."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str = Field(description="text to speak; <|speaker:N|> tags switch speakers")
    voice: str | VoiceID = Field("default", description="a saved voice name (GET /v1/voices), or 'default'")
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    references: list[ReferenceAudio] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    temperature: float | None = Field(None, description="main-token temperature; 0 means greedy decoding")
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = Field(None, description="most frames per text chunk (21.5 frames = 1 s)")

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceID) else self.voice


class BatchSpeechItem(SpeechRequest):
    """One input of `POST /v1/audio/speech/batch`: the fields of a speech request; `model` and `response_format`
    default to the batch's."""

    model: str | None = None
    response_format: str | None = None


class BatchSpeechRequest(BaseModel):
    """The body of `POST /v1/audio/speech/batch`: several speech requests answered in one JSON response."""

    model_config = ConfigDict(extra="forbid")

    model: str
    items: list[BatchSpeechItem] = Field(min_length=1, description="the inputs, each a speech request's fields")
    response_format: str = Field("wav", description="the audio format of every item that does not set its own")
