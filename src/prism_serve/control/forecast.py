"""Request-rate estimation over a sliding window, and the idle-gap statistics eviction is tuned from.

The caller owns one :class:`RateEstimator`, feeds it every arrival and reads ``rate(model, now)`` when
it builds a :class:`~prism_serve.control.types.ModelSnapshot`. Nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import deque

from prism_serve.control.types import InvalidKnobError, InvalidSnapshotError

__all__ = ["RateEstimator", "SeasonalForecaster", "idle_threshold_from_gaps"]


class RateEstimator:
    """Arrivals per second over the last ``window_s`` seconds, per model.

    The rate is the count of arrivals in ``(now - window_s, now]`` divided by the window, except while
    a model's history is shorter than the window: then it is divided by the time since the estimator
    first saw that model (at least ``min_span_s``), so a burst right after start-up is not diluted by a
    window of silence that never happened.

    A model may have a *prior* (``set_prior``: the rate it is expected to get, as ``prism plan``
    writes it into a deployment's models). While its history is shorter than the window, the part
    of the window not yet watched counts at the prior: ``(count + prior * (window_s - watched)) /
    window_s``, the prior alone at start and the arrivals alone after one window. Without a prior, a
    rate right after start-up is a handful of arrivals over a second or two, which says little about
    which models are busy.

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
        self._priors: dict[str, float] = {}
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

    def set_prior(self, model: str, rate: float) -> None:
        """``model`` is expected to get ``rate`` requests/s: its rate counts the part of the window
        not yet watched at this rate (the class docstring)."""
        if not (rate >= 0 and math.isfinite(rate)):
            raise InvalidKnobError(f"{model}: a prior rate must be finite and >= 0, got {rate}")
        self._priors[model] = float(rate)

    def rate(self, model: str, now: float) -> float:
        """Arrivals/s of ``model`` over the window ending at ``now`` (0.0 for a model never seen and
        without a prior)."""
        q = self._arrivals.get(model)
        first = self._first_seen.get(model)
        prior = self._priors.get(model)
        if first is None:
            return 0.0 if prior is None else prior
        count = 0
        if q is not None:
            horizon = now - self.window_s  # _trim, inline: this runs for every model at every tick
            while q and q[0] <= horizon:
                q.popleft()
            count = len(q)
        if prior is not None:
            unseen = max(0.0, self.window_s - max(0.0, now - first))
            return (count + prior * unseen) / self.window_s
        span = min(self.window_s, max(self.min_span_s, now - first))
        return count / span

    def last_arrival(self, model: str) -> float | None:
        return self._last.get(model)

    def history_at(self, model: str, t: float | None) -> float | None:
        """Seconds the estimator had been watching ``model`` at ``t`` (since ``start`` or its first
        arrival, whichever came first; 0 before that or for a model never seen); None where ``t``
        is None."""
        if t is None:
            return None
        first = self._first_seen.get(model)
        return 0.0 if first is None else max(0.0, t - first)

    def moving(self, now: float | None = None) -> list[str]:
        """The models whose rate may read differently at a later ``now`` without a new arrival: those
        with arrivals not yet known to have left the window (a model with none reads 0.0 whenever),
        and (given ``now``) those whose prior still covers part of the window."""
        out = [model for model, q in self._arrivals.items() if q]
        if now is not None and self._priors:
            seen = set(out)
            horizon = now - self.window_s
            for m in [m for m in self._priors if m in self._first_seen]:
                if self._first_seen[m] <= horizon:  # watched a whole window: its last move
                    del self._priors[m]
                if m not in seen:
                    out.append(m)
        return out

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


class SeasonalForecaster:
    """Per-model arrival-rate forecasts for the next window: WarmServe's corrective seasonal
    predictor (seed 004, section 5.1), fed with the same arrivals as :class:`RateEstimator`.

    Time is cut into windows of ``window_s``; ``L[i]`` is a model's arrival count in window ``i``.
    The forecast of window ``i`` is a seasonal part plus a correction:

    - seasonal ``P[i]``: the mean of ``L`` in the same window of the last ``num_periods`` periods
      (``period_s``, a day by default). Without a past period (a server up for less than a day, a
      short simulation) it falls back to ``L[i-1]``, the last complete window, which makes the
      predictor a persistence forecast with a trend correction;
    - correction: the weighted mean of the last ``lookback`` errors ``L[j] - P[j]`` with weights
      halving into the past. (The paper writes the weights as ``2^(j-1)`` for the ``j``-th window back
      but says the recent errors count most; we follow the text: the latest error has the largest.)

    ``rate(model, now)`` is the forecast of the window that contains ``now``, from complete windows
    only, in arrivals per second and never negative. Before a model's first complete window it is
    None: the caller falls back to its sliding-window rate.
    """

    def __init__(
        self,
        window_s: float = 300.0,
        *,
        period_s: float = 86400.0,
        num_periods: int = 7,
        lookback: int = 10,
    ) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise InvalidKnobError(f"window_s must be a positive number of seconds, got {window_s}")
        if not (period_s >= window_s and math.isfinite(period_s)):
            raise InvalidKnobError("period_s must be finite and at least one window")
        if num_periods < 1 or lookback < 1:
            raise InvalidKnobError("num_periods and lookback must be >= 1")
        self.window_s = window_s
        self.num_periods = num_periods
        self.lookback = lookback
        self._per_period = max(1, round(period_s / window_s))
        self._keep = self._per_period * num_periods + lookback + 2
        self._counts: dict[str, dict[int, int]] = {}
        self._first: dict[str, int] = {}
        self._cache: dict[tuple[str, int], float | None] = {}

    def start(self, model: str, t: float) -> None:
        """Count ``model`` from ``t`` on (windows before it are unknown, not zero)."""
        self._first.setdefault(model, self._index(t))
        self._counts.setdefault(model, {})

    def observe(self, model: str, t: float) -> None:
        self.start(model, t)
        i = self._index(t)
        counts = self._counts[model]
        counts[i] = counts.get(i, 0) + 1
        if len(counts) > self._keep:
            for old in sorted(counts)[: len(counts) - self._keep]:
                del counts[old]

    def rate(self, model: str, now: float) -> float | None:
        i = self._index(now)
        first = self._first.get(model)
        if first is None or i - 1 < first:
            return None  # no complete window yet
        key = (model, i)
        if key not in self._cache:
            if len(self._cache) > 4 * len(self._first) + 64:
                self._cache.clear()
            self._cache[key] = max(0.0, self._predict(model, i)) / self.window_s
        return self._cache[key]

    def window(self, t: float) -> int:
        """The index of the window holding ``t``: ``rate`` reads the same for every ``now`` in one
        window (it counts complete windows only)."""
        return self._index(t)

    def _index(self, t: float) -> int:
        return math.floor(t / self.window_s)

    def _count(self, model: str, i: int) -> int:
        return self._counts[model].get(i, 0)

    def _seasonal(self, model: str, i: int) -> float:
        first = self._first[model]
        past = [i - k * self._per_period for k in range(1, self.num_periods + 1)]
        past = [j for j in past if j >= first]
        if past:
            return sum(self._count(model, j) for j in past) / len(past)
        return float(self._count(model, i - 1)) if i - 1 >= first else 0.0

    def _predict(self, model: str, i: int) -> float:
        first = self._first[model]
        errors = []
        for j in range(1, self.lookback + 1):
            w = i - j
            if w - 1 < first:  # that window had no complete window before it to predict from
                break
            errors.append(self._count(model, w) - self._seasonal(model, w))
        correction = 0.0
        if errors:
            weights = [2.0 ** (len(errors) - 1 - k) for k in range(len(errors))]  # latest first, largest
            correction = sum(e * wt for e, wt in zip(errors, weights, strict=True)) / sum(weights)
        return self._seasonal(model, i) + correction
