"""What activating each of a deployment's models costs on this machine, measured by the live runtime,
for ``prism fit-hardware --shapes`` (the profile's ``shape_activations``, sim/hardware.py).

A one-core device of the runtime copies weights at that core's memory rate, not the whole machine's,
and around the copy it hands the job to a pooled worker, grants and maps (or creates) the weight
pages and builds the engine; for a shape larger than the pages a worker kept from the model before,
creating pages costs more than the copy. So the runtime's own activations are timed, per model:
``prism_serve.runtime.activation_probe`` in a process of its own (the simulator may not import the
runtime), on the fit's core in the deployment's budget, and each shape gets its measured time
around the copy, its copy rate and the time its eviction takes. The profile's
``activation_overhead_s`` and ``host_bandwidth`` become the medians, for shapes not measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence

from prism_serve.sim.fit import FitResult

__all__ = ["measure_activations", "with_activations"]

PROBE = "prism_serve.runtime.activation_probe"


def measure_activations(
    sources: Sequence[str], core: int, memory: int, rounds: int = 3, timeout_s: float = 900
) -> dict:
    """``activation_probe``'s result for ``sources`` on ``core``, a device of ``memory`` bytes: per
    source, its weight bytes and the median seconds of each phase (or why it could not be
    activated). RuntimeError naming the probe's last words if it fails."""
    cmd = [sys.executable, "-m", PROBE, "--core", str(core), "--rounds", str(rounds), "--memory", str(memory)]
    cmd += list(sources)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"activation probe exited {done.returncode}: {' | '.join(tail)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def with_activations(
    result: FitResult,
    shapes: Mapping[str, object],
    core: int | None = None,
    memory: int | None = None,
    rounds: int = 3,
) -> FitResult:
    """``result`` with each of ``shapes`` (engine source -> ModelShape) activated by the runtime on
    ``core`` (default: the last this process may use, as the fit's) in a device of ``memory`` bytes
    (default: the profile's; a deployment's budget decides which models swap in beside another):
    the profile's ``shape_activations`` set per shape, ``activation_overhead_s`` and
    ``host_bandwidth`` to their medians, and a report line. A probe that fails keeps the base's
    activation terms, and says why."""
    core = max(os.sched_getaffinity(0)) if core is None else core
    hw = result.profile
    memory = hw.memory_bytes if memory is None else memory
    try:
        found = measure_activations(list(shapes), core, memory, rounds)
    except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
        note = f"activations not measured ({type(e).__name__}: {e}): the base's activation terms kept"
        return dataclasses.replace(result, notes=(*result.notes, note))
    rows, lines = [], []
    for source, m in found.items():
        if "error" in m:
            lines.append(f"{shapes[source].name}: not measured ({m['error']}), priced at the medians")
            continue
        around = m["take_s"] + m["map_s"] + m["ready_s"]
        rate = m["weight_bytes"] / m["copy_s"] if m["copy_s"] > 0 else None
        if rate is None:
            continue
        name = shapes[source].name
        rows.append((name, around, rate, m.get("evict_s") or 0.0))
        lines.append(
            f"{name}: {m['total_s'] * 1000:.0f} ms ({m['weight_bytes'] / 2**30:.2f} GiB copied at "
            f"{rate / 1e9:.1f} GB/s, {around * 1000:.0f} ms around it; take {m['take_s'] * 1000:.0f}, "
            f"map {m['map_s'] * 1000:.0f}, ready {m['ready_s'] * 1000:.0f} ms)"
            + (f"; unloaded in {m['evict_s'] * 1000:.0f} ms" if m.get("evict_s") is not None else "")
        )
    if not rows:
        note = "activations not measured (the probe timed none): the base's activation terms kept"
        return dataclasses.replace(result, notes=(*result.notes, note))
    hw = dataclasses.replace(
        hw,
        shape_activations=tuple(rows),
        activation_overhead_s=statistics.median(r[1] for r in rows),
        host_bandwidth=statistics.median(r[2] for r in rows),
        host_efficiency=1.0,
    )
    note = (
        f"activations on core {core} in {memory / 2**20:.0f} MiB (median of {rounds} each, the "
        "runtime's pooled workers, each model activated beside the one before where both fit):\n  "
    ) + ("\n  ".join(lines))
    return dataclasses.replace(result, profile=hw, notes=(*result.notes, note))
