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

# Run by Speak's click in the browser before Gradio sends the event (Gradio's `js=`). Its arguments are the click's
# inputs in ui.py's order: the text, the voice, the settings (named in SETTINGS_NAMES), the page key and the token's
# hidden box; it returns them with the token in its box once the take's first chunk is scheduled (or the take ended
# without audio). `drama3Player` is made once per page.
PLAYER_JS = r"""
async (...inputs) => {
  const names = SETTINGS_NAMES;
  const player = window.drama3Player ??= {
    controller: null, sources: [],
    stop() {
      this.controller?.abort();
      this.sources.forEach(source => source.stop());
      this.controller = null;
      this.sources = [];
    },
    show(text) {
      const line = document.querySelector('#live-line');
      if (line) line.textContent = text;
    },
    async play(url, body, pageKey, clicked, answered) {
      this.stop();
      const controller = this.controller = new AbortController();
      const context = window.drama3Audio;  // made by PAGE_JS when the page loaded
      context.resume();  // within the click's user activation: the browser lets it play
      const live = window.drama3Live = {first_audio_ms: null, chunks: 0, samples: 0, done: false, error: null,
                                        audio_state: null};
      this.show('Waiting for the first audio…');
      try {
        const response = await fetch(url, {method: 'POST', body: JSON.stringify(body), signal: controller.signal,
                                           headers: {'Content-Type': 'application/json', 'X-Page-Key': pageKey}});
        if (!response.ok) {  // the page's own event shows the server's message
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
            this.show(`Playing: first audio in this browser ${Math.round(live.first_audio_ms)} ms after the click`);
            answered();
          }
        }
        live.done = true;
        const last = this.sources[this.sources.length - 1];
        if (last) last.onended = () => { if (this.controller === controller) context.suspend(); };  // idle: no CPU
      } catch (error) {
        if (error.name !== 'AbortError') {
          live.error = String(error);
          this.show('The live player stopped: the take plays below once it is complete');
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
  // Gradio sends the page's event once the first chunk is scheduled (or the take ended without audio), so that the
  // event's work in the browser and on the server does not delay the first audio.
  await new Promise(answered => player.play(new URL(root + '/live/' + token, location.href), body,
                                            inputs[2 + names.length] || '', clicked, answered));
  inputs[3 + names.length] = token;
  return inputs;
}
"""

STOP_JS = "() => { window.drama3Player?.stop(); }"

# Run once the page has loaded (the live line's `js_on_load`). It makes the page's one AudioContext now: making it
# took about 50 ms of the first take's time to first audio (Chromium, our 2-CPU machine). It stays suspended, which
# costs nothing, until a click on Speak resumes it (browsers let a page play after a click). And it keeps the time of
# each click on Speak, taken by the browser when the click happened: Gradio runs PLAYER_JS some 10 ms after the click,
# and the time to first audio the page shows runs from the click itself.
PAGE_JS = """
if (!window.drama3Audio) {
  window.drama3Audio = new AudioContext();
  window.drama3Audio.suspend();  // however the browser's autoplay rules are set
  window.addEventListener('click', event => {
    if (event.target.closest?.('#speak')) window.drama3Clicked = event.timeStamp;
  }, true);
}
"""


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
