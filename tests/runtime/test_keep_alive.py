"""Per-model keep_alive and pinned models at start-up, with real workers and SmolLM2 weights."""

from __future__ import annotations

import time

from prism_serve.config import PolicyConfig
from prism_serve.engine.config import EngineConfig
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec

GiB = 2**30


def _state(rt, name: str) -> str:
    return next(s.state for s in rt.c.status() if s.model == name)


def test_pinned_models_start_active_and_keep_alive_evicts_without_memory_pressure(runtime_factory):
    devices = [DeviceSpec("cpu:0", 3 * GiB // 2, (0,), 1), DeviceSpec("cpu:1", 3 * GiB // 2, (1,), 1)]
    models = [
        ModelSpec("always", pinned=True, engine=EngineConfig(max_model_len=1024)),
        ModelSpec("brief", keep_alive_s=1.0, engine=EngineConfig(max_model_len=1024)),
        ModelSpec(
            "lasting", engine=EngineConfig(max_model_len=1024)
        ),  # prism's idle threshold (30 s), no pressure: stays
    ]
    rt = runtime_factory(devices, models, policy=PolicyConfig(tick_interval_s=0.2))
    assert _state(rt, "always") == "active"  # activated by start(), before any request
    rt.generate("lasting", max_tokens=2)
    rt.generate("brief", max_tokens=2)
    # prism loads models into free memory at start, so brief may have been loaded, left idle and
    # evicted by its keep-alive once already: count from after its request
    before, ordered = rt.c.models["brief"].num_evictions, rt.c.loop.counters["evictions"]
    deadline = time.monotonic() + 30
    while rt.c.models["brief"].num_evictions < before + 1:  # counted once the worker has let it go
        assert time.monotonic() < deadline, "keep_alive did not evict the idle model"
        time.sleep(0.1)
    assert _state(rt, "lasting") == "active" and _state(rt, "always") == "active"
    assert _state(rt, "brief") == "evicted" and rt.c.loop.counters["evictions"] == ordered + 1
    assert rt.generate("brief", max_tokens=12)[0]  # it comes back on demand
