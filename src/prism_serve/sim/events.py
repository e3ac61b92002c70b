"""The event heap and one small class per event.

Events are ordered by ``(time, priority, sequence number)``: at equal times a finished step (which
frees memory) is handled before an activation completes, that before an arrival, then the global
tick, and last a coalesced placement; the sequence number keeps insertion order among equals, so a
run is deterministic. Each event knows which handler of the simulator applies it (``EventHandler``,
which the simulator is); the loop is ``pop -> event.apply(sim)``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar, Protocol

__all__ = ["ActivationDone", "Arrival", "Event", "EventHandler", "EventQueue", "Place", "StepDone", "Tick"]


class EventHandler(Protocol):
    """What applies the events: sim/simulator.py's ``Simulator``."""

    def on_step_done(self, model: str, version: int, now: float) -> None: ...
    def on_activation_done(self, model: str, version: int, now: float) -> None: ...
    def on_arrival(self, index: int, now: float) -> None: ...
    def on_tick(self, now: float) -> None: ...
    def on_place(self, now: float) -> None: ...


class Event:
    __slots__ = ()
    priority: ClassVar[int] = 9

    def apply(self, sim: EventHandler, now: float) -> None:
        raise NotImplementedError


@dataclass(slots=True)
class StepDone(Event):
    """An engine step (or decode run) ends; ``version`` guards against a run cut short since."""

    priority: ClassVar[int] = 0
    model: str
    version: int

    def apply(self, sim: EventHandler, now: float) -> None:
        sim.on_step_done(self.model, self.version, now)


@dataclass(slots=True)
class ActivationDone(Event):
    """A model's weights are loaded on every device of its placement; its engine starts."""

    priority: ClassVar[int] = 1
    model: str
    version: int

    def apply(self, sim: EventHandler, now: float) -> None:
        sim.on_activation_done(self.model, self.version, now)


@dataclass(slots=True)
class Arrival(Event):
    """The next request of the workload arrives (``index`` into its columns)."""

    priority: ClassVar[int] = 2
    index: int

    def apply(self, sim: EventHandler, now: float) -> None:
        sim.on_arrival(self.index, now)


@dataclass(slots=True)
class Tick(Event):
    """The global placement tick: ``policy.place``, then deferred requests are submitted again."""

    priority: ClassVar[int] = 3

    def apply(self, sim: EventHandler, now: float) -> None:
        sim.on_tick(now)


@dataclass(slots=True)
class Place(Event):
    """The placement that follows activations finished ``placement_coalesce_s`` ago (one for all
    of them); after a tick at the same time, which makes it unneeded."""

    priority: ClassVar[int] = 4

    def apply(self, sim: EventHandler, now: float) -> None:
        sim.on_place(now)


class EventQueue:
    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, time: float, event: Event) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, event.priority, self._seq, event))

    def pop(self) -> tuple[float, Event]:
        time, _, _, event = heapq.heappop(self._heap)
        return time, event

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None
