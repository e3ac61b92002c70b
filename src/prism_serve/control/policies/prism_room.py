"""Where prism finds memory for a model: which resident models may yield theirs beyond the idle
ones (replicas that yield to a model with no copy, quiet models), the free replica slot of a served
model, and the memory a device can give now (for prewarming and for second copies); a model taken
into or out of the plan's device loads, and the overload check of a move. Pure helpers over a
tick's plan (``planned``: model -> devices) for ``policies/prism.py``; ``busy`` is the busy
fraction the policy reads (0 when it does not weigh compute)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from prism_serve.control.eviction import DeviceLoad, eviction_key, is_idle
from prism_serve.control.placement import overloads, worst_load
from prism_serve.control.policies.base import min_kv_bytes
from prism_serve.control.types import ClusterSnapshot, ModelSnapshot, ModelState

__all__ = [
    "free_slot",
    "move_overloads",
    "plan_load",
    "plan_unload",
    "room_now",
    "with_quiet_models",
    "with_room_now",
    "with_spare_replicas",
]


def with_spare_replicas(
    replicas: list[ModelSnapshot], loads: list[DeviceLoad], gone: set[str]
) -> list[DeviceLoad]:
    """``loads`` (copies) whose evictable models end with ``replicas``, those that yield to a model
    with no copy resident (replicas.spare_replicas of the snapshot, which the caller computes once
    for all its calls on one snapshot), for choosing where such a model goes; the plan's own
    ``loads`` stay as they are."""
    spare: dict[str, list[ModelSnapshot]] = {}
    for r in replicas:
        if r.model not in gone:
            for d in r.placement:
                spare.setdefault(d, []).append(r)
    if not spare:
        return loads
    return [replace(load, idle=[*load.idle, *spare.get(load.device, ())]) for load in loads]


def with_quiet_models(
    cluster: ClusterSnapshot,
    loads: list[DeviceLoad],
    planned: dict[str, tuple[str, ...]],
    waiting: ModelSnapshot,
    now: float,
) -> list[DeviceLoad]:
    """``loads`` (copies) whose evictable models end with the *quiet* ones, for the evicted model
    ``waiting`` with requests queued: active, unpinned, with no keep-alive of their own, nothing
    queued or running, staying where they are this tick, and asked for less often than ``waiting``
    (lower rate), lowest rate first (then longest without a request). Without them such a model
    waits until enough models turn idle (tens of seconds at the idle threshold, every request of it
    missing its SLO meanwhile), while a quiet model costs at most its next request's activation."""
    extra: dict[str, list[ModelSnapshot]] = {}
    quiet = sorted(
        (
            m
            for name, where in planned.items()
            if (m := cluster.models[name]).state is ModelState.ACTIVE
            and where == m.placement
            and not (m.pinned or m.num_queued or m.num_running or m.keep_alive_s is not None)
            and m.rate < waiting.rate
        ),
        key=lambda m: (m.rate, -m.idle_for(now), m.model),
    )
    for m in quiet:
        for d in m.placement:
            extra.setdefault(d, []).append(m)
    if not extra:
        return loads
    return [
        replace(load, idle=[*load.idle, *(m for m in extra.get(load.device, ()) if m not in load.idle)])
        for load in loads
    ]


def free_slot(
    cluster: ClusterSnapshot, model: str, planned: dict[str, tuple[str, ...]]
) -> ModelSnapshot | None:
    """A replica slot of the served ``model`` that is evicted and not in this tick's plan."""
    return next(
        (
            cluster.models[s]
            for s in cluster.replicas(model)
            if not cluster.models[s].resident and s not in planned
        ),
        None,
    )


def room_now(
    cluster: ClusterSnapshot, planned: dict[str, tuple[str, ...]], fraction: float
) -> dict[str, float]:
    """Bytes each device can still map below ``fraction`` of its capacity: what is mapped now (KV
    and claims included) and the weights this tick's plan moves or loads there are taken; evictions
    are not credited (they may not be done)."""
    room = {d: fraction * dev.capacity_bytes - dev.mapped_bytes for d, dev in cluster.devices.items()}
    for name, devices in planned.items():
        m = cluster.models[name]
        for d in devices:
            if d not in m.placement:
                room[d] -= m.part_weight_bytes
    return room


def with_room_now(
    cluster: ClusterSnapshot,
    loads: list[DeviceLoad],
    planned: dict[str, tuple[str, ...]],
    m: ModelSnapshot,
    room: dict[str, float] | None = None,
) -> list[DeviceLoad]:
    """The ``loads`` where a second copy ``m`` fits now: in memory not mapped (:func:`room_now`)
    plus the weights of the idle models there. Feasibility elsewhere counts weights only, since an
    activation waits for busy engines' KV to drain; but while it waits its claim counts as mapped,
    so admission on that device stops, and the busy engines there serve minutes of long decodes.
    A first copy (a model with requests waiting and none resident) must take that wait; an extra
    one is not worth it. ``room``: ``room_now(cluster, planned, 1.0)`` if the caller has it."""
    if room is None:
        room = room_now(cluster, planned, 1.0)
    return [
        load
        for load in loads
        if room[load.device] + sum(v.part_weight_bytes for v in load.idle) >= m.part_weight_bytes
    ]


def planned_loads(
    cluster: ClusterSnapshot,
    result,
    planned: dict[str, tuple[str, ...]],
    now: float,
    idle_threshold_s: float,
    min_kv_fraction: float,
) -> list[DeviceLoad]:
    """Per-device loads of Algorithm 1's ``result`` (its weighted rates, KV room and busy
    fractions), with the idle models of the plan ``planned`` on each device in eviction order."""
    loads = [
        DeviceLoad(d, dev.capacity_bytes, min_kv_bytes(dev, min_kv_fraction), w, s, busy=u)
        for (d, dev), w, s, u in zip(
            cluster.devices.items(), result.weighted_rate, result.shared_kv, result.busy, strict=True
        )
    ]
    by_name = {load.device: load for load in loads}
    for name, devices in planned.items():
        m = cluster.models[name]
        if is_idle(m, now, idle_threshold_s):
            for d in devices:
                by_name[d].idle.append(m)
    for load in loads:
        load.idle.sort(key=lambda m: eviction_key(m, now))
    return loads


def plan_load(loads: list[DeviceLoad], m: ModelSnapshot, devices: tuple[str, ...], busy: float) -> None:
    """``m`` (busy ``busy``) placed on ``devices`` in the plan's ``loads``."""
    for load in loads:
        if load.device in devices:
            load.weighted_rate += m.demand / m.tp_size
            load.busy += busy
            load.shared_kv -= m.part_weight_bytes


def plan_unload(loads: list[DeviceLoad], m: ModelSnapshot, devices: tuple[str, ...], busy: float) -> None:
    """``m`` (busy ``busy``) taken off ``devices`` in the plan's ``loads``, and out of every idle list."""
    for load in loads:
        if load.device in devices:
            load.weighted_rate = max(0.0, load.weighted_rate - m.demand / m.tp_size)
            load.busy = max(0.0, load.busy - busy)
            load.shared_kv += m.part_weight_bytes
        if m in load.idle:
            load.idle.remove(m)


def move_overloads(
    cluster: ClusterSnapshot,
    m: ModelSnapshot,
    devices: tuple[str, ...],
    leaving: set[str],
    busy: Callable[[ModelSnapshot], float],
) -> bool:
    """Whether moving ``m`` from its devices onto ``devices`` overloads an engine there
    (``placement.overloads``, each destination against ``m``'s most loaded device), the models in
    ``leaving`` gone from both sides."""

    def busies(d: str) -> list[float]:
        return [busy(cluster.models[n]) for n in cluster.devices[d].models if n not in leaving]

    source = max((busies(d) for d in m.placement), key=worst_load)
    return any(overloads(source, busies(d), busy(m)) for d in devices)
