"""Chat: /v1/chat/completions (``ChatServing``) and /v1/responses over it (``ResponsesServing``).

A chat request's one prompt is its messages (and the tools the model may call, api/tools.py)
rendered with the model's chat template; its answer may call tools, read back from the text (or,
under a constrained ``tool_choice``, from the grammar's output) into OpenAI's ``tool_calls``, whole
or as stream deltas. The Responses API (api/responses.py) is a chat request in another shape: the
request is turned into one, its answer (or stream) back into a Response object (or events).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from prism_serve.api.choices import Choice, ChoiceOutput, sse_event
from prism_serve.api.errors import validation_message
from prism_serve.api.protocol import (
    ChatCompletionRequest,
    ToolSetup,
    chat_choice,
    chat_chunk,
    chat_response,
)
from prism_serve.api.responses import ResponseEvents, to_chat, to_response
from prism_serve.api.serving import Serving, ServingState
from prism_serve.api.serving_text import Chunks, TextServing
from prism_serve.api.tools import (
    MARKERS,
    CallStream,
    ToolChoice,
    ToolFormat,
    parse_calls,
    parse_constrained,
    parser_for_template,
    render_conversation,
)
from prism_serve.errors import InvalidRequestError
from prism_serve.runtime.serving import Delta

__all__ = ["ChatServing", "ResponsesServing"]


class ChatServing(TextServing):
    """``POST /v1/chat/completions``; ``render`` is also /tokenize's way of reading messages."""

    id_prefix = "chatcmpl"

    # ---- the prompt -------------------------------------------------------------------------------

    def check(self, body: ChatCompletionRequest) -> None:
        body.tool_setup()  # 400s naming the tool or message, before anything is tokenized

    def prompts(self, body: ChatCompletionRequest) -> list[list[int]]:
        text = self.render(body.model, body.messages, tools=body.tool_setup())
        return [self.prompt_ids(body.model, text, body.requested_max_tokens(), "messages")]

    def render(
        self, model: str, messages: list, add_generation_prompt: bool = True, tools: ToolSetup | None = None
    ) -> str:
        """Chat messages (and the tools the model may call, api/tools.py) as the model's prompt
        text: its template, or a plain transcript for a checkpoint without one, as some HF
        directories are."""
        tok = self.runtime.tokenizer(model)
        choice = tools.choice if tools is not None else ToolChoice("none")
        family = self._tool_parser(model) if tools is not None and tools.active else "hermes"
        plain, shown = render_conversation(
            messages, tools.tools if tools else [], choice, tok.chat_template, family
        )
        if tok.chat_template:
            return tok.apply_chat_template(plain, add_generation_prompt, shown)
        transcript = "".join(f"{m['role']}: {m['content']}\n" for m in plain)
        return transcript + ("assistant:" if add_generation_prompt else "")

    # ---- tool calls -------------------------------------------------------------------------------

    def _tool_parser(self, model: str) -> str:
        """The model's tool-call format: configured, else read from its chat template; an adapter
        reads calls as its base."""
        adapter = self.runtime.adapter(model)
        configured = self.state.tool_parsers.get(adapter.base if adapter else model)
        return configured or parser_for_template(self.runtime.tokenizer(model).chat_template)

    def tool_format(self, body: ChatCompletionRequest) -> ToolFormat | None:
        if not body.tool_setup().active:
            return None
        family = self._tool_parser(body.model)
        return ToolFormat(family, self.runtime.tokenizer(body.model).special_ids(MARKERS[family]))

    def _read_calls(
        self, model: str, tools: ToolSetup, text: str, finish: str | None
    ) -> tuple[str | None, list[dict] | None, str | None]:
        """(content, tool_calls, finish_reason) of a whole answer that may call tools."""
        if tools.constrained:
            calls = parse_constrained(text) if finish != "length" else []
            content = None if calls else text
        else:
            content, calls = parse_calls(text, self._tool_parser(model), tools.tools)
        return content, [c.as_openai() for c in calls] or None, call_finish(tools, calls, finish)

    # ---- the answer -------------------------------------------------------------------------------

    def output(self, body: ChatCompletionRequest, prompt: int, ids: list[int]) -> ChoiceOutput:
        return ChoiceOutput(self.runtime.tokenizer(body.model), ids, chat_logprobs=bool(body.logprobs))

    def answer(
        self, body: ChatCompletionRequest, runs: list[Choice], outs: list[ChoiceOutput], use: dict
    ) -> dict:
        tools = body.tool_setup()
        choices = []
        for run, out in zip(runs, outs, strict=True):
            text, finish, calls = "".join(run.text), run.last.finish_reason, None
            if tools.active:
                text, calls, finish = self._read_calls(body.model, tools, text, finish)
            choices.append(chat_choice(run.index, text, finish, out.chat(run.logprobs), calls))
        return chat_response(runs[0].rid, body.model, choices, use)

    def chunks(
        self, body: ChatCompletionRequest, runs: list[Choice], outs: list[ChoiceOutput], created: int
    ) -> Chunks:
        tools = body.tool_setup()
        calls: dict[int, CallStream] = {}  # per choice, where the model may call a tool
        if tools.active:
            family = self._tool_parser(body.model)
            calls = {run.index: CallStream(family, tools.tools, tools.constrained) for run in runs}
        return _ChatChunks(runs, outs, created, body.include_usage, tools, calls)


class _ChatChunks(Chunks):
    def __init__(
        self, runs: list[Choice], outs: list[ChoiceOutput], created: int, with_usage: bool, tools: ToolSetup,
        calls: dict[int, CallStream],
    ) -> None:  # fmt: skip
        self.rid, self.model, self.created = runs[0].rid, runs[0].model, created
        self.outs, self.with_usage, self.tools, self.calls = outs, with_usage, tools, calls

    def _event(self, data: dict) -> str:
        if self.with_usage:  # OpenAI sends "usage": null on every chunk but the last when usage is on
            data["usage"] = None
        return sse_event(data)

    def opening(self, run: Choice) -> str:
        role = {"role": "assistant", "content": ""}
        return self._event(chat_chunk(self.rid, self.model, self.created, role, None, index=run.index))

    def chunk(self, run: Choice, text: str | None, finish: str | None, d: Delta | None = None) -> str:
        i = run.index
        delta = {} if text is None else {"content": text}
        cs = self.calls.get(i)
        if cs is not None:  # text may be a call: content and tool-call deltas from it
            content, made = cs.feed(text) if text else ("", [])
            if finish is not None:
                more, rest = cs.finish()
                content, made = content + more, made + rest
                finish = call_finish(self.tools, cs.calls, finish)
            delta = ({"content": content} if content else {}) | ({"tool_calls": made} if made else {})
            if not delta and finish is None and not (d is not None and d.logprobs):
                return ""
        logprobs = self.outs[i].chat(d.logprobs or []) if d is not None else None
        return self._event(chat_chunk(self.rid, self.model, self.created, delta, finish, None, logprobs, i))

    def closing(self, use: dict[str, Any]) -> str:
        return sse_event(chat_chunk(self.rid, self.model, self.created, None, None, use))


def call_finish(tools: ToolSetup, calls: list, finish: str | None) -> str | None:
    """The finish_reason of an answer that called tools: tool_calls (OpenAI's stop for a named
    function); a cut by max_tokens stays length."""
    if calls and finish == "stop":
        return "stop" if tools.choice.mode == "named" else "tool_calls"
    return finish


# a chat parameter's name in a Responses request
_RESPONSES_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}


class ResponsesServing(Serving):
    """``POST /v1/responses`` (api/responses.py, stateless): the request as a chat completion, its
    answer (or its stream) as a Response object (or Responses events)."""

    def __init__(self, state: ServingState, chat: ChatServing) -> None:
        super().__init__(state)
        self.chat = chat

    async def respond(self, http: Request) -> Response:
        try:
            body = await http.json()
        except ValueError:
            raise InvalidRequestError("the body is not valid JSON") from None
        chat_body = to_chat(body)
        try:
            request = ChatCompletionRequest.model_validate_json(json.dumps(chat_body))
        except ValidationError as e:
            message, param = validation_message(e)
            raise InvalidRequestError(message, param=_RESPONSES_PARAMS.get(param, param)) from None
        response = await self.chat.complete(http, request)
        if isinstance(response, StreamingResponse):
            return StreamingResponse(
                _response_events(body, response.body_iterator),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        if response.status_code != 200:
            return response
        return JSONResponse(to_response(body, json.loads(response.body)))


async def _response_events(body: dict, chunks) -> Any:
    """A chat completion's SSE stream as Responses events."""
    events = ResponseEvents(body)
    yield events.start()
    async for piece in chunks:
        text = piece.decode() if isinstance(piece, bytes) else piece
        out = ""
        for block in text.split("\n\n"):
            if block.startswith("data: ") and block != "data: [DONE]":
                out += events.chunk(json.loads(block[len("data: ") :]))
        if out:
            yield out
    yield events.end()
