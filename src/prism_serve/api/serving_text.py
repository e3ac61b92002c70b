"""Generating text: what /v1/chat/completions and /v1/completions share, and completions' own part.

``TextServing.complete`` takes one request through the same steps for both families: admitted,
its prompts tokenized and checked in a thread (a long prompt must not stall the loop that streams
every other request's tokens), ``n`` choices of each prompt submitted and their first tokens awaited
(so that a failure is an HTTP status rather than an error inside a stream), then one JSON answer or
SSE chunks. What differs is the family's: its prompts, its answer's shape, its chunks' shape
(``Chunks``). ``CompletionServing`` is /v1/completions (several prompts, echo, prompt logprobs,
``max_tokens`` 0); chat is in serving_chat.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prism_serve.api.choices import (
    Choice,
    ChoiceOutput,
    ClientDisconnected,
    gather_or_cancel,
    merged,
    sse_event,
    unless_disconnected,
)
from prism_serve.api.errors import error_body
from prism_serve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_choice,
    completion_chunk,
    completion_response,
    new_id,
    usage,
)
from prism_serve.api.request_log import LogEntry, prompt_block_hashes
from prism_serve.api.serving import Serving
from prism_serve.api.tools import ToolFormat
from prism_serve.errors import PrismError
from prism_serve.runtime.serving import Delta

__all__ = ["Chunks", "CompletionServing", "TextServing"]

TextRequest = ChatCompletionRequest | CompletionRequest


class Chunks:
    """How one streamed request's deltas become SSE chunks (one family's shape)."""

    def opening(self, run: Choice) -> str:
        """What a choice's stream starts with, before its first delta."""
        return ""

    def chunk(self, run: Choice, text: str | None, finish: str | None, d: Delta | None = None) -> str:
        raise NotImplementedError

    def closing(self, use: dict[str, Any]) -> str:
        """The usage chunk, when the client asked for usage."""
        raise NotImplementedError


class TextServing(Serving):
    """The steps chat and completions share (module docstring); a subclass is one family."""

    id_prefix = "cmpl"

    # ---- the family's parts ---------------------------------------------------------------------

    def prompts(self, body: TextRequest) -> list[list[int]]:
        """The token ids of each prompt, checked against the model's vocabulary and context (400s);
        runs in a thread."""
        raise NotImplementedError

    def check(self, body: TextRequest) -> None:
        """The family's own checks of the request, before its prompts are tokenized (400s)."""

    def output(self, body: TextRequest, prompt: int, ids: list[int]) -> ChoiceOutput:
        """How one choice of prompt ``prompt`` (its token ids ``ids``) is shown: echo, logprobs."""
        raise NotImplementedError

    def tool_format(self, body: TextRequest) -> ToolFormat | None:
        """The model's tool-call format, for a request that may call a tool."""
        return None

    def answer(self, body: TextRequest, runs: list[Choice], outs: list[ChoiceOutput], use: dict) -> dict:
        """The whole answer's JSON."""
        raise NotImplementedError

    def chunks(self, body: TextRequest, runs: list[Choice], outs: list[ChoiceOutput], created: int) -> Chunks:
        raise NotImplementedError

    # ---- the shared steps ------------------------------------------------------------------------

    async def complete(self, http: Request, body: TextRequest) -> Response:
        """One request, its line in the request log written when it ends."""
        self.admit(http, body.model)
        entry = self.log_entry(http, body.model, body.stream, body.n, body.requested_max_tokens())
        return await self.logged(entry, self._complete(http, body, entry))

    async def _complete(self, http: Request, body: TextRequest, entry: LogEntry | None) -> Response:
        arrival = time.perf_counter()
        model = body.model
        self.note_ignored(body)
        try:
            self.runtime.tokenizer(model)  # 404 before any work
            self.state.served[model].refuse(model, "generate")
            self.check(body)
            prompts = await asyncio.to_thread(self.prompts, body)
            if entry is not None:
                entry.prompt_tokens = sum(len(ids) for ids in prompts)
                if len(prompts) == 1:  # which prefixes repeat, for prism plan (~0.1 ms for 8k tokens)
                    entry.block_hashes = prompt_block_hashes(prompts[0])
            runs = await self._open(http, body, prompts, arrival)
            self.metrics.on_request(model, runs[0].max_tokens, body.n)
        except ClientDisconnected:
            return Response(status_code=499)
        except PrismError as e:
            self.count_error(model, e, http)
            raise
        outs = [self.output(body, run.prompt, prompts[run.prompt]) for run in runs]
        if body.stream:
            return StreamingResponse(
                self._sse(body, runs, outs, prompts, entry),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            await unless_disconnected(http, gather_or_cancel(self.drain(run) for run in runs))
        except ClientDisconnected:
            return Response(status_code=499)
        except PrismError as e:
            self.count_error(model, e, http)
            raise
        finally:
            for run in runs:
                await run.stream.aclose()
            if entry is not None:
                entry.served(runs, sum(len(ids) for ids in prompts), arrival)
        use = self._usage(runs, prompts, outs[0].score_only)
        return JSONResponse(self.answer(body, runs, outs, use))

    async def _open(
        self, http: Request, body: TextRequest, prompts: list[list[int]], arrival: float
    ) -> list[Choice]:
        """Submit ``n`` choices of every prompt and wait for the first token of each (or a
        disconnect, or an error: then every choice is aborted)."""
        served = self.state.served[body.model]
        max_len, default_max = served.max_model_len, served.sampling.get("max_tokens")
        wanted = body.requested_max_tokens()
        if default_max and not body.model_fields_set & {"max_tokens", "max_completion_tokens"}:
            wanted = None  # the model's default, not the endpoint's (completions: 16)
        n = body.n * len(prompts)
        self.check_waiting(http, n)
        rid = new_id(self.id_prefix)
        tool_format = self.tool_format(body)
        choices = []
        for p, ids in enumerate(prompts):
            for j in range(body.n):
                room = max_len - len(ids)  # a model's default max_tokens is capped by the context
                max_tokens = wanted or (min(default_max, room) if default_max else room)
                choices.append((p, j, ids, body.sampling_params(max_tokens, j, served.sampling, tool_format)))
        quotas = self.reserve(http, [len(ids) + params.max_tokens for _, _, ids, params in choices])
        runs, slos = [], self.slos(http, served)
        for (p, j, ids, params), quota in zip(choices, quotas, strict=True):
            i = p * body.n + j
            stream = self.generate(http, body.model, ids, params, rid if n == 1 else f"{rid}-{i}", slos)
            runs.append(Choice(rid, body.model, arrival, stream, index=i, prompt=p,
                               max_tokens=params.max_tokens, num_prompt=len(ids),
                               slos=slos, quota=quota))  # fmt: skip
        await self.first_deltas(http, runs)
        return runs

    @staticmethod
    def _usage(runs: list[Choice], prompts: list[list[int]], score_only: bool) -> dict[str, Any]:
        """Each prompt counted once (as OpenAI does, whatever ``n``), each choice's tokens. A
        prompt's cached tokens are its first choice's (the others may hit what it computed)."""
        generated = 0 if score_only else sum(run.num_output for run in runs)
        cached = {run.prompt: run.num_cached for run in reversed(runs)}
        return usage(sum(len(ids) for ids in prompts), generated, sum(cached.values()))

    async def _sse(
        self, body: TextRequest, runs: list[Choice], outs: list[ChoiceOutput], prompts: list[list[int]],
        entry: LogEntry | None,
    ):  # fmt: skip
        chunks = self.chunks(body, runs, outs, int(time.time()))

        def of(run: Choice, d: Delta) -> str:
            sse = chunks.chunk(run, d.text, None, d) if d.text or d.token_ids else ""  # one per engine step
            return sse + (chunks.chunk(run, None, d.finish_reason) if d.finished else "")

        try:
            sse = "".join(chunks.opening(run) + of(run, run.last) for run in runs)
            left = sum(not run.last.finished for run in runs)
            if left:
                yield sse
                sse = ""
                async with contextlib.aclosing(merged(runs, self.take)) as deltas:
                    async for run, d in deltas:
                        sse = of(run, d)
                        left -= d.finished
                        if not left:
                            break  # the last chunk goes out with the usage and [DONE]
                        if sse:
                            yield sse
                            sse = ""
            if body.include_usage:
                sse += chunks.closing(self._usage(runs, prompts, outs[0].score_only))
            yield sse + "data: [DONE]\n\n"
            status = 200
        except PrismError as e:
            status = e.status_code
            self.count_error(runs[0].model, e, tenant=runs[0].quota[0] if runs[0].quota else None)
            yield sse_event(error_body(str(e), e.error_type, e.status_code)) + "data: [DONE]\n\n"
        except BaseException:
            status = 499  # a disconnect cancels this generator
            raise
        finally:
            for run in runs:  # a disconnect cancels this generator: the requests are aborted
                await run.stream.aclose()
            self.write_log(entry, runs, sum(len(ids) for ids in prompts), status)


class _CompletionChunks(Chunks):
    def __init__(self, runs: list[Choice], outs: list[ChoiceOutput], created: int, with_usage: bool) -> None:
        self.rid, self.model, self.created = runs[0].rid, runs[0].model, created
        self.outs, self.with_usage = outs, with_usage

    def chunk(self, run: Choice, text: str | None, finish: str | None, d: Delta | None = None) -> str:
        out = self.outs[run.index]
        logprobs = out.completion(d.logprobs or [], d.prompt_logprobs) if d is not None else None
        text = out.take_echo() + ("" if out.score_only else (text or ""))
        data = completion_chunk(self.rid, self.model, self.created, text, finish, None, logprobs, run.index)
        if self.with_usage:  # OpenAI sends "usage": null on every chunk but the last when usage is on
            data["usage"] = None
        return sse_event(data)

    def closing(self, use: dict[str, Any]) -> str:
        return sse_event(completion_chunk(self.rid, self.model, self.created, None, None, use))


class CompletionServing(TextServing):
    """``POST /v1/completions``: one prompt or several, each with ``n`` choices."""

    id_prefix = "cmpl"

    def prompts(self, body: CompletionRequest) -> list[list[int]]:
        wanted = body.requested_max_tokens()
        return [self.prompt_ids(body.model, p, wanted, "prompt") for p in body.prompts]

    def output(self, body: CompletionRequest, prompt: int, ids: list[int]) -> ChoiceOutput:
        tok = self.runtime.tokenizer(body.model)
        echo = ""
        if body.echo:
            text = body.prompts[prompt]
            echo = text if isinstance(text, str) else tok.decode(ids, False)
        return ChoiceOutput(
            tok, ids, completion_logprobs=body.logprobs is not None, score_only=body.score_only, echo=echo
        )

    def answer(
        self, body: CompletionRequest, runs: list[Choice], outs: list[ChoiceOutput], use: dict
    ) -> dict:
        choices = [
            completion_choice(run.index, out.echo + ("" if out.score_only else "".join(run.text)),
                              run.last.finish_reason, out.completion(run.logprobs, run.prompt_logprobs))
            for run, out in zip(runs, outs, strict=True)
        ]  # fmt: skip
        return completion_response(runs[0].rid, body.model, choices, use)

    def chunks(
        self, body: CompletionRequest, runs: list[Choice], outs: list[ChoiceOutput], created: int
    ) -> Chunks:
        return _CompletionChunks(runs, outs, created, body.include_usage)
