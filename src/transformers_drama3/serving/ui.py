"""The playground page of `drama3-serve --ui`: a Gradio Blocks app mounted at `/ui` on the server's FastAPI app.

    drama3-serve --tiny --ui          # then open http://127.0.0.1:8000/ (it links to /ui)

`build_page(app)` lays the page out and wires it to a `Playground` (ui_takes.py: the server's own functions, no
HTTP call to itself); `mount_page(app)` mounts it and links it from `/`. examples/space_app.py runs the same page as
a Hugging Face Space. Imported only with `--ui`: a server without it never loads Gradio.

Offline: Gradio 6 serves its scripts and its theme's fonts itself, and its analytics are off here, so the page loads
nothing from outside the server (the browser tests check it). A take plays while it is made through the page's own
player (ui_player.py: the server's pcm played with the Web Audio API), not Gradio's streamed audio.
"""

from __future__ import annotations

import logging
import os
import secrets

import gradio as gr
import pydantic
from fastapi import Body, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from gradio.routes import App

from .draining import DrainingServer
from ..audio_io import AudioEncoder
from .app import ready_service
from .errors import APIError
from .ui_code import curl_command, openai_code, synthesize_code
from .ui_player import PAGE_JS, STOP_JS, TOKEN, page_take_model, player_js
from .ui_takes import MAX_TAKES, Playground, Speaking

logger = logging.getLogger("transformers_drama3.serving")

PATH = "/ui"
SPEAKERS = [str(n) for n in range(16)]
STATUS_SECONDS = 2.0  # how often the status line is read
# The page's settings, each a field of the speech request, in the order of its inputs (PLAYER_JS reads them so).
SETTINGS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "ras_window", "ras_temperature", "ras_top_k",
            "ras_top_p", "codebook_temperature", "codebook_top_k", "codebook_top_p")
PAGE_TAKE = page_take_model(SETTINGS)  # the body of the live route (ui_player.py)
PAGE_SEED_BITS = 32  # the page's own random seeds: exact in a browser's numbers (2**53), short to copy
EXAMPLE = "<|speaker:0|> Did you buy the bread? <|speaker:1|> Of course I did."


def api_error(error: Exception) -> APIError:
    """A failure of the page as the server's `APIError` (its message is what an HTTP client reads)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, pydantic.ValidationError):
        first = error.errors()[0]
        return APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}", code="invalid_value")
    logger.exception("the page failed")
    return APIError(500, "something went wrong on the server; its log has the details", code="server_error")


def user_error(error: Exception) -> gr.Error:
    """A failure as the page shows it: the server's own message, never a traceback."""
    return gr.Error(api_error(error).message, print_exception=False)


def base_url(request: gr.Request) -> str:
    """Where the page's user reaches this server (for copied code)."""
    scheme = request.headers.get("x-forwarded-proto") or request.request.url.scheme
    return f"{scheme}://{request.headers['host']}"


def build_page(app, playground: Playground | None = None) -> gr.Blocks:
    """The playground's Blocks, on the server `app` (made by `create_app`)."""
    playground = playground or Playground(app)
    settings = app.state.settings
    defaults = playground.defaults()

    with gr.Blocks(title="Drama 3 playground", analytics_enabled=False) as page:
        history = gr.State([])  # the page's takes, newest last
        # What was typed and set, kept in the browser (localStorage) as it changes, so that a reload (the page reloads
        # itself when its server restarts) brings it back. The key only needs to be the same after a restart: the
        # text is the user's own, in their own browser.
        typed = gr.BrowserState(None, storage_key="drama3-playground", secret=playground.page_key or "drama3")
        gr.Markdown("## Drama 3 playground\nSpeak text, clone a voice, and copy the request as code. "
                    "[API docs](../docs) · [metrics](../metrics)")
        status = gr.Markdown("Reading the server's status…", elem_id="status")
        with gr.Row():
            with gr.Column(scale=3):
                text = gr.Textbox(EXAMPLE, label="Text (<|speaker:N|> switches speakers)", lines=4, elem_id="text")
                with gr.Row():
                    speaker = gr.Dropdown(SPEAKERS, value="0", label="Speaker", scale=1, min_width=80,
                                          elem_id="speaker")
                    line = gr.Textbox(label="Line", placeholder="What the speaker says", scale=4, elem_id="line")
                    add_line = gr.Button("Add line", scale=1, elem_id="add-line")
                preview = gr.Markdown(elem_id="preview")
                with gr.Row():
                    speak = gr.Button("Speak", variant="primary", elem_id="speak")
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
                # The live player's line (ui_player.py); its script makes the player's AudioContext, and keeps the time
                # of each click on Speak.
                gr.HTML('<div id="live-line"></div>', elem_id="live", js_on_load=PAGE_JS)
                page_key = gr.Textbox(visible=False)  # the live route's key, filled when the page loads
                live_token = gr.Textbox(visible=False)  # the take's token, drawn by PLAYER_JS
                player = gr.Audio(label="Speech (the take, once complete)", interactive=False, elem_id="player")
                take_info = gr.Markdown(elem_id="take-info")
            with gr.Column(scale=2):
                with gr.Accordion("Voice", open=True):
                    voice = gr.Dropdown(playground.voice_names(), value="default", label="Voice", elem_id="voice",
                                        allow_custom_value=False)
                    with gr.Row():
                        refresh = gr.Button("Refresh", size="sm")
                        delete = gr.Button("Delete this voice", size="sm", variant="stop", elem_id="delete")
                    with gr.Row(visible=False) as confirm_row:
                        confirm_text = gr.Markdown()
                        confirm = gr.Button("Yes, delete it", size="sm", variant="stop", elem_id="confirm-delete")
                        keep = gr.Button("Cancel", size="sm")
                    with gr.Accordion("Enrol a new voice", open=False, elem_id="enrol-accordion"):
                        new_name = gr.Textbox(label="Name", placeholder="letters, digits, _ or -", elem_id="new-name")
                        recording = gr.Audio(sources=["upload", "microphone"], type="filepath",
                                             label=f"Recording (10-30 s works best; at most "
                                             f"{settings.max_reference_seconds:g} s)", elem_id="recording")
                        transcript = gr.Textbox(label="Transcript: what is said in the recording",
                                                elem_id="transcript")
                        enrol = gr.Button("Enrol", elem_id="enrol")
                    voice_info = gr.Markdown(elem_id="voice-info")
                with gr.Accordion("Settings", open=True):
                    temperature = gr.Slider(0, 2, defaults["temperature"], step=0.05,
                                            label="temperature (0: greedy)", elem_id="temperature")
                    top_p = gr.Slider(0.01, 1, defaults["top_p"], step=0.01, label="top_p", elem_id="top_p")
                    top_k = gr.Number(defaults["top_k"], precision=0, minimum=0, label="top_k (0: no limit)",
                                      elem_id="top_k")
                    seed = gr.Number(None, precision=0, minimum=0, label="seed (empty: a new one each take)",
                                     elem_id="seed")
                    max_frames = gr.Number(defaults["max_new_tokens"], precision=0, minimum=1,
                                           maximum=settings.max_frames,
                                           label="max frames per text chunk (21.5 frames = 1 s)", elem_id="max_frames")
                    with gr.Accordion("Repetition-aware sampling and codebooks", open=False,
                                      elem_id="more-accordion"):
                        ras_window = gr.Number(defaults["ras_window"], precision=0, minimum=0,
                                               label="ras_window: frames looked back over (0: off)", elem_id="ras_window")
                        ras_temperature = gr.Slider(0.05, 2, defaults["ras_temperature"], step=0.05,
                                                    label="ras_temperature", elem_id="ras_temperature")
                        ras_top_k = gr.Number(defaults["ras_top_k"], precision=0, minimum=0,
                                              label="ras_top_k (0: no limit)", elem_id="ras_top_k")
                        ras_top_p = gr.Slider(0.01, 1, defaults["ras_top_p"], step=0.01, label="ras_top_p",
                                              elem_id="ras_top_p")
                        codebook_temperature = gr.Slider(0.05, 2, defaults["codebook_temperature"], step=0.05,
                                                         label="codebook_temperature", elem_id="codebook_temperature")
                        codebook_top_k = gr.Number(defaults["codebook_top_k"], precision=0, minimum=0,
                                                   label="codebook_top_k (0: no limit)", elem_id="codebook_top_k")
                        codebook_top_p = gr.Slider(0.01, 1, defaults["codebook_top_p"], step=0.01,
                                                   label="codebook_top_p", elem_id="codebook_top_p")
                    reset = gr.Button("Reset to the model's defaults", size="sm", elem_id="reset")
        with gr.Accordion("History of takes", open=True):
            takes = gr.Dropdown([], label="Take", elem_id="takes")
            take_audio = gr.Audio(label="Take", interactive=False, elem_id="take-audio")
            with gr.Row():
                downloads = [gr.DownloadButton(f"Download {name}", visible=False, size="sm", elem_id=f"download-{name}")
                             for name in ("wav", "mp3", "flac")]
                reuse = gr.Button("Use these settings again", size="sm", elem_id="reuse")
            take_fields = gr.JSON(label="Request", elem_id="take-fields")
        with gr.Accordion("Copy as code (reproduces the selected take)", open=True):
            with gr.Tab("curl"):
                curl = gr.Code(language="shell", elem_id="code-curl", interactive=False)
            with gr.Tab("OpenAI SDK"):
                openai_sdk = gr.Code(language="python", elem_id="code-openai", interactive=False)
            with gr.Tab("Python (synthesize)"):
                python = gr.Code(language="python", elem_id="code-python", interactive=False)
        timer = gr.Timer(STATUS_SECONDS)
        setting_inputs = [temperature, top_p, top_k, seed, max_frames, ras_window, ras_temperature, ras_top_k,
                          ras_top_p, codebook_temperature, codebook_top_k, codebook_top_p]  # SETTINGS' order

        def read_status() -> str:
            state = playground.status()
            if state["state"] != "ready":
                detail = f": {state['error']}" if state.get("error") else " (the page works once it is ready)"
                return f"**{state['model']}** · {state['state']}{detail}"
            return (f"**{state['model']}** · {state['device']} · {state['dtype']} · quantisation "
                    f"{state['quantization']} · queue {state['queued']} · running {state['running']} · batch "
                    f"{state['occupancy']}")

        def show_defaults():
            values = {**playground.defaults(), "seed": None}
            return tuple(values[name] for name in SETTINGS)

        def restore(saved):
            """The page's text, voice and settings as this browser left them (else the example and the defaults)."""
            values = [EXAMPLE, "default", *show_defaults()]
            if isinstance(saved, list) and len(saved) == len(values):
                values = saved
            values[1] = voice_choices(values[1])  # the voices saved now (a saved voice may be gone)
            return values

        def show_preview(value: str) -> str:
            try:
                chunks = playground.preview(value)
            except APIError as error:
                return f"⚠️ {error.message}"
            return f"The server will speak {len(chunks)} chunk(s): " + " ⏵ ".join(f"`{c}`" for c in chunks)

        def append_line(current: str, number: str, words: str):
            if not words.strip():
                raise gr.Error("write the line first", print_exception=False)
            joined = f"{current.rstrip()} <|speaker:{number}|> {words.strip()}".strip()
            return joined, ""

        def voice_choices(selected: str = "default"):
            names = playground.voice_names()
            return gr.update(choices=names, value=selected if selected in names else "default")

        async def enrol_voice(name: str, audio_path: str | None, words: str):
            try:
                saved = await playground.enrol(name, words, audio_path)
            except Exception as error:  # noqa: BLE001  (shown on the page)
                raise user_error(error) from None
            return voice_choices(saved), f"Enrolled **{saved}**: pick it above and speak.", "", None, ""

        def ask_delete(name: str):
            if name == "default":
                raise gr.Error("'default' is no saved voice: there is nothing to delete", print_exception=False)
            return gr.update(visible=True), f"Delete **{name}** for everyone using this server?"

        async def delete_voice(name: str):
            try:
                await playground.delete(name)
            except Exception as error:  # noqa: BLE001
                raise user_error(error) from None
            return voice_choices(), gr.update(visible=False), f"Deleted **{name}**."

        def take_view(chosen, takes_so_far, request: gr.Request):
            take = next((t for t in takes_so_far if t.label == chosen), None)
            if take is None:
                return (None, *[gr.update(visible=False)] * 3, None, "", "", "")
            url = base_url(request)
            buttons = [gr.update(value=str(take.files[name]), visible=True) if name in take.files else
                       gr.update(visible=False) for name in ("wav", "mp3", "flac")]
            return (str(take.files["wav"]), *buttons, take.fields,
                    curl_command(url, take.fields, settings.api_key is not None),
                    openai_code(url, take.fields, settings.api_key is not None),
                    synthesize_code(str(settings.model), take.fields,
                                    None if settings.voices_dir is None else str(settings.voices_dir),
                                    settings.chunk_bytes))

        def reuse_settings(chosen, takes_so_far):
            take = next((t for t in takes_so_far if t.label == chosen), None)
            if take is None:
                raise gr.Error("pick a take first", print_exception=False)
            values = {**playground.defaults(), **take.fields}  # a setting left out of the request had its default
            return (take.fields["input"], take.fields["voice"], *(values[name] for name in SETTINGS))

        async def speak_take(*inputs):
            """Wait for the take the click's PLAYER_JS is speaking through the live route, then keep it."""
            token, takes_so_far = inputs[-2], inputs[-1]
            if not TOKEN.fullmatch(token or ""):
                raise gr.Error("the page's player did not start (is JavaScript off?): reload the page",
                               print_exception=False)
            live = playground.live.take(token)
            try:
                await live.started.wait()
                if live.speaking is not None and not live.ended.done():
                    yield {take_info: f"Speaking… first audio after {live.speaking.first_audio_s * 1000:.0f} ms"}
                fields, speaking = await live.ended
                take = await playground.keep(takes_so_far[-1].number + 1 if takes_so_far else 1, fields, speaking)
            except APIError as error:
                if error.code != "cancelled":
                    raise user_error(error) from None
                yield {take_info: stopped()}  # Stop before the first audio: the page's event came after it
                return
            except Exception as error:  # noqa: BLE001  (shown on the page; Stop's cancellation is no Exception)
                raise user_error(error) from None
            finally:
                playground.live.forget(token)
            kept = [*takes_so_far, take]
            for old in kept[:-MAX_TAKES]:
                playground.forget(old)
            kept = kept[-MAX_TAKES:]
            yield {take_info: take.summary(), history: kept, player: str(take.files["wav"]),
                   takes: gr.update(choices=[t.label for t in reversed(kept)], value=take.label)}

        def stopped() -> str:
            return "Stopped: the server cancelled the request."

        page.load(restore, typed, [text, voice, *setting_inputs]).then(show_preview, text, preview)
        timer.tick(read_status, outputs=status)
        page.load(read_status, outputs=status)
        page.load(lambda: playground.page_key, outputs=page_key)
        text.change(show_preview, text, preview, show_progress="hidden")
        add_line.click(append_line, [text, speaker, line], [text, line])
        refresh.click(voice_choices, voice, voice)
        enrol.click(enrol_voice, [new_name, recording, transcript],
                    [voice, voice_info, new_name, recording, transcript])
        delete.click(ask_delete, voice, [confirm_row, confirm_text])
        keep.click(lambda: gr.update(visible=False), outputs=confirm_row)
        confirm.click(delete_voice, voice, [voice, confirm_row, voice_info])
        reset.click(show_defaults, outputs=setting_inputs)
        gr.on([box.change for box in [text, voice, *setting_inputs]], None, [text, voice, *setting_inputs], typed,
              js="(...values) => [values]")  # in the browser only: no call to the server
        speaking = speak.click(speak_take, [text, voice, *setting_inputs, page_key, live_token, history],
                               [player, take_info, history, takes], concurrency_limit=None, js=player_js(SETTINGS),
                               show_progress="hidden")  # the page's own line says how far it got
        stop.click(stopped, outputs=take_info, cancels=[speaking], js=STOP_JS)
        takes.change(take_view, [takes, history], [take_audio, *downloads, take_fields, curl, openai_sdk, python])
        reuse.click(reuse_settings, [takes, history], [text, voice, *setting_inputs])
    return page


def mount_page(app, path: str = PATH):
    """Mount the playground on the server's FastAPI `app` at `path` and link it from `/`; returns the app. With an
    API key, the page asks for it (as the password; any user name)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    settings = app.state.settings
    playground = Playground(app)
    key = settings.api_key

    def knows_key(username: str, password: str) -> bool:
        return secrets.compare_digest(password.encode(), key.encode())

    @app.get("/", include_in_schema=False)
    async def home() -> HTMLResponse:
        return HTMLResponse(f'<!doctype html><meta http-equiv="refresh" content="0; url={path}/">'
                            f'<title>Drama 3</title><a href="{path}/">Drama 3 playground</a>')

    @app.post(f"{path}/live/{{token}}", include_in_schema=False)
    async def live_take(token: str, request: Request, inputs: dict = Body(...)) -> StreamingResponse:
        """Speak the page's take `token` (ui_player.py): its pcm as it is decoded, or the server's error."""
        if not TOKEN.fullmatch(token):
            raise APIError(404, "no such take: the page draws its takes' tokens itself", code="not_found")
        given = request.headers.get("x-page-key", "")
        if playground.page_key and not secrets.compare_digest(given.encode(), playground.page_key.encode()):
            raise APIError(401, "this page has no valid key: reload it and log in", code="invalid_api_key")
        live, speaking = playground.live.take(token), Speaking()
        try:
            body = PAGE_TAKE.model_validate(inputs)
            values = {name: getattr(body, name) for name in SETTINGS}
            if values["seed"] is None:
                values["seed"] = secrets.randbits(PAGE_SEED_BITS)
            fields = playground.request_fields(body.text, body.voice, values)
            rate = ready_service(app).model.config.sampling_rate
            chunks = playground.speak(fields, speaking)
            first = await anext(chunks, None)  # None: a take that ended without audio
        except Exception as error:  # noqa: BLE001  (the page's event shows it; the browser gets it as JSON)
            live.end(error=api_error(error))
            raise live.ended.exception() from None
        if first is not None:
            live.first_audio(speaking)

        async def pcm():
            encoder = AudioEncoder("pcm", rate, streamed=True)  # the HTTP API's pcm
            try:
                if first is not None:
                    yield encoder.encode(first)
                async for chunk in chunks:
                    yield encoder.encode(chunk)
                yield encoder.finish()
                live.end((fields, speaking))
            except Exception as error:  # noqa: BLE001  (after the first audio: the stream breaks off)
                live.end(error=api_error(error))
                raise
            finally:
                live.end(error=APIError(499, "the page stopped listening", code="cancelled"))
                await chunks.aclose()

        return StreamingResponse(pcm(), media_type="audio/pcm",
                                 headers={"X-Sampling-Rate": str(rate), "Cache-Control": "no-store"})

    app.state.page = build_page(app, playground)
    return gr.mount_gradio_app(app, app.state.page, path=path,
                               auth=knows_key if key is not None else None,
                               allowed_paths=[str(playground.takes_dir)], footer_links=["api"],
                               max_file_size=settings.max_body_bytes)


class PageServer(DrainingServer):
    """`DrainingServer` for an app with the page: its shutdown first closes the page, which ends the streams an open
    page holds (Gradio's heartbeat and queue streams never end on their own, and uvicorn waits for every
    connection to close)."""

    def __init__(self, config, drain_seconds: float):
        super().__init__(config, drain_seconds)
        self.page = config.app.state.page
        self.page_app = next(route.app for route in config.app.routes if isinstance(getattr(route, "app", None), App))

    async def shutdown(self, sockets=None) -> None:
        self.page.close(verbose=False)  # ends the queue streams (within their 10 s poll)
        self.page_app.stop_event.set()  # ends the heartbeats of the app that serves the page
        await super().shutdown(sockets)
