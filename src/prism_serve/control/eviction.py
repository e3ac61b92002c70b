"""Idle-model eviction and on-demand activation (paper section 6.2, "Model eviction and activation").

- A model is *idle* when it has no queued or running request and its last request is older than the
  idle threshold, or when it is *prewarmed* (resident, no request since it was placed): prewarmed
  memory yields first. Pinned models and models still activating are never idle.
- Idle models are evicted only while a device is *constrained*: mapped memory at or above
  ``watermark * capacity``. Candidates go prewarmed first, then larger TTFT SLO first (then larger
  TPOT SLO, then longest idle, then name), because a relaxed-SLO model tolerates the reactivation
  delay best.
- An evicted model that gets a request is activated on the device(s) with the lowest effective KVPR
  (``placement.pressure``: KVPR stretched by the device's compute contention) that can hold its
  weights while leaving ``min_kv`` for KV. Devices that can hold it as they are always win over
  devices that would first need idle models evicted ("evicting idle models there if needed"); among
  the latter the pressure after those evictions decides, then the fewest evictions.

Feasibility counts weights only: KV pages of busy models are transient and the memory layer makes
an activation wait for them to drain, whereas weights stay until evicted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prism_serve.control.placement import on_one_node, pressure
from prism_serve.control.types import ClusterSnapshot, ModelSnapshot, ModelState

__all__ = [
    "DeviceLoad",
    "best_move_through_idle",
    "choose_activation",
    "constrained_evictions",
    "device_loads",
    "eviction_key",
    "is_idle",
    "keep_alive_expired",
    "never_fits",
]


def _yields_first(m: ModelSnapshot) -> bool:
    """Prewarmed memory yields first. (A replica added for its served model's load is never
    prewarmed: control/loop.py.)"""
    return m.prewarmed


def eviction_key(m: ModelSnapshot, now: float) -> tuple:
    return (not _yields_first(m), -m.ttft_slo, -m.tpot_slo, -m.idle_for(now), m.model)


def is_idle(m: ModelSnapshot, now: float, idle_threshold_s: float) -> bool:
    """Evictable: active, not pinned, and idle for longer than the threshold (the model's own
    ``keep_alive_s`` where it has one; negative: never), or prewarmed and still without a request
    (prewarmed memory yields to real demand first)."""
    if m.state is not ModelState.ACTIVE or m.pinned:
        return False
    threshold = idle_threshold_s if m.keep_alive_s is None else m.keep_alive_s
    if threshold < 0:
        return False
    if _yields_first(m) and not (m.num_queued or m.num_running):
        return True
    return m.idle_for(now) > threshold


def keep_alive_expired(cluster: ClusterSnapshot, now: float) -> list[str]:
    """Models idle for longer than their own ``keep_alive_s``: evicted at the tick, under any
    policy and without memory pressure (Ollama's and llama-swap's per-model ttl)."""
    return [
        m.model
        for m in cluster.models.values()
        if m.keep_alive_s is not None
        and m.keep_alive_s >= 0
        and m.state is ModelState.ACTIVE
        and not m.pinned
        and m.idle_for(now) > m.keep_alive_s
    ]


def constrained_evictions(
    cluster: ClusterSnapshot, now: float, idle_threshold_s: float, watermark: float
) -> list[str]:
    """Idle models to evict because a device they are on is at or above the memory watermark.

    Walks idle models in eviction order and evicts one while any of its devices is still
    constrained, crediting back its weights (and, on its engine's device, the KV its engine holds).
    """
    projected = {d: dev.mapped_bytes for d, dev in cluster.devices.items()}
    limit = {d: watermark * dev.capacity_bytes for d, dev in cluster.devices.items()}
    constrained = [d for d in projected if projected[d] >= limit[d]]
    if not constrained:
        return []  # no device is constrained (evictions only lower what is projected)
    # only a model on a constrained device can be evicted: the others' devices stay below the
    # watermark, as evictions only lower what is projected (names are unique, so the order below,
    # which ends in the name, is the order of all the idle models with those left out)
    models = cluster.models
    on = {n: None for d in constrained for n in cluster.devices[d].models}
    idle = sorted(
        (m for n in on if is_idle(m := models[n], now, idle_threshold_s)),
        key=lambda m: eviction_key(m, now),
    )
    evicted = []
    for m in idle:
        if not any(projected[d] >= limit[d] for d in m.placement):
            continue
        evicted.append(m.model)
        engine = cluster.engines.get(m.model)
        for d in m.placement:
            projected[d] -= m.part_weight_bytes
        if engine is not None:
            projected[engine.device] -= engine.free_kv_bytes + engine.used_kv_bytes
    return evicted


@dataclass(slots=True)
class DeviceLoad:
    """A device as activation sees it: Algorithm 1's state plus who could be evicted from it."""

    device: str
    capacity_bytes: int
    min_kv_bytes: int
    weighted_rate: float = 0.0
    shared_kv: float = 0.0
    idle: list[ModelSnapshot] = field(default_factory=list)  # evictable residents, eviction order
    busy: float = 0.0  # summed predicted busy fraction of its models (0 when compute is not weighed)


def device_loads(
    cluster: ClusterSnapshot,
    now: float,
    idle_threshold_s: float,
    min_kv_fraction: float,
    skip: Iterable[str] = (),
    *,
    compute: bool = True,
) -> list[DeviceLoad]:
    """Per-device KVPR state of the resident models, leaving out the models in ``skip``
    (``compute``: also their summed busy fractions)."""
    skipped = set(skip)
    loads = {
        d: DeviceLoad(
            d,
            dev.capacity_bytes,
            math.ceil(min_kv_fraction * dev.capacity_bytes),
            shared_kv=float(dev.capacity_bytes),
        )
        for d, dev in cluster.devices.items()
    }
    for m in cluster.models.values():
        if not m.resident or m.model in skipped:
            continue
        idle = is_idle(m, now, idle_threshold_s)
        for d in m.placement:
            load = loads[d]
            load.weighted_rate += m.demand / m.tp_size
            load.shared_kv -= m.part_weight_bytes
            if compute:
                load.busy += m.busy
            if idle:
                load.idle.append(m)
    for load in loads.values():
        load.idle.sort(key=lambda m: eviction_key(m, now))
    return list(loads.values())


def never_fits(model: ModelSnapshot, cluster: ClusterSnapshot, min_kv_fraction: float) -> bool:
    """True when no set of devices could hold the model even with everything else evicted (the
    ranks of a TP model on one node)."""
    roomy = [
        name
        for name, dev in cluster.devices.items()
        if dev.capacity_bytes - model.part_weight_bytes >= math.ceil(min_kv_fraction * dev.capacity_bytes)
    ]
    return len(roomy) < model.tp_size or on_one_node(roomy, model.tp_size, str) is None


def choose_activation(
    model: ModelSnapshot, loads: list[DeviceLoad]
) -> tuple[tuple[str, ...], list[str]] | None:
    """Devices (rank order) to activate ``model`` on, and the idle models to evict first.

    Returns None when no ``tp_size`` distinct devices can hold it, even after evicting idle models.
    """
    options = []
    for idx, load in enumerate(loads):
        room = _room_after_evictions(load, model)
        if room is None:
            continue
        rate, shared, busy, evict = room
        options.append(
            ((bool(evict), pressure(rate, shared, busy), busy, len(evict), -shared, idx), load.device, evict)
        )
    if len(options) < model.tp_size:
        return None
    options.sort(key=lambda o: o[0])
    chosen = options[:1] if model.tp_size == 1 else on_one_node(options, model.tp_size, lambda o: o[1])
    if chosen is None:  # no node has tp_size devices for it: TP groups never span nodes
        return None
    evictions: list[str] = []
    for _, _, evict in chosen:
        evictions.extend(v for v in evict if v not in evictions)
    return tuple(device for _, device, _ in chosen), evictions


def best_move_through_idle(
    model: ModelSnapshot, loads: list[DeviceLoad], bound: float
) -> tuple[str, list[str]] | None:
    """The device (other than the ones ``model`` is on) where ``model``'s weights fit only once idle
    models there are evicted, and whose pressure with ``model`` on it after those evictions is lowest
    and below ``bound``; with the idle models to evict. None if there is none. (A single-device model;
    devices where it fits as they are are Algorithm 1's to choose, not this.)"""
    best: tuple[float, int, str, list[str]] | None = None
    for idx, load in enumerate(loads):
        if load.device in model.placement:
            continue
        room = _room_after_evictions(load, model)
        if room is None or not room[3]:
            continue  # no room even then, or room without evicting anything (Algorithm 1's case)
        rate, shared, busy, evict = room
        after = pressure(rate + model.demand, shared - model.part_weight_bytes, busy + model.busy)
        if after < bound and (best is None or (after, idx) < best[:2]):
            best = (after, idx, load.device, evict)
    return None if best is None else (best[2], best[3])


def _room_after_evictions(
    load: DeviceLoad, model: ModelSnapshot
) -> tuple[float, float, float, list[str]] | None:
    """``load``'s SLO-weighted rate, KV room and busy fraction once enough of its idle models (in
    eviction order, never ``model`` itself) are evicted for ``model``'s weights to leave
    ``min_kv_bytes``, with those models; None if evicting all of them is not enough."""
    w = model.part_weight_bytes
    rate, shared, busy = load.weighted_rate, load.shared_kv, load.busy
    evict: list[str] = []
    if shared - w >= load.min_kv_bytes:
        return rate, shared, busy, evict
    for victim in load.idle:
        if victim.model == model.model:
            continue
        evict.append(victim.model)
        rate = max(0.0, rate - victim.demand / victim.tp_size)
        busy = max(0.0, busy - victim.busy)
        shared += victim.part_weight_bytes
        if shared - w >= load.min_kv_bytes:
            return rate, shared, busy, evict
    return None
