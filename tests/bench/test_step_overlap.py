"""benchmarks/step_overlap.py: which traced steps ran while another device stepped, and the
host-wide interference estimated from them (the simulator's cross_interference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prism_serve.engine.step_trace import StepRecord, StepTrace

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def so():
    return load_benchmark("step_overlap")


def _write(directory: Path, worker: str, steps: list[tuple[float, float]]) -> None:
    """Steps (start, wall seconds) of one worker, written as a live worker writes them."""
    trace = StepTrace(directory / f"{worker.replace('/', '_')}.jsonl")
    for t, dt in steps:
        trace.write(StepRecord(model="m", t=t, dt=dt, cpu=dt, batch=[(1, 10, True)]))
    trace.close()


def test_the_device_comes_from_the_worker_id_in_the_file_name(so):
    assert so.device_of(Path("x/cpu:0_w3.jsonl")) == "cpu:0"
    assert so.device_of(Path("cpu:12_w0.jsonl")) == "cpu:12"
    assert so.device_of(Path("other.jsonl")) == "other"


def test_overlap_counts_other_devices_only_and_merges_their_steps(so, tmp_path):
    # cpu:0: a step [0, 1) and one [10, 11); same-device neighbour cpu:0/w1 at [0, 1) does not count
    _write(tmp_path, "cpu:0/w0", [(0.0, 1.0), (10.0, 1.0)])
    _write(tmp_path, "cpu:0/w1", [(0.0, 1.0)])
    # cpu:1: two overlapping steps covering [0.5, 0.9) (counted once) and [10.0, 11.0)
    _write(tmp_path, "cpu:1/w2", [(0.5, 0.3), (0.6, 0.3), (10.0, 1.0)])
    steps = so.device_steps([tmp_path])
    overlap = so.other_device_overlap(steps)
    got = {(dev, r.t, r.dt): o for (dev, r), o in zip(steps, overlap, strict=True)}
    assert got[("cpu:0", 0.0, 1.0)] == pytest.approx(0.4)  # [0.5, 0.9) of [0, 1), both workers
    assert got[("cpu:0", 10.0, 1.0)] == pytest.approx(1.0)
    assert got[("cpu:1", 0.5, 0.3)] == pytest.approx(1.0)
    assert got[("cpu:1", 10.0, 1.0)] == pytest.approx(1.0)
    assert len(steps) == 6


def test_steps_of_different_runs_never_overlap(so, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "cpu:0/w0", [(0.0, 1.0)])
    _write(b, "cpu:1/w0", [(0.0, 1.0)])
    steps = so.device_steps([a, b])
    assert so.other_device_overlap(steps).tolist() == [1.0, 1.0]
    assert so.other_device_overlap(steps, run=[0, 1]).tolist() == [0.0, 0.0]


def test_cross_estimate_is_the_ratio_of_crossed_to_solo_cost(so):
    predicted = np.array([1.0, 2.0, 1.0, 2.0, 1.0])
    cpu = np.array([1.0, 2.0, 1.2, 2.4, 5.0])  # the last is partly crossed: in neither group
    overlap = np.array([0.0, 0.01, 1.0, 0.95, 0.5])
    est, crossed, solo = so.cross_estimate(cpu, predicted, overlap)
    assert est == pytest.approx(0.2) and (crossed, solo) == (2, 2)
    assert so.cross_estimate(cpu[:2], predicted[:2], overlap[:2]) is None


def test_serving_estimate_is_the_ratio_of_crossed_to_solo_wall_over_cpu(so):
    cpu = np.array([1.0, 2.0, 1.0, 2.0, 1.0])
    wall = np.array([1.01, 2.02, 1.04 * 1.01, 2.08 * 1.01, 3.0])  # the last is partly crossed
    overlap = np.array([0.0, 0.01, 1.0, 0.95, 0.5])
    est, crossed, solo = so.serving_estimate(wall, cpu, overlap)
    assert est == pytest.approx(0.04) and (crossed, solo) == (2, 2)
    assert so.serving_estimate(wall[:2], cpu[:2], overlap[:2]) is None


def test_host_speed_prices_the_uncontended_decode_steps_only(so, tmp_path):
    """Decode steps alone cost 1.1x the price; a step crossed by the other device, a prefill step
    and a step that lost its core (CPU < 0.8 wall) are left out."""

    def write(worker: str, steps: list[StepRecord]) -> None:
        trace = StepTrace(tmp_path / f"{worker.replace('/', '_')}.jsonl")
        for s in steps:
            trace.write(s)
        trace.close()

    def step(t: float, cpu: float, dt: float | None = None, batch=((1, 10, True),)) -> StepRecord:
        return StepRecord(model="m#1", t=t, dt=dt or cpu, cpu=cpu, batch=list(batch))

    prefill = [(64, 0, True)]
    write("cpu:0/w0", [step(0.0, 1.1), step(2.0, 2.2), step(10.0, 5.0), step(20.0, 3.0, batch=prefill),
                       step(30.0, 1.0, dt=2.0)])  # fmt: skip
    write("cpu:1/w1", [step(10.0, 5.0, batch=prefill)])
    prices = {0.0: 1.0, 2.0: 2.0}
    assert so.host_speed(tmp_path, lambda r: prices.get(r.t, 1.0)) == {"ratio": 1.1, "steps": 2}
    assert so.host_speed(tmp_path, lambda r: None) is None
    assert so.host_speed(tmp_path / "missing", lambda r: 1.0) is None


def test_host_speed_in_wall_seconds_for_a_profile_fitted_to_them(so, tmp_path):
    """The same uncontended steps, their wall seconds over the price (a profile timed in wall
    seconds, HardwareProfile.step_seconds "wall"); which steps count is still decided by CPU."""
    trace = StepTrace(tmp_path / "cpu_0_w0.jsonl")
    for t, cpu, dt in ((0.0, 1.0, 1.05), (2.0, 2.0, 2.1), (4.0, 1.0, 2.0)):  # the last lost its core
        trace.write(StepRecord(model="m#1", t=t, dt=dt, cpu=cpu, batch=[(1, 10, True)]))
    trace.close()
    assert so.host_speed(tmp_path, lambda r: 1.0 if r.t != 2.0 else 2.0) == {"ratio": 1.0, "steps": 2}
    wall = so.host_speed(tmp_path, lambda r: 1.0 if r.t != 2.0 else 2.0, seconds="wall")
    assert wall == {"ratio": 1.05, "steps": 2}


def test_host_speed_solves_memory_and_compute_speeds_apart(so, tmp_path):
    """Decode steps priced 1.0 s (0.9 memory), prefill steps 2.0 s (0.4 memory); the run's memory is
    1.2x slower than the profile and its compute 0.9x: each step's CPU is 1.2 x memory + 0.9 x the
    rest, and host_speed recovers both."""
    trace = StepTrace(tmp_path / "cpu:0_w0.jsonl")
    decode, prefill = [(1, 10, True)], [(64, 0, True)]
    t = 0.0
    for batch, price, memory in ((decode, 1.0, 0.9), (prefill, 2.0, 0.4)) * 3:
        cpu = 1.2 * memory + 0.9 * (price - memory)
        trace.write(StepRecord(model="m", t=t, dt=cpu, cpu=cpu, batch=batch))
        t += 10.0
    trace.close()

    def price(r):
        return 1.0 if r.batch[0][0] == 1 else 2.0

    def memory(r):
        return 0.9 if r.batch[0][0] == 1 else 0.4

    got = so.host_speed(tmp_path, price, memory)
    assert got["memory"] == pytest.approx(1.2, abs=1e-4) and got["compute"] == pytest.approx(0.9, abs=1e-4)
    assert got["ratio"] == pytest.approx(1.17, abs=1e-4) and got["steps"] == 3 and got["prefill_steps"] == 3
    assert "memory" not in so.host_speed(tmp_path, price)  # decode steps only without the split


def test_the_host_speed_profile_scales_memory_and_compute_rates_apart(so):
    from prism_serve.sim.hardware import HARDWARE

    hw = HARDWARE["cpu-smollm2-avx512bf16"]
    at = so.host_speed_profile(hw, {0: {"ratio": 1.1, "memory": 1.2, "compute": 0.8}, 1: {"ratio": 1.0}})
    assert at.mem_bandwidth == pytest.approx(hw.mem_bandwidth / 1.1)  # mean of 1.2 and 1.0
    assert at.kv_bandwidth == pytest.approx(hw.kv_bandwidth / 1.1)
    assert at.peak_flops == pytest.approx(hw.peak_flops / 0.9)  # mean of 0.8 and 1.0
    assert at.attn_flops == pytest.approx(hw.attn_flops / 0.9)
    assert at.cross_interference == hw.cross_interference and at.share_interference == hw.share_interference
    assert so.host_speed_profile(hw, {}) is None
