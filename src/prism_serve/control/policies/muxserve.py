"""``muxserve``: MuxServe-style colocation (seed 001), as the paper's MuxServe++ baseline runs it.

Defining behaviour, from the MuxServe paper (sections 3.2-3.3) and Prism's description of MuxServe++:
- Placement by estimated throughput, enumeration-greedy: enumerate ways to cut the devices into
  meshes; for each, place models in descending computation need (rate x weight bytes) on the mesh
  whose estimated throughput grows most; keep the mesh group with the highest total (ties, as when
  no rate is known yet, go to the highest capacity: the estimate not bounded by the rates).
- One shared KV pool per mesh with a per-model quota (ADBS). Quotas start proportional to each
  model's rate-weighted KV need and are adapted on every tick: models using less than ``low_util`` of
  their quota give ``quota_step`` of their unused part to models using more than ``high_util``.
- Prefill admission round-robin across the mesh's models, each within its quota (``RoundRobinQueue``).
- No eviction and no migration: once placed, a model stays, idle or not.

Adaptations, because our models have a fixed tensor-parallel size: a mesh hosts only models whose
``tp_size`` equals its size (MuxServe would re-shard), and the throughput estimate is MuxServe's
equation (3) with the batch size bounded by the model's KV quota instead of profiled:
``tpt_m = min(rate_m, batch_m / (sum of colocated prefill times + decode_step_m * output_tokens_m))``.
Groups are enumerated up to ``max_mesh_groups``; with only single-device models there is exactly one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from prism_serve.control.placement import on_one_node
from prism_serve.control.policies.base import (
    Knobs,
    Policy,
    PolicyMemo,
    fraction,
    min_kv_bytes,
    require,
)
from prism_serve.control.queues import RequestQueue, RoundRobinQueue
from prism_serve.control.types import (
    Action,
    Activate,
    ClusterSnapshot,
    ModelSnapshot,
    Request,
    SetKVQuota,
)

__all__ = ["MuxServeKnobs", "MuxServePolicy", "mesh_groups", "unit_throughput"]


@dataclass(slots=True, frozen=True)
class MuxServeKnobs(Knobs):
    reserve_tokens: int = 256
    min_kv_fraction: float = 0.05
    max_mesh_groups: int = 64
    quota_step: float = 0.25  # share of a low-utilization model's unused quota moved per tick
    low_util: float = 0.5
    high_util: float = 0.9

    def __post_init__(self) -> None:
        self._check_shared()
        require(self.max_mesh_groups >= 1, "max_mesh_groups must be >= 1")
        fraction("quota_step", self.quota_step)
        fraction("low_util", self.low_util)
        fraction("high_util", self.high_util)
        require(self.low_util < self.high_util, "low_util must be below high_util")


def _kv_need(m: ModelSnapshot) -> float:
    """Rate-weighted KV bytes per second of one rank: what MuxServe normalizes quotas by."""
    return m.rate * m.part_kv_bytes_per_token * (m.profile.mean_prompt_tokens + m.profile.mean_output_tokens)


def _shares(members: list[ModelSnapshot]) -> list[float]:
    needs = [_kv_need(m) for m in members]
    total = sum(needs)
    if total <= 0:
        return [1.0 / len(members)] * len(members)
    return [n / total for n in needs]


def unit_throughput(members: list[ModelSnapshot], kv_pool_bytes: float, capped: bool = True) -> float:
    """Estimated requests/s an LLM unit (models sharing one mesh and KV pool) serves; ``capped=False``:
    what it could serve, each model's estimate not bounded by its rate (its capacity)."""
    if not members or kv_pool_bytes <= 0:
        return 0.0
    prefill_s = sum(m.profile.mean_prompt_tokens / m.profile.prefill_tokens_per_s for m in members)
    total = 0.0
    for m, share in zip(members, _shares(members), strict=True):
        per_request = m.part_kv_bytes_per_token * (
            m.profile.mean_prompt_tokens + m.profile.mean_output_tokens
        )
        batch = kv_pool_bytes * share / per_request
        cycle = prefill_s + m.profile.decode_step_s * m.profile.mean_output_tokens
        total += min(m.rate, batch / cycle) if capped else batch / cycle
    return total


def mesh_groups(devices: list[str], sizes: list[int], limit: int) -> Iterator[list[tuple[str, ...]]]:
    """Ways to cut ``devices`` (in order) into meshes whose sizes are in ``sizes``: at least one mesh of
    every size when that fits, no room left for another mesh, at most ``limit`` groups."""
    sizes = sorted(set(sizes), reverse=True)
    n = len(devices)
    required = sum(sizes) <= n

    def counts(i: int, left: int) -> Iterator[list[int]]:
        if i == len(sizes):
            if left < sizes[-1]:
                yield []
            return
        k = sizes[i]
        low = 1 if required else 0
        for c in range(left // k, low - 1, -1):
            for rest in counts(i + 1, left - c * k):
                yield [c, *rest]

    for vector in itertools.islice(counts(0, n), limit):
        meshes, pos = [], 0
        for k, c in zip(sizes, vector, strict=True):
            for _ in range(c):
                meshes.append(tuple(devices[pos : pos + k]))
                pos += k
        yield meshes


class MuxServePolicy(Policy):
    name = "muxserve"
    keeps_fewer_devices = True  # a baseline: see Policy
    knobs_type = MuxServeKnobs
    knobs: MuxServeKnobs

    def new_queue(self, device: str) -> RequestQueue:
        return RoundRobinQueue(device, reserve_tokens=self.knobs.reserve_tokens)

    def on_request(self, request: Request, cluster: ClusterSnapshot, now: float) -> list[Action]:
        return self._route_or_wait_for_tick(
            request,
            cluster,
            now,
            defer="{m.model} is placed at the next placement tick",
            refuse="no mesh can hold {m.model} next to the models already placed",
        )

    def place(self, cluster: ClusterSnapshot, now: float, memo: PolicyMemo | None = None) -> list[Action]:
        new = [m for m in cluster.models.values() if not m.resident]
        resident = [m for m in cluster.models.values() if m.resident]
        actions: list[Action] = []
        changed: set[tuple[str, ...]] = set()
        if new:
            if resident:
                meshes = self._existing_meshes(cluster, resident, new)
                self._greedy(cluster, meshes, new)
            else:
                meshes = self._best_group(cluster, new)
            for devices, members in meshes.items():
                added = [m for m in members if not m.resident]
                if not added:
                    continue
                changed.add(devices)
                actions.extend(Activate(m.model, devices) for m in added)
                pool = self._pool(cluster, devices, members)
                for m, share in zip(members, _shares(members), strict=True):
                    actions.extend(SetKVQuota(m.model, d, int(pool * share)) for d in devices)
        actions.extend(self._adapt_quotas(cluster, changed))
        return actions

    # -- placement --------------------------------------------------------------------------------

    def _pool(
        self, cluster: ClusterSnapshot, devices: tuple[str, ...], members: list[ModelSnapshot]
    ) -> float:
        weights = sum(m.part_weight_bytes for m in members)
        return min(cluster.devices[d].capacity_bytes for d in devices) - weights

    def _fits(self, cluster: ClusterSnapshot, devices: tuple[str, ...], members: list[ModelSnapshot]) -> bool:
        floor = max(min_kv_bytes(cluster.devices[d], self.knobs.min_kv_fraction) for d in devices)
        return self._pool(cluster, devices, members) >= floor

    def _greedy(
        self,
        cluster: ClusterSnapshot,
        meshes: dict[tuple[str, ...], list[ModelSnapshot]],
        models: list[ModelSnapshot],
    ) -> tuple[int, float, float]:
        """Add ``models`` to ``meshes`` in place; returns (models placed, total estimated throughput,
        total estimated capacity)."""
        placed = 0
        for m in sorted(models, key=lambda m: (-m.rate * m.weight_bytes, -m.weight_bytes, m.model)):
            best, best_key = None, None
            for idx, (devices, members) in enumerate(meshes.items()):
                if len(devices) != m.tp_size or not self._fits(cluster, devices, [*members, m]):
                    continue
                pool_now = self._pool(cluster, devices, members)
                pool_after = self._pool(cluster, devices, [*members, m])
                delta = unit_throughput([*members, m], pool_after) - unit_throughput(members, pool_now)
                key = (delta, pool_after, -idx)
                if best_key is None or key > best_key:
                    best, best_key = devices, key
            if best is not None:
                meshes[best].append(m)
                placed += 1
        pools = {d: self._pool(cluster, d, ms) for d, ms in meshes.items()}
        total = sum(unit_throughput(ms, pools[d]) for d, ms in meshes.items())
        capacity = sum(unit_throughput(ms, pools[d], capped=False) for d, ms in meshes.items())
        return placed, total, capacity

    def _best_group(
        self, cluster: ClusterSnapshot, models: list[ModelSnapshot]
    ) -> dict[tuple[str, ...], list[ModelSnapshot]]:
        """The mesh group whose greedy placement places the most models, then serves the most of their
        rates, then has the most capacity to spare. The last decides whenever the rates do not: before
        any request (every rate is 0) and whenever every group's estimate covers every rate. Without
        it the first group enumerated (the largest meshes) won those ties and crowded the single-device
        models onto the few devices it left them."""
        best, best_key = {}, None
        sizes = [m.tp_size for m in models]
        for group in mesh_groups(list(cluster.devices), sizes, self.knobs.max_mesh_groups):
            meshes: dict[tuple[str, ...], list[ModelSnapshot]] = {mesh: [] for mesh in group}
            key = self._greedy(cluster, meshes, models)
            if best_key is None or key > best_key:
                best, best_key = meshes, key
        return best

    @staticmethod
    def _existing_meshes(
        cluster: ClusterSnapshot, resident: list[ModelSnapshot], new: list[ModelSnapshot]
    ) -> dict[tuple[str, ...], list[ModelSnapshot]]:
        """The meshes placed models already form, plus fresh meshes cut from free devices: at most
        one per new model, largest first (a free device left over simply stays free)."""
        meshes: dict[tuple[str, ...], list[ModelSnapshot]] = {}
        for m in resident:
            meshes.setdefault(m.placement, []).append(m)
        empty = [d for d, dev in cluster.devices.items() if not dev.models]
        for m in sorted(new, key=lambda m: -m.tp_size):
            mesh = on_one_node(empty, m.tp_size, str) if len(empty) >= m.tp_size else None
            if mesh is not None:  # a mesh never spans nodes
                meshes[tuple(mesh)] = []
                empty = [d for d in empty if d not in mesh]
        return meshes

    # -- ADBS quota adaptation ---------------------------------------------------------------------

    def _adapt_quotas(self, cluster: ClusterSnapshot, skip: set[tuple[str, ...]]) -> list[Action]:
        k = self.knobs
        meshes: dict[tuple[str, ...], list[ModelSnapshot]] = {}
        for m in cluster.models.values():
            if m.resident:
                meshes.setdefault(m.placement, []).append(m)
        actions: list[Action] = []
        for devices, members in meshes.items():
            if devices in skip:
                continue
            stats = []
            for m in members:
                e = cluster.engines.get(m.model)
                if e is None or e.kv_quota_bytes is None or e.kv_quota_bytes <= 0:
                    continue
                stats.append((m, e.kv_quota_bytes, e.used_kv_bytes, e.used_kv_bytes / e.kv_quota_bytes))
            donors = [s for s in stats if s[3] < k.low_util]
            takers = [s for s in stats if s[3] >= k.high_util]
            if not donors or not takers:
                continue
            moved = {m.model: int(k.quota_step * max(0, quota - used)) for m, quota, used, _ in donors}
            pot = sum(moved.values())
            if pot <= 0:
                continue
            for m, quota, _, _ in donors:
                actions.extend(SetKVQuota(m.model, d, quota - moved[m.model]) for d in devices)
            for m, quota, _, _ in takers:
                actions.extend(SetKVQuota(m.model, d, quota + pot // len(takers)) for d in devices)
        return actions
