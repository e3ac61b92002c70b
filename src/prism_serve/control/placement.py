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
        if tp_size == 1:  # most models: asked for every model at every placement
            d = self.assignment.get((model, 0))
            return None if d is None else (d,)
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


class _Bins:
    """Algorithm 1's devices while parts are placed on them: per device the summed SLO-weighted
    rate (``W``), busy fraction (``U``) and the busy fractions of its parts (``on``), the memory left
    for KV (``S``), the parts it holds, and the weights of resident parts not yet re-placed
    (``reserved``: physically there until they move). ``start`` builds a heap by pressure (one per
    node too, on several nodes) that ``put`` and ``take`` keep current through per-device versions."""

    def __init__(self, devices: Sequence[DeviceBudget]) -> None:
        self.names = [d.device for d in devices]
        self.index = {n: i for i, n in enumerate(self.names)}
        if len(self.index) != len(self.names):
            raise InvalidSnapshotError("duplicate device in placement input")
        n = len(self.names)
        self.W = [0.0] * n
        self.U = [0.0] * n
        self.on: list[list[float]] = [[] for _ in range(n)]
        self.S = [float(d.capacity_bytes) for d in devices]
        self.min_kv = [d.min_kv_bytes for d in devices]
        self.held: list[set[str]] = [set() for _ in range(n)]
        self.reserved = [0] * n
        self.node = [node_of(name) for name in self.names]
        self.multi_node = len(set(self.node)) > 1
        self.version = [0] * n
        self.heap: list[tuple] = []
        self.node_heaps: dict[str, list[tuple]] = {}

    def __len__(self) -> int:
        return len(self.names)

    def pressure(self, j: int) -> float:
        return pressure(self.W[j], self.S[j], self.U[j])

    def start(self) -> None:
        """The heaps, once the fixed parts are in."""
        self.heap = [(self.pressure(j), self.U[j], -self.S[j], j, 0) for j in range(len(self))]
        if self.multi_node:  # the later ranks of a TP model search only their node's heap
            for entry in self.heap:
                self.node_heaps.setdefault(self.node[entry[3]], []).append(entry)
            for h in self.node_heaps.values():
                heapq.heapify(h)
        heapq.heapify(self.heap)

    def fits(self, j: int, p: Part, node: str | None = None) -> bool:
        """``p`` on device ``j`` leaves its minimum KV free with every resident part still there,
        no sibling of ``p`` is there, and ``j`` is on ``node`` (None: any)."""
        return (
            self.S[j] - self.reserved[j] - p.weight_bytes >= self.min_kv[j]
            and p.key not in self.held[j]
            and (node is None or self.node[j] == node)
        )

    def best_below(self, p: Part, bound: float, node: str | None = None) -> int | None:
        """The lowest-pressure device (on ``node``) that fits ``p``, if its pressure is below ``bound``."""
        h = self.node_heaps[node] if self.multi_node and node is not None else self.heap
        stash = []
        found = None
        while h:
            entry = heapq.heappop(h)
            j = entry[3]
            if entry[4] != self.version[j]:
                continue  # stale: the device changed after this entry was pushed
            stash.append(entry)
            if entry[0] >= bound:
                break
            if self.fits(j, p, node):
                found = j
                break
        for entry in stash:
            heapq.heappush(h, entry)
        return found

    def hold(self, p: Part, j: int) -> None:
        """``p`` on device ``j``, before the heaps exist (a fixed part)."""
        self.W[j] += p.demand
        self.U[j] += p.busy
        self.on[j].append(p.busy)
        self.S[j] -= p.weight_bytes
        self.held[j].add(p.key)

    def put(self, p: Part, j: int) -> None:
        self.hold(p, j)
        self._touch(j)

    def take(self, p: Part, j: int) -> None:
        """Undo ``put(p, j)``."""
        self.W[j] -= p.demand
        self.U[j] -= p.busy
        self.S[j] += p.weight_bytes
        self.held[j].discard(p.key)
        self.on[j].remove(p.busy)
        self._touch(j)

    def _touch(self, j: int) -> None:
        self.version[j] += 1
        entry = (self.pressure(j), self.U[j], -self.S[j], j, self.version[j])
        heapq.heappush(self.heap, entry)
        if self.multi_node:
            heapq.heappush(self.node_heaps[self.node[j]], entry)

    def release(self, p: Part) -> None:
        """``p``'s current weights no longer reserve its device (it is being re-placed)."""
        if p.current is not None:
            self.reserved[self.index[p.current]] -= p.weight_bytes

    def place_group(self, group: list[Part], tau: float, target: str | None) -> list[tuple[Part, int]]:
        """Place the ranks of one model in order until one fits nowhere; the ones placed. ``target``:
        the node they must use (else the first rank's, on several nodes)."""
        node = target
        tie = self.multi_node and len(group) > 1
        chosen: list[tuple[Part, int]] = []
        for p in group:
            cur = self.index[p.current] if p.current is not None else None
            self.release(p)
            if cur is not None and self.fits(cur, p, node):
                # move only if the best device beats the current one by more than tau (line 8);
                # tau is a KVPR gain, worth tau at the current device's contention in pressure
                best = self.best_below(p, self.pressure(cur) - tau * contention(self.U[cur]), node)
                # an idle part too: idle this minute is not idle for good (live, smol-c, one
                # request every 40 s, read busy 0 and moved beside SmolLM2-360M at 0.92)
                if best is not None and overloads([*self.on[cur], p.busy], self.on[best], p.busy):
                    best = None
                j = cur if best is None else best
            else:
                j = self.best_below(p, math.inf, node)
            if j is None:
                break
            self.put(p, j)
            chosen.append((p, j))
            if tie:
                node = self.node[j]
        return chosen

    def roomiest_node(self, p: Part) -> tuple[str | None, int]:
        """The node with the most devices that fit ``p``'s weights (ties: the last name), and how many."""
        room: dict[str, int] = {}
        for j in range(len(self)):
            if self.S[j] - self.reserved[j] - p.weight_bytes >= self.min_kv[j]:
                room[self.node[j]] = room.get(self.node[j], 0) + 1
        target = max(room, key=lambda nd: (room[nd], nd), default=None)
        return target, room.get(target, 0)


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
    bins = _Bins(devices)
    index = bins.index
    assignment: dict[tuple[str, int], str | None] = {}
    movable: list[Part] = []
    seen: set[tuple[str, int]] = set()
    for p in parts:
        if (p.model, p.rank) in seen:
            raise InvalidSnapshotError(f"part {p.model}#{p.rank} given twice")
        seen.add((p.model, p.rank))
        if p.current is not None and p.current not in index:
            raise InvalidSnapshotError(f"part {p.model}#{p.rank} is on unknown device {p.current!r}")
        if p.fixed:
            if p.current is None:
                raise InvalidSnapshotError(f"fixed part {p.model}#{p.rank} has no device")
            bins.hold(p, index[p.current])
            assignment[(p.model, p.rank)] = p.current
        else:
            movable.append(p)
            if p.current is not None:
                bins.reserved[index[p.current]] += p.weight_bytes
    movable.sort(key=lambda p: (-p.demand, p.model, p.rank))
    bins.start()

    i = 0
    while i < len(movable):
        k = i
        while k < len(movable) and movable[k].model == movable[i].model:
            k += 1
        group = movable[i:k]
        saved = [(index[p.current], bins.reserved[index[p.current]]) for p in group if p.current is not None]
        chosen = bins.place_group(group, tau, None)
        if bins.multi_node and len(group) > 1 and len(chosen) < len(group):  # once more, on the roomiest node
            for p, j in chosen:
                bins.take(p, j)
            for j, r in saved:
                bins.reserved[j] = r
            target, room = bins.roomiest_node(group[0])
            if target is not None and room >= len(group):
                chosen = bins.place_group(group, tau, target)
            else:  # no node can take it: released as if its first rank had been tried
                chosen = []
                bins.release(group[0])
        if len(chosen) < len(group):
            for p, j in chosen:  # all ranks or none: give back what the placed siblings took
                bins.take(p, j)
            for p in group[len(chosen) + 1 :]:
                bins.release(p)
            chosen = []
            if all(p.current is not None for p in group):
                # a resident model the plan cannot fit stays where it is: its memory is real
                chosen = [(p, index[p.current]) for p in group]  # type: ignore[index]
                for p, j in chosen:
                    bins.put(p, j)
        for p in group:
            assignment[(p.model, p.rank)] = None
        for p, j in chosen:
            assignment[(p.model, p.rank)] = bins.names[j]
        i = k
    return PlacementResult(bins.names, assignment, bins.W, bins.S, bins.U)
