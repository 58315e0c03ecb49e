"""`ServerSettings`: what one `drama3-serve` process serves and the limits it enforces (each is a CLI flag)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..chunking import MIN_CHUNK_BYTES


@dataclass
class ServerSettings:
    """Options of a speech server; the defaults are those of `drama3-serve --help`.

    model: checkpoint directory or Hub id. model_name: the id clients send as `model` and `GET /v1/models` lists
    (default: the checkpoint's directory name). voices_dir: where saved voices (`NAME.voice.safetensors`) live.
    api_key: when set, every `/v1` call needs `Authorization: Bearer API_KEY`. max_batch: most requests generating
    at once (the engine's running batch). max_queue: requests waiting for their first frame beyond which new ones get
    429. max_text_chars: longest `input` (413 beyond).
    max_reference_seconds: longest reference or enrolled voice audio. max_body_bytes: largest request body
    (JSON with base64 references, or a voice upload; 413 beyond). max_frames: the most frames (21.5 per second)
    a request may ask for per text chunk, also the default. chunk_bytes: long `input` is spoken in chunks of at
    most this many UTF-8 bytes. fast_decode / compile_step: how the engine runs its frame step (a CUDA graph per frame
    on CUDA / `torch.compile` first, True or a backend name; docs/usage.md). log_text: put the text of each request in
    the log (off: only its length). voice_aliases: OpenAI voice names (or any names) -> saved voice names
    (`--voice-alias alloy=narrator`); an OpenAI voice name without one speaks with `default`.
    prompt_cache_mb: memory for the cached prompt prefixes of saved voices (their backbone and tower caches, computed once per voice; least recently used evicted first; 0 turns it off).
    drain_seconds: after SIGTERM, how long running requests may take to finish before the server stops anyway.
    """

    model: str = "fishaudio/drama-3"
    model_name: str | None = None
    voices_dir: Path | None = None
    api_key: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_batch: int = 16
    max_queue: int = 64
    max_text_chars: int = 4096
    max_reference_seconds: float = 60.0
    max_body_bytes: int = 32 * 1024 * 1024
    max_frames: int = 2048
    chunk_bytes: int = 300
    fast_decode: bool = False
    compile_step: bool | str = False
    log_text: bool = False
    voice_aliases: dict[str, str] = field(default_factory=dict)
    prompt_cache_mb: float = 512.0
    drain_seconds: float = 60.0

    def __post_init__(self):
        for name in ("max_batch", "max_queue", "max_text_chars", "max_body_bytes", "max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prompt_cache_mb", "drain_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_reference_seconds <= 0:
            raise ValueError(f"max_reference_seconds must be > 0, got {self.max_reference_seconds}")
        if self.chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be >= {MIN_CHUNK_BYTES}, got {self.chunk_bytes}")
        if self.api_key == "":
            raise ValueError("api_key is empty: give a key, or leave it out to serve without one")
        if self.voices_dir is not None:
            self.voices_dir = Path(self.voices_dir)
        if self.model_name is None:
            self.model_name = Path(str(self.model).rstrip("/")).name or str(self.model)
