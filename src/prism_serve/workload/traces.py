"""Readers for the real traces in ``../shared/traces`` (see its README.md for sources and licences).

- Azure LLM inference 2023 (code, conv): one row per request, ``TIMESTAMP, ContextTokens,
  GeneratedTokens``; about an hour of one service each.
- ShareGPT lengths: prompt/output token counts only (no times).
- ServeGen: per client, one row per 600 s window: ``ts, rate, cv, pattern, arg1, arg2``. We draw
  inter-arrival times from the window's distribution family (Gamma or Weibull) with its mean set by
  ``rate`` and its coefficient of variation by ``cv``; ``arg1``/``arg2`` are the trace's own fit and
  are kept for reference only, because their implied mean does not always match ``rate``.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from prism_serve.workload.format import WorkloadError

__all__ = [
    "SERVEGEN_WINDOW_S",
    "ServeGenClient",
    "default_traces_dir",
    "read_azure",
    "read_lengths",
    "read_servegen_client",
    "sample_window",
    "servegen_clients",
    "weibull_shape_for_cv",
]

SERVEGEN_WINDOW_S = 600.0
TRACES_ENV = "PRISM_TRACES"  # the one environment knob: where the trace copies live


def default_traces_dir() -> Path:
    """``$PRISM_TRACES``, else ``../shared/traces`` next to the repository root."""
    env = os.environ.get(TRACES_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3].parent / "shared" / "traces"


def _need(path: Path) -> Path:
    if not path.exists():
        raise WorkloadError(f"trace file {path} not found (set ${TRACES_ENV} or --traces)")
    return path


@dataclass(slots=True, frozen=True)
class AzureTrace:
    arrivals: np.ndarray  # seconds from the first request
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    @property
    def duration(self) -> float:
        return float(self.arrivals[-1]) if len(self.arrivals) else 0.0


def read_azure(path: Path) -> AzureTrace:
    """An Azure 2023 trace file; arrival times relative to its first request."""
    times, prompt, out = [], [], []
    with open(_need(path), newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            # 7 fractional digits: more than datetime parses, and the 100 ns are noise anyway
            stamp = row["TIMESTAMP"][:26]
            times.append(datetime.fromisoformat(stamp).timestamp())
            prompt.append(int(row["ContextTokens"]))
            out.append(int(row["GeneratedTokens"]))
    if not times:
        raise WorkloadError(f"{path}: no requests")
    t = np.array(times)
    order = np.argsort(t, kind="stable")
    return AzureTrace(t[order] - t[order][0], np.array(prompt)[order], np.array(out)[order])


def read_lengths(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output) token counts from an Azure trace or the ShareGPT length table."""
    with open(_need(path), newline="") as f:
        header = f.readline()
    if header.startswith("TIMESTAMP"):
        trace = read_azure(path)
        p, o = trace.prompt_tokens, trace.output_tokens
    else:
        data = np.loadtxt(path, delimiter=",", skiprows=1, usecols=(0, 1), dtype=np.int64, ndmin=2)
        p, o = data[:, 0], data[:, 1]
    keep = (p >= 1) & (o >= 1)
    return p[keep], o[keep]


@dataclass(slots=True, frozen=True)
class ServeGenClient:
    """One ServeGen client: 600 s windows with a rate, a CV and a distribution family."""

    name: str  # pool/chunk-N
    ts: np.ndarray  # window start, s
    rate: np.ndarray  # req/s
    cv: np.ndarray
    pattern: tuple[str, ...]  # "Gamma", "Weibull" or "" (no traffic)

    def requests_between(self, start: float, end: float) -> float:
        """Expected requests in [start, end) (whole windows that start inside it)."""
        sel = (self.ts >= start) & (self.ts < end)
        return float(self.rate[sel].sum() * SERVEGEN_WINDOW_S)


def read_servegen_client(path: Path) -> ServeGenClient:
    ts, rate, cv, pattern = [], [], [], []
    with open(_need(path), newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            ts.append(float(row[0]))
            rate.append(float(row[1]))
            cv.append(float(row[2]))
            pattern.append(row[3])
    return ServeGenClient(
        f"{path.parent.name}/{path.stem.removesuffix('-trace')}",
        np.array(ts),
        np.array(rate),
        np.array(cv),
        tuple(pattern),
    )


def servegen_clients(pool_dir: Path) -> list[Path]:
    """The client files of one ServeGen pool, in chunk-number order."""
    paths = list(_need(pool_dir).glob("chunk-*-trace.csv"))
    if not paths:
        raise WorkloadError(f"{pool_dir}: no chunk-N-trace.csv files")
    return sorted(paths, key=lambda p: int(p.stem.split("-")[1]))


def weibull_shape_for_cv(cv: float) -> float:
    """The Weibull shape k whose coefficient of variation is ``cv`` (bisection on log k).

    CV^2 = Gamma(1 + 2/k) / Gamma(1 + 1/k)^2 - 1, which falls monotonically in k.
    """
    if not (cv > 0 and math.isfinite(cv)):
        raise WorkloadError(f"cv must be finite and > 0, got {cv}")
    target = math.log1p(cv * cv)

    def log_ratio(k: float) -> float:
        return math.lgamma(1 + 2 / k) - 2 * math.lgamma(1 + 1 / k)

    lo, hi = math.log(0.02), math.log(200.0)
    for _ in range(80):
        mid = (lo + hi) / 2
        if log_ratio(math.exp(mid)) > target:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def _draw_gaps(pattern: str, rate: float, cv: float, n: int, rng: np.random.Generator) -> np.ndarray:
    mean = 1.0 / rate
    if pattern == "Weibull":
        k = weibull_shape_for_cv(cv)
        return rng.weibull(k, n) * (mean / math.exp(math.lgamma(1 + 1 / k)))
    # Gamma, and the fallback for an unknown family: shape 1/cv^2 gives the CV, scale the mean
    shape = 1.0 / (cv * cv) if cv > 0 else 1.0
    return rng.gamma(shape, mean / shape, n)


def sample_window(
    pattern: str, rate: float, cv: float, length_s: float, rng: np.random.Generator
) -> np.ndarray:
    """Arrival times in [0, length_s) of a renewal process with mean gap 1/rate and the given CV."""
    if rate <= 0 or not pattern:
        return np.empty(0)
    expected = rate * length_s
    out: list[np.ndarray] = []
    t = 0.0
    while t < length_s:
        n = int(expected * 1.2) + 16
        times = t + np.cumsum(_draw_gaps(pattern, rate, cv, n, rng))
        out.append(times[times < length_s])
        t = float(times[-1])
    return np.concatenate(out)
