"""The control loop: the one place that turns events into policy calls and policy actions into effects.

The live runtime (runtime/controller.py) and the simulator (sim/simulator.py) both run this loop;
they differ only in their *body*, the object that carries effects out (worker processes and IPC, or
simulated engines) and reports the state the policies read (ClusterSnapshot). So a simulated run
makes the same decisions, in the same order, as a live run that sees the same events.

Events in (each a method; ``now`` on the caller's clock):

- ``arrival``: a new request; the rate estimate moves, ``policy.on_request`` routes it.
- ``tick``: ``policy.place``; deferred requests are routed again; every device with a queue admits.
- ``activation_done`` / ``activation_failed``: a model's engine is ready (``place`` runs, as the
  policy contract says, and its device admits), or its activation failed (its waiting requests are
  handed back to the body to fail).
- ``first_token``: a request on an engine sampled its first token; the queue that dispatched it
  compares that with the first token it predicted (control/admission.py).
- ``request_left``: a request that was on an engine finished, failed or was aborted.
- ``capacity_freed``: memory or a sequence slot came free on a device (a step finished requests,
  an eviction completed); the device admits.
- ``abort``: a request not yet on an engine goes away.
- ``worker_died``: the model's engine is gone; its queued requests are routed again.

A tick's placement comes apart for a body that decides it off its event loop (the live runtime,
where a tick over thousands of models would hold up every token stream): ``begin_tick`` takes the
snapshot on the loop, ``decide`` runs ``policy.place`` on it (it reads nothing of the loop, so any
thread may run it), and ``end_tick`` applies the actions back on the loop, unless what they act on
moved meanwhile (``PlacementRun``): then it applies nothing and the body decides again. ``tick``
does all three at once (the simulator, where no time passes while a policy decides). A body given
``place_later`` gets the placement that follows an activation handed to it, to run later (``place``,
or a whole tick) so that several finishing activations share one, instead of the loop placing
there and then: both bodies do, after ``placement_coalesce_s`` (the live runtime's placement thread
waits that long before its tick; the simulator places that much later, unless a tick came between).

The loop owns the per-device queues, the backlog of deferred requests, where every request is, the
per-model count of waiting requests, the rate estimator and the seasonal forecaster. Everything else
(residency, engines, memory) is the body's, and the body builds the snapshots from it and from the
loop's public state.

Effects out: the body methods below, called in the order the policy returned its actions. Each
takes effect before the next policy call, as far as the next snapshot shows (an activation in
progress shows ``ACTIVATING`` with its placement), which is the caller contract of README.md.
Rules decided here once for both bodies:

- A request displaced by an action (its model was evicted under it, or activated on another device
  while it waited in some queue) is routed again through ``on_request`` after the whole action list
  is applied, keeping its arrival time.
- ``Migrate`` moves only an active model with nothing running: its queued requests move to the new
  rank-0 queue, the body evicts and activates it; otherwise it is skipped (counted) and the next
  tick decides again.
- ``prewarmed`` (``ModelSnapshot.prewarmed``, whose memory yields first): a model is prewarmed when
  an ``Activate`` for it is applied while none of its requests waits (queued or deferred) or is
  being routed, until its next arrival or eviction; a model activated for a request is not, even
  after that request finishes, and neither is a replica added to a served model that has one
  resident (it serves that model's demand; replica 0 re-added that way once counted as prewarmed,
  was evicted first at the next tick and asked for again, every tick). (Before, each body derived
  it from "no arrival since the placement time"; the runtime stamped that time a moment after the
  triggering arrival, so every model it activated on demand counted as prewarmed and was the first
  evicted, and the simulator did not.)
- Admission runs, after every event, on the devices whose queue or capacity may have changed, in
  device-name order, until no device has anything new to admit.
- Prefixes (a policy with ``prefix_aware``, requests with ``prefix_keys``): before a request is
  routed, the loop's prefix index (prefix_index.py) gives the prompt tokens each replica of its
  model probably holds cached, which ``pick_replica`` weighs; the request is then addressed with
  ``cached_tokens`` for the replica it went to (admission prices only the rest of its prefill) and
  its keys are recorded on that replica. A replica's keys are forgotten when an ``Evict`` or a
  ``Migrate`` is applied to it, when its worker dies or its activation fails, and when a snapshot
  shows it placed anew.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from prism_serve.control.eviction import keep_alive_expired
from prism_serve.control.fairness import FairShare
from prism_serve.control.forecast import RateEstimator, SeasonalForecaster
from prism_serve.control.policies import Policy
from prism_serve.control.prefix_index import PrefixIndex, capacity_blocks
from prism_serve.control.queues import RequestQueue
from prism_serve.control.types import (
    REPLICA_SEPARATOR,
    Activate,
    ClusterSnapshot,
    ControlError,
    Defer,
    DeviceSnapshot,
    Dispatch,
    EngineSnapshot,
    Enqueue,
    Evict,
    Migrate,
    ModelState,
    Priority,
    Reject,
    RejectReason,
    Request,
    SetKVQuota,
)

logger = logging.getLogger(__name__)

__all__ = ["ENGINE", "RATE_WINDOW_S", "Body", "ControlLoop", "LoopStateError", "PlacementRun"]

ENGINE = "\0engine"  # where a dispatched request is (no device can have this name)
_NEW = "\0new"
_DEFERRED = "\0deferred"
_MAX_ADMISSION_ROUNDS = 100_000


class LoopStateError(ControlError):
    """The policy returned an action the loop cannot apply (a policy or body bug)."""


class Body(Protocol):
    """What the loop needs from the live runtime or the simulator."""

    def cluster(self, now: float) -> ClusterSnapshot:
        """Every model, device and engine now (queued counts from ``ControlLoop.num_queued``)."""

    def admission_view(self, device: str, now: float) -> tuple[DeviceSnapshot, Mapping[str, EngineSnapshot]]:
        """The device and the engines ``policy.admit`` reads for ``device``."""

    def model_state(self, model: str) -> tuple[ModelState, int]:
        """``model``'s state and its number of requests running on its engine."""

    def dispatch(self, request: Request, device: str, now: float) -> bool:
        """Hand ``request`` to its model's engine; False if the body failed it instead."""

    def reject(self, request: Request, reason: RejectReason, detail: str, now: float) -> None:
        """End ``request`` with the policy's reason."""

    def activate(self, model: str, devices: tuple[str, ...], now: float) -> None:
        """Start loading ``model`` on ``devices`` (rank 0 first); it shows ACTIVATING from now on."""

    def evict(self, model: str, now: float) -> Iterable[Request]:
        """Stop ``model``'s engine; returns the requests that were running on it and must start over."""

    def set_kv_quota(self, model: str, device: str, quota_bytes: int | None) -> None:
        """Cap ``model``'s KV bytes on ``device`` (None: no cap)."""


@dataclass(frozen=True, slots=True)
class PlacementRun:
    """One tick's placement while it is decided (``ControlLoop.begin_tick``): the snapshot the policy
    places on, its time, and the loop's residency versions when it was taken, by which ``end_tick``
    tells whether the actions still apply."""

    cluster: ClusterSnapshot
    now: float
    version: int  # the loop's: bumped when the device set changes, a worker dies or an activation fails
    devices: Mapping[str, int]  # per device: bumped when a model starts or finishes activating there


# Seconds of arrivals a model's request rate is measured over (RateEstimator): the live
# controller's and the simulator's default.
RATE_WINDOW_S = 60.0


class ControlLoop:
    def __init__(
        self,
        policy: Policy,
        devices: Sequence[str],
        body: Body,
        models: Iterable[str],
        start: float,
        *,
        rate_window_s: float = RATE_WINDOW_S,
        forecast_window_s: float = 300.0,
        place_later: Callable[[], None] | None = None,
        rate_priors: Mapping[str, float] | None = None,
    ) -> None:
        self.policy = policy
        # what the policy carries from one placement to the next (PolicyMemo): the loop's, handed
        # to every place(), so the simulator and the live runtime keep it alike
        self.memo = policy.new_memo()
        self.body = body
        self.place_later = place_later
        # residency versions (PlacementRun): the loop's, and each device's
        self.version = 0
        self.device_versions: Counter[str] = Counter()
        self.rates = RateEstimator(rate_window_s)
        self.forecast = SeasonalForecaster(forecast_window_s)
        # tokens asked and served per tenant of each class: an arrival's Request.share (control/fairness.py)
        self.fair = FairShare()
        self.queues: dict[str, RequestQueue] = {d: self._new_queue(d) for d in devices}
        self.backlog: dict[str, Request] = {}  # deferred requests, in deferral order
        self.where: dict[str, str] = {}  # req_id -> _NEW, _DEFERRED, ENGINE or the device it queues on
        self._dispatched_to: dict[str, str] = {}  # req_id -> the device whose queue dispatched it
        self.requests: dict[str, Request] = {}
        self.num_queued: Counter[str] = Counter()  # per model: in a device queue or deferred
        self.counters: Counter[str] = Counter()  # evictions, migrations(_skipped), rejections, restarts
        # What changed since the body last built a snapshot (the simulator rebuilds only these).
        self.stale_models: dict[str, None] = {}
        self._forecast_window: int | None = None  # the forecast window of the last tick
        self.stale_devices: set[str] = set(devices)
        self._to_admit: set[str] = set()
        self._reroute: list[Request] = []
        self._applying = False
        # served models an operator unloaded, or their keep-alive evicted: no forecast (so no prewarming)
        # until their next arrival
        self.held: set[str] = set()
        # ModelSnapshot.prewarmed: models activated while no request of theirs was waiting or being
        # routed, and without an arrival since (cleared by an arrival or an eviction; a migration
        # keeps it). Decided here, once, so that the runtime and the simulator cannot disagree.
        self.prewarmed: set[str] = set()
        self._routing: Counter[str] = Counter()  # models with a request being routed right now
        # which prompt prefixes each replica probably holds (prefix_index.py), for a policy that
        # routes and admits by them; requests carry their keys (Request.prefix_keys)
        self.prefix_aware = bool(policy.prefix_aware)
        self.prefixes = PrefixIndex()
        self._models = dict.fromkeys(models)
        # served models that have replica slots (named model#k): only their arrivals need a snapshot
        # to pick a replica before the rate update
        self._replicated = {
            m.rpartition(REPLICA_SEPARATOR)[0] for m in self._models if REPLICA_SEPARATOR in m
        }
        for m in self._models:
            self.rates.start(m, start)
            self.forecast.start(m, start)
        # the rates the models are expected to get (their config's expected_rate, RateEstimator's
        # prior): what their rates read before a window of arrivals has been seen
        for m, rate in (rate_priors or {}).items():
            if m in self._models:
                self.rates.set_prior(m, rate)

    def _new_queue(self, device: str) -> RequestQueue:
        q = self.policy.new_queue(device)
        q.shares = self.fair.current
        return q

    # ---- events ---------------------------------------------------------------------------------

    def arrival(self, request: Request, now: float) -> None:
        if request.req_id in self.requests:
            raise LoopStateError(f"request {request.req_id!r} is already in the loop")
        self.fair.charge(request.origin, asked=request.prompt_tokens, now=now)
        share = self.fair.level(request.origin, now)
        if share != request.share:
            request = replace(request, share=share)
        self.requests[request.req_id] = request
        self._route(request, now, arriving=True)
        self._admit_changed(now)

    def tick(self, now: float) -> None:
        run = self.begin_tick(now)
        self.end_tick(run, self.decide(run), now)

    def begin_tick(self, now: float) -> PlacementRun:
        """A tick's first part, on the body's loop: the models' own keep-alive evictions, then the
        snapshot to place on."""
        self._mark_moved(now)
        self.fair.forget_idle(now)
        cluster = self.body.cluster(now)
        expired = keep_alive_expired(cluster, now)
        if expired:  # the models' own keep-alive comes before the policy
            self._apply([Evict(m) for m in expired], now)
            # and holds until the model's next request: prewarming it again would undo what its
            # configuration asked for, at every tick
            for m in expired:
                if cluster.models[m].replica_of is None:
                    self.hold(m)
            cluster = self.body.cluster(now)
        return PlacementRun(cluster, now, self.version, dict(self.device_versions))

    def decide(self, run: PlacementRun) -> list:
        """``policy.place`` on the run's snapshot with the loop's memo. A policy holds only its
        knobs, the snapshot is a value and the memo is touched by ``place`` alone, so this reads
        nothing else that the loop changes: any thread may run it. Two placements may overlap (the
        live runtime places on the loop when a node joins or leaves while its placement thread
        decides); a memo's entries are each checked against the snapshot entry they were made from
        (PrismMemo), so an overlap at worst redoes work."""
        return list(self.policy.place(run.cluster, run.now, self.memo))

    def end_tick(self, run: PlacementRun, actions: Sequence, now: float) -> bool:
        """A tick's last part, on the body's loop: ``actions`` (``decide``'s for ``run``) applied,
        deferred requests routed again, every device with a queue admits. False, with nothing done,
        when the actions no longer apply (``_still_applies``): the body decides again."""
        if not self._still_applies(run, actions):
            self.counters["placements_redone"] += 1
            return False
        self._apply_placement(run.cluster, actions, now)
        pending, self.backlog = list(self.backlog.values()), {}
        for i, request in enumerate(pending):
            try:
                self._set_where(request, _NEW)
                self._route(request, now)
            except BaseException:  # a policy failed: what was not routed stays deferred
                self.backlog.update((r.req_id, r) for r in pending[i + 1 :])
                raise
        self._to_admit.update(d for d, q in self.queues.items() if len(q))
        self._admit_changed(now)
        return True

    def _still_applies(self, run: PlacementRun, actions: Sequence) -> bool:
        """Whether ``actions``, decided on ``run``'s snapshot, still act on what it showed: no device
        joined or left, no worker died and no activation failed since, no model started or finished
        activating on a device they name (an eviction only frees memory, which leaves a plan
        feasible), every model they name is in the state it showed, and none that it showed idle
        has requests now. (What else moved, a queue or a rate, moves between any two ticks; the
        next one sees it.)"""
        if run.version != self.version:
            return False
        versions, seen = self.device_versions, run.devices
        models = run.cluster.models
        for a in actions:
            name = getattr(a, "model", None)
            snap = models.get(name) if name is not None else None
            if snap is None:
                return False
            touched = [*snap.placement, *getattr(a, "devices", ()), *getattr(a, "dst", ())]
            if any(versions[d] != seen.get(d, 0) for d in touched):
                return False
            state, running = self.body.model_state(name)
            if state is not snap.state:
                return False
            if not (snap.num_running or snap.num_queued) and (running or self.num_queued[name]):
                return False  # decided for an idle model (to evict or move it) that has work now
        return True

    def _touch(self, devices: Iterable[str]) -> None:
        for d in devices:
            self.device_versions[d] += 1

    def _mark_moved(self, now: float) -> None:
        """Mark stale what time alone moved since the last tick: the rates with arrivals in their
        window, and every forecast once a new forecast window began. Everything else a model's
        snapshot reports changes only with an event, which marks it then."""
        window = self.forecast.window(now)
        if window != self._forecast_window:
            self._forecast_window = window
            self.stale_models.update(self._models)
            return
        models = self._models
        self.stale_models.update((m, None) for m in self.rates.moving(now) if m in models)

    def activation_done(self, model: str, device: str, now: float) -> None:
        self.stale_models[model] = None
        self._to_admit.add(device)
        self._touch((device,))
        # the contract's "place() after a model finishes activating" (it may move it again): here
        # and now, or by the body (coalesced with others, or off the body's event loop)
        if self.place_later is not None:
            self.place_later()
            self._admit_changed(now)
        else:
            self.place(now)

    def place(self, now: float) -> None:
        """``policy.place`` now and its actions applied, then admission where anything changed: the
        placement that follows an activation (a tick's without the backlog's second routing)."""
        cluster = self.body.cluster(now)
        self._apply_placement(cluster, self.policy.place(cluster, now, self.memo), now)
        self._admit_changed(now)

    def _apply_placement(self, cluster: ClusterSnapshot, actions: Sequence, now: float) -> None:
        if logger.isEnabledFor(logging.INFO):
            _log_moves(actions, cluster)
        self._apply(actions, now)

    def activation_failed(self, model: str, now: float) -> list[Request]:
        """The model's waiting requests leave the loop; the body fails them. A replica slot's
        (control/replicas.py) are routed again instead: the model has other replicas, or replica 0
        to activate, and the body fails none of them."""
        out = [r for r in self.requests.values() if r.model == model and self.where[r.req_id] != ENGINE]
        self.stale_models[model] = None
        self.version += 1
        self.prefixes.forget(model)
        snap = self.body.cluster(now).models.get(model)
        replica = snap is not None and snap.replica_of is not None
        for r in out:
            self.abort(r.req_id)
            if replica:  # back in as new, keeping its arrival time
                self.requests[r.req_id] = r
                self.where[r.req_id] = _NEW
                self._reroute.append(r)
        self._drain_reroutes(now)
        self._admit_changed(now)
        return [] if replica else out

    def request_left(
        self, req_id: str, output_tokens: int = 0, now: float | None = None, first_token: float | None = None
    ) -> None:
        """A request on an engine is done (finished, failed or aborted) after ``output_tokens``,
        its first token at ``first_token`` (None: none came); both count in its tenant's fair
        share at ``now`` (control/fairness.py). Admission waits for the body's ``capacity_freed``,
        so one step's many finishes admit once."""
        if self.where.get(req_id) == ENGINE:
            request = self.requests[req_id]
            self.first_token(req_id, first_token)  # where the body did not report it as it came
            if now is not None:
                self.fair.left(
                    request.origin, request.prompt_tokens, output_tokens,
                    first_token is not None and first_token <= request.deadline, now,
                )  # fmt: skip
            self._forget(request)

    def first_token(self, req_id: str, at: float | None) -> None:
        """A dispatched request's first token came at ``at`` (None: it left without one): the queue
        that dispatched it learns how that compares with what it predicted (control/admission.py,
        ``DeadlineQueue.first_token``). Bodies call it as the token comes; ``request_left`` calls it
        for a request still unreported."""
        device = self._dispatched_to.pop(req_id, None)
        q = self.queues.get(device) if device is not None else None
        if q is not None:
            q.first_token(req_id, at)

    def capacity_freed(self, devices: Iterable[str], now: float) -> None:
        self.wake(devices)
        self._admit_changed(now)

    def wake(self, devices: Iterable[str]) -> None:
        """Mark ``devices`` for admission at the end of the event being handled (for a body whose
        effect, such as an eviction, frees memory while the loop applies actions)."""
        self._to_admit.update(d for d in devices if d in self.queues and len(self.queues[d]))

    def add_device(self, device: str) -> None:
        """A device joined (a node of a Ray cluster): the policy may place on it from now on."""
        if device not in self.queues:
            self.queues[device] = self._new_queue(device)
            self.stale_devices.add(device)
            self.version += 1

    def remove_device(self, device: str, now: float) -> None:
        """A device left (its node died). The body has already dropped it and its models from the
        snapshots; the requests queued on it are routed again."""
        q = self.queues.pop(device, None)
        if q is None:
            return
        self.version += 1
        for r in q.requests():
            q.cancel(r.req_id)
            self._set_where(r, _NEW)
            self._reroute.append(r)
        self.stale_devices.discard(device)
        self._to_admit.discard(device)
        self._drain_reroutes(now)
        self._admit_changed(now)

    def abort(self, req_id: str) -> bool:
        """Drop a request that is not on an engine; False if the loop does not hold it there."""
        where = self.where.get(req_id)
        if where is None or where == ENGINE:
            return False
        if where == _DEFERRED:
            self.backlog.pop(req_id, None)
        elif where != _NEW:
            self.queues[where].cancel(req_id)
        self._forget(self.requests[req_id])
        return True

    def worker_died(self, model: str, now: float) -> None:
        self.stale_models[model] = None
        self.version += 1
        self.prefixes.forget(model)
        for request in self._take_queued(model):
            self._reroute.append(request)
        self._drain_reroutes(now)
        self._admit_changed(now)

    def hold(self, model: str, held: bool = True) -> None:
        """An operator unloaded the served ``model`` (or its keep-alive did, at a tick): it stays
        evicted until a request for it arrives or ``hold(model, False)`` (the forecast would
        otherwise prewarm it again at the next tick)."""
        if held:
            self.held.add(model)
        else:
            self.held.discard(model)
        self.stale_models[model] = None

    def forecast_rate(self, model: str, now: float) -> float | None:
        """``ModelSnapshot.forecast_rate``: the seasonal forecast (None before its first complete
        window), 0.0 while ``model`` is held: an operator's unload says no request is expected."""
        return 0.0 if model in self.held else self.forecast.rate(model, now)

    # ---- routing and actions ----------------------------------------------------------------------

    def _route(self, request: Request, now: float, *, arriving: bool = False) -> None:
        """Pick the request's replica, then let the policy route it. An arrival counts in the rate of
        the replica it goes to and in the forecast of its served model, unless it is of the batch
        class: batch work waits for idle capacity (control/admission.py), so it must not read as
        demand that replicas, placement and prewarming answer (a batch file of 10,000 lines for one
        model would make it the hottest model of the deployment)."""
        self.where[request.req_id] = _NEW
        counted = request.origin.priority is not Priority.BATCH
        if arriving and request.model not in self._replicated:
            # one replica: it is the request's own model, so its arrival counts before the snapshot
            self._observe(request.model, request.model, now, counted)
        cluster = self.body.cluster(now)
        prefixed = self.prefix_aware and bool(request.prefix_keys)
        cached = self._cached_by_replica(request, cluster) if prefixed else None
        routed = self.policy.pick_replica(request, cluster, now, cached=cached)
        if prefixed:
            routed = self._note_prefix(routed, cluster, cached)
        if routed is not request:
            self.requests[routed.req_id] = routed
        if arriving and request.model in self._replicated:
            snap = cluster.models.get(routed.model)
            self._observe(routed.model, snap.group if snap is not None else routed.model, now, counted)
            cluster = self.body.cluster(now)
        self._routing[routed.model] += 1
        try:
            self._apply(self.policy.on_request(routed, cluster, now), now)
        finally:
            self._routing[routed.model] -= 1

    def _cached_by_replica(self, request: Request, cluster: ClusterSnapshot) -> dict[str, int] | None:
        """Per replica of the request's served model, the prompt tokens it probably holds cached
        (the prefix index, brought up to date with the snapshot first); None for an unknown model."""
        m = cluster.models.get(request.model)
        if m is None:
            return None
        index, models = self.prefixes, cluster.models
        out = {}
        for name in cluster.replicas(m.group):
            r = models[name]
            index.sync(name, r.resident, r.placed_at)
            out[name] = index.cached_tokens(name, request.prefix_keys, request.prompt_tokens)
        return out

    def _note_prefix(
        self, routed: Request, cluster: ClusterSnapshot, cached: Mapping[str, int] | None
    ) -> Request:
        """``routed`` with the cached tokens expected on the replica it goes to; its keys recorded
        there, bounded by what that replica's engine can cache."""
        name = routed.model
        if cached is None or name not in cached:
            return routed  # an unknown model: on_request rejects it
        index = self.prefixes
        index.record(name, routed.prefix_keys, capacity_blocks(cluster, name, index.block_tokens))
        if cached[name] != routed.cached_tokens:
            routed = replace(routed, cached_tokens=cached[name])
        return routed

    def _observe(self, replica: str, model: str, now: float, counted: bool = True) -> None:
        """An arrival for ``replica`` of the served ``model``: rates are per replica, the forecast
        per served model (``counted``: the arrival counts in both; either way the model is no longer
        held or prewarmed)."""
        if counted:
            self.rates.observe(replica, now)
            self.forecast.observe(model, now)
        self.held.discard(model)
        self.prewarmed.discard(replica)
        self.prewarmed.discard(model)
        self.stale_models[replica] = None
        self.stale_models[model] = None

    def _scales_out(self, model: str, now: float) -> bool:
        """Whether activating ``model`` adds a replica to a served model that has one resident: the
        demand it serves is that model's, so it is not prewarmed (its memory would yield first, and
        the next tick would ask for it again)."""
        group = model.rpartition(REPLICA_SEPARATOR)[0] if REPLICA_SEPARATOR in model else model
        if group not in self._replicated:
            return False
        cluster = self.body.cluster(now)
        return any(cluster.models[r].resident for r in cluster.replicas(group) if r != model)

    def _apply(self, actions: Iterable, now: float) -> None:
        """Apply ``actions`` in order; requests they displaced are routed again afterwards, so every
        policy call sees a snapshot with the previous call's actions fully applied."""
        if self._applying:
            self._apply_each(actions, now)
            return
        self._applying = True
        try:
            self._apply_each(actions, now)
        finally:
            self._applying = False
        self._drain_reroutes(now)

    def _drain_reroutes(self, now: float) -> None:
        while self._reroute:
            request = self._reroute.pop(0)
            if request.req_id in self.requests:  # not failed meanwhile
                self._route(request, now)

    def _apply_each(self, actions: Iterable, now: float) -> None:
        body = self.body
        for a in actions:
            match a:
                case Enqueue(request=r, device=d):
                    self.queues[d].push(r)
                    self._set_where(r, d)
                    self._to_admit.add(d)
                case Dispatch(request=r, device=d):
                    self._set_where(r, ENGINE)
                    self._dispatched_to[r.req_id] = d
                    self.stale_devices.add(d)
                    if not body.dispatch(r, d, now):
                        self.request_left(r.req_id)
                case Defer(request=r):
                    self.backlog[r.req_id] = r
                    self._set_where(r, _DEFERRED)
                case Reject(request=r, reason=reason, detail=detail):
                    self._forget(r)
                    self.counters["rejections"] += 1
                    body.reject(r, reason, detail, now)
                case Activate(model=model, devices=devices):
                    if self.num_queued[model] or self._routing[model] or self._scales_out(model, now):
                        self.prewarmed.discard(model)  # activated for demand
                    else:
                        self.prewarmed.add(model)  # ahead of any request (the forecast)
                    body.activate(model, devices, now)
                    self._touch(devices)
                    self._displaced_by_activation(model, devices[0])
                case Evict(model=model):
                    self.prewarmed.discard(model)
                    self.prefixes.forget(model)
                    self.counters["evictions"] += 1
                    self._evicted(model, body.evict(model, now))
                case Migrate(model=model, dst=dst):
                    self._migrate(model, dst, now)
                case SetKVQuota(model=model, device=d, quota_bytes=q):
                    body.set_kv_quota(model, d, q)
                case _:
                    raise LoopStateError(f"cannot apply {a!r}")
            if hasattr(a, "model"):
                self.stale_models[a.model] = None

    def _set_where(self, request: Request, where: str) -> None:
        old = self.where.get(request.req_id, _NEW)
        queued_before = old not in (_NEW, ENGINE)
        queued_after = where not in (_NEW, ENGINE)
        if queued_before != queued_after:
            self._count(request, 1 if queued_after else -1)
        if old not in (_NEW, ENGINE, _DEFERRED):
            self.stale_devices.add(old)
        if where not in (_NEW, ENGINE, _DEFERRED):
            self.stale_devices.add(where)
        self.where[request.req_id] = where

    def _count(self, request: Request, delta: int) -> None:
        self.num_queued[request.model] += delta
        self.stale_models[request.model] = None

    def _forget(self, request: Request) -> None:
        """``request`` leaves the loop (already out of its queue or engine): uncount it."""
        self._set_where(request, _NEW)
        del self.where[request.req_id]
        self.requests.pop(request.req_id, None)
        self._dispatched_to.pop(request.req_id, None)
        self.stale_models[request.model] = None

    def _take_queued(self, model: str, keep: str | None = None) -> list[Request]:
        """Remove ``model``'s requests from every device queue but ``keep``; they become new."""
        out = []
        for d, q in self.queues.items():
            if d == keep or model not in q.models():
                continue
            for r in q.requests():
                if r.model == model:
                    q.cancel(r.req_id)
                    self._set_where(r, _NEW)
                    out.append(r)
        return out

    def _displaced_by_activation(self, model: str, rank0: str) -> None:
        # requests of this model queued on another device would never start there
        self._reroute.extend(self._take_queued(model, keep=rank0))

    def _evicted(self, model: str, restarted: Iterable[Request]) -> None:
        for r in restarted:
            self.counters["restarts"] += 1
            self.first_token(r.req_id, None)  # its queue forgets what it promised: it starts over
            self._set_where(r, _NEW)
            self._reroute.append(r)

    def _migrate(self, model: str, dst: tuple[str, ...], now: float) -> None:
        state, num_running = self.body.model_state(model)
        if num_running or state is not ModelState.ACTIVE:
            self.counters["migrations_skipped"] += 1
            return
        moving = self._take_queued(model, keep=dst[0])
        self.prefixes.forget(model)
        self._evicted(model, self.body.evict(model, now))
        self.body.activate(model, dst, now)
        self._touch(dst)
        for r in moving:
            self.queues[dst[0]].push(r)
            self._set_where(r, dst[0])
        self._to_admit.add(dst[0])
        self.counters["migrations"] += 1

    # ---- admission --------------------------------------------------------------------------------

    def _admit_changed(self, now: float) -> None:
        rounds = 0
        while self._to_admit:
            d = min(self._to_admit)  # device-name order: reproducible
            self._to_admit.discard(d)
            q = self.queues[d]
            if not len(q):
                continue
            device, engines = self.body.admission_view(d, now)
            actions = self.policy.admit(q, device, engines, now)
            if actions:
                self.stale_devices.add(d)
                self._apply(actions, now)
            rounds += 1
            if rounds > _MAX_ADMISSION_ROUNDS:
                raise LoopStateError("admission did not settle (a policy keeps returning work)")


def _log_moves(actions: Sequence, cluster: ClusterSnapshot) -> None:
    """One info line per move a tick decides, with what the policy saw on both sides: each model's
    predicted busy fraction and request rate (the inputs of placement's compute rules)."""

    def side(devices: Iterable[str]) -> str:
        return "; ".join(
            f"{d}: "
            + ", ".join(
                f"{n} {cluster.models[n].busy:.2f}/{cluster.models[n].rate:.3f}"
                for n in cluster.devices[d].models
            )
            for d in devices
        )

    for a in actions:
        if isinstance(a, Migrate):
            logger.info(
                "moving %s %s -> %s (busy/rate %s | %s)",
                a.model,
                a.src,
                a.dst,
                side(a.src),
                side(a.dst),
            )
        elif isinstance(a, Activate) and cluster.models[a.model].replica_of is not None:
            group = cluster.models[a.model].replica_of
            copies = [r for r in cluster.replicas(group) if cluster.models[r].resident]
            logger.info(
                "adding %s on %s beside %s (busy/rate %s | %s)",
                a.model,
                a.devices,
                copies,
                side(sorted({d for r in copies for d in cluster.models[r].placement})),
                side(a.devices),
            )
