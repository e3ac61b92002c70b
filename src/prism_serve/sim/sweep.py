"""Sweeps of the paper's three axes (rate scale, SLO scale, number of GPUs). The GPU search
(``prism sim --find-gpus``) is ``prism plan``'s (sim/plan.py).

Every point is one full simulation. SLOs are measured once, on the workload at rate scale 1 (the
base workload), and scaled per point; a rate sweep rebuilds the workload from its spec with the
point's rate scale, so arrivals and lengths differ between points only by that factor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prism_serve.sim.errors import SimConfigError
from prism_serve.sim.models import ServedModel
from prism_serve.sim.simulator import ModelSLO, SimConfig, simulate
from prism_serve.sim.slo import scale_slos
from prism_serve.workload.builder import WorkloadSpec, build_workload
from prism_serve.workload.format import Workload

__all__ = ["AXES", "Experiment", "keep_fewer", "run_point", "sweep"]

AXES = ("rate", "slo", "gpus")


@dataclass(slots=True)
class Experiment:
    """Everything a point needs besides the axis value and the policy."""

    models: list[ServedModel]
    workload: Workload
    base_slos: Mapping[str, ModelSLO]  # unscaled (scale 1)
    config: SimConfig
    slo_scale: float = 5.0
    tpot_scale: float | None = None  # None: the same as slo_scale
    spec: WorkloadSpec | None = None  # needed to rebuild the workload for a rate sweep

    def workload_at(self, rate_scale: float) -> Workload:
        if rate_scale == 1.0:
            return self.workload
        if self.spec is None:
            raise SimConfigError("a rate sweep needs a workload built from a spec, not read from a file")
        return build_workload(dataclasses.replace(self.spec, rate_scale=self.spec.rate_scale * rate_scale))


def run_point(exp: Experiment, policy: str, axis: str | None = None, value: float | None = None) -> dict:
    """One simulation; the summary dict plus the axis value."""
    config = dataclasses.replace(exp.config, policy=policy)
    slo_scale, tpot_scale, workload = exp.slo_scale, exp.tpot_scale, exp.workload
    if axis == "rate":
        workload = exp.workload_at(value)
    elif axis == "slo":
        slo_scale, tpot_scale = (
            value,
            None if exp.tpot_scale is None else exp.tpot_scale * value / exp.slo_scale,
        )
    elif axis == "gpus":
        config = dataclasses.replace(config, num_devices=int(value))
    elif axis is not None:
        raise SimConfigError(f"unknown axis {axis!r}; choose one of {', '.join(AXES)}")
    if any(m.tp_size > config.num_devices for m in exp.models):
        # a TP model wider than the cluster cannot run: every one of its requests misses
        models = [m for m in exp.models if m.tp_size <= config.num_devices]
    else:
        models = exp.models
    dropped = workload.restrict([m.name for m in models]) if len(models) < len(exp.models) else workload
    res = simulate(models, dropped, scale_slos(exp.base_slos, slo_scale, tpot_scale), config)
    out = res.summary()
    out["per_model"] = res.per_model()
    lost = len(workload) - len(dropped)
    if lost:
        # attainment counts the judged requests (sim/metrics.py: batch ones are not)
        judged = out["num_judged"] + int(workload.judged().sum()) - int(dropped.judged().sum())
        out["ttft_attainment"] *= out["num_judged"] / judged
        out["tpot_attainment"] *= out["num_judged"] / judged
        out["num_requests"] += lost
        out["num_judged"] = judged
        out["num_rejected"] += lost
    out.update(axis=axis, value=value, slo_scale=slo_scale, tpot_scale=tpot_scale or slo_scale)
    return out


def keep_fewer(rows: list[dict], metric: str = "ttft_attainment") -> None:
    """Mark, in place, each point of a device-count sweep of one baseline that may keep its
    assignment for fewer devices and leave the rest idle (``Policy.keeps_fewer_devices``) where a
    smaller count of the sweep did better by ``metric``: its ``kept`` entry is what that deployment
    attains on this count (the smaller count's run exactly: the idle devices change nothing), the
    count it comes from, and the metrics the point's own placement gave stay as they were. So a
    baseline given one more device never does worse than with one fewer, as an operator would run
    it, and its own placement's figure at each count stays visible beside it."""
    best: dict | None = None
    for r in sorted(rows, key=lambda r: r["value"]):
        if best is not None and best[metric] > r[metric]:
            r["kept"] = {
                "from_devices": int(best["value"]),
                "ttft_attainment": best["ttft_attainment"],
                "tpot_attainment": best["tpot_attainment"],
            }
        elif best is None or r[metric] > best[metric]:
            best = r


def sweep(
    exp: Experiment,
    axis: str,
    values: Iterable[float],
    policies: Iterable[str],
    progress: Callable[[], None] | None = None,
    metric: str = "ttft_attainment",
) -> list[dict]:
    """Every point of ``axis`` at ``values`` for each policy. On the device-count axis a baseline
    that may keep a smaller count's assignment (``Policy.keeps_fewer_devices``) has its points
    marked where it would (``keep_fewer``, by ``metric``)."""
    from prism_serve.control.policies import POLICIES

    rows = []
    for policy in policies:
        own = []
        for v in values:
            own.append(run_point(exp, policy, axis, v))
            if progress is not None:
                progress()
        if axis == "gpus" and POLICIES[policy].keeps_fewer_devices:
            keep_fewer(own, metric)
        rows += own
    return rows
