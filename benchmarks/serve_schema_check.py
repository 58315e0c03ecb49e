"""Fuzz `drama3-serve`'s HTTP API from its own OpenAPI schema with schemathesis: no request may get a 5xx.

A server on the embedded tiny checkpoint runs in this process (`ServerThread`, 127.0.0.1, a voices directory with
one saved voice, `--max-frames 2` so that every valid speech request is short); `schemathesis run` then sends
`--max-examples` generated requests per operation of `/openapi.json` (valid and invalid bodies, headers, paths) and
checks `not_a_server_error`. The schema it reads is the server's own with the speech fields narrowed to values the
server accepts (`PINNED`: a random `model` is a 404, random text mostly a 400, neither reaches generation);
schemathesis still sends invalid variants of every field in its coverage phase. A 503 `model_loading`/`draining` cannot happen here (the server is ready and not
draining), so every 5xx is a bug. The exit status is schemathesis's (0: no failure). Bounded by `--max-examples`
and `--seconds`; needs `pip install "transformers-drama3[serve,load]"`.

    python benchmarks/serve_schema_check.py --max-examples 30
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import torch

from transformers_drama3 import Drama3Voice
from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.thread import ServerThread
from transformers_drama3.testing import default_tiny_checkpoint


# The speech fields narrowed to what the server accepts, so that generated requests reach generation (the server
# checks more than the schema says: text rules, settings' ranges, base64 audio).
PINNED = {
    "model": {"type": "string", "enum": ["drama3-tiny"]},
    "voice": {"type": "string", "enum": ["default", "narrator"]},
    "input": {"type": "string", "pattern": "^[A-Za-z][A-Za-z ,.!?']{0,60}$"},
    "response_format": {"type": "string", "enum": ["wav", "pcm", "flac"]},
    "speed": {"type": "number", "enum": [1.0]},
    "instructions": {"type": "null"},
    "references": {"type": "array", "maxItems": 0},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 1, "maximum": 50},
    "max_new_tokens": {"type": "integer", "minimum": 1, "maximum": 2},
}


def pinned_schema(schema: dict) -> dict:
    """The server's OpenAPI schema with the speech fields narrowed to `PINNED`."""
    for component in schema["components"]["schemas"].values():
        properties = component.get("properties", {})
        for name, pinned in PINNED.items():
            if name in properties and (name != "input" or "references" in properties):
                properties[name] = pinned
    return schema


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=30, help="generated requests per operation")
    parser.add_argument("--seconds", type=float, default=900, help="stop schemathesis after this long")
    args = parser.parse_args()
    command = shutil.which("schemathesis")
    if command is None:
        print("schemathesis is not installed: pip install 'transformers-drama3[load]'", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as voices:
        codes = torch.randint(0, 64, (10, 20), generator=torch.Generator().manual_seed(0))
        Drama3Voice(codes, "This is how I sound.").save(Path(voices) / "narrator.safetensors")
        settings = ServerSettings(model=default_tiny_checkpoint(), model_name="drama3-tiny", voices_dir=voices,
                                  max_frames=2, max_text_chars=400, max_reference_seconds=2.0)
        with ServerThread(settings) as server:
            schema_path = Path(voices) / "openapi.json"
            schema_path.write_text(json.dumps(pinned_schema(httpx.get(f"{server.url}/openapi.json").json())))
            run = [command, "run", str(schema_path), "--url", server.url, "--checks", "not_a_server_error",
                   "--max-examples", str(args.max_examples), "--generation-deterministic", "--request-timeout", "120"]
            print(" ".join(run), flush=True)
            try:
                status = subprocess.run(run, timeout=args.seconds).returncode
            except subprocess.TimeoutExpired:
                print(f"schemathesis did not finish within {args.seconds:g} s", file=sys.stderr)
                return 1
            print("server after the run:", server.service.worker.snapshot())
    return status


if __name__ == "__main__":
    sys.exit(main())
