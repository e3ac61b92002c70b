"""``POST /v1/responses``: OpenAI's Responses API, its stateless subset, over the chat completions path.

A request becomes a chat completion (``to_chat``): ``instructions`` a system message; ``input`` a
string (one user message) or items: messages (``input_text`` / ``output_text`` parts), the model's
earlier ``function_call`` items (an assistant message's tool calls) and ``function_call_output``
items (tool messages); ``tools`` (Responses' flat function tools), ``tool_choice``,
``parallel_tool_calls``; ``text.format`` (text, json_object, json_schema) as response_format;
``max_output_tokens``, ``temperature``, ``top_p``. The chat answer becomes a Response object
(``to_response``): a ``message`` output item with ``output_text`` and a ``function_call`` item per
call. Streamed, the chat chunks become Responses events (``ResponseEvents``): response.created, the
output items added, output_text deltas, function_call_arguments deltas, their done events and
response.completed (or .incomplete at max_output_tokens), each with its sequence_number.

Nothing is kept between requests: ``store: true`` and ``previous_response_id`` are a 400 that says
so (send the whole conversation as input items instead). Reasoning items in the input are skipped
(this server's models do not reason in items); other item types are a 400 naming them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from prism_serve.errors import InvalidRequestError

__all__ = ["ResponseEvents", "to_chat", "to_response"]

_SAMPLING = ("temperature", "top_p", "parallel_tool_calls", "user", "stream", "top_logprobs", "seed")


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be text or a list of text parts", param="input")
    parts = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequestError(
                f"{where}: content parts of type {str(kind)[:32]!r} are not supported", param="input"
            )
        parts.append(p.get("text") or "")
    return "".join(parts)


def _chat_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise InvalidRequestError(
                f"tools[{i}]: only function tools are supported, got {str(kind)[:32]!r}", param="tools"
            )
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _chat_format(text: Any) -> dict | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object", param="text")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def to_chat(body: dict) -> dict:
    """The chat completions body a Responses request means (400s naming what cannot be honoured)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object", param="input")
    if body.get("store"):
        raise InvalidRequestError(
            "store: this server keeps no responses (it is stateless); send store: false or leave it out",
            param="store",
        )
    if body.get("previous_response_id"):
        raise InvalidRequestError(
            "previous_response_id: this server keeps no conversation state; send the earlier turns as "
            "input items",
            param="previous_response_id",
        )
    if body.get("conversation"):
        raise InvalidRequestError(
            "conversation: this server keeps no conversation state", param="conversation"
        )
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("input must be text or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(
                    f"{where}.role must be user, system, developer or assistant, got {role!r:.32}",
                    param="input",
                )
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            fn = {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}
            call = {"id": item.get("call_id"), "type": "function", "function": fn}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequestError(
                f"{where}: items of type {str(kind)[:32]!r} are not supported", param="input"
            )
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for key in _SAMPLING:
        if key in body and body[key] is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    fmt = _chat_format(body.get("text"))
    if fmt is not None and fmt["type"] != "text":
        chat["response_format"] = fmt
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def _usage(use: dict | None) -> dict:
    use = use or {}
    i, o = use.get("prompt_tokens", 0), use.get("completion_tokens", 0)
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": i, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": o,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": i + o}  # fmt: skip


def _shell(body: dict, status: str, created: int) -> dict:
    """A new Response object without output: what the request asked, echoed as OpenAI echoes it."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    return {
        "id": _new("resp"), "object": "response", "created_at": created, "status": status,
        "model": body.get("model"), "output": [], "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": None,
        "store": False, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "text": {"format": fmt or {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "truncation": "disabled", "usage": None, "user": body.get("user"),
    }  # fmt: skip


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str | None, status: str = "completed") -> dict:
    """A message output item with its text part (``None``: none yet, while it streams)."""
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": _new("msg"), "status": status, "role": "assistant", "content": content}


def _call_item(call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": _new("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn.get("arguments") or "", "status": status}  # fmt: skip


def _finish(response: dict, finish: str | None) -> None:
    if finish == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def to_response(body: dict, chat: dict) -> dict:
    """The Response object of a whole chat completion (``chat``: its JSON)."""
    out = _shell(body, "completed", chat.get("created", int(time.time())))
    choice = chat["choices"][0]
    message = choice["message"]
    if message.get("content"):
        out["output"].append(_message_item(message["content"]))
    out["output"] += [_call_item(c) for c in message.get("tool_calls") or []]
    out["usage"] = _usage(chat.get("usage"))
    _finish(out, choice.get("finish_reason"))
    return out


class ResponseEvents:
    """Chat completion chunks (their JSON) in, Responses stream events (SSE text) out."""

    def __init__(self, body: dict) -> None:
        self.response = _shell(body, "in_progress", int(time.time()))
        self.seq = 0
        self.message: dict | None = None  # the output text item, once text came
        self.text = ""
        self.calls: dict[int, dict] = {}  # chat tool-call index -> the function_call item
        self.finish: str | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def start(self) -> str:
        return self._event("response.created", response=dict(self.response)) + self._event(
            "response.in_progress", response=dict(self.response)
        )

    def _index(self, item: dict) -> int:
        return self.response["output"].index(item)

    def chunk(self, data: dict) -> str:
        """The events one chat chunk makes (its choices' deltas; the last chunk's usage)."""
        if "error" in data:
            err = data["error"]
            self.response["status"] = "failed"
            self.response["error"] = {"code": str(err.get("code")), "message": err.get("message")}
            code, message = str(err.get("code")), err.get("message")
            return self._event("error", code=code, message=message, param=err.get("param"))
        out = ""
        if data.get("usage"):
            self.response["usage"] = _usage(data["usage"])
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for tc in delta.get("tool_calls") or []:
                out += self._call(tc)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _text(self, piece: str) -> str:
        out = ""
        if self.message is None:
            self.message = _message_item(None, status="in_progress")
            self.response["output"].append(self.message)
            i = self._index(self.message)
            out += self._event("response.output_item.added", output_index=i, item=dict(self.message))
            out += self._event("response.content_part.added", item_id=self.message["id"], output_index=i,
                               content_index=0, part=_text_part(""))  # fmt: skip
        self.text += piece
        return out + self._event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=self._index(self.message), content_index=0, delta=piece,
                                 logprobs=[])  # fmt: skip

    def _call(self, tc: dict) -> str:
        out = ""
        item = self.calls.get(tc.get("index", 0))
        if item is None:
            out += self._close_text()
            fn = tc.get("function") or {}
            item = _call_item({"id": tc.get("id"), "function": {"name": fn.get("name"), "arguments": ""}},
                              status="in_progress")  # fmt: skip
            self.calls[tc.get("index", 0)] = item
            self.response["output"].append(item)
            out += self._event("response.output_item.added", output_index=self._index(item), item=dict(item))
        piece = (tc.get("function") or {}).get("arguments") or ""
        if piece:
            item["arguments"] += piece
            out += self._event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=self._index(item), delta=piece)  # fmt: skip
        return out

    def _close_text(self) -> str:
        m = self.message
        if m is None or m["status"] == "completed":
            return ""
        i = self._index(m)
        part = _text_part(self.text)
        m["content"], m["status"] = [part], "completed"
        return (
            self._event("response.output_text.done", item_id=m["id"], output_index=i, content_index=0,
                        text=self.text, logprobs=[])
            + self._event("response.content_part.done", item_id=m["id"], output_index=i, content_index=0,
                          part=part)
            + self._event("response.output_item.done", output_index=i, item=dict(m))
        )  # fmt: skip

    def end(self) -> str:
        """The done events of every open item, then response.completed (or .incomplete)."""
        out = self._close_text()
        for item in self.calls.values():
            i = self._index(item)
            item["status"] = "completed"
            out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                               arguments=item["arguments"], name=item["name"])  # fmt: skip
            out += self._event("response.output_item.done", output_index=i, item=dict(item))
        if self.response["status"] == "failed":
            return out + self._event("response.failed", response=self.response)
        _finish(self.response, self.finish)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=self.response)
