"""The policy interface every placement/admission policy implements, and helpers they share.

A policy object holds only its knobs; everything that changes over time comes in through the
snapshot, the ``now`` argument and the caller-owned queue. Calling a policy twice with equal inputs
gives equal actions, which is what lets the simulator predict the live runtime.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar

from prism_serve.control.queues import RequestQueue
from prism_serve.control.replicas import pick_replica
from prism_serve.control.types import (
    Action,
    Activate,
    ClusterSnapshot,
    Defer,
    DeviceSnapshot,
    EngineSnapshot,
    Enqueue,
    InvalidKnobError,
    ModelSnapshot,
    Reject,
    RejectReason,
    Request,
)

__all__ = ["Knobs", "Policy", "route_resident", "unknown_model"]


@dataclass(slots=True, frozen=True)
class Knobs:
    """Base of every policy's knobs. Subclasses check ranges in ``__post_init__``."""

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _check_shared(self) -> None:
        """Range checks of the knobs every policy has (``reserve_tokens``, ``min_kv_fraction``)."""
        require(getattr(self, "reserve_tokens", 0) >= 0, "reserve_tokens must be >= 0")
        require(0 <= getattr(self, "min_kv_fraction", 0.0) < 1, "min_kv_fraction must be in [0, 1)")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidKnobError(message)


def fraction(name: str, value: float, *, open_low: bool = False) -> None:
    low_ok = value > 0 if open_low else value >= 0
    require(
        low_ok and value <= 1 and math.isfinite(value), f"{name} must be in {'(' if open_low else '['}0, 1]"
    )


class PolicyMemo:
    """What a policy carries from one ``place`` call to the next. The control loop owns it (one per
    loop, from ``Policy.new_memo``) and hands it to every ``place``; a policy keeps nothing of its
    own between calls but its knobs, so ``place`` is a function of the snapshot, this memo and the
    knobs. A memo may only hold what saves work: ``place`` with a fresh memo decides the same as
    with one carried over (tests/sim/test_snapshots.py checks it for prism). Empty here;
    a policy that carries something subclasses it with typed fields."""

    __slots__ = ()


class Policy:
    """Base class. Subclasses set ``name`` and ``knobs_type`` and override what they need.

    - ``place(cluster, now, memo)``: the global tick. Call it periodically and whenever a model
      finishes activating; apply the returned Evict/Migrate/Activate/SetKVQuota actions in order.
      ``memo``: the caller's ``new_memo()``, the same one on every call (None: a fresh one).
    - ``on_request(request, cluster, now)``: where a new request goes: ``Enqueue`` (possibly after
      Evict/Activate), ``Defer`` (hold it and resubmit after the next tick) or ``Reject``.
    - ``pick_replica(request, cluster, now, cached)``: which replica of its model a request goes to
      (before ``on_request``; ``cached``: the prompt tokens each replica probably holds cached, when
      the policy is ``prefix_aware`` and the request carries prefix keys); ``replica_slots``: how
      many replica slots per model the body creates.
    - ``new_queue(device)``: the per-device queue object the caller owns.
    - ``admit(queue, device, engines, now)``: which queued requests start now on ``device``
      (``Dispatch``), which are refused (``Reject``), and for time-sharing policies the swap to do.
      ``engines`` may be the whole cluster's engine map; capacity only counts the device's own.
    """

    name: ClassVar[str] = ""
    knobs_type: ClassVar[type[Knobs]] = Knobs
    # True: every model the policy serves holds ``tp_size`` devices of its own from its activation
    # on, shared with no other model and never given up, and a model it cannot give devices to is
    # refused; so N devices serve at most models whose tp sizes sum to N (the planner uses it:
    # sim/plan.py ``exclusive_floor``)
    exclusive_devices: ClassVar[bool] = False
    # True: a baseline whose deployment on more devices may keep its assignment for fewer and leave
    # the rest idle, so whatever it attains on N devices it attains on any count above; the planner
    # answers its first passing count without confirming the counts above (sim/plan.py), so that a
    # saving against it is never a saving against its unlucky packing at one count. False for a
    # policy that must itself do no worse with more devices (prism).
    keeps_fewer_devices: ClassVar[bool] = False

    def __init__(self, knobs: Knobs | None = None) -> None:
        if knobs is None:
            knobs = self.knobs_type()
        if not isinstance(knobs, self.knobs_type):
            raise InvalidKnobError(
                f"{self.name} takes {self.knobs_type.__name__}, got {type(knobs).__name__}"
            )
        self.knobs = knobs

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.knobs!r})"

    @classmethod
    def plan_variants(cls) -> tuple[dict, ...]:
        """The policy's own ways of placing that an operator sizing it would try: ``prism plan``
        searches each (knobs over the run's) and answers with the one that needs fewest devices.
        One, the knobs as given, by default."""
        return ({},)

    @classmethod
    def provisioned_knobs(cls, rates: Mapping[str, float], longest: Mapping[str, int] | None = None) -> dict:
        """The knobs an operator provisioning this policy by hand would set from the expected
        traffic (``rates``: requests/s per model; ``longest``: each model's longest request, prompt
        plus output tokens); the simulator (and so ``prism plan``) gives them to a run whose own
        knobs leave them unset. None by default: the policy adapts by itself."""
        return {}

    @property
    def replica_slots(self) -> int:
        """Replica slots the body creates per served model (control/replicas.py); 1: no replicas."""
        return 1

    @property
    def prefix_aware(self) -> bool:
        """Whether the control loop keeps a prefix index for this policy: ``pick_replica`` is then
        told what each replica probably holds cached, and requests reach ``on_request`` and the
        queues with ``cached_tokens`` for their replica (control/prefix_index.py)."""
        return False

    def pick_replica(
        self,
        request: Request,
        cluster: ClusterSnapshot,
        now: float,
        cached: Mapping[str, int] | None = None,
    ) -> Request:
        """``request`` addressed to the replica of its model it should go to (the loop calls this
        before ``on_request``, and again whenever the request is routed anew)."""
        return pick_replica(request, cluster, cached=cached, now=now)

    def new_memo(self) -> PolicyMemo:
        """A memo for a caller that calls ``place`` again and again (``PolicyMemo``)."""
        return PolicyMemo()

    def place(self, cluster: ClusterSnapshot, now: float, memo: PolicyMemo | None = None) -> list[Action]:
        return []

    def on_request(self, request: Request, cluster: ClusterSnapshot, now: float) -> list[Action]:
        raise NotImplementedError

    def new_queue(self, device: str) -> RequestQueue:
        raise NotImplementedError

    def admit(
        self, queue: RequestQueue, device: DeviceSnapshot, engines: Mapping[str, EngineSnapshot], now: float
    ) -> list[Action]:
        return queue.admit(now, device, engines)

    def _route_or_wait_for_tick(
        self, request: Request, cluster: ClusterSnapshot, now: float, *, defer: str, refuse: str
    ) -> list[Action]:
        """``on_request`` of the policies that place models only on their tick: enqueue for a resident
        model, defer when the next ``place()`` would activate the model, refuse otherwise. ``defer`` and
        ``refuse`` are format strings over the model's snapshot ``m``."""
        m = cluster.models.get(request.model)
        if m is None:
            return [unknown_model(request)]
        routed = route_resident(request, m)
        if routed is not None:
            return routed
        if any(isinstance(a, Activate) and a.model == m.model for a in self.place(cluster, now)):
            return [Defer(request, defer.format(m=m))]
        return [no_capacity(request, refuse.format(m=m))]


def unknown_model(request: Request) -> Reject:
    return Reject(request, RejectReason.UNKNOWN_MODEL, f"model {request.model!r} is not served here")


def route_resident(request: Request, m: ModelSnapshot) -> list[Action] | None:
    """Enqueue on the model's rank-0 device if it is resident, else None."""
    if m.resident:
        return [Enqueue(request, m.placement[0])]
    return None


def no_capacity(request: Request, why: str) -> Reject:
    return Reject(request, RejectReason.NO_CAPACITY, why)


def min_kv_bytes(device: DeviceSnapshot, min_kv_fraction: float) -> int:
    return math.ceil(min_kv_fraction * device.capacity_bytes)
