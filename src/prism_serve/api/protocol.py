"""OpenAI request bodies (pydantic) and the response / stream-chunk JSON we answer with.

Requests are strict: a parameter we do not implement (``n > 1``, ``logprobs``, tools, a non-zero
penalty) is a 400 that names it, never silently ignored. vLLM's extras ``top_k``, ``ignore_eos`` and
``stop_token_ids`` are accepted, so load generators written for vLLM work.

Types are checked at the edge, so nothing malformed reaches the tokenizer, the IPC encoder or the
engine: integers are JSON integers (not ``true`` or ``1.0``) within 64 bits, booleans are JSON
booleans, and text is valid Unicode (a lone surrogate such as ``"\\ud800"`` is a 400, since no
tokenizer can encode it).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from prism_serve.engine.sampling_params import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "Text",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "new_id",
    "usage",
]


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid Unicode at character {e.start} (a lone surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]


class _Body(BaseModel):
    # strict: JSON types as declared (no true for 1, no 1.0 for an integer, no 0 for false)
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[_TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(_Body):
    """Parameters both endpoints share."""

    model: Text = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT64_MAX)  # vLLM extra
    n: int = 1
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM extra
    seed: Int64 | None = None
    ignore_eos: bool = False  # vLLM extra: generate exactly max_tokens (load generators)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Text | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    @model_validator(mode="after")
    def _options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
        )


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    # Accepted only with their "off" values: a client that asks for more hears why.
    tools: None = None
    tool_choice: Literal["none"] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: Count | None = 16
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None
    best_of: Literal[1] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


# ---- responses ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(num_prompt: int, num_output: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }


def _envelope(rid: str, obj: str, model: str, created: int, choices: list, use: dict | None) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def chat_response(rid: str, model: str, text: str, finish: str | None, use: dict) -> dict:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish,
    }
    return _envelope(rid, "chat.completion", model, int(time.time()), [choice], use)


def chat_chunk(
    rid: str, model: str, created: int, delta: dict | None, finish: str | None, use: dict | None = None
) -> dict:
    choices = (
        [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    )
    return _envelope(rid, "chat.completion.chunk", model, created, choices, use)


def completion_response(rid: str, model: str, text: str, finish: str | None, use: dict) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _envelope(rid, "text_completion", model, int(time.time()), [choice], use)


def completion_chunk(
    rid: str, model: str, created: int, text: str | None, finish: str | None, use: dict | None = None
) -> dict:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    return _envelope(rid, "text_completion", model, created, choices, use)
