"""Two `drama3-serve` processes sharing one `--voices` directory, as replicas behind a load balancer would: a voice
enrolled on one speaks on the other at once, a replacement is seen (no stale copy in memory), a deletion makes the
other answer 404; a voice saved by `drama3-tts --save-voice` under the documented name serves, and bad files in the
directory are reported in both logs. Also the voice file's content hash (`Drama3Voice.load` refuses a damaged file)."""

import io
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
import soundfile
import torch

from transformers_drama3 import cli
from transformers_drama3.voice import VOICE_FILE_SUFFIX, Drama3Voice

from .conftest import wait_until_healthy

TIMEOUT = 120
SPEAK = {"model": "drama3-tiny", "input": "Hello there.", "response_format": "wav", "seed": 0, "max_new_tokens": 3}


def sine_wav(seconds: float, frequency: float = 220.0, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(buffer, 0.3 * np.sin(2 * np.pi * frequency * t), rate, format="WAV")
    return buffer.getvalue()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def voices(tmp_path_factory):
    """The shared directory, with a damaged voice file and a file whose name is no voice name."""
    folder = tmp_path_factory.mktemp("shared-voices")
    (folder / f"broken{VOICE_FILE_SUFFIX}").write_bytes(b"not a voice file")
    Drama3Voice(torch.zeros(10, 2, dtype=torch.long), "Hi.").save(folder / "two words.safetensors")
    return folder


def save_voice_with_the_cli(folder) -> None:
    """`drama3-tts --save-voice me.voice.safetensors`, the name the docs give, into the shared directory."""
    recording = folder.parent / "me.wav"
    recording.write_bytes(sine_wav(1.0))
    status = cli.main(["--tiny", "--quiet", "--reference", str(recording), "--reference-text", "This is my voice.",
                       "--save-voice", str(folder / f"me{VOICE_FILE_SUFFIX}")])
    assert status == 0


@pytest.fixture(scope="module")
def replicas(voices, tmp_path_factory):
    """Two servers started at once on the same voices directory (a voice is saved there by the CLI while they
    load): [(url, log file), ...]."""
    logs = tmp_path_factory.mktemp("replica-logs")
    started = []
    for index in range(2):
        port, log = free_port(), logs / f"replica{index}.log"
        command = [sys.executable, "-m", "transformers_drama3.serving.cli", "--tiny", "--port", str(port), "--voices",
                   str(voices), "--max-frames", "8"]
        with open(log, "w") as output:
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        started.append((process, f"http://127.0.0.1:{port}", log))
    try:
        save_voice_with_the_cli(voices)
        for process, url, log in started:
            assert wait_until_healthy(process, url, TIMEOUT), log.read_text()
        yield [(url, log) for _, url, log in started]
    finally:
        for process, _, _ in started:
            process.send_signal(signal.SIGTERM)
        for process, _, _ in started:
            process.wait(timeout=TIMEOUT)


def speak(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/speech", json={**SPEAK, **body}, timeout=TIMEOUT)


def enrol(url: str, method: str, path: str, transcript: str, frequency: float, **fields) -> httpx.Response:
    files = {"audio": ("me.wav", sine_wav(0.5, frequency), "audio/wav")}
    return httpx.request(method, f"{url}{path}", data={"transcript": transcript, **fields}, files=files,
                         timeout=TIMEOUT)


def test_replicas_share_enrolment_replacement_and_deletion(replicas):
    (a, _), (b, _) = replicas
    created = enrol(a, "POST", "/v1/voices", "A shared voice.", 330.0, name="shared")
    assert created.status_code == 201, created.text
    assert enrol(b, "POST", "/v1/voices", "Again.", 330.0, name="shared").status_code == 409  # taken, on b too

    on_a, on_b = speak(a, voice="shared"), speak(b, voice="shared")
    assert on_b.status_code == 200 and on_b.content == on_a.content != speak(b).content
    assert httpx.get(f"{b}/v1/voices/shared", timeout=TIMEOUT).json()["transcript"] == "A shared voice."

    replaced = enrol(b, "PUT", "/v1/voices/shared", "A new take.", 440.0)
    assert replaced.status_code == 200, replaced.text
    details = httpx.get(f"{a}/v1/voices/shared", timeout=TIMEOUT).json()  # a read the old voice before: re-read now
    assert details["transcript"] == "A new take." and details["sha256"] == replaced.json()["sha256"]
    assert speak(a, voice="shared").content == speak(b, voice="shared").content != on_a.content

    assert httpx.delete(f"{a}/v1/voices/shared", timeout=TIMEOUT).json()["deleted"] is True
    gone = httpx.get(f"{b}/v1/voices/shared", timeout=TIMEOUT)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "voice_not_found"
    refused = speak(b, voice="shared")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "voice_not_found"
    assert httpx.delete(f"{b}/v1/voices/shared", timeout=TIMEOUT).status_code == 404
    assert "shared" not in [voice["id"] for voice in httpx.get(f"{a}/v1/voices", timeout=TIMEOUT).json()["data"]]
    assert enrol(a, "PUT", "/v1/voices/fresh", "A new name.", 550.0).status_code == 201  # PUT of a new name creates
    assert httpx.get(f"{b}/v1/voices/fresh", timeout=TIMEOUT).json()["transcript"] == "A new name."


def test_a_voice_saved_by_the_cli_serves_and_bad_files_are_logged(replicas):
    for url, log in replicas:
        listed = [voice["id"] for voice in httpx.get(f"{url}/v1/voices", timeout=TIMEOUT).json()["data"]]
        assert {"default", "me"} <= set(listed) and "broken" not in listed and "two words" not in listed
        assert speak(url, voice="me").status_code == 200
        text = log.read_text()
        assert f"broken{VOICE_FILE_SUFFIX} is not used" in text and "is not a Drama 3 voice file" in text
        assert "two words.safetensors is not used: 'two words' is not a voice name" in text
        assert httpx.get(f"{url}/v1/voices/broken", timeout=TIMEOUT).json()["error"]["code"] == "voice_unreadable"
        assert httpx.delete(f"{url}/v1/voices/default", timeout=TIMEOUT).status_code == 409


def test_a_damaged_voice_file_is_refused(tmp_path):
    voice = Drama3Voice(torch.arange(20).reshape(10, 2), "Hello.")
    path = voice.save(tmp_path / f"v{VOICE_FILE_SUFFIX}")
    assert torch.equal(Drama3Voice.load(path).codes, voice.codes)
    data = bytearray(path.read_bytes())
    data[-8] ^= 1  # one bit of the last code
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is damaged"):
        Drama3Voice.load(path)


def test_a_server_without_a_voices_folder_knows_no_voice_by_name():
    """Without `--voices` every name but `default` is unknown (a 400 naming it), never a crash on the missing folder."""
    from transformers_drama3.serving.errors import APIError
    from transformers_drama3.serving.voices import VoiceLibrary

    library = VoiceLibrary(None)
    assert not library.exists("me") and library.path_of("me") is None
    with pytest.raises(APIError) as refused:
        library.get("me")
    assert refused.value.status == 400 and "me" in str(refused.value)
