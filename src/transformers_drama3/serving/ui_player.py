"""The playground's live player: a take's audio played in the browser while the server makes it.

Gradio's own streamed `Audio` plays about 1.5 s late (it serves AAC segments that its player polls), and an event
through Gradio's queue reaches the server some tens of milliseconds after the click. So the page speaks a take the
way an HTTP client does. A click on Speak runs `PLAYER_JS` in the browser first: it draws a random token and sends
the page's text, voice and settings to `POST /ui/live/TOKEN` itself. That route checks them as
`POST /v1/audio/speech` does, queues the request and answers with its audio as it is decoded: 16-bit little-endian
pcm at the model's rate (`X-Sampling-Rate`), made by the HTTP API's `pcm` encoder. The browser schedules each chunk
with the Web Audio API right behind the one before, and measures the time from the click (the browser's time of the
click event, kept by `PAGE_JS`) to the first chunk scheduled: the page shows it, and keeps its figures in
`window.drama3Live` (read by benchmarks/serve_ui.py and the browser tests). Gradio's own event (the page's speak
function, given the token) is sent once the first chunk is scheduled, so that its work does not delay the first audio;
it waits for that take under its token (`LiveTakes`) and keeps it in the page's history when it ends, or shows its
error.

With `--api-key` the route needs the page key (`X-Page-Key`): a random key of this server that only a page which
passed the login receives (its load event fills a hidden box with it).
"""

from __future__ import annotations

import asyncio
import json
import re

from pydantic import BaseModel, ConfigDict, create_model

from .schemas import SpeechRequest

TOKEN = re.compile(r"[0-9a-f]{32}")  # what PLAYER_JS draws: 16 random bytes in hex
MAX_LIVE = 64  # takes kept for the page's speak functions; the oldest go first

# Speak's click, in the browser only (a Gradio event with `js=` and no function). Its arguments are the click's inputs
# in ui.py's order: the text, the voice, the settings (named in SETTINGS_NAMES) and the page key. Once the take's
# first chunk is scheduled (or the take ended without audio) it returns the take's token, for the token's hidden box,
# and Gradio then sends the page's speak function that box alone: the live route has checked the text, voice and
# settings (they are the take's request), and Gradio does not check them again in its own words.
# Speak stays disabled until the take is over (`SPEAK_DONE_JS`, Stop) and the live line says how far the take got;
# Stop and an error clear it. `drama3Player` is made once per page.
PLAYER_JS = r"""
async (...inputs) => {
  const names = SETTINGS_NAMES;
  const player = window.drama3Player ??= {
    controller: null, sources: [], running: false,
    stop() {
      this.controller?.abort();
      this.sources.forEach(source => source.stop());
      this.controller = null;
      this.sources = [];
      this.show('');
      this.busy(false);
    },
    show(text) {
      const line = document.querySelector('#live-line');
      if (line) line.textContent = text;
    },
    busy(running) {  // Speak is disabled while a take runs
      this.running = running;
      const speak = document.querySelector('#speak');
      if (!speak) return;
      speak.disabled = running;
      speak.classList.toggle('drama3-busy', running);
    },
    async play(url, body, pageKey, clicked, answered) {
      this.stop();
      this.busy(true);
      const controller = this.controller = new AbortController();
      const context = window.drama3Audio;  // made by PAGE_JS when the page loaded
      context.resume();  // within the click's user activation: the browser lets it play
      const live = window.drama3Live = {first_audio_ms: null, chunks: 0, samples: 0, done: false, error: null,
                                        audio_state: null};
      this.show('Waiting for the first audio…');
      try {
        const response = await fetch(url, {method: 'POST', body: JSON.stringify(body), signal: controller.signal,
                                           headers: {'Content-Type': 'application/json', 'X-Page-Key': pageKey}});
        if (!response.ok) {  // the page's own event shows the server's message, beside the field it names
          live.error = `${response.status}: ${(await response.json()).error?.message}`;
          this.show('');
          return;
        }
        const rate = Number(response.headers.get('X-Sampling-Rate'));
        const reader = response.body.getReader();
        let carried = new Uint8Array(0), next = 0;
        for (;;) {
          const {value, done} = await reader.read();
          if (done) break;
          const bytes = new Uint8Array(carried.length + value.length);  // a sample may straddle two reads
          bytes.set(carried);
          bytes.set(value, carried.length);
          const whole = bytes.length - bytes.length % 2;
          carried = bytes.slice(whole);
          if (!whole) continue;
          const view = new DataView(bytes.buffer, 0, whole), samples = new Float32Array(whole / 2);
          for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
          const buffer = context.createBuffer(1, samples.length, rate);
          buffer.copyToChannel(samples, 0);
          const source = context.createBufferSource();
          source.buffer = buffer;
          source.connect(context.destination);
          next = Math.max(next, context.currentTime);  // right behind the chunk before, or now if it has ended
          source.start(next);
          next += buffer.duration;
          this.sources.push(source);
          live.chunks += 1;
          live.samples += samples.length;
          if (live.first_audio_ms === null) {
            live.first_audio_ms = performance.now() - clicked;
            live.audio_state = context.state;  // 'running' once resumed: the chunk is heard
            answered();
          }
          this.show(`Playing: first audio in this browser ${Math.round(live.first_audio_ms)} ms after the click · `
                    + `${(live.samples / rate).toFixed(1)} s of audio so far`);
        }
        live.done = true;
        if (live.chunks) {
          this.show(`Played: first audio in this browser ${Math.round(live.first_audio_ms)} ms after the click · `
                    + `${(live.samples / rate).toFixed(1)} s of audio`);
        }
        const last = this.sources[this.sources.length - 1];
        if (last) last.onended = () => { if (this.controller === controller) context.suspend(); };  // idle: no CPU
      } catch (error) {
        if (error.name !== 'AbortError') {  // the page's own event says what happened
          live.error = String(error);
          this.show('');
        }
      } finally {
        answered();
      }
    },
  };
  const clicked = window.drama3Clicked ?? performance.now();  // PAGE_JS's time of the click
  window.drama3Clicked = null;
  const body = {text: inputs[0], voice: inputs[1]};
  names.forEach((name, index) => { body[name] = inputs[2 + index]; });
  const token = Array.from(crypto.getRandomValues(new Uint8Array(16)), b => b.toString(16).padStart(2, '0')).join('');
  const root = (window.gradio_config?.root || location.href).replace(/\/+$/, '');
  // Gradio sends the page's speak function once the first chunk is scheduled (or the take ended without audio), so that
  // its work in the browser and on the server does not delay the first audio.
  await new Promise(answered => player.play(new URL(root + '/live/' + token, location.href), body,
                                            inputs[2 + names.length] || '', clicked, answered));
  return token;
}
"""

# Stop's click: the take ends in the browser at once; the page's stop function is told whether one was running (a
# Stop with no take running changes nothing on the page).
STOP_JS = ("() => { const running = Boolean(window.drama3Player?.running); window.drama3Player?.stop(); "
           "return [running]; }")
SPEAK_DONE_JS = "() => { window.drama3Player?.busy(false); }"  # after the page's speak function, whatever its end

# Run once the page has loaded (the live line's `js_on_load`). It makes the page's one AudioContext now: making it
# took about 50 ms of the first take's time to first audio (Chromium, our 2-CPU machine). It stays suspended, which
# costs nothing, until a click on Speak resumes it (browsers let a page play after a click). It keeps the time of
# each click on Speak, taken by the browser when the click happened: Gradio runs PLAYER_JS some 10 ms after the click,
# and the time to first audio the page shows runs from the click itself. And it asks the server's `/health` every
# STATUS_MS: while no answer comes, the server line says so in place of the status line (whose figures would be the
# last ones read), and in place of Gradio's own "Connection Lost" error (ui.py's CSS hides Gradio's messages while
# the server does not answer; the page asks at once when one appears), until the server answers again.
PAGE_JS = """
if (!window.drama3Audio) {
  window.drama3Audio = new AudioContext();
  window.drama3Audio.suspend();  // however the browser's autoplay rules are set
  window.addEventListener('click', event => {
    if (event.target.closest?.('#speak')) window.drama3Clicked = event.timeStamp;
  }, true);
  const health = new URL('../health', (window.gradio_config?.root || location.href).replace(/\\/*$/, '/'));
  let asking = false;
  const check = async () => {
    if (asking) return;
    asking = true;
    let answered = true;
    try {
      await fetch(health, {cache: 'no-store', signal: AbortSignal.timeout(STATUS_MS)});
    } catch (error) {
      answered = false;
    }
    asking = false;
    document.body.classList.toggle('drama3-unreachable', !answered);
    const line = document.querySelector('#server-line');
    if (line) line.textContent = answered ? '' : `The server (${location.host}) does not answer: the page tries again `
                                                 + `every ${STATUS_MS / 1000} s and carries on once it is back.`;
  };
  const watch = async () => {
    await check();
    setTimeout(watch, STATUS_MS);
  };
  watch();
  new MutationObserver(records => {  // a new message of Gradio's (its connection lost?): is the server there?
    if (records.some(record => [...record.addedNodes].some(node => node.nodeType === Node.ELEMENT_NODE
        && (node.matches('.toast-body') || node.querySelector('.toast-body'))))) check();
  }).observe(document.body, {childList: true, subtree: true});
}
"""


def page_js(status_seconds: float) -> str:
    """PAGE_JS for a page whose status is read every `status_seconds`."""
    return PAGE_JS.replace("STATUS_MS", str(round(status_seconds * 1000)))


def player_js(settings: tuple[str, ...]) -> str:
    """PLAYER_JS for a page whose settings inputs are `settings`, in order."""
    return PLAYER_JS.replace("SETTINGS_NAMES", json.dumps(list(settings)))


def page_take_model(settings: tuple[str, ...]) -> type[BaseModel]:
    """The model of `POST /ui/live/TOKEN`'s body for a page whose settings inputs are `settings`: the page's inputs as
    the browser holds them (None: left empty), each setting typed as the HTTP API's field of the same name (not
    strictly: the checks are the HTTP API's own, made on the request the take sends)."""
    fields = {name: (SpeechRequest.model_fields[name].annotation, None) for name in settings}
    return create_model("PageTake", __config__=ConfigDict(extra="forbid"), text=(str, ...), voice=(str | None, None),
                        **fields)


class LiveTake:
    """One take of the page, spoken by the live route and awaited by the page's speak function under its token."""

    def __init__(self):
        self.started = asyncio.Event()  # set with the first audio, or when the take ends without any
        self.ended = asyncio.get_running_loop().create_future()  # (request fields, Speaking), or the take's error
        self.speaking = None

    def first_audio(self, speaking) -> None:
        self.speaking = speaking
        self.started.set()

    def end(self, result=None, error: BaseException | None = None) -> None:
        if self.ended.done():
            return
        if error is not None:
            self.ended.set_exception(error)
            self.ended.exception()  # read once: a take whose page went away leaves no "never retrieved" warning
        else:
            self.ended.set_result(result)
        self.started.set()


class LiveTakes:
    """The page's takes in flight, by token: made by whichever comes first, the live route or the speak function."""

    def __init__(self):
        self.takes: dict[str, LiveTake] = {}

    def take(self, token: str) -> LiveTake:
        if token not in self.takes:
            while len(self.takes) >= MAX_LIVE:  # takes whose page never asked for them
                del self.takes[next(iter(self.takes))]
            self.takes[token] = LiveTake()
        return self.takes[token]

    def forget(self, token: str) -> None:
        self.takes.pop(token, None)
