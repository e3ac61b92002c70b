"""What existing clients and tools send and expect, against a real `prism serve` process: vLLM-style
leniency, /tokenize, /detokenize, /version, X-Request-Id, CORS, a draining admin unload, and the
operator CLI (`prism ps`, `prism load|unload|pin|unpin`)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from prism_serve.api.server import PrismServer
from prism_serve.cli import main as prism_main
from prism_serve.config import CorsConfig, DeploymentConfig, ServerConfig
from tests.api.conftest import ADMIN_KEY, API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def test_unknown_fields_and_neutral_values_are_accepted_and_logged_once(client, server):
    # what `vllm bench serve` and other clients send along: neutral values and fields we do not know
    extra = {"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "logit_bias": {},
             "presence_penalty": 0.0, "frequency_penalty": 0.0, "no_such_field_xyz": {"a": 1},
             "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}  # fmt: skip
    for _ in range(2):
        r = client.chat.completions.create(
            model="smol", messages=QUESTION, max_tokens=8, temperature=0, extra_body=extra
        )
        assert "Paris" in r.choices[0].message.content
    log = server.log_text()
    assert log.count("ignoring unknown request field(s): no_such_field_xyz") == 1
    r = client.completions.create(
        model="smol", prompt="Hi", max_tokens=2, extra_body={"no_such_field_xyz": 1}
    )
    assert r.usage.completion_tokens == 2


def test_what_cannot_be_honoured_is_still_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=QUESTION, n=17)  # above MAX_CHOICES
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt="Hi", best_of=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=QUESTION, extra_body={"repetition_penalty": -1})
    assert e.value.body["param"] == "repetition_penalty"
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model="smol", messages=QUESTION, logit_bias={"abc": 1})
    with pytest.raises(openai.BadRequestError, match="image"):
        client.chat.completions.create(model="smol", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
        ])  # fmt: skip


def test_models_show_root_and_context_and_no_server_paths(client):
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert cards["smol"]["root"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cards["tiny"]["root"] == "random:smollm2-135m"
    assert cards["tiny"]["max_model_len"] == 512 and cards["smol-b"]["max_model_len"] == 8192
    for card in cards.values():
        assert not card["source"].startswith("/") and not card["root"].startswith("/")
        assert card["dtype"] in ("float32", "bfloat16")


def test_a_models_sampling_defaults_apply_where_the_request_says_nothing(client):
    """tiny's config sets temperature 0 and max_tokens 6: a request without them decodes greedily
    and stops at 6 tokens; a value in the request wins, even one equal to OpenAI's default."""
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert cards["tiny"]["sampling_defaults"] == {"temperature": 0.0, "max_tokens": 6}
    assert cards["smol"]["sampling_defaults"] == {}  # the GGUF has no generation config

    def tokens(**kw) -> list[float]:  # what it sampled, by logprob (random weights' tokens have no text)
        r = client.completions.create(model="tiny", prompt="one two", logprobs=1, **kw)
        return r.choices[0].logprobs.token_logprobs

    plain = [tokens(seed=i) for i in range(2)]
    assert plain[0] == plain[1] == tokens(temperature=0, max_tokens=6) and len(plain[0]) == 6
    # random weights sample near uniformly over 49,152 tokens: at temperature 1 seeds differ
    assert tokens(temperature=1.0, seed=1, max_tokens=6) != tokens(temperature=1.0, seed=2, max_tokens=6)
    longer = client.completions.create(
        model="tiny", prompt="one two", max_tokens=9, extra_body={"ignore_eos": True}
    )
    assert longer.usage.completion_tokens == 9


def test_tokenize_and_detokenize_agree_with_the_completion_routes(client, server):
    post = lambda path, body: httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)  # noqa: E731
    r = post("/tokenize", {"model": "smol", "prompt": "The capital of France is"})
    assert r.status_code == 200, r.text
    tok = r.json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > tok["count"]
    done = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=1)
    assert done.usage.prompt_tokens == tok["count"]
    back = post("/detokenize", {"model": "smol", "tokens": tok["tokens"]}).json()["prompt"]
    assert back.endswith("The capital of France is")

    chat = post("/tokenize", {"model": "smol", "messages": QUESTION}).json()
    done = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=1)
    assert done.usage.prompt_tokens == chat["count"]

    assert post("/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    bad = post("/detokenize", {"model": "smol", "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post("/tokenize", {"model": "smol"}).status_code == 400  # neither prompt nor messages
    assert httpx.post(f"{server.url}/tokenize", json={"model": "smol", "prompt": "x"}).status_code == 401


def test_version_and_request_ids(server):
    v = httpx.get(f"{server.url}/version")
    assert v.status_code == 200 and v.json()["version"]
    assert len(v.headers["x-request-id"]) >= 16  # generated when the client sends none
    mine = {"x-request-id": "trace-42", **AUTH}
    ok = httpx.get(f"{server.base_url}/models", headers=mine)
    assert ok.headers["x-request-id"] == "trace-42"
    err = httpx.post(f"{server.base_url}/completions", json={"model": "nope", "prompt": "x"}, headers=mine)
    assert err.status_code == 404 and err.headers["x-request-id"] == "trace-42"
    body = {"model": "smol", "prompt": "Hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=mine, timeout=60) as s:
        assert s.headers["x-request-id"] == "trace-42" and "[DONE]" in s.read().decode()


def _app(cors: CorsConfig | None) -> TestClient:
    config = DeploymentConfig(devices={"count": 1, "memory": "1GiB"}, models=[{"name": "m"}],
                              server=ServerConfig(cors=cors))  # fmt: skip
    return TestClient(PrismServer(config).app)  # no lifespan: the controller never starts


def test_cors_only_when_configured():
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    on = _app(CorsConfig(allow_origins=["https://ui.example"]))
    r = on.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = on.get("/version", headers={"Origin": "https://ui.example"})
    assert r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    r = on.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    off = _app(None)
    assert (
        "access-control-allow-origin"
        not in off.get("/version", headers={"Origin": "https://ui.example"}).headers
    )


def test_admin_unload_drains_running_requests_unless_forced(server):
    async def main(force: bool):
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as c:
            body = {
                "model": "smol-b",
                "prompt": "Count:",
                "max_tokens": 48,
                "ignore_eos": True,
                "stream": True,
            }
            async with c.stream("POST", "/completions", json=body) as s:
                lines = s.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # streaming
                unload = asyncio.ensure_future(c.post(
                    "/admin/models/smol-b/unload", json={"force": force},
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                ))  # fmt: skip
                rest = [line async for line in lines]
            return (await unload).json(), "".join(rest)

    card, rest = asyncio.run(main(force=False))
    assert card["evicted"] is True and card["state"] == "evicted"
    assert '"finish_reason":"length"' in rest and '{"error":' not in rest  # it finished first
    card, rest = asyncio.run(main(force=True))
    assert card["evicted"] is True and '{"error":' in rest and "unloaded" in rest


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = prism_main(list(argv))
    return code, out.getvalue()


def test_operator_cli_against_the_running_server(server):
    keys = ["--url", server.url]
    code, out = _cli("load", "tiny", *keys, "--admin-key", ADMIN_KEY)
    assert code == 0 and out.startswith("tiny: ") and "state active" in out
    code, out = _cli("ps", *keys, "--api-key", API_KEY)
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["MODEL", "STATE", "DEVICE"]
    by_name = {r.split()[0]: r.split() for r in rows}
    assert set(by_name) == {"smol", "smol-b", "tiny"} and by_name["tiny"][1] == "active"
    assert "max=6,temp=0" in by_name["tiny"] and "-" in by_name["smol"]  # the sampling defaults
    assert _cli("pin", "tiny", *keys, "--admin-key", ADMIN_KEY)[0] == 0
    cards = {c["id"]: c for c in json.loads(_cli("ps", *keys, "--api-key", API_KEY, "--json")[1])}
    assert cards["tiny"]["pinned"] is True and cards["smol"]["pinned"] is False
    assert _cli("unpin", "tiny", *keys, "--admin-key", ADMIN_KEY)[0] == 0
    code, out = _cli("unload", "tiny", *keys, "--admin-key", ADMIN_KEY)
    assert code == 0 and "evicted" in out
    assert _cli("pin", "nope", *keys, "--admin-key", ADMIN_KEY)[0] == 2  # the server's 404, said
    assert _cli("ps", "--url", "http://127.0.0.1:9", "--api-key", API_KEY)[0] == 2  # nothing there


def test_chat_logprobs_streamed_and_not(client):
    r = client.chat.completions.create(
        model="smol", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and "".join(c.token for c in content).strip()
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        tops = [t.logprob for t in c.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy
    stream = client.chat.completions.create(
        model="smol", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        t for ch in stream if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [c.token for c in content]
    assert [t.logprob for t in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_echo_with_logprobs_scores_the_prompt(client):
    """What lm-eval-harness's loglikelihood tasks send: echo + logprobs, max_tokens 1 (0 in some)."""
    prompt = "The capital of France is Paris"
    r = client.completions.create(
        model="smol", prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0
    )
    choice = r.choices[0]
    lp = choice.logprobs
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(lp.token_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no prefix
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text and lp.text_offset == sorted(lp.text_offset)
    assert all(tok in top for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
    # " Paris" after "The capital of France is" is likely; " banana" is not
    other = (
        client.completions.create(
            model="smol", prompt="The capital of France is banana", max_tokens=1, echo=True, logprobs=0
        )
        .choices[0]
        .logprobs
    )
    assert lp.token_logprobs[r.usage.prompt_tokens - 1] > other.token_logprobs[-2]
    again = dict(model="smol", prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0)
    streamed = list(client.completions.create(**again, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices).startswith(prompt)
    toks = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert toks == lp.tokens


def test_logit_bias_and_penalties_reach_the_engine(client, server):
    ids = httpx.post(
        f"{server.url}/tokenize", json={"model": "smol", "prompt": " banana"}, headers=AUTH
    ).json()
    forced = ids["tokens"][-1]
    r = client.completions.create(model="smol", prompt="Hello", max_tokens=5, temperature=0, logprobs=0,
                                  logit_bias={str(forced): 100})  # fmt: skip
    banana = httpx.post(f"{server.url}/detokenize", json={"model": "smol", "tokens": [forced]}, headers=AUTH)
    assert r.choices[0].logprobs.tokens == [banana.json()["prompt"]] * 5
    base = dict(model="smol", messages=QUESTION, max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**base).choices[0].message.content
    penalised = client.chat.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0,
                                               extra_body={"repetition_penalty": 1.5})  # fmt: skip
    assert penalised.choices[0].message.content != plain
    short = client.chat.completions.create(**base, extra_body={"min_tokens": 20})
    assert short.usage.completion_tokens >= 20


def test_structured_output_parses_as_the_openai_client_expects(client):
    from pydantic import BaseModel, ConfigDict

    class City(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        country: str

    r = client.beta.chat.completions.parse(
        model="smol", messages=[{"role": "user", "content": "Name a city in France as JSON."}],
        response_format=City, max_tokens=64, temperature=0,
    )  # fmt: skip
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name and r.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(
        model="smol", messages=QUESTION, response_format={"type": "json_object"}, max_tokens=48, temperature=0
    )
    # an open object may run to max_tokens: what the grammar guarantees is that it is one
    assert anything.choices[0].message.content.lstrip().startswith("{")
    with pytest.raises(openai.BadRequestError, match=r"json_schema\.schema"):
        client.chat.completions.create(
            model="smol",
            messages=QUESTION,
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        )
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model="smol", messages=QUESTION, response_format={"type": "xml"})


def test_n_choices_non_streamed_and_streamed(client, server):
    """n > 1: each choice its own sample (seed + index, as vLLM does), the prompt counted once."""
    base = dict(model="smol", messages=QUESTION, max_tokens=12, temperature=1.0, seed=7)
    one = client.chat.completions.create(**base)
    three = client.chat.completions.create(**base, n=3, logprobs=True)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == one.choices[0].message.content  # choice 0: the same seed
    assert len({c.message.content for c in three.choices}) > 1  # sampled apart
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == sum(len(c.logprobs.content) for c in three.choices)
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    stream = client.chat.completions.create(**base, n=3, stream=True, stream_options={"include_usage": True})
    usage = None
    for ch in stream:
        usage = ch.usage or usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in three.choices}
    assert set(finished) == {0, 1, 2} and usage.completion_tokens == three.usage.completion_tokens
    # completions, streamed, with echo: every choice starts with the prompt
    r = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=6, n=2, echo=True,
                                  temperature=0, stream=True)  # fmt: skip
    by_index: dict[int, str] = {}
    for ch in r:
        for c in ch.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert sorted(by_index) == [0, 1] and by_index[0] == by_index[1]  # greedy: the same text
    assert by_index[0].startswith("Once upon a time") and len(by_index[0]) > len("Once upon a time")


def test_a_dropped_stream_of_n_choices_aborts_every_choice(server):
    body = {"model": "smol", "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "n": 3,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        seen: set[int] = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if seen == {0, 1, 2}:
                break  # hang up with every choice running
    for _ in range(100):
        card = httpx.get(f"{server.url}/v1/models/smol", headers=AUTH).json()
        if card["num_running"] == 0 and card["num_queued"] == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert card["num_running"] == 0 and card["num_queued"] == 0


def test_several_prompts_in_one_completion_request(client):
    """lm-eval batches prompts (token id lists) into one request: choice i * n + j is sample j of
    prompt i, each prompt counted once in usage."""
    one = client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=5, temperature=0
    )
    two = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=5, temperature=0)
    both = client.completions.create(
        model="smol",
        prompt=["The capital of France is", "Once upon a time"],
        max_tokens=5,
        temperature=0,
        n=2,
    )
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [one.choices[0].text] * 2 + [two.choices[0].text] * 2
    assert both.usage.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
    assert both.usage.completion_tokens == 4 * 5
    ids = [[504, 3575, 282, 4649, 314], [9470, 2724, 253, 655]]
    streamed = client.completions.create(model="smol", prompt=ids, max_tokens=3, temperature=0, stream=True)
    texts: dict[int, str] = {}
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1] and all(texts.values())
    with pytest.raises(openai.BadRequestError, match="prompt is empty"):
        client.completions.create(model="smol", prompt=[[1, 2], []], max_tokens=2)


def test_max_tokens_zero_with_echo_scores_the_prompt_only(client):
    prompt = "The capital of France is Paris"
    scored = client.completions.create(model="smol", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    assert (
        len(choice.logprobs.tokens) == scored.usage.prompt_tokens
        and choice.logprobs.token_logprobs[0] is None
    )
    with_one = client.completions.create(model="smol", prompt=prompt, max_tokens=1, echo=True, logprobs=1)
    # the prompt's logprobs are the same as when one token is generated after it
    n = scored.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        with_one.choices[0].logprobs.token_logprobs[1:n]
    )
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="smol", prompt=prompt, max_tokens=0)
