"""Tenants (``server.keys_file``, api/tenants.py): the sliding-minute arithmetic against a clock
of the test's own, then a real `prism serve` whose keys file gives each tenant its models and
limits, with the official `openai` client (its RateLimitError and the headers it sees), plain
HTTP streams, a reload on change and on SIGHUP, and streams that a reload does not cut."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prism_serve.api.process import stop_server_process
from prism_serve.api.tenants import (
    KeysFile,
    RateLimitError,
    Tenant,
    TenantEntry,
    Tenants,
    _duration,
    hash_key,
)
from prism_serve.control.types import Origin, Priority
from tests.api.conftest import ADMIN_KEY, API_KEY, shm_files, start_server

# ---- the arithmetic, on a clock of the test's own ---------------------------------------------


def _tenant(**limits) -> Tenant:
    return Tenant(TenantEntry(name="t", keys=[hash_key("k")], limits=limits))


def test_requests_per_minute_slide_with_the_window():
    t = _tenant(requests_per_minute=3)
    for now in (0.0, 1.0, 2.0):
        headers = t.admit(now)
        t.release()
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-limit-requests"] == "3"
    with pytest.raises(RateLimitError, match=r"3 requests in the last minute \(limit 3\)") as e:
        t.admit(30.0)
    assert e.value.retry_after == 30 and e.value.headers["x-ratelimit-reset-requests"] == "30s"
    assert t.admit(60.0)["x-ratelimit-remaining-requests"] == "0"  # the first left the window: 3 in it


def test_tokens_are_reserved_up_front_and_what_a_choice_did_not_use_comes_back():
    t = _tenant(tokens_per_minute=100)
    first, second = t.reserve([30, 30], 0.0)  # two choices: prompt plus max_tokens each
    t.settle(first, 20)  # it stopped early: 10 back
    assert t.headers(1.0)["x-ratelimit-remaining-tokens"] == "50"
    with pytest.raises(RateLimitError, match=r"50 tokens in the last minute \(limit 100\)") as e:
        t.reserve([60], 5.0)
    assert e.value.retry_after == 55  # both leave the window at 60 s
    with pytest.raises(RateLimitError, match=r"may use 101 tokens .* lower max_tokens"):
        t.reserve([101], 5.0)  # could never fit
    t.reserve([50], 5.0)  # exactly the room left
    t.settle(second, 30)
    assert t.headers(6.0)["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimitError):
        t.admit(6.0)  # at the limit: not even admitted
    assert t.reserve([50], 60.0)  # the first two left the window
    t.settle(first, 5)  # settling a reservation that left the window changes nothing now in it
    assert t.headers(60.0)["x-ratelimit-remaining-tokens"] == "0"


def test_concurrent_requests_count_until_released():
    t = _tenant(concurrent_requests=2)
    t.admit(0.0)
    t.admit(0.0)
    with pytest.raises(RateLimitError, match=r"2 requests in flight \(limit 2\)"):
        t.admit(0.0)
    t.release()
    t.admit(0.0)
    assert t.in_flight == 2


def test_reset_durations_are_written_as_openai_does():
    assert [_duration(s) for s in (0.25, 1.0, 59.2, 61.0, 600.0)] == ["250ms", "1s", "1m0s", "1m1s", "10m0s"]


def test_a_keys_file_stores_hashes_and_names_its_mistakes(tmp_path):
    path = tmp_path / "keys.yaml"
    cases = [
        ({"tenants": [{"name": "a", "keys": ["sk-plain"]}]}, "prism hash-key"),
        (
            {"tenants": [{"name": "a", "keys": [hash_key("x")]}, {"name": "a", "keys": [hash_key("y")]}]},
            "unique",
        ),
        (
            {"tenants": [{"name": "a", "keys": [hash_key("x")]}, {"name": "b", "keys": [hash_key("x")]}]},
            "both a and b",
        ),
        ({"tenants": [{"name": "default", "keys": [hash_key("x")]}]}, "api_keys"),
        ({"tenants": [{"name": "a", "keys": [hash_key("x")], "limits": {"rpm": 3}}]}, "rpm"),
        ({"tenants": [{"name": "a", "keys": [hash_key("x")], "priority": "urgent"}]}, "priority"),
        ({"tenants": [{"name": "a", "keys": [hash_key("x")], "weight": 0}]}, "weight"),
    ]
    for data, match in cases:
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ValueError, match=match):
            KeysFile.read(path)
    path.write_text(yaml.safe_dump({"tenants": [
        {"name": "a", "keys": [hash_key("ka")], "models": ["m-*"], "priority": "interactive", "weight": 3}
    ]}))  # fmt: skip
    tenants = Tenants(str(path), ["plain"])
    a = tenants.identify("ka")
    assert a is not None and a.name == "a" and a.may_use("m-1") and not a.may_use("n")
    # what admission sees of its requests: its class and its weight in the class's fair share
    assert a.origin == Origin("a", Priority.INTERACTIVE, 3.0)
    assert tenants.default.origin == Origin("default", Priority.STANDARD, 1.0)
    assert tenants.identify("plain") is tenants.default and tenants.default.may_use("anything")
    assert tenants.identify("kb") is None and tenants.identify("") is None


# ---- live ---------------------------------------------------------------------------------------

KEYS = {name: f"sk-{name}" for name in ("scope", "rpm", "tpm", "conc", "new")}
TENANTS = [
    # slo_scale: its SLOs 1/10,000 of its models' (3 ms to a first token): every request misses
    {"name": "scope", "keys": [hash_key(KEYS["scope"])], "models": ["tiny*"], "slo_scale": 0.0001,
     "priority": "interactive", "weight": 2.0},
    {"name": "rpm", "keys": [hash_key(KEYS["rpm"])], "limits": {"requests_per_minute": 4}},
    {"name": "tpm", "keys": [hash_key(KEYS["tpm"])], "limits": {"tokens_per_minute": 200}},
    {"name": "conc", "keys": [hash_key(KEYS["conc"])], "limits": {"concurrent_requests": 1}},
]

CONFIG = """
devices:
  - {{name: "cpu:0", memory: 2GiB, workers: 1}}
models:
  - {{name: tiny, source: "random:smollm2-135m", max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: tiny-b, source: "random:smollm2-135m", max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: private, source: "random:smollm2-135m", max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
policy: {{name: prism}}
server:
  api_keys: [{api_key}]
  admin_key: {admin_key}
  keys_file: "{keys_file}"
  namespace: "{{namespace}}"
"""


def write_keys(path: Path, tenants: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"tenants": tenants}))
    tmp.replace(path)  # whole: the server never reads half a file


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys.yaml"
    write_keys(keys, TENANTS)
    srv = start_server(tmp, CONFIG.format(api_key=API_KEY, admin_key=ADMIN_KEY, keys_file=keys))
    srv.keys = keys
    yield srv
    code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()
    assert shm_files(srv.namespace) == []


def client(server, tenant: str | None = None) -> openai.OpenAI:
    key = KEYS[tenant] if tenant else API_KEY
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


def ask(server, tenant: str | None, model: str = "tiny", max_tokens: int = 4):
    return client(server, tenant).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens, temperature=0
    )


def test_a_tenant_sees_and_calls_only_its_models(server):
    """Outside its list a model does not exist for the tenant: the same 404 as a name not served,
    on every route that names a model; the plain api_keys see everything."""
    c = client(server, "scope")
    assert sorted(m.id for m in c.models.list()) == ["tiny", "tiny-b"]
    assert sorted(m.id for m in client(server).models.list()) == ["private", "tiny", "tiny-b"]
    with pytest.raises(openai.NotFoundError) as hidden:
        c.chat.completions.create(model="private", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError) as missing:
        c.chat.completions.create(model="absent", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert hidden.value.body["message"] == missing.value.body["message"].replace("absent", "private")
    auth = {"Authorization": f"Bearer {KEYS['scope']}"}
    for method, path, body in [
        ("GET", "/v1/models/private", None),
        ("POST", "/tokenize", {"model": "private", "prompt": "hi"}),
        ("POST", "/v1/embeddings", {"model": "private", "input": "hi"}),
        ("POST", "/v1/rerank", {"model": "private", "query": "q", "documents": ["d"]}),
    ]:
        r = httpx.request(method, f"{server.url}{path}", json=body, headers=auth, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found", (path, r.text)
    before = slo_counts(server, "tiny-b")
    assert ask(server, "scope", "tiny-b").http_response.status_code == 200
    assert ask(server, None, "tiny-b").http_response.status_code == 200
    # judged by its tenant's scaled SLOs: the scope tenant's answer missed 3 ms, the plain key's met 30 s
    after = slo_counts(server, "tiny-b")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 2)
    # the dashboard shows every model: not for a tenant limited to some
    r = httpx.get(f"{server.url}/dashboard/state", headers=auth, timeout=60)
    assert r.status_code == 403 and "only some models" in r.json()["error"]["message"]
    r = httpx.get(
        f"{server.url}/dashboard/state", headers={"Authorization": f"Bearer {KEYS['rpm']}"}, timeout=60
    )
    assert r.status_code == 200
    # a tenant's key is known but is not the admin key: 403 on the admin routes
    r = httpx.post(f"{server.url}/v1/admin/models/tiny/pin", headers=auth, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_denied"
    # a key no tenant has is a 401
    with pytest.raises(openai.AuthenticationError):
        client(server, "scope").with_options(api_key="sk-wrong").models.list()


def test_requests_over_the_minutes_limit_get_429_with_openais_headers(server):
    remaining = []
    for _ in range(4):
        r = ask(server, "rpm")
        assert r.http_response.headers["x-ratelimit-limit-requests"] == "4"
        remaining.append(r.http_response.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["3", "2", "1", "0"]
    with pytest.raises(openai.RateLimitError, match="requests in the last minute") as e:
        ask(server, "rpm")
    headers = e.value.response.headers
    assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-remaining-requests"] == "0"
    assert ask(server, None).http_response.status_code == 200  # another tenant is not held up
    m = tenant_metrics(server)
    assert m["prism_tenant_requests_total", "rpm", None] == 4
    assert m["prism_tenant_rate_limited_total", "rpm", "requests"] == 1
    assert m["prism_tenant_rate_limited_total", "rpm", "tokens"] == 0


def test_operators_see_each_tenants_limits_and_use(server, capsys):
    """GET /v1/admin/tenants (the admin key) and `prism tenants`, which prints it."""
    from prism_serve.cli import main

    r = httpx.get(
        f"{server.url}/v1/admin/tenants", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    cards = {c["tenant"]: c for c in r.json()["data"]}
    assert set(cards) >= {"scope", "rpm", "tpm", "conc", "default"}
    assert cards["scope"]["models"] == ["tiny*"] and cards["rpm"]["limits"]["requests_per_minute"] == 4
    assert (cards["scope"]["slo_scale"], cards["rpm"]["slo_scale"]) == (0.0001, 1.0)
    assert (cards["scope"]["priority"], cards["scope"]["weight"]) == ("interactive", 2.0)
    assert (cards["rpm"]["priority"], cards["rpm"]["weight"]) == ("standard", 1.0)
    # each tenant judged by its own SLOs: scope's one answer missed its 3 ms, the plain key's met 30 s
    assert cards["scope"]["slo_attainment"]["ttft"] == 0.0
    assert cards["default"]["slo_attainment"]["ttft"] == 1.0
    m = tenant_metrics(server)
    assert m["prism_tenant_slo_requests_total", "scope", "ttft"] >= 1
    assert m["prism_tenant_slo_met_total", "scope", "ttft"] == 0
    r = httpx.get(
        f"{server.url}/v1/admin/tenants", headers={"Authorization": f"Bearer {KEYS['rpm']}"}, timeout=60
    )
    assert r.status_code == 403  # a tenant's key is not the admin key
    assert main(["tenants", "--url", server.url, "--admin-key", ADMIN_KEY]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["TENANT", "IN"] and any(line.split()[0] == "rpm" for line in table[1:])


def slo_counts(server, model: str) -> tuple[float, float]:
    """(met, judged) TTFT SLO counts of ``model`` in /metrics."""
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=60).text)
    got = {(s.name, s.labels["model_name"], s.labels["slo"]): s.value for f in families for s in f.samples
           if s.name in ("prism_slo_met_total", "prism_slo_requests_total")}  # fmt: skip
    return got.get(("prism_slo_met_total", model, "ttft"), 0.0), got.get(
        ("prism_slo_requests_total", model, "ttft"), 0.0
    )


def tenant_metrics(server) -> dict[tuple[str, str, str | None], float]:
    """The prism_tenant_* samples of /metrics by (name, tenant, limit or slo)."""
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=60).text)
    return {
        (s.name, s.labels["tenant"], s.labels.get("limit", s.labels.get("slo"))): s.value
        for f in families
        for s in f.samples
        if s.name.startswith("prism_tenant_")
    }


def test_tokens_per_minute_reserve_prompt_and_max_tokens_as_openai_counts_them(server):
    """The limit is 200: a first request's usage U stays in the window; a second whose prompt P
    plus max_tokens would pass the limit by one is refused, one token less is admitted."""
    first = ask(server, "tpm", max_tokens=8).parse().usage
    used, prompt = first.total_tokens, first.prompt_tokens
    room = 200 - used
    assert room - prompt >= 2, first
    with pytest.raises(openai.RateLimitError, match=f"{used} tokens in the last minute") as e:
        ask(server, "tpm", max_tokens=room - prompt + 1)
    assert e.value.response.headers["x-ratelimit-remaining-tokens"] == str(room)
    with pytest.raises(openai.RateLimitError, match="lower max_tokens"):
        ask(server, "tpm", max_tokens=200)  # could never fit
    r = ask(server, "tpm", max_tokens=room - prompt)
    assert r.http_response.status_code == 200
    m = tenant_metrics(server)  # the tokens the two answered requests used, the three refusals
    assert m["prism_tenant_tokens_total", "tpm", None] == used + r.parse().usage.total_tokens
    assert m["prism_tenant_rate_limited_total", "tpm", "tokens"] == 2


def test_a_stream_counts_against_concurrency_until_its_last_chunk(server):
    auth = {"Authorization": f"Bearer {KEYS['conc']}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.base_url}/chat/completions", json=body, headers=auth, timeout=60
    ) as s:
        assert s.status_code == 200
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")  # streaming: the request is in flight
        with pytest.raises(openai.RateLimitError, match=r"1 requests in flight \(limit 1\)"):
            ask(server, "conc")
        assert [line for line in lines if line][-1] == "data: [DONE]"
    deadline = time.monotonic() + 30
    while True:  # the middleware counts the end once the response is sent: at most a moment later
        try:
            assert ask(server, "conc").http_response.status_code == 200
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_the_keys_file_reloads_on_change_and_on_sighup_without_cutting_streams(server):
    """20 streams open while the file changes twice (a new tenant, then a file that does not
    parse): every stream ends whole; the new key works, and the bad file leaves it working. Then
    SIGHUP reads a change at once."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24,
            "stream": True, "ignore_eos": True}  # fmt: skip
    started = threading.Barrier(21)

    def stream() -> list[str]:
        with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as s:  # fmt: skip
            lines = s.iter_lines()
            first = next(lines)
            started.wait(60)
            return [first, *(line for line in lines if line)]

    with ThreadPoolExecutor(20) as pool:
        streams = [pool.submit(stream) for _ in range(20)]
        started.wait(60)
        write_keys(server.keys, [*TENANTS, {"name": "new", "keys": [hash_key(KEYS["new"])]}])
        time.sleep(1.1)  # the server looks at the file at most once a second
        assert ask(server, "new").http_response.status_code == 200
        server.keys.write_text("tenants: [unclosed")
        time.sleep(1.1)
        assert ask(server, "new").http_response.status_code == 200  # the last good file stands
        for f in streams:
            lines = f.result()
            assert (
                lines[-1] == "data: [DONE]" and sum(1 for x in lines if '"finish_reason":"length"' in x) == 1
            )
    assert "keys file not reloaded" in server.log_text()
    write_keys(server.keys, TENANTS)
    ask(server, None)  # the file is checked now: the next check is a second away
    write_keys(server.keys, [*TENANTS, {"name": "new", "keys": [hash_key("sk-after-hup")]}])
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "keys file reloaded (SIGHUP)" not in server.log_text():
        assert time.monotonic() < deadline, server.log_text()[-2000:]
        time.sleep(0.05)
    r = client(server).with_options(api_key="sk-after-hup").models.list()
    assert {m.id for m in r} == {"tiny", "tiny-b", "private"}
