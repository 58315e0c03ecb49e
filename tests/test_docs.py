"""The guide runs as written: every code block of the guide pages, in order, and every script in examples/.

As docs/usage.md says, the examples run on the tiny checkpoint: "fishaudio/drama-3" is replaced by the golden tiny
checkpoint, and every generation is held to `FRAMES` frames (its random weights rarely end speech on their own).
Python blocks of a page share one namespace, as a reader's session would; a block marked `# GPU only` on its first
line is compiled (its syntax checked), not run, and a bash block so marked is skipped. Bash blocks run their
`drama3-tts` and `drama3-prepare` commands in this process (`pip install` lines are the reader's setup, already done here); any other command fails
the test, so a new kind of command needs a way to run here first.
"""

import functools
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from transformers_drama3 import FishOmniForSpeech, cli
from transformers_drama3.training import cli as prepare_cli

from .conftest import GOLDEN_TINY

ROOT = Path(__file__).resolve().parents[1]
GUIDE_PAGES = ("usage.md", "processor.md", "finetuning.md")  # pages whose every code block runs
EXAMPLES = sorted(path.name for path in (ROOT / "examples").glob("*.py") if path.name != "example_setup.py")
FRAMES = 4
REAL_MODEL = "fishaudio/drama-3"
GPU_ONLY = "# GPU only"  # the first line of a block that needs a GPU
# A fenced block, possibly indented (inside a list item): its indentation, language and code.
FENCE = re.compile(r"^(?P<indent> *)```(?P<language>\w*)\n(?P<code>.*?)^(?P=indent)```", re.DOTALL | re.MULTILINE)


def code_blocks(page: str) -> list[tuple[str, str, int]]:
    """(language, code, first line number) of every fenced block of a docs page."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        indent = len(match["indent"])
        code = "".join(line[indent:] for line in match["code"].splitlines(keepends=True))
        blocks.append((match["language"], code, text.count("\n", 0, match.start()) + 2))
    return blocks


@pytest.fixture
def reader(tmp_path, monkeypatch):
    """A working directory with the files the guide speaks of, generation held to `FRAMES` frames, and the CLI's
    model loads shared (loading itself is tested in test_cli.py)."""
    monkeypatch.chdir(tmp_path)
    for name, rate, channels in (("me.wav", 44100, 1), ("you.wav", 22050, 1), ("alice.wav", 44100, 1),
                                 ("bob.wav", 44100, 1)):
        t = np.arange(rate // 2) / rate
        soundfile.write(name, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate)
    (tmp_path / "my_voice").mkdir()  # finetuning.md's recordings: clip.wav + clip.txt pairs
    for index, line in enumerate(("Hello there.", "Good morning, everyone.", "Did you hear that?")):
        t = np.arange(8000 + 2000 * index) / 16000
        soundfile.write(tmp_path / "my_voice" / f"clip{index}.wav", (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32),
                        16000)
        (tmp_path / "my_voice" / f"clip{index}.txt").write_text(line, encoding="utf-8")
    (tmp_path / "story.txt").write_text("The lighthouse keeper woke before dawn. He climbed the stairs. "
                                        "The lamp was still turning.", encoding="utf-8")
    generate = FishOmniForSpeech.generate

    def held_to_frames(self, *args, **kwargs):
        kwargs["max_new_tokens"] = min(kwargs.get("max_new_tokens") or FRAMES, FRAMES)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(FishOmniForSpeech, "generate", held_to_frames)
    monkeypatch.setattr(cli, "load_model", functools.lru_cache(cli.load_model))
    return tmp_path


def run_commands(code: str, monkeypatch) -> None:
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line.replace(REAL_MODEL, str(GOLDEN_TINY)), comments=True)
        if not words or words[:2] == ["pip", "install"]:
            continue
        if words[0] == "echo" and "|" in words:  # echo "TEXT" | drama3-tts ...: TEXT on standard input
            bar = words.index("|")
            monkeypatch.setattr(sys, "stdin", io.StringIO(" ".join(words[1:bar]) + "\n"))
            words = words[bar + 1 :]
        commands = {"drama3-tts": cli.main, "drama3-prepare": prepare_cli.main}
        assert words[0] in commands, f"a command the docs test cannot run: {line!r}"
        assert commands[words[0]](words[1:]) == 0, line


@pytest.mark.parametrize("page", GUIDE_PAGES)
def test_every_code_block_of_the_guide_runs(page, reader, monkeypatch):
    namespace: dict = {}
    blocks = code_blocks(page)
    assert [language for language, _, _ in blocks if language not in ("", "python", "bash")] == []
    for language, code, line in blocks:
        if language == "python":
            compiled = compile(code.replace(REAL_MODEL, str(GOLDEN_TINY)), f"docs/{page}:{line}", "exec")
            if not code.startswith(GPU_ONLY):
                exec(compiled, namespace)
        elif language == "bash" and not code.startswith(GPU_ONLY):
            run_commands(code, monkeypatch)


def test_the_guide_pages_have_code():
    """The test above would pass on a page whose fences it no longer finds: make sure it sees the blocks."""
    counts = {page: sum(language in ("python", "bash") for language, _, _ in code_blocks(page)) for page in GUIDE_PAGES}
    assert counts["usage.md"] >= 14 and counts["processor.md"] >= 8 and counts["finetuning.md"] >= 4, counts


@pytest.mark.parametrize("script", EXAMPLES)
def test_every_example_runs_on_the_tiny_checkpoint(script, reader, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setattr(sys, "argv", [script])
    runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
