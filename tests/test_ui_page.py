"""The playground page's parts that need no browser (tests/test_ui_browser.py drives the page itself): a server
without `--ui` never imports Gradio, the copied curl command sends the take's request exactly, the preview's summary,
the server's errors in the page's words, the page's bounds against the server's checks, and the API docs served
offline."""

import json
import re
import shlex
import subprocess
import sys

from transformers_drama3.serving.ui_code import curl_command, openai_code, synthesize_code

from .conftest import GOLDEN_TINY


def test_a_server_without_the_page_never_imports_gradio():
    script = ("import sys\n"
              "from transformers_drama3.serving import ServerSettings, cli\n"
              "from transformers_drama3.serving.app import create_app\n"
              f"create_app(ServerSettings(model={str(GOLDEN_TINY)!r}))\n"
              "cli.build_parser().parse_args(['--tiny'])\n"
              "print(sorted(name for name in sys.modules if name.split('.')[0] == 'gradio'))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_copied_curl_command_sends_the_takes_request_exactly():
    fields = {"model": "drama3-tiny", "input": "<|speaker:0|> It's $HOME's \"quote\" `ls` \\ done.", "voice": "me",
              "response_format": "wav", "temperature": 0.7, "seed": 4294967295, "max_new_tokens": 12}
    command = curl_command("http://127.0.0.1:8000", fields, with_key=True)
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:3] == ["curl", "-sS", "--fail-with-body"]
    assert json.loads(words[words.index("-d") + 1]) == fields
    assert "Authorization: Bearer $DRAMA3_API_KEY" in words
    assert words[-2:] == ["-o", "take.wav"]


def test_the_copied_code_carries_the_ras_and_codebook_settings():
    fields = {"model": "drama3-tiny", "input": "Hi.", "voice": "default", "response_format": "wav", "seed": 3,
              "temperature": 0.7, "ras_top_k": 5, "codebook_top_p": 0.5}
    python = synthesize_code("ckpt", fields, None, 300)
    assert "temperature=0.7, ras_top_k=5, codebook_top_p=0.5, chunk_bytes=300" in python, python
    assert "'ras_top_k': 5, 'codebook_top_p': 0.5" in openai_code("http://h", fields, with_key=False)


def test_the_preview_says_a_long_text_in_one_short_line():
    from transformers_drama3.serving.ui import PREVIEW_CHUNK_CHARS, SEPARATOR, preview_summary

    chunks = [f"<|speaker:0|> chunk number {n} " + "x" * 100 for n in range(78)]
    summary = preview_summary(chunks, 20017, 20480)
    assert summary.startswith("The server will speak it in 78 chunks (20,017 of at most 20,480 characters): ")
    assert summary.count(SEPARATOR) == 3 and "… 75 more …" in summary and "chunk number 77" in summary
    assert "chunk number 2 " not in summary and len(summary) < 4 * PREVIEW_CHUNK_CHARS + 200
    one = "The server will speak it in 1 chunk (3 of at most 4,096 characters): `Hi.`"
    assert preview_summary(["Hi."], 3, 4096) == one


def test_a_server_error_is_said_with_the_label_of_the_field_it_names():
    from transformers_drama3.serving.errors import APIError
    from transformers_drama3.serving.ui_fields import ENROL, FIELDS, page_error

    frames = page_error(APIError(400, "max_new_tokens must be an integer in [1, 2048], got 0", "max_new_tokens"))
    assert frames.field is FIELDS["max_new_tokens"] and frames.field.elem_id == "max_frames"
    assert frames.message == "max frames per text chunk must be an integer in [1, 2048], got 0"
    text = page_error(APIError(413, "input has 5000 characters; this server takes at most 4096", "input"))
    assert text.message == "Text has 5000 characters; this server takes at most 4096"
    control = page_error(APIError(400, "the text contains <|im_end|>", "input"))
    assert control.message == "Text: the text contains <|im_end|>"
    loading = page_error(APIError(503, "the model is still loading"))
    assert loading.field is None and loading.message == "the model is still loading"
    name = page_error(APIError(409, "a voice called 'x' already exists", "name"), ENROL)
    assert name.field.elem_id == "new-name" and name.message == "Name: a voice called 'x' already exists"


def test_the_pages_bounds_are_those_the_server_checks():
    """Each setting's least and greatest value on the page passes the server's checks, and one step beyond fails
    (the page's sliders end at 2 for temperatures, where the server goes on)."""
    from transformers_drama3.generation import DRAMA3_GENERATION_DEFAULTS
    from transformers_drama3.serving.errors import APIError
    from transformers_drama3.serving.settings import ServerSettings
    from transformers_drama3.serving.ui_fields import SETTINGS, bounds, step
    from transformers import GenerationConfig

    from transformers_drama3.serving.app import sampling_settings
    from transformers_drama3.serving.schemas import SpeechRequest

    settings = ServerSettings(max_frames=100)
    service = type("Service", (), {"model": type("Model", (), {
        "generation_config": GenerationConfig(**DRAMA3_GENERATION_DEFAULTS)})()})()

    def accepted(name, value) -> bool:
        body = SpeechRequest(model="m", input="Hi.", **{name: value})
        try:
            sampling_settings(body, service, settings)
        except APIError:
            return False
        return True

    for name in SETTINGS:
        if name == "seed":
            continue
        least, most = bounds(name, settings.max_frames)
        below = least - (1 if isinstance(least, int) else step(name))
        assert accepted(name, least), name
        assert not accepted(name, below), (name, below)
        if most is not None:
            assert accepted(name, most), name
        if name == "max_new_tokens" or name.endswith("top_p"):
            above = most + (1 if isinstance(most, int) else step(name))
            assert not accepted(name, above), (name, above)


def test_the_api_docs_are_served_by_the_server_itself():
    from fastapi.testclient import TestClient

    from transformers_drama3.serving import ServerSettings
    from transformers_drama3.serving.app import create_app

    client = TestClient(create_app(ServerSettings(model=str(GOLDEN_TINY))))  # no lifespan: no model loads
    page = client.get("/docs").text
    loaded = re.findall(r"""(?:src=|href=|url: )['"]([^'"]+)['"]""", page)  # scripts, styles, icon, the schema
    assert len(loaded) >= 4 and all(url.startswith("/") for url in loaded), loaded  # from this server: no CDN
    for url in loaded:
        assert client.get(url).status_code == 200, url
