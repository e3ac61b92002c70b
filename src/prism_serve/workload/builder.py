"""Multi-model workloads from real traces (the method of the Prism and WarmServe papers).

Every served model takes the arrival process of one *source*, so popularity is long-tailed and idle
periods are the trace's own:

- ``servegen:<pool>`` (pool = m-large, m-mid or m-small): one ServeGen client per model, picked at
  random (seeded) among the clients with traffic in ``[start_s, start_s + duration_s)``; when a pool
  has fewer active clients than models, the same clients a day later (then two days, ...) are added
  as further sources, i.e. time-shifted copies. Arrivals inside each 600 s window follow the window's
  Gamma or Weibull family with its rate and CV (``traces.sample_window``).
- ``azure:conv`` / ``azure:code``: every model takes the Azure trace from its own random offset
  (wrapping around), thinned to a Zipf popularity weight: the model of popularity rank ``r`` (a random
  permutation) keeps each arrival with probability ``(r + 1) ** -zipf``.

Rates: ``total_rate`` (req/s, optional) first rescales the sources so that the expected mean total
rate is that; ``rate_scale`` then multiplies every model's rate (the paper's "rate scale" axis). A
factor above 1 on an Azure slice replicates arrivals (each copy jittered by up to ``_JITTER_S``).

- ``mooncake``: the Mooncake trace's own requests (workload/mooncake.py), with their lengths and
  prompt block hashes (``lengths`` is not used). Every request goes to the model of its first block:
  each distinct first block picks one model (seeded) with the Zipf weights above, so requests that
  share a prefix go to one model. ``block_tokens`` scales the trace's 512-token blocks and its
  prompts alike (16 or 32 fit prompts into a 2048-token context, with ``max_prompt_tokens``);
  ``rate_scale`` (and ``total_rate``) compress time rather than thin or replicate, so the sharing
  between requests stays the trace's; the window is its first ``duration_s`` seconds after that.

Lengths: every request draws a (prompt, output) pair from ``lengths``: ``azure:conv``, ``azure:code``
or ``sharegpt``, uniformly with replacement, optionally capped by ``max_prompt_tokens`` /
``max_output_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np

from prism_serve.workload.format import Workload, WorkloadError
from prism_serve.workload.mooncake import MOONCAKE_FILE, read_mooncake, scale_mooncake
from prism_serve.workload.traces import (
    SERVEGEN_WINDOW_S,
    default_traces_dir,
    read_azure,
    read_lengths,
    read_servegen_client,
    sample_window,
    servegen_clients,
)

__all__ = ["LENGTH_FILES", "SOURCES", "WorkloadSpec", "build_workload"]

_DAY_S = 86400.0
_JITTER_S = 1.0

LENGTH_FILES: Mapping[str, str] = MappingProxyType(
    {
        "azure:conv": "azure2023_conv.csv",
        "azure:code": "azure2023_code.csv",
        "sharegpt": "lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    }
)


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    models: tuple[str, ...]
    source: str = "servegen:m-large"
    lengths: str = "azure:conv"
    duration_s: float = 3600.0
    start_s: float = _DAY_S + 10 * 3600.0  # ServeGen: day 2, 10:00 (ignored by azure sources)
    rate_scale: float = 1.0
    total_rate: float | None = None
    zipf: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    block_tokens: int | None = None  # mooncake: tokens per hashed block after scaling (None: 512)
    seed: int = 0
    traces_dir: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.models or len(set(self.models)) != len(self.models):
            raise WorkloadError("a workload needs one or more distinct model names")
        kind = self.source.split(":", 1)[0]
        if kind not in SOURCES:
            raise WorkloadError(f"unknown source {self.source!r}; kinds: {', '.join(sorted(SOURCES))}")
        if self.lengths not in LENGTH_FILES:
            raise WorkloadError(f"unknown lengths {self.lengths!r}; choose one of {', '.join(LENGTH_FILES)}")
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise WorkloadError("duration_s must be a positive number of seconds")
        if not (self.rate_scale > 0 and math.isfinite(self.rate_scale)):
            raise WorkloadError("rate_scale must be > 0")
        if self.total_rate is not None and not self.total_rate > 0:
            raise WorkloadError("total_rate must be > 0")
        if self.start_s < 0 or self.zipf < 0:
            raise WorkloadError("start_s and zipf must be >= 0")
        for cap in (self.max_prompt_tokens, self.max_output_tokens):
            if cap is not None and cap < 1:
                raise WorkloadError("token caps must be >= 1")
        if self.block_tokens is not None and self.block_tokens < 1:
            raise WorkloadError("block_tokens must be >= 1")

    @property
    def root(self) -> Path:
        return self.traces_dir if self.traces_dir is not None else default_traces_dir()


def build_workload(spec: WorkloadSpec) -> Workload:
    """The workload ``spec`` describes; the same spec (seed included) gives the same workload."""
    rng = np.random.default_rng(spec.seed)
    kind = spec.source.split(":", 1)[0]
    return SOURCES[kind](spec, rng)


def _with_lengths(spec: WorkloadSpec, rng: np.random.Generator, per_model: list[np.ndarray]) -> Workload:
    """Per-model arrival times as a workload, each request's lengths drawn from ``spec.lengths``."""
    times = np.concatenate(per_model) if per_model else np.empty(0)
    index = np.concatenate([np.full(len(t), i, dtype=np.int32) for i, t in enumerate(per_model)])
    prompt_pool, output_pool = read_lengths(spec.root / LENGTH_FILES[spec.lengths])
    pick = rng.integers(0, len(prompt_pool), len(times))
    prompt, output = prompt_pool[pick], output_pool[pick]
    if spec.max_prompt_tokens is not None:
        prompt = np.minimum(prompt, spec.max_prompt_tokens)
    if spec.max_output_tokens is not None:
        output = np.minimum(output, spec.max_output_tokens)
    return Workload(times, index, prompt, output, spec.models)


# -- sources -------------------------------------------------------------------------------------


def _servegen(spec: WorkloadSpec, rng: np.random.Generator) -> Workload:
    pool = spec.source.split(":", 1)[1] if ":" in spec.source else "m-large"
    clients = [read_servegen_client(p) for p in servegen_clients(spec.root / "servegen" / pool)]
    span = float(clients[0].ts[-1] + SERVEGEN_WINDOW_S) if clients else 0.0
    n = len(spec.models)
    candidates: list[tuple[int, float]] = []  # (client, start of its slice)
    start = spec.start_s
    while len(candidates) < n and start + spec.duration_s <= span:
        candidates.extend(
            (i, start)
            for i, c in enumerate(clients)
            if c.requests_between(start, start + spec.duration_s) > 0
        )
        start += _DAY_S
    if len(candidates) < n:
        raise WorkloadError(
            f"{spec.source}: only {len(candidates)} active client slices from {spec.start_s:.0f} s on, "
            f"{n} models need one each"
        )
    chosen = [candidates[j] for j in rng.choice(len(candidates), n, replace=False)]
    expected = sum(clients[i].requests_between(s, s + spec.duration_s) for i, s in chosen)
    scale = spec.rate_scale
    if spec.total_rate is not None:
        scale *= spec.total_rate * spec.duration_s / expected
    out = []
    for i, s in chosen:
        c = clients[i]
        parts = []
        for w in np.flatnonzero((c.ts + SERVEGEN_WINDOW_S > s) & (c.ts < s + spec.duration_s)):
            if not c.pattern[w] or c.rate[w] <= 0:
                continue
            t = c.ts[w] + sample_window(c.pattern[w], c.rate[w] * scale, c.cv[w], SERVEGEN_WINDOW_S, rng)
            parts.append(t[(t >= s) & (t < s + spec.duration_s)] - s)
        out.append(np.concatenate(parts) if parts else np.empty(0))
    return _with_lengths(spec, rng, out)


def _azure(spec: WorkloadSpec, rng: np.random.Generator) -> Workload:
    name = spec.source.split(":", 1)[1] if ":" in spec.source else "conv"
    key = f"azure:{name}"
    if key not in LENGTH_FILES:
        raise WorkloadError(f"unknown Azure trace {spec.source!r}; choose azure:conv or azure:code")
    trace = read_azure(spec.root / LENGTH_FILES[key])
    period = trace.duration + float(np.median(np.diff(trace.arrivals)))
    n = len(spec.models)
    weights = (rng.permutation(n) + 1.0) ** -spec.zipf
    scale = spec.rate_scale
    if spec.total_rate is not None:
        scale *= spec.total_rate / (len(trace.arrivals) / period * weights.sum())
    copies = math.ceil(spec.duration_s / period) + 1
    tiled = (trace.arrivals[None, :] + period * np.arange(copies)[:, None]).ravel()
    out = []
    for i in range(n):
        offset = rng.uniform(0, period)
        t = tiled[(tiled >= offset) & (tiled < offset + spec.duration_s)] - offset
        keep = weights[i] * scale
        reps = np.floor(keep) + (rng.random(len(t)) < keep - np.floor(keep))
        t = np.repeat(t, reps.astype(np.int64))
        extra = np.concatenate([[False], t[1:] == t[:-1]])  # every copy after the first of an arrival
        t = t + extra * rng.uniform(0, _JITTER_S, len(t))
        out.append(np.sort(t[t < spec.duration_s]))
    return _with_lengths(spec, rng, out)


def _mooncake(spec: WorkloadSpec, rng: np.random.Generator) -> Workload:
    trace = read_mooncake(spec.root / MOONCAKE_FILE)
    scale = spec.rate_scale
    if spec.total_rate is not None:
        scale *= spec.total_rate * max(trace.duration, 1e-9) / len(trace)
    trace = scale_mooncake(
        trace, block_tokens=spec.block_tokens, time_scale=1.0 / scale,
        max_prompt_tokens=spec.max_prompt_tokens, max_output_tokens=spec.max_output_tokens,
    )  # fmt: skip
    n = len(spec.models)
    weights = (rng.permutation(n) + 1.0) ** -spec.zipf
    roots, root_of = np.unique([h[0] for h in trace.hash_ids], return_inverse=True)
    model_of_root = rng.choice(n, size=len(roots), p=weights / weights.sum())
    keep = np.flatnonzero(trace.arrivals < spec.duration_s)
    return Workload(
        trace.arrivals[keep],
        model_of_root[root_of[keep]],
        trace.prompt_tokens[keep],
        trace.output_tokens[keep],
        spec.models,
        [trace.hash_ids[i] for i in keep.tolist()],
        trace.block_tokens,
    )


# a source turns a spec into a workload: servegen and azure draw arrivals per model (lengths from
# spec.lengths); mooncake takes the trace's own requests
SOURCES: Mapping[str, Callable[[WorkloadSpec, np.random.Generator], Workload]] = MappingProxyType(
    {"servegen": _servegen, "azure": _azure, "mooncake": _mooncake}
)
