"""Agent frameworks against a real `prism serve`, unmodified: the openai-agents SDK (through chat
completions and through the Responses API), pydantic-ai, instructor's default (tools) mode and
smolagents' ToolCallingAgent. SmolLM2-135M is a weak tool user, so each test forces the call where the
framework lets it (a required or named tool_choice: decoding is then constrained to a valid call) and
checks what the framework did with it: the tool ran with arguments valid for its signature, its
result went back to the model, and the framework produced its result."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import BaseModel

from tests.clients.conftest import API_KEY, MODEL

CALLS: list[tuple[str, dict]] = []  # (tool, arguments) of every tool run, in order


class Recorder:
    """The JSON bodies a client sent, read off its own httpx client (what reached the wire)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def __call__(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.bodies.append(json.loads(await request.aread()))

    def sync(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.bodies.append(json.loads(request.read()))


def get_weather(city: str) -> str:
    """The current weather in a city."""
    CALLS.append(("get_weather", {"city": city}))
    return f"It is 21 degrees and sunny in {city}."


@pytest.fixture(autouse=True)
def fresh_calls():
    CALLS.clear()


def _async_openai(server, recorder: Recorder):
    from openai import AsyncOpenAI

    hooks = {"request": [recorder]}
    return AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                       http_client=httpx.AsyncClient(event_hooks=hooks, timeout=120))  # fmt: skip


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_calls_a_tool_and_uses_its_result(server, api):
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # no trace export (nothing here reaches the internet)
    recorder = Recorder()
    client = _async_openai(server, recorder)
    model_class = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
    agent = Agent(
        name="weather", instructions="Answer questions about the weather with the get_weather tool.",
        model=model_class(model=MODEL, openai_client=client), tools=[function_tool(get_weather)],
        # the first turn must call the tool; the SDK then resets tool_choice so the model can answer
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )  # fmt: skip
    from agents.exceptions import MaxTurnsExceeded

    try:
        result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
        assert isinstance(result.final_output, str)
    except MaxTurnsExceeded:
        # under auto a weak model may call the tool again each turn (the model's choice, not the
        # server's: on this project's host it answers); what the SDK did with the call is below
        pass
    assert CALLS and CALLS[0][0] == "get_weather" and isinstance(CALLS[0][1]["city"], str)
    # the tool's result went back to the model in the next request
    second = json.dumps(recorder.bodies[1])
    assert "It is 21 degrees and sunny in" in second
    if api == "responses":
        assert "function_call_output" in second and all(b.get("store") is not True for b in recorder.bodies)


class City(BaseModel):
    name: str
    country: str


def test_pydantic_ai_agent_with_a_tool_and_a_structured_result(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    recorder = Recorder()
    provider = OpenAIProvider(openai_client=_async_openai(server, recorder))
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=City, tools=[get_weather],
                  model_settings={"temperature": 0, "max_tokens": 64})  # fmt: skip
    result = agent.run_sync("Name a sunny city in France.", usage_limits=UsageLimits(request_limit=6))
    assert isinstance(result.output, City) and result.output.name and result.output.country
    # its structured result is a tool call the server decoded under the output schema
    assert any(b.get("tool_choice") == "required" for b in recorder.bodies)
    for name, args in CALLS:  # the model may check the weather first; its calls were valid
        assert name == "get_weather" and isinstance(args["city"], str)


def test_instructor_tools_mode(server):
    import instructor
    from openai import OpenAI

    recorder = Recorder()
    raw = OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                 http_client=httpx.Client(event_hooks={"request": [recorder.sync]}, timeout=120))  # fmt: skip
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    city = client.chat.completions.create(
        model=MODEL, response_model=City, temperature=0, max_tokens=64, max_retries=0,
        messages=[{"role": "user", "content": "Name a city in France and its country."}],
    )  # fmt: skip
    assert isinstance(city, City) and city.name and city.country
    (body,) = recorder.bodies
    assert body["tool_choice"] == {"type": "function", "function": {"name": "City"}}


def test_smolagents_tool_calling_agent(server):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: the city's name
        """
        return get_weather(city)

    model = OpenAIServerModel(model_id=MODEL, api_base=server.base_url, api_key=API_KEY, temperature=0,
                              max_tokens=64)  # fmt: skip
    agent = ToolCallingAgent(tools=[weather], model=model, max_steps=3, verbosity_level=0)
    answer = agent.run("What is the weather in Paris?")
    assert answer is not None
    steps = [s for s in agent.memory.steps if getattr(s, "tool_calls", None)]
    assert steps, "the agent made no tool call"
    names = [c.name for s in steps for c in s.tool_calls]
    assert set(names) <= {"weather", "final_answer"}
    for name, args in CALLS:
        assert name == "get_weather" and isinstance(args["city"], str)
