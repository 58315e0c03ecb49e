"""The playground page of `drama3-serve --ui` as a Hugging Face Space (`app.py` of a Space with the Gradio SDK).

    python examples/space_app.py --serve                    # the page on http://0.0.0.0:7860/ (a Space's port)
    DRAMA3_MODEL=fishaudio/drama-3 python examples/space_app.py --serve     # the real model (needs a GPU)
    python examples/space_app.py                            # start it here, check the page and a take, stop

On a Space (where `SPACE_ID` is set) it serves as with `--serve`. The page is the same Blocks app as the server's,
with the whole HTTP API beside it (`/v1/audio/speech`, ...), so the page's "copy as code" calls work against the
Space too. Settings come from the environment: `DRAMA3_MODEL` (default: the embedded tiny random checkpoint, which
speaks noise), `DRAMA3_VOICES` (a folder for enrolled voices; on a Space, mount persistent storage there) and
`DRAMA3_API_KEY` (the page then asks for it). Needs `pip install "transformers-drama3[ui]"`; docs/serving.md has the
Space's files.
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


def space_app():
    """The server's FastAPI app with the page mounted at /ui, set up from the environment."""
    model = os.environ.get("DRAMA3_MODEL")
    voices = os.environ.get("DRAMA3_VOICES") or tempfile.mkdtemp(prefix="drama3-voices-")
    settings = ServerSettings(model=model or default_tiny_checkpoint(), model_name=None if model else "drama3-tiny",
                              voices_dir=voices, api_key=os.environ.get("DRAMA3_API_KEY"))
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
    print(f"the page and the API work; run with --serve to keep them up on port {SPACE_PORT}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help=f"serve on 0.0.0.0:{SPACE_PORT} until stopped")
    args = parser.parse_args()
    app = space_app()
    if args.serve or os.environ.get("SPACE_ID"):
        PageServer(uvicorn.Config(app, host="0.0.0.0", port=SPACE_PORT), drain_seconds=30).run()
    else:
        check(app)


if __name__ == "__main__":
    main()
