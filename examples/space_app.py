"""The playground page of `drama3-serve --ui` as a Hugging Face Space (`app.py` of a Space with the Gradio SDK).

    python examples/space_app.py --serve                    # the page on http://127.0.0.1:7860/, this machine only
    python examples/space_app.py --serve --host 0.0.0.0 --port 8080 --api-key KEY   # reachable by others, with a key
    DRAMA3_MODEL=fishaudio/drama-3 python examples/space_app.py --serve     # the real model (needs a GPU)
    python examples/space_app.py                            # start it here, check the page and a take, stop

On a Space (where `SPACE_ID` is set) it serves as with `--serve`, on 0.0.0.0:7860 (a Space's address and port). The
page is the same Blocks app as the server's, with the whole HTTP API beside it (`/v1/audio/speech`, ...), so the
page's "copy as code" calls work against the Space too. Settings come from the command line or the environment:
`--host` (`DRAMA3_HOST`; default 127.0.0.1, or 0.0.0.0 on a Space), `--port` (`DRAMA3_PORT`; default 7860),
`--api-key` (`DRAMA3_API_KEY`, which keeps it out of the process list; on a Space, a secret: the page then asks
for it), `DRAMA3_MODEL` (default: the embedded tiny random checkpoint, which speaks noise) and `DRAMA3_VOICES` (a
folder for enrolled voices; on a Space, mount persistent storage there). Needs
`pip install "transformers-drama3[ui]"`; docs/serving.md has the Space's files.
"""

import argparse
import os
import tempfile
import time

import uvicorn
from fastapi.testclient import TestClient

from transformers_drama3.serving import ServerSettings
from transformers_drama3.serving.app import create_app
from transformers_drama3.serving.ui import PageServer, mount_page
from transformers_drama3.testing import default_tiny_checkpoint

SPACE_PORT = 7860  # the port a Space's app listens on


def space_app(api_key: str | None = None):
    """The server's FastAPI app with the page mounted at /ui, set up from the environment (and `api_key`)."""
    model = os.environ.get("DRAMA3_MODEL")
    voices = os.environ.get("DRAMA3_VOICES") or tempfile.mkdtemp(prefix="drama3-voices-")
    settings = ServerSettings(model=model or default_tiny_checkpoint(), model_name=None if model else "drama3-tiny",
                              voices_dir=voices, api_key=api_key)
    return mount_page(create_app(settings))


def check(app) -> None:
    """Start the app in this process, wait for the model, and check the page and one request."""
    with TestClient(app) as client:
        deadline = time.monotonic() + 300
        while client.get("/health").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("the model did not load within 300 s")
            time.sleep(0.2)
        assert 'href="/ui/"' in client.get("/").text  # `/` links to the page
        page = client.get("/ui/")
        assert page.status_code == 200 and "gradio" in page.text, page.text[:200]
        speech = client.post("/v1/audio/speech", json={"model": app.state.settings.model_name, "input": "Hello.",
                                                       "response_format": "wav", "seed": 0, "max_new_tokens": 8})
        assert speech.status_code == 200 and speech.content[:4] == b"RIFF", speech.text[:200]
    print("the page and the API work; run with --serve to keep them up (--host, --port, --api-key)")


def main() -> None:
    on_space = bool(os.environ.get("SPACE_ID"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="serve until stopped (on a Space: always)")
    parser.add_argument("--host", default=os.environ.get("DRAMA3_HOST", "0.0.0.0" if on_space else "127.0.0.1"),
                        help="address to listen on (default: $DRAMA3_HOST, else 0.0.0.0 on a Space and 127.0.0.1, "
                        "this machine only, elsewhere)")
    parser.add_argument("--port", type=int, default=os.environ.get("DRAMA3_PORT", str(SPACE_PORT)),  # checked by type
                        help=f"port (default: $DRAMA3_PORT, else {SPACE_PORT}, a Space's)")
    parser.add_argument("--api-key", default=os.environ.get("DRAMA3_API_KEY"),
                        help="require the key on /v1 and /metrics, and as the page's password (default: "
                        "$DRAMA3_API_KEY; none: open to anyone who can connect)")
    args = parser.parse_args()
    app = space_app(args.api_key)
    if args.serve or on_space:
        print(f"the playground: http://{args.host}:{args.port}/")
        PageServer(uvicorn.Config(app, host=args.host, port=args.port), drain_seconds=30).run()
    else:
        check(app)


if __name__ == "__main__":
    main()
