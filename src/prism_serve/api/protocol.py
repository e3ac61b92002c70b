"""OpenAI request bodies (pydantic) and the response / stream-chunk JSON we answer with.

Requests are lenient about names, strict about effects (as vLLM is since strict 400s broke
clients): a field we do not know is accepted, logged once by the server and ignored; a known field
at its neutral value is accepted whatever it is; a field whose effect the server cannot honour
(an image part, ``best_of`` > 1) is a 400 that names it. vLLM's extras (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``) are accepted,
so load generators written for vLLM work.

Types are checked at the edge, so nothing malformed reaches the tokenizer, the IPC encoder or the
engine: integers are JSON integers (not ``true`` or ``1.0``) within 64 bits, booleans are JSON
booleans, and text is valid Unicode (a lone surrogate such as ``"\\ud800"`` is a 400, since no
tokenizer can encode it).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from prism_serve.api.tools import (
    Tool,
    ToolChoice,
    ToolFormat,
    auto_grammar,
    call_schema,
    check_json_schema,
    check_tool_messages,
    parse_tool_choice,
    parse_tools,
)
from prism_serve.config import MinP, Penalty, RepetitionPenalty, Temperature, TopK, TopP
from prism_serve.engine.sampling_params import SamplingParams, StructuredOutput
from prism_serve.engine.sequence import TokenLogprob
from prism_serve.errors import InvalidRequestError

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "Text",
    "TokenizeRequest",
    "chat_choice",
    "chat_chunk",
    "chat_logprobs",
    "chat_response",
    "completion_choice",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "new_id",
    "usage",
]


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOPS = 32  # stop strings per request (OpenAI allows 4; vLLM sets no limit)
MAX_CHOICES = 16  # n: each choice is one sequence in the engine (OpenAI allows 128; vLLM sets no limit)
MAX_PROMPTS = 64  # prompts in one completions request (lm-eval batches 16 by default)


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
    # strict: JSON types as declared (no true for 1, no 1.0 for an integer, no 0 for false); keys
    # of nested objects we do not know (a message's tool_calls, refusal, ...) are ignored
    model_config = ConfigDict(extra="ignore", strict=True)


class _Request(_Body):
    """A request body: its unknown top-level fields are kept in ``model_extra`` for the server to
    log (once per name), then ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _TextPart(_Body):
    type: str
    text: Text = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"content parts of type {v[:32]!r} are not supported: text only (no images)")
        return v


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[_TextPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (api/tools.py reads them)
    tool_call_id: Text | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(_Request):
    """Parameters both endpoints share."""

    model: Text = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0  # vLLM extra
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices: n independent samples of one prompt
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM extra
    seed: Int64 | None = None
    ignore_eos: bool = False  # vLLM extra: generate exactly max_tokens (load generators)
    # penalties and filters; each at its default leaves sampling as it is
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0  # vLLM extra
    min_p: MinP = 0.0  # vLLM extra
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)  # vLLM extra
    logit_bias: dict[str, float] | None = None
    user: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit() or int(key) > INT64_MAX:
                raise ValueError(f"logit_bias keys are token ids, got {key[:32]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return v

    @model_validator(mode="after")
    def _options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self, max_tokens: int, choice: int = 0, defaults: Mapping[str, float | int] | None = None,
        tool_format: ToolFormat | None = None,
    ) -> SamplingParams:  # fmt: skip
        """The engine's parameters for one choice. With ``n`` > 1 and a seed, choice i samples with
        seed + i (as vLLM does): reproducible, and the choices differ. ``defaults``: the model's
        sampling settings (SamplingDefaults) for those the request leaves out; ``tool_format``: the
        model's tool-call format (api/tools.py PARSERS), for a request that may call tools."""
        given = self.model_fields_set
        chosen = {k: v for k, v in (defaults or {}).items() if k not in given and k in _SAMPLED}

        def value(name: str) -> Any:
            return chosen.get(name, getattr(self, name))

        # only what differs from the neutral value travels: the engine's defaults are the same
        extra: dict[str, Any] = {
            name: value(name) for name, neutral in _NEUTRAL.items() if value(name) != neutral
        }
        if self.logit_bias:
            extra["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        extra.update(self._output_options(tool_format))
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=value("temperature"),
            top_p=value("top_p"),
            top_k=value("top_k"),
            seed=_choice_seed(self.seed, choice),
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            **extra,
        )

    def _output_options(self, tool_format: ToolFormat | None = None) -> dict[str, Any]:
        """SamplingParams fields the endpoint adds (logprobs)."""
        return {}


def _choice_seed(seed: int | None, choice: int) -> int | None:
    if seed is None or choice == 0:
        return seed
    seed += choice
    return seed - 2**64 if seed > INT64_MAX else seed  # stays a 64-bit integer


_NEUTRAL = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
    "min_tokens": 0,
}  # fmt: skip
_SAMPLED = {"temperature", "top_p", "top_k", *_NEUTRAL}  # what a model's defaults may set
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


@dataclass(slots=True, frozen=True)
class ToolSetup:
    """A chat request's checked tools, tool_choice and parallel_tool_calls (api/tools.py)."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool

    @property
    def active(self) -> bool:
        """The model may call a tool: its answer is read for calls."""
        return self.choice.mode != "none" and bool(self.tools)

    @property
    def constrained(self) -> bool:
        """Decoding is constrained to a call (required, or a named function)."""
        return self.choice.mode in ("required", "named")


class ChatCompletionRequest(_Sampling):
    _tools: ToolSetup | None = PrivateAttr(None)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # tool calling (api/tools.py checks them: ``tool_setup``)
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def tool_setup(self) -> ToolSetup:
        """The request's tools and tool_choice, checked (InvalidRequestError naming the parameter)."""
        if self._tools is None:
            tools = parse_tools(self.tools)
            choice = parse_tool_choice(self.tool_choice, tools)
            setup = ToolSetup(tools, choice, parallel=self.parallel_tool_calls is not False)
            check_tool_messages(self.messages)
            if setup.constrained and _structured(self.response_format) is not None:
                raise InvalidRequestError(
                    "response_format cannot be combined with a forced tool_choice", param="response_format"
                )
            self._tools = setup
        return self._tools

    def _output_options(self, tool_format: ToolFormat | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"logprobs": self.top_logprobs or 0} if self.logprobs else {}
        structured = _structured(self.response_format)
        setup = self.tool_setup()
        if setup.constrained:
            schema = call_schema(setup.tools, setup.choice, setup.parallel)
            structured = StructuredOutput("json_schema", json.dumps(schema))
        elif setup.active and tool_format is not None:
            # auto: free text, but a call the model starts is decoded under its tool's schema
            if structured is None:
                grammar = auto_grammar(setup.tools, setup.parallel, tool_format)
                structured = StructuredOutput("grammar", grammar)
            if tool_format.special:  # the call markers are special tokens: the parser must see them
                out["skip_special_tokens"] = False
        if structured is not None:
            out["structured"] = structured
        return out

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        _structured(v)  # a 400 naming what is wrong, before any work
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _structured(fmt: dict[str, Any] | None) -> StructuredOutput | None:
    """``response_format`` as the engine's constrained decoding (llguidance): text (none),
    json_object, or json_schema with its ``json_schema.schema``."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON Schema object")
        check_json_schema(schema, "response_format.json_schema.schema", "response_format")
        return StructuredOutput("json_schema", json.dumps(schema))
    raise ValueError(f"response_format {str(kind)[:32]!r} is not supported: text, json_object, json_schema")


class CompletionRequest(_Sampling):
    """``prompt`` may be several prompts (texts or token id lists): choice ``i * n + j`` is sample
    ``j`` of prompt ``i``, as OpenAI and vLLM number them. ``max_tokens`` 0 with ``echo`` scores the
    prompt only (lm-eval's loglikelihood): its tokens and logprobs come back, nothing is generated."""

    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Literal[""] | None = None
    # 1 only (an integer: a Literal would take true and 1.0, which equal 1)
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    def _output_options(self, tool_format: ToolFormat | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
            if self.echo:  # the prompt's tokens come back with their logprobs (lm-eval loglikelihood)
                out["prompt_logprobs"] = self.logprobs
        return out

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if _many(v) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if isinstance(v, list) and any(isinstance(p, list) and not p for p in _one_or_many(v)):
            raise ValueError("prompt is empty")
        return v

    @model_validator(mode="after")
    def _scoring_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it is allowed with echo (to score the prompt)")
        if len(self.prompts) * self.n > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} choices per request (prompts x n)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one or several."""
        return _one_or_many(self.prompt)

    @property
    def score_only(self) -> bool:
        return self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.max_tokens == 0 else self.max_tokens  # scoring runs one step, shown as none


MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request (OpenAI's limit)


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request: ``input`` one text or token id list, or a list of them;
    ``dimensions`` keeps the first ones of each vector (models trained to be truncated: Matryoshka),
    normalised after if the model normalises; ``user`` is accepted and unused."""

    model: Text = Field(min_length=1)
    input: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: Text | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        if _many(v) and len(v) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        if not all(_one_or_many(v)):
            raise ValueError("input is empty: each input must have text or tokens")
        return v

    @property
    def inputs(self) -> list[str | list[int]]:
        """The request's inputs, one or several."""
        return _one_or_many(self.input)


MAX_SCORE_PAIRS = 2048  # (query, document) pairs in one rerank or score request


class _Document(_Body):
    """A document as Cohere's and Jina's clients may send it: an object with its text."""

    text: Text


class _ScoringRequest(_Request):
    """What rerank and score requests share: the model; ``instruction``, the task the reranker is
    told (its ``{instruction}``; unset: the model's ``score_instruction``); ``max_tokens_per_doc``
    (Cohere's and vLLM's), where a longer document is cut."""

    model: Text = Field(min_length=1)
    instruction: Text | None = None
    max_tokens_per_doc: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0  # 0: documents are not cut
    user: Text | None = None

    def pairs(self) -> list[tuple[str, str]]:
        raise NotImplementedError


class RerankRequest(_ScoringRequest):
    """The rerank request of Jina's and Cohere's APIs (and vLLM's /rerank): one query, documents as
    texts or ``{"text": ...}`` objects; ``top_n`` keeps the best n (0 or unset: all), and
    ``return_documents`` false leaves the documents' texts out of the results."""

    query: Text = Field(min_length=1)
    documents: list[Text | _Document] = Field(min_length=1, max_length=MAX_SCORE_PAIRS)
    top_n: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    return_documents: bool = True

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def pairs(self) -> list[tuple[str, str]]:
        return [(self.query, d) for d in self.texts]


# vLLM's score request names its two sides in any of these ways
_SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2"))


class ScoreRequest(_ScoringRequest):
    """vLLM's /score: two sides, each a text or a list of texts, under one of the pairs of names
    of ``_SCORE_SIDES``. One text against N scores it with each; N against N pairs them in order."""

    queries: Text | list[Text] | None = None
    documents: Text | list[Text] | None = None
    items: Text | list[Text] | None = None
    text_1: Text | list[Text] | None = None
    text_2: Text | list[Text] | None = None
    data_1: Text | list[Text] | None = None
    data_2: Text | list[Text] | None = None

    @model_validator(mode="after")
    def _two_sides(self) -> ScoreRequest:
        given = self._sides()
        if len(given) != 1:
            names = "; ".join(f"{a} and {b}" for a, b in _SCORE_SIDES)
            raise ValueError(f"send one pair of sides to score: {names}")
        left, right = given[0]
        if not left or not right or not all(left) or not all(right):
            raise ValueError("each side needs at least one text, and no text may be empty")
        if len(left) != 1 and len(left) != len(right):
            raise ValueError(
                f"one query against any number of documents, or as many queries as documents "
                f"({len(left)} against {len(right)})"
            )
        if len(right) > MAX_SCORE_PAIRS:
            raise ValueError(f"at most {MAX_SCORE_PAIRS} pairs per request")
        return self

    def _sides(self) -> list[tuple[list[str], list[str]]]:
        """The texts of each pair of names the request fills."""
        return [
            (_one_or_many(getattr(self, a)), _one_or_many(getattr(self, b)))
            for a, b in _SCORE_SIDES
            if getattr(self, a) is not None and getattr(self, b) is not None
        ]

    def pairs(self) -> list[tuple[str, str]]:
        left, right = self._sides()[0]
        return list(zip(left * len(right) if len(left) == 1 else left, right, strict=True))


def _many(v: Any) -> bool:
    """Several prompts (texts or token id lists) rather than one (a text or a token id list)."""
    return isinstance(v, list) and bool(v) and isinstance(v[0], str | list)


def _one_or_many(v: Any) -> list:
    """One prompt or several as a list of prompts (an empty list: one empty prompt)."""
    return list(v) if _many(v) else [v]


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""

    model: Text = Field(min_length=1)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Request):
    model: Text = Field(min_length=1)
    tokens: list[TokenId]


# ---- responses ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(num_prompt: int, num_output: int, num_cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``num_cached``: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def _envelope(rid: str, obj: str, model: str, created: int, choices: list, use: dict | None) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def chat_choice(
    index: int, text: str | None, finish: str | None, logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def chat_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return _envelope(rid, "chat.completion", model, int(time.time()), choices, use)


def chat_chunk(
    rid: str, model: str, created: int, delta: dict | None, finish: str | None, use: dict | None = None,
    logprobs: dict | None = None, index: int = 0,
) -> dict:  # fmt: skip
    choices = (
        [] if delta is None
        else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    )  # fmt: skip
    return _envelope(rid, "chat.completion.chunk", model, created, choices, use)


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return _envelope(rid, "text_completion", model, int(time.time()), choices, use)


def completion_chunk(
    rid: str, model: str, created: int, text: str | None, finish: str | None, use: dict | None = None,
    logprobs: dict | None = None, index: int = 0,
) -> dict:  # fmt: skip
    choices = [] if text is None else [completion_choice(index, text, finish, logprobs)]
    return _envelope(rid, "text_completion", model, created, choices, use)


# ---- logprobs -----------------------------------------------------------------------------------


def chat_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str]) -> dict:
    """OpenAI chat ``logprobs``: per output token its text, bytes, logprob and top alternatives."""

    def one(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
        ]
    }


def completion_logprobs(
    entries: list[TokenLogprob | None],
    token_ids: list[int],
    token_text: Callable[[int], str],
    offset: int = 0,
) -> dict:
    """OpenAI (legacy) completions ``logprobs`` for ``token_ids``, ``entries`` their logprobs (None:
    unknown, the first prompt token of an echo); ``offset``: characters of text before the first
    token in the choice's text. The sampled token is in its own ``top_logprobs``, as vLLM does."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for token_id, e in zip(token_ids, entries, strict=True):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(e.logprob)
        top = {token_text(t): lp for t, lp in e.top}
        top.setdefault(text, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
