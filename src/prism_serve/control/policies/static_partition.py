"""``static-partition``: models share devices, but each gets a fixed slice of KV memory.

The MIG / fractional-GPU baseline of the paper (S-Partition, sections 2 and 7): colocated models
cannot use each other's unused KV memory, and nothing is ever evicted or moved. Placement happens
once per model, as an operator provisioning it by hand would do it:

- with the expected traffic (``rates``: requests/s per model, the forecast the operator sizes the
  partition for; the simulator and ``prism plan`` give each model's mean rate over the traffic):
  packing by expected demand. A model's demand on a device is its compute (busy fraction at its
  rate, ``ModelSnapshot.busy``) and its KV (what its requests hold at once by Little's law, over the
  memory the device has left after weights); a device's demand is the larger of the two sums. Each
  model goes to the device(s) where that comes out lowest among those whose memory still holds its
  weights and the minimum KV slice, in ``restarts`` orders (heaviest compute first, heaviest KV
  first, largest weights first, then seeded shuffles); the packing kept is the one that places
  the most models with the lowest demand on the most demanded device, the worst fit by memory
  (below) included among the candidates. Each packing is also tried on the first n devices for
  every n down to the fewest that could hold the models, so one more device never makes the kept
  packing worse by this measure (it may stay idle);
- without it, or with ``packing: memory``: largest weights first, each part on the device with
  the most memory left after weights (worst fit, so slices are as large as they can be); with the
  traffic known, on the first n devices for the n whose packing has the lowest peak demand.

Which packing needs fewer devices depends on the traffic (the demand estimate is a mean; bursts and
long prompts favour large slices): ``prism plan`` searches both (``plan_variants``) and answers with
the better, as an operator with a simulator would.

Every model's slice holds at least its longest request (``longest``: prompt plus output tokens, the
traffic's longest when provisioned from it; ``slice_tokens`` for a model not listed, the engine's
default context), plus the per-engine reserve, as an engine refuses to start without room for one
request of its context: a device takes a model only if its memory after weights covers every
member's floor. What is left above the floors is split in proportion to ``shares`` (1.0 for a
model not listed) times what the model needs: its floor plus, with ``rates``, the KV its requests
hold at once (Little's law), so a model of long requests or large KV per token gets the larger
slice. ``SetKVQuota`` enforces the slices. Admission is arrival order per engine
(``FifoQueue``), within the engine's slice; a slice never grows, so a request longer than its
slice can ever hold is refused at once (``PROMPT_TOO_LONG``) instead of waiting at the head of its
engine's queue forever.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from prism_serve.control.placement import on_one_node
from prism_serve.control.policies.base import (
    Knobs,
    Policy,
    PolicyMemo,
    min_kv_bytes,
    require,
)
from prism_serve.control.queues import FifoQueue, RequestQueue
from prism_serve.control.types import Action, Activate, ClusterSnapshot, ModelSnapshot, Request, SetKVQuota

__all__ = ["StaticPartitionKnobs", "StaticPartitionPolicy"]


@dataclass(slots=True, frozen=True)
class StaticPartitionKnobs(Knobs):
    shares: tuple[tuple[str, float], ...] = ()  # (model, relative share); models not listed get 1.0
    reserve_tokens: int = 256
    min_kv_fraction: float = 0.05
    # (model, expected requests/s): the traffic the partition is sized for; () places by memory alone
    rates: tuple[tuple[str, float], ...] = ()
    # (model, tokens): prompt plus output of the longest request its slice must hold
    longest: tuple[tuple[str, int], ...] = ()
    slice_tokens: int = 2048  # the same for a model not in ``longest`` (the engines' default context)
    restarts: int = 8  # packing orders tried when rates are given
    # "demand": with rates, pack by expected compute and KV; "memory": worst fit by memory always
    packing: str = "demand"

    def __post_init__(self) -> None:
        require(all(s > 0 for _, s in self.shares), "every share must be > 0")
        require(len({m for m, _ in self.shares}) == len(self.shares), "a model is listed twice in shares")
        require(all(r >= 0 for _, r in self.rates), "every rate must be >= 0")
        require(len({m for m, _ in self.rates}) == len(self.rates), "a model is listed twice in rates")
        require(all(t >= 1 for _, t in self.longest), "every longest request must be >= 1 token")
        require(len({m for m, _ in self.longest}) == len(self.longest), "a model is listed twice in longest")
        require(self.slice_tokens >= 1, "slice_tokens must be >= 1")
        require(self.restarts >= 1, "restarts must be >= 1")
        require(self.packing in ("demand", "memory"), "packing must be 'demand' or 'memory'")
        self._check_shared()


class StaticPartitionPolicy(Policy):
    name = "static-partition"
    keeps_fewer_devices = True  # a baseline: see Policy
    knobs_type = StaticPartitionKnobs
    knobs: StaticPartitionKnobs

    def __init__(self, knobs: StaticPartitionKnobs | None = None) -> None:
        super().__init__(knobs)
        self._longest = dict(self.knobs.longest)

    def new_queue(self, device: str) -> RequestQueue:
        return FifoQueue(device, reserve_tokens=self.knobs.reserve_tokens, final_quotas=True)

    @classmethod
    def plan_variants(cls) -> tuple[dict, ...]:
        return ({"packing": "demand"}, {"packing": "memory"})  # which packs better is the traffic's

    @classmethod
    def provisioned_knobs(cls, rates: Mapping[str, float], longest: Mapping[str, int] | None = None) -> dict:
        # the partition sized for the expected traffic: each model's rate and longest request
        sized = tuple(sorted((m, t) for m, t in (longest or {}).items() if t > 0))
        return {"rates": tuple(sorted(rates.items())), "longest": sized}

    def floor_bytes(self, m: ModelSnapshot) -> int:
        """The least KV ``m``'s slice holds on each of its devices: its longest request and the
        engine's reserve."""
        tokens = self._longest.get(m.model, self.knobs.slice_tokens) + self.knobs.reserve_tokens
        return math.ceil(tokens * m.kv_bytes_per_token / m.tp_size)

    def place(self, cluster: ClusterSnapshot, now: float, memo: PolicyMemo | None = None) -> list[Action]:
        if all(m.resident for m in cluster.models.values()):
            return []
        # The packing is a function of the knobs and of what _inputs reads. Snapshots hand the last
        # one on (ClusterSnapshot.carried), and it is used only where both are the same: asking
        # again, as on_request does for every request of a model the partition left out (at 500
        # models most of a simulation went to packing anew for each), costs a comparison.
        inputs = (self.knobs, _inputs(cluster))
        got = cluster.carried.get(_CARRIED)
        if got is not None and got[0] == inputs:
            return list(got[1])
        actions = self._packing(cluster)
        cluster.carried[_CARRIED] = (inputs, tuple(actions))
        return actions

    def _packing(self, cluster: ClusterSnapshot) -> list[Action]:
        """``place``'s actions, computed: a function of ``_inputs(cluster)`` and the knobs alone."""
        new = [m for m in cluster.models.values() if not m.resident]
        k = self.knobs
        members = {d: list(dev.models) for d, dev in cluster.devices.items()}
        left = {
            d: dev.capacity_bytes - sum(cluster.models[m].part_weight_bytes for m in dev.models)
            for d, dev in cluster.devices.items()
        }
        floor = self.floor_bytes
        floors = {d: sum(floor(cluster.models[m]) for m in dev.models) for d, dev in cluster.devices.items()}
        held: dict[str, float] = {}  # each model's expected KV held, with the traffic known
        if k.rates:
            compute, held = _expected_demand(cluster, dict(k.rates))
            placed = self._fewest_peak(cluster, new, compute, held, left, floors)[0]
        else:
            placed = self._worst_fit(cluster, list(cluster.devices), new, left, floors)
        actions: list[Action] = []
        changed: set[str] = set()
        for model, devices in placed:
            m = cluster.models[model]
            for d in devices:
                left[d] -= m.part_weight_bytes
                floors[d] += self.floor_bytes(m)
                members[d].append(model)
                changed.add(d)
            actions.append(Activate(model, devices))
        share = dict(k.shares)
        for d in cluster.devices:
            if d not in changed:
                continue
            # what is left above the floors goes by share x (floor + expected KV held)
            need = {n: floor(cluster.models[n]) for n in members[d]}
            weight = {n: share.get(n, 1.0) * (need[n] + held.get(n, 0.0)) for n in members[d]}
            above, total = max(0, left[d] - floors[d]), sum(weight.values())
            for n in members[d]:
                actions.append(SetKVQuota(n, d, need[n] + int(above * weight[n] / total)))
        return actions

    def _fits(
        self,
        cluster: ClusterSnapshot,
        use: list[str],
        left: dict[str, int],
        floors: dict[str, int],
        m: ModelSnapshot,
    ) -> list[str]:
        """Devices of ``use`` whose memory after weights, ``m``'s included, holds every member's floor
        and ``m``'s, and at least ``min_kv_fraction`` of the device."""
        least = self.knobs.min_kv_fraction
        need = self.floor_bytes(m)
        return [
            d
            for d in use
            if left[d] - m.part_weight_bytes >= max(min_kv_bytes(cluster.devices[d], least), floors[d] + need)
        ]

    def _fewest_peak(
        self,
        cluster: ClusterSnapshot,
        new: list[ModelSnapshot],
        compute: dict[str, float],
        kv: dict[str, float],
        left: dict[str, int],
        floors: dict[str, int],
    ) -> tuple[list[tuple[str, tuple[str, ...]]], tuple[int, float] | None]:
        """The packing's rule (``packing``) on the first ``n`` devices, for every ``n`` from all of
        them down to the fewest whose memory could hold the new models' weights and floors (and every
        device with a model already); the best by ``_balanced``'s key (most models placed, then the
        lowest peak demand), the most devices on a tie. So one more device never makes the chosen
        packing worse by the policy's own measure: it may leave the device idle and keep the packing
        of one fewer, as an operator who sized the partition would. ``compute`` and ``kv``: each
        model's expected demand (``_expected_demand``)."""
        names = list(cluster.devices)
        lowest = 1 + max((i for i, d in enumerate(names) if cluster.devices[d].models), default=0)
        need = sum(m.tp_size * (m.part_weight_bytes + self.floor_bytes(m)) for m in new)
        orders = self._orders(new, compute, kv) if self.knobs.packing == "demand" else []
        # every model's busy fraction on each of its devices (resident or new): once all are placed,
        # n devices carry this in sum and the busiest at least its average
        work = sum(compute[m.model] * m.tp_size for m in cluster.models.values())
        best: list[tuple[str, tuple[str, ...]]] = []
        best_key: tuple[int, float] | None = None
        for n in range(len(names), lowest - 1, -1):
            use = names[:n]
            if n < len(names) and sum(max(0, left[d] - floors[d]) for d in use) < need:
                break  # fewer devices cannot hold every new model
            if best_key is not None and best_key[0] == -len(new) and work / n > best_key[1]:
                break  # every model placed already, and n devices cannot have a lower peak
            placed, key = self._balanced(cluster, use, new, compute, kv, orders, left, floors)
            if best_key is None or key < best_key:
                best, best_key = placed, key
        return best, best_key

    def _worst_fit(
        self,
        cluster: ClusterSnapshot,
        use: list[str],
        new: list[ModelSnapshot],
        left: dict[str, int],
        floors: dict[str, int],
    ) -> list[tuple[str, tuple[str, ...]]]:
        """Largest weights first, each on the devices of ``use`` with the most memory left."""
        left, floors = dict(left), dict(floors)
        order = {d: i for i, d in enumerate(use)}
        out = []
        for m in sorted(new, key=lambda m: (-m.part_weight_bytes, m.model)):
            fits = self._fits(cluster, use, left, floors, m)
            if len(fits) < m.tp_size:
                continue
            group = on_one_node(sorted(fits, key=lambda d: (-left[d], order[d])), m.tp_size, str)
            if group is None:  # TP ranks never span nodes
                continue
            for d in group:
                left[d] -= m.part_weight_bytes
                floors[d] += self.floor_bytes(m)
            out.append((m.model, tuple(group)))
        return out

    def _orders(
        self, new: list[ModelSnapshot], compute: dict[str, float], kv: dict[str, float]
    ) -> list[list[ModelSnapshot]]:
        """The ``restarts`` orders the greedy packings take the new models in: heaviest compute
        first, heaviest KV first, largest weights first, then seeded shuffles."""
        orders = [
            sorted(new, key=lambda m: (-compute[m.model] * m.tp_size, -m.part_weight_bytes, m.model)),
            sorted(new, key=lambda m: (-kv[m.model] * m.tp_size, -m.part_weight_bytes, m.model)),
            sorted(new, key=lambda m: (-m.part_weight_bytes, -compute[m.model], m.model)),
        ]
        base = sorted(new, key=lambda m: m.model)
        while len(orders) < self.knobs.restarts:
            orders.append(_shuffled(base, len(orders)))
        return orders[: self.knobs.restarts]

    def _balanced(
        self,
        cluster: ClusterSnapshot,
        use: list[str],
        new: list[ModelSnapshot],
        compute: dict[str, float],
        kv: dict[str, float],
        orders: list[list[ModelSnapshot]],
        left: dict[str, int],
        floors: dict[str, int],
    ) -> tuple[list[tuple[str, tuple[str, ...]]], tuple[int, float]]:
        """On the devices of ``use``, the best of the greedy packings by expected demand, one per
        order of ``orders`` (``_orders``; none for ``packing: memory``), and of the worst fit by
        memory, with its key: most models placed, then the lowest demand on the most demanded
        device.

        A model's demand on each device it is placed on has two parts, each a fraction of what the
        device has: compute (its busy fraction at its expected rate, ``ModelSnapshot.busy``) and KV
        memory (the KV its requests hold at once by Little's law, rate x service time x mean tokens
        held, over the memory its device has left after weights). A device's demand is the larger of
        its models' summed compute and summed KV; each greedy step puts the model where that comes
        out lowest."""
        work = {d: sum(compute[m] for m in dev.models) for d, dev in cluster.devices.items()}
        kv_on = {d: sum(kv[m] for m in dev.models) for d, dev in cluster.devices.items()}
        order = {d: i for i, d in enumerate(use)}

        def demand(busy: float, bytes_: float, room: int) -> float:
            return max(busy, bytes_ / max(room, 1))

        def put(name: str, devices, room, floor_on, busy: dict[str, float], held: dict[str, float]):
            """A model onto ``devices``: their room, floors, compute and KV demand take it in."""
            m = cluster.models[name]
            w, floor = m.part_weight_bytes, self.floor_bytes(m)
            for d in devices:
                room[d] -= w
                floor_on[d] += floor
                busy[d] += compute[name]
                held[d] += kv[name]

        def score(out: list, room: dict[str, int], busy: dict[str, float], held: dict[str, float]):
            """A packing's key, from the devices' state after it: fewest unplaced, then lowest peak."""
            worst = max((demand(busy[d], held[d], room[d]) for d in cluster.devices), default=0.0)
            return -len(out), worst

        best = self._worst_fit(cluster, use, new, left, floors)
        room, floor_on, busy, held = dict(left), dict(floors), dict(work), dict(kv_on)
        for name, devices in best:
            put(name, devices, room, floor_on, busy, held)
        best_key = score(best, room, busy, held)
        for ranked in orders:
            room, floor_on, busy, held, out = dict(left), dict(floors), dict(work), dict(kv_on), []
            for m in ranked:
                fits = self._fits(cluster, use, room, floor_on, m)
                if len(fits) < m.tp_size:
                    continue
                w = m.part_weight_bytes
                fits.sort(
                    key=lambda d: (
                        demand(busy[d] + compute[m.model], held[d] + kv[m.model], room[d] - w),
                        -room[d],
                        order[d],
                    )
                )
                group = on_one_node(fits, m.tp_size, str)
                if group is None:
                    continue
                put(m.model, group, room, floor_on, busy, held)
                out.append((m.model, tuple(group)))
            key = score(out, room, busy, held)  # the state this packing left
            if key < best_key:
                best, best_key = out, key
        return best, best_key

    def on_request(self, request: Request, cluster: ClusterSnapshot, now: float) -> list[Action]:
        return self._route_or_wait_for_tick(
            request,
            cluster,
            now,
            defer="{m.model} gets its partition at the next placement tick",
            refuse="no device has a partition left for {m.model}",
        )


_CARRIED = ("static-partition", "packing")


def _inputs(cluster: ClusterSnapshot) -> tuple:
    """All of a snapshot that a packing reads: per model its name, whether it is resident, its
    sizes, TP size and profile (its expected demand comes from the knobs' rates and the profile,
    never from the measured rate), and per device its capacity and models."""
    models = tuple(
        (m.model, m.resident, m.weight_bytes, m.kv_bytes_per_token, m.tp_size, m.profile)
        for m in cluster.models.values()
    )
    devices = tuple((d, dev.capacity_bytes, dev.models) for d, dev in cluster.devices.items())
    return models, devices


def _expected_demand(cluster: ClusterSnapshot, rates: Mapping[str, float]) -> tuple[dict, dict]:
    """Each model's busy fraction at its expected rate, and the KV bytes per device its requests
    hold at once by Little's law (rate x service time x mean tokens held)."""
    compute: dict[str, float] = {}
    kv: dict[str, float] = {}
    for m in cluster.models.values():
        at = dataclasses.replace(m, rate=rates.get(m.model, 0.0))
        prof = at.profile
        compute[m.model] = at.busy
        held = prof.mean_prompt_tokens + prof.mean_output_tokens / 2
        kv[m.model] = at.rate * prof.service_s * held * m.kv_bytes_per_token / m.tp_size
    return compute, kv


def _shuffled(items: list, seed: int) -> list:
    """``items`` in an order that depends on ``seed`` alone (Fisher-Yates over a 64-bit LCG): the
    same snapshot gives the same packing, live and simulated, and control/ takes no randomness."""
    out, x = list(items), seed
    for i in range(len(out) - 1, 0, -1):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        j = (x >> 33) % (i + 1)
        out[i], out[j] = out[j], out[i]
    return out
