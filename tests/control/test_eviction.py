"""Idle eviction (order, only when constrained, never pinned) and activation targets."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from prism_serve.control.eviction import (
    choose_activation,
    constrained_evictions,
    device_loads,
    is_idle,
    keep_alive_expired,
    never_fits,
)
from prism_serve.control.types import InvalidSnapshotError, ModelProfile, ModelState
from tests.control.factories import cluster, engine, model

NOW = 1000.0


def crowded(mapped_gib: float, **extra):
    models = [
        model("relaxed", ttft=5.0, on=("d0",), last=0.0),
        model("strict", ttft=0.5, on=("d0",), last=0.0),
        model("pinned", ttft=10.0, on=("d0",), last=0.0, pinned=True),
        model("busy", ttft=8.0, on=("d0",), last=0.0, running=1),
        model("recent", ttft=9.0, on=("d0",), last=NOW - 5),
        model("loading", ttft=9.5, on=("d0",), last=0.0, state=ModelState.ACTIVATING),
    ]
    return cluster(models, {"d0": 80}, mapped={"d0": mapped_gib}, **extra)


def test_idle_means_active_unpinned_and_quiet_for_longer_than_the_threshold():
    c = crowded(79)
    idle = {m for m, snap in c.models.items() if is_idle(snap, NOW, 30.0)}
    assert idle == {"relaxed", "strict"}


def test_evicts_larger_slo_first_and_only_until_unconstrained():
    # 79 of 80 GiB mapped, watermark 0.9 (72 GiB): evicting "relaxed" (10 GiB) is enough
    assert constrained_evictions(crowded(79), NOW, 30.0, 0.9) == ["relaxed"]
    # a lower watermark needs both idle models, still larger SLO first
    assert constrained_evictions(crowded(79), NOW, 30.0, 0.5) == ["relaxed", "strict"]


def test_no_eviction_when_memory_is_not_constrained():
    assert constrained_evictions(crowded(60), NOW, 30.0, 0.9) == []


def test_evicting_credits_the_engine_kv_back():
    # "relaxed"'s engine holds 8 GiB of KV: evicting it frees 18 GiB, enough at watermark 0.8 (64 GiB)
    c = crowded(79, engines=[engine("relaxed", free_gib=8)])
    assert constrained_evictions(c, NOW, 30.0, 0.8) == ["relaxed"]
    assert constrained_evictions(crowded(79), NOW, 30.0, 0.8) == ["relaxed", "strict"]


def test_activation_prefers_a_device_that_needs_no_eviction():
    models = [
        model("hot", rate=8, on=("d0",), last=NOW - 1),
        model("idle", rate=0, on=("d1",), weight_gib=60, last=0.0),
        model("new", weight_gib=30),
    ]
    c = cluster(models, {"d0": 80, "d1": 80, "d2": 80})
    loads = device_loads(c, NOW, 30.0, 0.05)
    # d2 (empty, KVPR 0) wins over d0 (busy) and d1 (would need "idle" evicted)
    assert choose_activation(c.models["new"], loads) == (("d2",), [])


def test_activation_picks_lowest_kvpr_and_evicts_idle_models_there_if_needed():
    models = [
        model("hot", rate=8, on=("d0",), weight_gib=60, last=NOW - 1),
        model("idle", rate=0, on=("d1",), weight_gib=60, last=0.0),
        model("new", weight_gib=30),
    ]
    c = cluster(models, {"d0": 80, "d1": 80})
    loads = device_loads(c, NOW, 30.0, 0.05)
    assert choose_activation(c.models["new"], loads) == (("d1",), ["idle"])


def test_activation_is_impossible_when_devices_hold_only_busy_models():
    models = [model("busy", on=("d0",), weight_gib=60, running=2), model("new", weight_gib=30)]
    c = cluster(models, {"d0": 80})
    assert choose_activation(c.models["new"], device_loads(c, NOW, 30.0, 0.05)) is None
    assert not never_fits(c.models["new"], c, 0.05)
    assert never_fits(model("giant", weight_gib=79), c, 0.05)


def test_tp_activation_uses_distinct_devices():
    c = cluster([model("tp", tp=2, weight_gib=40)], {"d0": 80, "d1": 80, "d2": 20})
    devices, evictions = choose_activation(c.models["tp"], device_loads(c, NOW, 30.0, 0.05))
    assert sorted(devices) == ["d0", "d1"] and evictions == []
    assert never_fits(model("tp3", tp=3, weight_gib=60), c, 0.05)


def test_busy_fraction_is_measured_or_predicted_from_the_profile():
    # service alone: 512 / 8000 + 100 * 0.01 = 1.064 s; at 0.5 req/s an M/G/inf engine is busy
    # with probability 1 - exp(-0.532)
    p = ModelProfile(512, 100, 8000.0, 0.01)
    m = replace(model("m", rate=0.5), profile=p)
    assert m.busy == pytest.approx(1 - math.exp(-0.5 * 1.064))
    assert replace(m, rate=0.0).busy == 0.0
    assert replace(m, rate=50.0).busy == pytest.approx(1.0)
    measured = replace(m, profile=replace(p, busy_s_per_request=0.4))
    assert measured.busy == pytest.approx(0.2), "rate x measured busy seconds per request"
    assert replace(measured, rate=10.0).busy == 1.0
    with pytest.raises(InvalidSnapshotError):
        ModelProfile(busy_s_per_request=-1.0)


def test_activation_weighs_compute_contention_not_kvpr_alone():
    slow = ModelProfile(512, 256, 8000.0, 0.02)  # 5.2 s per request: busy almost always at 1 req/s
    quick = ModelProfile(512, 256, 8000.0, 0.0001)  # 0.09 s: rarely computing even at 2 req/s
    models = [
        replace(model("hot", rate=1.0, on=("d0",), last=NOW - 1), profile=slow),
        replace(model("chatty", rate=2.0, on=("d1",), last=NOW - 1), profile=quick),
        model("new", weight_gib=10),
    ]
    c = cluster(models, {"d0": 80, "d1": 80})
    kv_only = device_loads(c, NOW, 30.0, 0.05, compute=False)
    assert choose_activation(c.models["new"], kv_only) == (("d0",), []), "lower KVPR: 1/70 < 2/70"
    loads = device_loads(c, NOW, 30.0, 0.05)
    assert loads[0].busy == pytest.approx(c.models["hot"].busy) and loads[0].busy > 0.99
    assert choose_activation(c.models["new"], loads) == (("d1",), []), "d0's engine is always computing"


def test_a_models_own_keep_alive_overrides_the_policy_threshold_and_expires_without_pressure():
    models = [
        model("short", on=("d0",), last=NOW - 20),  # idle 20 s
        model("forever", on=("d0",), last=0.0),  # idle 1000 s
        model("default", on=("d0",), last=NOW - 20),
        model("busy", on=("d0",), last=0.0, running=1),
    ]
    keep = {"short": 10.0, "forever": -1.0, "busy": 0.0}
    models = [replace(m, keep_alive_s=keep.get(m.model)) for m in models]
    c = cluster(models, {"d0": 80}, mapped={"d0": 1})  # far below the watermark
    assert {m for m, s in c.models.items() if is_idle(s, NOW, 30.0)} == {"short"}
    assert {m for m, s in c.models.items() if is_idle(s, NOW, 5.0)} == {"short", "default"}
    assert keep_alive_expired(c, NOW) == ["short"]  # "forever" never; "busy" is serving
    assert constrained_evictions(c, NOW, 30.0, 0.9) == []  # no memory pressure: only keep_alive evicts
