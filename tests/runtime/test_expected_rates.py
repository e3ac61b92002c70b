"""A deployment told each model's expected rate places by it from the start, with real workers."""

from __future__ import annotations

import pytest

from prism_serve.config import PolicyConfig
from prism_serve.control.types import ModelState
from prism_serve.engine.config import EngineConfig
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec

from .conftest import wait_until

GiB = 2**30


def test_start_up_places_the_expected_hot_model_alone_and_rates_start_from_the_prior(runtime_factory):
    devices = [DeviceSpec("cpu:0", 2 * GiB, (0,), 1), DeviceSpec("cpu:1", 2 * GiB, (1,), 1)]
    expected = {"smol-a": 0.15, "smol-b": 0.5, "smol-c": 0.2}
    engine = EngineConfig(max_model_len=1024, dtype="float32")
    models = [ModelSpec(n, engine=engine, expected_rate=r) for n, r in expected.items()]
    rt = runtime_factory(devices, models, policy=PolicyConfig(tick_interval_s=0.2))
    c = rt.c
    # before any request: the rates read the expected ones, and so do the policy's snapshots
    now, rates = c._now(), c.loop.rates
    for name, rate in expected.items():  # no arrival yet: the part of the window not watched, at the prior
        unwatched = rates.window_s - rates.history_at(name, now)
        assert 0 < unwatched < rates.window_s
        assert rates.rate(name, now) == pytest.approx(rate * unwatched / rates.window_s)
    # the start-up fill loads all three (each fits beside the others) by pressure, hottest first:
    # the hot model gets a device of its own, the two lighter ones share the other
    wait_until(lambda: all(c.models[n].state is ModelState.ACTIVE for n in expected), timeout_s=120)
    where = {n: c.models[n].device for n in expected}
    assert where["smol-b"] not in (where["smol-a"], where["smol-c"]) and where["smol-a"] == where["smol-c"]


    async def snapshot():  # on the controller's own event loop, as its ticks build them
        return c.cluster(c._now())

    snap = rt.run(snapshot())
    assert {n: snap.models[n].expected_rate for n in expected} == expected
    assert rt.generate("smol-b", max_tokens=2)[0]
