"""The controller's by-hand operations (the server's admin routes): load a model (on a device or
where the policy's on-demand rule puts it), unload it, pin it. A mixin of Controller, kept apart
from the request path and the control loop it drives."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from prism_serve.control import Activate, Defer, Evict, ModelState, Reject, Request
from prism_serve.errors import ConflictError, InvalidRequestError, quoted
from prism_serve.runtime import messages as msg
from prism_serve.runtime.state import ActivationError, ModelStatus

if TYPE_CHECKING:
    from prism_serve.runtime.controller import Controller

__all__ = ["AdminOps"]


class AdminOps:
    def status(self: Controller) -> list[ModelStatus]:
        """One status per served model, its replicas inside."""
        snap = self.snapshot()
        return [
            ModelStatus.of(
                [(self.models[n], snap.models[n].num_queued) for n in (name, *self.replicas[name])]
            )
            for name in self.specs
        ]

    async def load(self: Controller, model: str, device: str | None = None) -> msg.ActivationPhases | None:
        """Activate ``model`` (on ``device`` or where the policy's on-demand rule would put it);
        returns its phases, or None if it was already active."""
        m = self._model(model)
        self.loop.hold(m.replica_of or model, False)
        if device is not None and device not in self.devices:
            raise InvalidRequestError(f"unknown device {quoted(device)}; devices: {', '.join(self.devices)}")
        if device is not None and m.state is not ModelState.EVICTED and m.device != device:
            raise ConflictError(f"{model} is {m.state.value} on {m.device}; unload it first to move it")
        if m.state is ModelState.ACTIVE:
            return None
        if m.state is ModelState.EVICTED:
            if device is None:
                probe = Request(f"load-{model}", model, self._now(), 1, m.spec.ttft_slo)
                now = self._now()
                for a in self.policy.on_request(probe, self.snapshot(now), now):
                    if isinstance(a, Evict):
                        self._start_evict(self._model(a.model), force=False)
                    elif isinstance(a, Activate):
                        device = a.device
                    elif isinstance(a, Reject | Defer):
                        raise ActivationError(f"cannot load {model} now: {getattr(a, 'detail', '')}")
            if device not in self.devices:
                raise ActivationError(f"unknown device {device!r}")
            self._start_activate(m, device)
        task = m.activation
        phases = await task if task is not None else None
        if m.state is not ModelState.ACTIVE:
            raise ActivationError(f"{model} did not activate")
        return phases

    async def unload(self: Controller, model: str, force: bool = True, drain_s: float = 0.0) -> bool:
        """Evict ``model``, every replica of it; with ``force`` its requests in flight end with
        ModelEvictedError. True if every resident replica was evicted; False if none was resident or
        one with requests in flight refused (without ``force``; idle replicas are still evicted).
        Without ``force``, ``drain_s`` > 0 waits up to that long for the requests in flight to
        finish (requests arriving meanwhile are served too) and evicts each replica as it empties.
        An unloaded model stays evicted (no prewarming) until a request for it arrives."""
        deadline = self._now() + drain_s
        while True:
            evicted = await self._unload_once(model, force)
            if evicted or force or self._now() >= deadline or self._all_evicted(model):
                return evicted
            await asyncio.sleep(0.05)  # a replica with requests in flight: wait for them

    def _all_evicted(self: Controller, model: str) -> bool:
        return all(self._model(n).state is ModelState.EVICTED for n in (model, *self.replicas[model]))

    async def _unload_once(self: Controller, model: str, force: bool) -> bool:
        self._served(model)
        replicas = [self._model(name) for name in (model, *self.replicas[model])]
        for m in replicas:
            if m.state is ModelState.ACTIVATING and m.activation is not None:
                await m.activation
        # Held before anything goes: a tick while the workers let go would otherwise prewarm it
        # again (a model that stays resident is not affected; its next request ends the hold).
        self.loop.hold(model)
        # every eviction starts before any is awaited: no tick can slip in between
        pending = [done for m in replicas if (done := self._start_evict(m, force)) is not None]
        results = [bool(await done) for done in pending]
        return bool(results) and all(results)

    def pin(self: Controller, model: str, pinned: bool = True) -> None:
        self._served(model).pinned = pinned
