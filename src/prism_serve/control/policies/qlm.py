"""``qlm``: time sharing by swapping whole models (QLM, as the Prism paper's sections 2 and 7 run it).

Defining behaviour:
- A device holds one model at a time; serving another model means stopping the engine, evicting the
  loaded model and activating the next one (a swap).
- Requests form groups: consecutive requests of one model, at most ``max_group_size``. A device serves
  its groups first-in first-out (``GroupQueue``); the head group runs alone, as many of its requests at
  once as memory allows and without a reserve (QLM over-batches), and a swap waits until the loaded
  model's running requests drain.
- A model with no group queued and not loaded anywhere goes to the first device whose queue is empty,
  else to the device with the fewest queued requests, whatever model that device has loaded; this is
  the assignment Prism's section 7.5 blames for QLM's needless swaps.

Adaptation: a model runs in one place at a time, so a model's groups follow it to the device where it
is loaded or already has a group queued. Tensor-parallel models are not supported by this baseline
(their requests are rejected with ``NO_CAPACITY``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prism_serve.control.policies.base import (
    Knobs,
    Policy,
    min_kv_bytes,
    no_capacity,
    require,
    unknown_model,
)
from prism_serve.control.queues import GroupQueue, RequestQueue
from prism_serve.control.types import (
    Action,
    Activate,
    ClusterSnapshot,
    DeviceSnapshot,
    EngineSnapshot,
    Enqueue,
    Evict,
    InvalidSnapshotError,
    Migrate,
    Request,
)

__all__ = ["QLMKnobs", "QLMPolicy"]


@dataclass(slots=True, frozen=True)
class QLMKnobs(Knobs):
    max_group_size: int = 32
    reserve_tokens: int = 0  # QLM batches as much as fits
    min_kv_fraction: float = 0.05

    def __post_init__(self) -> None:
        require(self.max_group_size >= 1, "max_group_size must be >= 1")
        self._check_shared()


class QLMPolicy(Policy):
    name = "qlm"
    keeps_fewer_devices = True  # a baseline: see Policy
    knobs_type = QLMKnobs
    knobs: QLMKnobs

    def new_queue(self, device: str) -> RequestQueue:
        return GroupQueue(
            device, reserve_tokens=self.knobs.reserve_tokens, max_group_size=self.knobs.max_group_size
        )

    def on_request(self, request: Request, cluster: ClusterSnapshot, now: float) -> list[Action]:
        m = cluster.models.get(request.model)
        if m is None:
            return [unknown_model(request)]
        if m.tp_size != 1:
            return [no_capacity(request, "the qlm baseline serves single-device models only")]
        holds = [
            d
            for d, dev in cluster.devices.items()
            if dev.capacity_bytes - m.part_weight_bytes >= min_kv_bytes(dev, self.knobs.min_kv_fraction)
        ]
        if not holds:
            return [no_capacity(request, f"no device can hold {m.model}")]
        for d in holds:
            if m.model in cluster.devices[d].queued_models:
                return [Enqueue(request, d)]
        if m.resident:
            return [Enqueue(request, m.placement[0])]
        empty = [d for d in holds if cluster.devices[d].num_queued == 0]
        if empty:
            return [Enqueue(request, empty[0])]
        order = {d: i for i, d in enumerate(cluster.devices)}
        return [Enqueue(request, min(holds, key=lambda d: (cluster.devices[d].num_queued, order[d])))]

    def admit(
        self, queue: RequestQueue, device: DeviceSnapshot, engines: Mapping[str, EngineSnapshot], now: float
    ) -> list[Action]:
        if not isinstance(queue, GroupQueue):
            raise InvalidSnapshotError("qlm admits from the GroupQueue its new_queue() made")
        head = queue.head_model()
        if head is None or head in device.models:
            return queue.admit(now, device, engines)
        # swap: only once the loaded model's requests have drained (QLM restarts the engine)
        for loaded in device.models:
            e = engines.get(loaded)
            if e is not None and (e.num_running > 0 or not e.ready):
                return []
        actions: list[Action] = [Evict(m) for m in device.models]
        elsewhere = engines.get(head)
        if elsewhere is not None and elsewhere.device != device.device:
            actions.append(Migrate(head, (elsewhere.device,), (device.device,)))
        else:
            actions.append(Activate(head, (device.device,)))
        return actions
