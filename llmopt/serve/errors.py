"""OpenAI-shaped errors: every failure a client can cause is a 4xx `{"error": {...}}`, never a 500.

`ApiError` is raised anywhere in the request path; the handlers installed by `install_error_handlers`
turn it, FastAPI's validation errors and Starlette's HTTP errors (404, 405) into the same JSON shape, so
the openai client raises its typed exceptions (BadRequestError, AuthenticationError, RateLimitError...).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("llmopt.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.err_type, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def _loc_param(loc: tuple | list) -> str | None:
    """FastAPI locations look like ("body", "messages", 0, "content"): OpenAI names `messages.0.content`."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line for the first problem (plus a count of the others), and its parameter."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    param = _loc_param(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        msg = "the request body is not valid JSON"
        ctx = first.get("ctx") or {}
        if ctx.get("error"):
            msg += f": {ctx['error']}"
        return msg, None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        msg = "unrecognized request argument supplied"
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return text, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(list(exc.errors()))
        return error_response(ApiError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(Exception)
    async def _bug(_req: Request, exc: Exception) -> JSONResponse:  # a bug of ours, never the client's
        log.exception("internal error: %s", exc)
        return error_response(ApiError(500, "internal server error", err_type="server_error"))
