"""Async streaming front of one engine, for the HTTP server.

The engine runs in its own thread (torch releases the GIL inside kernels); requests and aborts
reach it through a queue that it drains between steps, and outputs go back to each request's
asyncio queue with ``call_soon_threadsafe``. Validation and tokenization happen in the caller,
so a bad request raises right there and never reaches the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prism_serve.engine.llm_engine import LLMEngine, Prompt
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.sequence import RequestOutput, Sequence
from prism_serve.errors import DuplicateRequestError, EngineDeadError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    seq: Sequence
    sink: _Sink


@dataclass(slots=True)
class _Abort:
    req_id: str


@dataclass(slots=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the caller's loop is closed; nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="prism-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, req_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per new piece of output, the last with ``finished=True``.
        Leaving the loop early (or cancelling the task) aborts the request and frees its KV."""
        if not self.is_running:
            raise EngineDeadError(f"engine is not running: {self._error!r}")
        seq = self.engine.make_sequence(prompt, params, req_id)
        if seq.req_id in self._sinks:
            raise DuplicateRequestError(f"request id {seq.req_id!r} is already in flight")
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._sinks[seq.req_id] = sink
        self._inbox.put(_Add(seq, sink))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(seq.req_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain(block=idle, timeout=0.005 if self.engine.stalled else None):
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug or OOM in one step fails what is in flight, not the server
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(e)
                    continue
                for out in outputs:
                    sink = self._sinks.get(out.req_id)
                    if sink is not None:
                        sink.put(out)
                        if out.finished:
                            del self._sinks[out.req_id]
        except BaseException as e:
            self._error = e
            logger.exception("engine thread died")
        finally:
            self._fail_all(self._error or EngineDeadError("engine shut down"))

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued adds and aborts; False on shutdown. With a timeout, wait that long for the
        first message even when not blocking (a stalled engine backs off this way)."""
        while True:
            try:
                msg = self._inbox.get(block=block or timeout is not None, timeout=timeout)
            except queue.Empty:
                return True
            block, timeout = False, None
            if msg is None:
                return False
            if isinstance(msg, _Add):
                try:
                    self.engine.add_sequence(msg.seq)
                except Exception as e:
                    msg.sink.put(e)
                    self._sinks.pop(msg.seq.req_id, None)
            else:
                self.engine.abort_request(msg.req_id)
                self._sinks.pop(msg.req_id, None)

    def _fail_all(self, error: BaseException) -> None:
        self.engine.abort_all()
        for sink in self._sinks.values():
            sink.put(error if isinstance(error, EngineDeadError) else EngineDeadError(str(error)))
        self._sinks.clear()
