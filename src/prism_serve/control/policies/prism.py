"""``prism``: the paper's two-level demand-aware scheduling (section 6).

Global tick (``place``), in this order:
1. evict idle models from devices at or above the memory watermark, larger SLO first
   (``eviction.constrained_evictions``);
2. Algorithm 1 over every resident model plus every evicted model that has requests waiting,
   keeping models where they are unless the KVPR gain exceeds tau (``placement.place_parts``);
   a model placed less than ``migration_cooldown_s`` ago stays put (``ModelSnapshot.placed_at``), and
   so does a model with running requests (callers migrate only idle models);
3. an evicted model with waiting requests that Algorithm 1 could not fit is activated where idle
   models can make room (``eviction.choose_activation``), else where replicas yielding to it can,
   else where *quiet* models can (nothing queued or running, a lower rate than it; knob
   ``evict_quiet``);
4. beyond the paper: a compute-balancing move through idle models, replicas of hot models (and
   of models backlogged by a burst), make-before-break moves of busy models slowed by their
   neighbours (``relocate_busy``), and prewarming (forecast, then the startup fill).
Requests (``on_request``) for a resident model go to its rank-0 device's queue; for an evicted model
they trigger an activation on the lowest-KVPR device that can hold it. Admission is Algorithm 2
(``admission.DeadlineQueue``).

The ``rebalance`` and ``deadline_admission`` knobs switch off the global rebalancing and the local
deadline scheduling, for the ablations of the paper's Figures 10 and 11.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from prism_serve.control.admission import DeadlineQueue
from prism_serve.control.eviction import (
    DeviceLoad,
    best_move_through_idle,
    choose_activation,
    constrained_evictions,
    device_loads,
    never_fits,
)
from prism_serve.control.placement import DeviceBudget, Part, contention, on_one_node, place_parts, pressure
from prism_serve.control.policies.base import (
    Policy,
    PolicyMemo,
    min_kv_bytes,
    no_capacity,
    route_resident,
    unknown_model,
)
from prism_serve.control.policies.prism_knobs import PrismKnobs
from prism_serve.control.policies.prism_room import (
    free_slot,
    move_overloads,
    plan_load,
    plan_unload,
    planned_loads,
    room_now,
    with_quiet_models,
    with_room_now,
    with_spare_replicas,
)
from prism_serve.control.queues import FifoQueue, RequestQueue
from prism_serve.control.replicas import (
    MISPLACED_FACTOR,
    group_rate,
    neighbours_busy,
    pick_replica,
    replica_capacity,
    replicas_for_rate,
    resident_replicas,
    settled,
    spare_replicas,
    surplus,
    wanted_replicas,
    yielding_replica,
)
from prism_serve.control.types import (
    Action,
    Activate,
    ClusterSnapshot,
    Defer,
    Enqueue,
    Evict,
    Migrate,
    ModelSnapshot,
    ModelState,
    Request,
)

__all__ = ["PrismKnobs", "PrismMemo", "PrismPolicy"]

# a device this contended (busy fraction 0.5) is worth a compute-balancing move through idle models
_CONTENDED = 2.0


@dataclass(slots=True)
class PrismMemo(PolicyMemo):
    """What prism carries from one ``place`` to the next: each resident model's Algorithm 1 parts,
    with the snapshot entry and the fixed flag they were made from. Most resident models' entries
    are the same object from one snapshot to the next (the bodies rebuild only what changed), so
    their parts are reused while both are unchanged; entries of models gone stay until the model
    is placed again (at most one per model)."""

    parts: dict[str, tuple[ModelSnapshot, bool, list[Part]]] = field(default_factory=dict)


class _TickPlan:
    """One placement as it is built, step by step (the steps at the top of this module): the
    devices each considered model will be on (``planned``), the models evicted (``evicted``, in
    order, and ``gone``, as a set), and the devices' loads under the plan (``loads()``: Algorithm
    1's, built on first use; each step that evicts or places keeps them current)."""

    __slots__ = ("_busy", "_knobs", "_loads", "_result", "_spare", "cluster", "evicted", "gone", "now",
                 "planned")  # fmt: skip

    def __init__(
        self,
        cluster: ClusterSnapshot,
        now: float,
        evicted: list[str],
        gone: set[str],
        result,
        busy: Callable[[ModelSnapshot], float],
        knobs: PrismKnobs,
    ) -> None:
        """``evicted`` and ``gone``: the evictions so far (as a list and as a set); ``result``:
        Algorithm 1's (``placement.place_parts``), which ``loads()`` starts from."""
        self.cluster = cluster
        self.now = now
        self.evicted = evicted
        self.gone = gone
        self.planned: dict[str, tuple[str, ...]] = {}
        self._result = result
        self._busy = busy
        self._knobs = knobs
        self._loads: list[DeviceLoad] | None = None
        self._spare: list[ModelSnapshot] | None = None

    def loads(self) -> list[DeviceLoad]:
        """The plan's per-device loads, built once and only if a step needs them."""
        if self._loads is None:
            k = self._knobs
            self._loads = planned_loads(
                self.cluster, self._result, self.planned, self.now, k.idle_threshold_s, k.min_kv_fraction
            )
        return self._loads

    def peak_busy(self) -> float:
        """The busiest device's busy fraction under the plan (Algorithm 1's while no step changed it)."""
        busy = (load.busy for load in self._loads) if self._loads is not None else (self._result.busy or ())
        return max(busy, default=0.0)

    def spare(self) -> list[ModelSnapshot]:
        """The snapshot's replicas that yield to a model with no copy, found once per placement."""
        if self._spare is None:
            self._spare = spare_replicas(self.cluster)
        return self._spare

    def evict(self, victims: list[str]) -> None:
        """Take the idle ``victims`` out of the plan: their loads and devices; into ``evicted``."""
        loads, models = self.loads(), self.cluster.models
        for v in victims:
            plan_unload(loads, models[v], self.planned.pop(v), self._busy(models[v]))
            self.evicted.append(v)
            self.gone.add(v)

    def make_room(self, candidates: list[DeviceLoad], m: ModelSnapshot) -> tuple[str, ...] | None:
        """Devices for ``m`` among ``candidates`` (some of the plan's loads) by
        ``choose_activation``, evicting the idle models it names there; the plan's loads take both
        in (the caller records where ``m`` goes). None if no device can hold it."""
        choice = choose_activation(m, candidates)
        if choice is None:
            return None
        devices, victims = choice
        self.evict(victims)
        plan_load(self.loads(), m, devices, self._busy(m))
        return devices


class PrismPolicy(Policy):
    name = "prism"
    knobs_type = PrismKnobs
    knobs: PrismKnobs

    def new_queue(self, device: str) -> RequestQueue:
        k = self.knobs
        if not k.deadline_admission:
            return FifoQueue(device, reserve_tokens=k.reserve_tokens)
        return DeadlineQueue(
            device,
            reserve_tokens=k.reserve_tokens,
            abort_on_miss=k.abort_on_miss,
            default_prefill_tokens_per_s=k.default_prefill_tokens_per_s,
            best_effort_share=k.best_effort_share,
            learn_lateness=k.lateness_margin,
        )

    @property
    def replica_slots(self) -> int:
        return self.knobs.max_replicas

    @property
    def prefix_aware(self) -> bool:
        return self.knobs.prefix_aware

    def pick_replica(
        self,
        request: Request,
        cluster: ClusterSnapshot,
        now: float,
        cached: Mapping[str, int] | None = None,
    ) -> Request:
        """The replica holding the longest cached prefix of the request unless it would miss the
        TTFT SLO where another would not, else the one with the lowest predicted TTFT
        (replicas.pick_replica); leaving out a surplus replica, or while a model waits with no copy
        resident the replica that yields to it (either drains)."""
        m = cluster.models.get(request.model)
        if m is None or len(cluster.replicas(m.group)) == 1:
            return pick_replica(request, cluster)
        extra = surplus(cluster, m.group, self.knobs.replica_low)
        if extra is None and cluster.starved:
            extra = yielding_replica(cluster, m.group)
        draining = extra.model if extra is not None else None
        return pick_replica(request, cluster, draining, cached=cached if self.prefix_aware else None, now=now)

    def on_request(self, request: Request, cluster: ClusterSnapshot, now: float) -> list[Action]:
        m = cluster.models.get(request.model)
        if m is None:
            return [unknown_model(request)]
        routed = route_resident(request, m)
        if routed is not None:
            return routed
        k = self.knobs
        if never_fits(m, cluster, k.min_kv_fraction):
            return [
                no_capacity(
                    request,
                    f"{m.model} needs {m.tp_size} device(s) with room for "
                    f"{m.part_weight_bytes} weight bytes plus the KV minimum",
                )
            ]
        loads = device_loads(cluster, now, k.idle_threshold_s, k.min_kv_fraction, compute=k.compute_aware)
        choice = choose_activation(m, loads)
        if choice is None:
            choice = choose_activation(m, with_spare_replicas(spare_replicas(cluster), loads, set()))
        if choice is None:
            return [Defer(request, f"{m.model}: every device is full of busy models")]
        devices, evictions = choice
        return [*(Evict(v) for v in evictions), Activate(m.model, devices), Enqueue(request, devices[0])]

    def _expected(self, m: ModelSnapshot) -> bool:
        """Whether a request for ``m`` is expected within the prewarm horizon (the prewarm rule's
        test): by its forecast, or before the forecast has a complete window by its rate so far
        (a model asked for 8 times a minute is expected, forecast or not)."""
        rate = m.rate if m.forecast_rate is None else m.forecast_rate
        return rate * self.knobs.prewarm_horizon_s >= 1.0

    def _prewarm_rank(self, m: ModelSnapshot) -> tuple | None:
        """Where an evicted ``m`` stands in the prewarm order, or None if it is not prewarmed: first
        the models the forecast expects (highest forecast first), then those with no forecast yet
        (``forecast_rate`` None: no complete window since the start), by their rate so far and then
        the smallest weights, so that free memory holds as many of them as it can. Without a
        forecast nothing says a model is unwanted, and memory nobody uses serves nothing: at start
        the models fill it as the baselines' up-front loading does, instead of every model's first
        request waiting for its activation."""
        if m.forecast_rate is None:
            return (1, -m.rate, m.weight_bytes, m.model)
        if self._expected(m):
            return (0, -m.forecast_rate, 0, m.model)
        return None

    def _busy(self, m: ModelSnapshot) -> float:
        return m.busy if self.knobs.compute_aware else 0.0

    def new_memo(self) -> PrismMemo:
        return PrismMemo()

    def place(self, cluster: ClusterSnapshot, now: float, memo: PolicyMemo | None = None) -> list[Action]:
        if memo is None:
            memo = PrismMemo()
        elif not isinstance(memo, PrismMemo):
            raise TypeError(f"prism places with a PrismMemo (its new_memo()), got {type(memo).__name__}")
        k = self.knobs
        busy = self._busy
        evicted = constrained_evictions(cluster, now, k.idle_threshold_s, k.memory_watermark)
        gone = set(evicted)
        parts: list[Part] = []
        waiting: list[ModelSnapshot] = []
        # what the plan is about: resident models and evicted ones with requests waiting (most of a
        # large deployment's models and replica slots are neither), in the snapshot's order
        evicted_state = ModelState.EVICTED
        considered = [m for m in cluster.models.values() if m.state is not evicted_state or m.num_queued > 0]
        kept_parts = memo.parts
        for m in considered:
            if m.model in gone:
                continue
            if m.state is not evicted_state:
                # Callers move only a model with nothing running (runtime/controller.py); planning
                # around a busy model as if it moved would move the others into a plan that never
                # happens. So it stays put this round, like one activating or cooling down.
                fixed = (
                    m.state is ModelState.ACTIVATING
                    or m.num_running > 0
                    or not k.rebalance
                    or self._cooling(m, now)
                )
                # the parts of the same snapshot at an earlier tick, if it stays as fixed as it was
                # (most resident models' snapshots are unchanged from one tick to the next)
                got = kept_parts.get(m.model)
                if got is None or got[0] is not m or got[1] != fixed:
                    got = kept_parts[m.model] = (
                        m,
                        fixed,
                        [
                            Part(
                                m.model,
                                r,
                                m.demand / m.tp_size,
                                m.part_weight_bytes,
                                m.placement[r],
                                fixed,
                                busy(m),
                                m.group,
                            )
                            for r in range(m.tp_size)
                        ],
                    )
                parts.extend(got[2])
            else:
                waiting.append(m)
                parts.extend(
                    Part(m.model, r, m.demand / m.tp_size, m.part_weight_bytes, busy=busy(m), group=m.group)
                    for r in range(m.tp_size)
                )
        budgets = [
            DeviceBudget(d, dev.capacity_bytes, min_kv_bytes(dev, k.min_kv_fraction))
            for d, dev in cluster.devices.items()
        ]
        result = place_parts(parts, budgets, k.migration_threshold)
        plan = _TickPlan(cluster, now, evicted, gone, result, busy, k)

        planned = plan.planned
        waiting_names = {m.model for m in waiting}
        for m in considered:
            if m.model in gone or not (m.state is not evicted_state or m.model in waiting_names):
                continue
            where = result.placement(m.model, m.tp_size)
            # a resident model that no longer fits anywhere in the plan stays put: its memory is real;
            # and so does one whose ranks the plan only shuffles among its own devices (a TP model's
            # ranks are alike to Algorithm 1, but a move reloads every rank and stops the model)
            if where is None or (m.tp_size > 1 and set(where) == set(m.placement)):
                where = m.placement
            planned[m.model] = where
        activations = [m for m in waiting if planned.get(m.model)]

        # evicted models Algorithm 1 could not fit: make room by evicting idle models (section 6.2)
        unplaced = sorted(
            (m for m in waiting if not planned.get(m.model)), key=lambda m: (-m.demand, m.model)
        )
        if unplaced:
            loads = plan.loads()
            for m in unplaced:
                del planned[m.model]
                devices = plan.make_room(loads, m)
                if devices is None:  # a second copy of another model yields to this model's first
                    devices = plan.make_room(with_spare_replicas(plan.spare(), loads, gone), m)
                if devices is None and k.evict_quiet:  # then models with no work now, least used first
                    devices = plan.make_room(with_quiet_models(cluster, loads, planned, m, now), m)
                if devices is None:
                    continue
                planned[m.model] = devices
                activations.append(m)
        # the plan's loads carry Algorithm 1's busy fractions until an activation changes them, so
        # without a contended device in either there is nothing to move and no loads to build
        if k.compute_aware and k.rebalance and contention(plan.peak_busy()) >= _CONTENDED:
            self._move_through_idle(plan)
        if cluster.extra_replicas:
            # the served models with a copy resident: the only ones replica scaling looks at
            served = {m.group: None for m in considered if m.state is not evicted_state}
            activations.extend(self._scale_replicas(plan, served))
            if k.compute_aware and k.rebalance and k.relocate_busy:
                active = ModelState.ACTIVE
                running = [m for m in considered if m.state is active and m.num_running > 0]
                activations.extend(self._relocate_busy(plan, running))
        if k.prewarm:
            activations.extend(self._prewarm(plan))

        actions: list[Action] = [Evict(v) for v in plan.evicted]
        for m in considered:
            if m.state is not evicted_state and m.model not in gone and planned[m.model] != m.placement:
                actions.append(Migrate(m.model, m.placement, planned[m.model]))
        actions.extend(Activate(m.model, planned[m.model]) for m in activations)
        return actions

    def _move_through_idle(self, plan: _TickPlan) -> None:
        """Compute balancing where memory blocks Algorithm 1: on the most contended device
        (contention >= 2, i.e. busy fraction >= 0.5) where it works, the busiest movable model moves
        to a device that can hold it once idle models there are evicted, if the pressure it lands on
        beats its current one by tau at the current contention (Algorithm 1's rule) and it overloads
        no engine there (:func:`placement.overloads`). At most one
        such move per tick: each costs an activation and the evicted models' next requests."""
        k = self.knobs
        cluster, planned, gone, now = plan.cluster, plan.planned, plan.gone, plan.now
        loads = plan.loads()
        models = cluster.models
        for hot in sorted(loads, key=lambda load: (-load.busy, load.device)):
            if contention(hot.busy) < _CONTENDED:
                return
            # the models that can move off it: one-rank, active, idle now, kept where they are by
            # the plan so far, with predicted work, and out of their cooldown
            movable = [
                m
                for n in cluster.devices[hot.device].models
                if (m := models[n]).state is ModelState.ACTIVE
                and m.tp_size == 1
                and n not in gone
                and planned.get(n) == m.placement
                and m.num_running == 0
                and self._busy(m) > 0
                and not self._cooling(m, now)
            ]
            if not movable:
                continue
            m = max(movable, key=lambda m: (self._busy(m), m.model))
            current = pressure(hot.weighted_rate, hot.shared_kv, hot.busy)
            bound = current - k.migration_threshold * contention(hot.busy)
            move = best_move_through_idle(m, loads, bound)
            if move is None:
                continue
            device, victims = move
            if move_overloads(cluster, m, (device,), set(victims) | gone, self._busy):
                continue
            plan.evict(victims)
            plan_unload(loads, m, m.placement, self._busy(m))
            plan_load(loads, m, (device,), self._busy(m))
            planned[m.model] = (device,)
            return

    def _scale_replicas(self, plan: _TickPlan, served: dict[str, None]) -> list[ModelSnapshot]:
        """Replica slots to activate (added to ``planned``) for served models whose demand wants more
        replicas than are resident, one per model per tick, on the lowest-pressure devices holding no
        replica of it (evicting idle models there if needed, but not those the forecast expects a
        request for within ``prewarm_horizon_s``: a second copy is not worth a first copy's
        reactivation); surplus replicas with nothing queued or running are evicted (added to
        ``evicted``). A model backlogged by a burst wants one replica more (replicas.py).
        ``served``: the served models with a replica resident (the others have nothing to scale)."""
        k = self.knobs
        cluster, planned, gone = plan.cluster, plan.planned, plan.gone
        out = []
        for model in cluster.extra_replicas:
            if model not in served or settled(cluster, model, k.replica_high):
                continue  # neither a copy more nor one fewer, whatever the rest of the plan is
            resident = [m for m in resident_replicas(cluster, model) if m.model not in gone]
            if not resident or any(m.state is ModelState.ACTIVATING for m in resident):
                continue  # nothing to replicate yet, or a replica is still coming up: wait for it
            tp = resident[0].tp_size
            slots = min(k.max_replicas, len(cluster.replicas(model)), len(cluster.devices) // tp)
            n = len(resident)
            if wanted_replicas(cluster, model, k.replica_high, slots) > n:
                free = free_slot(cluster, model, planned)
                if free is None:
                    continue
                taken = {d for m in resident for d in planned.get(m.model, m.placement)}
                # for the plan's loads the new replica carries its share of the model's rate
                # the slot has served nothing yet: its demand is the model's measured one
                share = replace(free, rate=group_rate(cluster, model) / (n + 1), profile=resident[0].profile)
                loads = plan.loads()
                # a second copy takes the memory of idle models the forecast does not expect soon
                # (or of idle second copies)
                others = [
                    replace(load, idle=[m for m in load.idle if m.replica_of or not self._expected(m)])
                    for load in loads
                    if load.device not in taken
                ]
                others = with_room_now(cluster, others, planned, share)
                # a copy only where it runs less contended than the model's busiest copy does now:
                # next to models as busy, it serves at their expense and takes memory (the
                # overloaded decode-heavy CPU sweep: SmolLM2-360M's second copy on the other busy
                # core pushed the small models there out, TTFT 49% at x5 against static's 79%)
                # (the idle models the copy may evict there do not count)
                by_name = {load.device: load for load in loads}
                now_busy = max((by_name[d].busy for m in resident for d in m.placement), default=0.0)
                # what stays on each device once the idle models the copy may evict there are gone
                staying = {load.device: load.busy - sum(map(self._busy, load.idle)) for load in others}
                share_busy = self._busy(share)
                slowed = contention(now_busy)
                others = [load for load in others if contention(staying[load.device] + share_busy) < slowed]
                if replicas_for_rate(cluster, model, k.replica_high) <= n:
                    # a copy for a burst only where its neighbours leave it spare compute: busy less
                    # than half the time without it. Next to busier models it would run at half
                    # speed or less and slow them as much, and the burst is over before that pays
                    # for its activation (the decode-heavy CPU sweep: 17 such copies, TTFT 39% at
                    # x3). Its own share does not count here: a burst big enough that half of it
                    # keeps an engine busy half the time would find no device at all, exactly when
                    # a copy helps most (the test above already asks that it runs less contended
                    # than the copy it relieves). Beside a rank of a tensor-parallel model with work
                    # it does count: that model steps at its slowest rank's pace, so slowing one
                    # rank slows the whole group, and the copy must leave the device under half busy
                    others = [
                        load
                        for load in others
                        if contention(
                            staying[load.device] + (share_busy if self._tp_at_work(cluster, load) else 0.0)
                        )
                        < _CONTENDED
                    ]
                devices = plan.make_room(others, share)
                if devices is None:
                    continue
                planned[free.model] = devices
                out.append(free)
                continue
            extra = surplus(cluster, model, k.replica_low)
            if extra is not None and not (extra.num_queued or extra.num_running) and extra.model not in gone:
                plan.evict([extra.model])
        return out

    def _tp_at_work(self, cluster: ClusterSnapshot, load: DeviceLoad) -> bool:
        """Whether a model of more than one rank with predicted work stays on ``load``'s device
        (one of its idle models, which an activation may evict there, does not)."""
        idle = {m.model for m in load.idle}
        models = cluster.models
        return any(
            (m := models[n]).tp_size > 1 and n not in idle and self._busy(m) > 0
            for n in cluster.devices[load.device].models
        )

    def _cooling(self, m: ModelSnapshot, now: float, by_history: bool = False) -> bool:
        """``m``'s placement is too recent to be undone (``migration_cooldown_s``): a move then acts
        on a rate estimate renewed since that placement rather than on its noise. ``by_history``
        (a busy model slowed by its neighbours, ``_relocate_busy``): the placement is held no longer
        than the history it was decided on (``placed_history_s``): one made blind (the start-up
        fill, an activation right after start, a warm-up) had no estimate to renew, and the
        contention it caused is corrected as soon as the rates show it. Moves of idle models (Algorithm 1, the
        compute-balancing move) keep the whole cooldown: right after a blind placement one request
        reads as 1 req/s, and moving on such estimates churned (the Azure code trace at 40 req/s
        needed 21 simulated GPUs instead of 14)."""
        if m.placed_at is None:
            return False
        hold = self.knobs.migration_cooldown_s
        if by_history and m.placed_history_s is not None:
            hold = min(hold, m.placed_history_s)
        return now - m.placed_at < hold

    def _relocate_busy(self, plan: _TickPlan, running: list[ModelSnapshot]) -> list[ModelSnapshot]:
        """Make-before-break moves of busy models (at most one per tick, each costs an activation).

        A served model with one resident replica that is running requests, placed at least
        ``migration_cooldown_s`` ago, whose neighbours' summed busy fraction slows it (contention >=
        2 on its busiest device), and whose demand one replica serves below ``replica_low`` (or whose
        capacity is not known yet, as live before the engine has batched enough to fit it), gets a
        second replica on the devices :func:`choose_activation` picks among the others that have
        memory for it now (evicting idle models there that the forecast does not expect soon) if
        the device it lands on, itself included, would be at most half as contended as the one it
        leaves, itself included (:data:`replicas.MISPLACED_FACTOR`), and the move overloads no
        engine there (:func:`placement.overloads`: the live decode-heavy sweep moved a model with
        1-3 requests a minute back and forth beside the one model near its limit). Once the new
        replica is active
        the old one is :func:`replicas.misplaced`: the router sends it nothing and it is evicted
        once it has nothing queued or running, as a surplus replica is. ``running``: the active
        replicas with requests running (a model with none resident has nothing to move)."""
        k = self.knobs
        cluster, planned, gone, now = plan.cluster, plan.planned, plan.gone, plan.now
        candidates = []
        extra = cluster.extra_replicas
        # the active replicas running requests (an idle model is Algorithm 1's to move): a model
        # qualifies through its one resident replica, so looking at these alone finds the same
        for m in running:
            model = m.group
            if model not in extra or m.model in gone:
                continue
            if sum(r.model not in gone for r in resident_replicas(cluster, model)) != 1:
                continue  # it has another copy: that one serves while this drains, or the reverse
            if planned.get(m.model) != m.placement or self._cooling(m, now, by_history=True):
                continue
            capacity = replica_capacity(cluster, model)
            if capacity is not None and group_rate(cluster, model) >= k.replica_low * capacity:
                continue
            slowed = contention(neighbours_busy(cluster, m))
            if slowed >= _CONTENDED:
                candidates.append((-slowed, m.model, m))
        # every device's load with the idle models a move may evict there, and the memory it has
        # now, made once for all the candidates: the plan changes only with the move made, after
        # which this returns
        yielding: list[DeviceLoad] = []
        room: dict[str, float] = {}
        for _, _, m in sorted(candidates):
            free = free_slot(cluster, m.group, planned)
            if free is None:
                continue
            loads = plan.loads()
            if not yielding:
                yielding = [
                    replace(load, idle=[v for v in load.idle if v.replica_of or not self._expected(v)])
                    for load in loads
                ]
                room = room_now(cluster, planned, 1.0)
            others = [load for load in yielding if load.device not in m.placement]
            moved = replace(free, rate=m.rate, profile=m.profile)
            choice = choose_activation(moved, with_room_now(cluster, others, planned, moved, room))
            if choice is None:
                continue
            devices, victims = choice
            gone_busy = {d: 0.0 for d in devices}
            for v in victims:
                for d in cluster.models[v].placement:
                    if d in gone_busy:
                        gone_busy[d] += self._busy(cluster.models[v])
            by_name = {load.device: load for load in loads}
            # the whole device counts, ``m`` included, on both sides: the move must halve the
            # contention ``m`` steps under without making its new neighbours' worse than that
            after = max(max(0.0, by_name[d].busy - gone_busy[d]) for d in devices) + self._busy(m)
            if contention(after) * MISPLACED_FACTOR > contention(neighbours_busy(cluster, m) + self._busy(m)):
                continue
            # nor may it overload an engine already there (a light model beside one near its limit
            # slows that one more than the move saves; placement.overloads)
            if move_overloads(cluster, m, devices, set(victims) | gone, self._busy):
                continue
            plan.evict(victims)
            plan_load(loads, moved, devices, self._busy(moved))
            planned[free.model] = devices
            return [free]
        return []

    def _prewarm(self, plan: _TickPlan) -> list[ModelSnapshot]:
        """Evicted models the forecast expects a request for within ``prewarm_horizon_s``, then those
        with no forecast yet (``_prewarm_rank``), activated (and added to ``planned``) in that order
        where they fit in memory that stays below the watermark without evicting anything; those
        with no forecast and no expected rate are chosen in that order and placed largest first
        (``fill_largest_first``); those with an expected rate (``ModelSnapshot.expected_rate``) go
        by pressure in rate order, their rates being known. Their memory yields first
        (eviction.is_idle)."""
        k = self.knobs
        cluster, planned = plan.cluster, plan.planned
        extra = cluster.extra_replicas
        ranked = sorted(
            (rank, m)
            for m in cluster.models.values()
            if m.replica_of is None
            and not m.resident
            and m.model not in planned
            and (rank := self._prewarm_rank(m)) is not None
            # a served model with a replica planned is warm already
            and not (m.model in extra and any(n in planned for n in extra[m.model]))
        )
        candidates = [m for _, m in ranked]
        if not candidates:
            return []
        loads = plan.loads()
        # memory each device can still give without crossing the watermark: what is mapped now, plus
        # the weights this tick moves or loads there (evictions are not credited: they may not be done)
        room = room_now(cluster, planned, k.memory_watermark)
        expected, blind = [], []  # a rate known (forecast or expected_rate), or none
        for m in candidates:
            (blind if m.forecast_rate is None and m.expected_rate is None else expected).append(m)
        if not (k.fill_largest_first and len(blind) > 1):
            return self._place_prewarm(candidates, loads, room, planned)
        out = self._place_prewarm(expected, loads, room, planned)
        # the startup fill: which models, smallest first (as many as fit; a trial on copies), then
        # where, largest first, each on the devices with the most room (worst-fit decreasing): with
        # no rate known, weights are the only hint of compute, and placing the big ones first spreads
        # them (smallest first left the largest for whichever device the small ones had left
        # emptiest, next to them). Not by pressure: right after start one request makes a rate of
        # 1/s, and every model with none would pile up away from the device that served it
        trial = [replace(load) for load in loads]
        chosen = self._place_prewarm(blind, trial, dict(room), dict(planned))
        chosen.sort(key=lambda m: (-m.part_weight_bytes * m.tp_size, m.model))
        return out + self._place_prewarm(chosen, loads, room, planned, by_room=True)

    def _place_prewarm(
        self,
        models: list[ModelSnapshot],
        loads: list[DeviceLoad],
        room: dict[str, float],
        planned: dict[str, tuple[str, ...]],
        by_room: bool = False,
    ) -> list[ModelSnapshot]:
        """Activate ``models`` in this order, each by ``choose_activation`` among the devices whose
        ``room`` holds it (``by_room``: on the devices with the most room, worst fit), evicting
        nothing; the plan (``loads``, ``room``, ``planned``) takes each in."""
        out = []
        most = max(room.values(), default=0.0)  # no device has room for a model heavier than this
        # per TP size, the lightest model that found no devices since the plan last changed: every
        # test below only gets harder with more weight (no evictions here), so one as heavy or
        # heavier finds none either, and is passed over without asking (at thousands of evicted
        # models, most of a tick was asking)
        failed: dict[int, int] = {}
        for m in models:
            if m.part_weight_bytes > most or m.part_weight_bytes >= failed.get(m.tp_size, most + 1):
                continue  # as no open device below: nowhere to go
            open_loads = [
                DeviceLoad(load.device, load.capacity_bytes, load.min_kv_bytes, load.weighted_rate,
                           load.shared_kv, [], load.busy)
                for load in loads
                if room[load.device] >= m.part_weight_bytes
            ]  # fmt: skip
            if by_room:
                group = None
                if len(open_loads) >= m.tp_size:
                    ranked = sorted(open_loads, key=lambda load: -room[load.device])
                    group = on_one_node(ranked, m.tp_size, lambda load: load.device)  # not across nodes
                devices = tuple(load.device for load in group) if group is not None else None
            else:
                choice = choose_activation(m, open_loads)
                devices = choice[0] if choice is not None else None
            if devices is None:
                failed[m.tp_size] = min(m.part_weight_bytes, failed.get(m.tp_size, m.part_weight_bytes))
                continue
            failed.clear()
            for d in devices:
                room[d] -= m.part_weight_bytes
            most = max(room.values())
            plan_load(loads, m, devices, self._busy(m))
            planned[m.model] = devices
            out.append(m)
        return out
