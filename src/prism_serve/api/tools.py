"""Tool calling in chat completions: the request's tools checked, shown to the model, and its output
read back as OpenAI ``tool_calls``.

**Checked** (a 400 naming the parameter): every tool is a function with a valid name and a valid
JSON schema for its parameters, names are unique; ``tool_choice`` (``none``, ``auto``, ``required``
or a named function) names a tool that is there; a ``role: tool`` message answers a call an earlier
assistant message made (its ``tool_call_id``).

**Shown.** A chat template that knows tools (it reads ``tools``) gets them and the conversation's
calls and results as Hugging Face templates take them. A template without (SmolLM2's, and many
fine-tunes') gets them described in the system message, with the instruction to answer a call in
the format its answers are read in (below; Hermes' ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` unless the model's ``tool_parser`` says otherwise), earlier calls written back that
way and results as ``<tool_response>`` user turns. ``tool_choice: none`` shows no tools.

**Read back** by the model family's format (``PARSERS``), chosen from the template or set per model:

- ``hermes``: ``<tool_call>{json}</tool_call>`` blocks, text around them is content (Qwen 2.5/3,
  Hermes, many fine-tunes, and the system-message prompt above);
- ``llama3_json``: a JSON object ``{"name", "parameters"|"arguments"}`` (several separated by ``;``),
  after ``<|python_tag|>`` or alone (Llama 3.1-3.3);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``;
- ``json``: the whole answer one such object or array (optionally in a ```json fence).

Every parser also accepts plain JSON. What does not parse into calls of known tools with object
arguments stays text, as vLLM returns it; never an error.

**Constrained.** Under ``required`` or a named function the engine decodes only JSON that is a
call: ``{"name": <a tool's>, "arguments": <valid for its schema>}`` (an array of them under
``required`` with ``parallel_tool_calls``), as vLLM's guided decoding does, so the arguments always
validate. Under ``auto`` the model answers freely, but in a grammar of its family's format
(``auto_grammar``): a call it starts is decoded under its tool's schema from its first token.
Where the family's markers are special tokens of the model's vocabulary (``[TOOL_CALLS]`` in
Mistral's, ``<|python_tag|>`` in Llama 3's, ``<tool_call>`` in Qwen's GGUF), the grammar names
them by token id and the answer keeps special tokens, so that the parser sees them (vLLM's Mistral
parser does the same).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prism_serve.errors import InvalidRequestError

__all__ = [
    "MARKERS",
    "PARSERS",
    "CallStream",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolFormat",
    "auto_grammar",
    "call_schema",
    "check_tool_messages",
    "parse_calls",
    "parse_constrained",
    "parse_tool_choice",
    "parse_tools",
    "parser_for_template",
    "render_conversation",
]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema

    def definition(self) -> dict:
        """As OpenAI and Hugging Face templates write a tool."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(slots=True, frozen=True)
class ToolChoice:
    mode: str  # none, auto, required or named
    name: str | None = None  # the function, when named


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# JSON containers (objects, arrays) a schema in a request may nest: some 64 levels of nested
# objects (each a schema and its "properties"); checking 150 would exhaust Python's stack
MAX_SCHEMA_DEPTH = 128


def check_json_schema(schema: dict[str, Any], where: str, param: str) -> None:
    """The one check of every JSON schema a request sends (a tool's parameters, response_format's):
    nested at most MAX_SCHEMA_DEPTH deep, then valid for its draft. InvalidRequestError (400)
    naming ``where`` and ``param`` otherwise."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:  # iterative: the depth is what is being checked
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(
                f"{where} nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels", param=param
            )
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        path = "/".join(str(p) for p in e.path) or "(root)"
        raise InvalidRequestError(
            f"{where} is not a valid JSON schema at {path}: {e.message[:200]}", param=param
        ) from None
    except RecursionError:  # a schema that refers to itself in a way the checker follows forever
        raise InvalidRequestError(f"{where} cannot be checked: it recurses too deeply", param=param) from None


def parse_tools(tools: Sequence[Any] | None) -> list[Tool]:
    """The request's ``tools``, checked (a 400 naming ``tools``)."""
    out: list[Tool] = []
    if len(tools or ()) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools", param="tools")
    for i, t in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise InvalidRequestError(
                f"{where}: only function tools are supported, got {str(kind)[:32]!r}", param="tools"
            )
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{where}.function must be an object with a name", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1-64 letters, digits, _ . or -, got {name!r:.80}",
                param="tools",
            )
        params = fn.get("parameters", _NO_PARAMETERS)
        if params is None:
            params = _NO_PARAMETERS
        if not isinstance(params, dict):
            raise InvalidRequestError(
                f"{where}.function.parameters must be a JSON schema object", param="tools"
            )
        check_json_schema(params, f"{where}.function.parameters", "tools")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description must be a string", param="tools")
        if any(o.name == name for o in out):
            raise InvalidRequestError(f"{where}: a tool named {name!r} is already listed", param="tools")
        out.append(Tool(name, description, params))
    return out


def parse_tool_choice(choice: Any, tools: list[Tool]) -> ToolChoice:
    """``tool_choice`` against the tools (default: auto with tools, none without)."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be none, auto, required or a function, got {choice[:32]!r}",
                param="tool_choice",
            )
        if choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice {choice} needs tools", param="tool_choice")
        return ToolChoice(choice)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise InvalidRequestError(
            'tool_choice must name a function: {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if not any(t.name == name for t in tools):
        listed = ", ".join(t.name for t in tools) or "none"
        raise InvalidRequestError(
            f"tool_choice names {name[:64]!r}, which is not in tools ({listed})", param="tool_choice"
        )
    return ToolChoice("named", name)


def check_tool_messages(messages: Sequence[Any]) -> None:
    """Every ``role: tool`` message answers a call an earlier assistant message made."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            made.update(c.get("id") for c in m.tool_calls or () if isinstance(c, dict))
        elif m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequestError(
                    f"messages[{i}]: a tool message needs the tool_call_id it answers", param="messages"
                )
            if m.tool_call_id not in made:
                raise InvalidRequestError(
                    f"messages[{i}]: tool_call_id {m.tool_call_id[:64]!r} answers no call of an earlier "
                    "assistant message", param="messages",
                )  # fmt: skip


def _call_arguments(call: dict) -> tuple[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError("an assistant message's tool_calls need function.name", param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise InvalidRequestError(
                f"the arguments of a call to {fn['name'][:64]!r} are not JSON", param="messages"
            ) from None
    return fn["name"], args


# ---- how the model sees them ---------------------------------------------------------------------

_SYSTEM = """You are a function calling AI model. You may call one or more functions to assist with \
the user query. The functions you may call are listed in <tools></tools> as JSON:
<tools>
{tools}
</tools>
{how}
{rule}"""
_HOW = {
    "hermes": "To call a function, answer with a JSON object of its name and arguments inside "
    '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}'
    "\n</tool_call>",
    "mistral": "To call functions, answer with [TOOL_CALLS] and a JSON list of the calls, each with its "
    'name and arguments:\n[TOOL_CALLS] [{"name": <function-name>, "arguments": <arguments-object>}]',
    "llama3_json": "To call a function, answer with nothing but a JSON object of its name and "
    'parameters:\n{"name": <function-name>, "parameters": <arguments-object>}',
    "json": "To call a function, answer with nothing but a JSON object of its name and arguments:\n"
    '{"name": <function-name>, "arguments": <arguments-object>}',
}  # how the system message asks for a call, in the format the model's answers are read in
_RULES = {
    "auto": "Call a function only when it helps; otherwise answer in text.",
    "required": "You must call one or more of these functions.",
}


def _written_calls(calls: list[tuple[str, Any]], family: str) -> str:
    """Earlier calls of the conversation, written as ``family`` asks the model to write them."""
    if family == "hermes":
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in calls
        )
    if family == "mistral":
        return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    key = "parameters" if family == "llama3_json" else "arguments"
    return "; ".join(json.dumps({"name": n, key: a}) for n, a in calls)


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def render_conversation(
    messages: Sequence[Any], tools: list[Tool], choice: ToolChoice, template: str | None,
    family: str = "hermes",
) -> tuple[list[dict], list[dict] | None]:  # fmt: skip
    """(messages, tools) for the chat template: ``tools`` is None where the template gets them in the
    system message (or not at all, under ``none``), asked for and written back in ``family``'s format."""
    shown = [] if choice.mode == "none" else tools
    if template_knows_tools(template):
        out = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.role == "assistant" and m.tool_calls:
                d["tool_calls"] = []
                for c in m.tool_calls:
                    name, args = _call_arguments(c)
                    d["tool_calls"].append({"id": c.get("id"), "type": "function",
                                            "function": {"name": name, "arguments": args}})  # fmt: skip
            if m.role == "tool":
                d["tool_call_id"] = m.tool_call_id
                if m.name:
                    d["name"] = m.name
            out.append(d)
        return out, [t.definition() for t in shown] or None
    out = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            written = _written_calls([_call_arguments(c) for c in m.tool_calls], family)
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.text(), written]))})
        elif m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
        else:
            out.append({"role": m.role, "content": m.text()})
    if shown:
        rule = _RULES.get(choice.mode) or f"You must call the function {choice.name}."
        listed = "\n".join(json.dumps(t.definition()) for t in shown)
        system = _SYSTEM.format(tools=listed, how=_HOW[family], rule=rule)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def parser_for_template(template: str | None) -> str:
    """The tool-call format a chat template teaches (hermes where it teaches none: the system
    message prompt above asks for it)."""
    t = template or ""
    if MARKERS["mistral"][0] in t:
        return "mistral"
    if MARKERS["llama3_json"][0] in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


# ---- reading calls back --------------------------------------------------------------------------


def _as_call(obj: Any, tools: dict[str, Tool]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tools:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_of(value: Any, tools: dict[str, Tool]) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(x, tools) for x in items]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _json_answer(text: str, tools: dict[str, Tool]) -> list[ToolCall] | None:
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    for prefix in (*MARKERS["llama3_json"], *MARKERS["mistral"]):
        body = body.removeprefix(prefix).strip()
    if not body or body[0] not in "[{":
        return None
    try:
        return _calls_of(json.loads(body), tools)
    except ValueError:
        pass
    try:  # Llama 3: several objects separated by ';'
        return _calls_of([json.loads(part) for part in body.split(";") if part.strip()], tools)
    except ValueError:
        return None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _hermes(text: str, tools: dict[str, Tool]) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    blocks = list(_HERMES.finditer(text))
    if not blocks:
        plain = _json_answer(text, tools)
        return (None, plain) if plain else (text, [])
    rest, last = [], 0
    for b in blocks:
        got = _json_answer(b.group(1), tools)
        if not got:
            return text, []  # a block that is not a call: the whole answer stays text
        calls += got
        rest.append(text[last : b.start()])
        last = b.end()
    rest.append(text[last:])
    content = "".join(rest).strip()
    return content or None, calls


def _mistral(text: str, tools: dict[str, Tool]) -> tuple[str | None, list[ToolCall]]:
    head, marker, tail = text.partition("[TOOL_CALLS]")
    got = _json_answer(tail if marker else text, tools)
    if not got:
        return text, []
    return (head.strip() or None) if marker else None, got


def _plain(text: str, tools: dict[str, Tool]) -> tuple[str | None, list[ToolCall]]:
    got = _json_answer(text, tools)
    return (None, got) if got else (text, [])


PARSERS = {"hermes": _hermes, "llama3_json": _plain, "mistral": _mistral, "json": _plain}


def parse_calls(text: str, family: str, tools: Iterable[Tool]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a free answer (``tool_choice: auto``) in ``family``'s format."""
    return PARSERS[family](text, {t.name: t for t in tools})


# ---- constrained calls ---------------------------------------------------------------------------


_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required")  # keys whose values are data
DECIMALS = 1e-6  # the finest step of a number in a forced call


def _bounded_decimals(schema: Any) -> Any:
    """``schema`` as a forced call is decoded under it: every ``number`` without ``multipleOf`` in
    steps of ``DECIMALS``, and every object that lists its ``properties`` without saying whether
    others are allowed, with those properties only. A small model otherwise writes a decimal's
    digits, or parameters the tool never declared (a "description" running on), until max_tokens,
    and a call cut short is no call. Every value decoded this way is valid for the tool's own schema."""
    if isinstance(schema, list):
        return [_bounded_decimals(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _NOT_SCHEMAS else _bounded_decimals(v) for k, v in schema.items()}
    kind = schema.get("type")
    if (kind == "number" or (isinstance(kind, list) and "number" in kind)) and "multipleOf" not in schema:
        out["multipleOf"] = DECIMALS
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _call_object(t: Tool, key: str = "arguments") -> dict:
    """The JSON schema of one call of ``t``: its name, and arguments (under ``key``) valid for it."""
    return {
        "type": "object",
        "properties": {"name": {"const": t.name}, key: _bounded_decimals(t.parameters)},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _any_call(tools: list[Tool], key: str = "arguments") -> dict:
    return (
        _call_object(tools[0], key) if len(tools) == 1 else {"anyOf": [_call_object(t, key) for t in tools]}
    )


def call_schema(tools: list[Tool], choice: ToolChoice, parallel: bool) -> dict:
    """The JSON schema the engine decodes under ``required`` or a named function."""
    if choice.mode == "named":
        out = _call_object(next(t for t in tools if t.name == choice.name))
    else:
        item = _any_call(tools)
        out = {"type": "array", "items": item, "minItems": 1} if parallel else item
    return _compact(out)


def _compact(schema: dict) -> dict:
    # JSON as json.dumps writes it: free whitespace lets a small model spend its tokens on newlines
    # (llguidance reads this key; other JSON schema tools ignore it)
    return {**schema, "x-guidance": _COMPACT}


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A model's tool-call format: its family (``PARSERS``) and the ids of the family's markers
    (``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``) that its tokenizer holds as single special
    tokens. Such a marker is one token the model emits, not text it spells: the grammar names it by
    id, and the answer is detokenized with special tokens kept so that the parsers see it."""

    family: str
    special: dict[str, int] = field(default_factory=dict)


MARKERS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "mistral": ("[TOOL_CALLS]",),
    "llama3_json": ("<|python_tag|>",),
    "json": (),
}  # the marker strings of each family's calls


def auto_grammar(tools: list[Tool], parallel: bool, fmt: ToolFormat) -> str:
    """The grammar (llguidance's Lark) of an answer under ``auto`` in ``fmt``'s family: free text,
    or calls of listed tools with valid arguments (one, or several with ``parallel``), written as
    the family writes them, each constrained from its first token:

    - hermes: text holding no ``<tool_call>``, then ``<tool_call>{call}</tool_call>`` blocks;
    - mistral: text holding no ``[TOOL_CALLS]``, then ``[TOOL_CALLS]`` and a JSON array of calls;
    - llama3_json: an optional ``<|python_tag|>`` and ``{"name", "parameters"}`` objects separated
      by ``;``, or text that does not open with what the parser reads as a call (``{``, ``[``, a
      ```json fence, ``<|python_tag|>``);
    - json: one call object (or an array of them), or such text."""

    def mark(marker: str) -> str:  # a special token by id, else its text
        token = fmt.special.get(marker)
        return f"<[{token}]>" if token is not None else json.dumps(marker)

    def text_then(marker: str) -> list[str]:
        """Rules of ``lead``: text holding no ``marker``, then the marker. As text, the two are one
        lexeme (text that ends at its first marker): llguidance's lexer takes the longest match
        and does not back up, so a free-text lexeme followed by the marker would swallow it."""
        free = rf"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(marker)}.*)/"
        if marker in fmt.special:
            return [f"lead: TEXT {mark(marker)}", free]
        m = re.escape(marker)
        return ["lead: LEAD", free, rf"LEAD: /(?s:.*){m}/ & ~/(?s:.*{m}.+)/"]

    family = fmt.family
    if family == "hermes":
        call = _compact(_any_call(tools))
        rules = [
            f"start: TEXT | lead body{' (open body)*' if parallel else ''}",
            f"open: {mark('<tool_call>')}",
            f"body: WS? %json {json.dumps(call)} WS? {mark('</tool_call>')} WS?",
            *text_then("<tool_call>"),
        ]
    elif family == "mistral":
        array = _compact({"type": "array", "items": _any_call(tools), "minItems": 1}
                         | ({} if parallel else {"maxItems": 1}))  # fmt: skip
        rules = [f"start: TEXT | lead WS? %json {json.dumps(array)}", *text_then("[TOOL_CALLS]")]
    else:
        key = "parameters" if family == "llama3_json" else "arguments"
        one = _compact(_any_call(tools, key))
        if family == "llama3_json":
            calls = 'call (WS? ";" WS? call)*' if parallel else "call"
            rules = [
                f"start: TEXT | WS? {mark('<|python_tag|>')}? WS? {calls}",
                f"call: %json {json.dumps(one)}",
            ]
        else:
            many = _compact({"type": "array", "items": _any_call(tools, key), "minItems": 1})
            rules = ["start: TEXT | WS? calls", f"calls: %json {json.dumps(one)}"
                     + (f" | %json {json.dumps(many)}" if parallel else "")]  # fmt: skip
        tag = re.escape(MARKERS["llama3_json"][0])
        rules.append(rf"TEXT: /(?s:.*)/ & ~/(?s:\s*(```(json)?\s*)?[\[{{].*)/ & ~/(?s:\s*{tag}.*)/")
    # whitespace around calls is bounded: a model may not spend its tokens on it
    return "\n".join(["%llguidance {}", *rules, r"WS: /[ \t\r\n]{1,8}/"])


def parse_constrained(text: str) -> list[ToolCall]:
    """The calls of constrained output (it is a call, or an array of them, by construction; a
    generation cut short by max_tokens is not, and gives none), each call's arguments the text
    the model wrote (what a stream of it sent)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    spans = _scan_calls(text)
    if len(spans) != len(items) or any(s is None or e is None for _, s, e in spans):
        return []
    return [
        ToolCall(x["name"], text[s:e])
        for x, (_, s, e) in zip(items, spans, strict=True)
        if isinstance(x, dict) and isinstance(x.get("name"), str) and isinstance(x.get("arguments"), dict)
    ]


class CallStream:
    """Tool-call deltas of a streamed answer, as OpenAI streams them: per call first its index, id,
    type and name with empty arguments, then the arguments' text in pieces as it is generated.

    ``constrained``: the output is ``call_schema`` JSON, so each call's name and arguments are
    found in the text as it grows. Else (``auto``) text streams as content until the family's
    format may start a call; from there the answer is held and parsed when it ends (a call that
    does not parse is content then)."""

    def __init__(self, family: str, tools: list[Tool], constrained: bool) -> None:
        self.family, self.tools, self.constrained = family, tools, constrained
        self.text = ""
        self.sent = 0  # characters of text already streamed as content (auto)
        self.held = False  # auto: a call may have started; hold the rest
        self.calls: list[ToolCall] = []  # constrained: each call's arguments so far are what was sent

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        """(content to stream, tool-call deltas) for the next piece of the answer."""
        self.text += piece
        if self.constrained:
            return "", self._scan()
        if self.held:
            return "", []
        start = self._call_start()
        head = self.text.lstrip()
        if start is None and self.sent == 0 and any(m.startswith(head) for m in _OPENERS):
            return "", []  # the answer so far may open a JSON answer: wait for more
        if start is None:
            # keep back what may be the beginning of a marker
            safe = len(self.text) - _partial_marker(self.text, self.family)
            out, self.sent = self.text[self.sent : safe], max(self.sent, safe)
            return out, []
        self.held = True
        out, self.sent = self.text[self.sent : start], start
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end of the answer."""
        if self.constrained:
            return "", self._scan()
        rest = self.text[self.sent :]
        if not self.held:
            return rest, []
        content, self.calls = parse_calls(rest, self.family, self.tools)
        return content or "", [_delta(i, c, c.arguments) for i, c in enumerate(self.calls)]

    def _call_start(self) -> int | None:
        t = self.text
        marker = _MARKERS.get(self.family)
        if marker is not None and marker in t:
            return t.find(marker)
        stripped = t.lstrip()
        if stripped[:1] in ("{", "[") or stripped.startswith(_OPENERS):
            return len(t) - len(stripped)  # a JSON answer from its first character
        return None

    def _scan(self) -> list[dict]:
        """Deltas for the calls found in the constrained JSON so far."""
        deltas = []
        for i, (name, args_start, args_end) in enumerate(_scan_calls(self.text)):
            if i == len(self.calls):
                if name is None:
                    break
                self.calls.append(ToolCall(name, ""))
                deltas.append(_delta(i, self.calls[i], ""))
            if args_start is None:
                continue
            end = args_end if args_end is not None else len(self.text)
            piece = self.text[args_start + len(self.calls[i].arguments) : end]
            if piece:
                self.calls[i].arguments += piece
                deltas.append({"index": i, "function": {"arguments": piece}})
        return deltas


def _delta(i: int, call: ToolCall, arguments: str) -> dict:
    return {
        "index": i,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


_MARKERS = {f: MARKERS[f][0] for f in ("hermes", "mistral")}  # where a family's call starts, anywhere
_OPENERS = ("```", *MARKERS["llama3_json"])  # besides { and [: what may open an answer that is all calls


def _partial_marker(text: str, family: str) -> int:
    """How many characters at the end of ``text`` may begin the family's call marker."""
    marker = _MARKERS.get(family)
    if marker is None:
        return 0
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_NAME_FIELD = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_FIELD = re.compile(r'"arguments"\s*:\s*')


def _scan_calls(text: str) -> list[tuple[str | None, int | None, int | None]]:
    """Per call object of constrained JSON so far: (its name once complete, where its arguments'
    text starts, where it ends once complete)."""
    out = []
    pos = 0
    while True:
        start = text.find("{", pos)
        if start < 0:
            return out
        m = _NAME_FIELD.match(text, _skip_to_key(text, start + 1))
        name = json.loads(f'"{m.group(1)}"') if m else None
        if m is None:
            out.append((None, None, None))
            return out
        a = _ARGS_FIELD.match(text, _skip_to_key(text, m.end()))
        if a is None:
            out.append((name, None, None))
            return out
        end = _value_end(text, a.end())
        out.append((name, a.end(), end))
        if end is None:
            return out
        pos = end


def _skip_to_key(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n,":
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """The end of the JSON object or array starting at ``i`` (None: not complete yet)."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None
