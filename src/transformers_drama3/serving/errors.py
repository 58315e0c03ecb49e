"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

Every failure the server answers goes through `APIError`, so clients written for the OpenAI API (the `openai`
package raises `BadRequestError`, `AuthenticationError`, ... from these) read the message, and nothing answers a 500
with a traceback: unexpected exceptions become a short 500 JSON body, and the traceback goes to the server log.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..settings_checks import short_repr

logger = logging.getLogger("transformers_drama3.serving")

# HTTP status -> OpenAI error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered to the client: HTTP `status`, a `message` that says what to do, the request field it
    concerns (`param`) and a machine-readable `code`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# pydantic's names of the members of a union (`voice: str | VoiceID`) in an error's location; no field has them.
UNION_MEMBERS = ("str", "int", "float", "bool", "list", "dict", "VoiceID")
WHOLE_BODY = "body"  # the `param` of an error about the body as a whole (empty, not JSON, not an object)


def field_path(location) -> str | None:
    """A pydantic error location as a client writes the field: `items[3].temperature`, `references[0].audio`."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in UNION_MEMBERS:
            path += f".{part}" if path else str(part)
    return path or None


def validation_error(error: RequestValidationError) -> APIError:
    """pydantic's first complaint about a request body, as a 400 naming the field (`param`)."""
    first = error.errors()[0]
    kind = first.get("type")
    location = [part for part in first.get("loc", ()) if part != "body"]
    if kind == "extra_forbidden":  # the client's own name last, kept whatever it is
        parent = field_path(location[:-1])
        param = f"{parent}.{location[-1]}" if parent else str(location[-1])
        return APIError(400, f"unknown field {param!r}; see docs/serving.md for the accepted fields", param,
                        "unknown_parameter")
    param = field_path(location)
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON", WHOLE_BODY, "invalid_json")
    if param is None and kind == "missing":
        return APIError(400, "the request body is empty: send a JSON object with at least 'model' and 'input' "
                        "(Content-Type: application/json)", WHOLE_BODY, "invalid_json")
    if param is None:
        return APIError(400, "the request body must be a JSON object, sent with 'Content-Type: application/json' "
                        "(not a form)", WHOLE_BODY, "invalid_json")
    if kind == "missing":
        return APIError(400, f"missing required field {param!r}", param, "missing_parameter")
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}, got {short_repr(first.get('input'))}", param,
                    "invalid_value")


def body_too_large(max_body_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {max_body_bytes} bytes "
                    "(--max-body-bytes)", WHOLE_BODY, "request_too_large")


def install_error_handlers(app: FastAPI, max_body_bytes: int) -> None:
    """Answer every error of `app` in the OpenAI shape (`max_body_bytes`: the body limit, named in 413s)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code == 413:  # the body limit (app.RequestGuard)
            return body_too_large(max_body_bytes).response()
        if error.status_code == 400:  # FastAPI could not parse the body (bytes that are not UTF-8 JSON)
            return APIError(400, f"the request body is not valid JSON ({error.detail}): send a UTF-8 JSON object",
                            WHOLE_BODY, "invalid_json").response()
        code = "not_found" if error.status_code == 404 else None
        return APIError(error.status_code, str(error.detail), code=code, headers=error.headers).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error; the server log has the details", code="internal_error").response()
