"""`prism serve` with `ray:` in its YAML on a real local two-node Ray cluster, driven over HTTP by
the official openai client: the model answers from the second node, /metrics shows both nodes'
devices, and shutdown leaves no shared memory on either node."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest

from prism_serve.api.process import stop_server_process
from tests.conftest import local_ray_cluster

from .conftest import shm_files, start_server

pytest.importorskip("ray")

CONFIG = """
devices:
  - {{name: "cpu:0", memory: 1536MiB, workers: 1}}
models:
  - {{name: smol, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: tiny, source: "random:smollm2-135m", max_model_len: 512}}
# no prewarming: the startup fill would place smol itself, racing the test's load on n1 (409)
policy: {{name: prism, knobs: {{prewarm: false}}}}
server: {{admin_key: admin-test-key, namespace: "{{namespace}}"}}
ray: {{address: "{address}", poll_interval_s: 0.2}}
"""


@pytest.fixture(scope="module")
def cluster():
    with local_ray_cluster() as c:
        yield c


def test_prism_serve_on_a_ray_cluster_answers_the_openai_client(tmp_path, cluster) -> None:
    srv = start_server(tmp_path, CONFIG.format(address=cluster.address))
    try:
        admin = {"Authorization": "Bearer admin-test-key"}
        r = httpx.post(f"{srv.url}/v1/admin/models/smol/load", json={"device": "n1/cpu:0"}, headers=admin)
        assert r.status_code == 200, r.text
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused")
        reply = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0.0,
        )
        assert "Paris" in reply.choices[0].message.content
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, stream=True)
        assert len([c for c in stream if c.choices and c.choices[0].text is not None]) >= 1
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert 'prism_device_budget_bytes{device="n0/cpu:0"}' in metrics
        assert 'prism_device_budget_bytes{device="n1/cpu:0"}' in metrics
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) >= {"smol", "tiny"}
    finally:
        code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()
    log = srv.log_text()
    assert "n1/cpu:0" in log and "Traceback" not in log, log
    assert "stopped: workers ended, shared memory released" in log
    assert shm_files(srv.namespace) == [], "shared memory left behind on a node"


VLLM_CONFIG = """
devices:
  - {{name: "cpu:0", memory: 1536MiB, workers: 1}}
models:
  - {{name: smol-vllm, engine: vllm, source: "{hf}", dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0}}
policy: {{name: prism, activation_timeout_s: 240, knobs: {{prewarm: false}}}}
vllm_python: "{python}"
vllm_compile: false
server: {{admin_key: admin-test-key, namespace: "{{namespace}}"}}
ray: {{address: "{address}", poll_interval_s: 0.2}}
"""


def test_a_vllm_model_serves_from_another_node(tmp_path, cluster, smollm_hf) -> None:
    """A vLLM worker runs on the second node too (started by its node agent with the vLLM
    environment's Python), its host cache and Prepare that node's own, and answers as it would
    on this one."""
    from tests.api.test_vllm_server import VLLM_PYTHON

    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: run scripts/vllm-server-env.sh"
    config = VLLM_CONFIG.format(hf=smollm_hf, python=VLLM_PYTHON, address=cluster.address)
    srv = start_server(tmp_path, config, timeout_s=300)
    try:
        admin = {"Authorization": "Bearer admin-test-key"}
        url = f"{srv.url}/v1/admin/models/smol-vllm/load"
        r = httpx.post(url, json={"device": "n1/cpu:0"}, headers=admin, timeout=240)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["device"] == "n1/cpu:0" and out["state"] == "active", out
        # that node's pooled vLLM worker had built the engine and checked the load plan ahead
        assert out["activation_s"]["ready"] == 0.0 and out["weights_loaded_by"] == "plan", out
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", timeout=240, max_retries=0)
        reply = client.completions.create(model="smol-vllm", prompt="The capital of France is", max_tokens=4,
                                          temperature=0)  # fmt: skip
        assert reply.choices[0].text.startswith(" Paris"), reply
    finally:
        code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()
    assert "Traceback" not in srv.log_text()
    assert shm_files(srv.namespace) == [], "shared memory left behind on a node"
