"""The simulator's incrementally updated cluster snapshot (sim/snapshots.py) is, at every policy
call of a run with activations, evictions and migrations, the snapshot a fresh build of its state
gives."""

from __future__ import annotations

from prism_serve.control import ClusterSnapshot
from prism_serve.sim import SimConfig
from prism_serve.sim.simulator import Simulator
from prism_serve.sim.snapshots import SnapshotBuilder

from .helpers import loose, poisson, served


def test_every_cluster_snapshot_equals_a_fresh_build(monkeypatch):
    calls = []
    incremental = SnapshotBuilder.cluster

    def checked(self: SnapshotBuilder, now: float) -> ClusterSnapshot:
        snap = incremental(self, now)
        fresh = ClusterSnapshot(
            {n: self.model(m, now) for n, m in self.models.items()},
            {d: self.device(d) for d in self.devices},
            {n: self.engine(n) for n, m in self.models.items() if m.engine is not None},
        )
        for part in ("models", "devices", "engines", "extra_replicas"):
            assert dict(getattr(snap, part)) == dict(getattr(fresh, part)), (now, part)
        assert snap.starved == fresh.starved, now
        calls.append(snap)
        return snap

    monkeypatch.setattr(SnapshotBuilder, "cluster", checked)
    # twelve 8B models on two GPUs: more than fit, so models are activated, evicted and moved
    ms = [served(f"m{i}", "llama-3.1-8b") for i in range(12)]
    w = poisson([m.name for m in ms], 0.15, 120.0, prompt=(64, 1024), output=(8, 128), seed=3)
    sim = Simulator(ms, w, loose(ms, ttft=2.0, tpot=0.2), SimConfig(num_devices=2, policy="prism"))
    result = sim.run()
    assert len(calls) > len(w)  # at least one snapshot per arrival
    assert result.counters["activations"] > 2 and result.counters["evictions"] > 0
