"""Small builders for simulator tests: synthetic Poisson workloads on the model shapes of sim/models.py."""

from __future__ import annotations

import numpy as np

from prism_serve.sim import ModelSLO, ServedModel, model_shape
from prism_serve.workload import Workload


def served(name: str = "m0", shape: str = "llama-3.1-8b", tp: int = 1) -> ServedModel:
    return ServedModel(name, model_shape(shape), tp)


def poisson(
    models: list[str],
    rate: float,
    duration: float,
    *,
    prompt: int | tuple[int, int] = 512,
    output: int | tuple[int, int] = 64,
    seed: int = 0,
) -> Workload:
    """``rate`` req/s per model, Poisson arrivals, fixed or uniform lengths (synthetic)."""
    rng = np.random.default_rng(seed)
    n = rng.poisson(rate * duration * len(models))
    times = np.sort(rng.uniform(0, duration, n))

    def lengths(x):
        return np.full(n, x) if isinstance(x, int) else rng.integers(x[0], x[1] + 1, n)

    return Workload(times, rng.integers(0, len(models), n), lengths(prompt), lengths(output), models)


def loose(models: list[ServedModel], ttft: float = 10.0, tpot: float = 1.0) -> dict[str, ModelSLO]:
    return {m.name: ModelSLO(ttft, tpot) for m in models}
