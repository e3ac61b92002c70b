"""``X-Request-Id`` on every response, as an ASGI middleware (pure ASGI: it does not buffer streams).

A client's own id (tracing through proxies and logs) is echoed back; a request without one gets a
fresh id, so every answer, error or stream can be quoted in a bug report or matched to a log line.
"""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["RequestIdHeader"]

_HEADER = b"x-request-id"
_MAX_LEN = 256  # a longer client id is replaced: it is echoed into headers and logs


class RequestIdHeader:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope.get("headers", ()) if k == _HEADER), b"")
        if not rid or len(rid) > _MAX_LEN or not all(0x21 <= c <= 0x7E for c in rid):
            rid = uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = rid.decode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
