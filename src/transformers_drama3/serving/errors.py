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


def validation_error(error: RequestValidationError) -> APIError:
    """pydantic's first complaint about a request body, as a 400 naming the field."""
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    if not location and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return APIError(400, "the request body must be a JSON object, sent with 'Content-Type: application/json' "
                        "(not a form)", code="invalid_json")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}; see docs/serving.md for the accepted fields", param,
                        "unknown_parameter")
    if first.get("type") == "missing":
        return APIError(400, f"missing required field {param!r}", param, "missing_parameter")
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param, "invalid_value")


def body_too_large(max_body_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {max_body_bytes} bytes "
                    "(--max-body-bytes)", code="request_too_large")


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
        code = "not_found" if error.status_code == 404 else None
        return APIError(error.status_code, str(error.detail), code=code, headers=error.headers).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error; the server log has the details", code="internal_error").response()
