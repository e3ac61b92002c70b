"""``PrismKnobs``: the settings of the ``prism`` policy (policies/prism.py), with their checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prism_serve.control.policies.base import Knobs, fraction, require

__all__ = ["PrismKnobs"]


@dataclass(slots=True, frozen=True)
class PrismKnobs(Knobs):
    migration_threshold: float = 0.05  # tau: KVPR gain (per GiB, see placement.py) a migration must beat
    idle_threshold_s: float = 30.0  # a model idle this long may be evicted (paper: from idle-gap data)
    memory_watermark: float = 0.9  # a device is constrained at mapped >= this fraction of capacity
    min_kv_fraction: float = 0.05  # never place a model where less than this fraction is left for KV
    reserve_tokens: int = 256  # per-engine KV reserve admission keeps free (tokens of that model)
    abort_on_miss: bool = False  # reject requests the deadline schedule drops instead of deferring
    default_prefill_tokens_per_s: float = 8000.0  # until the engine reports its measured speed
    # a model placed (activated or migrated) less than this long ago does not migrate: one rate window,
    # so a move acts on an estimate renewed since the last one rather than on its noise
    migration_cooldown_s: float = 60.0
    rebalance: bool = True  # False: resident models never migrate (global scheduler off)
    deadline_admission: bool = True  # False: per-engine FIFO admission (local scheduler off)
    # the deadline schedule checks each model's deadlines less how late its first tokens have come
    # after the schedule's prediction (control/admission.py, DeadlineQueue.first_token); False: the
    # prediction alone (the paper's Algorithm 2), the ablation
    lateness_margin: bool = True
    # False: placement weighs KV pressure only (the paper's KVPR), not the compute colocated engines
    # share (placement.pressure); the ablation of compute-aware placement
    compute_aware: bool = True
    # activate evicted models the seasonal forecast expects a request for within prewarm_horizon_s,
    # into memory below the watermark (WarmServe's prewarming, seed 004); False: activate on demand only
    prewarm: bool = True
    prewarm_horizon_s: float = 60.0
    # the models prewarmed with no forecast yet (the startup fill) are chosen smallest first (as many
    # as memory holds) and then placed largest first, each where most memory is free (worst-fit
    # decreasing: weights spread evenly, as a compute prior while no rate is known); False: placed in
    # the order they are chosen (smallest first)
    fill_largest_first: bool = True
    # replicas of hot models (control/replicas.py): at most this many per served model (1: off, the
    # ablation); a model wants ceil(rate / (replica_high * max_rate)) of them and gives one up when
    # the others would stay below replica_low utilization without it
    max_replicas: int = 4
    # an evicted model with requests waiting that no device can take even after its idle models go
    # may evict models with nothing queued or running that are not idle yet, asked for less often than
    # it (lowest rate first); False: it waits until enough models turn idle (the paper's rule)
    evict_quiet: bool = True
    # a busy model (never idle, so Algorithm 1 cannot move it) whose neighbours slow it is moved
    # make-before-break: a replica on devices whose neighbours slow it at most half as much, then the
    # old replica drains (replicas.misplaced); needs max_replicas >= 2
    relocate_busy: bool = True
    replica_high: float = 0.8
    replica_low: float = 0.5
    # route a request to the replica that probably holds the longest cached prefix of its prompt
    # (unless it would miss the TTFT SLO there and not elsewhere), and count only the uncached
    # prompt tokens in admission's prefill estimate (control/prefix_index.py); False: the ablation
    prefix_aware: bool = True
    # a best-effort request (the batch class, or a tenant over its fair share) starts only while its
    # device runs fewer requests (of every class) than this fraction of its engines' sequence slots,
    # and no prefill is pending: it fills idle capacity without crowding the steps every running
    # request shares (control/admission.py)
    best_effort_share: float = 0.125

    def __post_init__(self) -> None:
        require(
            self.migration_threshold >= 0 and math.isfinite(self.migration_threshold),
            "migration_threshold must be finite and >= 0",
        )
        require(self.idle_threshold_s >= 0, "idle_threshold_s must be >= 0")
        require(
            self.prewarm_horizon_s > 0 and math.isfinite(self.prewarm_horizon_s),
            "prewarm_horizon_s must be finite and > 0",
        )
        require(
            self.migration_cooldown_s >= 0 and math.isfinite(self.migration_cooldown_s),
            "migration_cooldown_s must be finite and >= 0",
        )
        fraction("memory_watermark", self.memory_watermark, open_low=True)
        require(self.max_replicas >= 1, "max_replicas must be >= 1")
        fraction("best_effort_share", self.best_effort_share, open_low=True)
        fraction("replica_high", self.replica_high, open_low=True)
        fraction("replica_low", self.replica_low)
        require(self.replica_low < self.replica_high, "replica_low must be below replica_high")
        self._check_shared()
        require(self.default_prefill_tokens_per_s > 0, "default_prefill_tokens_per_s must be > 0")
