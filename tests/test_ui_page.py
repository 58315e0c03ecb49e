"""The playground page's parts that need no browser (tests/test_ui_browser.py drives the page itself): a server
without `--ui` never imports Gradio, and the copied curl command sends the take's request exactly."""

import json
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
