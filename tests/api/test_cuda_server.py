"""`prism serve` on a GPU: two SYNTHETIC models (SmolLM2-135M and -360M shapes; the real GGUF cannot
be carried to the GPU machines this project is lent) on one CUDA device, served to the official
openai client, shown on /v1/models and /metrics, unloaded with the device's ledger back to zero.
Skipped without a GPU (conftest.py)."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest

from prism_serve.api.process import stop_server_process
from prism_serve.memory.ledger import DeviceLedger
from tests.api.conftest import shm_files, start_server

pytestmark = pytest.mark.gpu

CONFIG = """
devices:
  - {name: "cuda:0", memory: 8GiB, workers: 2}
models:
  - {name: small, source: "random:smollm2-135m", max_model_len: 1024, ttft_slo: 30.0, tpot_slo: 2.0}
  - {name: large, source: "random:smollm2-360m", max_model_len: 1024, ttft_slo: 30.0, tpot_slo: 2.0}
policy: {name: prism}
server: {namespace: "{namespace}"}
"""


def test_two_models_share_one_gpu_and_give_their_memory_back(tmp_path):
    server = start_server(tmp_path, CONFIG)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        for name in ("small", "large"):
            out = client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=16, temperature=0)
            assert out.usage.completion_tokens == 16
            chunks = list(client.completions.create(model=name, prompt="hi", max_tokens=8, stream=True))
            assert sum(len(c.choices) for c in chunks) >= 8
        cards = {c["id"]: c for c in httpx.get(f"{server.base_url}/models").json()["data"]}
        assert cards["small"]["device"] == cards["large"]["device"] == "cuda:0"
        assert cards["small"]["dtype"] == "bfloat16"  # dtype auto on a deployment of GPUs
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'device="cuda:0"' in metrics
        ledger = DeviceLedger("cuda:0", namespace=server.namespace)
        assert ledger.snapshot().used_bytes > 0
        for name in ("small", "large"):
            httpx.post(f"{server.base_url}/admin/models/{name}/unload", timeout=60).raise_for_status()
        spare = sum(e.mapped_bytes for e in ledger.snapshot().entries if e.spare)
        assert ledger.snapshot().used_bytes == spare  # only the workers' spare pages stay mapped
        ledger.close()
    finally:
        code = stop_server_process(server.proc)
    assert code in (0, -signal.SIGTERM), server.log_text()
    assert "Traceback" not in server.log_text(), server.log_text()
    assert shm_files(server.namespace) == []
