"""``POST /v1/responses`` against a real `prism serve` with the official openai client: text, a forced
function call, a call's output sent back as input items, a JSON schema text format, streamed as
Responses events; and what a stateless server refuses (store, previous_response_id), named."""

from __future__ import annotations

import json

import openai
import pytest
from jsonschema import validate

from prism_serve.api.responses import to_chat
from prism_serve.errors import InvalidRequestError
from tests.api.conftest import API_KEY

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = "What is the weather in Paris?"


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def test_input_items_become_a_chat_conversation():
    chat = to_chat({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "A"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "B"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "21"},
            {"type": "reasoning", "summary": []},
        ],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    })  # fmt: skip
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][1] == {"role": "user", "content": ASK}
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]  # one assistant turn
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "21"}
    assert len(chat["messages"]) == 4 and chat["max_tokens"] == 9
    assert chat["tools"][0]["function"]["name"] == "get_weather"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "store": True}, "store"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "web_search_call"}]}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ],
)
def test_what_a_stateless_server_cannot_honour_is_named(body, param):
    with pytest.raises(InvalidRequestError) as e:
        to_chat({"model": "m", **body})
    assert e.value.param == param


def test_text_streamed_and_not(client):
    kw = dict(model="smol", input="What is the capital of France?", instructions="Answer in one sentence.",
              max_output_tokens=24, temperature=0)  # fmt: skip
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete") and "Paris" in r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text == events[-1].response.output_text  # greedy: the same answer


def test_a_forced_function_call_and_its_output_sent_back(client):
    pick = {"type": "function", "name": "get_weather"}
    kw = dict(model="smol", input=ASK, tools=[WEATHER], tool_choice=pick, max_output_tokens=60, temperature=0)
    r = client.responses.create(**kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(**kw, stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == call.arguments and events[-1].type == "response.completed"
    answer = client.responses.create(
        model="smol", tools=[WEATHER], max_output_tokens=24, temperature=0,
        input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}],
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete") and answer.output


def test_a_json_schema_text_format_is_followed(client):
    city = {"city": {"type": "string", "maxLength": 30}}
    schema = {"type": "object", "properties": city, "required": ["city"], "additionalProperties": False}
    r = client.responses.create(
        model="smol", input="Name a city in France.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "City", "schema": schema, "strict": True}},
    )  # fmt: skip
    validate(json.loads(r.output_text), schema)


def test_refusals_are_400_naming_the_parameter(client):
    refused = [({"store": True}, "store"), ({"previous_response_id": "resp_x"}, "previous_response_id"),
               ({"max_output_tokens": 0}, "max_output_tokens")]  # fmt: skip
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="smol", input="hi", **extra)
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")
