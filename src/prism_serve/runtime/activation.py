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
import contextlib
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

    def activate(self, m: ModelEntry, devices: tuple[str, ...]) -> None:
        """Start activating ``m`` on ``devices`` (one per tensor parallel rank; ``m.activation`` is
        the task; nothing if it is resident or on its way already)."""
        if m.state is not ModelState.EVICTED:
            return
        if len(devices) != m.spec.tp:
            raise ActivationError(f"{m.spec.name} has tp: {m.spec.tp}; placed on {len(devices)} device(s)")
        now = self._clock()
        m.state, m.device, m.devices, m.placed_at = ModelState.ACTIVATING, devices[0], devices, now
        if m.spec.tp > 1:
            m.activation = asyncio.create_task(self._activate_ranks(m, devices, now))
        else:
            m.activation = asyncio.create_task(self._activate(m, devices[0], now))

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
            self._activation_failed(m, handle, self._as_activation_error(m, e, device))
            return None
        self._refill(handle, device, m)
        self._activated(m, handle, device, reply)
        return reply.phases

    async def _activate_ranks(
        self, m: ModelEntry, devices: tuple[str, ...], decided_at: float
    ) -> msg.ActivationPhases | None:
        """A tensor parallel model: one worker per device, each sent its rank's ActivateModel at
        once (each copies its own shard from the host cache, in parallel). The ranks meet at a
        rendezvous file and agree whether all of them made it, so they fail together; where the
        only failure was memory, all of them are tried again until the deadline."""
        deadline = decided_at + self.timeout_s
        handles: list[WorkerHandle] = []
        activated: list[WorkerHandle] = []  # ranks that made it while another died
        try:
            pending = [f for d in devices for f in self._evictions[d] if not f.done()]
            if pending:
                await asyncio.wait(pending, timeout=max(0.0, deadline - self._clock()))
            for d in devices:
                h = await asyncio.wait_for(
                    self._pool.take(d, m.spec.engine_kind, m.spec.source), max(0.0, deadline - self._clock())
                )
                h.model = m.spec.name
                handles.append(h)
            m.worker, m.followers = handles[0], handles[1:]
            while True:
                replies = await self._activate_once(m, handles, decided_at)
                failed = [r for r in replies if not isinstance(r, msg.ModelActivated)]
                if not failed:
                    break
                died = next((r for r in failed if isinstance(r, BaseException)), None)
                if died is not None:
                    ok = zip(handles, replies, strict=True)
                    activated = [h for h, r in ok if isinstance(r, msg.ModelActivated)]
                    raise died
                short = DeviceMemoryExhaustedError.__name__
                if any(r.error != short for r in failed) or self._clock() >= deadline:
                    first = next((r for r in failed if r.error != short), failed[0])
                    raise error_class(first.error)(f"activating {m.spec.name} on {devices}: {first.message}")
                await asyncio.sleep(0.05)  # other engines' KV pages drain as their requests finish
        except Exception as e:
            for h, d in zip(handles, devices, strict=False):
                self._refill(h, d, m)
                if h in activated:  # its group is broken: it gives its pages back, says ModelLost
                    h.state = WorkerState.EVICTING
                elif h.state is WorkerState.ACTIVATING:
                    h.state, h.model = WorkerState.IDLE, None
            if m.activation is not asyncio.current_task():
                return None
            self._activation_failed(m, None, self._as_activation_error(m, e, f"each of {devices}"))
            return None
        for h, d in zip(handles, devices, strict=True):
            self._refill(h, d, m)
        for h, reply in zip(handles[1:], replies[1:], strict=True):
            h.state, h.stats, h.last_source = WorkerState.SERVING, reply.stats, m.spec.source
        handles[0].last_source = m.spec.source
        self._activated(m, handles[0], devices[0], replies[0])
        return replies[0].phases

    async def _activate_once(
        self, m: ModelEntry, handles: list[WorkerHandle], decided_at: float
    ) -> list[msg.Message | BaseException]:
        """Every rank's reply to one try (a WorkerDiedError where its worker died)."""
        rendezvous = self._cache.rendezvous_file()
        try:
            messages = [
                m.activate_message(decided_at, rank=r, tp_init=f"file://{rendezvous}")
                for r in range(len(handles))
            ]
            ranks = list(zip(handles, messages, strict=True))
            # each rank reads its node's copy (all on one node: placement keeps a group together)
            requests = [self._request(h, self._on_node(x, m, h.device.name)) for h, x in ranks]
            return list(await asyncio.gather(*requests, return_exceptions=True))
        finally:  # every rank has answered: joined and opened, or given up
            rendezvous.unlink(missing_ok=True)
            rendezvous.with_name(rendezvous.name + ".ar").unlink(missing_ok=True)  # CPU ranks' sums

    def _activated(self, m: ModelEntry, handle: WorkerHandle, device: str, reply: msg.ModelActivated) -> None:
        self._cache.drop_prefixes(m.spec.name)  # restored into the engine, or of no use to it
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

    def _as_activation_error(self, m: ModelEntry, e: Exception, where: str) -> PrismError:
        """What the requests that waited for ``m``'s activation hear: the named error, or an
        ActivationError for a timeout (no worker on ``where``) or anything unexpected."""
        if isinstance(e, TimeoutError):
            return ActivationError(f"{m.spec.name}: no worker on {where} within {self.timeout_s} s")
        if not isinstance(e, PrismError):
            logger.exception("activating %s failed", m.spec.name)
            return ActivationError(f"activating {m.spec.name}: {type(e).__name__}: {e}")
        return e

    def _activation_failed(self, m: ModelEntry, handle: WorkerHandle | None, error: PrismError) -> None:
        logger.warning("activation of %s failed: %s", m.spec.name, error)
        m.left_devices()
        if handle is not None and handle.state is WorkerState.ACTIVATING:
            handle.state, handle.model = WorkerState.IDLE, None
        waiting = self._loop.activation_failed(m.spec.name, self._clock())
        self._requests.fail_ids((r.req_id for r in waiting), lambda _: ActivationError(str(error)))

    def _activate_message(self, m: ModelEntry, device: str, decided_at: float) -> msg.ActivateModel:
        """What a worker on ``device`` activates ``m`` from: its own node's copy of the weights."""
        base = m.replica_of or m.spec.name
        adapters = [a.file for a in self._models.adapters.of_base(base)]
        message = self._on_node(m.activate_message(decided_at, adapters), m, device)
        kept = self._cache.kept_prefixes(m.spec.name)
        if kept is not None and message.cache_path == m.cached.path:  # this node's: the kept file's
            message = msgspec.structs.replace(message, kept_prefixes=kept)
        return message

    def _on_node(self, message: msg.ActivateModel, m: ModelEntry, device: str) -> msg.ActivateModel:
        """``message`` with the paths of the node of ``device`` (its own host cache), where that is
        another node."""
        paths = self._nodes.activate_paths(device, m.spec.name, message.tp_rank)
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
        ``force`` a model with requests in flight is not evicted (the future says False). A tensor
        parallel model's rank 0 goes first (it holds the requests, and its going ends the other
        ranks' loops), then the others."""
        if m.state is not ModelState.ACTIVE or m.worker is None:
            return None
        handle, device, followers = m.worker, m.device, list(m.followers)
        devices = m.devices or (device,)
        done = asyncio.get_running_loop().create_future()
        if handle.in_flight and not force:
            # The worker would refuse. Refusing here keeps the model ACTIVE throughout: shown evicted
            # while a refusal is on its way, it could be activated a second time meanwhile.
            done.set_result(False)
            return done
        for d in devices:
            self._evictions[d].append(done)
        # The model leaves the snapshots now; its pages stay in the ledger until the worker is done.
        m.left_devices()
        for h in (handle, *followers):
            h.state = WorkerState.EVICTING
        evicting = self._evict(m, handle, followers, devices, force, done)
        self._tasks.add(task := asyncio.create_task(evicting))
        task.add_done_callback(self._tasks.discard)
        return done

    async def _evict(
        self, m: ModelEntry, handle: WorkerHandle, followers: list[WorkerHandle], devices: tuple[str, ...],
        force: bool, done: asyncio.Future,
    ) -> None:  # fmt: skip
        evict = self._evict_message(m, handle, force)
        try:
            reply = await self._request(handle, evict)
            if isinstance(reply, msg.EvictRefused) and m.state is not ModelState.EVICTED:
                # placed again while the refusal was on its way: that placement stands and this
                # engine goes, so no model ever holds two engines
                logger.warning(
                    "%s was placed again while its engine on %s refused to go", m.spec.name, devices[0]
                )
                reply = await self._request(handle, msgspec.structs.replace(evict, force=True))
            if evict.keep_prefixes:  # the file is the worker's answer's, whatever it was
                kept = reply.kept_prefix_bytes if isinstance(reply, msg.ModelEvicted) else 0
                self._cache.keep_prefixes(m.spec.name, evict.keep_prefixes, kept)
            if not isinstance(reply, msg.EvictRefused):
                for f in followers:  # rank 0 has ended their loops: each gives back its pages
                    with contextlib.suppress(WorkerDiedError):
                        await self._request(f, msg.EvictModel(m.spec.name, True))
                    if f.state is WorkerState.EVICTING:
                        f.state, f.model, f.stats = WorkerState.IDLE, None, None
        except WorkerDiedError:
            reply = None
        finally:
            for d in devices:
                self._evictions[d].remove(done)
        if isinstance(reply, msg.EvictRefused):
            # requests the controller had finished were still in the engine (an abort on its way)
            for h in (handle, *followers):
                h.state = WorkerState.SERVING
            m.state, m.device, m.devices, m.worker, m.followers = (
                ModelState.ACTIVE, devices[0], devices, handle, followers,
            )  # fmt: skip
            done.set_result(False)
            return
        if handle.state is WorkerState.EVICTING:
            handle.state, handle.model, handle.stats = WorkerState.IDLE, None, None
        m.num_evictions += 1
        done.set_result(True)
        self._loop.capacity_freed(list(devices), self._clock())

    def _evict_message(self, m: ModelEntry, handle: WorkerHandle, force: bool) -> msg.EvictModel:
        """The EvictModel for ``m``: asking the worker to keep its engine's hottest cached prefixes
        in host memory (a file the next activation restores) where the model can have them: the
        built-in engine with its prefix cache on, one device of this node, and room in the budget."""
        keeps = (
            m.spec.engine_kind == "builtin" and m.spec.engine.prefix_caching and m.spec.tp == 1
            and not handle.device.node and self._cache.kept_prefix_bytes > 0
        )  # fmt: skip
        if not keeps:
            return msg.EvictModel(m.spec.name, force)
        path, allowance = self._cache.prefix_room(m.spec.name)
        return msg.EvictModel(m.spec.name, force, path, allowance)

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
        if handle in model.ranks:  # a tensor parallel model's other ranks report ModelLost
            self._fail_requests(model, f"a rank of tensor parallel model {model.spec.name} died")
            model.left_devices()
            model.num_running = 0
        self._loop.worker_died(model.spec.name, self._clock())

    def model_lost(self, handle: WorkerHandle, lost: msg.ModelLost) -> None:
        """A rank of a tensor parallel model found its group broken (another rank died): that
        worker gave back its pages and is idle again; the model, if this is still one of its
        ranks, is evicted, and its queued requests go back through the policy."""
        model = self._models.get(lost.model)
        if handle.state is not WorkerState.DEAD:
            handle.state, handle.model, handle.stats = WorkerState.IDLE, None, None
        if model is None or handle not in model.ranks:
            return
        logger.warning("%s lost: %s", lost.model, lost.message)
        self._fail_requests(model, lost.message)
        model.left_devices()
        self._loop.worker_died(model.spec.name, self._clock())

    def _fail_requests(self, model: ModelEntry, why: str) -> None:
        """Fail (503) what ``model``'s engine holds: the requests on its rank 0 (none of them would
        finish: another rank is gone)."""
        if model.worker is not None:
            self._requests.fail_on(model.worker, lambda _: why)

    def devices_lost(self, devices: set[str]) -> None:
        """The models on ``devices`` (gone with their node) are evicted at once; an activation in
        flight there fails when its worker is declared dead, detached first so that its failure
        cannot undo a placement made meanwhile."""
        for m in self._models.values():
            if m.device in devices or devices.intersection(m.devices):
                m.left_devices()
                m.activation = None
