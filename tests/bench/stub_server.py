"""A STUB OpenAI-compatible endpoint for the load generator's tests.

It stands in for a real server (vLLM, prism serve) and runs no model: POST /v1/completions streams
``max_tokens`` chunks of fake text in OpenAI's SSE shape. The real server is tested end to end with
this load generator in its own tests; this stub only lets the generator's tests control every answer.

Models and what they do:
- ``m1``, ``m2``, ``slow``: stream one chunk per token (``slow`` pauses between chunks); ``m1`` lists
  SLOs in /v1/models.
- ``no-usage``: streams without the usage chunk.
- ``busy``: 429 with Retry-After, OpenAI error shape.
- ``hang``: one chunk, then nothing (the client must time out).
- ``cut``: ends the stream without ``data: [DONE]``.
- ``fail-mid``: sends an error event mid-stream.
- ``garbage``: sends an event whose choices are not objects.
- ``silent``: every token's chunk has empty text (tokens that decode to nothing), usage counts them.
- ``empty``: ``data: [DONE]`` with no chunk and no usage.
- ``cached``: as ``m1``, and its usage says in ``prompt_tokens_details.cached_tokens`` how many
  leading prompt ids it had seen in an earlier prompt, in whole blocks of ``CACHE_BLOCK`` ids.
- anything else: 404, OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

KNOWN = ("m1", "m2", "slow", "no-usage", "busy", "hang", "cut", "fail-mid", "garbage", "silent", "empty",
         "cached")  # fmt: skip
CACHE_BLOCK = 8
M1_SLOS = (0.5, 0.05)  # (ttft_slo, tpot_slo) that /v1/models lists for m1


def _error(status: int, message: str, type_: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _chunk(text: str, finish: str | None = None) -> str:
    body = {
        "id": "cmpl-stub",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n"


class StubEndpoint:
    """The stub app served by uvicorn in a background thread on a free port."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.seen: list[list] = []  # the ``cached`` model's earlier prompts
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.app = self._build()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def reset(self) -> None:
        self.bodies.clear()
        self.seen.clear()
        self.auth.clear()
        self.peak_in_flight = 0

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            data = [{"id": m, "object": "model", "owned_by": "stub"} for m in KNOWN]
            data[0].update(ttft_slo=M1_SLOS[0], tpot_slo=M1_SLOS[1])
            return {"object": "list", "data": data}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.auth.append(request.headers.get("authorization"))
            model = body.get("model")
            if model not in KNOWN:
                return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
            if model == "busy":
                return _error(429, "queue full", "rate_limit_error", {"Retry-After": "3"})
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        return app

    async def _stream(self, body: dict):
        model, n = body["model"], body["max_tokens"]
        prompt = body["prompt"]
        num_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            yield ": keep-alive\n\n"
            if model == "empty":
                yield "data: [DONE]\n\n"
                return
            if model == "garbage":
                yield 'data: {"choices": ["x"]}\n\n'
            for i in range(n):
                if model == "slow":
                    await asyncio.sleep(0.02)
                text = "" if model == "silent" else f" t{i}"
                yield _chunk(text, "length" if i == n - 1 else None)
                if model == "hang":
                    await asyncio.sleep(3600)
                if model == "fail-mid":
                    err = {"error": {"message": "engine died", "type": "service_unavailable"}}
                    yield f"data: {json.dumps(err)}\n\n"
                    return
            if model == "cut":
                return
            if model != "no-usage" and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": num_prompt, "completion_tokens": n, "total_tokens": num_prompt + n}
                if model == "cached":
                    usage["prompt_tokens_details"] = {"cached_tokens": self._cached(prompt)}
                yield f"data: {json.dumps({'id': 'cmpl-stub', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    def _cached(self, prompt: list) -> int:
        def common(a: list, b: list) -> int:
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n

        best = max((common(prompt, q) for q in self.seen), default=0)
        self.seen.append(prompt)
        return best // CACHE_BLOCK * CACHE_BLOCK

    def start(self) -> StubEndpoint:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        for _ in range(1000):  # readiness poll, not a timing assertion
            if self._server.started:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError("the stub endpoint did not start")
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
