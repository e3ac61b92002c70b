"""Request-rate estimation over a sliding window, and the idle-gap statistics eviction is tuned from.

The caller owns one :class:`RateEstimator`, feeds it every arrival and reads ``rate(model, now)`` when
it builds a :class:`~prism_serve.control.types.ModelSnapshot`. Nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import deque

from prism_serve.control.types import InvalidKnobError, InvalidSnapshotError

__all__ = ["RateEstimator", "idle_threshold_from_gaps"]


class RateEstimator:
    """Arrivals per second over the last ``window_s`` seconds, per model.

    The rate is the count of arrivals in ``(now - window_s, now]`` divided by the window, except while
    a model's history is shorter than the window: then it is divided by the time since the estimator
    first saw that model (at least ``min_span_s``), so a burst right after start-up is not diluted by a
    window of silence that never happened.

    It also keeps the gaps between consecutive arrivals longer than ``min_gap_s`` (the idle periods of
    the paper's section 3.1), up to ``max_gaps`` per model, for :func:`idle_threshold_from_gaps`.
    """

    def __init__(
        self,
        window_s: float = 60.0,
        *,
        min_span_s: float = 1.0,
        min_gap_s: float = 10.0,
        max_gaps: int = 4096,
    ) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise InvalidKnobError(f"window_s must be a positive number of seconds, got {window_s}")
        if not 0 < min_span_s <= window_s:
            raise InvalidKnobError(f"min_span_s must be in (0, window_s], got {min_span_s}")
        if min_gap_s < 0 or max_gaps < 1:
            raise InvalidKnobError("min_gap_s must be >= 0 and max_gaps >= 1")
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.min_gap_s = min_gap_s
        self._arrivals: dict[str, deque[float]] = {}
        self._first_seen: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._gaps: dict[str, deque[float]] = {}
        self._max_gaps = max_gaps

    def observe(self, model: str, t: float) -> None:
        """Record one arrival of ``model`` at time ``t`` (non-decreasing per model)."""
        last = self._last.get(model)
        if last is not None and t < last:
            raise InvalidSnapshotError(f"{model}: arrival {t} is earlier than the previous one {last}")
        if model not in self._arrivals:
            self._arrivals[model] = deque()
            self._gaps[model] = deque(maxlen=self._max_gaps)
            self._first_seen.setdefault(model, t)
        elif t - last > self.min_gap_s:
            self._gaps[model].append(t - last)
        self._arrivals[model].append(t)
        self._last[model] = t
        self._trim(model, t)

    def start(self, model: str, t: float) -> None:
        """Start counting ``model`` at ``t`` with no arrivals (so its rate decays from a known origin)."""
        self._first_seen.setdefault(model, t)

    def rate(self, model: str, now: float) -> float:
        """Arrivals/s of ``model`` over the window ending at ``now`` (0.0 for a model never seen)."""
        q = self._arrivals.get(model)
        first = self._first_seen.get(model)
        if first is None:
            return 0.0
        if q is not None:
            self._trim(model, now)
        count = len(q) if q is not None else 0
        span = min(self.window_s, max(self.min_span_s, now - first))
        return count / span

    def last_arrival(self, model: str) -> float | None:
        return self._last.get(model)

    def idle_gaps(self, model: str) -> list[float]:
        """Gaps longer than ``min_gap_s`` between consecutive arrivals of ``model``, oldest first."""
        return list(self._gaps.get(model, ()))

    def _trim(self, model: str, now: float) -> None:
        q = self._arrivals[model]
        horizon = now - self.window_s
        while q and q[0] <= horizon:
            q.popleft()


def idle_threshold_from_gaps(gaps: list[float], quantile: float = 0.5, floor_s: float = 10.0) -> float:
    """An eviction idle threshold read off the idle-gap distribution (paper section 6.2).

    A model idle for longer than the ``quantile`` of its past idle gaps has, by that history, at
    least a ``1 - quantile`` chance of staying idle longer still, so its memory is better spent on
    others. Falls back to ``floor_s`` without history and never returns less than it.
    """
    if not 0.0 <= quantile <= 1.0:
        raise InvalidKnobError(f"quantile must be in [0, 1], got {quantile}")
    if not gaps:
        return floor_s
    ordered = sorted(gaps)
    pos = quantile * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    value = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return max(floor_s, value)
