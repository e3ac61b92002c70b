"""Which vLLM engine a fresh vLLM worker builds ahead of activations (its Prepare), and which idle
vLLM worker an activation takes. The build itself, and the activation that then finds the engine
built, run against real vLLM in tests/api/test_vllm_server.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.vllm_engine import engine_key
from prism_serve.runtime.activation import Activator
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec
from prism_serve.runtime.workers import WorkerHandle, WorkerPool, WorkerStartError, WorkerState


def checkpoint(root: Path, name: str, layers: int) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers})
    )
    (d / "tokenizer.json").write_text("{}")
    return d


def fine_tune(base: Path, name: str) -> Path:
    d = base.parent / name
    shutil.copytree(base, d)
    (d / "model.safetensors").write_bytes(name.encode())  # other weights: not part of the shape
    return d


def activator(
    entries: list[tuple[str, ModelSpec, Path]], rates: dict[str, float] | None = None, compiled: bool = True
) -> Activator:
    """An Activator over what vllm_shapes and engine_key read: the model entries (replica slots
    included) and their recent request rates (by entry); nothing else of a running controller."""
    models = {
        name: SimpleNamespace(spec=spec, cached=SimpleNamespace(source=str(src)))
        for name, spec, src in entries
    }
    loop = SimpleNamespace(rates=SimpleNamespace(rate=lambda name, now: (rates or {}).get(name, 0.0)))
    return Activator(None, models, None, loop, None, None, lambda: 0.0, timeout_s=60.0, vllm_compile=compiled)  # type: ignore[arg-type]


def vllm(name: str, src: Path, **knobs) -> tuple[str, ModelSpec, Path]:
    return name, ModelSpec(name, source=str(src), engine=EngineConfig(**knobs), engine_kind="vllm"), src


def test_the_shape_most_vllm_models_share_is_built_and_replica_slots_count_once(tmp_path: Path) -> None:
    a = checkpoint(tmp_path, "base-a", 30)
    b = checkpoint(tmp_path, "base-b", 24)
    ft1, ft2 = fine_tune(a, "ft1"), fine_tune(a, "ft2")
    b_spec = vllm("b", b)[1]
    c = activator([
        ("b", b_spec, b), ("b#1", b_spec, b), ("b#2", b_spec, b),  # one model, three replica slots
        vllm("ft1", ft1), vllm("ft2", ft2),
        ("builtin", ModelSpec("builtin"), tmp_path),
    ])  # fmt: skip
    (shape,) = c.vllm_shapes()
    assert shape.source == str(ft1)  # two models share base-a's shape; base-b's is one model's
    assert shape.engine == ModelSpec("ft1", source=str(ft1), engine_kind="vllm").engine
    assert shape.compiled  # the deployment's vllm_compile (default on) goes with the shape
    assert c.engine_key(c._models["ft2"]) == c.engine_key(c._models["ft1"]) != c.engine_key(c._models["b"])
    assert c.engine_key(c._models["builtin"]) is None


def test_other_engine_knobs_are_another_engine_and_a_tie_goes_to_the_first_configured(tmp_path: Path) -> None:
    a = checkpoint(tmp_path, "base-a", 30)
    b = checkpoint(tmp_path, "base-b", 24)
    c = activator(
        [vllm("b", b), vllm("a-short", a, max_model_len=512), vllm("a-long", a, max_model_len=2048)]
    )
    assert c.engine_key(c._models["a-short"]) != c.engine_key(c._models["a-long"])
    (shape,) = c.vllm_shapes()
    assert shape.source == str(b)  # three engines of one model each: the first configured
    off = activator([vllm("b", b)], compiled=False)
    assert not off.vllm_shapes()[0].compiled
    assert activator([("builtin", ModelSpec("builtin"), tmp_path)]).vllm_shapes() == []


def test_engine_key_ignores_the_model_name_and_weights(tmp_path: Path) -> None:
    a = checkpoint(tmp_path, "base-a", 30)
    ft = fine_tune(a, "ft")
    spec = ModelSpec("x", source=str(a), engine_kind="vllm")
    other = ModelSpec("y", source=str(ft), engine_kind="vllm")
    assert engine_key(str(a), spec.engine) == engine_key(str(ft), other.engine)
    (ft / "config.json").write_text(json.dumps({"num_hidden_layers": 31}))
    assert engine_key(str(a), spec.engine) != engine_key(str(ft), other.engine)


@pytest.fixture
def pool(tmp_path: Path):
    p = WorkerPool(
        [DeviceSpec("cpu:0", 2**30, (0,), 1)], on_message=lambda h, m: None, on_death=lambda h: None,
        namespace=None, reserve_bytes={"cpu:0": 2**30}, page_size=2**21, load_threads=1,
    )  # fmt: skip
    yield p
    p._sock.close()
    p._ctx.term()


def test_an_activation_takes_the_worker_that_kept_the_model_then_one_built_for_its_shape(pool) -> None:
    async def take(source: str, key: str) -> str:
        return (await pool.take("cpu:0", "vllm", source, key)).worker_id

    async def run() -> list[str]:
        device = pool.devices["cpu:0"]
        for i, (kept, built) in enumerate(
            [(None, None), (None, "k2"), ("/m/a", "k1"), (None, "k1"), (None, None)]
        ):
            h = WorkerHandle(f"cpu:0/v{i}", device, proc=None, state=WorkerState.IDLE, engine="vllm")  # type: ignore[arg-type]
            h.last_source, h.engine_key = kept, built
            pool.workers[h.worker_id] = h
        return [
            await take("/m/a", "k1"),
            await take("/m/b", "k1"),
            await take("/m/c", "k2"),
            await take("/m/d", "k9"),
        ]

    # kept weights first, then a built engine of the shape, then any idle vLLM worker
    assert asyncio.run(run()) == ["cpu:0/v2", "cpu:0/v3", "cpu:0/v1", "cpu:0/v0"]


def test_of_the_workers_built_for_the_shape_the_one_that_kept_weights_is_taken() -> None:
    """Another model of the shape takes over kept weights' pages (runtime/vllm_slot.py), so among
    the workers built for its shape the one with spare memory in the ledger goes first."""
    spare = {"cpu:0/v0": 0, "cpu:0/v1": 600 * 2**20, "cpu:0/v2": 0}
    p = WorkerPool(
        [DeviceSpec("cpu:0", 2**30, (0,), 1)], on_message=lambda h, m: None, on_death=lambda h: None,
        namespace=None, reserve_bytes={"cpu:0": 2**30}, page_size=2**21, load_threads=1,
        spare_of=lambda w: spare[w.worker_id],
    )  # fmt: skip

    async def run() -> list[str]:
        device = p.devices["cpu:0"]
        for i, source in enumerate(["/m/x", "/m/a", "/m/y"]):
            h = WorkerHandle(f"cpu:0/v{i}", device, proc=None, state=WorkerState.IDLE, engine="vllm")  # type: ignore[arg-type]
            h.last_source, h.engine_key = source, "k1"
            p.workers[h.worker_id] = h
        return [
            (await p.take("cpu:0", "vllm", "/m/b", "k1")).worker_id,
            (await p.take("cpu:0", "vllm", "/m/y", "k1")).worker_id,  # the worker that kept it
        ]

    try:
        assert asyncio.run(run()) == ["cpu:0/v1", "cpu:0/v2"]
    finally:
        p._sock.close()
        p._ctx.term()


def test_the_shape_with_the_most_recent_requests_wins_over_the_most_models(tmp_path: Path) -> None:
    a = checkpoint(tmp_path, "base-a", 30)
    b = checkpoint(tmp_path, "base-b", 24)
    ft1, ft2 = fine_tune(a, "ft1"), fine_tune(a, "ft2")
    b_spec = vllm("b", b)[1]
    entries = [vllm("ft1", ft1), vllm("ft2", ft2), ("b", b_spec, b), ("b#1", b_spec, b)]
    # base-b's model gets 1.5 req/s over its two replicas, base-a's two models 1.0 together
    c = activator(entries, rates={"ft1": 0.6, "ft2": 0.4, "b": 1.0, "b#1": 0.5})
    assert c.vllm_shapes()[0].source == str(b)
    c = activator(entries, rates={"ft1": 1.0, "ft2": 0.6, "b": 1.0, "b#1": 0.5})
    assert c.vllm_shapes()[0].source == str(ft1)


def test_an_activation_that_ends_during_shutdown_starts_no_replacement_worker(pool) -> None:
    """stop() waits for the workers it knows: a refill after it (an activation finishing as the
    server stops) would start a worker that outlives the server, with its ledger entries."""
    asyncio.run(pool.stop(timeout_s=1.0))
    pool.refill("cpu:0", "vllm")
    pool.refill("cpu:0")
    assert pool.workers == {}
    with pytest.raises(WorkerStartError, match="shutting down"):
        pool.spawn(pool.devices["cpu:0"])
