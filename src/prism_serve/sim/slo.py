"""SLOs as the Prism paper sets them (section 7.2): each model's P95 TTFT and P95 TPOT when its own
requests run alone on dedicated devices, measured here in the simulator, times an SLO scale.

A P95 over a handful of requests says little, so a model with fewer than ``min_requests`` requests is
measured on a probe instead: ``min_requests`` requests with lengths drawn (seeded) from the whole
workload, one every ``probe_gap_s`` seconds. Results depend on the hardware profile and the engine
knobs of ``base``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from prism_serve.sim.config import ModelSLO, SimConfig
from prism_serve.sim.models import ServedModel
from prism_serve.sim.simulator import simulate
from prism_serve.workload.format import Workload, WorkloadError

__all__ = ["load_slos", "measure_slos", "save_slos", "scale_slos"]

_UNBOUNDED = 1e9  # SLO handed to the dedicated run: the measurement, not a target


def measure_slos(
    models: list[ServedModel],
    workload: Workload,
    base: SimConfig,
    *,
    min_requests: int = 50,
    probe_gap_s: float = 2.0,
    seed: int = 0,
    jobs: int | None = 1,
) -> dict[str, ModelSLO]:
    """P95 TTFT and TPOT of every model alone on ``tp_size`` dedicated devices (FIFO, no sharing);
    ``jobs``: simulations at once, in worker processes (None: one per core). The runs are
    independent and their inputs (probes included) drawn here in model order, so the SLOs are the
    same for any ``jobs``."""
    if len(workload) == 0:
        raise WorkloadError("cannot derive SLOs from an empty workload")
    rng = np.random.default_rng(seed)
    runs = []
    for m in models:
        alone = workload.only(m.name) if m.name in workload.models else None
        if alone is None or len(alone) < min_requests:
            pick = rng.integers(0, len(workload), min_requests)
            alone = Workload(
                np.arange(min_requests) * probe_gap_s,
                np.zeros(min_requests, dtype=np.int32),
                workload.prompt_tokens[pick],
                workload.output_tokens[pick],
                [m.name],
            )
        cfg = dataclasses.replace(base, num_devices=m.tp_size, policy="dedicated", knobs=())
        runs.append((m, alone, cfg))
    workers = max(1, min(jobs or os.cpu_count() or 1, len(runs)))
    if workers == 1:
        return dict(map(_measure_one, runs))
    with ProcessPoolExecutor(workers) as pool:
        return dict(pool.map(_measure_one, runs))


def _measure_one(run: tuple[ServedModel, Workload, SimConfig]) -> tuple[str, ModelSLO]:
    m, alone, cfg = run
    res = simulate([m], alone, {m.name: ModelSLO(_UNBOUNDED, _UNBOUNDED)}, cfg)
    ttfts = [r.ttft for r in res.requests if r.first_token is not None]
    tpots = [r.tpot for r in res.requests if r.finish is not None and r.output_tokens > 1]
    if not ttfts or not tpots:
        raise WorkloadError(f"{m.name}: the dedicated run finished no request; cannot derive its SLOs")
    return m.name, ModelSLO(float(np.percentile(ttfts, 95)), float(np.percentile(tpots, 95)))


def scale_slos(
    slos: Mapping[str, ModelSLO], ttft_scale: float, tpot_scale: float | None = None
) -> dict[str, ModelSLO]:
    if ttft_scale <= 0 or (tpot_scale is not None and tpot_scale <= 0):
        raise WorkloadError("SLO scales must be > 0")
    return {m: s.scaled(ttft_scale, tpot_scale) for m, s in slos.items()}


def save_slos(slos: Mapping[str, ModelSLO], path: str | Path, **meta: object) -> None:
    body = {"meta": meta, "slos": {m: {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s} for m, s in slos.items()}}
    Path(path).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def load_slos(path: str | Path) -> dict[str, ModelSLO]:
    try:
        body = json.loads(Path(path).read_text())
        return {m: ModelSLO(float(v["ttft_s"]), float(v["tpot_s"])) for m, v in body["slos"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WorkloadError(f"{path}: not an SLO file ({exc})") from None
