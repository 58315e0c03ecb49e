"""The `drama3-tts` console script: synthesis, start-up and signals as a user meets them (subprocesses), flags,
checks and errors (in process)."""

import io
import logging
import os
import re
import signal
import subprocess
import sys
import time
import wave

import numpy as np
import pytest
import soundfile
import torch

from transformers_drama3 import cli, loading
from transformers_drama3.cpu_path import ENVIRONMENT_VARIABLE, resolve_cpu_path
from transformers_drama3.voice import Drama3Voice

from .conftest import GOLDEN_TINY, default_sigint

MODEL = ["--model", str(GOLDEN_TINY)]
FAST = ["--max-new-tokens", "2", "--quiet"]
CLI = [sys.executable, "-m", "transformers_drama3.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _reuse_the_model(golden_model, monkeypatch, tmp_path):
    """In-process runs share one loaded golden model (loading itself is tested by the subprocess run); relative
    paths such as `-o x.wav` land in a per-test folder, never in the checkout."""
    monkeypatch.chdir(tmp_path)
    load_model = cli.load_model
    # A CPU load without a dtype takes DRAMA3_CPU_PATH's path, float32 in this suite (conftest.py): the golden model.
    monkeypatch.setattr(cli, "load_model", lambda path, device, dtype: golden_model
                        if path == str(GOLDEN_TINY) and dtype in (torch.float32, None) else load_model(path, device, dtype))


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


def _tone(path, seconds=0.25, rate=44100, channels=1):
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    soundfile.write(str(path), np.stack([samples] * channels, axis=1) if channels > 1 else samples, rate)
    return path


# -- as a user runs it ---------------------------------------------------------------------------------------------


def test_synthesis_on_the_embedded_checkpoint_writes_a_wav(tmp_path):
    """The README's main-job command, as a user runs it: one clean line per message, no transformers noise, the CPU
    path this CPU offers (not the suite's float32 pin)."""
    output = tmp_path / "hello.wav"
    user_environment = {name: value for name, value in ENV.items() if name != ENVIRONMENT_VARIABLE}
    result = subprocess.run([*CLI, "--tiny", "Hello there.", "--output", str(output), "--max-new-tokens", "4",
                             "--seed", "0"], capture_output=True, text=True, timeout=600, env=user_environment)
    assert result.returncode == 0, result.stderr
    assert f"(the {resolve_cpu_path('auto')} CPU path)" in result.stderr
    assert "Traceback" not in result.stderr and f"wrote {output}" in result.stderr
    info = soundfile.info(str(output))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", "PCM_16", 44100, 1)
    frames = _frames(result.stderr)
    assert 1 <= frames <= 4 and info.frames == frames * 2048
    assert os.listdir(tmp_path) == ["hello.wav"]
    # the FP8 experts stay FP8 on a CPU (nothing to say about them); no GPU-kernel fallback notes on a CPU
    assert "FP8" not in result.stderr
    assert "[transformers]" not in result.stderr and "falling back" not in result.stderr


def test_kernel_fallback_notes_are_known_by_their_logger_and_a_stable_fragment(monkeypatch):
    """transformers' note that a linear-attention kernel package is missing is recognised without parsing its text
    for the package (the CLI says one note on a GPU, none on a CPU); the packages come from what is installed."""
    from transformers.integrations import hub_kernels

    def record(logger: str, text: str) -> logging.LogRecord:
        return logging.LogRecord(logger, logging.WARNING, __file__, 0, text, None, None)

    note = ("`causal_conv1d_fn` is falling back to its reference PyTorch implementation because `causal_conv1d` is "
            "not installed. This is correct but much slower; install `causal_conv1d` for the optimized kernel.")
    assert hub_kernels.logger.name == loading.KERNEL_LOGGER  # where transformers says it
    assert loading.is_kernel_fallback(record(loading.KERNEL_LOGGER, note))
    assert not loading.is_kernel_fallback(record("transformers.modeling_utils", note))
    assert not loading.is_kernel_fallback(record(loading.KERNEL_LOGGER, "another note about kernels"))
    monkeypatch.setattr(loading, "find_spec", lambda module: None if module == "fla" else object())
    assert loading.missing_kernel_packages() == ["flash-linear-attention"]


def test_help_and_usage_errors_import_neither_torch_nor_transformers():
    """`--help` and command-line errors answer before any heavy import (docs/performance.md, start-up)."""
    script = (
        "import sys\nfrom transformers_drama3 import cli\nfor argv in (['--help'], ['--tiny', 'Hi']):\n"
        "    try:\n        cli.main(argv)\n    except SystemExit as stop:\n        print('exit', stop.code)\n"
        "print('heavy:', sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ENV)
    assert "exit 0" in result.stdout and "exit 2" in result.stdout and "--output FILE is required" in result.stderr
    assert "heavy: []" in result.stdout, result.stdout


def _wait_for(condition, process, seconds=300):
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before the condition held"
        time.sleep(0.05)


def test_sigterm_while_streaming_leaves_no_file(tmp_path):
    """A process manager's SIGTERM unwinds like Ctrl-C: the temporary file goes, the status is 128 + 15."""
    output = tmp_path / "speech.wav"
    process = subprocess.Popen([*CLI, *MODEL, "Hello there.", "-o", str(output), "--stream", "--max-new-tokens",
                                "4000", "--seed", "0", "-q"], stderr=subprocess.PIPE, text=True, env=ENV)
    _wait_for(lambda: any(name.endswith(".tmp") for name in os.listdir(tmp_path)), process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in stderr, stderr
    assert "Traceback" not in stderr and os.listdir(tmp_path) == []


def test_ctrl_c_while_loading_is_one_line(tmp_path):
    process = subprocess.Popen([*CLI, *MODEL, "Hello there.", "-o", str(tmp_path / "x.wav")],
                               stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=default_sigint)
    first_line = process.stderr.readline()  # "loading ...": the command line is checked, the model is loading
    assert first_line.startswith("loading"), first_line
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "drama3-tts: interrupted" in stderr and "Traceback" not in stderr, stderr
    assert os.listdir(tmp_path) == []


def test_help(capsys):
    status, out, _ = _main(capsys, "--help")
    assert status == 0
    for flag in ("--tiny", "--output", "--reference", "--voice", "--stream", "--seed", "--summary"):
        assert flag in out


def test_a_missing_output_directory_fails_before_loading(tmp_path, capsys):
    status, out, err = _main(capsys, *MODEL, "Hello.", "--output", str(tmp_path / "missing" / "out.wav"))
    assert status == 1 and "does not exist" in err and "loading" not in err and out == ""


# -- text, outputs, streaming -------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".wav", ".ogg"])
def test_streamed_and_repeated_runs_write_identical_files(tmp_path, capsys, suffix):
    """Same seed, same bytes: twice, and with --stream (OGG too: one Ogg serial, the same encoder input blocks)."""
    common = [*MODEL, "Hello there, how are you?", "--seed", "5", "--max-new-tokens", "9", "--quiet"]
    files = [tmp_path / f"{name}{suffix}" for name in ("plain", "again", "streamed")]
    for file, extra in zip(files, ([], [], ["--stream"])):
        assert _main(capsys, *common, "-o", str(file), *extra)[0] == 0
    assert files[0].read_bytes() == files[1].read_bytes() == files[2].read_bytes()
    assert sorted(os.listdir(tmp_path)) == sorted(file.name for file in files)


def _stdout_bytes(capsys, monkeypatch, *args) -> bytes:
    """What a run writes to standard output (a binary one, as a pipe is)."""
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO()))
    assert _main(capsys, *args)[0] == 0
    return sys.stdout.buffer.getvalue()


def test_output_to_stdout_is_the_servers_stream(tmp_path, capsys, monkeypatch):
    """`-o -` writes what the server streams for the same format: `AudioEncoder`'s bytes, made as the audio is."""
    from transformers_drama3.audio_io import AudioEncoder

    common = [*MODEL, "Hello there.", "--seed", "4", "--max-new-tokens", "5", "--quiet"]
    for name in ("speech.wav", "speech.mp3"):
        assert _main(capsys, *common, "-o", name)[0] == 0
    samples, rate = soundfile.read("speech.wav", dtype="int16")
    wav = _stdout_bytes(capsys, monkeypatch, *common, "-o", "-")
    encoder = AudioEncoder("wav", rate, streamed=True)
    assert wav == encoder.encode(samples.astype(np.float32) / 32768) + encoder.finish()  # 16-bit values are exact
    mp3 = _stdout_bytes(capsys, monkeypatch, *common, "-o", "-", "--format", "mp3")
    first_frame = 144 * 128000 // 44100  # libsndfile's first MPEG frame (128 kb/s): the file's holds its length
    complete = (tmp_path / "speech.mp3").read_bytes()
    assert len(mp3) == len(complete) and mp3[first_frame:] == complete[first_frame:]
    assert sorted(os.listdir(tmp_path)) == ["speech.mp3", "speech.wav"]


def test_stream_into_a_pipe_plays_while_the_file_is_written_atomically(tmp_path, capsys, monkeypatch):
    """`--stream -o speech.opus | player`: the player gets a WAV as it is made, the file appears complete and equal
    to an unstreamed run's."""
    monkeypatch.setattr("transformers_drama3.cli.stdout_is_pipe", lambda: True)
    common = [*MODEL, "Hello there.", "--seed", "0", "--max-new-tokens", "4", "--quiet"]
    piped = _stdout_bytes(capsys, monkeypatch, *common, "-o", "streamed.opus", "--stream")
    with wave.open(io.BytesIO(piped)) as reader:
        assert reader.getframerate() == 44100 and len(reader.readframes(reader.getnframes())) == 4 * 2048 * 2
    assert _main(capsys, *common, "-o", "plain.opus")[0] == 0
    assert (tmp_path / "streamed.opus").read_bytes() == (tmp_path / "plain.opus").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["plain.opus", "streamed.opus"]


def test_a_closed_pipe_ends_quietly(tmp_path, capsys, monkeypatch):
    """`-o - | head -c 5000`: once the reader is gone the run stops generating and exits 0 without a word;
    `--stream -o FILE | player` whose player quits still finishes the file."""
    from transformers_drama3.streaming import Drama3AudioStreamer

    puts = []
    put = Drama3AudioStreamer.put
    monkeypatch.setattr(Drama3AudioStreamer, "put", lambda self, value: puts.append(1) or put(self, value))

    def closed_pipe():
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader has gone before the first byte
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(os.fdopen(write_end, "wb")))

    common = [*MODEL, "Hello there.", "--seed", "0", "--quiet"]
    long_text = [*MODEL, "One sentence here. " * 4, "--chunk-bytes", "40", "--seed", "0", "--quiet", "-o", "-"]
    assert _stdout_bytes(capsys, monkeypatch, *long_text, "--max-new-tokens", "8")
    everything, puts[:] = len(puts), []
    closed_pipe()
    assert _main(capsys, *long_text, "--max-new-tokens", "8") == (0, "", "")
    assert len(puts) < everything / 2  # stopped early, not after generating all chunks for nobody
    closed_pipe()
    monkeypatch.setattr("transformers_drama3.cli.stdout_is_pipe", lambda: True)
    assert _main(capsys, *common, "-o", "streamed.wav", "--stream", "--max-new-tokens", "6") == (0, "", "")
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO()))
    assert _main(capsys, *common, "-o", "plain.wav", "--max-new-tokens", "6")[0] == 0
    assert (tmp_path / "streamed.wav").read_bytes() == (tmp_path / "plain.wav").read_bytes()


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
    reference = _tone(tmp_path / "me.wav")
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


def test_a_stereo_low_rate_reference_is_said_once_before_generating(tmp_path, capsys):
    reference = _tone(tmp_path / "phone.wav", rate=8000, channels=2)
    status, _, err = _main(capsys, *MODEL, "Hello there.", "-o", str(tmp_path / "out.wav"), "--greedy",
                           "--max-new-tokens", "2", "--reference", str(reference), "--reference-text", "Mine.")
    assert status == 0, err
    notes = [line for line in err.splitlines() if "2 channels are averaged to mono" in line]
    assert len(notes) == 1 and notes[0].startswith("note: --reference 1:") and "8000 Hz" in notes[0]


def test_finish_reasons_are_summed_up_in_one_note(tmp_path, capsys):
    text = "Hello there, how are you? The quick brown fox jumps. Did you hear that now?"
    status, _, err = _main(capsys, *MODEL, text, "-o", str(tmp_path / "out.wav"), "--chunk-bytes", "40",
                           "--greedy", "--max-new-tokens", "1")
    assert status == 0, err
    notes = [line for line in err.splitlines() if "before the end of speech" in line]
    assert notes == ["note: 3 of 3 chunks (1-3) stopped at the 1-frame limit before the end of speech: "
                     "raise --max-new-tokens if speech was cut"]


def test_chunk_ranges():
    assert cli.chunk_ranges([0]) == "1"
    assert cli.chunk_ranges([0, 1, 2, 5, 7, 8]) == "1-3, 6, 8-9"
    assert cli.chunk_ranges([0, 2, 4, 6, 8, 10, 12]) == "1, 3, 5, 7, 9, ..."


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
        ([*MODEL, "Hello.", "-o", "x.wav", "--top-k", "many"], "invalid int value"),
        ([*MODEL, "--save-voice", "v.safetensors"], "saves one --reference"),
        ([*MODEL, "--reference", "a.wav", "--reference-text", "A.", "--save-voice", "a.wav"], "name it *.safetensors"),
        ([*MODEL, "Hello.", "-o", "x.wav", "--greedy", "--temperature", "0.5", "--top-k", "3"],
         "--greedy always takes the most likely token, so --temperature and --top-k would change nothing"),
        ([*MODEL, "--summary", "Hello.", "-o", "x.wav"], "leave out TEXT, --output"),
        ([*MODEL, "Hello.", "-o", "x.wav", "--chunk-bytes", "8"], "--chunk-bytes must be at least 32"),
        ([*MODEL, "Hello.", "-o", "x.wav", "--format", "mp3"], "a file's format is its suffix"),
    ],
)
def test_usage_errors_exit_2(capsys, args, message):
    status, out, err = _main(capsys, *args)
    assert status == 2 and message in err and out == ""
    assert os.listdir() == []  # refused before anything is written


@pytest.mark.parametrize(
    "flag, value",
    [("--temperature", "0"), ("--top-p", "1.5"), ("--top-k", "-1"), ("--max-new-tokens", "0"),
     ("--temperature", "1e308"), ("--temperature", "nan"), ("--top-k", "100000000000000000000"),
     ("--max-new-tokens", "9223372036854775808"), ("--seed", "99999999999999999999999")],
)
def test_sampling_settings_are_checked_by_the_model_rules_before_loading(capsys, flag, value):
    """One source of truth: `generation_settings` decides, the message names the flag and the value, in one line
    (values too big for the frame step's float32 and int64 tensors included)."""
    status, out, err = _main(capsys, *MODEL, "Hello.", "-o", "x.wav", flag, value)
    assert status == 2 and f"error: {flag}" in err.replace("`", "") and "loading" not in err and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert os.listdir() == []


@pytest.mark.parametrize(
    "text, message",
    [("   ", "text is empty or only white space"), ("Hi <|im_end|>", "control token '<|im_end|>'"),
     ("Hi <|speaker:16|>", "invalid speaker tag")],
)
def test_bad_text_is_the_processors_error(tmp_path, capsys, text, message):
    status, _, err = _main(capsys, *MODEL, text, "-o", str(tmp_path / "out.wav"))
    assert status == 1 and message in err and "loading" not in err  # refused before the model loads
    assert os.listdir(tmp_path) == []


def test_bad_references_are_refused_before_loading(tmp_path, capsys):
    (tmp_path / "text.wav").write_text("not audio")
    soundfile.write(str(tmp_path / "empty.wav"), np.zeros(0, dtype=np.float32), 44100)
    soundfile.write(str(tmp_path / "long.wav"), np.zeros(8000 * 61, dtype=np.float32), 8000)
    good = _tone(tmp_path / "good.wav")
    cases = [
        (tmp_path / "missing.wav", "Mine.", "--reference 1: audio file"),
        (tmp_path / "text.wav", "Mine.", "--reference 1: cannot read audio file"),
        (tmp_path / "empty.wav", "Mine.", "holds no samples"),
        (tmp_path / "long.wav", "Mine.", "--reference 1 is 61.0 s long"),
        (good, "Mine <|im_end|>", "--reference-text 1 contains the control token"),
    ]
    for audio, transcript, message in cases:
        status, _, err = _main(capsys, *MODEL, "Hello.", "-o", str(tmp_path / "out.wav"),
                               "--reference", str(audio), "--reference-text", transcript)
        assert status == 1 and message in err and "loading" not in err, (audio, err)
    assert "out.wav" not in os.listdir(tmp_path)


def test_devices_that_cannot_run_are_one_line_errors(capsys):
    unavailable = "cuda:99" if torch.cuda.is_available() else "cuda"
    for device, message in (("tpu", "is not a device"), (unavailable, "--device " + unavailable), ("meta", "meta")):
        status, _, err = _main(capsys, *MODEL, "Hello.", "-o", "x.wav", "--device", device)
        assert status == 1 and message in err and err.count("\n") == 1 and "loading" not in err, err


def test_bad_outputs_and_files_exit_1(tmp_path, capsys, monkeypatch):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    cases = [
        ([*MODEL, "Hello.", "-o", str(tmp_path / "out.aac")], "cannot tell the audio format"),
        ([*MODEL, "Hello.", "-o", str(tmp_path)], "it is a directory"),
        ([*MODEL, "Hello.", "-o", str(tmp_path / "out.wav"), "--voice", str(tmp_path / "none.safetensors")], "none"),
        ([*MODEL, "--text-file", str(tmp_path / "none.txt"), "-o", str(tmp_path / "out.wav")], "none.txt"),
        ([*MODEL, "--text-file", str(tmp_path / "latin1.txt"), "-o", str(tmp_path / "out.wav")],
         f"--text-file {str(tmp_path / 'latin1.txt')!r} is not UTF-8 text"),
        (["--model", str(tmp_path / "nothing"), "Hello.", "-o", str(tmp_path / "out.wav")],
         f"no checkpoint directory {str(tmp_path / 'nothing')!r}"),
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


def test_a_hub_id_without_network_is_one_clear_error(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, and an empty cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    status, _, err = _main(capsys, "--model", "fishaudio/drama-3", "Hello.", "-o", str(tmp_path / "out.wav"))
    assert status == 1 and "'fishaudio/drama-3' is not a local directory nor in the Hugging Face cache" in err, err


def test_a_failure_while_streaming_leaves_no_file(tmp_path, capsys, monkeypatch):
    def failing(model, processor, text, references, streamer, **options):
        streamer.put(torch.zeros(1, 10, dtype=torch.long))  # some audio reaches the file, then generation fails
        streamer.end()
        raise ValueError("generation failed")

    monkeypatch.setattr("transformers_drama3.synthesis.synthesize", failing)
    status, _, err = _main(capsys, *MODEL, "Hello.", "-o", str(tmp_path / "out.wav"), "--stream", *FAST)
    assert status == 1 and "generation failed" in err
    assert os.listdir(tmp_path) == []
