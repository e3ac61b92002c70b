"""The OpenAI-compatible server, end to end: a real `prism serve` process, the official `openai`
client, real SmolLM2 weights, real worker processes."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import ADMIN_KEY, API_KEY

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def metrics(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}, parsed as Prometheus text."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def admin(server, name: str, action: str, key: str | None = ADMIN_KEY, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{server.base_url}/admin/models/{name}/{action}", json=body or None, headers=headers, timeout=120
    )


def card(server, name: str) -> dict:
    r = httpx.get(f"{server.base_url}/models/{name}", headers={"Authorization": f"Bearer {API_KEY}"})
    r.raise_for_status()
    return r.json()


def test_chat_non_stream(client):
    r = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.model == "smol"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=24, temperature=0)
    assert again.choices[0].message.content == choice.message.content  # greedy is deterministic


def test_chat_stream_with_usage_matches_non_stream(client):
    whole = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model="smol", messages=QUESTION, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_a_repeated_prompt_reports_its_cached_tokens(client, server):
    """The second of two chats with one long system prompt reuses its KV: OpenAI's
    usage.prompt_tokens_details.cached_tokens says how many prompt tokens were not prefilled
    again, in the whole response and the stream's usage chunk, with the same greedy answer."""
    system = {"role": "system", "content": "You answer geography questions in one sentence. " * 12}
    messages = [system, *QUESTION]
    before = metrics(server)
    first = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
    again = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 16 <= cached < first.usage.prompt_tokens  # all but the last block
    assert again.choices[0].message.content == first.choices[0].message.content
    stream = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == first.choices[0].message.content
    )
    m = metrics(server)
    hits = sample(m, "vllm:prefix_cache_hits_total", model_name="smol") - sample(
        before, "vllm:prefix_cache_hits_total", model_name="smol"
    )
    queries = sample(m, "vllm:prefix_cache_queries_total", model_name="smol") - sample(
        before, "vllm:prefix_cache_queries_total", model_name="smol"
    )
    assert hits == 2 * cached and queries == 3 * first.usage.prompt_tokens
    assert card(server, "smol")["cached_kv_bytes"] > 0  # kept, not in use: reclaimable


def test_completion_token_ids_ignore_eos_and_stop(client, server):
    r = client.completions.create(
        model="smol", prompt=[1, 504, 3458, 282, 4649, 314], max_tokens=7, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"
    text = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0)
    stopped = client.completions.create(
        model="smol", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=["7"]
    )
    cut = text.choices[0].text.find("7")
    assert cut > 0, text.choices[0].text
    assert stopped.choices[0].text == text.choices[0].text[:cut]
    assert stopped.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="smol", messages=QUESTION, max_tokens=12, temperature=1.0, top_p=0.9)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert a == b


def test_two_models_at_once(server):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
        real = c.chat.completions.create(model="smol-b", messages=QUESTION, max_tokens=12, temperature=0)
        synthetic = c.completions.create(model="tiny", prompt="hello", max_tokens=9, temperature=0,
                                         extra_body={"ignore_eos": True})  # fmt: skip
        return await asyncio.gather(real, synthetic)

    real, synthetic = asyncio.run(main())
    assert "Paris" in real.choices[0].message.content
    assert synthetic.usage.completion_tokens == 9
    listing = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    cards = {c["id"]: c for c in listing["data"]}
    assert cards["smol-b"]["state"] == "active" and cards["tiny"]["state"] == "active"
    assert cards["tiny"]["synthetic"] is True and cards["smol-b"]["synthetic"] is False
    assert {cards["smol-b"]["device"], cards["tiny"]["device"]} <= {"cpu:0", "cpu:1"}


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert e.value.status_code == 404
    assert "no-such-model" in e.value.body["message"]


def test_bad_parameters_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=QUESTION, temperature=7)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=QUESTION, n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x " * 600, max_tokens=4)
    assert "maximum context length is 512" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="smol", prompt=[10**7], max_tokens=4)


def test_api_keys(server):
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(f"{server.base_url}/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert admin(server, "smol", "pin", key=None).status_code == 401
    assert admin(server, "smol", "pin", key=API_KEY).status_code == 403  # a user key is not an admin key


def test_unload_then_request_reactivates(client, server):
    client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=4, temperature=0)
    before = card(server, "smol")
    assert before["state"] == "active"
    r = admin(server, "smol", "unload")
    assert r.status_code == 200 and r.json()["evicted"] is True and r.json()["state"] == "evicted"
    stream = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=8, temperature=0,
                                            stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text
    after = card(server, "smol")
    assert after["state"] == "active"
    assert after["num_activations"] == before["num_activations"] + 1
    assert after["num_evictions"] == before["num_evictions"] + 1


def test_admin_load_pin_unpin(server):
    r = admin(server, "smol-b", "load")
    assert r.status_code == 200 and r.json()["state"] == "active"
    assert admin(server, "smol-b", "pin").json()["pinned"] is True
    assert admin(server, "smol-b", "unpin").json()["pinned"] is False
    assert admin(server, "nope", "load").status_code == 404


def test_client_disconnect_aborts_and_frees_kv(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": "a b c", "max_tokens": 400, "stream": True, "ignore_eos": True}
    before = metrics(server)
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass  # the first token arrived: the request is running
    # The connection is closed: the server must abort the request and free its KV.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(server)
        if (
            sample(m, "vllm:num_requests_running", model_name="tiny") == 0
            and sample(m, "vllm:kv_cache_usage_perc", model_name="tiny") == 0
        ):
            break
        time.sleep(0.2)
    assert sample(m, "vllm:num_requests_running", model_name="tiny") == 0
    assert sample(m, "vllm:kv_cache_usage_perc", model_name="tiny") == 0
    generated = sample(m, "vllm:generation_tokens_total", model_name="tiny") - sample(
        before, "vllm:generation_tokens_total", model_name="tiny"
    )
    assert generated < 400  # it never finished
    # and the model still serves
    c = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    assert (
        c.completions.create(
            model="tiny", prompt="x", max_tokens=3, extra_body={"ignore_eos": True}
        ).usage.completion_tokens
        == 3
    )


def test_overload_is_429_with_retry_after(server):
    """max_waiting_requests is 3: of 10 simultaneous long prompts, some must wait and be refused."""

    async def one(c: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"model": "smol", "prompt": f"{i} " + "word " * 400, "max_tokens": 2}
        return await c.post(f"{server.base_url}/completions", json=body, timeout=120)

    async def main():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            return await asyncio.gather(*(one(c, i) for i in range(10)))

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 3
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_exceeded"


def test_metrics_are_prometheus_text(server, client):
    before = metrics(server)
    out = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=4, temperature=0)
    m = metrics(server)

    def grew(name: str) -> float:
        return sample(m, name, model_name="smol") - sample(before, name, model_name="smol")

    # vLLM's per-request histograms: this one request, once each, with its own token counts
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "time_to_first_token_seconds",
                 "request_params_max_tokens", "request_params_n"):  # fmt: skip
        assert grew(f"vllm:{name}_count") == 1, name
    assert grew("vllm:request_params_max_tokens_sum") == 4 and grew("vllm:request_params_n_sum") == 1
    assert grew("vllm:request_prompt_tokens_sum") == out.usage.prompt_tokens
    assert grew("vllm:request_generation_tokens_sum") == out.usage.completion_tokens == 4
    for le, n in (("2.0", 0), ("5.0", 1)):  # vLLM's 1-2-5 buckets: 4 tokens are in le=5, not le=2
        bucket = ("vllm:request_generation_tokens_bucket", (("le", le), ("model_name", "smol")))
        assert m[bucket] - before.get(bucket, 0.0) == n, le
    queue = grew("vllm:request_queue_time_seconds_sum")
    prefill = grew("vllm:request_prefill_time_seconds_sum")
    decode = grew("vllm:request_decode_time_seconds_sum")
    assert prefill > 0 and decode > 0 and queue >= 0  # 4 tokens: a prefill step, then decode steps
    assert queue + prefill == pytest.approx(grew("vllm:time_to_first_token_seconds_sum"))  # the TTFT, split
    assert grew("vllm:request_inference_time_seconds_sum") == pytest.approx(prefill + decode)
    assert prefill + decode <= grew("vllm:e2e_request_latency_seconds_sum")
    # the engine's time: the request's steps took wall time and its worker's CPU
    for name in ("prism_engine_step_seconds_total", "prism_engine_cpu_seconds_total"):
        assert sample(m, name, model_name="smol") > sample(before, name, model_name="smol"), name
    assert sample(m, "vllm:time_to_first_token_seconds_count", model_name="smol") >= 1
    assert sample(m, "vllm:e2e_request_latency_seconds_count", model_name="smol") >= 1
    assert sample(m, "vllm:prompt_tokens_total", model_name="smol") > 0
    assert sample(m, "vllm:generation_tokens_total", model_name="smol") > 0
    assert ("vllm:inter_token_latency_seconds_count", (("model_name", "smol"),)) in m
    assert sample(m, "prism_model_activations_total", model_name="smol") >= 1
    assert (
        sample(m, "prism_activation_seconds_count", device=card(server, "smol")["device"], model_name="smol")
        >= 1
    )
    budgets = [v for (name, _), v in m.items() if name == "prism_device_budget_bytes"]
    assert budgets == [2 * 2**30, 2 * 2**30]
    mapped = {
        dict(labels)["device"]: v for (name, labels), v in m.items() if name == "prism_device_mapped_bytes"
    }
    assert set(mapped) == {"cpu:0", "cpu:1"} and sum(mapped.values()) > 0
    att = sample(m, "prism_slo_attainment", model_name="smol", slo="ttft")
    assert 0 < att <= 1
    states = [dict(labels) for (name, labels), v in m.items() if name == "prism_model_state" and v == 1]
    assert {s["model_name"] for s in states} == {"smol", "smol-b", "tiny"}
