"""Hostile input against the real server: values the engine or the IPC cannot carry, bad Unicode,
loose types, oversized bodies, and a large prompt next to small requests. Each must get its own
4xx and leave nothing registered: the model keeps serving and every counter returns to zero."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from prism_serve.api.protocol import ChatCompletionRequest
from tests.api.conftest import ADMIN_KEY, API_KEY
from tests.api.test_server import admin, metrics, sample

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HUGE = 2**70  # fits no 64-bit integer


def post(server, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    headers = {**AUTH, "content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=120, **kw)


def chat(model: str = "tiny", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_idle(server) -> None:
    """Nothing running or waiting for any model (the server's own view, through /metrics)."""
    m = metrics(server)
    for model in ("smol", "smol-b", "tiny"):
        assert sample(m, "vllm:num_requests_running", model_name=model) == 0, model
        assert sample(m, "vllm:num_requests_waiting", model_name=model) == 0, model


def serves(server, model: str = "tiny") -> None:
    r = post(server, "/v1/chat/completions", chat(model))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    "extra",
    [{"seed": HUGE}, {"seed": -HUGE}, {"top_k": HUGE}, {"stop_token_ids": [HUGE]}, {"max_tokens": HUGE}],
    ids=["seed", "negative-seed", "top_k", "stop_token_ids", "max_tokens"],
)
def test_integers_beyond_64_bits_are_400_and_leave_nothing_behind(server, extra):
    param = next(iter(extra))
    # More of them than the model's running limit (32): a leak per request would block the model.
    for _ in range(40):
        assert_error(post(server, "/v1/chat/completions", chat(**extra)), 400, param)
    assert_idle(server)
    serves(server)


def test_bad_values_while_the_model_is_evicted_do_not_break_its_activation(server):
    assert admin(server, "tiny", "unload").status_code == 200

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as c:
            bad = {"model": "tiny", "prompt": "x", "seed": HUGE}
            good = {"model": "tiny", "prompt": "x", "max_tokens": 3}
            sends = [c.post("/completions", json=bad) for _ in range(8)]
            return await asyncio.gather(*sends, *(c.post("/completions", json=good) for _ in range(2)))

    *bad, g1, g2 = asyncio.run(main())
    assert all(r.status_code == 400 for r in bad), [r.text for r in bad]
    assert g1.status_code == g2.status_code == 200, (g1.text, g2.text)
    assert_idle(server)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a\ud800"}]), "messages"),
        ("/v1/chat/completions", chat(stop=["\udfff"]), "stop"),
        ("/v1/completions", {"model": "tiny", "prompt": "x\ud800y"}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [1, True, 3]}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [1.0, 2]}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": 1}, "stream"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
        ("/v1/chat/completions", chat(logprobs=0), "logprobs"),
        ("/v1/chat/completions", chat(top_k=True), "top_k"),
        ("/v1/chat/completions", chat(seed=False), "seed"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": True}, "best_of"),  # true == 1
        ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 1.0}, "best_of"),
    ],
    ids=[
        "surrogate-content",
        "surrogate-stop",
        "surrogate-prompt",
        "bool-token-id",
        "float-token-id",
        "float-max-tokens",
        "int-stream",
        "str-bool",
        "logprobs-0",
        "bool-top-k",
        "bool-seed",
        "bool-best-of",
        "float-best-of",
    ],
)
def test_loose_types_and_bad_unicode_are_400(server, path, body, param):
    # json.dumps escapes a lone surrogate as \ud800: the body is valid JSON, the string is not Unicode
    assert_error(post(server, path, body), 400, param)


def test_unknown_model_name_is_not_echoed_in_full(server):
    name = "m" * 1_000_000
    r = post(server, "/v1/chat/completions", chat(name))
    err = assert_error(r, 404)
    assert len(r.content) < 1000 and "chars" in err["message"]


def test_admin_input_is_checked(server):
    for device in ("cpu:7", "../../x"):
        err = assert_error(admin(server, "tiny", "load", device=device), 400)
        assert "cpu:0" in err["message"]  # it names the configured devices
    assert_error(admin(server, "tiny", "unload", force=0), 400, "force")
    # earlier tests may have placed tiny on either device: start from evicted, then pick cpu:0 by hand
    assert admin(server, "tiny", "unload", force=True).status_code == 200
    assert admin(server, "tiny", "load", device="cpu:0").status_code == 200
    err = assert_error(admin(server, "tiny", "load", device="cpu:1"), 409)  # active elsewhere: say so
    assert "cpu:0" in err["message"]
    assert admin(server, "tiny", "load", device="cpu:0").json()["device"] == "cpu:0"  # same device: fine


def test_body_over_the_limit_is_413_before_it_is_read(server):
    big = json.dumps({"model": "tiny", "prompt": "x" * (3 * 2**20)}).encode()
    err = assert_error(post(server, "/v1/completions", big), 413)
    assert "2 MiB" in err["message"] or "2.0 MiB" in err["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(f"{server.base_url}/completions", content=chunks(), timeout=60,
                   headers={**AUTH, "content-type": "application/json"})  # fmt: skip
    assert_error(r, 413)
    serves(server)


def test_a_large_prompt_does_not_hold_up_small_requests(server):
    """A 650 KB prompt for the 8192-token model must be tokenized to learn it is too long (its
    length alone does not prove it); that happens off the event loop, so /health and a small request
    sent after it (tokenized and refused: no engine time involved) are answered first."""
    text = "hello world, tokens for everyone. " * 19_000  # ~650 KB, ~110k tokens
    assert len(text) // 81 < 8192  # below the no-tokenization bound (SmolLM2: <= 81 chars a token)
    big = {"model": "smol-b", "prompt": text, "max_tokens": 1}
    small = {"model": "tiny", "prompt": "x", "max_tokens": 10_000}  # beyond its 512-token context
    order: list[str] = []

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:

            async def large():
                r = await c.post("/v1/completions", json=big)
                order.append("large")
                return r

            tasks = [asyncio.create_task(large())]
            await asyncio.sleep(0.05)  # the large body is sent and being worked on
            answer = await c.post("/v1/completions", json=small)
            order.append("small")
            while not all(t.done() for t in tasks):
                assert (await c.get("/health")).status_code == 200
                order.append("health")
            return answer, [await t for t in tasks]

    answer, large = asyncio.run(main())
    assert_error(answer, 400, "prompt")
    for r in large:
        assert_error(r, 400, "prompt")
        assert "maximum context length is 8192" in r.json()["error"]["message"]
    assert order.index("small") < order.index("large"), order
    last_large = max(i for i, what in enumerate(order) if what == "large")
    assert "health" in order[:last_large], order  # answered while a large prompt was still in work


def test_a_prompt_far_beyond_the_context_is_refused_without_tokenizing(server):
    r = post(server, "/v1/completions", {"model": "smol", "prompt": "word " * 300_000})
    err = assert_error(r, 400, "prompt")
    assert "at least" in err["message"]  # the bound, not a count: it was never tokenized


def test_openapi_describes_the_real_statuses(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    chat_op = schema["paths"]["/v1/chat/completions"]["post"]
    codes = set(chat_op["responses"])
    assert {"200", "400", "401", "404", "413", "429", "503", "504"} <= codes and "422" not in codes
    assert "text/event-stream" in chat_op["responses"]["200"]["content"]
    error_schema = chat_op["responses"]["400"]["content"]["application/json"]["schema"]
    assert error_schema["$ref"].endswith("ErrorResponse")
    assert "text/plain" in next(iter(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]))
    assert all("422" not in op["responses"] for item in schema["paths"].values() for op in item.values())


def test_admin_key_still_required(server):
    r = httpx.post(f"{server.base_url}/admin/models/tiny/pin", headers=AUTH, timeout=30)
    assert_error(r, 403)
    assert admin(server, "tiny", "unpin", key=ADMIN_KEY).status_code == 200


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_tool_schema_nested_150_deep_is_a_400_like_the_same_response_format(server, choice):
    """Every JSON schema a request sends is checked in one place (api/tools.py check_json_schema):
    nesting past the limit is a 400 naming the parameter, never a RecursionError's 500."""
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested_schema(150)}}
    err = assert_error(
        post(server, "/v1/chat/completions", chat(tools=[tool], tool_choice=choice)), 400, "tools"
    )
    assert "deeper than" in err["message"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested_schema(150)}}
    err = assert_error(
        post(server, "/v1/chat/completions", chat(response_format=fmt)), 400, "response_format"
    )
    assert "deeper than" in err["message"]
    assert_idle(server)
    # 60 levels, within the limit, pass and compile into the call's grammar (not served here: the
    # tool's schema in the prompt would be longer than this server's models take)
    tool["function"]["parameters"] = _nested_schema(60)
    assert ChatCompletionRequest.model_validate(chat(tools=[tool], tool_choice=choice)).tool_setup().tools


def test_an_adapter_refusal_is_an_invalid_request(server):
    """No model here has adapter slots: registering one is the caller's mistake (400,
    invalid_request_error), not an internal error."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nowhere"},
                   headers=headers, timeout=60)  # fmt: skip
    err = assert_error(r, 400)
    assert err["type"] == "invalid_request_error" and "max_loras" in err["message"], err
