"""LoRA adapters against a real `prism serve`: adapters from the config and loaded at run time
with vLLM's routes run in their base's engine, batched with it; their greedy tokens equal
transformers + peft's merged model; /v1/models lists them with their parent; unloading waits for
their requests (or fails them with force); bad adapters get a 400 naming the problem; the base's
adapter slots are granted from the ledger with its weights and go back with them."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest

from prism_serve.api.process import stop_server_process
from prism_serve.memory.ledger import DeviceLedger
from tests.api.conftest import (
    ADMIN_KEY,
    API_KEY,
    LORA_PROMPT,
    LORA_TOKENS,
    ServerProcess,
    shm_files,
    start_server,
)
from tests.peft_adapters import make_adapter

N = LORA_TOKENS
PROMPT = LORA_PROMPT


@pytest.fixture(scope="module")
def lora(tmp_path_factory, smollm_hf, lora_adapters) -> dict[str, Path]:
    """The package's base and adapters (qv, mlp), and one of a rank above the base's maximum."""
    root = tmp_path_factory.mktemp("adapters-big")
    return {**lora_adapters, "big": make_adapter(smollm_hf, root / "too-big", 32, 32, ["q_proj"], seed=3)}


@pytest.fixture(scope="module")
def server(tmp_path_factory, lora) -> ServerProcess:
    config = f"""
devices:
  - {{name: "cpu:0", memory: 2GiB, workers: 1}}
models:
  - {{name: smol, dtype: float32, max_loras: 2, max_lora_rank: 16, ttft_slo: 60.0, tpot_slo: 5.0}}
  - {{name: support, base: smol, adapter: "{lora["qv"]}", ttft_slo: 30.0}}
  - {{name: other, dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0}}
policy: {{name: prism}}
server: {{namespace: "{{namespace}}", api_keys: [{API_KEY}], admin_key: {ADMIN_KEY}}}
"""
    srv = start_server(tmp_path_factory.mktemp("adapters-serve"), config)
    yield srv
    code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()[-4000:]
    assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]
    assert shm_files(srv.namespace) == []


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=240)


def admin(server: ServerProcess, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=240)  # fmt: skip


def load(server: ServerProcess, name: str, path: Path) -> httpx.Response:
    return admin(server, "load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def greedy(server: ServerProcess, model: str, max_tokens: int = N) -> str:
    r = client(server).completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


@pytest.fixture(scope="module")
def reference(lora_reference) -> dict[str, str]:
    """Each model's greedy text (base, qv, mlp): transformers, with peft's adapter merged into the
    weights (tests/api/conftest.py)."""
    return lora_reference


def test_models_lists_the_adapter_under_its_base(server):
    cards = {m.id: m for m in client(server).models.list().data}
    assert cards["support"].parent == "smol" and cards["smol"].parent is None
    extra = cards["support"].model_extra
    assert extra["adapter"]["rank"] == 8 and extra["adapter"]["target_modules"] == ["q_proj", "v_proj"]
    assert extra["ttft_slo"] == 30.0 and extra["tpot_slo"] == 5.0  # its own, and its base's
    assert "/" not in cards["support"].root  # the directory's name, never a path on the server


def test_adapter_and_base_answers_equal_peft_merged_models_in_one_batch(server, reference, lora):
    assert (
        admin(server, "load_lora_adapter", {"lora_name": "legal", "lora_path": str(lora["mlp"])}).status_code
        == 200
    )
    results = {}

    def run(model: str) -> None:
        results.setdefault(model, []).append(greedy(server, model))

    threads = [
        threading.Thread(target=run, args=(m,)) for m in ("smol", "support", "legal") for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["smol"] == [reference["base"]] * 2
    assert results["support"] == [reference["qv"]] * 2
    assert results["legal"] == [reference["mlp"]] * 2
    assert admin(server, "unload_lora_adapter", {"lora_name": "legal"}).status_code == 200


def adapter_files(server: ServerProcess) -> set[str]:
    return {f for f in shm_files(server.namespace) if f.endswith(".lora")}


def test_unloading_waits_for_the_adapters_requests_then_it_is_gone(server, lora):
    before = adapter_files(server)
    assert len(before) == 1  # the configured adapter's checked weights, in the host cache
    assert (
        admin(server, "load_lora_adapter", {"lora_name": "temp", "lora_path": str(lora["mlp"])}).status_code
        == 200
    )
    (added,) = adapter_files(server) - before
    size = os.path.getsize(f"/dev/shm/{added}")
    # rank 16 over gate/up/down of 30 layers, float32: the adapter's own bytes (64-byte aligned)
    assert 30 * 16 * 3 * (576 + 1536) * 4 <= size < 30 * 16 * 3 * (576 + 1536) * 4 + 30 * 3 * 64
    chunks = []

    def stream() -> None:
        for c in client(server).completions.create(model="temp", prompt=PROMPT, max_tokens=48, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
            chunks.append(c)

    t = threading.Thread(target=stream)
    t.start()
    while not chunks:  # it is running
        t.join(0.05)
    r = admin(server, "unload_lora_adapter", {"lora_name": "temp"})
    t.join()
    assert r.status_code == 200 and r.json()["in_flight"] == 1
    assert chunks[-1].choices[0].finish_reason == "length"  # it finished before the adapter went
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="temp", prompt="hi", max_tokens=2)
    assert "temp" not in {m.id for m in client(server).models.list().data}
    assert adapter_files(server) == before  # its host cache file went with it


def test_forced_unload_fails_the_adapters_requests_and_others_keep_serving(server, lora):
    assert (
        admin(server, "load_lora_adapter", {"lora_name": "temp2", "lora_path": str(lora["mlp"])}).status_code
        == 200
    )
    errors, chunks = [], []

    def stream() -> None:
        try:
            for c in client(server).completions.create(model="temp2", prompt=PROMPT, max_tokens=400,
                                                       temperature=0, stream=True,
                                                       extra_body={"ignore_eos": True}):  # fmt: skip
                chunks.append(c)
        except openai.APIError as e:
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    while not chunks:
        t.join(0.05)
    assert admin(server, "unload_lora_adapter", {"lora_name": "temp2", "force": True}).status_code == 200
    t.join(60)
    assert not t.is_alive() and (errors or chunks[-1].choices[0].finish_reason != "length")
    assert greedy(server, "support", 2) and greedy(server, "smol", 2)  # the others still serve


@pytest.mark.parametrize(
    ("body", "status", "match"),
    [
        ({"lora_name": "x", "lora_path": "{big}"}, 400, "rank 32 is above this base's max_lora_rank 16"),
        ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "no adapter_config.json"),
        ({"lora_name": "x", "lora_path": "{qv}", "base_model_name": "nope"}, 400, "not a model served here"),
        ({"lora_name": "x", "lora_path": "{qv}", "base_model_name": "other"}, 400, "no adapter slots"),
        ({"lora_name": "support", "lora_path": "{qv}"}, 400, "name is taken"),
        ({"lora_name": "smol", "lora_path": "{qv}"}, 400, "name is taken"),
    ],
)  # fmt: skip
def test_bad_adapters_are_400_naming_the_problem(server, lora, body, status, match):
    body = {k: v.format(big=lora["big"], qv=lora["qv"]) for k, v in body.items()}
    r = admin(server, "load_lora_adapter", body)
    assert r.status_code == status, r.text
    assert match in r.json()["error"]["message"]
    assert "x" not in {m.id for m in client(server).models.list().data}


def test_a_corrupt_adapter_is_refused(server, lora, tmp_path):
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((lora["qv"] / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    r = admin(server, "load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "cannot read" in r.json()["error"]["message"]
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "use_dora": True}))
    r = admin(server, "load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "DoRA" in r.json()["error"]["message"]


def test_the_adapter_slots_are_granted_with_the_weights_and_given_back(server):
    greedy(server, "support", 2)  # smol is active
    cards = {m.id: m.model_extra for m in client(server).models.list().data}
    other = cards["other"]["weight_bytes"]  # the same weights, no adapter slots
    slots = 2 * 16 * 30 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536)) * 4  # 2 slots, rank 16, fp32
    assert cards["smol"]["weight_bytes"] - other >= slots
    ledger = DeviceLedger("cpu:0", namespace=server.namespace)
    try:
        held = {e.name: e.mapped_bytes for e in ledger.snapshot().entries}
        weights = next(v for k, v in held.items() if k.startswith("smol ") and k.endswith("weights"))
        assert weights >= other + slots
        r = httpx.post(f"{server.url}/v1/admin/models/smol/unload", json={"force": True},
                       headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)  # fmt: skip
        assert r.status_code == 200
        names = [e.name for e in ledger.snapshot().entries if e.mapped_bytes and not e.spare]
        assert not [n for n in names if n.startswith("smol ")], names
    finally:
        ledger.close()
