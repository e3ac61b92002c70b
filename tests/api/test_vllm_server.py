"""vLLM's engine inside a prism worker: a real `prism serve` with the real SmolLM2-135M
on both engines, side by side on one CPU device. The vLLM model runs in a worker started with the
vLLM environment's Python (``.venv-vllm-server``, made by scripts/vllm-server-env.sh, which
scripts/dev.sh test runs), the built-in one in a worker of this environment.

Checked: greedy outputs and logprobs of the two engines agree; the vLLM model streams and serves
the server's features (chat template, stop strings, structured output through vLLM's own backend);
its KV pages follow its requests (mapped as a long prompt needs them, given back when it ends but
for the blocks its prefix cache keeps, which the ledger counts as reclaimable, and which serve the
same prompt again with the same output), and with a budget too small for both models' long
requests at once each grows into the memory the other (and the other's cache) gave back, the
ledger never over its budget; its memory is in the device ledger while active,
and after an eviction only what the worker keeps for the next activation, as spare memory, 20 times
over; kept weights give way to a grant that needs them; another model of the shape loads over
the kept weights' pages (none made) by the checked load plan; a vLLM worker killed mid-request
fails that request only, and a new worker serves the model again. The pooled engine is compiled
(vllm_compile's default).

The budget: both models' weights (514 + 515 MiB in fp32) and their idle KV (the built-in pool's
first pages, vLLM's null block in each of 30 layers: 68 MiB) take 1,097 MiB; a 1,801-token prompt
adds about 100 MiB of KV on either engine, so 1,230 MiB holds one such request at a time, not two.
Spare weight pages are off so that nothing else takes memory, and prewarming is off so that no
model activates unasked (the policy counts kept weights as free memory, and would fill it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from prism_serve.api.process import stop_server_process
from prism_serve.memory.ledger import DeviceLedger
from tests.api.conftest import (
    ADMIN_KEY,
    API_KEY,
    LedgerWatch,
    ServerProcess,
    ledger_snapshot,
    shm_files,
    start_server,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("PRISM_VLLM_PYTHON", ROOT / ".venv-vllm-server/bin/python"))

CONFIG = """
devices:
  - {{name: "cpu:0", memory: 1230MiB, workers: 1}}
models:
  - {{name: smol, dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0}}
  - {{name: smol-vllm, engine: vllm, source: "{hf}", dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0}}
  - {{name: smol-b, dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0}}
  - {{name: smol-vllm-b, engine: vllm, source: "{hf_b}", dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0}}
policy: {{name: prism, activation_timeout_s: 240, spare_pages: false,
         knobs: {{prewarm: false}}}}
vllm_python: "{python}"
server:
  api_keys: [{key}]
  admin_key: {admin}
  namespace: "{{namespace}}"
"""

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Memory bandwidth limits decoding because"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm_hf: Path) -> ServerProcess:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: run scripts/vllm-server-env.sh"
    # a second model of smol-vllm's shape, from another directory (the same files: its own host
    # cache file, so to prism another model's weights, as a fine-tune of the same base would be)
    hf_b = tmp_path_factory.mktemp("smol-hf-b") / "smollm2-135m-b"
    hf_b.mkdir()
    for f in smollm_hf.iterdir():
        (hf_b / f.name).symlink_to(f)
    config = CONFIG.format(hf=smollm_hf, hf_b=hf_b, python=VLLM_PYTHON, key=API_KEY, admin=ADMIN_KEY)
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
    snap = ledger_snapshot(server)
    return [e for e in snap.entries if e.name.startswith(f"{model} ")]


def test_the_idle_vllm_worker_builds_the_engine_ahead_and_holds_nothing_after(server: ServerProcess) -> None:
    """The pool's vLLM worker builds vLLM's engine for smol-vllm's shape in its idle time (a
    Prepare, started as the server starts; an activation that comes meanwhile waits for it). The
    first activation then loads weights into the built engine instead of building one (its ready
    phase is the build: exactly 0 when none happened), and a build leaves nothing granted."""
    out = admin(server, "smol-vllm", "load")
    assert out["activated"] and out["activation_s"]["ready"] == 0.0, out
    assert out["engine_compiled"] is True, out  # a build ahead is compiled (vllm_compile's default)
    # the Prepare also checked a load plan on synthetic tensors of the checkpoint's shapes, so the
    # weights went in by it, not by vLLM's reload (engine/vllm_load.py)
    assert out["weights_loaded_by"] == "plan", out
    # the pool's new idle vLLM worker, started as this one was taken, builds its engine too
    ledger = DeviceLedger("cpu:0", namespace=server.namespace)
    deadline = time.monotonic() + 180
    while [e for e in ledger.snapshot().entries if e.name.endswith(" vllm prepare")]:
        assert time.monotonic() < deadline, "a Prepare's build holds memory after 180 s"
        time.sleep(0.05)
    snap = ledger.snapshot()
    assert snap.used_bytes == sum(e.mapped_bytes for e in model_entries(server, "smol-vllm")) > 500 * 2**20


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


def test_a_forced_tool_call_on_the_vllm_engine(server: ServerProcess) -> None:
    """A named tool_choice is decoded by vLLM's structured-output backend into a valid call, the
    same call the built-in engine makes (greedy), streamed in argument pieces."""
    from jsonschema import validate

    city = {"city": {"type": "string", "maxLength": 30}}
    params = {"type": "object", "properties": city, "required": ["city"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(messages=ask, tools=[tool], tool_choice=named, max_tokens=48, temperature=0)
    c = client(server)
    (call,) = c.chat.completions.create(model="smol-vllm", **kw).choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    validate(json.loads(call.function.arguments), params)
    chunks = list(c.chat.completions.create(model="smol-vllm", stream=True, **kw))
    deltas = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    pieces = [t.function.arguments for t in deltas]
    assert len(pieces) > 2 and "".join(p or "" for p in pieces) == call.function.arguments
    builtin = c.chat.completions.create(model="smol", **kw).choices[0].message.tool_calls[0]
    assert json.loads(builtin.function.arguments) == json.loads(call.function.arguments)


def test_bad_request_gets_an_error_and_the_model_keeps_serving(server: ServerProcess) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="smol-vllm", prompt="x " * 5000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="vocabulary size 49152"):
        c.completions.create(model="smol-vllm", prompt=[1, 2, 10**6], max_tokens=4)
    r = c.completions.create(model="smol-vllm", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


LONG = "word " * 1800  # 1,801 tokens
OTHER_LONG = "text " * 1800


def kv_bytes(server: ServerProcess, model: str) -> int:
    return sum(e.mapped_bytes for e in model_entries(server, model) if e.name.endswith(" kv"))


def held_kv_bytes(server: ServerProcess, model: str) -> int:
    """The KV bytes the model holds beyond what its prefix cache would give back when asked."""
    return sum(
        e.mapped_bytes - e.reclaimable_bytes for e in model_entries(server, model) if e.name.endswith(" kv")
    )


def settled_kv_bytes(server: ServerProcess, model: str, quiet_s: float = 1.0) -> int:
    """``held_kv_bytes`` once it has stayed the same for ``quiet_s`` (at most 30 s of waiting)."""
    deadline = time.monotonic() + 30
    value, since = held_kv_bytes(server, model), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"{model}'s KV never settled (last {value})"
        time.sleep(0.05)
        now = held_kv_bytes(server, model)
        if now != value:
            value, since = now, time.monotonic()
    return value


def wait_kv(server: ServerProcess, model: str, value: int, at_most: bool = False) -> None:
    """Until the model holds ``value`` KV bytes (``at_most``: no more), besides the cached blocks'
    reclaimable pages."""
    deadline = time.monotonic() + 30
    while (held_kv_bytes(server, model) > value) if at_most else (held_kv_bytes(server, model) != value):
        held = held_kv_bytes(server, model)
        assert time.monotonic() < deadline, f"{model}'s KV stays at {held}, not {value}"
        time.sleep(0.05)


def test_vllm_kv_pages_follow_its_requests(server: ServerProcess) -> None:
    c = client(server)
    admin(server, "smol-vllm", "load")
    idle = held_kv_bytes(server, "smol-vllm")  # besides what earlier prompts left cached
    assert 0 < idle <= 64 * 2**20  # the null block's pages, one per layer
    with LedgerWatch(server) as watch:
        r = c.completions.create(model="smol-vllm", prompt=LONG, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == 1801 and r.usage.completion_tokens == 8
    # 15 blocks of 128 tokens, 5.6 MiB each across the 30 layers, were mapped for it
    assert watch.peak["smol-vllm kv"] - idle >= 15 * 5898240
    wait_kv(server, "smol-vllm", idle)  # and given back when it finished, but for the cached blocks
    assert kv_bytes(server, "smol-vllm") - idle >= 14 * 5898240  # its 14 full blocks stay cached
    again = c.completions.create(model="smol-vllm", prompt=LONG, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 14 * 128
    assert again.choices[0].text == r.choices[0].text


def test_colocated_engines_take_turns_with_memory_neither_could_hold_both(server: ServerProcess) -> None:
    """Both models resident and pinned (so the policy cannot make room by evicting the quiet one,
    which would leave a device that holds both requests at once); then what the device has free,
    even with every cached block given back, is less than their two long requests' KV, and each
    grows into what the other gives back. The requests run together on a prompt neither has
    cached, so the caches the solo runs left must go back too; the vLLM model answers as it did
    alone."""
    c = client(server)
    models = ("smol", "smol-vllm")
    for model in models:
        admin(server, model, "load")
        admin(server, model, "pin")
    try:
        assert [admin(server, m, "pin")["state"] for m in models] == ["active", "active"]
        # a built-in engine just activated still holds its pool's full buffer of empty pages; after
        # a step it trims them to the idle minimum (its pool's thread, in the background), which is
        # what it returns to after each request below
        c.completions.create(model="smol", prompt="hi", max_tokens=1, temperature=0)
        settled_kv_bytes(server, "smol")
        # smol-vllm's cache held LONG's blocks (the test above), but smol's activation may have
        # taken some of them back (whether smol was still resident depends on what the policy did
        # between the tests): one request caches them all again, and the next finds them all
        c.completions.create(model="smol-vllm", prompt=LONG, max_tokens=4, temperature=0)
        cached = c.completions.create(model="smol-vllm", prompt=LONG, max_tokens=4, temperature=0)
        assert cached.usage.prompt_tokens_details.cached_tokens == 14 * 128
        solo: dict[str, int] = {}
        solo_vllm = None
        idle = {m: settled_kv_bytes(server, m) for m in models}
        for model in models:  # smol first: its request needs memory that smol-vllm's cache holds
            with LedgerWatch(server) as watch:
                r = c.completions.create(model=model, prompt=LONG, max_tokens=4, temperature=0)
            solo[model] = watch.peak[f"{model} kv"] - idle[model]
            # everything its request took goes back (the built-in pool may trim its empty buffer
            # pages below what it kept after a one-token request)
            wait_kv(server, model, idle[model], at_most=True)
            solo_vllm = r if model == "smol-vllm" else solo_vllm
        # so smol-vllm gave back cached blocks (evicted before their pages went), and recomputed
        # them to the same answer
        assert solo_vllm.usage.prompt_tokens_details.cached_tokens < 14 * 128
        assert solo_vllm.choices[0].text == cached.choices[0].text
        snap = ledger_snapshot(server)
        resident = {e.name for e in snap.entries}
        assert {f"{m} weights" for m in models} <= resident, resident  # both still there
        assert sum(solo.values()) > snap.budget_bytes - snap.engine_bytes  # both at once cannot fit
        done: dict[str, int] = {}
        texts: dict[str, str] = {}

        def one(model: str) -> None:
            r = c.completions.create(model=model, prompt=OTHER_LONG, max_tokens=16, temperature=0)
            done[model] = r.usage.completion_tokens
            texts[model] = r.choices[0].text

        with LedgerWatch(server) as watch:  # asserts the budget at every sample
            threads = [threading.Thread(target=one, args=(m,)) for m in models]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert done == {"smol": 16, "smol-vllm": 16}
        alone = c.completions.create(model="smol-vllm", prompt=OTHER_LONG, max_tokens=16, temperature=0)
        assert alone.choices[0].text == texts["smol-vllm"]
        # each held its whole prompt's KV (2 x 30 layers x 3 heads x 64 x 4 bytes a token) at some
        # point, which both together could not: one grew into the memory the other gave back. Held
        # bytes, not the rise above its idle figure: a built-in pool's idle pages are empty buffer
        # that the request fills (and it may have trimmed them since); cached blocks do not count
        for model in solo:
            assert watch.peak_held[f"{model} kv"] >= 1801 * 46080
    finally:
        for model in models:
            admin(server, model, "unpin")


def kept_bytes(server: ServerProcess) -> int:
    """What vLLM workers keep of evicted models (spare: reclaimable)."""
    snap = ledger_snapshot(server)
    kept = [e for e in snap.entries if e.name.endswith(" vllm kept")]
    assert all(e.spare for e in kept)
    return sum(e.mapped_bytes for e in kept)


def test_activate_serve_evict_20_times_leaves_no_model_memory(server: ServerProcess) -> None:
    c = client(server)
    admin(server, "smol-vllm", "load")
    expected = c.completions.create(model="smol-vllm", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    for _ in range(20):
        assert model_entries(server, "smol-vllm"), "an active model's memory is in the ledger"
        assert sum(e.mapped_bytes for e in model_entries(server, "smol-vllm")) > 500 * 2**20
        assert kept_bytes(server) == 0  # what was kept went back to the model
        assert admin(server, "smol-vllm", "unload")["state"] == "evicted"
        assert model_entries(server, "smol-vllm") == []
        # its weights stay with the worker in vLLM's form, as spare memory, for the next activation
        assert kept_bytes(server) > 500 * 2**20
        out = admin(server, "smol-vllm", "load")
        assert out["state"] == "active" and out["weights_loaded_by"] == "kept", out
        r = c.completions.create(model="smol-vllm", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert r.choices[0].text == expected.choices[0].text
    # the built-in model on the same device served throughout
    r = c.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert r.choices[0].text == expected.choices[0].text
    snap = ledger_snapshot(server)
    assert snap.used_bytes <= snap.budget_bytes


def test_kept_weights_give_way_to_a_grant_that_needs_their_memory(server: ServerProcess) -> None:
    c = client(server)
    admin(server, "smol", "load")
    admin(server, "smol-vllm", "load")
    admin(server, "smol-vllm", "unload")
    assert kept_bytes(server) > 500 * 2**20
    snap = ledger_snapshot(server)
    # smol-b's weights (514 MiB) fit only if the kept weights go: the policy counts them as free
    assert snap.budget_bytes - snap.used_bytes < 514 * 2**20 <= snap.budget_bytes - snap.engine_bytes
    r = c.completions.create(model="smol-b", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    assert kept_bytes(server) == 0
    assert model_entries(server, "smol-b")
    # the vLLM model activates again the long way (its weights loaded into the built engine again,
    # by the plan) and answers the same
    admin(server, "smol-b", "unload")
    assert admin(server, "smol-vllm", "load")["weights_loaded_by"] == "plan"
    r = c.completions.create(model="smol-vllm", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    ours = c.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert r.choices[0].text == ours.choices[0].text


def test_another_model_of_the_shape_loads_into_the_kept_weights_pages(server: ServerProcess) -> None:
    """smol-vllm-b goes to the worker that kept smol-vllm's weights (built for the same shape, and
    holding spare memory), takes over their pages (none made) and loads its own weights into them
    by the load plan; then the other way round."""
    c = client(server)
    admin(server, "smol-vllm", "load")
    assert admin(server, "smol-vllm", "unload")["state"] == "evicted"
    kept = kept_bytes(server)
    assert kept > 500 * 2**20
    out = admin(server, "smol-vllm-b", "load")
    assert out["weights_loaded_by"] == "plan" and out["activation_s"]["ready"] == 0.0, out
    assert out["weight_pages"]["created"] == 0 < out["weight_pages"]["reused"], out
    assert kept_bytes(server) == 0
    assert sum(e.mapped_bytes for e in model_entries(server, "smol-vllm-b")) > 500 * 2**20
    ours = c.completions.create(model="smol", prompt=PROMPTS[2], max_tokens=12, temperature=0)
    r = c.completions.create(model="smol-vllm-b", prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert r.choices[0].text == ours.choices[0].text
    admin(server, "smol-vllm-b", "unload")
    out = admin(server, "smol-vllm", "load")
    assert out["weights_loaded_by"] == "plan" and out["weight_pages"]["created"] == 0, out
    r = c.completions.create(model="smol-vllm", prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert r.choices[0].text == ours.choices[0].text
    admin(server, "smol-vllm", "unload")
    snap = ledger_snapshot(server)
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
