"""Tool calls read back from model output (api/tools.py), on outputs in each family's recorded format,
whole and streamed piece by piece; the checks of tools, tool_choice and tool messages; and how a
template with and without tool support is given the conversation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.api.tools import (
    CallStream,
    ToolChoice,
    call_schema,
    check_tool_messages,
    parse_calls,
    parse_constrained,
    parse_tool_choice,
    parse_tools,
    parser_for_template,
    render_conversation,
)
from prism_serve.errors import InvalidRequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = parse_tools([WEATHER, TIME])

# what models of each family answer (the formats of their chat templates)
RECORDED = {
    "hermes": [  # Qwen 2.5 / 3, Hermes
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         None, [("get_weather", {"city": "Paris"})]),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
         "Let me check.", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ],
    "llama3_json": [  # Llama 3.1-3.3: with <|python_tag|> kept, or dropped as a special token
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
         None, [("get_weather", {"city": "Paris"})]),
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
         None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         None, [("get_weather", {"city": "Paris"})]),
        ('[{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),  # the marker dropped
    ],
    "json": [
        ('```json\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n```',
         None, [("get_weather", {"city": "Rome"})]),
    ],
}  # fmt: skip
# answers that look like calls but are not: they stay text, never an error
NOT_CALLS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',  # cut JSON
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not a tool here
    '{"name": "get_weather", "arguments": [1, 2]}',  # arguments not an object
    "{not json at all",
]


def cases():
    for family, rows in RECORDED.items():
        for text, content, calls in rows:
            yield family, text, content, calls


@pytest.mark.parametrize(("family", "text", "content", "calls"), list(cases()))
def test_each_family_reads_its_recorded_output(family, text, content, calls):
    got_content, got = parse_calls(text, family, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("family", list(RECORDED))
@pytest.mark.parametrize("text", NOT_CALLS)
def test_what_is_not_a_call_stays_text(family, text):
    assert parse_calls(text, family, TOOLS) == (text, [])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(cases())), st.lists(st.integers(1, 7), min_size=1, max_size=60))
def test_streamed_in_any_pieces_gives_what_the_whole_gives(case, cuts):
    """Content streamed before a call plus the call deltas equal the whole answer's parse, however
    the text is cut; no content is streamed that is part of a call."""
    family, text, content, calls = case
    stream = CallStream(family, TOOLS, constrained=False)
    streamed, deltas, i = "", [], 0
    for k in cuts:
        piece, i = text[i : i + k], i + k
        c, d = stream.feed(piece)
        streamed, deltas = streamed + c, deltas + d
        if i >= len(text):
            break
    if i < len(text):
        c, d = stream.feed(text[i:])
        streamed, deltas = streamed + c, deltas + d
    c, d = stream.finish()
    streamed, deltas = streamed + c, deltas + d
    assert "<tool_call>" not in streamed and "get_weather" not in streamed.replace("Let me check.", "")
    assert (streamed.strip() or None) == content
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == calls


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=40), st.booleans())
def test_constrained_calls_stream_their_arguments_in_pieces(cuts, parallel):
    """Under required / named the answer is call JSON: each call's id and name go first, then its
    arguments' text as it grows, which concatenated is the arguments of the whole answer."""
    tricky = {"city": "Saint-Étienne", "unit": "c", "n": {"a": [1, "}"]}}  # braces inside strings
    calls = [{"name": "get_weather", "arguments": tricky},
             {"name": "get_time", "arguments": {}}]  # fmt: skip
    text = json.dumps(calls if parallel else calls[0], ensure_ascii=False, separators=(",", ":"))
    stream = CallStream("hermes", TOOLS, constrained=True)
    deltas, i = [], 0
    for k in cuts:
        if i >= len(text):
            break
        c, d = stream.feed(text[i : i + k])
        assert c == ""
        deltas += d
        i += k
    if i < len(text):
        deltas += stream.feed(text[i:])[1]
    deltas += stream.finish()[1]
    heads = [d for d in deltas if "id" in d]
    assert [h["function"]["name"] for h in heads] == [c["name"] for c in (calls if parallel else calls[:1])]
    for h in heads:
        args = "".join(d["function"]["arguments"] for d in deltas if d["index"] == h["index"])
        assert json.loads(args) == (calls if parallel else calls[:1])[h["index"]]["arguments"]
    assert [json.loads(c.arguments) for c in stream.calls] == [
        c["arguments"] for c in (calls if parallel else calls[:1])
    ]
    assert parse_constrained(text)[0].name == "get_weather"


def test_the_constrained_schema_is_a_call_of_a_listed_tool():
    from jsonschema import validate
    from jsonschema.exceptions import ValidationError

    named = call_schema(TOOLS, ToolChoice("named", "get_weather"), parallel=True)
    validate({"name": "get_weather", "arguments": {"city": "Paris"}}, named)
    for bad in ({"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"unit": "c"}},
                {"name": "get_weather", "arguments": {"city": "P"}, "extra": 1}):  # fmt: skip
        with pytest.raises(ValidationError):
            validate(bad, named)
    required = call_schema(TOOLS, ToolChoice("required"), parallel=True)
    validate(
        [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "x"}}], required
    )
    with pytest.raises(ValidationError):
        validate([], required)  # at least one call
    single = call_schema(TOOLS, ToolChoice("required"), parallel=False)
    validate({"name": "get_time", "arguments": {}}, single)
    # numbers are decoded in millionths (no runaway decimals), nested ones too; enums are data
    nested = {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": ["number", "null"], "minimum": 1},
        "z": {"type": "array", "items": {"type": "object", "properties": {"w": {"type": "number"}}}},
        "m": {"type": "number", "multipleOf": 0.5}, "e": {"enum": [{"type": "number"}]},
    }}  # fmt: skip
    (tool,) = parse_tools([{"type": "function", "function": {"name": "n", "parameters": nested}}])
    args = call_schema([tool], ToolChoice("named", "n"), True)["properties"]["arguments"]["properties"]
    assert args["x"]["multipleOf"] == args["y"]["multipleOf"] == 1e-6 and args["m"]["multipleOf"] == 0.5
    assert args["z"]["items"]["properties"]["w"]["multipleOf"] == 1e-6
    assert args["e"] == nested["properties"]["e"]
    assert "multipleOf" not in nested["properties"]["x"]  # the tool's own schema is left as it was
    # only the parameters a tool declares, where it does not say others are allowed
    top = call_schema([tool], ToolChoice("named", "n"), True)["properties"]["arguments"]
    assert top["additionalProperties"] is False and args["z"]["items"]["additionalProperties"] is False


@pytest.mark.parametrize(
    ("tools", "match"),
    [
        ([{"type": "code_interpreter"}], "only function tools"),
        ([{"type": "function", "function": {"name": "has space"}}], "function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
         "not a valid JSON schema"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema object"),
        ([TIME, TIME], "already listed"),
    ],
)  # fmt: skip
def test_bad_tools_are_named(tools, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        parse_tools(tools)
    assert e.value.param == "tools"


def test_tool_choice_is_checked_against_the_tools():
    assert parse_tool_choice(None, TOOLS).mode == "auto" and parse_tool_choice(None, []).mode == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS).name == "get_time"
    for choice, match in (
        ({"type": "function", "function": {"name": "nope"}}, "not in tools"),
        ("sometimes", "must be none, auto, required"),
        ({"type": "function"}, "must name a function"),
    ):
        with pytest.raises(InvalidRequestError, match=match) as e:
            parse_tool_choice(choice, TOOLS)
        assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError, match="needs tools"):
        parse_tool_choice("required", [])


def message(role, content="", tool_calls=None, tool_call_id=None, name=None):
    m = SimpleNamespace(
        role=role, content=content, tool_calls=tool_calls, tool_call_id=tool_call_id, name=name
    )
    m.text = lambda: content or ""
    return m


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TURNS = [
    message("user", "Weather in Paris?"),
    message("assistant", None, tool_calls=[CALL]),
    message("tool", '{"temp": 21}', tool_call_id="call_1"),
]


def test_a_tool_message_must_answer_an_earlier_call():
    check_tool_messages(TURNS)
    for bad, match in (
        ([TURNS[0], message("tool", "x", tool_call_id="call_9")], "answers no call"),
        ([TURNS[0], message("tool", "x")], "needs the tool_call_id"),
    ):
        with pytest.raises(InvalidRequestError, match=match) as e:
            check_tool_messages(bad)
        assert e.value.param == "messages"


def test_a_template_without_tools_gets_them_in_the_system_message():
    msgs, tools = render_conversation(TURNS, TOOLS, ToolChoice("auto"), "{{ messages }}")
    assert tools is None and msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert (
        msgs[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert msgs[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    none, _ = render_conversation(TURNS, TOOLS, ToolChoice("none"), "{{ messages }}")
    assert none[0]["role"] == "user"  # under none the tools are not shown
    named, _ = render_conversation(TURNS[:1], TOOLS, ToolChoice("named", "get_time"), None)
    assert "You must call the function get_time." in named[0]["content"]


def test_a_template_with_tools_gets_them_and_the_calls_as_transformers_gives_them():
    template = "{% for t in tools %}{{ t.function.name }}{% endfor %}<tool_call>"
    msgs, tools = render_conversation(TURNS, TOOLS, ToolChoice("auto"), template)
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # a dict, not text
    assert msgs[2] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    assert parser_for_template(template) == "hermes"
    assert parser_for_template("[TOOL_CALLS] {{ x }}") == "mistral"
    assert parser_for_template("<|python_tag|>{{ x }}") == "llama3_json"
    assert parser_for_template(None) == "hermes"
