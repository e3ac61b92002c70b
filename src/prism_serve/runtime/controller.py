"""The controller: the runtime's body around control/'s brain.

It owns the engine pool and the host weight cache, and is the body of control/loop.py's
ControlLoop (the same loop the simulator runs): it hands the loop its events (arrival, tick,
activation done or failed, requests finished, eviction done, worker died) and carries out the
effects the loop asks for (activate -> an idle worker loads the model, evict -> the worker unmaps
it, dispatch -> the request goes to the model's worker), and builds the snapshots the policy reads
(ledger bytes, engine stats, the loop's queues). Everything runs on one asyncio loop, so the state
needs no locks; workers are separate processes.

Request path: ``generate`` validates and tokenizes, the loop asks ``policy.on_request`` where the
request goes (activating the model if it is evicted) and ``policy.admit`` when it starts; tokens
stream back from the worker as the engine produces them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable

from prism_serve.control import (
    ClusterSnapshot,
    DeviceSnapshot,
    EngineSnapshot,
    ModelState,
    RejectReason,
    Request,
    RequestQueue,
)
from prism_serve.control.forecast import RateEstimator
from prism_serve.control.loop import ControlLoop
from prism_serve.control.policies import Policy, get_policy
from prism_serve.control.types import REPLICA_SEPARATOR, replica_name
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.errors import (
    DuplicateRequestError,
    InternalError,
    PrismError,
    WorkerDiedError,
    error_class,
    quoted,
)
from prism_serve.memory.ledger import DeviceLedger
from prism_serve.memory.spare import spare_bytes
from prism_serve.memory.vmm import DEFAULT_PAGE_SIZE, format_size
from prism_serve.runtime import messages as msg
from prism_serve.runtime.admin import AdminOps
from prism_serve.runtime.cluster import LedgerMirror, RayNodes
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.loading import DeviceMemoryExhaustedError
from prism_serve.runtime.models import ModelSpec, ModelTooLargeError, UnknownModelError
from prism_serve.runtime.nodes import NodeOps
from prism_serve.runtime.state import (
    REJECT_ERRORS,
    ActivationError,
    DeadlineMissError,
    ModelEntry,
    ModelStatus,
    RequestEntry,
    RequestTimeoutError,
    cluster_snapshot,
    model_entries,
)
from prism_serve.runtime.weight_cache import HostWeightCache
from prism_serve.runtime.workers import WorkerHandle, WorkerPool, WorkerState

__all__ = ["ActivationError", "Controller", "DeadlineMissError", "ModelStatus", "RequestTimeoutError"]

logger = logging.getLogger(__name__)


class Controller(AdminOps, NodeOps):
    def __init__(
        self,
        devices: Iterable[DeviceSpec],
        models: Iterable[ModelSpec],
        policy: str | Policy = "prism",
        *,
        knobs: dict | None = None,
        namespace: str | None = None,
        tick_interval_s: float = 0.5,
        activation_timeout_s: float = 60.0,
        load_threads: int = 4,
        page_size: int = DEFAULT_PAGE_SIZE,
        rate_window_s: float = 60.0,
        spare_pages: bool = True,
        prepare_workers: bool = True,
        nodes: RayNodes | None = None,
        vllm_python: str | None = None,
        vllm_compile: bool = True,
    ) -> None:
        self.devices = {d.name: d for d in devices}
        self.vllm_python = vllm_python  # the Python vLLM workers start with (runtime/workers.py)
        self.vllm_compile = vllm_compile  # the engines vLLM workers build ahead are compiled (nodes.py)
        # the Ray cluster that holds the devices of other nodes (runtime/cluster.py), or None
        self.nodes = nodes
        if bad := [d for d in self.devices.values() if d.node and nodes is None]:
            raise ValueError(f"devices {[d.name for d in bad]} are on other nodes: give the Ray cluster")
        self.specs = {m.name: m for m in models}
        if not self.devices or not self.specs:
            raise ValueError("need at least one device and one model")
        if bad := [n for n in self.specs if REPLICA_SEPARATOR in n]:
            raise ValueError(f"model names must not contain {REPLICA_SEPARATOR!r} (replica slots): {bad}")
        self.policy = get_policy(policy, **(knobs or {})) if isinstance(policy, str) else policy
        self.namespace = namespace
        self.tick_interval_s = tick_interval_s
        self.activation_timeout_s = activation_timeout_s
        self.load_threads = load_threads
        self.page_size = page_size
        self.spare_pages = spare_pages
        self.prepare_workers = prepare_workers
        self.cache = HostWeightCache(namespace)
        self.models: dict[str, ModelEntry] = {}  # served models and their replica slots
        self._engine_keys: dict[str, str] = {}  # vLLM models' engine_key, by model (nodes.py)
        # replica slots beyond replica 0 per served model (control/replicas.py), at most one per device
        num_slots = min(self.policy.replica_slots, len(self.devices))
        self.replicas: dict[str, list[str]] = {
            name: [replica_name(name, k) for k in range(1, num_slots)] for name in self.specs
        }
        # The policy-driving loop (control/loop.py, shared with the simulator); this class is its body.
        self.loop = ControlLoop(
            self.policy,
            list(self.devices),
            self,
            [n for name in self.specs for n in (name, *self.replicas[name])],
            self._now(),
            rate_window_s=rate_window_s,
        )
        self._requests: dict[str, RequestEntry] = {}
        self._evictions: defaultdict[str, list[asyncio.Future]] = defaultdict(list)
        self._ledgers: dict[str, DeviceLedger | LedgerMirror] = {}
        self._pool: WorkerPool | None = None
        self._tick_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # evictions in flight (strong references)
        self._ids = 0
        self._running = False
        # Observers of finished activations (model, device, phases): the server's metrics.
        self.activation_listeners: list[Callable[[str, str, msg.ActivationPhases], None]] = []

    # ---- life cycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every model into the host cache (disk read once), refuse models no device can hold,
        create the device ledgers and start the engine pool."""
        loop = asyncio.get_running_loop()
        biggest = max(d.memory_bytes for d in self.devices.values())
        for spec in self.specs.values():
            cached = await loop.run_in_executor(None, self.cache.load, spec)
            if cached.weight_bytes >= biggest:
                self.cache.drop(spec.name)
                raise ModelTooLargeError(
                    f"model {spec.name}: its weights take {format_size(cached.weight_bytes)}, more than "
                    f"any device's budget (largest {format_size(biggest)}); give a device more memory "
                    f"or remove the model"
                )
            self.models.update(model_entries(spec, cached, self.replicas[spec.name]))
        for d in self.devices.values():
            self._ledgers[d.name] = self._open_ledger(d)
        if self.nodes is not None:  # every node reads the models into its own host cache
            await self.nodes.start(self.specs.values(), self._node_added, self._node_lost)
        self._pool = WorkerPool(
            list(self.devices.values()),
            on_message=self._on_message,
            on_death=self._on_worker_death,
            namespace=self.namespace,
            reserve_bytes={d.name: d.memory_bytes for d in self.devices.values()},
            page_size=self.page_size,
            load_threads=self.load_threads,
            # each worker keeps weight pages for the largest model ready (memory/spare.py)
            spare_bytes=max(
                (m.cached.weight_bytes for m in self.models.values() if m.spec.engine == "builtin"), default=0
            )
            if self.spare_pages
            else 0,
            spare_of=lambda w: spare_bytes(self._ledgers[w.device.name].peek(), w.worker_id),
            prepare=self._prepare_message if self.prepare_workers else None,
            launcher=self.nodes,
            vllm_python=self.vllm_python if any(s.engine == "vllm" for s in self.specs.values()) else None,
        )
        await self._pool.start()
        self._tick_task = asyncio.create_task(self._tick_loop())
        self._running = True
        await self._load_pinned()

    async def _load_pinned(self) -> None:
        """Pinned models are activated at start-up, one after the other (where the policy's
        on-demand rule puts them); one that cannot be is logged and loads on its first request."""
        for spec in self.specs.values():
            if spec.pinned:
                try:
                    await self.load(spec.name)
                except PrismError as e:
                    logger.warning("pinned model %s was not activated at start-up: %s", spec.name, e)

    async def stop(self) -> None:
        self._running = False
        if self._tick_task is not None:
            self._tick_task.cancel()
            await asyncio.gather(self._tick_task, return_exceptions=True)
        for r in list(self._requests.values()):
            self._fail(r, WorkerDiedError("the server is shutting down"))
        if self._pool is not None:
            await self._pool.stop()
        if self.nodes is not None:
            await self.nodes.stop()
        for ledger in self._ledgers.values():
            if not ledger.snapshot().entries:  # nobody else on the device: leave no file behind
                ledger.unlink()
            ledger.close()
        self.cache.close()

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        """Between a finished ``start()`` and ``stop()``."""
        return self._running

    @property
    def queues(self) -> dict[str, RequestQueue]:
        return self.loop.queues

    @property
    def rates(self) -> RateEstimator:
        return self.loop.rates

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            raise RuntimeError("the controller is not started")
        return self._pool

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    # ---- requests -----------------------------------------------------------------------------

    def tokenizer(self, model: str) -> Tokenizer:
        return self._served(model).tokenizer

    def max_model_len(self, model: str) -> int:
        """Prompt plus output tokens one request of ``model`` may have."""
        return self._served(model).max_model_len

    async def generate(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        req_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[msg.TokenDelta]:
        """Stream ``model``'s output for ``prompt``: one ``TokenDelta`` per engine step, the last with
        ``finished``. Raises a PrismError (404 unknown model, 400 bad prompt, 503 worker or model
        gone, 504 no first token within ``timeout_s``). Leaving the loop early aborts the request."""
        r = self._submit(model, prompt, params or SamplingParams(), req_id)
        first = True
        try:
            while True:
                if first and timeout_s is not None:
                    try:
                        item = await asyncio.wait_for(r.stream.get(), timeout_s)
                    except TimeoutError:
                        raise RequestTimeoutError(
                            f"no token from {model} within {timeout_s} s (still queued or activating)"
                        ) from None
                else:
                    item = await r.stream.get()
                first = False
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not r.done:
                self._abort(r)

    def _submit(
        self, model: str, prompt: str | list[int], params: SamplingParams, req_id: str | None
    ) -> RequestEntry:
        m = self._served(model)
        if req_id is None:
            self._ids += 1
            req_id = f"r{self._ids}"
        if req_id in self._requests:
            raise DuplicateRequestError(f"request id {req_id!r} is already in flight")
        now = self._now()
        r = RequestEntry.build(req_id, m, prompt, params, now)  # 400s: nothing registered yet
        self._requests[req_id] = r
        try:
            self.loop.arrival(r.control, now)
        except BaseException:
            # Whatever failed (a policy, a queue), nothing of this request may stay registered.
            logger.exception("routing %s failed", req_id)
            self._abort(r)
            raise
        return r

    def _abort(self, r: RequestEntry) -> None:
        """The client went away: drop the request wherever it is and free its KV."""
        worker = r.worker
        self._finish(r)
        if worker is not None:
            with contextlib.suppress(WorkerDiedError):
                self.pool.send(worker, msg.AbortRequest(r.req_id))

    def _finish(self, r: RequestEntry) -> None:
        """The request leaves the controller and the loop, wherever it is."""
        r.done = True
        self._requests.pop(r.req_id, None)
        if r.worker is not None:
            r.worker.in_flight.discard(r.req_id)
            served = self._model(r.engine_model)
            served.num_running -= 1
            served.num_served += 1
            self.loop.request_left(r.req_id)
        else:
            self.loop.abort(r.req_id)

    def _fail(self, r: RequestEntry, error: BaseException) -> None:
        if r.done:
            return
        self._finish(r)
        r.stream.put_nowait(error)

    # ---- snapshots ----------------------------------------------------------------------------

    def snapshot(self, now: float | None = None) -> ClusterSnapshot:
        now = self._now() if now is None else now
        return cluster_snapshot(
            self.models, self.devices, self.loop.queues, self.loop.num_queued, self.loop.rates,
            self.loop.forecast_rate, self.loop.prewarmed, self._ledgers, now,
        )  # fmt: skip

    # ---- effects (the control loop's Body) ----------------------------------------------------

    def cluster(self, now: float) -> ClusterSnapshot:
        return self.snapshot(now)

    def admission_view(self, device: str, now: float) -> tuple[DeviceSnapshot, dict[str, EngineSnapshot]]:
        snap = self.snapshot(now)
        return snap.devices[device], snap.engines

    def model_state(self, model: str) -> tuple[ModelState, int]:
        m = self._model(model)
        return m.state, m.num_running

    def reject(self, request: Request, reason: RejectReason, detail: str, now: float) -> None:
        r = self._requests.get(request.req_id)
        if r is not None:
            self._fail(r, REJECT_ERRORS[reason](detail))

    def activate(self, model: str, devices: tuple[str, ...], now: float) -> None:
        self._start_activate(self._model(model), devices[0])

    def evict(self, model: str, now: float) -> list[Request]:
        # graceful: a worker with requests in flight refuses (EvictRefused), so nothing restarts
        self._start_evict(self._model(model), force=False)
        return []

    def set_kv_quota(self, model: str, device: str, quota_bytes: int | None) -> None:
        m = self._model(model)
        m.kv_quota = quota_bytes
        if m.worker is not None and m.state is ModelState.ACTIVE:
            self._send(m.worker, msg.SetKVLimit(quota_bytes))

    def dispatch(self, request: Request, device: str, now: float) -> bool:
        r = self._requests.get(request.req_id)
        if r is None or r.done:
            return False
        m = self._model(request.model)  # the replica the loop routed it to
        if m.worker is None or m.state is not ModelState.ACTIVE:
            self._fail(r, ActivationError(f"{request.model} is not active"))
            return False
        r.worker, r.replica = m.worker, request.model
        m.worker.in_flight.add(r.req_id)
        m.num_running += 1
        if not self._send(m.worker, r.payload):  # it must not stay booked on a worker that never got it
            self._fail(r, InternalError("could not hand the request to its worker"))
            return False
        return True

    def _send(self, handle: WorkerHandle, message: msg.Message | bytes) -> bool:
        """Send; False (logged) if the send itself failed. A dead worker counts as sent: its death
        handler fails what was in flight."""
        try:
            self.pool.send(handle, message)
        except WorkerDiedError:
            pass
        except Exception:
            logger.exception("sending to %s failed", handle.worker_id)
            return False
        return True

    # ---- activation ---------------------------------------------------------------------------

    def _start_activate(self, m: ModelEntry, device: str) -> None:
        if m.state is not ModelState.EVICTED:
            return
        m.state, m.device, m.placed_at = ModelState.ACTIVATING, device, self._now()
        m.activation = asyncio.create_task(self._activate(m, device, self._now()))

    async def _activate(self, m: ModelEntry, device: str, decided_at: float) -> msg.ActivationPhases | None:
        deadline = decided_at + self.activation_timeout_s
        handle: WorkerHandle | None = None
        try:
            # Evictions the policy ordered before this activation free the memory it needs.
            pending = [f for f in self._evictions[device] if not f.done()]
            if pending:
                await asyncio.wait(pending, timeout=max(0.0, deadline - self._now()))
            handle = await asyncio.wait_for(
                self.pool.take(device, m.spec.engine, m.spec.source, self._engine_key(m)),
                max(0.0, deadline - self._now()),
            )
            handle.model = m.spec.name
            m.worker = handle
            while True:
                reply = await self._request(handle, self._activate_message(m, device, decided_at))
                if isinstance(reply, msg.ModelActivated):
                    handle.last_source, handle.engine_key = m.spec.source, self._engine_key(m)
                    break
                retry = reply.error == DeviceMemoryExhaustedError.__name__ and self._now() < deadline
                if not retry:
                    raise error_class(reply.error)(f"activating {m.spec.name} on {device}: {reply.message}")
                await asyncio.sleep(0.05)  # other engines' KV pages drain as their requests finish
        except Exception as e:  # whatever went wrong, waiting requests must hear about it
            self._refill(handle, device, m)
            if m.activation is not asyncio.current_task():
                return None  # detached (its node left): the model has moved on without it
            if isinstance(e, TimeoutError):
                e = ActivationError(
                    f"{m.spec.name}: no worker on {device} within {self.activation_timeout_s} s"
                )
            elif not isinstance(e, PrismError):
                logger.exception("activating %s failed", m.spec.name)
                e = ActivationError(f"activating {m.spec.name}: {type(e).__name__}: {e}")
            self._activation_failed(m, handle, e)
            return None
        self._refill(handle, device, m)
        handle.state = WorkerState.SERVING
        handle.stats = reply.stats
        m.state, m.max_kv_bytes, m.last_phases = ModelState.ACTIVE, reply.max_kv_bytes, reply.phases
        m.num_activations += 1
        # Idle time counts from the activation too: a model loaded ahead of its first request (by
        # an admin, or a migration) is not "idle forever" and evicted on the next tick.
        m.activated_at = self._now()
        if m.kv_quota is not None:
            self._send(handle, msg.SetKVLimit(m.kv_quota))
        logger.info(
            "activated %s on %s in %.3f s %s", m.spec.name, device, reply.phases.total_s, reply.phases
        )
        now = self._now()
        try:
            for listener in self.activation_listeners:
                listener(m.spec.name, device, reply.phases)
            self.loop.activation_done(m.spec.name, device, now)
        except Exception:  # the model is active; the next tick admits what this could not
            logger.exception("placing and admitting after %s's activation failed", m.spec.name)
        return reply.phases

    def _activation_failed(self, m: ModelEntry, handle: WorkerHandle | None, error: PrismError) -> None:
        logger.warning("activation of %s failed: %s", m.spec.name, error)
        m.state, m.device, m.worker = ModelState.EVICTED, None, None
        if handle is not None and handle.state is WorkerState.ACTIVATING:
            handle.state, handle.model = WorkerState.IDLE, None
        for request in self.loop.activation_failed(m.spec.name, self._now()):
            r = self._requests.get(request.req_id)
            if r is not None:
                self._fail(r, ActivationError(str(error)))

    async def _request(self, handle: WorkerHandle, message: msg.Message) -> msg.Message:
        """Send an ActivateModel/EvictModel and wait for the worker's reply to it."""
        handle.reply = asyncio.get_running_loop().create_future()
        self.pool.send(handle, message)
        try:
            return await handle.reply
        finally:
            handle.reply = None

    # ---- eviction -----------------------------------------------------------------------------

    def _start_evict(self, m: ModelEntry, force: bool) -> asyncio.Future | None:
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
        self.loop.capacity_freed([device], self._now())

    # ---- state ----------------------------------------------------------------------------------

    def _model(self, name: str) -> ModelEntry:
        """A served model or a replica slot (the loop's and the workers' names)."""
        m = self.models.get(name)
        if m is None:
            raise UnknownModelError(f"model {quoted(name)} is not served here; see /v1/models")
        return m

    def _served(self, name: str) -> ModelEntry:
        """A model clients may address (replica slots are internal names)."""
        if name not in self.specs:
            raise UnknownModelError(f"model {quoted(name)} is not served here; see /v1/models")
        return self.models[name]

    # ---- worker messages ----------------------------------------------------------------------

    def _on_message(self, handle: WorkerHandle, m: msg.Message) -> None:
        match m:
            case msg.StepOutputs(outputs, stats):
                served = self.models.get(handle.model or "")
                if served is not None and served.worker is handle:
                    served.count_engine_time(handle.stats, stats)
                handle.stats = stats
                finished = False
                for d in outputs:
                    r = self._requests.get(d.req_id)
                    if r is None:
                        continue
                    r.stream.put_nowait(d)
                    if d.finished:
                        self._finish(r)
                        finished = True
                if finished:
                    self.loop.capacity_freed([handle.device.name], self._now())
            case msg.RequestFailed(req_id, error, message):
                r = self._requests.get(req_id)
                if r is not None:
                    self._fail(r, error_class(error)(message))
                    self.loop.capacity_freed([handle.device.name], self._now())
            case msg.ModelActivated() | msg.ActivationFailed() | msg.ModelEvicted() | msg.EvictRefused():
                if handle.reply is not None and not handle.reply.done():
                    handle.reply.set_result(m)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval_s)
            try:
                self.tick()
            except Exception:
                logger.exception("placement tick failed")

    def tick(self) -> None:
        """One placement tick: ``policy.place``, deferred requests resubmitted, every device admits."""
        self.loop.tick(self._now())
