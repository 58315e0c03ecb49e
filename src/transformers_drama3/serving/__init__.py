"""An OpenAI-compatible speech server for Drama 3: `drama3-serve` (cli.py), the FastAPI app (`app.create_app`).

Needs the `serve` extra: `pip install "transformers-drama3[serve]"` (FastAPI, uvicorn, pydantic, python-multipart).
Modules: settings (options and limits), schemas (request bodies), errors (OpenAI-shaped errors), voices (saved
voices by name), reference_audio (uploaded audio), audio_encoding (response formats), worker (queue, batching,
generation thread), app (routes), cli. The settings import without the extra, so `drama3-serve --help` always works.
"""

from .settings import ServerSettings

__all__ = ["ServerSettings"]
