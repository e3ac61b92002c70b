"""Chat clients people point at an OpenAI-compatible server, unmodified, against a real `prism serve`:
LangChain's ChatOpenAI (with_structured_output by JSON schema and by function calling, bind_tools) and
LiteLLM. (The openai client's own `.parse()` with a
pydantic schema is covered in tests/api/test_dropin.py::
test_structured_output_parses_as_the_openai_client_expects.)"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from tests.clients.conftest import API_KEY, MODEL

ASK_CITY = "Name a city in France and its country."


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    country: str


class Recorder:
    """The JSON bodies a client sent, read off its own httpx client (what reached the wire)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.bodies.append(json.loads(request.read()))

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self]}, timeout=120)


def _chat(server, recorder: Recorder):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server.base_url, api_key=API_KEY, temperature=0, max_tokens=64,
                      max_retries=0, http_client=recorder.client())  # fmt: skip


@pytest.mark.parametrize("method", [None, "json_schema"])
def test_langchain_with_structured_output(server, method):
    """ChatOpenAI's default method is json_schema (langchain-openai >= 0.3): a response_format with
    the pydantic model's JSON Schema, strict, and no tools."""
    recorder = Recorder()
    kwargs = {} if method is None else {"method": method}
    city = _chat(server, recorder).with_structured_output(City, **kwargs).invoke(ASK_CITY)
    assert isinstance(city, City) and city.name and city.country
    (body,) = recorder.bodies
    assert "tools" not in body and "tool_choice" not in body
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "City"
    assert fmt["json_schema"]["schema"]["properties"].keys() == {"name", "country"}


def test_langchain_function_calling_structured_output(server):
    """method="function_calling" forces a tool call (tools + tool_choice naming the function); the
    call's arguments, decoded under the schema, are the structured result."""
    recorder = Recorder()
    structured = _chat(server, recorder).with_structured_output(City, method="function_calling")
    city = structured.invoke(ASK_CITY)
    assert isinstance(city, City) and city.name and city.country
    (body,) = recorder.bodies
    assert body["tools"][0]["function"]["name"] == "City"
    assert body["tool_choice"] == {"type": "function", "function": {"name": "City"}}


def test_langchain_bind_tools(server):
    """bind_tools with a forced tool: the AIMessage carries LangChain tool_calls with parsed args;
    the result goes back as a ToolMessage and the model answers in text."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_population(city: str) -> int:
        """The population of a city."""
        return 2_100_000

    recorder = Recorder()
    llm = _chat(server, recorder).bind_tools([get_population], tool_choice="get_population")
    question = HumanMessage("How many people live in Paris?")
    ai = llm.invoke([question])
    (call,) = ai.tool_calls
    assert call["name"] == "get_population" and isinstance(call["args"]["city"], str) and call["id"]
    result = ToolMessage(str(get_population.invoke(call["args"])), tool_call_id=call["id"])
    answer = _chat(server, recorder).bind_tools([get_population]).invoke([question, ai, result])
    assert isinstance(answer.content, str)
    sent = recorder.bodies[-1]["messages"][-1]
    assert sent == {"role": "tool", "content": "2100000", "tool_call_id": call["id"]}


@pytest.fixture(scope="module")
def litellm():
    # the bundled price map, not a download at import (there is no network here)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.telemetry = False
    return litellm


def test_litellm_completion_streamed_and_not(server, litellm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    base = dict(model=f"openai/{MODEL}", api_base=server.base_url, api_key=API_KEY, max_tokens=12,
                temperature=0, messages=question)  # fmt: skip
    r = litellm.completion(**base)
    text = r.choices[0].message.content
    assert "Paris" in text and r.usage.completion_tokens > 0
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(litellm.completion(**base, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same tokens either way
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_litellm_text_completion(server, litellm):
    r = litellm.text_completion(model=f"openai/{MODEL}", api_base=server.base_url, api_key=API_KEY,
                                prompt="The capital of France is", max_tokens=4, temperature=0)  # fmt: skip
    assert "Paris" in r.choices[0].text


def test_litellm_several_choices(server, litellm):
    """n > 1 through LiteLLM: n independent samples of one prompt, by index."""
    r = litellm.completion(model=f"openai/{MODEL}", api_base=server.base_url, api_key=API_KEY, n=2,
                           max_tokens=8, temperature=1.0, seed=7,
                           messages=[{"role": "user", "content": "Say a colour."}])  # fmt: skip
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices) and r.usage.completion_tokens > 0
