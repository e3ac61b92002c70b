"""Pooled workers open the host cache files and parse the tokenizers while they wait (Prepare), so
the first activation in a worker that never held a model starts with the copy."""

from __future__ import annotations

import time

import pytest

from prism_serve.config import PolicyConfig
from prism_serve.engine.config import EngineConfig
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec
from prism_serve.runtime.workers import WorkerState

from .conftest import wait_until

GiB = 2**30


@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "not-prepared"])
def test_a_fresh_workers_first_activation_finds_its_files_open_only_when_prepared(
    runtime_factory, prepare: bool
) -> None:
    # Two weights (two cache files) with one tokenizer between them; no prewarming, so no model is
    # activated before the test asks for one.
    models = [
        ModelSpec(
            "a", source="random:smollm2-135m", engine=EngineConfig(seed=1, dtype="float32", max_model_len=256)
        ),
        ModelSpec(
            "b", source="random:smollm2-135m", engine=EngineConfig(seed=2, dtype="float32", max_model_len=256)
        ),
    ]
    rt = runtime_factory(
        [DeviceSpec("cpu:0", 2 * GiB, (0,), 2)],
        models,
        policy=PolicyConfig(knobs={"prewarm": False}, prepare_workers=prepare, tick_interval_s=3600),
    )
    a, b = rt.c.cache.get("a"), rt.c.cache.get("b")
    assert a.path != b.path and a.tokenizer_path == b.tokenizer_path  # the tokenizer file is shared
    workers = rt.c.pool.on_device("cpu:0")
    assert len(workers) == 2 and all(w.state is WorkerState.IDLE for w in workers)
    if prepare:
        wait_until(lambda: all(w.prepared is not None for w in workers), 60)
        for w in workers:
            assert w.prepared.files == sorted([a.path, b.path])
            assert w.prepared.tokenizers == [a.tokenizer_path] and w.prepared.seconds > 0
    else:
        time.sleep(0.5)
        assert all(w.prepared is None for w in workers)
    phases = rt.run(rt.c.load("a", "cpu:0"))
    assert phases.prepared is prepare
    _, deltas = rt.generate("a", [1, 2, 3], max_tokens=3, ignore_eos=True)
    assert sum(len(d.token_ids) for d in deltas) == 3 and deltas[-1].finished  # it serves
    # The other worker, which never held a model, activates the second weights.
    phases_b = rt.run(rt.c.load("b", "cpu:0"))
    assert phases_b.prepared is prepare
    assert rt.c.models["a"].worker is not rt.c.models["b"].worker
    # Evicted and activated again, a model finds its files open either way (the worker kept them).
    rt.run(rt.c.unload("a"))
    assert rt.run(rt.c.load("a", "cpu:0")).prepared is True
