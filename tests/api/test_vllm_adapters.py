"""LoRA adapters of an ``engine: vllm`` base, through vLLM's own LoRA support, in a real ``prism
serve`` (the vLLM worker runs in ``.venv-vllm-server``, as in test_vllm_server.py), with adapters
made by ``peft`` over the real SmolLM2-135M in fp32.

Checked: greedy answers of the base and of three adapters (ranks 8, 16 and 64 over different
modules, one rsLoRA; one from the config, two registered at run time), requested together, equal
transformers + peft's merged model; vLLM's adapter slots are in the weight range, granted in the
device ledger with the weights (their size known before the build) and given back at eviction;
after an eviction the adapters are registered again and answer the same; an unloaded adapter is
gone; a rank vLLM cannot build is a config error."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest

from prism_serve.api.process import stop_server_process
from prism_serve.config import ConfigError, parse_config
from prism_serve.engine.models.config import PRESETS
from prism_serve.engine.vllm_engine import lora_slot_bytes
from tests.api.conftest import (
    ADMIN_KEY,
    API_KEY,
    LORA_PROMPT,
    LORA_TOKENS,
    ServerProcess,
    ledger_snapshot,
    shm_files,
    start_server,
)
from tests.api.test_vllm_server import VLLM_PYTHON
from tests.peft_adapters import make_adapter, merged_greedy

N = LORA_TOKENS
PROMPT = LORA_PROMPT
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora(tmp_path_factory, smollm_hf, lora_adapters) -> dict[str, Path]:
    """The package's base and adapters (qv, mlp: tests/api/conftest.py), and a rank-64 rsLoRA
    adapter over every projection."""
    root = tmp_path_factory.mktemp("vllm-adapters")
    all_r64 = make_adapter(smollm_hf, root / "all-r64", 64, 32, ALL, seed=3, rslora=True, b_scale=0.1)
    return {**lora_adapters, "all": all_r64}


@pytest.fixture(scope="module")
def server(tmp_path_factory, lora) -> ServerProcess:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: run scripts/vllm-server-env.sh"
    config = f"""
devices:
  - {{name: "cpu:0", memory: 3GiB, workers: 1}}
models:
  - {{name: smol-vllm, engine: vllm, source: "{lora["base"]}", dtype: float32, max_loras: 2,
     max_lora_rank: 64, ttft_slo: 60.0, tpot_slo: 5.0}}
  - {{name: support, base: smol-vllm, adapter: "{lora["qv"]}"}}
policy: {{name: prism, activation_timeout_s: 240, spare_pages: false, knobs: {{prewarm: false}}}}
vllm_python: "{VLLM_PYTHON}"
vllm_compile: false  # eager: the compiled build is test_vllm_server.py's to check; here it costs minutes
server: {{namespace: "{{namespace}}", api_keys: [{API_KEY}], admin_key: {ADMIN_KEY}}}
"""
    srv = start_server(tmp_path_factory.mktemp("vllm-adapters-serve"), config, timeout_s=300)
    yield srv
    code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()[-4000:]
    assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]
    assert shm_files(srv.namespace) == []


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=240)


def admin(server: ServerProcess, route: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=240)  # fmt: skip


def greedy(server: ServerProcess, model: str) -> str:
    r = client(server).completions.create(
        model=model, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


@pytest.fixture(scope="module")
def reference(lora, lora_reference, smollm) -> dict[str, str]:
    """Each model's greedy text: transformers, with peft's adapter merged into the weights (the base's,
    qv's and mlp's computed once for the package: tests/api/conftest.py); adapters that change
    nothing prove nothing."""
    tok = smollm.tokenizer
    (tokens,) = merged_greedy(lora["base"], lora["all"], [tok.encode(PROMPT)], N)
    out = {**lora_reference, "all": tok.decode(tokens)}
    assert len(set(out.values())) == len(out), "adapters that change nothing prove nothing"
    return out


def all_together(server: ServerProcess, models: list[str]) -> dict[str, list[str]]:
    results: dict[str, list[str]] = {}

    def run(model: str) -> None:
        results.setdefault(model, []).append(greedy(server, model))

    threads = [threading.Thread(target=run, args=(m,)) for m in models for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def weight_entry(server: ServerProcess):
    snap = ledger_snapshot(server)
    return [e for e in snap.entries if e.name.startswith("smol-vllm ") and "weights" in e.name]


def test_adapters_answer_as_peft_merged_models_in_one_batch(server, reference, lora):
    for name, key in (("legal", "mlp"), ("wide", "all")):
        r = admin(server, "load_lora_adapter", {"lora_name": name, "lora_path": str(lora[key])})
        assert r.status_code == 200, r.text
    cards = {m.id: m for m in client(server).models.list().data}
    assert cards["wide"].parent == "smol-vllm" and cards["wide"].model_extra["adapter"]["rank"] == 64
    got = all_together(server, ["smol-vllm", "support", "legal", "wide"])
    assert got == {
        "smol-vllm": [reference["base"]] * 2,
        "support": [reference["qv"]] * 2,
        "legal": [reference["mlp"]] * 2,
        "wide": [reference["all"]] * 2,
    }


def test_vllm_adapter_slots_are_granted_with_the_weights_and_given_back(server, reference, lora):
    card = next(m for m in client(server).models.list().data if m.id == "smol-vllm")
    # 2 slots and the one kept zero for the base's rows, x rank 64 over every projection, the
    # embedding and the head
    slots = lora_slot_bytes(PRESETS["smollm2-135m"], 3, 64, 4)
    assert slots > 250 * 2**20
    # the footprint placement uses, and what the ledger granted while it serves, include them
    footprint = card.model_extra["weight_bytes"]
    assert 500 * 2**20 < footprint - slots < 520 * 2**20  # the fp32 checkpoint (513 MiB), and the slots
    (entry,) = weight_entry(server)
    # granted: the data parameters' and the slots' pages, and the packed linears' bytes (the
    # checkpoint's less the data parameters'), within a page per tensor of the footprint
    assert abs(entry.mapped_bytes - footprint) < 2 * 2**20, (entry.mapped_bytes, footprint)
    r = httpx.post(f"{server.url}/v1/admin/models/smol-vllm/unload",
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=240)  # fmt: skip
    assert r.status_code == 200, r.text
    assert weight_entry(server) == []  # nothing under the model (kept weights are off: spare_pages)
    # activated again: the adapters are registered again, and answer the same
    got = all_together(server, ["support", "wide"])
    assert got == {"support": [reference["qv"]] * 2, "wide": [reference["all"]] * 2}


def test_an_unloaded_vllm_adapter_is_gone_and_the_others_serve(server, reference):
    assert admin(server, "unload_lora_adapter", {"lora_name": "legal"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="legal", prompt="hi", max_tokens=2)
    assert greedy(server, "support") == reference["qv"]


def test_a_rank_vllm_cannot_build_is_a_config_error(lora):
    text = f"""
devices: [{{name: "cpu:0", memory: 2GiB}}]
models:
  - {{name: b, engine: vllm, source: "{lora["base"]}", max_lora_rank: 20}}
  - {{name: a, base: b, adapter: "{lora["qv"]}"}}
"""
    with pytest.raises(ConfigError, match="max_lora_rank 20; vLLM builds adapter slots of rank"):
        parse_config(text)
