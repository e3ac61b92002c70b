"""Snapshots validate themselves and cannot be edited through a policy."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ClusterSnapshot.updated: the same snapshot (or the same error) as a fresh build of the result.

_DEVICES = ("d0", "d1", "d2")
_NAMES = ("a", "b", "a#1", "b#1", "c")


def _snap(name: str, on: tuple[str, ...], queued: int, rate: float) -> ModelSnapshot:
    base, _, k = name.partition("#")
    state = ModelState.ACTIVE if on else ModelState.EVICTED
    return ModelSnapshot(
        name, rate, 1.0, 0.05, GIB, 1024, 1, on, state, 0.0, queued, 0, False, replica_of=base if k else None
    )


def _fresh(models, devices, engines):
    try:
        return ClusterSnapshot(models, devices, engines)
    except InvalidSnapshotError as e:
        return e


def _same(a, b) -> bool:
    if isinstance(a, InvalidSnapshotError) or isinstance(b, InvalidSnapshotError):
        return type(a) is type(b)
    return (
        dict(a.models) == dict(b.models)
        and dict(a.devices) == dict(b.devices)
        and dict(a.engines) == dict(b.engines)
        and dict(a.extra_replicas) == dict(b.extra_replicas)
        and a.starved == b.starved
    )


@st.composite
def _placements(draw):
    return {n: draw(st.sampled_from(((), *((d,) for d in _DEVICES)))) for n in _NAMES}


@settings(max_examples=300, deadline=None)
@given(
    before=_placements(),
    after=_placements(),
    queued=st.dictionaries(st.sampled_from(_NAMES), st.integers(0, 2)),
    moved=st.sets(st.sampled_from(_NAMES)),
    stale_devices=st.sets(st.sampled_from(_DEVICES)),
    engine_moves=st.lists(st.tuples(st.sampled_from(_NAMES), st.sampled_from((None, *_DEVICES))), max_size=3),
    wrong_lists=st.booleans(),
)
def test_updated_equals_a_fresh_build(before, after, queued, moved, stale_devices, engine_moves, wrong_lists):
    _check_update(before, after, queued, moved, stale_devices, engine_moves, wrong_lists, deferred=False)


@settings(max_examples=300, deadline=None)
@given(
    before=_placements(),
    after=_placements(),
    queued=st.dictionaries(st.sampled_from(_NAMES), st.integers(0, 2)),
    moved=st.sets(st.sampled_from(_NAMES)),
    stale_devices=st.sets(st.sampled_from(_DEVICES)),
    engine_moves=st.lists(st.tuples(st.sampled_from(_NAMES), st.sampled_from((None, *_DEVICES))), max_size=3),
    wrong_lists=st.booleans(),
)
def test_deferred_devices_and_engines_equal_a_fresh_build(
    before, after, queued, moved, stale_devices, engine_moves, wrong_lists
):
    """``deferring``: the models now, the devices and engines from ``resolve`` on first read (once),
    checked as ``updated`` checks them; None when the models change the layout."""
    _check_update(before, after, queued, moved, stale_devices, engine_moves, wrong_lists, deferred=True)


def _check_update(before, after, queued, moved, stale_devices, engine_moves, wrong_lists, *, deferred):
    def devices_for(place):
        return {
            d: DeviceSnapshot(d, 8 * GIB, 0, tuple(n for n in _NAMES if place[n] == (d,))) for d in _DEVICES
        }

    models = {n: _snap(n, before[n], 0, 1.0) for n in _NAMES}
    devices = devices_for(before)
    engines = {n: EngineSnapshot(n, before[n][0], 1024) for n in _NAMES if before[n]}
    prev = ClusterSnapshot(models, devices, engines)
    # the change: some models moved (after) and got new queue counts; some devices re-listed from
    # the new placement (a body may forget one, or list what did not move: then both must fail
    # alike); engines moved or gone
    place = {n: after[n] if n in moved else before[n] for n in _NAMES}
    new_models = [_snap(n, place[n], queued.get(n, 0), 2.0) for n in _NAMES if n in moved or n in queued]
    relisted = devices_for(after if wrong_lists else place)
    new_devices = [relisted[d] for d in sorted(stale_devices)]
    new_engines, gone = [], []
    for n, d in engine_moves:
        if d is None:
            if n in prev.engines and n not in gone:
                gone.append(n)
        else:
            new_engines.append(EngineSnapshot(n, d, 1024))
    want_models = {**models, **{m.model: m for m in new_models}}
    want_devices = {**devices, **{d.device: d for d in new_devices}}
    want_engines = {n: e for n, e in engines.items() if n not in gone}
    want_engines.update((e.model, e) for e in new_engines)
    if deferred:
        resolved = []

        def resolve(snap):
            resolved.append(snap)
            done = snap.with_entries(prev.devices, prev.engines).updated((), new_devices, new_engines, gone)
            return done.devices, done.engines

        def entry(snap, kind, name):
            now = want_devices if kind == "devices" else want_engines
            return now.get(name), getattr(prev, kind).get(name)

        got = prev.deferring(new_models, resolve, entry)
        if got is None:
            assert any(m.placement != prev.models[m.model].placement for m in new_models)
            return
        assert resolved == [] and dict(got.models) == want_models
        fresh = _fresh(want_models, want_devices, want_engines)
        ok = not isinstance(fresh, InvalidSnapshotError)
        try:  # one by one first (an entry whose layout moved has the whole checked), then whole
            for d in _DEVICES:
                assert got.devices.get(d) == (fresh.devices[d] if ok else got.devices.get(d))
            for n in _NAMES:
                assert got.engines.get(n) == (fresh.engines.get(n) if ok else got.engines.get(n))
                assert (n in got.engines) == (n in fresh.engines if ok else n in got.engines)
            assert dict(got.devices) == dict(got.devices)
        except InvalidSnapshotError as e:
            got = e
        assert len(resolved) == 1
    else:
        try:
            got = prev.updated(new_models, new_devices, new_engines, gone)
        except InvalidSnapshotError as e:
            got = e
    assert _same(got, _fresh(want_models, want_devices, want_engines))


def test_updated_reuses_the_layout_and_tracks_starved_models():
    a = _snap("a", (), 0, 1.0)
    b = _snap("b", ("d0",), 0, 1.0)
    prev = ClusterSnapshot({"a": a, "b": b}, {"d0": DeviceSnapshot("d0", GIB, 0, ("b",))})
    assert prev.starved == ()
    waiting = prev.updated([_snap("a", (), 3, 1.0)])
    assert waiting.starved == ("a",) and waiting.models["a"].num_queued == 3
    assert prev.starved == () and prev.models["a"].num_queued == 0  # the old one is unchanged
    assert waiting.updated([_snap("a", (), 0, 1.0)]).starved == ()
    with pytest.raises(InvalidSnapshotError, match="placements put"):  # moved without its device
        prev.updated([_snap("a", ("d0",), 0, 1.0)])
    with pytest.raises(InvalidSnapshotError, match="to drop"):
        prev.updated(gone_engines=["b"])  # b has no engine here
    with pytest.raises(TypeError):
        waiting.models["c"] = a  # type: ignore[index]
