"""Tool calling against a real `prism serve` with the official openai client: a forced call (named,
or required) always carries arguments valid for the tool's schema, streamed as OpenAI streams them;
a conversation with calls and results goes back to the model; bad tools and messages get a 400 naming
them. SmolLM2's template has no tool support, so the tools go into its system message."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from jsonschema import validate

from tests.api.conftest import API_KEY

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 40}},
            "required": ["tz"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def test_a_named_function_is_called_with_valid_arguments_streamed_and_not(client):
    kw = dict(model="smol", messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=80, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    assert choice.message.content is None and choice.finish_reason == "stop"  # OpenAI's, for a named call
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    assert len(deltas) > 2  # the arguments come in pieces, as they are generated
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # greedy
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_calls_validate_against_their_tools(client):
    for parallel in (True, False):
        r = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Weather in Oslo and the time in Tokyo?"}],
            tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel, max_tokens=120,
            temperature=0,
        )  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls"
        assert len(calls) == 1 or parallel
        for c in calls:
            validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_auto_answers_in_text_or_with_calls_never_an_error(client):
    for stream in (False, True):
        r = client.chat.completions.create(
            model="smol", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0, stream=stream
        )
        if stream:
            chunks = [c for c in r if c.choices]
            calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            calls, text = r.choices[0].message.tool_calls or [], r.choices[0].message.content or ""
        assert text or calls
        for c in calls:
            assert c.function.name == "get_weather" and isinstance(json.loads(c.function.arguments), dict)


def test_a_call_and_its_result_go_back_to_the_model(client, server):
    made = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                          max_tokens=80, temperature=0).choices[0].message  # fmt: skip
    result = {"role": "tool", "tool_call_id": made.tool_calls[0].id, "content": '{"temperature": 21}'}
    history = [*ASK, made.model_dump(exclude_none=True), result]
    r = client.chat.completions.create(model="smol", messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=24, temperature=0)  # fmt: skip
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    # the result reached the prompt: it is longer than the question by the call and the result
    auth = {"Authorization": f"Bearer {API_KEY}"}
    ask = httpx.post(f"{server.url}/tokenize", json={"model": "smol", "messages": ASK}, headers=auth).json()
    assert ask["count"] > 0
    assert r.usage.prompt_tokens > ask["count"] + 20


@pytest.mark.parametrize(
    ("extra", "param", "match"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
         "tools", "not a valid JSON schema"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice", "not in tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "21"}]},
         "messages", "answers no call"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_parameter(client, extra, param, match):
    body = {"model": "smol", "messages": ASK, "max_tokens": 4} | extra
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.post("/chat/completions", cast_to=dict, body=body)
    assert e.value.body["param"] == param
