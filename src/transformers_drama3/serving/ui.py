"""The playground page of `drama3-serve --ui`: a Gradio Blocks app mounted at `/ui` on the server's FastAPI app.

    drama3-serve --tiny --ui          # then open http://127.0.0.1:8000/ (it links to /ui)

`build_page(app)` lays the page out and wires it to a `Playground` (ui_takes.py: the server's own functions, no
HTTP call to itself); `mount_page(app)` mounts it, links it from `/` and serves the page's icon and manifest.
examples/space_app.py runs the same page as a Hugging Face Space. Imported only with `--ui`: a server without it
never loads Gradio.

Errors: the page raises no Gradio error (which would cover its outputs with "Error" pills, and log a traceback). A
take or an enrolment is checked by the server's own checks, and their message goes beside the field it names, in the
page's words (ui_fields.py). Gradio's own checks of the inputs never run on a take: the page's speak function gets
only the take's token (ui_player.py).

Offline: Gradio 6 serves its scripts and its theme's fonts itself, and its analytics are off here, so the page loads
nothing from outside the server (the browser tests check it); so does the API docs page (`/docs`, app.py). A take
plays while it is made through the page's own player (ui_player.py: the server's pcm played with the Web Audio API),
not Gradio's streamed audio.
"""

from __future__ import annotations

import logging
import os
import secrets
from contextlib import asynccontextmanager

import gradio as gr
import pydantic
from fastapi import Body, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from gradio.routes import App

from .draining import DrainingServer
from ..audio_io import AudioEncoder
from .app import ready_service
from .errors import APIError
from .ui_code import curl_command, openai_code, synthesize_code
from .ui_fields import (ENROL, ENROL_FIELDS, INTEGER_SETTINGS, LINE, SETTING_FIELDS, SETTINGS, TEXT, VOICE, PageError,
                        PageField, bounds, page_error, step)
from .ui_player import SPEAK_DONE_JS, STOP_JS, TOKEN, page_js, page_take_model, player_js
from .ui_takes import MAX_TAKES, MIN_RECORDING_SECONDS, Playground, Speaking

logger = logging.getLogger("transformers_drama3.serving")

PATH = "/ui"
SPEAKERS = [str(n) for n in range(16)]
STATUS_SECONDS = 2.0  # how often the status line is read, and the server's health asked
PAGE_TAKE = page_take_model(SETTINGS)  # the body of the live route (ui_player.py)
PAGE_SEED_BITS = 32  # the page's own random seeds: exact in a browser's numbers (2**53), short to copy
EXAMPLE = "<|speaker:0|> Did you buy the bread? <|speaker:1|> Of course I did."
PREVIEW_CHUNKS, PREVIEW_CHUNK_CHARS = 3, 60  # the preview shows at most 3 chunks, each cut to 60 characters
SEPARATOR = "→"  # between the preview's chunks: in every common font (WGL4's arrows), unlike "⏵"
LOGIN_MESSAGE = ("This server has an API key: log in with the key as the password (the one given to drama3-serve "
                 "with --api-key or $DRAMA3_API_KEY); any user name.")
# The page's icon (at /favicon.ico, where browsers look for it) and its web app manifest (at /manifest.json, where
# Gradio's page links it): a speech bubble.
ICON_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 64 64"><rect width="64" height="64" rx="14" '
            'fill="#f97316"/><path d="M14 18h36a4 4 0 0 1 4 4v18a4 4 0 0 1-4 4H30l-10 9v-9h-6a4 4 0 0 1-4-4V22a4 4 '
            '0 0 1 4-4z" fill="#fff"/></svg>')


def api_error(error: Exception) -> APIError:
    """A failure of the page as the server's `APIError` (its message is what an HTTP client reads)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, pydantic.ValidationError):
        first = error.errors()[0]
        return APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                        str(first["loc"][0]) if first["loc"] else None, "invalid_value")
    logger.exception("the page failed")
    return APIError(500, "something went wrong on the server; its log has the details", code="server_error")


def base_url(request: gr.Request) -> str:
    """Where the page's user reaches this server (for copied code)."""
    scheme = request.headers.get("x-forwarded-proto") or request.request.url.scheme
    return f"{scheme}://{request.headers['host']}"


CSS = """
.drama3-error .info-text, #recording-info.drama3-error { color: var(--error-text-color, #dc2626); font-weight: 600; }
.drama3-error input, .drama3-error textarea { border-color: var(--error-border-color, #dc2626) !important; }
#server-line:empty { display: none; }
#server-line { color: var(--color-red-600, #dc2626); font-weight: 600; }
body.drama3-unreachable #status, body.drama3-unreachable .toast-wrap { display: none; }
#speak.drama3-busy { opacity: 0.6; cursor: progress; }
"""
MARK = "⚠️ "  # before a message beside its field
NOT_SPOKEN = "Not spoken: "  # the take's line when the server refused it


def build_page(app, playground: Playground | None = None) -> gr.Blocks:
    """The playground's Blocks, on the server `app` (made by `create_app`)."""
    playground = playground or Playground(app)
    settings = app.state.settings
    defaults = playground.defaults()
    keyed = settings.api_key is not None

    def setting_input(field: PageField):
        least, most = bounds(field.name, settings.max_frames)
        value = None if field.name == "seed" else defaults[field.name]
        if field.name in INTEGER_SETTINGS:
            return gr.Number(value, precision=0, minimum=least, maximum=most, label=field.shown_label,
                             elem_id=field.elem_id)
        return gr.Slider(least, most, value, step=step(field.name), label=field.shown_label, elem_id=field.elem_id)

    with gr.Blocks(title="Drama 3 playground", analytics_enabled=False) as page:
        history = gr.State([])  # the page's takes, newest last
        # What was typed and set, kept in the browser (localStorage) as it changes, so that a reload (the page reloads
        # itself when its server restarts) brings it back. The key only needs to be the same after a restart: the
        # text is the user's own, in their own browser.
        typed = gr.BrowserState(None, storage_key="drama3-playground", secret=playground.page_key or "drama3")
        gr.Markdown("## Drama 3 playground\nSpeak text, clone a voice, and copy the request as code.")
        status = gr.Markdown("Reading the server's status…", elem_id="status")
        gr.HTML('<div id="server-line"></div>', elem_id="server")  # PAGE_JS: while the server does not answer
        inputs = {}
        with gr.Row():
            with gr.Column(scale=3):
                text = gr.Textbox(EXAMPLE, label=TEXT.shown_label, lines=4, elem_id=TEXT.elem_id)
                with gr.Row():
                    speaker = gr.Dropdown(SPEAKERS, value="0", label="Speaker", scale=1, min_width=80,
                                          elem_id="speaker")
                    line = gr.Textbox(label=LINE.label, placeholder="What the speaker says", scale=4,
                                      elem_id=LINE.elem_id)
                    add_line = gr.Button("Add line", scale=1, elem_id="add-line")
                preview = gr.Markdown(elem_id="preview")
                with gr.Row():
                    speak = gr.Button("Speak", variant="primary", elem_id="speak")
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
                # The live player's line (ui_player.py); its script makes the player's AudioContext, keeps the time
                # of each click on Speak and watches the server's health.
                gr.HTML('<div id="live-line"></div>', elem_id="live", js_on_load=page_js(STATUS_SECONDS))
                page_key = gr.Textbox(visible=False)  # the live route's key, filled when the page loads
                live_token = gr.Textbox(visible=False)  # the take's token, drawn by PLAYER_JS
                was_running = gr.Checkbox(visible=False)  # STOP_JS: whether Stop ended a take
                player = gr.Audio(label="Speech (the take, once complete)", interactive=False, elem_id="player")
                take_info = gr.Markdown(elem_id="take-info")
            with gr.Column(scale=2):
                with gr.Accordion("Voice", open=True):
                    voice = gr.Dropdown(playground.voice_names(), value="default", label=VOICE.label,
                                        elem_id=VOICE.elem_id, allow_custom_value=False)
                    with gr.Row():
                        refresh = gr.Button("Refresh", size="sm")
                        delete = gr.Button("Delete this voice", size="sm", variant="stop", elem_id="delete")
                    with gr.Row(visible=False) as confirm_row:
                        confirm_text = gr.Markdown()
                        confirm = gr.Button("Yes, delete it", size="sm", variant="stop", elem_id="confirm-delete")
                        keep = gr.Button("Cancel", size="sm")
                    saves = playground.saves_voices
                    with gr.Accordion("Enrol a new voice", open=False, elem_id="enrol-accordion"):
                        if not saves:
                            gr.Markdown("This server saves no voices, so it cannot enrol one: start it with "
                                        "`--voices DIR` (e.g. `drama3-serve ... --voices voices/`).",
                                        elem_id="enrol-off")
                        name_field, audio_field, transcript_field = ENROL_FIELDS
                        new_name = gr.Textbox(label=name_field.label, placeholder="letters, digits, _ or -",
                                              elem_id=name_field.elem_id, interactive=saves)
                        recording = gr.Audio(sources=["upload", "microphone"], type="filepath",
                                             label=f"{audio_field.label} (at least {MIN_RECORDING_SECONDS:g} s; "
                                             f"10-30 s works best; at most {settings.max_reference_seconds:g} s)",
                                             elem_id=audio_field.elem_id, interactive=saves)
                        # The recording's messages (an Audio has no `info` line of its own).
                        recording_info = gr.Markdown(elem_id=f"{audio_field.elem_id}-info",
                                                     elem_classes=["drama3-error"])
                        transcript = gr.Textbox(label=transcript_field.shown_label, elem_id=transcript_field.elem_id,
                                                interactive=saves)
                        with gr.Row():
                            enrol = gr.Button("Enrol", elem_id="enrol", interactive=saves)
                            replace = gr.Button("Replace it", visible=False, variant="stop", elem_id="replace")
                    voice_info = gr.Markdown(elem_id="voice-info")
                with gr.Accordion("Settings", open=True):
                    for field in SETTING_FIELDS[:5]:
                        inputs[field.name] = setting_input(field)
                    with gr.Accordion("Repetition-aware sampling and codebooks", open=False,
                                      elem_id="more-accordion"):
                        for field in SETTING_FIELDS[5:]:
                            inputs[field.name] = setting_input(field)
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
        metrics = ("`GET /metrics` (Prometheus; it needs the API key as a bearer token)" if keyed
                   else "[metrics](../metrics) (Prometheus)")
        gr.Markdown(f"**This server's API**: OpenAI's speech endpoint `POST /v1/audio/speech`, voices at "
                    f"`/v1/voices`, and more: [API docs](../docs) · {metrics}. The page is made with Gradio; its "
                    "own calls are no API of the server.", elem_id="our-api")
        timer = gr.Timer(STATUS_SECONDS)
        setting_inputs = [inputs[name] for name in SETTINGS]
        fields = {TEXT.name: text, VOICE.name: voice, **inputs}  # what a take's error may name
        enrol_inputs = dict(zip(ENROL, (new_name, recording, transcript)))

        def marks(error: PageError | None, components: dict) -> dict:
            """Updates of `components` (field name -> input): `error`'s message beside its field, none beside the
            others. The recording's message goes in the line under it."""
            updates = {}
            for name, component in components.items():
                named = error is not None and error.field is not None and error.field.name == name
                if component is recording:
                    updates[recording_info] = MARK + error.message if named else ""
                elif name != TEXT.name:
                    updates[component] = (gr.update(info=MARK + error.message, elem_classes=["drama3-error"]) if named
                                          else gr.update(info="", elem_classes=[]))
            return updates

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
                return preview_summary(playground.preview(value or ""), len(value or ""), settings.max_text_chars)
            except APIError as error:
                return MARK + page_error(error).message

        def append_line(current: str, number: str, words: str):
            if not words.strip():
                return current, gr.update(info=MARK + "write the line first, then add it",
                                          elem_classes=["drama3-error"])
            joined = f"{current.rstrip()} <|speaker:{number}|> {words.strip()}".strip()
            return joined, gr.update(value="", info="", elem_classes=[])

        def voice_choices(selected: str = "default"):
            names = playground.voice_names()
            return gr.update(choices=names, value=selected if selected in names else "default")

        async def enrol_voice(name: str, audio_path: str | None, words: str, replacing: bool = False):
            try:
                saved, notes = await playground.enrol(name, words, audio_path, replace=replacing)
            except Exception as error:  # noqa: BLE001  (shown beside its field)
                error = api_error(error)
                shown = page_error(error, ENROL)
                taken = error.code == "voice_exists" and playground.voices.exists(name.strip())
                if taken:
                    shown = PageError(shown.field, f"{shown.field.label}: a voice called {name.strip()!r} already "
                                      "exists: choose another name, or replace it (the button below)")
                return {**marks(shown, enrol_inputs), voice_info: "" if shown.field else MARK + shown.message,
                        replace: gr.update(visible=taken, value=f"Replace {name.strip()}")}
            said = " ".join(f"Note: {note}" for note in notes)
            emptied = gr.update(value="", info="", elem_classes=[])  # the form, for the next voice
            return {**marks(None, enrol_inputs), new_name: emptied, transcript: emptied, recording: None,
                    voice: voice_choices(saved), replace: gr.update(visible=False),
                    voice_info: f"{'Replaced' if replacing else 'Enrolled'} **{saved}**: pick it above and speak. "
                    + said}

        async def replace_voice(name: str, audio_path: str | None, words: str):
            return await enrol_voice(name, audio_path, words, replacing=True)

        def ask_delete(name: str):
            if name == "default":
                return gr.update(visible=False), "", MARK + "'default' is no saved voice: there is nothing to delete"
            return gr.update(visible=True), f"Delete **{name}** for everyone using this server?", ""

        async def delete_voice(name: str):
            try:
                await playground.delete(name)
            except Exception as error:  # noqa: BLE001  (shown beside the voice)
                return voice_choices(name), gr.update(visible=False), MARK + page_error(api_error(error)).message
            return voice_choices(), gr.update(visible=False), f"Deleted **{name}**."

        def take_view(chosen, takes_so_far, request: gr.Request):
            take = next((t for t in takes_so_far if t.label == chosen), None)
            if take is None:
                return (None, *[gr.update(visible=False)] * 3, None, "", "", "")
            url = base_url(request)
            buttons = [gr.update(value=str(take.files[name]), visible=True) if name in take.files else
                       gr.update(visible=False) for name in ("wav", "mp3", "flac")]
            return (str(take.files["wav"]), *buttons, take.fields,
                    curl_command(url, take.fields, keyed), openai_code(url, take.fields, keyed),
                    synthesize_code(str(settings.model), take.fields,
                                    None if settings.voices_dir is None else str(settings.voices_dir),
                                    settings.chunk_bytes))

        def reuse_settings(chosen, takes_so_far, said: str):
            """The take's text, voice and settings put back; the messages of a refused take go with the values they
            were about."""
            take = next((t for t in takes_so_far if t.label == chosen), None)
            if take is None:
                return {takes: gr.update(info=MARK + "pick a take first", elem_classes=["drama3-error"])}
            values = {**playground.defaults(), **take.fields}  # a setting left out of the request had its default
            gone = take.fields["voice"] not in playground.voice_names()
            voice_update = gr.update(choices=playground.voice_names(), value=take.fields["voice"], info="",
                                     elem_classes=[])
            if gone:  # deleted since the take: its settings come back, with the voice 'default'
                voice_update = gr.update(choices=playground.voice_names(), value="default",
                                         info=MARK + f"this take's voice {take.fields['voice']!r} has been deleted: "
                                         "the page speaks with 'default' instead (enrol it again to use it)",
                                         elem_classes=["drama3-error"])
            refused = (said or "").startswith(MARK + NOT_SPOKEN)
            return {text: take.fields["input"], voice: voice_update, takes: gr.update(info="", elem_classes=[]),
                    take_info: "" if refused else gr.update(),
                    **{inputs[name]: gr.update(value=values[name], info="", elem_classes=[]) for name in SETTINGS}}

        async def speak_take(token: str, takes_so_far: list):
            """Wait for the take the click's PLAYER_JS is speaking through the live route, then keep it; a refused
            take's message goes beside the field it names."""
            if not TOKEN.fullmatch(token or ""):
                yield {take_info: MARK + "the page's player did not start (is JavaScript off?): reload the page"}
                return
            live = playground.live.take(token)
            try:
                await live.started.wait()
                if live.speaking is not None and not live.ended.done():
                    yield {**marks(None, fields),
                           take_info: f"Speaking… first audio after {live.speaking.first_audio_s * 1000:.0f} ms"}
                fields_sent, speaking = await live.ended
                take = await playground.keep(takes_so_far[-1].number + 1 if takes_so_far else 1, fields_sent, speaking)
            except Exception as error:  # noqa: BLE001  (shown on the page; Stop's cancellation is no Exception)
                error = api_error(error)
                if error.code == "cancelled":  # Stop before the first audio: the page's event came after it
                    yield {take_info: stopped()}
                    return
                shown = page_error(error)
                said = {preview: MARK + shown.message} if shown.field is TEXT else {}
                yield {**marks(shown, fields), **said,
                       take_info: MARK + NOT_SPOKEN + (f"see the message beside {shown.field.label}" if shown.field
                                                       else shown.message)}
                return
            finally:
                playground.live.forget(token)
            kept = [*takes_so_far, take]
            for old in kept[:-MAX_TAKES]:
                playground.forget(old)
            kept = kept[-MAX_TAKES:]
            yield {**marks(None, fields), take_info: take.summary(), history: kept, player: str(take.files["wav"]),
                   takes: gr.update(choices=[t.label for t in reversed(kept)], value=take.label)}

        def stopped(running: bool = True):
            """The take's line after Stop (STOP_JS says whether a take was running: if not, the line stays)."""
            return "Stopped: the server cancelled the request." if running else gr.update()

        hidden = {"api_visibility": "undocumented"}  # the page's own calls: no API of the server
        page.load(restore, typed, [text, voice, *setting_inputs], **hidden).then(show_preview, text, preview, **hidden)
        timer.tick(read_status, outputs=status, **hidden)
        page.load(read_status, outputs=status, **hidden)
        page.load(lambda: playground.page_key, outputs=page_key, **hidden)
        text.change(show_preview, text, preview, show_progress="hidden", **hidden)
        add_line.click(append_line, [text, speaker, line], [text, line], **hidden)
        refresh.click(voice_choices, voice, voice, **hidden)
        enrolling = [new_name, recording, transcript]
        enrol_outputs = [*enrolling, recording_info, voice, voice_info, replace]
        enrol.click(enrol_voice, enrolling, enrol_outputs, **hidden)
        replace.click(replace_voice, enrolling, enrol_outputs, **hidden)
        new_name.change(lambda: gr.update(visible=False), outputs=replace, show_progress="hidden", **hidden)
        delete.click(ask_delete, voice, [confirm_row, confirm_text, voice_info], **hidden)
        keep.click(lambda: gr.update(visible=False), outputs=confirm_row, **hidden)
        confirm.click(delete_voice, voice, [voice, confirm_row, voice_info], **hidden)
        reset.click(show_defaults, outputs=setting_inputs, **hidden)
        gr.on([box.change for box in [text, voice, *setting_inputs]], None, [text, voice, *setting_inputs], typed,
              js="(...values) => [values]")  # in the browser only: no call to the server
        # Speak: the take is spoken from the browser (PLAYER_JS), then kept by speak_take, given its token alone.
        speaking = speak.click(None, [text, voice, *setting_inputs, page_key], live_token, js=player_js(SETTINGS),
                               trigger_mode="multiple").then(
            speak_take, [live_token, history], [player, take_info, history, takes, preview, voice, *setting_inputs],
            concurrency_limit=None, show_progress="hidden", **hidden)  # the page's own line says how far it got
        speaking.then(None, js=SPEAK_DONE_JS)
        stop.click(stopped, was_running, take_info, cancels=[speaking], js=STOP_JS, show_progress="hidden", **hidden)
        takes.change(take_view, [takes, history], [take_audio, *downloads, take_fields, curl, openai_sdk, python],
                     **hidden)
        reuse.click(reuse_settings, [takes, history, take_info], [text, voice, *setting_inputs, takes, take_info],
                    **hidden)
    return page


def preview_summary(chunks: list[str], characters: int, max_characters: int) -> str:
    """What the preview says of text the server accepts: how many chunks, how many characters of how many, and the
    first and last chunks (a long text's every chunk would push Speak off the screen)."""
    shown = [f"`{chunk if len(chunk) <= PREVIEW_CHUNK_CHARS else chunk[:PREVIEW_CHUNK_CHARS - 1] + '…'}`"
             for chunk in chunks]
    if len(shown) > PREVIEW_CHUNKS:
        shown = [*shown[:PREVIEW_CHUNKS - 1], f"… {len(chunks) - PREVIEW_CHUNKS} more …", shown[-1]]
    counted = "1 chunk" if len(chunks) == 1 else f"{len(chunks)} chunks"
    return (f"The server will speak it in {counted} ({characters:,} of at most {max_characters:,} characters): "
            + f" {SEPARATOR} ".join(shown))


def mount_page(app, path: str = PATH):
    """Mount the playground on the server's FastAPI `app` at `path` and link it from `/`; returns the app. With an
    API key, the page asks for it (as the password; any user name). The takes' files are removed when the app's
    lifespan ends (the server shuts down)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    settings = app.state.settings
    playground = Playground(app)
    key = settings.api_key

    def knows_key(username: str, password: str) -> bool:
        return secrets.compare_digest(password.encode(), key.encode())

    @app.get("/", include_in_schema=False)
    async def home() -> HTMLResponse:
        return HTMLResponse(f'<!doctype html><meta http-equiv="refresh" content="0; url={path}/">'
                            f'<link rel="icon" href="/favicon.ico"><title>Drama 3</title>'
                            f'<a href="{path}/">Drama 3 playground</a>')

    @app.get("/favicon.ico", include_in_schema=False)
    async def icon() -> Response:
        return Response(ICON_SVG, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    @app.get("/manifest.json", include_in_schema=False)
    async def manifest() -> JSONResponse:
        return JSONResponse({"name": "Drama 3 playground", "short_name": "Drama 3", "start_url": f"{path}/",
                             "display": "standalone", "icons": [{"src": "/favicon.ico", "sizes": "any",
                                                                 "type": "image/svg+xml"}]},
                            media_type="application/manifest+json")

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

    # Gradio keeps a copy of each file the page shows (the takes) and each upload in its cache folder, which it never
    # empties (GRADIO_TEMP_DIR, else /tmp/gradio): the takes' folder is that cache, so a take is not copied, and the
    # server's shutdown removes them all. (A GRADIO_TEMP_DIR of the user's own is theirs to empty.)
    os.environ.setdefault("GRADIO_TEMP_DIR", str(playground.takes_dir))
    app.state.page = build_page(app, playground)
    # The footer has no "Use via API": the page's own Gradio calls are no API of the server (the page names the
    # server's API itself, and hides its calls from Gradio's API page).
    gr.mount_gradio_app(app, app.state.page, path=path, auth=knows_key if key is not None else None,
                        auth_message=LOGIN_MESSAGE, allowed_paths=[str(playground.takes_dir)],
                        footer_links=["gradio", "settings"], max_file_size=settings.max_body_bytes, css=CSS)
    with_page = app.router.lifespan_context  # the server's lifespan, with the page's start-up inside (Gradio's)

    @asynccontextmanager
    async def lifespan(app):
        try:
            async with with_page(app) as state:
                yield state
        finally:
            playground.close()  # the takes' files go with the server

    app.router.lifespan_context = lifespan
    return app


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
