"""``dedicated``: every model owns ``tp_size`` whole devices; nothing is shared, evicted or moved.

This is the common practice the paper's section 1 measures against (one model, or one TP group, per
device). Models are given devices once, most demanding (r/s) first, in device order; a model left
without free devices is not served and its requests are rejected with ``NO_CAPACITY``. Admission is
plain arrival order per engine (``FifoQueue``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prism_serve.control.placement import on_one_node
from prism_serve.control.policies.base import (
    Knobs,
    Policy,
    PolicyMemo,
    min_kv_bytes,
)
from prism_serve.control.queues import FifoQueue, RequestQueue
from prism_serve.control.types import Action, Activate, ClusterSnapshot, Request

__all__ = ["DedicatedKnobs", "DedicatedPolicy"]


@dataclass(slots=True, frozen=True)
class DedicatedKnobs(Knobs):
    reserve_tokens: int = 256
    min_kv_fraction: float = 0.05

    def __post_init__(self) -> None:
        self._check_shared()


class DedicatedPolicy(Policy):
    name = "dedicated"
    knobs_type = DedicatedKnobs
    exclusive_devices = True
    keeps_fewer_devices = True  # a baseline: see Policy
    knobs: DedicatedKnobs

    def new_queue(self, device: str) -> RequestQueue:
        return FifoQueue(device, reserve_tokens=self.knobs.reserve_tokens)

    def place(self, cluster: ClusterSnapshot, now: float, memo: PolicyMemo | None = None) -> list[Action]:
        free = [d for d, dev in cluster.devices.items() if not dev.models]
        actions: list[Action] = []
        unplaced = sorted(
            (m for m in cluster.models.values() if not m.resident), key=lambda m: (-m.demand, m.model)
        )
        for m in unplaced:
            fits = [
                d
                for d in free
                if cluster.devices[d].capacity_bytes - m.part_weight_bytes
                >= min_kv_bytes(cluster.devices[d], self.knobs.min_kv_fraction)
            ]
            if len(fits) < m.tp_size:
                continue
            group = on_one_node(fits, m.tp_size, str)  # TP ranks never span nodes
            if group is None:
                continue
            devices = tuple(group)
            free = [d for d in free if d not in devices]
            actions.append(Activate(m.model, devices))
        return actions

    def on_request(self, request: Request, cluster: ClusterSnapshot, now: float) -> list[Action]:
        return self._route_or_wait_for_tick(
            request,
            cluster,
            now,
            defer="{m.model} gets its dedicated devices at the next placement tick",
            refuse="no {m.tp_size} free device(s) left to dedicate to {m.model}",
        )
