"""Snapshots validate themselves and cannot be edited through a policy."""

from __future__ import annotations

import dataclasses

import pytest

from prism_serve.control import (
    ClusterSnapshot,
    DeviceSnapshot,
    EngineSnapshot,
    InvalidSnapshotError,
    ModelSnapshot,
    ModelState,
    Request,
)
from prism_serve.errors import PrismError
from tests.control.factories import GIB, cluster, model


def test_model_snapshot_checks_its_fields():
    with pytest.raises(InvalidSnapshotError):
        model("a", rate=-1)
    with pytest.raises(InvalidSnapshotError):
        model("a", ttft=0)
    with pytest.raises(InvalidSnapshotError, match="distinct"):
        model("a", tp=2, on=("d0", "d0"))
    with pytest.raises(InvalidSnapshotError, match="evicted"):
        ModelSnapshot("a", 1, 1, 1, GIB, 1, placement=("d0",), state=ModelState.EVICTED)
    assert issubclass(InvalidSnapshotError, PrismError) and issubclass(InvalidSnapshotError, ValueError)


def test_derived_model_quantities():
    m = model("a", rate=3, ttft=0.5, weight_gib=10, tp=4, on=("d0", "d1", "d2", "d3"), last=90.0)
    assert m.demand == 6.0 and m.part_weight_bytes == 10 * GIB // 4
    assert m.idle_for(100.0) == 10.0
    assert model("b", queued=1, on=("d0",)).idle_for(1e9) == 0.0
    assert model("c", last=None).idle_for(0.0) == float("inf")


def test_cluster_snapshot_must_be_consistent():
    ok = cluster([model("a", on=("d0",))], {"d0": 80})
    with pytest.raises(InvalidSnapshotError, match="unknown device"):
        ClusterSnapshot.build([model("a", on=("dx",))], ok.devices.values())
    with pytest.raises(InvalidSnapshotError, match="placements put"):
        ClusterSnapshot.build([model("a", on=("d0",))], [DeviceSnapshot("d0", GIB)])
    with pytest.raises(InvalidSnapshotError, match="duplicate"):
        ClusterSnapshot.build([model("a"), model("a")], [DeviceSnapshot("d0", GIB)])
    with pytest.raises(InvalidSnapshotError, match="engine"):
        ClusterSnapshot.build(ok.models.values(), ok.devices.values(), [EngineSnapshot("a", "d1", 1)])


def test_snapshots_are_frozen_all_the_way_down():
    c = cluster([model("a", on=("d0",))], {"d0": 80})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.models["a"].rate = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        c.models["b"] = model("b")  # type: ignore[index]


def test_request_deadline_and_validation():
    assert Request("r", "a", 10.0, 5, 2.5).deadline == 12.5
    with pytest.raises(InvalidSnapshotError):
        Request("r", "a", 0.0, -1, 1.0)
    with pytest.raises(InvalidSnapshotError):
        Request("r", "a", 0.0, 1, 0.0)
