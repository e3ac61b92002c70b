"""KV pressure ratio and global model placement (paper section 6.2, Algorithm 1, Appendix A.1).

KVPR of a device ``g`` holding models ``M_g``::

    KVPR_g = sum_{m in M_g} (r_m / s_m)  /  shared_kv_g
    shared_kv_g = C_g - sum_{m in M_g} w_m

``r_m`` is the model's request rate (req/s), ``s_m`` its TTFT SLO (s), ``w_m`` the weight bytes it maps on
``g`` and ``C_g`` the device's capacity. ``r/s`` is the SLO-weighted rate: how much KV memory the model
claims per unit time, scaled up by how urgently it must get it. ``shared_kv`` is the memory left for
every colocated model's KV cache once weights are mapped. We measure ``shared_kv`` in GiB so that KVPR
and the migration threshold tau are human-sized numbers (a device with 40 GiB for KV and models
totalling 4 req/s at a 0.5 s SLO has KVPR 0.2); a device with no memory left has KVPR = inf.

A tensor-parallel model with ``tp`` ranks is placed as ``tp`` parts, each carrying ``1/tp`` of its
weight and rate (Appendix A.1.2). Parts of one model sort next to each other and never share a device:
if the lowest-KVPR device already holds a sibling part, the next lowest is used. Replicas of one served
model (``Part.group``) never share a device either.

The algorithm re-places every model from empty devices each time it runs, in descending ``r/s``; a
model leaves its current device only if that device's KVPR exceeds the best device's by more than tau.
A device is eligible only if the part's weights leave at least ``min_kv_bytes`` for KV; the paper's
pseudocode omits this check because its devices always fit every model. Eligibility also counts the
weights of resident models not yet re-placed (they are physically there until they move), so staying
put is always feasible and the plan never exceeds a device's capacity. A model that fits nowhere is
left out whole, unless it is resident: then it stays where it is.

Compute (beyond the paper): colocated engines share their device's compute, so a device full of busy
engines serves each of them slower, and every request holds its KV longer by the same factor. Each
part may carry ``busy``, its model's predicted busy fraction (``ModelSnapshot.busy``; every TP rank
is busy when the model is), and a device's *effective* KVPR is its KVPR times the slowdown that
processor sharing at its summed busy fraction ``U`` predicts::

    pressure_g = KVPR_g * contention(U_g)     contention(U) = 1 / (1 - U)  for U < 0.9,
                                              10 + 100 (U - 0.9)  beyond (the tangent: finite, rising)

Algorithm 1 then runs on ``pressure`` instead of ``KVPR``; a part leaves its device only if the
gain beats ``tau * contention(U)`` of that device (tau stays a KVPR gain: without the factor, a
contention of 20 would turn rate noise of a few percent into migrations). With every ``busy`` zero
it is the paper's algorithm exactly.

A move must also not overload the engines it lands next to (:func:`overloads`). Pressure is one
number per device, so it cannot tell a device of several light engines, each with plenty of slack,
from one whose single engine is near its limit: both read as busy. Engine ``j``, busy ``b_j`` alone
with neighbours busy ``U - b_j`` of the time, steps at about ``1 / (1 + U - b_j)`` of its speed alone
(processor sharing with the expected number of neighbours stepping), so it has work
``load_j = b_j (1 + U - b_j)`` of the time and its queue grows without bound as that nears 1. A move
that leaves every engine at the destination below ``SAFE_LOAD`` is pressure's to decide. Above it,
a move is refused if the destination's most loaded engine would end more loaded than the most
loaded engine of either device was before, or if the destination holds an engine busier alone than
every engine on the source, the moved one included. The loads are rough (busy fractions measured
over a minute, each engine's alone, summing past 1 on a crowded core), and the second test does not
depend on their scale: a light model leaves four light engines with slack for one engine that
alone is near its limit only if the measured loads happen to rank them that way (live, they did:
syn-135m's load read 1.12 beside three small models, SmolLM2-360M's 1.0 alone, and syn-135m met
every SLO while SmolLM2-360M missed 15%). Above ``SAFE_LOAD`` a move and its reverse are both
allowed only if they tie (each needs its destination to end no more loaded than the other side),
so with unchanged inputs the next run does not undo it. (The decode-heavy CPU sweep: a
light model moved by pressure onto the core of the one model at 98% of its limit, and back when the
rates turned, every 60 s, and that model's TTFT attainment fell from 95% to 85%.)

Picking the lowest-pressure device uses a heap with lazy deletion, so one run costs
O((M + D) log D) for M parts on D devices plus the ineligible devices skipped on the way.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from prism_serve.control.types import InvalidSnapshotError

__all__ = [
    "GIB",
    "SAFE_LOAD",
    "DeviceBudget",
    "Part",
    "PlacementResult",
    "contention",
    "kvpr",
    "overloads",
    "place_parts",
    "pressure",
    "worst_load",
]

GIB = float(1 << 30)
_KNEE = 0.9  # busy fraction where contention() leaves 1 / (1 - U) for its tangent
# an engine with work less than half the time, neighbours' slowdown included, has ample slack: moves
# below this load are pressure's to decide (the busy fraction 0.5 where contention() reaches 2)
SAFE_LOAD = 0.5


def kvpr(weighted_rate: float, shared_kv_bytes: float) -> float:
    """KV pressure ratio: SLO-weighted request rate per GiB of KV memory left after weights."""
    if shared_kv_bytes <= 0:
        return math.inf
    return weighted_rate * GIB / shared_kv_bytes


def contention(busy: float) -> float:
    """How much longer work takes on a device whose engines are busy ``busy`` of the time in sum
    (processor sharing, 1 / (1 - U)); past the knee it rises along its tangent instead of blowing up,
    so overloaded devices still order by how overloaded they are."""
    if busy < _KNEE:
        return 1.0 / (1.0 - max(0.0, busy))
    slope = 1.0 / (1.0 - _KNEE) ** 2
    return 1.0 / (1.0 - _KNEE) + slope * (busy - _KNEE)


def worst_load(busy: Iterable[float]) -> float:
    """The most loaded engine's share of time with work among engines busy ``busy`` alone on one
    device, each slowed by its neighbours: ``max_j b_j (1 + U - b_j)`` (module docstring)."""
    busy = list(busy)
    total = sum(busy)
    return max((b * (1.0 + total - b) for b in busy), default=0.0)


def overloads(source: Sequence[float], destination: Sequence[float], busy: float) -> bool:
    """Whether moving an engine busy ``busy`` from a device whose engines are busy ``source`` (it
    included) onto one with ``destination`` leaves the destination's most loaded engine above
    ``SAFE_LOAD`` and either above the most loaded engine of either device before the move, or
    beside an engine busier alone than every engine on the source."""
    after = worst_load([*destination, busy])
    if after <= SAFE_LOAD:
        return False
    if after > max(worst_load(source), worst_load(destination)):
        return True
    return max(destination, default=0.0) > max(source, default=0.0)


def pressure(weighted_rate: float, shared_kv_bytes: float, busy: float = 0.0) -> float:
    """Effective KVPR: the KV pressure ratio stretched by the device's compute contention."""
    k = kvpr(weighted_rate, shared_kv_bytes)
    return k * contention(busy) if k > 0 else k


@dataclass(slots=True, frozen=True)
class Part:
    """One TP rank of a model as Algorithm 1 sees it."""

    model: str
    rank: int
    demand: float  # r / (s * tp): this part's share of the SLO-weighted rate
    weight_bytes: int  # this part's weights
    current: str | None = None  # device it is on now; None for a model being activated
    fixed: bool = False  # cannot move this round (an activation or migration is in flight)
    busy: float = 0.0  # the model's predicted busy fraction (compute demand on this part's device)
    # parts with equal groups never share a device: the replicas of one served model (control/
    # replicas.py) as well as the ranks of one TP model; "" means the part's own model
    group: str = ""

    @property
    def key(self) -> str:
        return self.group or self.model


@dataclass(slots=True, frozen=True)
class DeviceBudget:
    device: str
    capacity_bytes: int
    min_kv_bytes: int = 0  # a part fits only if at least this much KV memory stays free


@dataclass(slots=True)
class PlacementResult:
    devices: list[str]
    assignment: dict[tuple[str, int], str | None]  # (model, rank) -> device, None if it fits nowhere
    weighted_rate: list[float]  # per device, sum of r/s of its parts
    shared_kv: list[float]  # per device, bytes left for KV
    busy: list[float] | None = None  # per device, sum of its parts' busy fractions

    def kvpr_of(self, device: str) -> float:
        i = self.devices.index(device)
        return kvpr(self.weighted_rate[i], self.shared_kv[i])

    def busy_of(self, device: str) -> float:
        return self.busy[self.devices.index(device)] if self.busy is not None else 0.0

    def max_kvpr(self) -> float:
        return max((kvpr(w, s) for w, s in zip(self.weighted_rate, self.shared_kv, strict=True)), default=0.0)

    def placement(self, model: str, tp_size: int) -> tuple[str, ...] | None:
        devs = tuple(self.assignment.get((model, r)) for r in range(tp_size))
        return None if any(d is None for d in devs) else devs  # type: ignore[return-value]


T = TypeVar("T")


def node_of(device: str) -> str:
    """The node of a device named ``<node>/<device>`` (a multi-node cluster, runtime/cluster.py);
    "" for a plain name: every device of a one-machine deployment is on one node."""
    return device.rpartition("/")[0]


def on_one_node(ranked: Sequence[T], count: int, device: Callable[[T], str]) -> list[T] | None:
    """``count`` of ``ranked`` (best first) on one node, for the ranks of a TP model, which never span
    nodes: of the nodes with ``count`` of them, the one whose ``count``-th best comes first. None if
    no node has ``count``. On one node this is ``ranked[:count]``."""
    taken: dict[str, list[T]] = {}
    for x in ranked:
        mine = taken.setdefault(node_of(device(x)), [])
        mine.append(x)
        if len(mine) == count:
            return mine
    return None


def place_parts(parts: Iterable[Part], devices: Sequence[DeviceBudget], tau: float) -> PlacementResult:
    """Algorithm 1 over ``parts`` on ``devices`` with migration threshold ``tau`` (KVPR units).

    Fixed parts are put on their current device first. The others go in descending demand (ties: model
    name, then rank, so the parts of one model are adjacent and the order is deterministic). A model
    whose parts cannot all be placed is left out entirely (every rank maps to None), unless every part
    is resident, in which case it stays on its current devices.

    On devices of several nodes (``node_of``) the ranks of a TP model stay on the node of its first
    rank; if they do not all fit there, the model is tried once more on the node with the most
    devices that fit a rank.
    """
    if not (tau >= 0 and math.isfinite(tau)):
        raise InvalidSnapshotError(f"tau must be finite and >= 0, got {tau}")
    names = [d.device for d in devices]
    index = {n: i for i, n in enumerate(names)}
    if len(index) != len(names):
        raise InvalidSnapshotError("duplicate device in placement input")
    n = len(names)
    W = [0.0] * n
    U = [0.0] * n
    on: list[list[float]] = [[] for _ in range(n)]  # busy fractions of the parts placed on each device
    S = [float(d.capacity_bytes) for d in devices]
    min_kv = [d.min_kv_bytes for d in devices]
    held: list[set[str]] = [set() for _ in range(n)]
    node = [node_of(name) for name in names]
    multi_node = len(set(node)) > 1
    only_node: str | None = None  # the node the ranks of the TP model being placed must use
    version = [0] * n
    assignment: dict[tuple[str, int], str | None] = {}

    movable: list[Part] = []
    seen: set[tuple[str, int]] = set()
    # Weights of resident parts not yet re-placed: they are physically on their device, so a part may
    # only move into memory that stays free even if they all stay (keeps the plan within capacity).
    reserved = [0] * n
    for p in parts:
        if (p.model, p.rank) in seen:
            raise InvalidSnapshotError(f"part {p.model}#{p.rank} given twice")
        seen.add((p.model, p.rank))
        if p.current is not None and p.current not in index:
            raise InvalidSnapshotError(f"part {p.model}#{p.rank} is on unknown device {p.current!r}")
        if p.fixed:
            if p.current is None:
                raise InvalidSnapshotError(f"fixed part {p.model}#{p.rank} has no device")
            j = index[p.current]
            W[j] += p.demand
            U[j] += p.busy
            on[j].append(p.busy)
            S[j] -= p.weight_bytes
            held[j].add(p.key)
            assignment[(p.model, p.rank)] = p.current
        else:
            movable.append(p)
            if p.current is not None:
                reserved[index[p.current]] += p.weight_bytes
    movable.sort(key=lambda p: (-p.demand, p.model, p.rank))

    heap = [(pressure(W[j], S[j], U[j]), U[j], -S[j], j, 0) for j in range(n)]
    # on several nodes, one heap per node as well: the later ranks of a TP model search only theirs
    node_heaps: dict[str, list] = {}
    if multi_node:
        for entry in heap:
            node_heaps.setdefault(node[entry[3]], []).append(entry)
        for h in node_heaps.values():
            heapq.heapify(h)
    heapq.heapify(heap)

    def touch(j: int) -> None:
        version[j] += 1
        entry = (pressure(W[j], S[j], U[j]), U[j], -S[j], j, version[j])
        heapq.heappush(heap, entry)
        if multi_node:
            heapq.heappush(node_heaps[node[j]], entry)

    def fits(j: int, p: Part) -> bool:
        return (
            S[j] - reserved[j] - p.weight_bytes >= min_kv[j]
            and p.key not in held[j]
            and (only_node is None or node[j] == only_node)
        )

    def best_below(p: Part, bound: float) -> int | None:
        """The lowest-pressure device that fits ``p``, if its pressure is below ``bound``."""
        h = node_heaps[only_node] if multi_node and only_node is not None else heap
        stash = []
        found = None
        while h:
            entry = heapq.heappop(h)
            j = entry[3]
            if entry[4] != version[j]:
                continue  # stale: the device changed after this entry was pushed
            stash.append(entry)
            if entry[0] >= bound:
                break
            if fits(j, p):
                found = j
                break
        for entry in stash:
            heapq.heappush(h, entry)
        return found

    def put(p: Part, j: int, sign: int = 1) -> None:
        W[j] += sign * p.demand
        U[j] += sign * p.busy
        S[j] -= sign * p.weight_bytes
        if sign > 0:
            held[j].add(p.key)
            on[j].append(p.busy)
        else:
            held[j].discard(p.key)
            on[j].remove(p.busy)
        touch(j)

    def place_group(group: list[Part], target: str | None) -> list[tuple[Part, int]]:
        """Place the ranks of one model in order until one fits nowhere; the ones placed. ``target``:
        the node they must use (else the first rank's, on several nodes)."""
        nonlocal only_node
        only_node = target
        tie = multi_node and len(group) > 1
        chosen: list[tuple[Part, int]] = []
        try:
            for p in group:
                cur = index[p.current] if p.current is not None else None
                if cur is not None:
                    reserved[cur] -= p.weight_bytes
                if cur is not None and fits(cur, p):
                    # move only if the best device beats the current one by more than tau (line 8);
                    # tau is a KVPR gain, worth tau at the current device's contention in pressure
                    best = best_below(p, pressure(W[cur], S[cur], U[cur]) - tau * contention(U[cur]))
                    # an idle part too: idle this minute is not idle for good (live, smol-c, one
                    # request every 40 s, read busy 0 and moved beside SmolLM2-360M at 0.92)
                    if best is not None and overloads([*on[cur], p.busy], on[best], p.busy):
                        best = None
                    j = cur if best is None else best
                else:
                    j = best_below(p, math.inf)
                if j is None:
                    break
                put(p, j)
                chosen.append((p, j))
                if tie:
                    only_node = node[j]
        finally:
            only_node = None
        return chosen

    i = 0
    while i < len(movable):
        k = i
        while k < len(movable) and movable[k].model == movable[i].model:
            k += 1
        group = movable[i:k]
        tp_nodes = multi_node and len(group) > 1
        saved = [(index[p.current], reserved[index[p.current]]) for p in group if p.current is not None]
        chosen = place_group(group, None)
        if tp_nodes and len(chosen) < len(group):  # once more, on the node with the most room for it
            for p, j in chosen:
                put(p, j, -1)
            for j, r in saved:
                reserved[j] = r
            room: dict[str, int] = {}
            for j in range(n):
                if S[j] - reserved[j] - group[0].weight_bytes >= min_kv[j]:
                    room[node[j]] = room.get(node[j], 0) + 1
            target = max(room, key=lambda nd: (room[nd], nd), default=None)
            if target is not None and room[target] >= len(group):
                chosen = place_group(group, target)
            else:  # no node can take it: released as if its first rank had been tried
                chosen = []
                if group[0].current is not None:
                    reserved[index[group[0].current]] -= group[0].weight_bytes
        if len(chosen) < len(group):
            for p, j in chosen:  # all ranks or none: give back what the placed siblings took
                put(p, j, -1)
            for p in group[len(chosen) + 1 :]:
                if p.current is not None:
                    reserved[index[p.current]] -= p.weight_bytes
            chosen = []
            if all(p.current is not None for p in group):
                # a resident model the plan cannot fit stays where it is: its memory is real
                chosen = [(p, index[p.current]) for p in group]  # type: ignore[index]
                for p, j in chosen:
                    put(p, j)
        for p in group:
            assignment[(p.model, p.rank)] = None
        for p, j in chosen:
            assignment[(p.model, p.rank)] = names[j]
        i = k
    return PlacementResult(names, assignment, W, S, U)
