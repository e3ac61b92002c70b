"""The request size limit (``server.max_request_bytes``), as an ASGI middleware in front of the app.

A body whose ``Content-Length`` says it is too large is answered 413 before a byte of it is read;
a chunked body is counted as it arrives and refused at the first chunk over the limit. Either way
the app never parses (or tokenizes) it, so one huge request costs the server almost nothing.
A path may have its own limit (``per_path``: the batch lane's file uploads, ``server.max_file_bytes``).
(uvicorn's h11 and httptools parsers enforce Content-Length, so a body cannot exceed what it said.)

After the 413 the rest of the body is read and thrown away (for at most ``LINGER_S`` seconds and
``LINGER_BYTES`` bytes) before the connection closes. Closing a socket with unread data makes the
kernel reset the connection, and the reset can destroy the answer on its way, so a client still
sending its body would see a reset instead of the 413. (This is the "lingering close" of HTTP servers.)
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from prism_serve.api.errors import error_body
from prism_serve.memory.vmm import format_size

__all__ = ["LINGER_BYTES", "LINGER_S", "BodySizeLimit"]

LINGER_S = 10.0  # how long a refused body is drained before the connection closes anyway
LINGER_BYTES = 1 << 30

Scope = dict[str, Any]
Message = dict[str, Any]


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int, per_path: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}  # path -> (limit, the setting that sets it)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        default = (self.max_bytes, "server.max_request_bytes")
        max_bytes, setting = self.per_path.get(scope.get("path", ""), default)
        length = _content_length(scope)
        if length is not None and length > max_bytes:
            # A client that asked "Expect: 100-continue" sends no body after a refusal: nothing to drain.
            await self._refuse(
                None if _expects_continue(scope) else receive, send, length, max_bytes, setting
            )
            return
        if length is None and _has_body(scope):
            # Chunked: read it here, counting, and hand the app the whole body in one message.
            chunks, seen = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away while sending
                chunks.append(message.get("body", b""))
                seen += len(chunks[-1])
                if seen > max_bytes:
                    more = message.get("more_body", False)
                    await self._refuse(receive if more else None, send, None, max_bytes, setting)
                    return
                if not message.get("more_body", False):
                    break
            replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

            async def replayed() -> Message:
                return replay.pop() if replay else await receive()  # then disconnects, as before

            await self.app(scope, replayed, send)
            return
        await self.app(scope, receive, send)

    async def _refuse(
        self, receive: Any, send: Any, length: int | None, max_bytes: int, setting: str
    ) -> None:
        """Answer 413; then, if ``receive`` is given (more of the body is on its way), drain it."""
        size = f" ({format_size(length)})" if length is not None else ""
        body = json.dumps(error_body(
            f"the request body{size} is larger than this server's limit of {format_size(max_bytes)} "
            f"({setting})",
            "invalid_request_error", 413,
        )).encode()  # fmt: skip
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]  # fmt: skip
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        # The whole answer goes out now; the empty last message, which closes the connection, waits
        # until the client has finished sending (or the linger is over).
        await send({"type": "http.response.body", "body": body, "more_body": receive is not None})
        if receive is not None:
            await _drain(receive)
            await send({"type": "http.response.body", "body": b""})


async def _drain(receive: Any) -> None:
    """Read and drop what is left of a request body, within LINGER_S and LINGER_BYTES."""
    end, seen = time.monotonic() + LINGER_S, 0
    while seen <= LINGER_BYTES:
        left = end - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


def _has_body(scope: Scope) -> bool:
    return any(name == b"transfer-encoding" for name, _ in scope.get("headers", ()))


def _expects_continue(scope: Scope) -> bool:
    return any(
        name == b"expect" and value.lower() == b"100-continue" for name, value in scope.get("headers", ())
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
