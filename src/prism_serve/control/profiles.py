"""What the control plane measures of a model's demand: the profile both bodies build from an
engine's step seconds and requests served (:func:`measured_profile`), and the fit of its decode step
time against the batch (:class:`StepSums`) that credits the batching its TPOT SLO leaves room for
(:func:`batching_gain`). Live, the controller feeds it from the workers' stats; the simulator with
``SimConfig.profiles == "live"`` from its simulated engines."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from prism_serve.control.types import ModelProfile

__all__ = ["MIN_SERVED_FOR_PROFILE", "StepSums", "batching_gain", "measured_profile"]

# requests a model's engine serves before its measured busy seconds per request replace the prior
MIN_SERVED_FOR_PROFILE = 4
# decode steps, and spread of ln(batch), before a step-time fit counts (1s and 2s at 4:1 spread 0.077)
_MIN_FIT_STEPS = 16
_MIN_FIT_LOG_BATCH_VARIANCE = 0.05


@dataclass(slots=True, frozen=True)
class StepSums:
    """Running sums over an engine's decode steps, for ``fit``: the count; the batch (sequences in the
    step) and the seconds; and of x = ln(batch), y = ln(seconds), x * x and x * y. Both bodies add
    every decode step, timed by the engine's own compute (the simulator: its time alone on the
    device; the live worker: its process CPU time, at most the wall time) so that a busy neighbour does
    not read as a cost of batching. The simulator adds a decode run as that many steps of its mean
    time; a live worker sends its sums since the activation and the controller adds the deltas."""

    steps: int = 0
    batch: float = 0.0
    seconds: float = 0.0
    x: float = 0.0
    xx: float = 0.0
    y: float = 0.0
    xy: float = 0.0

    def plus(self, batch: int, seconds: float, steps: int = 1) -> StepSums:
        """With ``steps`` more decode steps of ``batch`` sequences taking ``seconds`` together."""
        if steps <= 0 or batch <= 0 or seconds <= 0:
            return self
        x, y = math.log(batch), math.log(seconds / steps)
        return StepSums(
            self.steps + steps,
            self.batch + steps * batch,
            self.seconds + seconds,
            self.x + steps * x,
            self.xx + steps * x * x,
            self.y + steps * y,
            self.xy + steps * x * y,
        )

    def __add__(self, other: StepSums) -> StepSums:
        return StepSums(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def __sub__(self, other: StepSums) -> StepSums:
        return StepSums(*(a - b for a, b in zip(self.values(), other.values(), strict=True)))

    def values(self) -> tuple:
        """The sums in field order (what a worker sends: ``StepSums(*values)`` rebuilds them)."""
        return (self.steps, self.batch, self.seconds, self.x, self.xx, self.y, self.xy)

    def fit(self) -> tuple[float, float] | None:
        """(t1, p) of step time = t1 * batch ** p, by least squares on the logs, p clipped to [0, 1]
        (a step never gets faster with more sequences, nor slower than running them one by one);
        None with fewer than 16 steps or batches too alike to tell p (variance of ln(batch) below
        0.05). A power law because a decode step's time grows sub-linearly with the batch where the
        weights' pass dominates (on a GPU it is nearly flat; measured on one CPU core p is about
        0.5): a line fitted to batches 1-3 would double the time a batch of 16 takes."""
        n = self.steps
        if n < _MIN_FIT_STEPS:
            return None
        mx, my = self.x / n, self.y / n
        var = self.xx / n - mx * mx
        if var < _MIN_FIT_LOG_BATCH_VARIANCE:
            return None
        p = min(1.0, max(0.0, (self.xy / n - mx * my) / var))
        return math.exp(my - p * mx), p


def batching_gain(steps: StepSums, tpot_s: float, max_num_seqs: int) -> float | None:
    """How many times the sequences an engine advances per second of stepping grow when its batch
    grows from the mean it ran at to the largest one whose step (by ``steps.fit``) stays within
    ``tpot_s`` (at most ``max_num_seqs``): (B / t(B)) / (mean batch / mean step), at least 1.
    None when the fit is unknown, unless the engine already ran at half its batch limit or more
    (then 1: the measured rate is close to its limit)."""
    if steps.steps <= 0 or steps.batch <= 0 or steps.seconds <= 0:
        return None
    fit = steps.fit()
    if fit is None:
        return 1.0 if steps.batch / steps.steps >= max_num_seqs / 2 else None
    t1, p = fit
    if t1 >= tpot_s:
        return 1.0
    # the largest B with t1 * B**p <= tpot_s, in logs: with p near 0 (a step that hardly grows with
    # the batch) (tpot_s / t1) ** (1 / p) overflows a float, and a tick that raised here stopped
    # the control loop and /metrics with it
    limit = math.log(max_num_seqs)
    top = (
        float(max_num_seqs)
        if p <= 0 or math.log(tpot_s / t1) / p >= limit
        else math.exp(math.log(tpot_s / t1) / p)
    )
    top = max(1.0, math.floor(top))
    now = steps.batch / steps.seconds  # sequences per second of stepping at the mean batch
    return max(1.0, (top / (t1 * top**p)) / now)


def measured_profile(
    prior: ModelProfile,
    step_seconds: float,
    num_served: int,
    steps: StepSums | None = None,
    tpot_s: float = math.inf,
    max_num_seqs: int = 1,
) -> ModelProfile:
    """The profile the control plane predicts a model's compute demand from, as both bodies build it:
    ``prior`` until its engine has served ``MIN_SERVED_FOR_PROFILE`` requests, then the measured
    engine step seconds per request served (batching included) and ``max_rate``, the requests one
    replica serves per second of stepping within its SLO. Without ``steps`` that is the measured
    rate (the inverse), a floor; with them, the measured rate times the batching gain the fitted
    step time leaves within ``tpot_s`` (:func:`batching_gain`), or None (unknown: no replica) while
    the engine has neither batched enough to fit nor run near its batch limit. The floor alone
    underrates an engine that ran mostly at batch 1 and asks a replica for a model that one engine
    serves by batching."""
    if num_served < MIN_SERVED_FOR_PROFILE or step_seconds <= 0:
        return prior
    per_request = step_seconds / num_served
    gain = 1.0 if steps is None else batching_gain(steps, tpot_s, max_num_seqs)
    return replace(
        prior, busy_s_per_request=per_request, max_rate=None if gain is None else gain / per_request
    )
