"""The playground's fields (ui.py): what the page calls each request field, the bounds its input takes from the
server's own checks, and a server error put in the page's words, beside the field it names. No Gradio here.

The page checks nothing itself: a take goes through the checks of `POST /v1/audio/speech` (`make_job`) and an
enrolment through those of `POST /v1/voices` (`enrol_recording`). Their `APIError` names the request field it is
about (`param`); `page_error` finds the page's field of that name and writes the message with the field's label
instead of the request's name (`max_new_tokens must be ...` -> `max frames per text chunk must be ...`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..settings_checks import COUNTS, SEED_RANGE, TEMPERATURES, TOP_KS, TOP_PS
from .errors import APIError


@dataclass(frozen=True)
class PageField:
    """One input of the page: `name` is the request's field (or the enrolment form's), `elem_id` the page's element,
    `label` what the page calls it and `hint` what its label adds in brackets."""

    name: str
    elem_id: str
    label: str
    hint: str = ""

    @property
    def shown_label(self) -> str:
        return f"{self.label} ({self.hint})" if self.hint else self.label


# The take's settings, in the order of the page's inputs (PLAYER_JS reads them so), then the take's other fields and
# the enrolment form's. The elem_id of a setting is its request name.
SETTING_FIELDS = (
    PageField("temperature", "temperature", "temperature", "0: greedy"),
    PageField("top_p", "top_p", "top_p"),
    PageField("top_k", "top_k", "top_k", "0: no limit"),
    PageField("seed", "seed", "seed", "empty: a new one each take"),
    PageField("max_new_tokens", "max_frames", "max frames per text chunk", "21.5 frames = 1 s"),
    PageField("ras_window", "ras_window", "ras_window", "frames looked back over; 0: off"),
    PageField("ras_temperature", "ras_temperature", "ras_temperature"),
    PageField("ras_top_k", "ras_top_k", "ras_top_k", "0: no limit"),
    PageField("ras_top_p", "ras_top_p", "ras_top_p"),
    PageField("codebook_temperature", "codebook_temperature", "codebook_temperature"),
    PageField("codebook_top_k", "codebook_top_k", "codebook_top_k", "0: no limit"),
    PageField("codebook_top_p", "codebook_top_p", "codebook_top_p"),
)
SETTINGS = tuple(field.name for field in SETTING_FIELDS)
TEXT = PageField("input", "text", "Text", "<|speaker:N|> switches speakers")
VOICE = PageField("voice", "voice", "Voice")
LINE = PageField("line", "line", "Line")
ENROL_FIELDS = (PageField("name", "new-name", "Name"), PageField("audio", "recording", "Recording"),
                PageField("transcript", "transcript", "Transcript", "what is said in the recording"))
FIELDS = {field.name: field for field in (*SETTING_FIELDS, TEXT, VOICE)}  # a take's fields by request name
ENROL = {field.name: field for field in ENROL_FIELDS}

INTEGER_SETTINGS = (*COUNTS, *TOP_KS, "seed")  # a number box each on the page; the others are sliders
SLIDER_TOP = 2.0  # the temperature sliders' right end: the server takes any positive number, a slider needs an end
SLIDER_STEP = {"temperature": 0.05, "top_p": 0.01}  # by kind; the least value of a (0, x] setting is one step
PAGE_SEED_MAX = 2**53  # a browser's numbers hold integers exactly up to here


def bounds(name: str, max_frames: int) -> tuple[float | None, float | None]:
    """(least, greatest) value of setting `name`'s input, from the server's checks (settings_checks.py's table of
    settings by kind, the server's `--max-frames`); None: no bound. A temperature of 0 is the page's greedy, as in
    the HTTP API; the sliders of the (0, x] settings start one step above 0."""
    if name == "max_new_tokens":
        return COUNTS[name], max_frames
    if name in COUNTS:
        return COUNTS[name], None
    if name in TOP_KS:
        return 0, None
    if name == "seed":
        return max(SEED_RANGE[0], 0), min(SEED_RANGE[1], PAGE_SEED_MAX)  # the HTTP API takes no negative seed
    if name == "temperature":
        return 0.0, SLIDER_TOP
    if name in TEMPERATURES:
        return SLIDER_STEP["temperature"], SLIDER_TOP
    if name in TOP_PS:
        return SLIDER_STEP["top_p"], 1.0
    raise KeyError(f"{name} is no setting of the page")


def step(name: str) -> float:
    """The slider step of a float setting."""
    return SLIDER_STEP["temperature"] if name in TEMPERATURES else SLIDER_STEP["top_p"]


@dataclass(frozen=True)
class PageError:
    """A server error as the page shows it: the page's field it is about (None: the take as a whole) and the
    message in the page's words."""

    field: PageField | None
    message: str


def page_error(error: APIError, fields: dict[str, PageField] = FIELDS) -> PageError:
    """`error` (its `param` a request field) as the page says it: beside the field of that name in `fields`, with
    the field's label where the message names the request's field."""
    field = fields.get((error.param or "").split(".")[0].split("[")[0])
    message = error.message
    if field is not None and field.name != field.label:
        if message.startswith(field.name):
            message = field.label + message[len(field.name):]
        else:
            message = f"{field.label}: {message}"
    return PageError(field, message)
