"""``static-partition``: models share devices, but each gets a fixed slice of KV memory.

The MIG / fractional-GPU baseline of the paper (S-Partition, sections 2 and 7): colocated models
cannot use each other's unused KV memory, and nothing is ever evicted or moved. Placement happens
once per model: largest weights first, each part on the device with the most memory left after
weights (worst fit, so slices are as large as they can be). Every device's memory left after weights
is split among its models in proportion to ``shares`` (1.0 for a model not listed) and enforced by
``SetKVQuota``. Admission is arrival order per engine (``FifoQueue``), within the engine's slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from prism_serve.control.placement import on_one_node
from prism_serve.control.policies.base import (
    Knobs,
    Policy,
    min_kv_bytes,
    require,
)
from prism_serve.control.queues import FifoQueue, RequestQueue
from prism_serve.control.types import Action, Activate, ClusterSnapshot, Request, SetKVQuota

__all__ = ["StaticPartitionKnobs", "StaticPartitionPolicy"]


@dataclass(slots=True, frozen=True)
class StaticPartitionKnobs(Knobs):
    shares: tuple[tuple[str, float], ...] = ()  # (model, relative share); models not listed get 1.0
    reserve_tokens: int = 256
    min_kv_fraction: float = 0.05

    def __post_init__(self) -> None:
        require(all(s > 0 for _, s in self.shares), "every share must be > 0")
        require(len({m for m, _ in self.shares}) == len(self.shares), "a model is listed twice in shares")
        self._check_shared()


class StaticPartitionPolicy(Policy):
    name = "static-partition"
    keeps_fewer_devices = True  # a baseline: see Policy
    knobs_type = StaticPartitionKnobs
    knobs: StaticPartitionKnobs

    def new_queue(self, device: str) -> RequestQueue:
        return FifoQueue(device, reserve_tokens=self.knobs.reserve_tokens)

    def place(self, cluster: ClusterSnapshot, now: float) -> list[Action]:
        k = self.knobs
        members = {d: list(dev.models) for d, dev in cluster.devices.items()}
        left = {
            d: dev.capacity_bytes - sum(cluster.models[m].part_weight_bytes for m in dev.models)
            for d, dev in cluster.devices.items()
        }
        order = {d: i for i, d in enumerate(cluster.devices)}
        actions: list[Action] = []
        changed: set[str] = set()
        new = sorted(
            (m for m in cluster.models.values() if not m.resident),
            key=lambda m: (-m.part_weight_bytes, m.model),
        )
        for m in new:
            fits = [
                d
                for d in cluster.devices
                if left[d] - m.part_weight_bytes >= min_kv_bytes(cluster.devices[d], k.min_kv_fraction)
            ]
            if len(fits) < m.tp_size:
                continue
            group = on_one_node(sorted(fits, key=lambda d: (-left[d], order[d])), m.tp_size, str)
            if group is None:  # TP ranks never span nodes
                continue
            devices = tuple(group)
            for d in devices:
                left[d] -= m.part_weight_bytes
                members[d].append(m.model)
                changed.add(d)
            actions.append(Activate(m.model, devices))
        share = dict(k.shares)
        for d in cluster.devices:
            if d not in changed:
                continue
            total = sum(share.get(m, 1.0) for m in members[d])
            for m in members[d]:
                actions.append(SetKVQuota(m, d, int(max(0, left[d]) * share.get(m, 1.0) / total)))
        return actions

    def on_request(self, request: Request, cluster: ClusterSnapshot, now: float) -> list[Action]:
        return self._route_or_wait_for_tick(
            request,
            cluster,
            now,
            defer="{m.model} gets its partition at the next placement tick",
            refuse="no device has a partition left for {m.model}",
        )
