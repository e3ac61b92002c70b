"""Per-device request queues owned by the caller, and the simple orders the baselines use.

Every policy's ``new_queue(device)`` returns a :class:`RequestQueue`; the runtime or simulator keeps one
per device, pushes requests that ``on_request`` routed there (``Enqueue``), and calls the policy's
``admit`` with it. A queue holds all the mutable admission state there is, so two queues built the same
way and fed the same calls make the same decisions.

- :class:`FifoQueue`: one arrival-order queue per engine; an engine's head blocks only that engine.
- :class:`RoundRobinQueue`: per-model FIFOs served round-robin (MuxServe's ADBS prefill order).
- :class:`GroupQueue`: FIFO request groups, one model per group (QLM).
The deadline-ordered Algorithm 2 queue is in ``admission.py``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping

from prism_serve.control.capacity import DeviceRoom, Fit
from prism_serve.control.types import (
    Action,
    DeviceSnapshot,
    Dispatch,
    DuplicateRequestError,
    EngineSnapshot,
    InvalidSnapshotError,
    Origin,
    Reject,
    RejectReason,
    Request,
)

__all__ = ["FifoQueue", "GroupQueue", "RequestQueue", "RoundRobinQueue"]


class RequestQueue:
    """Base class: request ids, per-model counts, and the push/cancel/admit contract."""

    def __init__(self, device: str, *, reserve_tokens: int = 0) -> None:
        if reserve_tokens < 0:
            raise InvalidSnapshotError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        self.device = device
        self.reserve_tokens = reserve_tokens
        # the fair-share level a request's tenant is at now (the control loop's FairShare.current),
        # for queues that re-rank queued requests as their tenants' levels change; None: each
        # request keeps the level it arrived with (Request.share)
        self.shares: Callable[[Origin], int] | None = None
        self._model_counts: dict[str, int] = {}
        self._ids: set[str] = set()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._ids

    def models(self) -> tuple[str, ...]:
        """Models with at least one queued request (for ``DeviceSnapshot.queued_models``)."""
        return tuple(self._model_counts)

    def push(self, request: Request) -> None:
        if request.req_id in self._ids:
            raise DuplicateRequestError(f"request {request.req_id!r} is already queued on {self.device}")
        self._ids.add(request.req_id)
        self._model_counts[request.model] = self._model_counts.get(request.model, 0) + 1
        self._push(request)

    def cancel(self, req_id: str) -> bool:
        """Drop a queued request (client went away). False if it is not queued here."""
        if req_id not in self._ids:
            return False
        self._forget(self._cancel(req_id))
        return True

    def admit(
        self, now: float, device: DeviceSnapshot, engines: Mapping[str, EngineSnapshot]
    ) -> list[Action]:
        """Dispatches (and rejections) for this device at ``now``; removes them from the queue."""
        raise NotImplementedError

    def requests(self) -> list[Request]:
        raise NotImplementedError

    def first_token(self, req_id: str, at: float | None) -> None:
        """A request this queue dispatched got its first token at ``at`` (None: it left without
        one). Queues that learn from their predictions override it."""

    # subclass hooks
    def _push(self, request: Request) -> None:
        raise NotImplementedError

    def _cancel(self, req_id: str) -> Request:
        raise NotImplementedError

    def _forget(self, request: Request) -> None:
        self._ids.discard(request.req_id)
        left = self._model_counts[request.model] - 1
        if left:
            self._model_counts[request.model] = left
        else:
            del self._model_counts[request.model]

    def _emit(self, out: list[Action], action: Dispatch | Reject) -> None:
        self._forget(action.request)
        out.append(action)


def _reject_never(request: Request) -> Reject:
    return Reject(
        request,
        RejectReason.PROMPT_TOO_LONG,
        f"{request.prompt_tokens} prompt tokens need more KV than the engine can ever hold"
        " (its device, or its fixed KV slice)",
    )


class FifoQueue(RequestQueue):
    """Arrival order per engine, as a dedicated or statically partitioned engine would serve it.

    Each model's head waits for its own engine only; engines do not block each other, except that a
    head waiting for the device's shared memory stops others from taking that memory first.
    ``final_quotas``: the engines' KV quotas never grow (``DeviceRoom``), so a head longer than its
    engine's quota can hold is refused instead of blocking its engine for good.
    """

    def __init__(self, device: str, *, reserve_tokens: int = 0, final_quotas: bool = False) -> None:
        super().__init__(device, reserve_tokens=reserve_tokens)
        self.final_quotas = final_quotas
        self._fifos: dict[str, deque[Request]] = {}

    def _push(self, request: Request) -> None:
        self._fifos.setdefault(request.model, deque()).append(request)

    def _cancel(self, req_id: str) -> Request:
        for fifo in self._fifos.values():
            for r in fifo:
                if r.req_id == req_id:
                    fifo.remove(r)
                    return r
        raise AssertionError("unreachable: id was in the queue")  # pragma: no cover

    def requests(self) -> list[Request]:
        return sorted((r for f in self._fifos.values() for r in f), key=lambda r: r.arrival)

    def admit(
        self, now: float, device: DeviceSnapshot, engines: Mapping[str, EngineSnapshot]
    ) -> list[Action]:
        room = DeviceRoom(device, engines, self.reserve_tokens, self.final_quotas)
        out: list[Action] = []
        # oldest heads first, so the shared pool goes to whoever has waited longest
        heads = sorted((f[0].arrival, m) for m, f in self._fifos.items() if f)
        for _, model in heads:
            fifo = self._fifos[model]
            while fifo:
                r = fifo[0]
                fit = room.fit(model, r.prompt_tokens)
                if fit is Fit.NEVER:
                    fifo.popleft()
                    self._emit(out, _reject_never(r))
                    continue
                if fit is not Fit.OK:
                    if fit is Fit.NO_MEMORY and room.short_of_shared(model, r.prompt_tokens):
                        room.shared_blocked = True
                    break
                fifo.popleft()
                room.take(model, r.prompt_tokens)
                self._emit(out, Dispatch(r, self.device))
        return out


class RoundRobinQueue(FifoQueue):
    """Per-model FIFOs visited round-robin, one request per visit (MuxServe ADBS prefill order).

    The position of the round-robin pointer is queue state, so fairness carries across calls.
    """

    def __init__(self, device: str, *, reserve_tokens: int = 0) -> None:
        super().__init__(device, reserve_tokens=reserve_tokens)
        self._next = 0
        self._order: list[str] = []

    def _push(self, request: Request) -> None:
        if request.model not in self._fifos:
            self._order.append(request.model)
        super()._push(request)

    def admit(
        self, now: float, device: DeviceSnapshot, engines: Mapping[str, EngineSnapshot]
    ) -> list[Action]:
        room = DeviceRoom(device, engines, self.reserve_tokens)
        out: list[Action] = []
        blocked: set[str] = set()
        n = len(self._order)
        idle_visits = 0
        i = self._next % n if n else 0
        while n and idle_visits < n:
            model = self._order[i]
            fifo = self._fifos[model]
            i = (i + 1) % n
            if model in blocked or not fifo:
                idle_visits += 1
                continue
            r = fifo[0]
            fit = room.fit(model, r.prompt_tokens)
            if fit is Fit.NEVER:
                fifo.popleft()
                self._emit(out, _reject_never(r))
                idle_visits = 0
                continue
            if fit is not Fit.OK:
                blocked.add(model)
                idle_visits += 1
                continue
            fifo.popleft()
            room.take(model, r.prompt_tokens)
            self._emit(out, Dispatch(r, self.device))
            idle_visits = 0
            self._next = i
        return out


class GroupQueue(RequestQueue):
    """FIFO request groups (QLM): consecutive requests of one model form a group of at most
    ``max_group_size``; only the head group is served, and a group of a model that is not loaded
    here needs the device swapped to that model first (the QLM policy decides the swap)."""

    def __init__(self, device: str, *, reserve_tokens: int = 0, max_group_size: int = 32) -> None:
        super().__init__(device, reserve_tokens=reserve_tokens)
        if max_group_size < 1:
            raise InvalidSnapshotError(f"max_group_size must be >= 1, got {max_group_size}")
        self.max_group_size = max_group_size
        self._groups: deque[tuple[str, OrderedDict[str, Request]]] = deque()
        self._tail_sealed = False  # the tail group started dispatching; later arrivals open a new one

    def _push(self, request: Request) -> None:
        if (
            self._groups
            and not self._tail_sealed
            and self._groups[-1][0] == request.model
            and len(self._groups[-1][1]) < self.max_group_size
        ):
            self._groups[-1][1][request.req_id] = request
            return
        self._groups.append((request.model, OrderedDict({request.req_id: request})))
        self._tail_sealed = False

    def _cancel(self, req_id: str) -> Request:
        for i, (_, members) in enumerate(self._groups):
            if req_id in members:
                r = members.pop(req_id)
                if not members:
                    del self._groups[i]
                return r
        raise AssertionError("unreachable: id was in the queue")  # pragma: no cover

    def requests(self) -> list[Request]:
        return [r for _, members in self._groups for r in members.values()]

    def head_model(self) -> str | None:
        return self._groups[0][0] if self._groups else None

    def group_models(self) -> Iterable[str]:
        return (model for model, _ in self._groups)

    def admit(
        self, now: float, device: DeviceSnapshot, engines: Mapping[str, EngineSnapshot]
    ) -> list[Action]:
        """Dispatch the head group's requests, in arrival order, while its engine has room."""
        room = DeviceRoom(device, engines, self.reserve_tokens)
        out: list[Action] = []
        while self._groups:
            model, members = self._groups[0]
            while members:
                r = next(iter(members.values()))
                fit = room.fit(model, r.prompt_tokens)
                if fit is Fit.NEVER:
                    members.popitem(last=False)
                    self._emit(out, _reject_never(r))
                    continue
                if fit is not Fit.OK:
                    return out
                members.popitem(last=False)
                room.take(model, r.prompt_tokens)
                self._emit(out, Dispatch(r, self.device))
                if len(self._groups) == 1:
                    # a group in service takes no newcomers, or a busy model would never yield
                    self._tail_sealed = True
            self._groups.popleft()
        return out
