"""The `drama3-tts` console script: synthesis as a user runs it (a subprocess), flags and errors (in process)."""

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import soundfile
import torch

from transformers_drama3 import cli
from transformers_drama3.voice import Drama3Voice

from .conftest import GOLDEN_TINY

MODEL = ["--model", str(GOLDEN_TINY)]
FAST = ["--max-new-tokens", "2", "--quiet"]


@pytest.fixture(autouse=True)
def _reuse_the_model(golden_model, monkeypatch):
    """In-process runs share one loaded golden model (loading itself is tested by the subprocess run)."""
    load_model = cli.load_model
    monkeypatch.setattr(cli, "load_model", lambda path, device, dtype: golden_model
                        if (path, dtype) == (str(GOLDEN_TINY), torch.float32) else load_model(path, device, dtype))


def _main(capsys, *args):
    """Run the CLI in this process: (exit status, stdout, stderr)."""
    try:
        status = cli.main(list(args))
    except SystemExit as exit_:  # argparse usage errors and --help
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _frames(stderr: str) -> int:
    return int(re.search(r"(\d+) frames", stderr).group(1))


# -- as a user runs it ---------------------------------------------------------------------------------------------


def test_synthesis_on_the_embedded_checkpoint_writes_a_wav(tmp_path):
    """The README's main-job command, as a user runs it."""
    output = tmp_path / "hello.wav"
    result = subprocess.run(
        [sys.executable, "-m", "transformers_drama3.cli", "--tiny", "Hello there.", "--output", str(output),
         "--max-new-tokens", "4", "--seed", "0"], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and f"wrote {output}" in result.stderr
    info = soundfile.info(str(output))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", "PCM_16", 44100, 1)
    frames = _frames(result.stderr)
    assert 1 <= frames <= 4 and info.frames == frames * 2048
    assert os.listdir(tmp_path) == ["hello.wav"]


def test_help(capsys):
    status, out, _ = _main(capsys, "--help")
    assert status == 0
    for flag in ("--tiny", "--output", "--reference", "--voice", "--stream", "--seed", "--summary"):
        assert flag in out


def test_a_missing_output_directory_fails_before_loading(tmp_path, capsys):
    status, out, err = _main(capsys, *MODEL, "Hello.", "--output", str(tmp_path / "missing" / "out.wav"))
    assert status == 1 and "does not exist" in err and "loading" not in err and out == ""


# -- text, outputs, streaming -------------------------------------------------------------------------------------


def test_streaming_writes_the_same_file_as_a_plain_run(tmp_path, capsys):
    plain, streamed = tmp_path / "plain.wav", tmp_path / "streamed.wav"
    common = [*MODEL, "Hello there, how are you?", "--seed", "5", *FAST]
    assert _main(capsys, *common, "-o", str(plain))[0] == 0
    assert _main(capsys, *common, "-o", str(streamed), "--stream")[0] == 0
    assert plain.read_bytes() == streamed.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["plain.wav", "streamed.wav"]


def test_text_from_stdin_and_from_a_file_in_flac(tmp_path, capsys, monkeypatch):
    (tmp_path / "text.txt").write_text("Hello there.\n", encoding="utf-8")
    from_file, from_stdin = tmp_path / "file.flac", tmp_path / "stdin.flac"
    text_file = ["--text-file", str(tmp_path / "text.txt")]
    assert _main(capsys, *MODEL, *text_file, "-o", str(from_file), "--greedy", *FAST)[0] == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there.\n"))
    assert _main(capsys, *MODEL, "-", "-o", str(from_stdin), "--greedy", *FAST)[0] == 0
    a, rate = soundfile.read(str(from_file), dtype="int16")
    b, _ = soundfile.read(str(from_stdin), dtype="int16")
    assert rate == 44100 and soundfile.info(str(from_file)).format == "FLAC"
    assert a.shape == (2 * 2048,) and np.array_equal(a, b)


def test_voice_cloning_saves_and_reuses_a_voice(tmp_path, capsys):
    reference = tmp_path / "me.wav"
    soundfile.write(str(reference), (0.3 * np.sin(np.arange(11025) / 20)).astype(np.float32), 44100)
    voice_file, cloned, reused = tmp_path / "me.voice.safetensors", tmp_path / "cloned.wav", tmp_path / "reused.wav"
    common = [*MODEL, "Hello there.", "--greedy", *FAST]
    status, _, err = _main(capsys, *common, "-o", str(cloned), "--reference", str(reference),
                           "--reference-text", "This is my voice.", "--save-voice", str(voice_file))
    assert status == 0, err
    voice = Drama3Voice.load(voice_file)
    assert voice.transcript == "This is my voice." and voice.codes.shape == (10, 6)
    assert _main(capsys, *common, "-o", str(reused), "--voice", str(voice_file))[0] == 0
    assert cloned.read_bytes() == reused.read_bytes()  # greedy, same reference codes: the same speech
    fast = tmp_path / "fast.wav"
    assert _main(capsys, *common, "-o", str(fast), "--voice", str(voice_file), "--fast-decode")[0] == 0
    assert fast.read_bytes() == reused.read_bytes()  # the fast decode path makes the same greedy frames
    # only saving a voice: no text, no output
    status, _, err = _main(capsys, *MODEL, "--reference", str(reference), "--reference-text", "Mine.",
                           "--save-voice", str(tmp_path / "only.voice.safetensors"))
    assert status == 0, err
    assert Drama3Voice.load(tmp_path / "only.voice.safetensors").transcript == "Mine."


def test_summary_of_a_checkpoint(capsys):
    status, out, err = _main(capsys, "--summary", *MODEL, "--dtype", "bfloat16")
    assert status == 0, err
    assert "FishOmniForSpeech" in out and "2 shared + 9 residual layers" in out
    assert "semantic band: ids 421..484, EOS 401" in out
    assert "bfloat16" in out and "float32" in out  # backbone and tower in bf16, the codec kept in float32


# -- errors ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["Hello.", "-o", "x.wav"], "choose a checkpoint"),
        ([*MODEL, "-o", "x.wav"], "no text to speak"),
        ([*MODEL, "Hello."], "--output FILE is required"),
        ([*MODEL, "--text-file", "t.txt"], "--output FILE is required"),
        ([*MODEL, "-o", "x.wav", "--reference", "a.wav", "--reference-text", "A.", "--save-voice", "v"], "needs text"),
        ([*MODEL, "Hello.", "--text-file", "t.txt", "-o", "x.wav"], "not both"),
        ([*MODEL, "Hello.", "-o", "x.wav", "--reference", "a.wav"], "every --reference needs its --reference-text"),
        ([*MODEL, "Hello.", "-o", "x.wav", "--temperature", "0"], "must be > 0"),
        ([*MODEL, "Hello.", "-o", "x.wav", "--top-p", "1.5"], "must be in (0, 1]"),
        ([*MODEL, "Hello.", "-o", "x.wav", "--max-new-tokens", "0"], "must be >= 1"),
        ([*MODEL, "Hello.", "-o", "x.wav", "--top-k", "many"], "not a number"),
        ([*MODEL, "--save-voice", "v.safetensors"], "saves one --reference"),
    ],
)
def test_usage_errors_exit_2(capsys, args, message):
    status, out, err = _main(capsys, *args)
    assert status == 2 and message in err and out == ""


@pytest.mark.parametrize(
    "text, message",
    [("   ", "text is empty or only white space"), ("Hi <|im_end|>", "control token '<|im_end|>'"),
     ("Hi <|speaker:16|>", "invalid speaker tag")],
)
def test_bad_text_is_the_processors_error(tmp_path, capsys, text, message):
    status, _, err = _main(capsys, *MODEL, text, "-o", str(tmp_path / "out.wav"))
    assert status == 1 and message in err and "loading" not in err  # refused before the model loads
    assert os.listdir(tmp_path) == []


def test_bad_outputs_and_files_exit_1(tmp_path, capsys, monkeypatch):
    cases = [
        ([*MODEL, "Hello.", "-o", str(tmp_path / "out.mp3")], "cannot tell the audio format"),
        ([*MODEL, "Hello.", "-o", str(tmp_path)], "it is a directory"),
        ([*MODEL, "Hello.", "-o", str(tmp_path / "out.wav"), "--voice", str(tmp_path / "none.safetensors")], "none"),
        ([*MODEL, "--text-file", str(tmp_path / "none.txt"), "-o", str(tmp_path / "out.wav")], "none.txt"),
        (["--model", str(tmp_path / "nothing"), "Hello.", "-o", str(tmp_path / "out.wav")], "cannot load"),
    ]
    for args, message in cases:
        status, _, err = _main(capsys, *args)
        assert status == 1 and message in err and "Traceback" not in err, (args, err)
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.access(read_only, os.W_OK):  # root writes anywhere: pretend the directory is read-only
        monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    status, _, err = _main(capsys, *MODEL, "Hello.", "-o", str(read_only / "out.wav"))
    assert status == 1 and "not writable" in err
    assert os.listdir(read_only) == []


def test_a_failure_while_streaming_leaves_no_file(tmp_path, capsys, monkeypatch):
    def failing(model, processor, text, references, streamer, **options):
        streamer.put(torch.zeros(1, 10, dtype=torch.long))  # some audio reaches the file, then generation fails
        streamer.end()
        raise ValueError("generation failed")

    monkeypatch.setattr(cli, "synthesize", failing)
    status, _, err = _main(capsys, *MODEL, "Hello.", "-o", str(tmp_path / "out.wav"), "--stream", *FAST)
    assert status == 1 and "generation failed" in err
    assert os.listdir(tmp_path) == []
