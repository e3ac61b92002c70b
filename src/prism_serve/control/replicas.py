"""Replicas of hot models: how many each served model needs, and which replica a request goes to.

A served model may run as several *replicas*: data-parallel engines on different devices, each
with its own KV cache, all loaded from the one host copy of the model's weights. The control plane
sees each replica as a model of its own (``ModelSnapshot.replica_of`` names the served model;
:func:`~prism_serve.control.types.replica_name` names the slots), so placement, eviction, admission
and both bodies treat replicas exactly like models. The body creates the slots up front
(``Policy.replica_slots``); a slot is EVICTED until a policy activates it.

Demand against capacity. A served model's demand is the sum of its replicas' request rates (each
replica's rate is what the router sent it), and one replica serves at most ``max_rate`` requests/s
within the model's SLOs (``ModelProfile.max_rate``: the simulator's cost model, or live the
requests served per second of engine stepping times the batching its TPOT SLO leaves room for,
``profiles.measured_profile``). The model wants::

    wanted = ceil(rate / (high * max_rate))      clamped to [1, slots]

replicas: scale up while fewer are resident, one per placement tick. It has a *surplus* replica
when one fewer would still run below ``low`` utilization (``rate < low * max_rate * (n - 1)``):
the router stops sending the surplus replica requests and the policy evicts it once it has none.
``low`` < ``high`` is the hysteresis that keeps the count from flapping with rate noise.

Bursts. The rate is a 60 s average, and a burst (hundreds of requests within seconds, as in the
Azure code trace) is over before it moves the average. So a model is also *backlogged* when every
active replica's predicted TTFT (below) already exceeds the model's TTFT SLO with requests of it
waiting (in a device queue or in its engine's waiting queue): a new request would miss wherever it
went. A backlogged model wants one replica more than it has (one per tick; the capacity need not
be known, but without it no replica is ever surplus), and has no surplus while any of its
replicas still predicts a TTFT above half the SLO: the replica added for a burst starts empty and
is not drained while the others still work the burst off.

Replicas yield to models with no copy. While a model waits with no resident copy because no
device has room (``ClusterSnapshot.starved``), a second copy of another model is worth less than
its first: each replicated model's highest resident slot drains (the router sends it nothing, as a
surplus) and, once it has nothing queued or running, its memory counts as evictable for the waiting
model after the idle models (:func:`spare_replicas`). Replica scaling takes only idle models'
memory, so the replica comes back only once the model it made room for is idle again.

Moving a busy model. The replica that yields (to surplus, or to a model with no copy) is the
*misplaced* one if there is one: an active replica whose neighbours slow it at least
``MISPLACED_FACTOR`` times as much as another active replica's (:func:`misplaced`); else the
highest slot. prism moves a busy model (one that is never idle, so Algorithm 1 leaves it where it
is) by activating a replica on less contended devices: once it is active, the old replica is
misplaced and drains.

Routing. A request goes to the resident replica with the lowest predicted TTFT (:func:`predicted_ttft`):
requests queued ahead of it on that replica's device and its own prefill, one decode step of the
replica's running batch, all stretched by the device's compute contention; a replica still
activating comes after every active one. Ties go to the lower slot, so traffic concentrates on
replica 0 and a surplus replica drains. With no replica resident the request goes to replica 0,
whose activation the policy decides as for any evicted model.

Prefix-aware routing (a request with prefix keys, under a policy that is ``prefix_aware``: the
control loop hands :func:`pick_replica` the prompt tokens each replica probably holds cached, from
its prefix index, prefix_index.py). Its own prefill in each replica's prediction is then only the
tokens not cached there. The request goes to the active replica holding the longest cached prefix
of its prompt (ties by predicted TTFT, then the lower slot), unless that replica's predicted TTFT
would miss the request's deadline while another replica's would meet it; then, and when no replica
holds any of it, the rule above decides. As vLLM's production-stack router and llm-d's prefix
scorer do: a hit saves the prefill of everything it covers, and the requests of one conversation
or one system prompt keep finding their prefix where they went before, instead of every replica
computing it. The surplus and draining replicas are left out as above, whatever they hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from prism_serve.control.placement import contention
from prism_serve.control.types import ClusterSnapshot, ModelSnapshot, ModelState, Request

__all__ = [
    "active_replicas",
    "backlogged",
    "device_busy",
    "group_rate",
    "misplaced",
    "neighbours_busy",
    "pick_replica",
    "predicted_ttft",
    "replica_capacity",
    "replicas_for_rate",
    "resident_replicas",
    "settled",
    "spare_replicas",
    "surplus",
    "wanted_replicas",
    "yielding_replica",
]

_TYPICAL_BATCH = 16  # ModelProfile.decode_step_s is one step at about this many running requests
_UNSET = object()  # not derived yet (a derived value may be None)
# a replica whose neighbours slow it this many times as much as another replica's is misplaced
MISPLACED_FACTOR = 2.0


def _derived(cluster: ClusterSnapshot, kind: str, name: str, compute):
    """``compute(cluster, name)``, once per snapshot (``ClusterSnapshot.derived``): a policy call
    asks the same of a served model or a device many times (every model's replicas at a tick)."""
    key = (kind, name)
    value = cluster.derived.get(key, _UNSET)
    if value is _UNSET:
        value = cluster.derived[key] = compute(cluster, name)
    return value


class _Group:
    """A served model's replicas in one snapshot: those resident and those active (slot order),
    the mean known ``max_rate`` (:func:`replica_capacity`) and the summed rate; a function of the
    replicas' snapshot entries alone (``snaps``)."""

    __slots__ = ("active", "capacity", "rate", "resident", "snaps")

    def __init__(self, snaps: tuple[ModelSnapshot, ...]) -> None:
        self.snaps = snaps
        self.resident = tuple(m for m in snaps if m.state is not ModelState.EVICTED)
        self.active = tuple(m for m in self.resident if m.state is ModelState.ACTIVE)
        self.rate = sum(m.rate for m in snaps)
        self.capacity = _capacity(self.resident, snaps)


def _capacity(resident: Sequence[ModelSnapshot], snaps: Sequence[ModelSnapshot]) -> float | None:
    """The mean known ``max_rate`` of the resident replicas, else of every replica (None: none knows)."""
    for pool in (resident, snaps):
        known = [m.profile.max_rate for m in pool if m.profile.max_rate is not None]
        if known:
            return sum(known) / len(known)
    return None


def _group(cluster: ClusterSnapshot, model: str) -> _Group:
    # _derived inlined: a placement at hundreds of models asks for groups millions of times
    key = ("group", model)
    group = cluster.derived.get(key)
    if group is None:
        group = cluster.derived[key] = _new_group(cluster, model)
    return group


def _new_group(cluster: ClusterSnapshot, model: str) -> _Group:
    """``model``'s group in ``cluster``: the one an earlier snapshot of the chain made
    (``ClusterSnapshot.carried``) when it was made of these very replica entries, else a new one.
    Between two placements most served models' entries do not change, and at hundreds of models
    building every group again was most of a placement's replica scaling."""
    models = cluster.models
    names = cluster.replicas(model)
    key = ("group", model)
    group = cluster.carried.get(key)
    if group is not None:
        snaps = group.snaps
        if len(snaps) == len(names) and all(models[n] is m for n, m in zip(names, snaps, strict=True)):
            return group
    group = cluster.carried[key] = _Group(tuple(models[n] for n in names))
    return group


def group_rate(cluster: ClusterSnapshot, model: str) -> float:
    """Requests/s of the served model ``model`` over all its replicas."""
    return _group(cluster, model).rate


def replica_capacity(cluster: ClusterSnapshot, model: str) -> float | None:
    """Requests/s one replica of ``model`` serves within its SLOs: the mean ``max_rate`` of its
    resident replicas that know it, else of any replica; None when no replica knows it."""
    return _group(cluster, model).capacity


def resident_replicas(cluster: ClusterSnapshot, model: str) -> list[ModelSnapshot]:
    return list(_group(cluster, model).resident)


def active_replicas(cluster: ClusterSnapshot, model: str) -> tuple[ModelSnapshot, ...]:
    """``model``'s replicas that are active (resident and done activating), in slot order."""
    return _group(cluster, model).active


def yielding_replica(cluster: ClusterSnapshot, model: str) -> ModelSnapshot | None:
    """The replica ``model`` would give up first: a :func:`misplaced` one, else its highest resident
    slot, if it has two or more resident and that is not its last active one."""
    return _last_to_go(cluster, _group(cluster, model).resident)


def neighbours_busy(cluster: ClusterSnapshot, m: ModelSnapshot) -> float:
    """The summed predicted busy fraction of the other models on ``m``'s busiest device: the compute
    ``m``'s steps share (a TP model steps at the pace of its slowest rank)."""
    return max(device_busy(cluster, d) - m.busy for d in m.placement)


def misplaced(cluster: ClusterSnapshot, model: str, factor: float) -> ModelSnapshot | None:
    """The active replica of ``model`` whose neighbours slow it at least ``factor`` times as much as
    another active replica's slow that one (``contention`` of :func:`neighbours_busy`), the most
    slowed first; None if there is none. A replica added to move a busy model off contended devices
    (policies/prism.py, make-before-break) makes the old one misplaced, so it drains rather than
    the new one."""
    active = active_replicas(cluster, model)
    if len(active) < 2:
        return None
    slowed = sorted(
        ((contention(neighbours_busy(cluster, m)), i, m) for i, m in enumerate(active)), key=lambda t: t[:2]
    )
    best, worst = slowed[0][0], slowed[-1]
    return worst[2] if worst[0] >= factor * best else None


def _last_to_go(cluster: ClusterSnapshot, resident: Sequence[ModelSnapshot]) -> ModelSnapshot | None:
    if len(resident) < 2:
        return None
    moved = misplaced(cluster, resident[0].group, MISPLACED_FACTOR)
    if moved is not None:
        return moved
    last = resident[-1]
    if last.state is ModelState.ACTIVE and not any(m.state is ModelState.ACTIVE for m in resident[:-1]):
        return None
    return last


def surplus(cluster: ClusterSnapshot, model: str, low: float) -> ModelSnapshot | None:
    """The replica ``model`` can give up (:func:`yielding_replica`), if one fewer would still run
    below ``low`` utilization (while the capacity is unknown: if it is :func:`misplaced`, the end of
    a move) and no replica of it predicts a TTFT above half its SLO with requests waiting (it is
    still working a burst off)."""
    group = _group(cluster, model)
    resident = group.resident
    last = _last_to_go(cluster, resident)
    if last is None:
        return None
    capacity = group.capacity
    if capacity is None:
        # nothing says how many replicas the rate needs: only a move (a misplaced replica) gives one up
        if last is not misplaced(cluster, model, MISPLACED_FACTOR):
            return None
    elif group.rate >= low * capacity * (len(resident) - 1):
        return None
    if _backlog(cluster, group, slack=0.5, every=False):
        return None
    return last


def backlogged(cluster: ClusterSnapshot, model: str) -> bool:
    """Whether a new request of the served ``model`` would wait past its TTFT SLO on every active
    replica (:func:`predicted_ttft`), with requests of it waiting: a burst that its replicas cannot
    absorb, whatever its average rate says. False without an active replica, and while no active
    replica's costs are known (the default profile): the prediction would be the defaults', not
    the model's. Live, that is a model's first requests, which queue behind its own activation and
    its neighbours' (a copy of SmolLM2-135M made then sat beside SmolLM2-360M for the first 100 s
    of the decode-heavy sweep's x5, 96.0% TTFT)."""
    return _backlogged(cluster, _group(cluster, model))


def _backlogged(cluster: ClusterSnapshot, group: _Group) -> bool:
    known = (m.profile for m in group.active)
    if not any(p.busy_s_per_request is not None or p.max_rate is not None for p in known):
        return False
    return _backlog(cluster, group, slack=1.0, every=True)


def _backlog(cluster: ClusterSnapshot, group: _Group, slack: float, every: bool) -> bool:
    """Whether requests of the group's served model wait (in a device queue or an engine's waiting
    queue) and every (``every``) or any active replica's predicted TTFT exceeds ``slack`` x the TTFT
    SLO."""
    active = group.active
    if not active or not _waiting(cluster, group):
        return False
    limit = slack * active[0].ttft_slo
    late = (predicted_ttft(m, cluster) > limit for m in active)
    return all(late) if every else any(late)


def spare_replicas(cluster: ClusterSnapshot) -> list[ModelSnapshot]:
    """Replicas a model with no resident copy may have evicted for its memory (after the idle
    models): each replicated model's :func:`yielding_replica`, once active with nothing queued or
    running and not pinned."""
    out = []
    models = cluster.models
    evicted = ModelState.EVICTED
    for model, extra in cluster.extra_replicas.items():
        # most served models have one copy resident, and a model yields none below two
        # (yielding_replica): counted here without building the list, a scan of every model per call
        if (models[model].state is not evicted) + sum(models[n].state is not evicted for n in extra) < 2:
            continue
        r = yielding_replica(cluster, model)
        if r is not None and r.state is ModelState.ACTIVE and not (r.num_queued or r.num_running or r.pinned):
            out.append(r)
    return out


def _device_busy(cluster: ClusterSnapshot, device: str) -> float:
    return sum(cluster.models[n].busy for n in cluster.devices[device].models)


def device_busy(cluster: ClusterSnapshot, device: str) -> float:
    """Summed predicted busy fraction of the models on ``device``."""
    return _derived(cluster, "device_busy", device, _device_busy)


def predicted_ttft(m: ModelSnapshot, cluster: ClusterSnapshot, prefill_tokens: float | None = None) -> float:
    """Seconds until a new request of replica ``m`` would get its first token, roughly: the queue
    ahead of it on ``m``'s device, the requests its engine holds but has not started, and its own
    prefill (``prefill_tokens``, else the model's mean prompt), plus one decode step of ``m``'s
    running batch, stretched by the device's compute contention."""
    p = m.profile
    device = cluster.devices[m.placement[0]]
    engine = cluster.engines.get(m.model)
    ahead = device.num_queued + (engine.num_waiting if engine is not None else 0)
    prefill_s = p.mean_prompt_tokens / p.prefill_tokens_per_s
    if prefill_tokens is None:
        queue_s = (ahead + 1) * prefill_s
    else:
        queue_s = ahead * prefill_s + prefill_tokens / p.prefill_tokens_per_s
    step_s = p.decode_step_s * max(1.0, m.num_running / _TYPICAL_BATCH)
    return contention(device_busy(cluster, device.device)) * (queue_s + step_s)


def pick_replica(
    request: Request,
    cluster: ClusterSnapshot,
    draining: str | None = None,
    *,
    cached: Mapping[str, int] | None = None,
    now: float | None = None,
) -> Request:
    """``request`` addressed to the replica it should go to (see the module docstring); ``draining``
    is a replica that gets requests only if no other is resident. ``cached``: by replica, the prompt
    tokens it probably holds cached (prefix-aware routing; None or empty: not known); ``now``: when
    the request is routed, for what is left of its TTFT SLO (None: all of it). Unknown models pass
    unchanged."""
    m = cluster.models.get(request.model)
    if m is None:
        return request
    model = m.group
    if len(cluster.replicas(model)) == 1:
        return _to(request, model)
    candidates = [r for r in _group(cluster, model).resident if r.model != draining]
    if not candidates:
        return _to(request, draining or model)
    if len(candidates) == 1:  # the only choice, whatever the predictions (most requests, most models)
        return _to(request, candidates[0].model)
    if cached:
        return _to(request, _by_prefix(request, cluster, candidates, cached, now).model)
    best = min(
        enumerate(candidates),
        key=lambda ir: (ir[1].state is not ModelState.ACTIVE, predicted_ttft(ir[1], cluster), ir[0]),
    )[1]
    return _to(request, best.model)


def _by_prefix(
    request: Request,
    cluster: ClusterSnapshot,
    candidates: Sequence[ModelSnapshot],
    cached: Mapping[str, int],
    now: float | None,
) -> ModelSnapshot:
    """Prefix-aware routing among ``candidates`` (module docstring): each predicted with its own
    uncached prompt tokens; the active replica holding the longest cached prefix unless it would
    miss the deadline while the fastest would meet it, else the fastest."""
    active = ModelState.ACTIVE
    ranked = {
        r.model: (
            r.state is not active,
            predicted_ttft(r, cluster, request.prompt_tokens - cached.get(r.model, 0)),
            i,
        )
        for i, r in enumerate(candidates)
    }
    fastest = min(candidates, key=lambda r: ranked[r.model])
    longest = max(cached.get(r.model, 0) for r in candidates)
    if longest <= 0:
        return fastest
    holder = min((r for r in candidates if cached.get(r.model, 0) == longest), key=lambda r: ranked[r.model])
    if holder.state is not active and fastest.state is active:
        return fastest  # a replica still activating comes after every active one, as without prefixes
    budget = request.ttft_slo if now is None else request.deadline - now

    def meets(r: ModelSnapshot) -> bool:
        return r.state is active and ranked[r.model][1] <= budget

    return holder if meets(holder) or not meets(fastest) else fastest


def replicas_for_rate(cluster: ClusterSnapshot, model: str, high: float) -> int:
    """Replicas ``model``'s rate calls for at ``high`` utilization of one replica's capacity (1
    while the capacity is unknown)."""
    return _for_rate(_group(cluster, model), high)


def _for_rate(group: _Group, high: float) -> int:
    capacity = group.capacity
    return 1 if capacity is None else math.ceil(group.rate / (high * capacity))


def settled(cluster: ClusterSnapshot, model: str, high: float) -> bool:
    """Whether ``model`` has nothing to scale: one replica resident, a rate that one replica serves
    at ``high`` utilization (or no capacity known), and no request of it waiting in a device queue
    or an engine. Then :func:`wanted_replicas` is 1 (it can only be more with requests waiting) and
    there is no :func:`surplus` (it needs two resident), whatever the rest of the cluster holds.
    Most served models of a large deployment are so at every placement: asking this first spares
    them the full test (at 500 models it was a third of each placement), and the answer is read from
    the replicas' entries without building their group (:func:`_group`) where none is built yet.
    Only a resident replica has an engine (``ClusterSnapshot``), so only its engine is asked."""
    group = cluster.derived.get(("group", model))
    if group is not None:
        return len(group.resident) == 1 and _for_rate(group, high) <= 1 and not _waiting(cluster, group)
    models = cluster.models
    snaps = (model, *cluster.extra_replicas.get(model, ()))
    resident = None
    rate = 0.0  # summed in slot order, as the group sums it
    evicted = ModelState.EVICTED
    for name in snaps:
        m = models[name]
        if m.num_queued:
            return False
        if m.state is not evicted:
            if resident is not None:
                return False  # two resident
            resident = m
        rate += m.rate
    if resident is None:
        return False
    e = cluster.engines.get(resident.model)
    if e is not None and e.num_waiting:
        return False
    capacity = resident.profile.max_rate
    if capacity is None:
        capacity = _capacity((), [models[n] for n in snaps])
    return capacity is None or math.ceil(rate / (high * capacity)) <= 1


def _waiting(cluster: ClusterSnapshot, group: _Group) -> bool:
    """Whether a request of the group's served model waits in a device queue or an engine."""
    engines = cluster.engines
    return any(
        m.num_queued or ((e := engines.get(m.model)) is not None and e.num_waiting) for m in group.snaps
    )


def wanted_replicas(cluster: ClusterSnapshot, model: str, high: float, slots: int) -> int:
    """How many replicas ``model``'s demand calls for, in [1, slots]: by its rate against one
    replica's capacity (:func:`replicas_for_rate`), and one more than it has while it is
    :func:`backlogged`."""
    group = _group(cluster, model)
    need = _for_rate(group, high)
    if _backlogged(cluster, group):
        need = max(need, len(group.resident) + 1)
    return max(1, min(slots, need))


def _to(request: Request, model: str) -> Request:
    return request if request.model == model else replace(request, model=model)
