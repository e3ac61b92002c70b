from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.memory.ledger import ledger_dir
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec

PROMPT = "What is the capital of France?"


class LoopThread:
    """An asyncio loop in a thread, so module-scoped controllers serve many synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class Runtime:
    """A started Controller plus the loop it runs on."""

    def __init__(self, controller: Controller, loop: LoopThread) -> None:
        self.c = controller
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300.0) -> Any:
        return self.loop.run(coro, timeout)

    def chat(self, model: str, text: str = PROMPT) -> str:
        return self.c.models.tokenizer(model).apply_chat_template([{"role": "user", "content": text}])

    def generate(self, model: str, prompt: str | list[int] | None = None, **params: Any) -> tuple[str, list]:
        """Run one request to the end; (text, deltas)."""
        params.setdefault("temperature", 0.0)
        params.setdefault("max_tokens", 8)
        prompt = self.chat(model) if prompt is None else prompt
        return self.run(collect(self.c, model, prompt, SamplingParams(**params)))


async def collect(
    c: Controller, model: str, prompt: str | list[int], params: SamplingParams
) -> tuple[str, list]:
    deltas = [d async for d in c.generate(model, prompt, params)]
    return "".join(d.text for d in deltas), deltas


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``predicate`` (something the controller or a worker makes true) until it holds; waiting,
    not timing: only a condition never reached fails."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def cleanup_namespace(ns: str) -> None:
    for p in ledger_dir().glob(f"prism-ledger-{ns}-*"):
        p.unlink(missing_ok=True)


def start_runtime(devices: list[DeviceSpec], models: list[ModelSpec], **kwargs: Any) -> Runtime:
    ns = f"rt{uuid.uuid4().hex[:10]}"
    loop = LoopThread()
    c = Controller(devices, models, namespace=ns, **kwargs)
    try:
        loop.run(c.start())
    except BaseException:
        loop.run(c.stop())
        loop.close()
        cleanup_namespace(ns)
        raise
    return Runtime(c, loop)


def stop_runtime(rt: Runtime) -> None:
    rt.run(rt.c.stop())
    rt.loop.close()
    cleanup_namespace(rt.c.namespace)


@pytest.fixture(scope="module")
def runtime_factory():
    """Start controllers for a test module; every one is stopped and its ledgers removed after."""
    started: list[Runtime] = []

    def make(devices: list[DeviceSpec], models: list[ModelSpec], **kwargs: Any) -> Runtime:
        rt = start_runtime(devices, models, **kwargs)
        started.append(rt)
        return rt

    yield make
    for rt in started:
        stop_runtime(rt)
