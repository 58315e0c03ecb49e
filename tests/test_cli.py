"""The `drama3-tts` console script, run as a user would (a subprocess)."""

import subprocess
import sys

from .conftest import GOLDEN_TINY


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "transformers_drama3.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_help():
    result = _run("--help")
    assert result.returncode == 0
    assert "drama3-tts" in result.stdout and "--summary" in result.stdout


def test_summary_of_a_checkpoint():
    result = _run("--summary", "--model", str(GOLDEN_TINY), "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    assert "FishOmniForSpeech" in result.stdout
    assert "2 shared + 9 residual layers" in result.stdout
    assert "semantic band: ids 421..484, EOS 401" in result.stdout
    # backbone and tower in bf16, the codec kept in float32
    assert "bfloat16" in result.stdout and "float32" in result.stdout


def test_synthesis_is_refused_until_generation_exists():
    result = _run("Hello there.")
    assert result.returncode == 2
    assert "not available yet" in result.stderr
    assert result.stdout == ""


def test_bad_model_path_is_a_clear_error():
    result = _run("--summary", "--model", "/nonexistent/drama3")
    assert result.returncode == 1
    assert "cannot load '/nonexistent/drama3'" in result.stderr and "Traceback" not in result.stderr
