"""Which live engine steps ran while another CPU device was stepping (the host-wide interference).

CPU devices are cores of one socket: they share its memory bandwidth and last-level cache, so a
step on one core costs more CPU time while another core steps too. ``PRISM_STEP_TRACE`` files are
named after the worker (``cpu:0_w3.jsonl`` for worker ``cpu:0/w3``), which gives each step's device;
this module measures, for every step, the share of its wall time during which a step of another
device was in flight, and from steps of one kind that ran with and without such a neighbour the
simulator's ``cross_interference`` (sim/hardware.py): CPU seconds over the cost model's, with the
other device busy throughout, divided by the same with it idle throughout, minus one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from prism_serve.engine.step_trace import StepRecord, read_step_traces

__all__ = [
    "cross_estimate", "device_of", "device_steps", "host_speed", "host_speed_profile", "host_speeds",
    "other_device_overlap", "serving_estimate",
]  # fmt: skip

BUSY = 0.9  # share of a step overlapped by other devices' steps above which it counts as crossed
IDLE = 0.05  # ... below which it ran with the other devices idle


def device_of(path: Path) -> str:
    """The device of a step-trace file: ``cpu:0_w3.jsonl`` -> ``cpu:0``."""
    stem = path.stem
    return stem.rsplit("_w", 1)[0] if "_w" in stem else stem


def device_steps(paths: Iterable[Path]) -> list[tuple[str, StepRecord]]:
    """(device, step) for every step of the given trace files or directories, in file order."""
    out: list[tuple[str, StepRecord]] = []
    for p in paths:
        files = sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
        for f in files:
            out += [(device_of(f), r) for r in read_step_traces([f])]
    return out


def _union(intervals: np.ndarray) -> np.ndarray:
    """Disjoint [start, end) intervals covering the given ones (rows), sorted."""
    if not len(intervals):
        return intervals.reshape(0, 2)
    iv = intervals[np.argsort(intervals[:, 0])]
    merged = [list(iv[0])]
    for s, e in iv[1:]:
        if s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return np.array(merged)


def other_device_overlap(
    steps: Sequence[tuple[str, StepRecord]], run: Sequence[int] | None = None
) -> np.ndarray:
    """Per step, the share of its wall time during which a step of another device of the same run
    was in flight (0..1). ``run``: a run label per step (the default: one run); steps of different
    runs never overlap, whatever their clocks say."""
    run = np.zeros(len(steps), dtype=int) if run is None else np.asarray(run)
    out = np.zeros(len(steps))
    for label in np.unique(run):
        idx = np.flatnonzero(run == label)
        devices = sorted({steps[i][0] for i in idx})
        for dev in devices:
            mine = [i for i in idx if steps[i][0] == dev]
            others = np.array(
                [(r.t, r.t + r.dt) for i in idx if steps[i][0] != dev for r in (steps[i][1],)]
            ).reshape(-1, 2)
            cover = _union(others)
            starts, ends = cover[:, 0], cover[:, 1]
            for i in mine:
                r = steps[i][1]
                t0, t1 = r.t, r.t + r.dt
                lo, hi = np.searchsorted(ends, t0), np.searchsorted(starts, t1)
                seg = np.clip(np.minimum(ends[lo:hi], t1) - np.maximum(starts[lo:hi], t0), 0, None)
                out[i] = min(1.0, float(seg.sum()) / r.dt) if r.dt > 0 else 0.0
    return out


def cross_estimate(
    cpu: np.ndarray, predicted: np.ndarray, overlap: np.ndarray
) -> tuple[float, int, int] | None:
    """(cross_interference, crossed steps, solo steps) from steps that each ran alone on their own
    core: the CPU-over-predicted ratio of steps with other devices busy (overlap >= BUSY) over that of
    steps with them idle (overlap <= IDLE), minus one; None without both kinds of step."""
    crossed, solo = overlap >= BUSY, overlap <= IDLE
    if not crossed.any() or not solo.any():
        return None
    ratio = (cpu[crossed].sum() / predicted[crossed].sum()) / (cpu[solo].sum() / predicted[solo].sum())
    return float(ratio - 1.0), int(crossed.sum()), int(solo.sum())


def serving_estimate(wall: np.ndarray, cpu: np.ndarray, overlap: np.ndarray) -> tuple[float, int, int] | None:
    """(serving_share, crossed steps, solo steps) from steps that each ran alone on their own core:
    the wall-over-CPU ratio of steps with the other devices busy (overlap >= BUSY) over that of
    steps with them idle (overlap <= IDLE), minus one. With a core idle the serving path (server,
    clients, the workers' own threads) runs there; with none, it takes wall time from the steps
    (sim/hardware.py ``serving_share``). Exact for two devices, where "another device busy" is
    "every device busy". None without both kinds of step."""
    crossed, solo = overlap >= BUSY, overlap <= IDLE
    if not crossed.any() or not solo.any():
        return None
    ratio = (wall[crossed].sum() / cpu[crossed].sum()) / (wall[solo].sum() / cpu[solo].sum())
    return float(ratio - 1.0), int(crossed.sum()), int(solo.sum())


def host_speed(
    steps_dir: Path,
    predict: Callable[[StepRecord], float | None],
    memory_part: Callable[[StepRecord], float | None] | None = None,
    seconds: str = "cpu",
) -> dict | None:
    """How fast the host ran during one live run, against a profile: the CPU seconds of the run's
    decode steps that had their core and no other device stepping (overlap <= IDLE), over what
    ``predict`` gives for them (None: a step of a model it cannot price, left out). A host whose
    memory or neighbours change between runs moves this by several percent; the simulator has one
    fixed profile. None when the run has no such steps. ``seconds="wall"``: the same steps' wall
    seconds instead, for a profile fitted to wall seconds (HardwareProfile.step_seconds): on a VM a
    busy core gives its thread about 95% of the wall time, which such a profile already carries.

    With ``memory_part`` (the part of ``predict`` spent on memory traffic: weights and KV), the
    prefill steps count too, and the two speeds are solved for separately: ``memory`` and
    ``compute`` such that each kind's CPU seconds = memory x its memory part + compute x the rest
    (decode steps are mostly memory, prefill steps mostly compute; the host's memory bandwidth and
    its cores' speed need not drift together)."""
    steps = device_steps([steps_dir]) if steps_dir.is_dir() else []
    if not steps:
        return None
    overlap = other_device_overlap(steps)
    # seconds spent (CPU or wall: ``seconds``), predicted, memory part, steps
    sums = {"decode": np.zeros(4), "prefill": np.zeros(4)}
    for (_, r), o in zip(steps, overlap, strict=True):
        if o > IDLE or r.cpu < 0.8 * r.dt:
            continue
        kind = "decode" if all(new == 1 for new, _, _ in r.batch) else "prefill"
        if kind == "prefill" and memory_part is None:
            continue
        p = predict(r)
        m = memory_part(r) if memory_part is not None else 0.0
        if p is None or m is None:
            continue
        sums[kind] += (r.dt if seconds == "wall" else r.cpu, p, m, 1)
    spent, pred, _, n = sums["decode"]
    if not n:
        return None
    out = {"ratio": round(spent / pred, 4), "steps": int(n)}
    if memory_part is not None and sums["prefill"][3]:
        # [memory part, compute part] . [memory, compute] = seconds spent, one row per kind
        a = np.array([[s[2], s[1] - s[2]] for s in sums.values()])
        b = np.array([s[0] for s in sums.values()])
        if abs(np.linalg.det(a)) > 1e-12 * np.abs(a).max() ** 2:
            memory, compute = np.linalg.solve(a, b)
            if memory > 0 and compute > 0:
                out |= {"memory": round(float(memory), 4), "compute": round(float(compute), 4),
                        "prefill_steps": int(sums["prefill"][3])}  # fmt: skip
    return out


def host_speeds(live_runs: list[dict], specs: dict, hardware: str) -> dict[int, dict]:
    """Per live run (index), ``host_speed`` against the ``hardware`` profile, with the memory and compute
    speeds apart: how much more (> 1) or less time than the profile the run's uncontended steps took, in
    the seconds the profile was fitted to (``HardwareProfile.step_seconds``). ``specs``: model name -> its
    simulated shape; ``live_runs``: live_run.py's runs (each with its ``steps_dir``)."""
    import dataclasses

    from prism_serve.control.types import REPLICA_SEPARATOR
    from prism_serve.sim.cost import RooflineCostModel
    from prism_serve.sim.fit import predict
    from prism_serve.sim.hardware import get_hardware

    hw = get_hardware(hardware)
    cm = RooflineCostModel(hw)
    # the same steps with free compute: what is left is the memory traffic (the CPU form is a sum)
    memory_only = RooflineCostModel(dataclasses.replace(hw, peak_flops=1e30, attn_flops=1e30))

    def priced(model):
        def price(step) -> float | None:
            spec = specs.get(step.model.split(REPLICA_SEPARATOR)[0])
            return None if spec is None else predict(model, spec, [tuple(b) for b in step.batch])

        return price

    price = priced(cm)
    memory = priced(memory_only) if not hw.overlap else None  # a roofline max does not split
    out = {}
    for i, run in enumerate(live_runs):
        steps_dir = run.get("steps_dir")
        speed = host_speed(Path(steps_dir), price, memory, hw.step_seconds) if steps_dir else None
        if speed is not None:
            out[i] = speed
    return out


def host_speed_profile(hw, speeds: dict[int, dict]):
    """``hw`` at the runs' mean speeds (``HardwareProfile.slowed``): its memory traffic slowed by the
    mean memory speed and its compute by the mean compute speed (the decode-only ratio for both where
    a run has no split); None without runs."""
    if not speeds:
        return None
    memory = float(np.mean([s.get("memory", s["ratio"]) for s in speeds.values()]))
    compute = float(np.mean([s.get("compute", s["ratio"]) for s in speeds.values()]))
    return hw.slowed(memory, compute_factor=compute)
