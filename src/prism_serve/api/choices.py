"""One request's choices in flight, between the controller's token streams and the HTTP response:
each choice's stream and timings (``Choice``), how its output is shown (``ChoiceOutput``: echo and
logprobs in OpenAI's shapes), the streams of ``n`` > 1 choices merged as tokens come, and waiting
that a client disconnect or a failed choice cuts short for every choice."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from prism_serve.api.protocol import chat_logprobs, completion_logprobs
from prism_serve.api.tenants import Tenant
from prism_serve.engine.sequence import TokenLogprob
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.errors import PrismError
from prism_serve.runtime.serving import Delta

__all__ = [
    "Choice",
    "ChoiceOutput",
    "ClientDisconnected",
    "gather_or_cancel",
    "merged",
    "sse_event",
    "unless_disconnected",
]


class ClientDisconnected(Exception):
    """The client went away before its request finished (nothing more can be sent)."""


@dataclass(slots=True)
class Choice:
    """One choice of a request in flight (``n`` > 1 runs one per choice, each its own sequence in
    the engine): its stream from the controller and its timings (for /metrics)."""

    rid: str
    model: str
    arrival: float
    stream: AsyncIterator[Delta]
    index: int = 0  # the choice's index
    prompt: int = 0  # which of the request's prompts (completions may send several)
    max_tokens: int = 0  # the engine's limit for it
    last: Delta | None = None  # the latest delta
    first_at: float = 0.0
    last_at: float = 0.0
    num_prompt: int = 0
    num_output: int = 0
    num_cached: int = 0  # prompt tokens the engine's prefix cache served
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the output tokens', if asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the prompt's (completions with echo)
    # its model's SLOs when it was submitted (for /metrics' attainment): an adapter may be unloaded
    # while its last tokens are still on their way to the client; None: not judged (a batch line,
    # whose deadline is its batch's window)
    slos: tuple[float, float] | None = (0.0, 0.0)
    # the caller's tenant and this choice's token reservation (api/tenants.py), settled when it ends
    quota: tuple[Tenant, list] | None = None


class ChoiceOutput:
    """How one request's output is shown: the echoed prompt (completions ``echo``) and logprobs in
    OpenAI's chat or completions shape, token texts decoded once per token id."""

    def __init__(
        self, tok: Tokenizer, ids: list[int], chat_logprobs: bool = False, completion_logprobs: bool = False,
        echo: str = "", score_only: bool = False,
    ):  # fmt: skip
        """``ids``: the prompt's; ``chat_logprobs`` / ``completion_logprobs``: logprobs shown in that
        shape; ``echo``: the prompt text a completion repeats first; ``score_only``: a completion
        that generates nothing (max_tokens 0, the prompt's logprobs only)."""
        self.tok = tok
        self.chat_logprobs = chat_logprobs
        self.completion_logprobs = completion_logprobs
        self.score_only = score_only
        self.prompt_ids = ids
        self.echo = echo
        self._pending_echo = self.echo
        self._offset = 0  # characters of the choice's text before the next token
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tok.decode([token_id], False)
        return text

    def take_echo(self) -> str:
        """The echoed prompt, once (the first chunk of a stream carries it)."""
        echo, self._pending_echo = self._pending_echo, ""
        return echo

    def chat(self, entries: list[TokenLogprob]) -> dict | None:
        return chat_logprobs(entries, self.token_text) if self.chat_logprobs else None

    def completion(
        self, entries: list[TokenLogprob], prompt_entries: list[TokenLogprob | None] | None
    ) -> dict | None:
        if not self.completion_logprobs:
            return None
        if self.score_only:
            entries = []
        ids, all_entries = [e.token_id for e in entries], list(entries)
        if self.echo and prompt_entries is not None:  # the first delta: the prompt's tokens lead
            ids, all_entries = self.prompt_ids + ids, [*prompt_entries, *all_entries]
        out = completion_logprobs(all_entries, ids, self.token_text, self._offset)
        self._offset += sum(len(t) for t in out["tokens"])
        return out


async def merged(
    runs: list[Choice], take: Callable[[Choice, Delta], None]
) -> AsyncIterator[tuple[Choice, Delta]]:
    """The unfinished choices' next deltas as they come, merged over the choices, each booked with
    ``take`` first."""
    if len(runs) == 1:
        run = runs[0]
        while not run.last.finished:
            d = await anext(run.stream)
            take(run, d)
            yield run, d
        return
    queue: asyncio.Queue[tuple[Choice, Delta | None, BaseException | None]] = asyncio.Queue()

    async def pump(run: Choice) -> None:
        try:
            while not run.last.finished:
                d = await anext(run.stream)
                take(run, d)
                queue.put_nowait((run, d, None))
        except Exception as e:  # handed to the reader, which ends every choice
            queue.put_nowait((run, None, e))

    pumps = [asyncio.ensure_future(pump(run)) for run in runs if not run.last.finished]
    try:
        for _ in range(len(pumps)):
            while True:
                run, d, error = await queue.get()
                if error is not None:
                    raise error
                yield run, d
                if d.finished:
                    break
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def sse_event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def gather_or_cancel(work: Iterable[Awaitable]) -> list:
    """``asyncio.gather``, except that a failure (or a cancellation) cancels and awaits the rest
    before it propagates: nothing is left reading a stream that is about to be closed."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def unless_disconnected(http: Request, work: Awaitable) -> Any:
    """``await work``, unless the client disconnects first: then cancel it (the controller's
    stream aborts the request) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, PrismError):
        await task
    raise ClientDisconnected


async def _disconnected(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
