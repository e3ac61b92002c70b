"""The simulator's incrementally updated cluster snapshot (sim/snapshots.py) is, at every policy
call of a run with activations, evictions and migrations, the snapshot a fresh build of its state
gives."""

from __future__ import annotations

import dataclasses

import pytest

from prism_serve.control import ClusterSnapshot
from prism_serve.sim import SimConfig
from prism_serve.sim.errors import SimStateError
from prism_serve.sim.simulator import Simulator
from prism_serve.sim.snapshots import SnapshotBuilder

from .helpers import loose, poisson, served

TICK_S = SimConfig(num_devices=1).tick_s


@pytest.mark.parametrize(("read_every", "expected"), [(1, False), (3, False), (1, True)])
def test_every_cluster_snapshot_equals_a_fresh_build(monkeypatch, read_every, expected):
    """``read_every`` 3: the devices and engines of two snapshots in three are read one by one
    first (ClusterSnapshot.deferring builds only those), the third's only whole. ``expected``: half
    the models have an expected rate, whose share of their rates falls with time alone for the
    first window: every snapshot's rates are the estimator's at its time."""
    calls = []
    incremental = SnapshotBuilder.cluster

    def checked(self: SnapshotBuilder, now: float) -> ClusterSnapshot:
        snap = incremental(self, now)
        fresh = ClusterSnapshot(
            {n: self.model(m, now) for n, m in self.models.items()},
            {d: self.device(d) for d in self.devices},
            {n: self.engine(n) for n, m in self.models.items() if m.engine is not None},
        )
        if len(calls) % read_every:  # read one by one, as a policy reads a few (a device, an engine)
            for d in self.devices:
                assert snap.devices.get(d) == fresh.devices[d], now
            for n in self.models:
                assert snap.engines.get(n) == fresh.engines.get(n), now
        for part in ("models", "devices", "engines", "extra_replicas"):
            assert dict(getattr(snap, part)) == dict(getattr(fresh, part)), (now, part)
        assert snap.starved == fresh.starved, now
        rates = self.loop.rates
        for n, m in snap.models.items():  # a prior's share, refreshed at every tick
            if m.expected_rate is not None and rates.last_arrival(n) is None:
                now_reads = m.expected_rate * max(0.0, rates.window_s - now) / rates.window_s
                assert now_reads <= m.rate <= now_reads + m.expected_rate * TICK_S / rates.window_s + 1e-12
        calls.append(snap)
        return snap

    monkeypatch.setattr(SnapshotBuilder, "cluster", checked)
    result, arrivals = _twelve_on_two(expected)
    assert len(calls) > arrivals  # at least one snapshot per arrival
    if expected:  # and a prior's share was seen falling, then gone
        assert any(0 < m.rate < 0.1 and m.expected_rate for c in calls for m in c.models.values())
    assert result.counters["activations"] > 2 and result.counters["evictions"] > 0


def _twelve_on_two(expected: bool = False):
    """Twelve 8B models on two GPUs under prism: more than fit, so models are activated, evicted
    and moved (``expected``: the even ones expect 0.15 req/s). The run's result and its number of
    arrivals."""
    ms = [served(f"m{i}", "llama-3.1-8b") for i in range(12)]
    if expected:
        ms = [dataclasses.replace(m, expected_rate=0.15) if i % 2 == 0 else m for i, m in enumerate(ms)]
    w = poisson([m.name for m in ms], 0.15, 120.0, prompt=(64, 1024), output=(8, 128), seed=3)
    sim = Simulator(ms, w, loose(ms, ttft=2.0, tpot=0.2), SimConfig(num_devices=2, policy="prism"))
    return sim.run(), len(w)


def test_a_snapshot_read_after_the_state_changed_raises():
    """Its devices and engines are built when first read, as they were when it was taken: once the
    state changed (an effect, an event, another snapshot) that can no longer be done."""
    ms = [served(f"m{i}", "llama-3.1-8b") for i in range(3)]
    w = poisson([m.name for m in ms], 0.5, 30.0, prompt=(64, 256), output=(8, 32), seed=1)
    sim = Simulator(ms, w, loose(ms, ttft=2.0, tpot=0.2), SimConfig(num_devices=2, policy="prism"))
    sim.run()
    first = sim.cluster(sim.now)
    read = sim.cluster(sim.now)
    assert set(read.devices) == set(sim.devices)
    assert set(read.engines) == {n for n, m in sim.models.items() if m.engine is not None}
    unread = sim.cluster(sim.now)
    sim.snapshots.seal()
    with pytest.raises(SimStateError, match="after the state changed"):
        unread.devices.get("gpu00")
    assert dict(unread.models) == dict(read.models)  # its models are built with it
    with pytest.raises(SimStateError):
        dict(first.engines)


def test_prism_decides_the_same_with_its_memo_as_with_a_fresh_one_at_every_placement(monkeypatch):
    """What prism carries between placements (PrismMemo: each model's Algorithm 1 parts) only saves
    work: at every placement of a run with activations and evictions, ``place`` with the
    loop's memo returns what it returns with a fresh memo, and the memo is the loop's, one object
    for the whole run."""
    from prism_serve.control.policies.prism import PrismMemo, PrismPolicy

    placed = PrismPolicy.place
    memos = set()
    calls = []

    def both(self, cluster, now, memo=None):
        assert isinstance(memo, PrismMemo)
        memos.add(id(memo))
        fresh = placed(self, cluster, now, None)
        kept = placed(self, cluster, now, memo)
        assert kept == fresh, now
        calls.append(len(memo.parts))
        return kept

    monkeypatch.setattr(PrismPolicy, "place", both)
    result, _ = _twelve_on_two()
    assert len(memos) == 1 and max(calls) > 0  # one memo, and it carried parts
    assert result.counters["activations"] > 2 and result.counters["evictions"] > 0
