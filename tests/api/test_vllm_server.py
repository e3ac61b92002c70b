"""vLLM's engine inside a prism worker (issue 18): a real `prism serve` with the real SmolLM2-135M
on both engines, side by side on one CPU device. The vLLM model runs in a worker started with the
vLLM environment's Python (``.venv-vllm-server``, made by scripts/vllm-server-env.sh, which
scripts/dev.sh test runs), the built-in one in a worker of this environment.

Checked: greedy outputs and logprobs of the two engines agree; the vLLM model streams and serves
the server's features (chat template, stop strings, structured output through vLLM's own backend);
its memory is in the device ledger while active and nowhere after an eviction, 20 times over; a
vLLM worker killed mid-request fails that request only, and a new worker serves the model again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from prism_serve.api.process import stop_server_process
from prism_serve.memory.ledger import DeviceLedger
from tests.api.conftest import ADMIN_KEY, API_KEY, ServerProcess, shm_files, start_server

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("PRISM_VLLM_PYTHON", ROOT / ".venv-vllm-server/bin/python"))

CONFIG = """
devices:
  - {{name: "cpu:0", memory: 3GiB, workers: 1}}
models:
  - {{name: smol, dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0}}
  - {{name: smol-vllm, engine: vllm, source: "{hf}", dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0,
     kv_limit: 96MiB}}
policy: {{name: prism, activation_timeout_s: 240}}
vllm_python: "{python}"
server:
  api_keys: [{key}]
  admin_key: {admin}
  namespace: "{{namespace}}"
"""

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Memory bandwidth limits decoding because"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's real weights (the GGUF, dequantized) written as an HF directory."""
    from prism_serve.engine.weights import load_weights, save_hf_dir

    path = tmp_path_factory.mktemp("smol-hf") / "smollm2-135m"
    save_hf_dir(load_weights("smollm2-135m-instruct"), path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, hf_dir: Path) -> ServerProcess:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: run scripts/vllm-server-env.sh"
    config = CONFIG.format(hf=hf_dir, python=VLLM_PYTHON, key=API_KEY, admin=ADMIN_KEY)
    srv = start_server(tmp_path_factory.mktemp("vllm-serve"), config, timeout_s=300)
    yield srv
    code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()[-4000:]
    assert shm_files(srv.namespace) == [], "shared memory left behind after shutdown"


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=240, max_retries=0)


def admin(server: ServerProcess, model: str, action: str) -> dict:
    r = httpx.post(
        f"{server.url}/v1/admin/models/{model}/{action}",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=240,
    )
    assert r.status_code == 200, r.text
    return r.json()


def model_entries(server: ServerProcess, model: str) -> list:
    snap = DeviceLedger("cpu:0", namespace=server.namespace).snapshot()
    return [e for e in snap.entries if e.name.startswith(f"{model} ")]


def test_greedy_outputs_and_logprobs_match_the_builtin_engine(server: ServerProcess) -> None:
    c = client(server)
    for prompt in PROMPTS:
        got = {}
        for model in ("smol", "smol-vllm"):
            r = c.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=3)
            got[model] = r.choices[0]
            assert r.usage.completion_tokens == 16
        ours, theirs = got["smol"], got["smol-vllm"]
        assert theirs.text == ours.text
        assert theirs.logprobs.tokens == ours.logprobs.tokens
        for a, b in zip(ours.logprobs.token_logprobs, theirs.logprobs.token_logprobs, strict=True):
            assert abs(a - b) < 1e-3
        for a, b in zip(ours.logprobs.top_logprobs, theirs.logprobs.top_logprobs, strict=True):
            assert list(a) == list(b)  # the same alternatives, in the same order


def test_streamed_chat_stop_strings_and_structured_output(server: ServerProcess) -> None:
    c = client(server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = c.chat.completions.create(model="smol-vllm", messages=messages, max_tokens=24, temperature=0)
    stream = c.chat.completions.create(
        model="smol-vllm", messages=messages, max_tokens=24, temperature=0, stream=True
    )
    parts = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert len([p for p in parts if p]) > 1  # token by token, not one final chunk
    assert "".join(parts) == whole.choices[0].message.content
    assert "Paris" in whole.choices[0].message.content

    r = c.completions.create(model="smol-vllm", prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=["."])
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = c.chat.completions.create(
        model="smol-vllm",
        messages=[{"role": "user", "content": "Name a city as JSON."}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["city"], str)


def test_bad_request_gets_an_error_and_the_model_keeps_serving(server: ServerProcess) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="smol-vllm", prompt="x " * 5000, max_tokens=4)
    r = c.completions.create(model="smol-vllm", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_activate_serve_evict_20_times_leaves_the_ledger_empty(server: ServerProcess) -> None:
    c = client(server)
    admin(server, "smol-vllm", "load")
    expected = c.completions.create(model="smol-vllm", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    for _ in range(20):
        assert model_entries(server, "smol-vllm"), "an active model's memory is in the ledger"
        assert sum(e.mapped_bytes for e in model_entries(server, "smol-vllm")) > 500 * 2**20
        assert admin(server, "smol-vllm", "unload")["state"] == "evicted"
        assert model_entries(server, "smol-vllm") == []
        assert admin(server, "smol-vllm", "load")["state"] == "active"
        r = c.completions.create(model="smol-vllm", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert r.choices[0].text == expected.choices[0].text
    # the built-in model on the same device served throughout
    r = c.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert r.choices[0].text == expected.choices[0].text
    snap = DeviceLedger("cpu:0", namespace=server.namespace).snapshot()
    assert snap.used_bytes <= snap.budget_bytes


def test_killed_vllm_worker_fails_its_request_only(server: ServerProcess) -> None:
    c = client(server)
    admin(server, "smol-vllm", "load")
    ps = subprocess.run(["pgrep", "-af", "prism_serve.runtime.worker"], capture_output=True, text=True)
    mine = [ln for ln in ps.stdout.splitlines() if server.namespace in ln]
    workers = [ln.split() for ln in mine if "--engine vllm" in ln]
    assert workers, "a vLLM worker process runs"

    def stream() -> list[str]:
        s = c.completions.create(
            model="smol-vllm", prompt=PROMPTS[1], max_tokens=400, temperature=0, stream=True
        )
        out = []
        for ch in s:
            out.append(ch.choices[0].text)
            if len(out) == 3:
                # the worker that serves it is the one with a model (the others wait idle)
                for w in workers:
                    os.kill(int(w[0]), signal.SIGKILL)
        return out

    with pytest.raises(openai.APIError):
        stream()
    r = c.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    deadline = time.monotonic() + 240
    while True:  # the model activates again on a new vLLM worker
        try:
            r = c.completions.create(model="smol-vllm", prompt=PROMPTS[0], max_tokens=4, temperature=0)
            break
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    assert r.usage.completion_tokens == 4
