"""Two replicas of one model on two CPU devices, live: a real `prism serve` process with real
SmolLM2 weights, the official `openai` client. prism's replica thresholds are set low so that a
short burst is "more than one device serves"; the rest (measured capacity, routing by predicted
TTFT, one host copy of the weights) is the default path."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import API_KEY, start_server, stop_clean

CONFIG = """
devices:
  - {{name: "cpu:0", memory: 2GiB, cores: "0", workers: 1}}
  - {{name: "cpu:1", memory: 2GiB, cores: "{core1}", workers: 1}}
models:
  - {{name: smol, max_model_len: 1024, ttft_slo: 30.0, tpot_slo: 2.0}}
policy:
  name: prism
  tick_interval_s: 0.2
  knobs: {{replica_high: 0.02, replica_low: 0.001, prewarm: false}}
server:
  api_keys: [{api_key}]
  namespace: "{{namespace}}"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    cores = sorted(os.sched_getaffinity(0))
    srv = start_server(tmp_path_factory.mktemp("replicas"), CONFIG.format(core1=cores[-1], api_key=API_KEY))
    yield srv
    stop_clean(srv)


def card(server) -> dict:
    r = httpx.get(
        f"{server.base_url}/models/smol", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    r.raise_for_status()
    return r.json()


def burst(client: openai.OpenAI, n: int, prompt: str | None = None) -> list[str]:
    """``n`` concurrent greedy completions (distinct prompts unless ``prompt`` is given)."""

    def one(i: int) -> str:
        text = prompt or f"Count to {i + 3}:"
        return (
            client.completions.create(model="smol", prompt=text, max_tokens=12, temperature=0).choices[0].text
        )

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_two_replicas_of_one_model_on_two_devices_both_serve(server):
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    assert all(burst(client, 6))  # replica 0 activates, serves, and its capacity gets measured
    deadline = time.monotonic() + 120
    while len(card(server)["replicas"]) < 2 or any(r["state"] != "active" for r in card(server)["replicas"]):
        assert time.monotonic() < deadline, card(server)
        burst(client, 2)  # keep the demand up until the replica is active
        time.sleep(0.2)
    replicas = card(server)["replicas"]
    assert sorted(r["device"] for r in replicas) == ["cpu:0", "cpu:1"]
    assert [r["replica"] for r in replicas] == [0, 1]
    before = {r["replica"]: r["num_served"] for r in replicas}
    outputs = burst(client, 8, prompt="The capital of France is")
    # both replicas took part, and greedy outputs do not depend on the replica that served them
    served = {r["replica"]: r["num_served"] - before[r["replica"]] for r in card(server)["replicas"]}
    assert served[0] > 0 and served[1] > 0 and sum(served.values()) == 8, served
    assert len(set(outputs)) == 1 and outputs[0], outputs
    # /metrics: the replica count and each replica's device
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("prism_model_replicas", (("model_name", "smol"),))] == 2
    states = [k for k in samples if k[0] == "prism_replica_state"]
    assert {dict(k[1])["device"] for k in states} == {"cpu:0", "cpu:1"}
    # replica slots are internal names: a client cannot address one
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="smol#1", prompt="hi", max_tokens=2)
    listed = [m.id for m in client.models.list().data]
    assert listed == ["smol"]
