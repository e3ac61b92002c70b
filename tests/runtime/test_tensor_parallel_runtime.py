"""Tensor parallel models in the live runtime: a ``tp: 2`` model runs as two workers, one per CPU
device (real processes, gloo between them), each granted its shard and its KV from its own
device's ledger. Checked: the greedy tokens of TP 1 for the real SmolLM2-135M (9 heads on 3 KV
heads: split 6+3 on 2+1) and for a synthetic shape whose head counts divide by 2 (labelled: random
weights, written as an HF directory); a SIGKILL of either rank mid-stream fails that model's
requests with 503 while another model keeps serving, gives every rank's memory back and the model
activates again on its next request; a synthetic Gemma 3 shape, its windowed layers' KV freed as the
window passes, gives the same tokens on two ranks (fixed KV) as on one (elastic KV) past its window;
activate/evict cycles leave the ledgers at zero; a tp above
the devices of a node, vLLM with tp > 1, and adapters on a TP model are refused."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from prism_serve.config import ConfigError, DeploymentConfig, PolicyConfig
from prism_serve.control import ModelState
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.weights import random_weights, save_hf_dir
from prism_serve.errors import InvalidRequestError, WorkerDiedError
from prism_serve.runtime.build import model_specs
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec, ModelTooLargeError
from prism_serve.runtime.workers import WorkerState

from .conftest import collect, start_runtime, stop_runtime, wait_until

GiB = 2**30
# head counts that divide by 2 (8 heads on 4 KV heads), with a separate LM head; random weights
SYNTHETIC = ArchConfig("llama", 384, 256, 512, 3, 8, 4, 32, 512, tie_word_embeddings=False)
FP32 = EngineConfig(dtype="float32", max_model_len=512)
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Memory bandwidth limits decoding because"]
# Gemma 3's layers (5 of 6 windowed, 16 tokens), head counts that divide by 2: its windowed layers'
# KV in blocks of their own (engine/kv_cache.py KVGroups), freed as the window passes; random weights
GEMMA = ArchConfig(
    "gemma3", 384, 256, 512, 6, 8, 4, 32, 512, sliding_window=16, global_layers=(5,), rope_local_theta=1e4,
    tie_word_embeddings=True,
)  # fmt: skip
LONG_PROMPTS = ["a prompt that runs well past a sixteen-token window", "0123456789 " * 4, "hello there"]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    synthetic = tmp_path_factory.mktemp("tp-synthetic")
    save_hf_dir(random_weights(SYNTHETIC, seed=3, name="tp-synthetic"), synthetic)
    gemma = tmp_path_factory.mktemp("tp-gemma")
    save_hf_dir(random_weights(GEMMA, seed=4, name="tp-gemma"), gemma)
    devices = [DeviceSpec("cpu:0", 2 * GiB, (0,), 1), DeviceSpec("cpu:1", 2 * GiB, (1,), 1)]
    models = [
        ModelSpec("smol-tp2", engine=FP32, tp=2),
        ModelSpec("smol", engine=FP32),
        ModelSpec("synth-tp2", source=str(synthetic), engine=FP32, tp=2),
        ModelSpec("synth", source=str(synthetic), engine=FP32),
        ModelSpec("gemma-tp2", source=str(gemma), engine=FP32, tp=2),
        ModelSpec("gemma", source=str(gemma), engine=FP32),
    ]
    rt = start_runtime(devices, models, policy=PolicyConfig(tick_interval_s=0.2))
    yield rt
    stop_runtime(rt)


def _tokens(rt, model: str, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    """Each prompt's greedy tokens, all requests in flight together (one batch)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def run() -> list[list[int]]:
        outs = await asyncio.gather(*(collect(rt.c, model, p, params) for p in prompts))
        return [[t for d in deltas for t in d.token_ids] for _, deltas in outs]

    return rt.run(run())


def _entries(c) -> list:
    return [e for d in c.devices for e in c.nodes.ledger(d).snapshot().entries]


def _model_bytes(rt, model: str) -> dict[str, int]:
    """What each device's ledger holds under ``model``'s accounts."""
    out = {}
    for d in rt.c.devices:
        snap = rt.c.nodes.ledger(d).snapshot()
        out[d] = sum(e.mapped_bytes for e in snap.entries if e.name.split(" ")[0] == model)
    return out


@pytest.mark.parametrize(("tp2", "tp1", "prompts"), [
    ("smol-tp2", "smol", SMOL_PROMPTS),
    ("synth-tp2", "synth", ["abc", "hello there", "0123456789"]),
    ("gemma-tp2", "gemma", LONG_PROMPTS),
])  # fmt: skip
def test_tp2_gives_the_greedy_tokens_of_tp1(rt, tp2, tp1, prompts):
    want = _tokens(rt, tp1, prompts)
    got = _tokens(rt, tp2, prompts)
    assert got == want
    m = rt.c.models[tp2]
    assert m.state is ModelState.ACTIVE and set(m.devices) == {"cpu:0", "cpu:1"}
    status = next(s for s in rt.c.status() if s.model == tp2)
    assert status.tp == 2 and status.devices == m.devices and status.device == m.devices[0]
    placement = rt.c.snapshot().models[tp2]
    assert placement.tp_size == 2 and set(placement.placement) == {"cpu:0", "cpu:1"}
    # each rank's shard and its KV are granted from its own device's ledger
    held = _model_bytes(rt, tp2)
    for rank, (device, handle) in enumerate(zip(m.devices, m.ranks, strict=True)):
        assert handle.device.name == device
        assert held[device] > m.cached.ranks[rank].weight_bytes  # its shard and its KV


def test_activate_evict_cycles_leave_the_ledgers_at_zero(rt):
    m = rt.c.models["synth-tp2"]
    for _ in range(3):
        rt.run(rt.c.load("synth-tp2"))
        assert m.state is ModelState.ACTIVE
        assert all(n > 0 for n in _model_bytes(rt, "synth-tp2").values())
        assert len(_tokens(rt, "synth-tp2", ["abc"], 4)[0]) == 4
        ranks = m.ranks
        assert rt.run(rt.c.unload("synth-tp2"))
        assert _model_bytes(rt, "synth-tp2") == {"cpu:0": 0, "cpu:1": 0}
        assert m.ranks == [] and all(h.state is WorkerState.IDLE and h.model is None for h in ranks)


@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_fails_its_model_with_503_and_frees_every_rank(rt, rank):
    c = rt.c
    _tokens(rt, "smol-tp2", ["warm"], 2)
    m = c.models["smol-tp2"]
    victim = m.ranks[rank]
    survivors = [h for h in m.ranks if h is not victim]
    held = sorted(_model_bytes(rt, "smol-tp2").values())

    async def scenario() -> list[list[int]]:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        long = c.generate("smol-tp2", "Count to one thousand:", params)
        await anext(long)
        other = asyncio.ensure_future(
            collect(c, "smol", "The capital of France is", SamplingParams(temperature=0.0, max_tokens=8))
        )
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as e:
            async for _ in long:
                pass
        assert e.value.status_code == 503
        return (await other)[1]

    deltas = rt.run(scenario())
    assert [t for d in deltas for t in d.token_ids] == _tokens(rt, "smol", ["The capital of France is"], 8)[0]
    wait_until(lambda: victim not in c.models["smol-tp2"].ranks)
    wait_until(lambda: all(e.pid != victim.pid for e in _entries(c)))
    # the surviving rank found its group broken and gave back its pages: it is idle, or serves
    # a new activation of the model (the policy may prewarm it at once)
    wait_until(lambda: all(h.state is WorkerState.IDLE or h in c.models["smol-tp2"].ranks for h in survivors))
    # the next request activates it again, on live workers, with the tokens of TP 1
    assert _tokens(rt, "smol-tp2", SMOL_PROMPTS[:1]) == _tokens(rt, "smol", SMOL_PROMPTS[:1])
    assert victim not in c.models["smol-tp2"].ranks
    # every device holds one activation's worth again: nothing of the lost one stayed granted
    assert sorted(_model_bytes(rt, "smol-tp2").values()) == held


def test_a_tp_above_the_devices_of_a_node_is_refused():
    devices = [DeviceSpec("cpu:0", 1 * GiB, (0,), 1)]
    with pytest.raises(ModelTooLargeError, match="tp: 2"):
        start_runtime(devices, [ModelSpec("big", source="random:smollm2-135m", tp=2)])


def test_vllm_and_adapters_with_tp_are_config_errors(tmp_path):
    for model, error in [
        ({"name": "v", "engine": "vllm", "source": str(tmp_path), "tp": 2}, "vLLM's tensor"),
        ({"name": "l", "max_loras": 2, "tp": 2}, "LoRA"),
    ]:
        devices = {"count": 2, "memory": "1GiB"}
        config = DeploymentConfig.model_validate({"devices": devices, "models": [model]})
        with pytest.raises(ConfigError, match=error):  # served; planning it stays possible
            model_specs(config)
    with pytest.raises(InvalidRequestError, match="LoRA"):
        ModelSpec("lora-tp", engine=EngineConfig(max_loras=2), tp=2)
    with pytest.raises(InvalidRequestError, match="vLLM's tensor parallel"):
        ModelSpec("vllm-tp", engine_kind="vllm", tp=2)


def test_runtime_stops_cleanly_after_tp_models(tmp_path):
    """No rendezvous or cache file outlives the controller."""
    devices = [DeviceSpec("cpu:0", GiB, (0,), 1), DeviceSpec("cpu:1", GiB, (1,), 1)]
    rt = start_runtime(devices, [ModelSpec("s", source="random:smollm2-135m", engine=FP32, tp=2)])
    try:
        ns = rt.c.namespace
        assert _tokens(rt, "s", ["abc"], 2)
    finally:
        stop_runtime(rt)
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"prism-weights-{ns}-")]
