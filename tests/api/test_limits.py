"""The request size limit in front of a real uvicorn server (and, for what a socket cannot show, at the
ASGI level): a body over the limit is answered 413 whether or not the client is still sending it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from prism_serve.api import limits
from prism_serve.api.limits import BodySizeLimit

LIMIT = 2 * 2**20


async def echo(scope, receive, send):
    """The app behind the limit: answers with the size of the body it was handed."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.fixture(scope="module")
def url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(BodySizeLimit(echo, LIMIT), log_level="warning", http="h11"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def chunked(body: bytes):
    for i in range(0, len(body), 65536):
        yield body[i : i + 65536]


def test_a_body_over_the_limit_is_413_every_time_while_the_client_is_still_sending(url):
    """Before the rest of the body was drained, about one refusal in six reached the client as a
    connection reset (the server closed with unread data) instead of the 413."""
    big = json.dumps({"prompt": "x" * (3 * 2**20)}).encode()
    for _ in range(20):
        for content in (big, chunked(big)):  # with a Content-Length, and chunked
            r = httpx.post(f"{url}/v1/completions", content=content, timeout=60)
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert (
                err["code"] == 413
                and "limit of 2.0 MiB" in err["message"]
                and "server.max_request_bytes" in err["message"]
            )


def test_a_body_within_the_limit_reaches_the_app_whole(url):
    body = b"y" * (LIMIT - 10)
    for content in (body, chunked(body)):
        r = httpx.post(f"{url}/v1/completions", content=content, timeout=60)
        assert r.status_code == 200 and r.text == str(len(body))


def run_refusal(headers: list[tuple[bytes, bytes]], messages) -> tuple[list[dict], int]:
    """Drive the middleware directly: the request's messages come from ``messages``; returns what
    was sent and how many messages were asked for."""
    sent: list[dict] = []
    asked = 0

    async def receive():
        nonlocal asked
        asked += 1
        return next(messages)

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        raise AssertionError("the app must not see a refused request")

    scope = {"type": "http", "path": "/v1/completions", "headers": headers}
    asyncio.run(BodySizeLimit(app, LIMIT)(scope, receive, send))
    return sent, asked


def endless():
    while True:
        yield {"type": "http.request", "body": b"z" * 65536, "more_body": True}


def test_the_drain_of_a_refused_body_is_bounded(monkeypatch):
    monkeypatch.setattr(limits, "LINGER_BYTES", 10 * 65536)
    sent, asked = run_refusal([(b"content-length", str(1 << 40).encode())], endless())
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == 413 and sent[1]["more_body"] is True
    assert sent[-1] == {"type": "http.response.body", "body": b""}  # the answer is finished
    assert asked == 11  # drained past LINGER_BYTES, then stopped


def test_a_client_waiting_for_100_continue_is_answered_without_waiting_for_its_body():
    """It sends no body after a refusal, so the middleware must not wait for one."""
    headers = [(b"content-length", str(1 << 30).encode()), (b"expect", b"100-Continue")]
    sent, asked = run_refusal(headers, endless())
    assert asked == 0
    assert sent[0]["status"] == 413 and sent[-1].get("more_body", False) is False


def test_a_chunked_body_that_ends_in_the_refused_chunk_is_not_drained():
    chunks = iter([{"type": "http.request", "body": b"a" * (LIMIT + 1), "more_body": False}])
    sent, asked = run_refusal([(b"transfer-encoding", b"chunked")], chunks)
    assert asked == 1 and sent[0]["status"] == 413 and sent[-1].get("more_body", False) is False
