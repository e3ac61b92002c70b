"""Device-count sweeps of a baseline that may keep a smaller count's assignment (sim/sweep.py)."""

from __future__ import annotations

import pytest

from prism_serve.sim import sweep as sweep_mod
from prism_serve.sim.sweep import keep_fewer


def _row(policy: str, n: int, ttft: float, tpot: float = 1.0) -> dict:
    return {"policy": policy, "axis": "gpus", "value": n, "ttft_attainment": ttft, "tpot_attainment": tpot}


def test_a_count_that_does_worse_than_a_smaller_one_keeps_the_best_smaller_assignment():
    # given out of order, as --values may be
    rows = [_row("m", 26, 0.9895, 0.97), _row("m", 24, 0.9920, 0.95), _row("m", 25, 0.9902),
            _row("m", 27, 0.9911), _row("m", 28, 0.9930)]  # fmt: skip
    keep_fewer(rows)
    by = {r["value"]: r for r in rows}
    # 25 and 26 and 27 did worse than 24: each keeps 24's assignment and reports 24's run
    for n in (25, 26, 27):
        assert by[n]["kept"] == {"from_devices": 24, "ttft_attainment": 0.9920, "tpot_attainment": 0.95}
    # the point's own placement's figures stay as they were
    assert by[26]["ttft_attainment"] == 0.9895 and by[26]["tpot_attainment"] == 0.97
    # 24 is the first, 28 beats it: their own placements are what they run
    assert "kept" not in by[24] and "kept" not in by[28]
    # so what the baseline runs never falls as devices are added
    runs = [by[n].get("kept", by[n])["ttft_attainment"] for n in sorted(by)]
    assert runs == sorted(runs)


def test_a_tie_keeps_its_own_placement_and_the_metric_decides():
    rows = [_row("m", 3, 0.99, 0.80), _row("m", 4, 0.99, 0.70), _row("m", 5, 0.98, 0.90)]
    keep_fewer(rows)
    assert "kept" not in rows[1]  # no better than 3, no worse either
    assert rows[2]["kept"]["from_devices"] == 3
    rows = [_row("m", 3, 0.99, 0.80), _row("m", 4, 0.99, 0.70), _row("m", 5, 0.98, 0.90)]
    keep_fewer(rows, metric="tpot_attainment")
    assert rows[1]["kept"]["from_devices"] == 3 and "kept" not in rows[2]


@pytest.mark.parametrize(
    ("policy", "kept"), [("muxserve", True), ("static-partition", True), ("prism", False)]
)
def test_only_a_baseline_that_may_keep_fewer_devices_is_marked(monkeypatch, policy, kept):
    """prism must itself do no worse with more devices (Policy.keeps_fewer_devices is False): its
    points are what its own placement gave, never replaced by a smaller count's."""
    attained = {2: 0.995, 3: 0.97}

    def point(exp, policy, axis, value):
        return _row(policy, int(value), attained[int(value)])

    monkeypatch.setattr(sweep_mod, "run_point", point)
    rows = sweep_mod.sweep(None, "gpus", [2, 3], [policy])
    assert ("kept" in rows[1]) is kept
    # another axis is never marked: a rate or SLO point is not a deployment of fewer devices
    rows = sweep_mod.sweep(None, "rate", [2, 3], [policy])
    assert not any("kept" in r for r in rows)
