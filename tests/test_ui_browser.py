"""The playground page (`drama3-serve --tiny --ui`) driven in a real headless Chromium through Selenium.

One server process (on loopback, as a user starts it) and one browser serve the module. The browser resolves no
host but 127.0.0.1, so a page that needed a CDN font or script would show it here. Where Chromium, its driver or
Selenium is missing the module skips in one line; CI installs Debian's `chromium` and `chromium-driver` (.ci/run).
Marked `browser`: the README's test command leaves them out and .ci/run runs them as a stage of their own
(`python -m pytest -m browser tests/test_ui_browser.py`). `DRAMA3_UI_SCREENSHOT=docs/ui.png` also writes the page
after a take there (the picture in docs/serving.md), and `DRAMA3_UI_SCREENSHOTS=DIR` keeps the tests' other
screenshots in DIR (a refused take, the preview, an enrolment, the server down, the login page) to look at.

What a user must never see, checked wherever a test could meet it: Gradio's error toasts or "Error" pills over the
inputs (`Page.overlays`), a file the browser could not load (`Page.failed_loads`), a traceback in the server's log
for a mistake of the user's.
"""

import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from transformers_drama3.testing import sine_recording

from .conftest import default_sigint, wait_until_healthy

CHROMIUM, CHROMEDRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no Chromium and chromedriver on PATH (CI installs Debian's chromium and chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
pytest.importorskip("gradio", reason="gradio is not installed (the ui and test extras have it)")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

pytestmark = pytest.mark.browser  # a stage of its own in .ci/run (about 5 minutes on 2 busy cores)
MODEL = "drama3-tiny"
TIMEOUT = 120  # seconds for one wait: a busy 2-core CI machine makes ~10 tiny frames a second
FRAMES = 12  # frames per take: enough to hear, short to make
LONG_TEXT, LONG_SEED = "Keep talking for a while please.", 3  # a take of 142 frames (about 10 s to make): stoppable
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,2400",  # and the browser's own autoplay rules, as a user's browser has them
                  "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"]  # offline: nothing but loopback


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`drama3-serve --tiny --ui` in a child process (with `--api-key KEY` when given; `--voices` unless `voices` is
    False), restartable on its port. Its temporary files (the takes) go in its folder's `tmp`."""

    def __init__(self, folder: Path, key: str | None = None, voices: bool = True):
        self.port, self.folder, self.process, self.key, self.voices = free_port(), folder, None, key, voices
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = folder / "tmp"
        self.tmp.mkdir()
        (folder / "voices").mkdir()

    def start(self) -> None:
        command = [sys.executable, "-m", "transformers_drama3.serving.cli", "--tiny", "--ui", "--port",
                   str(self.port), "--max-reference-seconds", "5",
                   *(["--voices", str(self.folder / "voices")] if self.voices else []),
                   *(["--api-key", self.key] if self.key else [])]
        log = open(self.folder / "server.log", "a")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=default_sigint,
                                        env={**os.environ, "TMPDIR": str(self.tmp)})
        if wait_until_healthy(self.process, self.url, TIMEOUT):
            return
        raise RuntimeError(f"drama3-serve --ui did not start: {(self.folder / 'server.log').read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=TIMEOUT)

    def speech(self, key: str | None = None, **fields) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}/v1/audio/speech", json={"model": MODEL, **fields}, headers=headers,
                          timeout=TIMEOUT)

    def log(self) -> str:
        return (self.folder / "server.log").read_text()

    def enrol(self, name: str, seconds: float, rate: int = 44100) -> None:
        """Enrol a tone of `seconds` as voice `name` over HTTP."""
        import soundfile

        buffer = io.BytesIO()
        soundfile.write(buffer, sine_recording(seconds, rate), rate, format="WAV")
        created = httpx.post(f"{self.url}/v1/voices", data={"name": name, "transcript": "A tone."},
                             files={"audio": ("tone.wav", buffer.getvalue(), "audio/wav")}, timeout=TIMEOUT)
        assert created.status_code == 201, created.text

    def cancelled(self) -> float:
        metrics = httpx.get(f"{self.url}/metrics", timeout=TIMEOUT).text
        return float(re.search(r'drama3_speech_requests_total\{outcome="cancelled"\} (\S+)', metrics).group(1))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = Server(tmp_path_factory.mktemp("ui-server"))
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def downloads(tmp_path_factory):
    return tmp_path_factory.mktemp("downloads")


MICROPHONE_SECONDS = 3  # the fake microphone's recording, played in a loop


@pytest.fixture(scope="module")
def microphone(tmp_path_factory) -> Path:
    """What Chromium's fake microphone hears: a 220 Hz tone (a 16-bit WAV, the form Chromium reads)."""
    import soundfile

    path, rate = tmp_path_factory.mktemp("microphone") / "tone.wav", 48000
    soundfile.write(path, sine_recording(MICROPHONE_SECONDS, rate), rate, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def browser(server, downloads, microphone, tmp_path_factory):
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for a driver online: the system's is given
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    media = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",  # a microphone, allowed
             f"--use-file-for-fake-audio-capture={microphone}"]
    for flag in [*CHROMIUM_FLAGS, *media, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: a failed load shows there
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    yield Page(driver, server)
    driver.quit()


class Page:
    """The playground in the browser: its controls by their element ids (ui.py)."""

    def __init__(self, driver, server: Server):
        self.driver, self.server = driver, server

    def open(self) -> None:
        """Open the page as a new visitor (without what an earlier test typed, which the browser keeps)."""
        self.driver.execute_cdp_cmd("Storage.clearDataForOrigin", {"origin": self.server.url,
                                                                  "storageTypes": "local_storage"})
        self.driver.get(self.server.url + "/")  # `/` links to the page
        self.wait(lambda: "quantisation" in self.text("status"), "the status line")
        # The page has put back what this browser left (nothing: the example), which would overwrite what a test
        # types before it; the preview follows it.
        self.wait(lambda: "The server will speak it" in self.text("preview"), "the page's text restored")

    def element(self, elem_id: str):
        return self.driver.find_element(By.ID, elem_id)

    def text(self, elem_id: str) -> str:
        return self.element(elem_id).text

    def value(self, elem_id: str) -> str:
        """What a text box or number field holds."""
        return self.driver.find_element(By.CSS_SELECTOR, f"#{elem_id} textarea, #{elem_id} input").get_attribute(
            "value")

    def fill(self, elem_id: str, value) -> None:
        selector = f"#{elem_id} textarea, #{elem_id} input[type=number], #{elem_id} input"
        # A field inside an accordion just opened is rendered a moment later: wait for it to show.
        box = self.wait(lambda: next((e for e in self.driver.find_elements(By.CSS_SELECTOR, selector)
                                      if e.is_displayed()), None), f"the field {elem_id}")
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.DELETE)
        box.send_keys(str(value))
        box.send_keys(Keys.TAB)

    def pick(self, elem_id: str, choice: str) -> None:
        """Choose `choice` in a dropdown."""
        self.driver.find_element(By.CSS_SELECTOR, f"#{elem_id} input").click()
        self.wait(lambda: self.driver.find_element(By.CSS_SELECTOR, f"#{elem_id} li[aria-label='{choice}']"),
                  f"{choice} in {elem_id}").click()

    def click(self, elem_id: str) -> None:
        self.element(elem_id).click()

    def message(self, elem_id: str) -> str:
        """The message beside field `elem_id` ("" when there is none)."""
        found = self.driver.find_elements(By.CSS_SELECTOR, f"#{elem_id} .info-text, #{elem_id}-info")
        return found[0].text if found else ""

    def overlays(self) -> list[str]:
        """Gradio's error toasts and its "Error" pills over components: none must ever show."""
        shown = self.driver.find_elements(By.CSS_SELECTOR, ".toast-body, [data-testid=status-tracker] span.error")
        return [element.text for element in shown if element.is_displayed()]

    def type_fast(self, elem_id: str, text: str) -> None:
        """Put a long `text` in a text box at once, as a paste does (typing it key by key takes minutes)."""
        box = self.driver.find_element(By.CSS_SELECTOR, f"#{elem_id} textarea")
        self.driver.execute_script("arguments[0].value = arguments[1];"
                                   "arguments[0].dispatchEvent(new Event('input', {bubbles: true}));", box, text)

    def failed_loads(self) -> list[str]:
        """What the browser's console says it could not load since the last call (a 404 shows there)."""
        return [entry["message"] for entry in self.driver.get_log("browser") if "Failed to load" in entry["message"]]

    def screenshot(self, path: Path) -> None:
        self.driver.save_screenshot(str(path))
        if os.environ.get("DRAMA3_UI_SCREENSHOTS"):  # a folder to keep them in, to look at
            shutil.copyfile(path, Path(os.environ["DRAMA3_UI_SCREENSHOTS"]) / path.name)

    def wait(self, condition, what: str, timeout: float = TIMEOUT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                result = condition()
            except Exception:  # noqa: BLE001  (the page is still rendering)
                result = None
            if result:
                return result
            time.sleep(0.1)
        shown = self.driver.find_element(By.TAG_NAME, "body").text[:2000]
        raise AssertionError(f"waited {timeout} s for {what}; the page says: {shown}")

    def stays(self, elem_id: str, text: str, seconds: float) -> bool:
        """Whether element `elem_id` still says `text` all through the next `seconds` (for what must not change)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.text(elem_id) != text:
                return False
            time.sleep(0.1)
        return True

    def take(self, number: int) -> str:
        """Wait for take `number` and return its line (time to first audio, real-time factor)."""
        return self.wait(lambda: (line := self.text("take-info")).startswith(f"Take #{number}:") and line,
                         f"take #{number}")

    def speak_take(self, number: int, text: str, seed: int | None = None, frames: int = FRAMES) -> str:
        self.fill("text", text)
        self.fill("max_frames", frames)
        if seed is not None:
            self.fill("seed", seed)
        self.click("speak")
        return self.take(number)

    def copied_curl(self) -> str:
        """The curl command of the selected take (Copy as code)."""
        return self.wait(lambda: "curl" in (code := self.driver.find_element(
            By.CSS_SELECTOR, "#code-curl .cm-content").get_attribute("innerText")) and code, "the curl command")

    def download(self, folder: Path, name: str, number: int = 1) -> bytes:
        """Click take `number`'s download button; the file's bytes once the browser has written it (a click that
        came before the button showed the new take downloads the previous one, which is dropped: click again)."""

        def downloaded():
            for path in folder.glob(f"drama3-take-*.{name}"):
                if path.name == f"drama3-take-{number}.{name}":
                    return path
                path.unlink()
            if self.element(f"download-{name}").is_displayed():
                self.click(f"download-{name}")
                time.sleep(0.5)
            return None

        path = self.wait(downloaded, f"the {name} download of take #{number}")
        data = path.read_bytes()
        path.unlink()
        return data


def test_speak_a_dialogue_line_streams_and_shows_time_to_first_audio(browser, server, downloads, tmp_path):
    browser.open()
    browser.fill("text", "<|speaker:0|> Did you buy the bread?")
    browser.fill("line", "Of course I did.")
    browser.pick("speaker", "1")
    browser.click("add-line")
    browser.wait(lambda: "<|speaker:1|> Of course I did." in browser.element("text").find_element(
        By.TAG_NAME, "textarea").get_attribute("value"), "the dialogue helper's line")
    browser.fill("max_frames", FRAMES)
    # The page's audio waits, suspended, for a click (a browser lets a page play only after one).
    assert browser.driver.execute_script("return window.drama3Audio.state") == "suspended"
    browser.click("speak")
    line = browser.take(1)
    assert re.search(r"first audio after \d+ ms · real-time factor \d", line), line
    # The live player played the take as it came, all of it, audibly, and says when its first audio started.
    live = browser.wait(lambda: (state := browser.driver.execute_script("return window.drama3Live"))["done"]
                        and state, "the live player to reach the end of the take")
    assert live["error"] is None and live["chunks"] >= 1 and live["audio_state"] == "running", live
    assert re.fullmatch(r"Played: first audio in this browser \d+ ms after the click · \d+\.\d s of audio",
                        browser.text("live")), browser.text("live")
    browser.wait(lambda: browser.driver.find_element(By.CSS_SELECTOR, "#player a[download]").get_attribute(
        "download") == "drama3-take-1.wav", "the complete take in the player below")
    samples = np.frombuffer(browser.download(downloads, "wav")[44:], np.int16)
    assert samples.size > 0 and np.abs(samples).max() > 0
    assert live["samples"] == samples.size  # the live stream carried every sample of the take
    # Offline: everything the page loaded came from this server.
    loaded = browser.driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(server.url) for url in loaded), loaded
    screenshot = tmp_path / "page-after-a-take.png"
    browser.driver.save_screenshot(str(screenshot))
    if os.environ.get("DRAMA3_UI_SCREENSHOT"):
        shutil.copyfile(screenshot, os.environ["DRAMA3_UI_SCREENSHOT"])


def upload(browser, path: Path) -> None:
    """Put the file `path` in the enrolment form's recording (the form open)."""
    clear = browser.driver.find_elements(By.CSS_SELECTOR, "#recording button[aria-label='Clear']")
    if clear:
        clear[0].click()
    browser.wait(lambda: browser.driver.find_element(By.CSS_SELECTOR, "#recording input[type=file]"),
                 "the recording's upload").send_keys(str(path))
    uploaded = "#recording audio, #recording .waveform-container"
    browser.wait(lambda: browser.driver.find_elements(By.CSS_SELECTOR, uploaded), "the uploaded recording")


def test_enrol_a_voice_from_a_wav_file_and_speak_with_it(browser, server, tmp_path):
    """Enrolment tells the truth: a clip too short to copy a voice from is refused, with the reason, beside the
    recording; the server's note on a recording it resamples is shown; a name taken offers to replace that voice."""
    import soundfile

    short, low, rate = tmp_path / "short.wav", tmp_path / "me.wav", 16000
    soundfile.write(short, sine_recording(0.5, rate), rate)
    soundfile.write(low, sine_recording(2.5, rate), rate)
    browser.open()
    browser.driver.find_element(By.CSS_SELECTOR, "#enrol-accordion button").click()  # it opens closed
    browser.fill("new-name", "tester")
    upload(browser, short)
    browser.fill("transcript", "A short test recording.")
    browser.click("enrol")
    message = browser.wait(lambda: browser.message("recording"), "the message beside the recording")
    assert "0.5 s long; a voice needs at least 2 s" in message and "too little" in message, message
    upload(browser, low)
    browser.click("enrol")
    browser.wait(lambda: "Enrolled tester" in browser.text("voice-info"), "the enrolment")
    assert "16000 Hz are resampled to 44100 Hz" in browser.text("voice-info"), browser.text("voice-info")
    assert browser.message("recording") == ""
    assert [voice["id"] for voice in httpx.get(f"{server.url}/v1/voices").json()["data"]] == ["default", "tester"]
    frames = httpx.get(f"{server.url}/v1/voices/tester", timeout=TIMEOUT).json()["frames"]
    # The same name again: the page offers to replace the voice, and does.
    browser.fill("new-name", "tester")
    upload(browser, low)
    browser.fill("transcript", "The same voice, enrolled again.")
    browser.click("enrol")
    message = browser.wait(lambda: browser.message("new-name"), "the message beside the name")
    assert "a voice called 'tester' already exists" in message and "PUT" not in message, message
    browser.wait(lambda: browser.element("replace").is_displayed(), "the replace button")
    browser.click("replace")
    browser.wait(lambda: "Replaced tester" in browser.text("voice-info"), "the replaced voice")
    browser.wait(lambda: browser.message("new-name") == "", "the name's message gone")
    details = httpx.get(f"{server.url}/v1/voices/tester", timeout=TIMEOUT).json()
    assert details["transcript"] == "The same voice, enrolled again." and details["frames"] == frames
    browser.screenshot(tmp_path / "enrolled-and-replaced.png")
    assert browser.overlays() == []
    browser.pick("voice", "tester")
    browser.speak_take(1, "Hello from my own voice.")
    assert "· tester ·" in browser.driver.find_element(By.CSS_SELECTOR, "#takes input").get_attribute("value")


def test_enrol_a_voice_from_the_microphone(browser, server):
    browser.open()
    browser.driver.find_element(By.CSS_SELECTOR, "#enrol-accordion button").click()
    browser.fill("new-name", "microphone")
    browser.driver.find_element(By.CSS_SELECTOR, "#recording button[aria-label='Record audio']").click()
    browser.wait(lambda: browser.driver.find_element(By.CSS_SELECTOR, "#recording .record-button"),
                 "the record button").click()
    # Record until the page's clock shows 3 s (the page takes at least 2 s), then stop (the fake microphone plays
    # the tone).
    browser.wait(lambda: re.search(r"0:0[3-9]", browser.text("recording")), "three seconds of recording")
    browser.driver.find_element(By.CSS_SELECTOR, "#recording .stop-button").click()
    browser.wait(lambda: browser.driver.find_elements(By.CSS_SELECTOR, "#recording .waveform-container"),
                 "the recording, played back")
    browser.fill("transcript", "A tone from the fake microphone.")
    browser.click("enrol")
    browser.wait(lambda: "Enrolled microphone" in browser.text("voice-info"), "the enrolment")
    frames = httpx.get(f"{server.url}/v1/voices/microphone", timeout=TIMEOUT).json()["frames"]
    assert 3 * 21 <= frames <= 5 * 22, frames  # about 3 s at 21.5 frames a second, within --max-reference-seconds
    browser.pick("voice", "microphone")
    browser.speak_take(1, "Hello from the microphone.")
    assert "· microphone ·" in browser.driver.find_element(By.CSS_SELECTOR, "#takes input").get_attribute("value")


def test_the_same_seed_gives_the_bytes_of_the_same_request_over_http(browser, server, downloads):
    browser.open()
    browser.speak_take(1, "Same seed, same audio.", seed=1234)
    page_wav = browser.download(downloads, "wav")
    http_wav = server.speech(input="Same seed, same audio.", response_format="wav", seed=1234,
                             max_new_tokens=FRAMES).content
    assert page_wav[:4] == b"RIFF" and page_wav == http_wav
    browser.fill("seed", 1235)  # another seed, another take
    browser.click("speak")
    line = browser.take(2)
    assert browser.download(downloads, "wav", number=2) != http_wav
    # Stop with no take running changes nothing: the last take's line stays (it said "Stopped" within a second).
    browser.wait(lambda: browser.element("speak").is_enabled(), "Speak enabled after the take")
    browser.click("stop")
    assert browser.stays("take-info", line, seconds=5), browser.text("take-info")


def test_stop_cancels_the_request_on_the_server(browser, server):
    browser.open()
    before = server.cancelled()
    browser.fill("text", LONG_TEXT)
    browser.fill("max_frames", 1000)
    browser.fill("seed", LONG_SEED)
    browser.click("speak")
    # While the take runs Speak is disabled, and the live line says how far it got.
    browser.wait(lambda: re.search(r"[1-9]\.\d s of audio so far", browser.text("live")), "the take's progress")
    assert not browser.element("speak").is_enabled()
    browser.wait(lambda: "Speaking… first audio after" in browser.text("take-info"), "the first audio")
    browser.click("stop")
    browser.wait(lambda: server.cancelled() == before + 1, "the server's cancelled count in /metrics")
    assert browser.text("take-info").startswith("Stopped"), browser.text("take-info")
    assert browser.text("live") == "" and browser.element("speak").is_enabled()  # nothing left of the take


def test_a_control_token_is_refused_with_the_servers_message(browser, server):
    browser.open()
    text = "Hello <|im_end|> there."
    message = server.speech(input=text).json()["error"]["message"]
    browser.fill("text", text)
    browser.wait(lambda: message in browser.text("preview"), "the server's message under the text")
    browser.click("speak")
    browser.wait(lambda: browser.text("take-info") == "⚠️ Not spoken: see the message beside Text", "the refusal")
    assert message in browser.text("preview") and browser.overlays() == []
    assert "Traceback" not in browser.driver.find_element(By.TAG_NAME, "body").text


def test_a_refused_take_says_why_beside_the_field_in_the_pages_words(browser, server, tmp_path):
    """The server's checks, in the page's words, beside the field they name: no Gradio error over the inputs, none
    of Gradio's own wording, no traceback in the server's log; the fields' bounds are the server's."""
    browser.open()
    logged = len(server.log())
    assert [browser.driver.find_element(By.CSS_SELECTOR, f"#{elem_id} input").get_attribute(bound)
            for elem_id, bound in (("max_frames", "min"), ("max_frames", "max"), ("top_k", "min"))] == ["1", "2048",
                                                                                                       "0"]
    browser.fill("text", "Hello there.")
    for frames in (99999999999, 0, -5):
        browser.fill("max_frames", frames)
        browser.click("speak")
        message = browser.wait(lambda: (said := browser.message("max_frames")).endswith(f"got {frames}") and said,
                               f"the message beside max frames for {frames}")
        assert message == ("⚠️ max frames per text chunk must be an integer in [1, 2048] (the server's "
                           f"--max-frames), got {frames}"), message
        assert browser.text("take-info") == "⚠️ Not spoken: see the message beside max frames per text chunk"
        browser.wait(lambda: browser.element("speak").is_enabled(), "Speak enabled again")
        assert browser.text("live") == "" and browser.overlays() == []
    browser.screenshot(tmp_path / "refused-take.png")
    browser.fill("line", "")
    browser.click("add-line")
    browser.wait(lambda: "write the line first" in browser.message("line"), "the message beside the line")
    assert browser.overlays() == []
    browser.fill("max_frames", FRAMES)  # put right, the take is spoken and the messages go
    browser.click("speak")
    browser.take(1)
    assert browser.message("max_frames") == "" and browser.message("line") != ""
    # Refused again, then "Use these settings again": the take's values come back, and the refusal's messages go.
    browser.fill("max_frames", 0)
    browser.click("speak")
    browser.wait(lambda: browser.message("max_frames").endswith("got 0"), "the message beside max frames")
    browser.click("reuse")
    browser.wait(lambda: browser.value("max_frames") == str(FRAMES), "the take's max frames back")
    browser.wait(lambda: browser.message("max_frames") == "" and browser.text("take-info") == "",
                 "the refusal's messages gone")
    log = server.log()[logged:]
    assert "Traceback" not in log and "greater than maximum" not in log, log[-3000:]


def test_use_these_settings_again_when_the_takes_voice_was_deleted(browser, server, tmp_path):
    server.enrol("fleeting", 2.5)
    browser.open()
    browser.pick("voice", "fleeting")
    browser.speak_take(1, "A voice that will go.", seed=5)
    assert httpx.delete(f"{server.url}/v1/voices/fleeting", timeout=TIMEOUT).status_code == 200
    browser.fill("text", "Something else.")
    browser.click("reuse")
    message = browser.wait(lambda: browser.message("voice"), "the message beside the voice")
    assert "this take's voice 'fleeting' has been deleted" in message and "'default'" in message, message
    assert browser.value("voice") == "default" and browser.value("text") == "A voice that will go."
    assert browser.overlays() == []
    browser.screenshot(tmp_path / "reused-deleted-voice.png")
    browser.click("speak")
    browser.take(2)
    assert "· default · seed" in browser.driver.find_element(By.CSS_SELECTOR, "#takes input").get_attribute("value")


def test_the_preview_runs_the_servers_checks_and_stays_short(browser, server, tmp_path):
    browser.open()
    long_text = "The quick brown fox jumps over the lazy dog. " * 445  # 20,025 characters
    browser.type_fast("text", long_text)
    browser.wait(lambda: f"Text has {len(long_text)} characters; this server takes at most 4096 (--max-text-chars)"
                 in browser.text("preview"), "the length limit in the preview")
    text = long_text[:4000]  # within the limit: many chunks, said in a short line
    browser.type_fast("text", text)
    summary = browser.wait(lambda: "chunks" in (said := browser.text("preview")) and said, "the preview's summary")
    assert re.search(r"in \d\d chunks \(4,000 of at most 4,096 characters\)", summary), summary
    assert summary.count("→") == 3 and "more" in summary and "⏵" not in summary, summary
    speak, box = browser.element("speak").rect, browser.element("text").rect
    assert speak["y"] - (box["y"] + box["height"]) < 300, (speak, box)  # Speak stays in view
    # The separator is drawn in the preview's own font, as the words around it are, not in a font the browser falls
    # back to for a glyph that font lacks (which common fonts show as an empty box).
    driver = browser.driver
    document = driver.execute_cdp_cmd("DOM.getDocument", {"depth": 0})
    paragraph = driver.execute_cdp_cmd("DOM.querySelector", {"nodeId": document["root"]["nodeId"],
                                                             "selector": "#preview p"})
    driver.execute_cdp_cmd("CSS.enable", {})
    used = [font["familyName"] for font in driver.execute_cdp_cmd(
        "CSS.getPlatformFontsForNode", {"nodeId": paragraph["nodeId"]})["fonts"]]
    assert len(used) == 1, used
    browser.screenshot(tmp_path / "preview.png")


def test_the_links_work_offline_and_name_our_api(browser, server, tmp_path):
    browser.open()
    browser.failed_loads()  # what came before the page (the first open of the browser)
    browser.driver.refresh()
    browser.wait(lambda: "quantisation" in browser.text("status"), "the status line")
    footer = browser.driver.find_element(By.TAG_NAME, "footer").text
    assert "Use via API" not in footer and "API" not in footer, footer
    assert "POST /v1/audio/speech" in browser.text("our-api")
    assert httpx.get(f"{server.url}/ui/gradio_api/info", timeout=TIMEOUT).json()["named_endpoints"] == {}
    for path, kind in (("/favicon.ico", "image/"), ("/manifest.json", "application/manifest+json")):
        answer = httpx.get(server.url + path, timeout=TIMEOUT)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith(kind), (path, answer)
    assert browser.failed_loads() == []  # no 404 for the icon or the manifest
    docs = browser.driver.find_element(By.LINK_TEXT, "API docs").get_attribute("href")
    assert docs == f"{server.url}/docs", docs
    browser.driver.get(docs)  # the link opens a new tab: open it here
    browser.wait(lambda: "Drama 3 speech server" in browser.driver.find_element(By.CSS_SELECTOR,
                                                                                  ".swagger-ui .title").text,
                 "Swagger UI with the server's API")
    assert "/v1/audio/speech" in browser.driver.find_element(By.TAG_NAME, "body").text
    browser.screenshot(tmp_path / "api-docs.png")
    loaded = browser.driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(server.url) for url in loaded), loaded  # offline: all from the server
    assert browser.failed_loads() == []


def test_the_copied_curl_command_returns_the_pages_take(browser, server, downloads, tmp_path):
    browser.open()
    browser.fill("temperature", 0.7)
    browser.driver.find_element(By.CSS_SELECTOR, "#more-accordion button").click()  # it opens closed
    browser.fill("ras_top_k", 5)
    browser.fill("codebook_top_p", 0.5)
    browser.speak_take(1, "<|speaker:0|> Copy me, exactly.", seed=77)
    page_wav = browser.download(downloads, "wav")
    command = browser.copied_curl()
    for field in ('"temperature": 0.7', '"seed": 77', '"ras_top_k": 5', '"codebook_top_p": 0.5'):
        assert field in command, command
    assert '"ras_window"' not in command, command  # left at the model's value: left out
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True, timeout=TIMEOUT)
    assert (tmp_path / "take.wav").read_bytes() == page_wav


def test_a_page_left_open_recovers_after_the_server_restarts(browser, server, tmp_path):
    browser.open()
    text = "<|speaker:1|> Still here after the restart."
    browser.fill("text", text)
    browser.fill("temperature", 0.8)
    browser.fill("max_frames", FRAMES)
    browser.driver.execute_script("window.leftOpen = true")
    server.stop()
    # The takes' files, and Gradio's copies of them and the uploads, went with the server (Gradio leaves an empty
    # folder of its own in the temporary directory).
    left = [*server.tmp.glob("drama3-takes-*"), *(path for path in server.tmp.glob("gradio/**/*") if path.is_file())]
    assert left == []
    # While it is down the status line says so, rather than showing its last figures, and Gradio's own "Connection
    # Lost" error does not show beside it.
    browser.wait(lambda: "does not answer" in browser.text("server") and not browser.element("status").is_displayed(),
                 "the status line to say the server is down")
    assert browser.overlays() == []
    browser.screenshot(tmp_path / "server-down.png")
    server.start()
    # Gradio's page sees its server back and reloads itself, and what was typed comes back from the browser's
    # storage: then it speaks again with nobody typing anything.
    browser.wait(lambda: browser.driver.execute_script("return window.leftOpen") is None
                 and "quantisation" in browser.text("status"), "the page to reload itself")
    assert browser.text("server") == "" and browser.overlays() == []
    browser.wait(lambda: browser.value("text") == text, "the typed text back in the text box")
    assert browser.value("temperature") == "0.8" and browser.value("max_frames") == str(FRAMES)
    browser.click("speak")
    browser.take(1)
    command = browser.copied_curl()
    assert '"temperature": 0.8' in command and "Still here after the restart." in command, command


def test_the_page_behind_an_api_key(browser, tmp_path_factory):
    """With --api-key the page asks for the key, and then works: its own calls are authorised; HTTP calls without
    the key, and the page's live route without the page's key, are still refused."""
    keyed = Server(tmp_path_factory.mktemp("keyed-server"), key="sesame-4711", voices=False)
    keyed.start()
    try:
        page = Page(browser.driver, keyed)
        page.driver.get(keyed.url + "/")
        page.wait(lambda: page.driver.find_element(By.CSS_SELECTOR, "input[type=password]"), "the login form")
        # The login page says what the password is.
        login = page.wait(lambda: "API key" in (said := page.driver.find_element(By.TAG_NAME, "body").text) and said,
                          "the login page's message")
        assert "the key as the password" in login, login
        page.screenshot(tmp_path_factory.mktemp("login") / "login.png")
        page.driver.find_element(By.CSS_SELECTOR, "input[data-testid=textbox]").send_keys("me")
        page.driver.find_element(By.CSS_SELECTOR, "input[type=password]").send_keys("sesame-4711", Keys.ENTER)
        page.wait(lambda: "quantisation" in page.text("status"), "the page after the login")
        # No link to /metrics, which a browser cannot open without the key: the page says it needs the key.
        assert page.driver.find_elements(By.CSS_SELECTOR, "a[href$='metrics']") == []
        assert "it needs the API key" in page.text("our-api")
        # This server saves no voices: the enrolment form says so, with the flag, and takes nothing.
        page.driver.find_element(By.CSS_SELECTOR, "#enrol-accordion button").click()
        page.wait(lambda: "--voices DIR" in page.text("enrol-off"), "the enrolment's message")
        assert not page.element("enrol").is_enabled()
        assert not page.driver.find_element(By.CSS_SELECTOR, "#new-name input, #new-name textarea").is_enabled()
        page.speak_take(1, "Behind a key.", seed=9)
        assert page.driver.execute_script("return window.drama3Live.done"), "the live player played nothing"
        assert "Authorization: Bearer $DRAMA3_API_KEY" in page.copied_curl()
        refused = keyed.speech(input="No key.", max_new_tokens=FRAMES)
        assert refused.status_code == 401 and "no API key" in refused.json()["error"]["message"]
        assert keyed.speech(key="sesame-4711", input="A key.", max_new_tokens=FRAMES).status_code == 200
        live = httpx.post(f"{keyed.url}/ui/live/{'0' * 32}", json={"text": "No page key."}, timeout=TIMEOUT)
        assert live.status_code == 401, live.text
    finally:
        keyed.stop()
