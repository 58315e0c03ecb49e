"""`drama3-serve`: an OpenAI-compatible speech server for Drama 3 (FastAPI + uvicorn).

    drama3-serve --tiny --ui          # then open http://127.0.0.1:8000/ in a browser
    drama3-serve --model fishaudio/drama-3 --host 0.0.0.0 --port 8000 --voices voices/ --max-batch 16

The server listens at once, before it imports anything heavy (a connection made during the seconds of imports waits
in the kernel's queue and is answered when they are done, never refused), and loads the model in the background
(`GET /health` is 503 until it is ready); if the model cannot be loaded the process exits with status 1. Ctrl+C stops it gracefully (exit status 130, as drama3-tts);
SIGTERM drains it first: new requests get 503 while running ones finish (--drain-seconds).
docs/serving.md describes the API.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from ..loading import default_threads_wait_passively
from .settings import ServerSettings

API_KEY_VARIABLE = "DRAMA3_API_KEY"
INTERRUPTED = 128 + signal.SIGINT  # the shell's status of a command ended by Ctrl+C (130, as drama3-tts)
DEFAULTS = ServerSettings()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drama3-serve",
        description="OpenAI-compatible text-to-speech server (POST /v1/audio/speech) for Fish Audio Drama 3.",
        epilog="examples:\n" + __doc__.split("\n\n")[1] + "\n\nAPI and examples: docs/serving.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory or Hub repository id (e.g. fishaudio/drama-3)")
    source.add_argument("--tiny", action="store_true",
                        help="serve the embedded tiny random checkpoint (for trying the API: it speaks noise)")
    parser.add_argument("--model-name", help="the model id clients send and GET /v1/models lists "
                        "(default: the checkpoint's directory name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                        "only; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--voices", type=Path, metavar="DIR",
                        help="directory of saved voices (NAME.voice.safetensors, as drama3-tts --save-voice writes "
                        "them); POST /v1/voices adds to it; replicas may share it (docs/serving.md)")
    parser.add_argument("--voice-alias", action="append", default=[], metavar="NAME=VOICE",
                        help="speak OpenAI's voice NAME (alloy, echo, nova, ...) with the saved VOICE; repeatable. "
                        "OpenAI names without an alias speak with 'default'")
    parser.add_argument("--ui", action="store_true",
                        help="serve the playground page at /ui (linked from /): speak, clone a voice, copy the request "
                        "as code; needs the ui extra (pip install \"transformers-drama3[ui]\")")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_VARIABLE),
                        help=f"require 'Authorization: Bearer KEY' on /v1 and /metrics (default: ${API_KEY_VARIABLE}, "
                        "which keeps the key out of the process list; no key: open to anyone who can connect)")

    run = parser.add_argument_group("model")
    run.add_argument("--device", default=DEFAULTS.device, help='"cpu", "cuda", "cuda:1", ... (default: cuda if '
                     "available)")
    run.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=DEFAULTS.dtype,
                     help="weights dtype (default: bfloat16 on a GPU, the CPU path on a CPU: DRAMA3_CPU_PATH)")
    run.add_argument("--fast-decode", action="store_true",
                     help="replay the frame step as a CUDA graph on a GPU (docs/usage.md)")
    run.add_argument("--compile-step", nargs="?", const=True, default=False, metavar="BACKEND",
                     help="torch.compile the frame step first (inductor, or the named backend; compiles on the first "
                     "frames of each batch size)")

    limits = parser.add_argument_group("batching and limits")
    limits.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch,
                        help=f"most requests generating at once; others join the running batch at a frame boundary "
                        f"as rows free (default {DEFAULTS.max_batch})")
    limits.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue,
                        help=f"requests waiting for their first frame beyond which new ones get 429 "
                        f"(default {DEFAULTS.max_queue})")
    limits.add_argument("--max-text-chars", type=int, default=DEFAULTS.max_text_chars,
                        help=f"longest input text, in characters (default {DEFAULTS.max_text_chars}, as OpenAI)")
    limits.add_argument("--max-reference-seconds", type=float, default=DEFAULTS.max_reference_seconds,
                        help=f"longest reference or enrolled recording (default {DEFAULTS.max_reference_seconds:g})")
    limits.add_argument("--max-body-bytes", type=int, default=DEFAULTS.max_body_bytes,
                        help=f"largest request body, base64 references and uploads included "
                        f"(default {DEFAULTS.max_body_bytes})")
    limits.add_argument("--max-frames", type=int, default=DEFAULTS.max_frames,
                        help=f"most frames per text chunk a request may ask for, and the default (21.5 frames = 1 s; "
                        f"default {DEFAULTS.max_frames})")
    limits.add_argument("--chunk-bytes", type=int, default=DEFAULTS.chunk_bytes,
                        help=f"long input is spoken in chunks of at most this many UTF-8 bytes "
                        f"(default {DEFAULTS.chunk_bytes})")

    limits.add_argument("--prompt-cache-mb", type=float, default=DEFAULTS.prompt_cache_mb,
                        help="memory for the cached prompt prefixes of saved voices, computed once per voice and "
                        f"reused by its requests (least recently used evicted; 0: off; default {DEFAULTS.prompt_cache_mb:g})")
    limits.add_argument("--drain-seconds", type=float, default=DEFAULTS.drain_seconds,
                        help="on SIGTERM, refuse new requests (503) and let running ones finish for at most this long "
                        f"before stopping (0: stop at once; default {DEFAULTS.drain_seconds:g})")

    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    logs.add_argument("--log-text", action="store_true", help="log the text of each request (default: its length)")
    return parser


def voice_alias(text: str) -> tuple[str, str]:
    """`--voice-alias NAME=VOICE` -> (NAME, VOICE)."""
    name, _, voice = text.partition("=")
    if not name.strip() or not voice.strip():
        raise ValueError(f"--voice-alias {text!r}: write NAME=VOICE, e.g. --voice-alias alloy=narrator")
    return name.strip(), voice.strip()


def page_mounted(app):
    """`app` with the playground page (Gradio is imported here, only with --ui)."""
    try:
        from .ui import mount_page
    except ImportError as error:
        raise ValueError(f"--ui needs {error.name}: install it with "
                         "'pip install \"transformers-drama3[ui]\"'") from None
    return mount_page(app)
def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the slow imports; uvicorn serves it (`server.run(sockets=...)`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)  # uvicorn's default backlog
    except OSError as error:
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from error


def main(argv: list[str] | None = None) -> int:
    default_threads_wait_passively()  # before torch loads (docs/serving.md, "Threads")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        listening = listen(args.host, args.port)
    except OSError as error:
        print(f"drama3-serve: error: {error}", file=sys.stderr)
        return 1
    with listening:
        return serve(args, listening)


def serve(args, listening: socket.socket) -> int:
    """Import the server, build it and run it on `listening` until it stops; the exit status."""
    try:
        import uvicorn

        from ..testing import default_tiny_checkpoint  # imports torch: after the thread settings above
        from .app import create_app
        from .draining import DrainingServer
    except ImportError as error:
        print(f"drama3-serve: error: {error.name} is missing; install the server with "
              '\'pip install "transformers-drama3[serve]"\'', file=sys.stderr)
        return 1
    try:
        aliases = dict(voice_alias(text) for text in args.voice_alias)
        settings = ServerSettings(
            model=default_tiny_checkpoint() if args.tiny else args.model,
            model_name=args.model_name or ("drama3-tiny" if args.tiny else None), voices_dir=args.voices,
            api_key=args.api_key, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
            max_queue=args.max_queue, max_text_chars=args.max_text_chars,
            max_reference_seconds=args.max_reference_seconds, max_body_bytes=args.max_body_bytes,
            max_frames=args.max_frames, chunk_bytes=args.chunk_bytes, fast_decode=args.fast_decode,
            compile_step=args.compile_step, log_text=args.log_text, voice_aliases=aliases,
            prompt_cache_mb=args.prompt_cache_mb, drain_seconds=args.drain_seconds,
        )
        failed = []

        def stop(error: Exception) -> None:
            failed.append(error)
            server.should_exit = True

        app = create_app(settings, on_load_failure=stop)
        if args.ui:
            app = page_mounted(app)
    except (OSError, ValueError) as error:
        print(f"drama3-serve: error: {error}", file=sys.stderr)
        return 1
    # With the page, a browser may hold a stream open through the shutdown: after 20 s (twice the page's queue poll)
    # uvicorn cancels what is left instead of waiting for the browser.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=20 if args.ui else None)
    server_class = DrainingServer
    if args.ui:
        from .ui import PageServer as server_class
    server = server_class(config, drain_seconds=args.drain_seconds)
    if args.ui:
        print(f"drama3-serve: open http://{args.host}:{args.port}/ in a browser for the playground", file=sys.stderr)
    try:
        server.run(sockets=[listening])
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised Ctrl+C
        return INTERRUPTED
    if failed:
        print(f"drama3-serve: error: cannot load {settings.model!r}: {failed[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
