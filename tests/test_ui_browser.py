"""The playground page (`drama3-serve --tiny --ui`) driven in a real headless Chromium through Selenium.

One server process (on loopback, as a user starts it) and one browser serve the module. The browser resolves no
host but 127.0.0.1, so a page that needed a CDN font or script would show it here. Where Chromium, its driver or
Selenium is missing the module skips in one line; CI installs Debian's `chromium` and `chromium-driver` (.ci/run).
Marked `browser`: the README's test command leaves them out and .ci/run runs them as a stage of their own
(`python -m pytest -m browser tests/test_ui_browser.py`). `DRAMA3_UI_SCREENSHOT=docs/ui.png` also writes the page
after a take there (the picture in docs/serving.md).
"""

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

pytestmark = pytest.mark.browser  # a stage of its own in .ci/run (about 2 minutes on 2 busy cores)
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
    """`drama3-serve --tiny --ui` in a child process (with `--api-key KEY` when given), restartable on its port."""

    def __init__(self, folder: Path, key: str | None = None):
        self.port, self.folder, self.process, self.key = free_port(), folder, None, key
        self.url = f"http://127.0.0.1:{self.port}"
        (folder / "voices").mkdir()

    def start(self) -> None:
        command = [sys.executable, "-m", "transformers_drama3.serving.cli", "--tiny", "--ui", "--port",
                   str(self.port), "--voices", str(self.folder / "voices"), "--max-reference-seconds", "5",
                   *(["--api-key", self.key] if self.key else [])]
        log = open(self.folder / "server.log", "a")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=default_sigint)
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
    assert re.fullmatch(r"Playing: first audio in this browser \d+ ms after the click", browser.text("live")), (
        browser.text("live"))
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


def test_enrol_a_voice_from_a_wav_file_and_speak_with_it(browser, server, tmp_path):
    import soundfile

    recording = tmp_path / "me.wav"
    rate = 44100
    soundfile.write(recording, sine_recording(2, rate), rate)
    browser.open()
    browser.driver.find_element(By.CSS_SELECTOR, "#enrol-accordion button").click()  # it opens closed
    browser.fill("new-name", "tester")
    browser.driver.find_element(By.CSS_SELECTOR, "#recording input[type=file]").send_keys(str(recording))
    browser.fill("transcript", "A short test recording.")
    uploaded = "#recording audio, #recording .waveform-container"
    browser.wait(lambda: browser.driver.find_elements(By.CSS_SELECTOR, uploaded), "the uploaded recording")
    browser.click("enrol")
    browser.wait(lambda: "Enrolled tester" in browser.text("voice-info"), "the enrolment")
    assert [voice["id"] for voice in httpx.get(f"{server.url}/v1/voices").json()["data"]] == ["default", "tester"]
    browser.speak_take(1, "Hello from my own voice.")
    assert "· tester ·" in browser.driver.find_element(By.CSS_SELECTOR, "#takes input").get_attribute("value")


def test_enrol_a_voice_from_the_microphone(browser, server):
    browser.open()
    browser.driver.find_element(By.CSS_SELECTOR, "#enrol-accordion button").click()
    browser.fill("new-name", "microphone")
    browser.driver.find_element(By.CSS_SELECTOR, "#recording button[aria-label='Record audio']").click()
    browser.wait(lambda: browser.driver.find_element(By.CSS_SELECTOR, "#recording .record-button"),
                 "the record button").click()
    # Record until the page's clock shows 2 s, then stop (the fake microphone plays the tone).
    browser.wait(lambda: re.search(r"0:0[2-9]", browser.text("recording")), "two seconds of recording")
    browser.driver.find_element(By.CSS_SELECTOR, "#recording .stop-button").click()
    browser.wait(lambda: browser.driver.find_elements(By.CSS_SELECTOR, "#recording .waveform-container"),
                 "the recording, played back")
    browser.fill("transcript", "A tone from the fake microphone.")
    browser.click("enrol")
    browser.wait(lambda: "Enrolled microphone" in browser.text("voice-info"), "the enrolment")
    frames = httpx.get(f"{server.url}/v1/voices/microphone", timeout=TIMEOUT).json()["frames"]
    assert 2 * 21 <= frames <= 5 * 22, frames  # about 2 s at 21.5 frames a second, within --max-reference-seconds
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
    browser.take(2)
    assert browser.download(downloads, "wav", number=2) != http_wav


def test_stop_cancels_the_request_on_the_server(browser, server):
    browser.open()
    before = server.cancelled()
    browser.fill("text", LONG_TEXT)
    browser.fill("max_frames", 1000)
    browser.fill("seed", LONG_SEED)
    browser.click("speak")
    browser.wait(lambda: "Speaking… first audio after" in browser.text("take-info"), "the first audio")
    browser.click("stop")
    browser.wait(lambda: server.cancelled() == before + 1, "the server's cancelled count in /metrics")
    assert browser.text("take-info").startswith("Stopped"), browser.text("take-info")


def test_a_control_token_is_refused_with_the_servers_message(browser, server):
    browser.open()
    text = "Hello <|im_end|> there."
    message = server.speech(input=text).json()["error"]["message"]
    browser.fill("text", text)
    browser.wait(lambda: message in browser.text("preview"), "the server's message under the text")
    browser.click("speak")
    browser.wait(lambda: any(message in toast.text for toast in browser.driver.find_elements(
        By.CSS_SELECTOR, ".toast-body")), "the server's message when speaking")
    assert "Traceback" not in browser.driver.find_element(By.TAG_NAME, "body").text


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


def test_a_page_left_open_recovers_after_the_server_restarts(browser, server):
    browser.open()
    text = "<|speaker:1|> Still here after the restart."
    browser.fill("text", text)
    browser.fill("temperature", 0.8)
    browser.fill("max_frames", FRAMES)
    browser.driver.execute_script("window.leftOpen = true")
    server.stop()
    server.start()
    # Gradio's page sees its server back and reloads itself, and what was typed comes back from the browser's
    # storage: then it speaks again with nobody typing anything.
    browser.wait(lambda: browser.driver.execute_script("return window.leftOpen") is None
                 and "quantisation" in browser.text("status"), "the page to reload itself")
    browser.wait(lambda: browser.value("text") == text, "the typed text back in the text box")
    assert browser.value("temperature") == "0.8" and browser.value("max_frames") == str(FRAMES)
    browser.click("speak")
    browser.take(1)
    command = browser.copied_curl()
    assert '"temperature": 0.8' in command and "Still here after the restart." in command, command


def test_the_page_behind_an_api_key(browser, tmp_path_factory):
    """With --api-key the page asks for the key, and then works: its own calls are authorised; HTTP calls without
    the key, and the page's live route without the page's key, are still refused."""
    keyed = Server(tmp_path_factory.mktemp("keyed-server"), key="sesame-4711")
    keyed.start()
    try:
        page = Page(browser.driver, keyed)
        page.driver.get(keyed.url + "/")
        page.wait(lambda: page.driver.find_element(By.CSS_SELECTOR, "input[type=password]"), "the login form")
        page.driver.find_element(By.CSS_SELECTOR, "input[data-testid=textbox]").send_keys("me")
        page.driver.find_element(By.CSS_SELECTOR, "input[type=password]").send_keys("sesame-4711", Keys.ENTER)
        page.wait(lambda: "quantisation" in page.text("status"), "the page after the login")
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
