"""Models onto workers and off them: activation and eviction, the controller's residency effects.

An activation (paper section 5.2) takes an idle pre-started worker of the device from the pool
(waiting first for evictions the same decision ordered there), sends it ``ActivateModel`` with the
host cache file of the worker's own node, retries while the device ledger refuses the weight pages
(other engines' KV drains as their requests finish), and once the worker answers marks the model
active and hands the loop ``activation_done``; the pool then starts the worker's replacement. A
failed or timed-out activation evicts the model again and fails the requests that waited for it.

An eviction is graceful unless forced: a worker with requests in flight refuses it, and the model
stays active. The model leaves the snapshots as the eviction starts; its pages stay in the ledger
until the worker has unmapped them.

The ``Activator`` also decides what an idle worker prepares ahead of activations: its own node's
host cache files of the models on its engine, and for a vLLM worker the engine shape to build
(``vllm_shapes``), by the models' ``engine_key``s (engine/vllm_engine.py: models of one shape share
a pooled vLLM engine).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable

import msgspec

from prism_serve.control import ModelState
from prism_serve.control.loop import ControlLoop
from prism_serve.engine.vllm_engine import engine_key
from prism_serve.errors import PrismError, WorkerDiedError, error_class
from prism_serve.runtime import messages as msg
from prism_serve.runtime.loading import DeviceMemoryExhaustedError
from prism_serve.runtime.models import ActivationError
from prism_serve.runtime.nodes import NodeSet
from prism_serve.runtime.requests import Requests
from prism_serve.runtime.state import ModelEntry, ModelTable
from prism_serve.runtime.weight_cache import HostWeightCache
from prism_serve.runtime.workers import WorkerHandle, WorkerPool, WorkerState

__all__ = ["ActivationListener", "Activator"]

logger = logging.getLogger(__name__)

# Observers of finished activations (model, device, phases): the server's metrics.
ActivationListener = Callable[[str, str, msg.ActivationPhases], None]


class Activator:
    def __init__(
        self,
        pool: WorkerPool,
        models: ModelTable,
        nodes: NodeSet,
        loop: ControlLoop,
        requests: Requests,
        cache: HostWeightCache,
        clock: Callable[[], float],
        *,
        timeout_s: float,
        vllm_compile: bool,
    ) -> None:
        self._pool = pool
        self._models = models
        self._nodes = nodes
        self._loop = loop
        self._requests = requests
        self._cache = cache
        self._clock = clock
        self.timeout_s = timeout_s  # from the decision to the worker's answer, retries included
        self.vllm_compile = vllm_compile  # the engines vLLM workers build ahead are compiled
        self.listeners: list[ActivationListener] = []
        self._engine_keys: dict[str, str] = {}  # vLLM models' engine_key, by model
        self._evictions: defaultdict[str, list[asyncio.Future]] = defaultdict(list)  # by device
        self._tasks: set[asyncio.Task] = set()  # evictions in flight (strong references)

    # ---- activation ---------------------------------------------------------------------------

    def activate(self, m: ModelEntry, device: str) -> None:
        """Start activating ``m`` on ``device`` (``m.activation`` is the task; nothing if it is
        resident or on its way already)."""
        if m.state is not ModelState.EVICTED:
            return
        now = self._clock()
        m.state, m.device, m.placed_at = ModelState.ACTIVATING, device, now
        m.activation = asyncio.create_task(self._activate(m, device, now))

    async def _activate(self, m: ModelEntry, device: str, decided_at: float) -> msg.ActivationPhases | None:
        deadline = decided_at + self.timeout_s
        handle: WorkerHandle | None = None
        try:
            # Evictions the policy ordered before this activation free the memory it needs.
            pending = [f for f in self._evictions[device] if not f.done()]
            if pending:
                await asyncio.wait(pending, timeout=max(0.0, deadline - self._clock()))
            handle = await asyncio.wait_for(
                self._pool.take(device, m.spec.engine_kind, m.spec.source, self.engine_key(m)),
                max(0.0, deadline - self._clock()),
            )
            handle.model = m.spec.name
            m.worker = handle
            message = self._activate_message(m, device, decided_at)
            while True:
                reply = await self._request(handle, message)
                if isinstance(reply, msg.ModelActivated):
                    handle.last_source, handle.engine_key = m.spec.source, self.engine_key(m)
                    break
                retry = reply.error == DeviceMemoryExhaustedError.__name__ and self._clock() < deadline
                if not retry:
                    raise error_class(reply.error)(f"activating {m.spec.name} on {device}: {reply.message}")
                await asyncio.sleep(0.05)  # other engines' KV pages drain as their requests finish
        except Exception as e:  # whatever went wrong, waiting requests must hear about it
            self._refill(handle, device, m)
            if m.activation is not asyncio.current_task():
                return None  # detached (its node left): the model has moved on without it
            if isinstance(e, TimeoutError):
                e = ActivationError(f"{m.spec.name}: no worker on {device} within {self.timeout_s} s")
            elif not isinstance(e, PrismError):
                logger.exception("activating %s failed", m.spec.name)
                e = ActivationError(f"activating {m.spec.name}: {type(e).__name__}: {e}")
            self._activation_failed(m, handle, e)
            return None
        self._refill(handle, device, m)
        self._activated(m, handle, device, reply)
        return reply.phases

    def _activated(self, m: ModelEntry, handle: WorkerHandle, device: str, reply: msg.ModelActivated) -> None:
        handle.state = WorkerState.SERVING
        handle.stats = reply.stats
        m.state, m.max_kv_bytes, m.last_phases = ModelState.ACTIVE, reply.max_kv_bytes, reply.phases
        m.num_activations += 1
        # Idle time counts from the activation too: a model loaded ahead of its first request (by
        # an admin, or a migration) is not "idle forever" and evicted on the next tick.
        m.activated_at = self._clock()
        if m.kv_quota is not None:
            self._pool.try_send(handle, msg.SetKVLimit(m.kv_quota))
        logger.info(
            "activated %s on %s in %.3f s %s", m.spec.name, device, reply.phases.total_s, reply.phases
        )
        try:
            for listener in self.listeners:
                listener(m.spec.name, device, reply.phases)
            self._loop.activation_done(m.spec.name, device, self._clock())
        except Exception:  # the model is active; the next tick admits what this could not
            logger.exception("placing and admitting after %s's activation failed", m.spec.name)

    def _activation_failed(self, m: ModelEntry, handle: WorkerHandle | None, error: PrismError) -> None:
        logger.warning("activation of %s failed: %s", m.spec.name, error)
        m.state, m.device, m.worker = ModelState.EVICTED, None, None
        if handle is not None and handle.state is WorkerState.ACTIVATING:
            handle.state, handle.model = WorkerState.IDLE, None
        waiting = self._loop.activation_failed(m.spec.name, self._clock())
        self._requests.fail_ids((r.req_id for r in waiting), lambda _: ActivationError(str(error)))

    def _activate_message(self, m: ModelEntry, device: str, decided_at: float) -> msg.ActivateModel:
        """What a worker on ``device`` activates ``m`` from: its own node's copy of the weights."""
        base = m.replica_of or m.spec.name
        adapters = [a.file for a in self._models.adapters.of_base(base)]
        message = m.activate_message(decided_at, adapters)
        paths = self._nodes.activate_paths(device, m.spec.name)
        if paths is not None:
            message = msgspec.structs.replace(message, cache_path=paths[0], tokenizer_path=paths[1])
        return message

    def _refill(self, handle: WorkerHandle | None, device: str, m: ModelEntry) -> None:
        """An activation that took a worker from the pool is done: the pool starts its replacement."""
        if handle is not None:
            self._pool.refill(device, m.spec.engine_kind)

    # ---- what idle workers prepare ------------------------------------------------------------

    def engine_key(self, m: ModelEntry) -> str | None:
        """A vLLM model's engine_key: which pooled vLLM engine can serve it (None: built-in)."""
        if m.spec.engine_kind != "vllm":
            return None
        key = self._engine_keys.get(m.spec.name)
        if key is None:
            key = self._engine_keys[m.spec.name] = engine_key(m.cached.source, m.spec.engine)
        return key

    def vllm_shapes(self) -> list[msg.EngineShape]:
        """The engine a fresh vLLM worker builds ahead of activations: the shape whose models had
        the most requests lately (every replica counted), then the one most vLLM models share
        (fine-tunes of one base; at start-up, before any request, this decides), the first
        configured on a tie. A worker holds one vLLM engine; a model of another shape rebuilds
        it at activation (eager: only a build ahead is compiled, under ``vllm_compile``)."""
        now = self._clock()
        groups: dict[str, tuple[float, set[str], ModelEntry]] = {}  # rate, models, first model
        for name, m in self._models.items():
            key = self.engine_key(m)
            if key is None:
                continue
            rate, names, first = groups.get(key, (0.0, set(), m))
            groups[key] = (rate + self._loop.rates.rate(name, now), names | {m.spec.name}, first)
        if not groups:
            return []
        _, _, m = max(groups.values(), key=lambda g: (g[0], len(g[1])))  # max keeps the first of equals
        return [msg.EngineShape(m.cached.source, m.spec.engine, self.vllm_compile)]

    def prepare_message(self, handle: WorkerHandle) -> msg.Prepare:
        """What an idle worker opens ahead of activations: its own node's host cache files of the
        models on its engine (and for a vLLM worker, the engine to build)."""
        if handle.device.node:
            message = self._nodes.prepare_message(handle.device.node, handle.engine)
            if message is None:  # that node's cache is not filled yet
                return msg.Prepare([], [])
        else:
            message = self._cache.prepare_message(engine=handle.engine)
        if handle.engine == "vllm":
            return msgspec.structs.replace(message, engines=self.vllm_shapes())
        return message

    # ---- eviction -----------------------------------------------------------------------------

    def evict(self, m: ModelEntry, force: bool) -> asyncio.Future | None:
        """Start evicting ``m``; the future says whether it went (None: it was not active). Without
        ``force`` a model with requests in flight is not evicted (the future says False)."""
        if m.state is not ModelState.ACTIVE or m.worker is None:
            return None
        handle, device = m.worker, m.device
        done = asyncio.get_running_loop().create_future()
        if handle.in_flight and not force:
            # The worker would refuse. Refusing here keeps the model ACTIVE throughout: shown evicted
            # while a refusal is on its way, it could be activated a second time meanwhile.
            done.set_result(False)
            return done
        self._evictions[device].append(done)
        # The model leaves the snapshots now; its pages stay in the ledger until the worker is done.
        m.state, m.device, m.worker = ModelState.EVICTED, None, None
        handle.state = WorkerState.EVICTING
        self._tasks.add(task := asyncio.create_task(self._evict(m, handle, device, force, done)))
        task.add_done_callback(self._tasks.discard)
        return done

    async def _evict(
        self, m: ModelEntry, handle: WorkerHandle, device: str, force: bool, done: asyncio.Future
    ) -> None:
        try:
            reply = await self._request(handle, msg.EvictModel(m.spec.name, force))
            if isinstance(reply, msg.EvictRefused) and m.state is not ModelState.EVICTED:
                # placed again while the refusal was on its way: that placement stands and this
                # engine goes, so no model ever holds two engines
                logger.warning(
                    "%s was placed again while its engine on %s refused to go", m.spec.name, device
                )
                reply = await self._request(handle, msg.EvictModel(m.spec.name, True))
        except WorkerDiedError:
            reply = None
        finally:
            self._evictions[device].remove(done)
        if isinstance(reply, msg.EvictRefused):
            # requests the controller had finished were still in the engine (an abort on its way)
            handle.state = WorkerState.SERVING
            m.state, m.device, m.worker = ModelState.ACTIVE, device, handle
            done.set_result(False)
            return
        if handle.state is WorkerState.EVICTING:
            handle.state, handle.model, handle.stats = WorkerState.IDLE, None, None
        m.num_evictions += 1
        done.set_result(True)
        self._loop.capacity_freed([device], self._clock())

    def set_kv_quota(self, m: ModelEntry, quota_bytes: int | None) -> None:
        m.kv_quota = quota_bytes
        if m.worker is not None and m.state is ModelState.ACTIVE:
            self._pool.try_send(m.worker, msg.SetKVLimit(quota_bytes))

    # ---- the workers' answers and deaths ------------------------------------------------------

    async def _request(self, handle: WorkerHandle, message: msg.Message) -> msg.Message:
        """Send an ActivateModel/EvictModel and wait for the worker's reply to it."""
        handle.reply = asyncio.get_running_loop().create_future()
        self._pool.send(handle, message)
        try:
            return await handle.reply
        finally:
            handle.reply = None

    @staticmethod
    def on_reply(handle: WorkerHandle, reply: msg.Message) -> None:
        """A worker's answer to the ActivateModel or EvictModel it was sent."""
        if handle.reply is not None and not handle.reply.done():
            handle.reply.set_result(reply)

    def worker_died(self, handle: WorkerHandle) -> None:
        """Its model (if it still ran there) is evicted, and its queued requests go back through
        the policy (which activates it elsewhere)."""
        model = self._models.get(handle.model or "")
        if model is None:
            return
        if model.worker is handle:
            model.state, model.device, model.worker = ModelState.EVICTED, None, None
            model.num_running = 0
        self._loop.worker_died(model.spec.name, self._clock())

    def devices_lost(self, devices: set[str]) -> None:
        """The models on ``devices`` (gone with their node) are evicted at once; an activation in
        flight there fails when its worker is declared dead, detached first so that its failure
        cannot undo a placement made meanwhile."""
        for m in self._models.values():
            if m.device in devices:
                m.state, m.device, m.worker, m.activation = ModelState.EVICTED, None, None, None
