"""By-hand operations on the served models (the server's admin routes and ``prism load|unload|pin``):
load a model (on a device, or where the policy's on-demand rule puts it), unload it with every
replica, pin it. ``Admin`` acts through the same activation and control loop as the policy does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prism_serve.control import Activate, ClusterSnapshot, Defer, Evict, ModelState, Reject, Request
from prism_serve.control.loop import ControlLoop
from prism_serve.control.policies import Policy
from prism_serve.errors import ConflictError, InvalidRequestError, quoted
from prism_serve.runtime import messages as msg
from prism_serve.runtime.activation import Activator
from prism_serve.runtime.models import ActivationError
from prism_serve.runtime.nodes import NodeSet
from prism_serve.runtime.state import ModelTable

__all__ = ["Admin"]


class Admin:
    def __init__(
        self,
        models: ModelTable,
        nodes: NodeSet,
        loop: ControlLoop,
        policy: Policy,
        activator: Activator,
        clock: Callable[[], float],
        snapshot: Callable[[float], ClusterSnapshot],
    ) -> None:
        self._models = models
        self._snapshot = snapshot  # the controller's cluster snapshot at a time
        self._nodes = nodes
        self._loop = loop
        self._policy = policy
        self._activator = activator
        self._clock = clock

    async def load(self, model: str, device: str | None = None) -> msg.ActivationPhases | None:
        """Activate ``model`` (on ``device`` or where the policy's on-demand rule would put it);
        returns its phases, or None if it was already active."""
        m = self._models.entry(model)
        self._loop.hold(m.replica_of or model, False)
        devices = self._nodes.devices
        if device is not None and device not in devices:
            raise InvalidRequestError(f"unknown device {quoted(device)}; devices: {', '.join(devices)}")
        if device is not None and m.state is not ModelState.EVICTED and m.device != device:
            raise ConflictError(f"{model} is {m.state.value} on {m.device}; unload it first to move it")
        if m.state is ModelState.ACTIVE:
            return None
        if m.state is ModelState.EVICTED:
            if device is not None and m.spec.tp > 1:
                raise InvalidRequestError(
                    f"{model} is tensor parallel over {m.spec.tp} devices: leave the device out and "
                    "the policy places its ranks"
                )
            placed = (device,) if device is not None else self._placement(model, m.spec.ttft_slo)
            if placed is None or any(d not in devices for d in placed):
                raise ActivationError(f"unknown device {placed!r}")
            self._activator.activate(m, placed)
        task = m.activation
        phases = await task if task is not None else None
        if m.state is not ModelState.ACTIVE:
            raise ActivationError(f"{model} did not activate")
        return phases

    def _placement(self, model: str, ttft_slo: float) -> tuple[str, ...] | None:
        """Where the policy's on-demand rule puts ``model`` now, one device per rank (the
        evictions it asks for start)."""
        now = self._clock()
        probe = Request(f"load-{model}", model, now, 1, ttft_slo)
        device = None
        snap = self._snapshot(now)
        for a in self._policy.on_request(probe, snap, now):
            if isinstance(a, Evict):
                self._activator.evict(self._models.entry(a.model), force=False)
            elif isinstance(a, Activate):
                device = a.devices
            elif isinstance(a, Reject | Defer):
                raise ActivationError(f"cannot load {model} now: {getattr(a, 'detail', '')}")
        return device

    async def unload(self, model: str, force: bool = True, drain_s: float = 0.0) -> bool:
        """Evict ``model``, every replica of it; with ``force`` its requests in flight end with
        ModelEvictedError. True if every resident replica was evicted; False if none was resident or
        one with requests in flight refused (without ``force``; idle replicas are still evicted).
        Without ``force``, ``drain_s`` > 0 waits up to that long for the requests in flight to
        finish (requests arriving meanwhile are served too) and evicts each replica as it empties.
        An unloaded model stays evicted (no prewarming) until a request for it arrives."""
        deadline = self._clock() + drain_s
        while True:
            evicted = await self._unload_once(model, force)
            if evicted or force or self._clock() >= deadline:
                return evicted
            if all(m.state is ModelState.EVICTED for m in self._models.slots(model)):
                return evicted
            await asyncio.sleep(0.05)  # a replica with requests in flight: wait for them

    async def _unload_once(self, model: str, force: bool) -> bool:
        replicas = self._models.slots(model)
        for m in replicas:
            if m.state is ModelState.ACTIVATING and m.activation is not None:
                await m.activation
        # Held before anything goes: a tick while the workers let go would otherwise prewarm it
        # again (a model that stays resident is not affected; its next request ends the hold).
        self._loop.hold(model)
        # every eviction starts before any is awaited: no tick can slip in between
        pending = [done for m in replicas if (done := self._activator.evict(m, force)) is not None]
        results = [bool(await done) for done in pending]
        return bool(results) and all(results)

    def pin(self, model: str, pinned: bool = True) -> None:
        self._models.served(model).pinned = pinned
