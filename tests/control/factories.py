"""Small builders for control-plane tests: consistent snapshots without boilerplate."""

from __future__ import annotations

from prism_serve.control import (
    ClusterSnapshot,
    DeviceSnapshot,
    EngineSnapshot,
    ModelSnapshot,
    ModelState,
    Request,
)

GIB = 1 << 30


def model(
    name: str,
    *,
    rate: float = 1.0,
    ttft: float = 1.0,
    tpot: float = 0.05,
    weight_gib: float = 10.0,
    kvpt: int = 128 * 1024,
    tp: int = 1,
    on: tuple[str, ...] = (),
    state: ModelState | None = None,
    last: float | None = 0.0,
    queued: int = 0,
    running: int = 0,
    pinned: bool = False,
) -> ModelSnapshot:
    if state is None:
        state = ModelState.ACTIVE if on else ModelState.EVICTED
    return ModelSnapshot(
        name,
        rate,
        ttft,
        tpot,
        int(weight_gib * GIB),
        kvpt,
        tp,
        tuple(on),
        state,
        last,
        queued,
        running,
        pinned,
    )


def cluster(
    models: list[ModelSnapshot],
    devices: dict[str, float],
    *,
    mapped: dict[str, float] | None = None,
    engines: list[EngineSnapshot] = (),
    queued: dict[str, tuple[str, ...]] | None = None,
) -> ClusterSnapshot:
    """``devices`` maps name -> capacity in GiB; device model lists come from the placements.

    ``mapped`` (GiB) defaults to the resident weights on each device.
    """
    on: dict[str, list[str]] = {d: [] for d in devices}
    weights: dict[str, int] = dict.fromkeys(devices, 0)
    for m in models:
        for d in m.placement:
            on[d].append(m.model)
            weights[d] += m.part_weight_bytes
    queued = queued or {}
    devs = [
        DeviceSnapshot(
            d,
            int(cap * GIB),
            int(mapped[d] * GIB) if mapped and d in mapped else weights[d],
            tuple(on[d]),
            len(queued.get(d, ())),
            tuple(queued.get(d, ())),
        )
        for d, cap in devices.items()
    ]
    return ClusterSnapshot.build(models, devs, engines)


def request(
    req_id: str, model: str = "a", *, arrival: float = 0.0, tokens: int = 100, slo: float = 1.0
) -> Request:
    return Request(req_id, model, arrival, tokens, slo)


def engine(
    model: str,
    device: str = "d0",
    *,
    free_gib: float = 0.0,
    used_gib: float = 0.0,
    quota_gib: float | None = None,
    kvpt: int = 1024,
    ready: bool = True,
    running: int = 0,
    max_seqs: int | None = None,
    speed: float | None = None,
    max_kv: int | None = None,
) -> EngineSnapshot:
    return EngineSnapshot(
        model,
        device,
        kvpt,
        ready,
        int(free_gib * GIB),
        int(used_gib * GIB),
        None if quota_gib is None else int(quota_gib * GIB),
        max_kv,
        running,
        max_seqs,
        speed,
    )


def device(
    name: str = "d0", *, cap_gib: float = 80.0, mapped_gib: float = 0.0, models: tuple[str, ...] = ()
) -> DeviceSnapshot:
    return DeviceSnapshot(name, int(cap_gib * GIB), int(mapped_gib * GIB), models)


def apply(c: ClusterSnapshot, actions, *, now: float | None = None) -> ClusterSnapshot:
    """What a runtime would do with placement actions, instantly: the next snapshot.

    Activated and migrated models become ACTIVE at once; mapped bytes become the resident weights.
    """
    from dataclasses import replace

    from prism_serve.control import Activate, Evict, Migrate

    models = dict(c.models)
    for a in actions:
        if isinstance(a, Activate):
            models[a.model] = replace(models[a.model], placement=a.devices, state=ModelState.ACTIVE)
        elif isinstance(a, Evict):
            models[a.model] = replace(models[a.model], placement=(), state=ModelState.EVICTED)
        elif isinstance(a, Migrate):
            models[a.model] = replace(models[a.model], placement=a.dst, state=ModelState.ACTIVE)
    on = {d: [m.model for m in models.values() if d in m.placement] for d in c.devices}
    devices = [
        replace(dev, models=tuple(on[d]), mapped_bytes=sum(models[m].part_weight_bytes for m in on[d]))
        for d, dev in c.devices.items()
    ]
    engines = [
        e for name, e in c.engines.items() if models[name].resident and models[name].placement[0] == e.device
    ]
    return ClusterSnapshot.build(models.values(), devices, engines)
