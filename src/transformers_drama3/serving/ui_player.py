"""The playground's live player: a take's audio played in the browser while the server makes it.

Gradio's own streamed `Audio` plays about 1.5 s late (it serves AAC segments that its player polls), so the page plays
the take itself. When Speak is clicked, `PLAYER_JS` (run by the click before the request goes to the server) draws a
random token, starts `GET /ui/live/TOKEN` and hands the token to the page's speak function with the other inputs. The
speak function puts each decoded chunk of the take into `LiveTakes` under that token, and the live route sends them
as they come: 16-bit little-endian pcm at the model's rate (`X-Sampling-Rate`), the bytes of the HTTP API's `pcm`
(the same `AudioEncoder`). The browser schedules every chunk with the Web Audio API right behind the one before, and
measures the time from the click to the first chunk scheduled: the page shows it, and keeps its figures in
`window.drama3Live` (benchmarks/serve_ui.py and the browser tests read them).

The token is the only key to a take's stream: 128 random bits drawn by the page that spoke it, never shown.
"""

from __future__ import annotations

import asyncio
import re

from ..audio_io import AudioEncoder

TOKEN = re.compile(r"[0-9a-f]{32}")  # what PLAYER_JS draws: 16 random bytes in hex
LIVE_WAIT_SECONDS = 120.0  # the longest a listener waits for the next chunk (a take's start waits in the queue too)
MAX_LIVE = 64  # takes kept for a listener; the oldest go first (a page whose listener never came)

# Run by Speak's click in the browser before the request (Gradio's `js=`): its arguments are the click's input values,
# the last one the token's hidden box; it returns them with the token in that box. `drama3Player` is made once.
PLAYER_JS = r"""
(...inputs) => {
  const player = window.drama3Player ??= {
    context: null, controller: null,
    stop() {
      this.controller?.abort();
      this.context?.close();
      this.controller = this.context = null;
    },
    show(text) {
      const line = document.querySelector('#live-line');
      if (line) line.textContent = text;
    },
    async play(url, clicked) {
      this.stop();
      const controller = this.controller = new AbortController();
      const context = this.context = new AudioContext();
      const live = window.drama3Live = {first_audio_ms: null, chunks: 0, samples: 0, done: false, error: null};
      this.show('Waiting for the first audio…');
      try {
        const response = await fetch(url, {signal: controller.signal, cache: 'no-store'});
        if (!response.ok) throw new Error(`the live stream answered ${response.status}`);
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
          live.chunks += 1;
          live.samples += samples.length;
          if (live.first_audio_ms === null) {
            live.first_audio_ms = performance.now() - clicked;
            this.show(`Playing: first audio in this browser ${Math.round(live.first_audio_ms)} ms after the click`);
          }
        }
        live.done = true;
      } catch (error) {
        if (error.name !== 'AbortError') {
          live.error = String(error);
          this.show('The live player stopped: the take still plays below once it is complete');
        }
      }
    },
  };
  const clicked = performance.now();
  const token = Array.from(crypto.getRandomValues(new Uint8Array(16)), b => b.toString(16).padStart(2, '0')).join('');
  const root = (window.gradio_config?.root || location.href).replace(/\/+$/, '');
  player.play(new URL(root + '/live/' + token, location.href), clicked);
  inputs[inputs.length - 1] = token;
  return inputs;
}
"""

STOP_JS = "() => { window.drama3Player?.stop(); }"


class LiveTakes:
    """The chunks of the takes being spoken, by token, for the live route; `None` ends a take."""

    def __init__(self):
        self.queues: dict[str, asyncio.Queue] = {}

    def queue(self, token: str) -> asyncio.Queue:
        """The take's queue, made by whichever comes first: the speak function or the listener."""
        if token not in self.queues:
            while len(self.queues) >= MAX_LIVE:
                del self.queues[next(iter(self.queues))]
            self.queues[token] = asyncio.Queue()
        return self.queues[token]

    def put(self, token: str | None, chunk) -> None:
        """Add a float32 chunk `[samples]` (nothing without a token: a caller of the page's API without the player)."""
        if token:
            self.queue(token).put_nowait(chunk)

    def finish(self, token: str | None) -> None:
        """The take ended (finished, failed or stopped): its listener's stream ends."""
        if token:
            self.queue(token).put_nowait(None)

    async def pcm(self, token: str, sampling_rate: int):
        """The take's audio as pcm bytes, as it comes; ends with the take, or after `LIVE_WAIT_SECONDS` of silence."""
        queue = self.queue(token)
        encoder = AudioEncoder("pcm", sampling_rate, streamed=True)  # the encoder of the HTTP API's pcm
        try:
            while (chunk := await asyncio.wait_for(queue.get(), LIVE_WAIT_SECONDS)) is not None:
                data = encoder.encode(chunk)
                if data:
                    yield data
            yield encoder.finish()
        except TimeoutError:
            return
        finally:
            if self.queues.get(token) is queue:
                del self.queues[token]
