"""Request bodies of the speech server (pydantic models).

`SpeechRequest` is OpenAI's `POST /v1/audio/speech` body (`model`, `input`, `voice`, `response_format`, `speed`,
`stream_format`, `instructions`) plus the fields of the official Drama 3 server's request (sglang-omni's): `stream`,
`speaker` (another name for `voice`), `references` (each `audio` or `data`, and `text` or `transcript`), `ref_audio`
with `ref_text`, `language`, `seed`, `temperature`, `top_p`, `top_k`, `repetition_penalty` and `max_new_tokens`; and
Drama 3's other sampling settings, named as `generate` names them: `ras_window`, `ras_temperature`, `ras_top_k`,
`ras_top_p` (repetition-aware sampling of the main token) and `codebook_temperature`, `codebook_top_k`,
`codebook_top_p` (the codes after the first).
Types (and the seed's range) are checked here, strictly: a number is never read from a string (`"7"`) or a bool
(`true`), nor a bool from a string (`"yes"`); the other ranges and the rules between fields are checked by the
server with the package's own validation (`generation_settings`, the processor's text checks), so they read the same
as in Python. Unknown fields are refused, so a misspelt setting is never silently ignored.
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
    audio: str = Field(description="base64 of an audio file (or a data: URL)",
                       validation_alias=AliasChoices("audio", "data"))
    transcript: str = Field(validation_alias=AliasChoices("transcript", "text"))
    media_type: str | None = Field(None, description="accepted and not needed: the bytes say their format")


class SpeechRequest(BaseModel):
    """The body of `POST /v1/audio/speech`."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str = Field(description="text to speak; <|speaker:N|> tags switch speakers")
    voice: str | VoiceID = Field("default", validation_alias=AliasChoices("voice", "speaker"),
                                 description="a saved voice name (GET /v1/voices), an OpenAI voice name, or 'default'")
    response_format: str = "mp3"
    speed: float = Field(1.0, strict=True)
    stream: bool | None = Field(None, strict=True,
                                description="send the audio as it is made (default: the format's own)")
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    language: str | None = Field(None, description="accepted; Drama 3 reads the language from the text itself")
    references: list[ReferenceAudio] = Field(default_factory=list)
    ref_audio: str | None = Field(None, description="one reference: base64 of an audio file (or a data: URL)")
    ref_text: str | None = Field(None, description="what is said in ref_audio")
    seed: int | None = Field(None, ge=0, le=2**64 - 1, strict=True)
    temperature: float | None = Field(None, strict=True, description="main-token temperature; 0 means greedy decoding")
    top_p: float | None = Field(None, strict=True)
    top_k: int | None = Field(None, strict=True, description="main-token top-k; 0 or left out: no limit")
    repetition_penalty: float | None = Field(None, strict=True,
                                             description="only 1.0 (none): Drama 3 samples without penalties")
    max_new_tokens: int | None = Field(None, strict=True,
                                       description="most frames per text chunk (21.5 frames = 1 s)")
    ras_window: int | None = Field(None, strict=True, description="frames the repetition-aware sampling looks back "
                                   "over (0: off)")
    ras_temperature: float | None = Field(None, strict=True, description="temperature of the repetition-aware resample")
    ras_top_k: int | None = Field(None, strict=True, description="top-k of the repetition-aware resample (0: no limit)")
    ras_top_p: float | None = Field(None, strict=True, description="top-p of the repetition-aware resample")
    codebook_temperature: float | None = Field(None, strict=True, description="temperature of the codes after the first")
    codebook_top_k: int | None = Field(None, strict=True, description="top-k of the codes after the first")
    codebook_top_p: float | None = Field(None, strict=True, description="top-p of the codes after the first")

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceID) else self.voice

    def all_references(self) -> list[tuple[str, str, ReferenceAudio]]:
        """(its audio field, its transcript field, reference) of `references` and of `ref_audio`/`ref_text`."""
        found = [(f"references[{index}].audio", f"references[{index}].transcript", reference)
                 for index, reference in enumerate(self.references)]
        if self.ref_audio is not None:
            found.append(("ref_audio", "ref_text", ReferenceAudio(audio=self.ref_audio, transcript=self.ref_text or "")))
        return found


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
