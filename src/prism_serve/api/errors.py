"""Every error the server answers with, in OpenAI's JSON shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": 400}}

PrismErrors carry their own status and type (errors.py); FastAPI's validation errors become 400s
(OpenAI's status for bad parameters, not FastAPI's 422) naming the parameter; unknown routes 404.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from prism_serve.errors import PrismError

__all__ = [
    "AuthenticationError",
    "OverloadedError",
    "PermissionDeniedError",
    "bearer_token",
    "error_body",
    "install_error_handlers",
    "key_matches",
    "validation_message",
]

logger = logging.getLogger(__name__)


class AuthenticationError(PrismError):
    """Missing or wrong API key."""

    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(PrismError):
    """The key is valid but not allowed here (admin routes without the admin key)."""

    status_code = 403
    error_type = "permission_denied"


class OverloadedError(PrismError):
    """Too many requests are waiting for their first token; retry after ``retry_after`` seconds."""

    status_code = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def bearer_token(http: Request) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, if any."""
    scheme, _, token = http.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(token: str, keys: Iterable[str | None]) -> bool:
    """Whether ``token`` is one of ``keys``, compared in constant time (hmac.compare_digest, on
    every key: how long it takes says nothing of how much of a key a guess got right, nor which)."""
    given = token.encode()
    found = False
    for key in keys:
        if key is not None:
            found |= hmac.compare_digest(given, key.encode())
    return found


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(exc: PrismError) -> JSONResponse:
    headers = {}
    retry = getattr(exc, "retry_after", None)
    if retry is None and exc.status_code == 429:
        retry = 1
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if exc.status_code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    headers.update(getattr(exc, "headers", None) or {})  # a tenant's x-ratelimit-* (api/tenants.py)
    body = error_body(str(exc), exc.error_type, exc.status_code, exc.param)
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """(message, the parameter it names) of a request body that does not validate."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        # pydantic names union members (``str``, ``list[int]``): not parameters
        loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "function-after")]
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unsupported parameter"
        elif err.get("type") == "json_invalid":
            msg, loc = "the body is not valid JSON", []  # loc is a character offset here
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PrismError)
    async def _prism(_: Request, exc: PrismError) -> JSONResponse:
        if exc.status_code >= 500:
            logger.warning("%s: %s", type(exc).__name__, exc)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), kind, exc.status_code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        body = error_body(f"internal error: {type(exc).__name__}", "internal_error", 500)
        return JSONResponse(body, status_code=500)
