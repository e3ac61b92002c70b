"""Per-model workload statistics, the quantities of the Prism paper's Figure 2:

- share of all requests (long-tail popularity, 2a);
- median gap between consecutive requests (2b);
- idle intervals longer than ``idle_gap_s`` per hour (2c; the run's start and end count as edges);
- coefficient of variation of the per-minute request count (2d).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from prism_serve.workload.format import Workload

__all__ = ["ModelStats", "format_stats", "model_stats"]


@dataclass(slots=True, frozen=True)
class ModelStats:
    model: str
    num_requests: int
    share: float  # of all requests
    rate: float  # req/s over the workload's span
    median_gap_s: float  # nan with fewer than two requests
    idle_per_hour: float  # gaps longer than idle_gap_s, per hour of workload
    cv_per_minute: float  # std/mean of requests per minute; nan without requests
    mean_prompt_tokens: float
    mean_output_tokens: float

    def as_dict(self) -> dict:
        return asdict(self)


def model_stats(
    workload: Workload, *, span_s: float | None = None, idle_gap_s: float = 10.0
) -> list[ModelStats]:
    """Statistics of every model in ``workload`` (span: ``span_s`` or the last arrival time)."""
    span = span_s if span_s is not None else max(workload.duration, 1e-9)
    minutes = max(1, int(np.ceil(span / 60.0)))
    total = max(1, len(workload))
    out = []
    for i, name in enumerate(workload.models):
        mask = workload.model_index == i
        t = workload.timestamps[mask]
        n = len(t)
        gaps = np.diff(np.concatenate([[0.0], t, [span]]))
        inner = np.diff(t)
        counts = np.bincount(np.minimum((t // 60).astype(np.int64), minutes - 1), minlength=minutes)
        mean = counts.mean()
        out.append(
            ModelStats(
                model=name,
                num_requests=n,
                share=n / total,
                rate=n / span,
                median_gap_s=float(np.median(inner)) if n >= 2 else float("nan"),
                idle_per_hour=float((gaps > idle_gap_s).sum()) * 3600.0 / span,
                cv_per_minute=float(counts.std() / mean) if mean > 0 else float("nan"),
                mean_prompt_tokens=float(workload.prompt_tokens[mask].mean()) if n else float("nan"),
                mean_output_tokens=float(workload.output_tokens[mask].mean()) if n else float("nan"),
            )
        )
    return out


def format_stats(stats: list[ModelStats]) -> str:
    """A table, most popular model first, with the cumulative share (the Figure 2a curve)."""
    rows = sorted(stats, key=lambda s: (-s.num_requests, s.model))
    width = max([len("model"), *(len(s.model) for s in rows)])
    lines = [
        f"{'model':<{width}}  {'reqs':>7} {'share':>6} {'cum':>6} {'req/s':>7} "
        f"{'med gap s':>9} {'idle/h':>7} {'CV/min':>6} {'prompt':>7} {'output':>6}"
    ]
    cum = 0.0
    for s in rows:
        cum += s.share
        lines.append(
            f"{s.model:<{width}}  {s.num_requests:>7} {s.share:>6.1%} {cum:>6.1%} {s.rate:>7.3f} "
            f"{s.median_gap_s:>9.2f} {s.idle_per_hour:>7.1f} {s.cv_per_minute:>6.2f} "
            f"{s.mean_prompt_tokens:>7.0f} {s.mean_output_tokens:>6.0f}"
        )
    n = len(rows)
    if n:
        tail = rows[int(np.ceil(0.4 * n)) :]  # the 60% least popular models
        lines.append(
            f"{n} models; the least popular 60% ({len(tail)}) send "
            f"{sum(s.share for s in tail):.1%} of requests; "
            f"median of median gaps {np.nanmedian([s.median_gap_s for s in rows]):.1f} s"
        )
    return "\n".join(lines)
