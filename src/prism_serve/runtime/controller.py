"""The controller: the runtime's body around control/'s brain.

It builds the runtime's parts and wires them together, and is the body of control/loop.py's
ControlLoop (the same loop the simulator runs): it hands the loop its events (arrival, tick,
activation done or failed, requests finished, eviction done, worker died, nodes joining and
leaving) and carries out the effects the loop asks for through the part that owns them:

- ``Requests`` (requests.py): a request's path, from submit through dispatch to its last token;
- ``Activator`` (activation.py): models onto workers and off them, and what idle workers prepare;
- ``NodeSet`` (nodes.py): the devices and their ledgers, on this machine or other Ray nodes;
- ``ModelTable`` (state.py): what is known of each model and replica slot;
- ``Admin`` (admin.py): load, unload and pin by hand;
- ``WorkerPool`` (workers.py): the worker processes and the socket to them;
- ``HostWeightCache`` (weight_cache.py): every model's weights in shared memory, read once.

Everything runs on one asyncio loop, so the state needs no locks; workers are separate processes.
One thing leaves the loop: a tick's ``policy.place``, which over thousands of models takes long
enough to hold up every token stream. It runs on the controller's placement thread, on a snapshot
taken on the loop (a value: nothing the loop changes), and its actions are applied back on the loop
unless what they act on moved meanwhile, when it is decided again (control/loop.py
``PlacementRun``); the placement after an activation runs the same way, and activations finishing
while one is decided share the next.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor

from prism_serve.config import PolicyConfig
from prism_serve.control import (
    ClusterSnapshot,
    DeviceSnapshot,
    EngineSnapshot,
    ModelState,
    RejectReason,
    Request,
)
from prism_serve.control.loop import ControlLoop
from prism_serve.control.policies import get_policy
from prism_serve.control.types import DEFAULT_ORIGIN, REPLICA_SEPARATOR, Origin
from prism_serve.engine.lora import InvalidAdapterError
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.errors import PrismError, WorkerDiedError, quoted
from prism_serve.memory.ledger import LedgerSnapshot
from prism_serve.memory.vmm import DEFAULT_PAGE_SIZE, format_size
from prism_serve.runtime import messages as msg
from prism_serve.runtime.activation import Activator
from prism_serve.runtime.adapters import AdapterSpec
from prism_serve.runtime.admin import Admin
from prism_serve.runtime.cluster import Node, RayNodes
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec, ModelTooLargeError, UnknownModelError
from prism_serve.runtime.nodes import NodeSet
from prism_serve.runtime.requests import Requests
from prism_serve.runtime.state import ModelStatus, ModelTable, Snapshots
from prism_serve.runtime.weight_cache import HostWeightCache, config_from_dict
from prism_serve.runtime.workers import WorkerHandle, WorkerPool

__all__ = ["Controller"]

logger = logging.getLogger(__name__)

# placements decided off the loop that may find their actions moved under them before one is
# decided on the loop (where nothing moves while it is)
_OFF_LOOP_TRIES = 3
_SWITCH_INTERVAL_S = 0.001


class Controller:
    def __init__(
        self,
        devices: Iterable[DeviceSpec],
        models: Iterable[ModelSpec],
        policy: PolicyConfig | None = None,
        *,
        namespace: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        nodes: RayNodes | None = None,
        vllm_python: str | None = None,
        vllm_compile: bool = True,
        adapters: Iterable[tuple[str, str, str, float, float]] = (),
    ) -> None:
        """``adapters``: LoRA adapters of the config, (name, base, PEFT directory, TTFT SLO, TPOT
        SLO) each, read and checked against their bases at ``start``."""
        self._configured_adapters = list(adapters)
        self.settings = policy or PolicyConfig()
        self.policy = get_policy(self.settings.name, **self.settings.knobs)
        self.namespace = namespace
        self.nodes = NodeSet(devices, namespace, nodes)
        self.devices = self.nodes.devices  # the same dict: nodes join and leave
        self.models = ModelTable(models, min(self.policy.replica_slots, len(self.devices)))
        self.specs = self.models.specs
        if not self.devices or not self.specs:
            raise ValueError("need at least one device and one model")
        self.cache = HostWeightCache(namespace, kept_prefix_bytes=self.settings.kept_prefix_bytes)
        self.loop = ControlLoop(
            self.policy, list(self.devices), self, self.models.names(), self._now(),
            place_later=(
                self._want_placement
                if self.settings.placement_thread or self.settings.placement_coalesce_s > 0
                else None
            ),
            rate_priors={n: s.expected_rate for n, s in self.specs.items() if s.expected_rate is not None},
        )  # fmt: skip
        self._placer = ThreadPoolExecutor(1, thread_name_prefix="prism-placement")
        # each snapshot the last one with what changed rebuilt; PRISM_CHECK_SNAPSHOTS=1 (the tests)
        # compares every one with a fresh build
        self.snapshots = Snapshots(
            self.models, self.devices, self.nodes.ledgers, self.loop,
            check=os.environ.get("PRISM_CHECK_SNAPSHOTS") == "1",
        )  # fmt: skip
        self._placement_wanted: asyncio.Event | None = None  # made on the serving loop (start)
        self.pool = WorkerPool(
            list(self.devices.values()),
            on_message=self._on_message,
            on_death=self._on_worker_death,
            namespace=namespace,
            reserve_bytes={d.name: d.memory_bytes for d in self.devices.values()},
            page_size=page_size,
            spare_of=self.nodes.spare_of,
            launcher=nodes,
            vllm_python=vllm_python if any(s.engine_kind == "vllm" for s in self.specs.values()) else None,
        )
        self.requests = Requests(self.models, self.loop, self.pool, self._now)
        self.activator = Activator(
            self.pool, self.models, self.nodes, self.loop, self.requests, self.cache, self._now,
            timeout_s=self.settings.activation_timeout_s, vllm_compile=vllm_compile,
        )  # fmt: skip
        self.admin = Admin(
            self.models, self.nodes, self.loop, self.policy, self.activator, self._now, self.snapshot
        )
        self.activation_listeners = self.activator.listeners  # the server's metrics observe these
        self._tick_task: asyncio.Task | None = None
        self._running = False

    # ---- life cycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every model into the host cache (disk read once), refuse models no device can hold,
        open the device ledgers, start the engine pool and activate the pinned models."""
        loop = asyncio.get_running_loop()
        biggest = max(d.memory_bytes for d in self.devices.values())
        for spec in self.specs.values():
            cached = await loop.run_in_executor(None, self.cache.load, spec)
            self.models.add(spec, cached)
            footprint = self.models[spec.name].device_bytes  # weights and adapter slots (one rank's)
            if spec.tp > self.nodes.max_devices_per_node():
                self.cache.drop(spec.name)
                raise ModelTooLargeError(
                    f"model {spec.name}: tp: {spec.tp} needs that many devices on one node; the "
                    f"largest node has {self.nodes.max_devices_per_node()}"
                )
            if footprint >= biggest:
                self.cache.drop(spec.name)
                raise ModelTooLargeError(
                    f"model {spec.name}: its weights take {format_size(footprint)} (with any adapter "
                    f"slots), more than any device's budget (largest {format_size(biggest)}); give a "
                    f"device more memory, fewer max_loras, or remove the model"
                )
        for name, base, path, ttft, tpot in self._configured_adapters:
            await self.load_adapter(name, path, base, ttft, tpot)
        self.nodes.open()
        if self.nodes.ray is not None:  # every node reads the models into its own host cache
            await self.nodes.ray.start(self.specs.values(), self._on_node_added, self._on_node_lost)
        builtin = [m.device_bytes for m in self.models.values() if m.spec.engine_kind == "builtin"]
        await self.pool.start(
            # each worker keeps weight pages for the largest model ready (memory/spare.py)
            spare_bytes=max(builtin, default=0) if self.settings.spare_pages else 0,
            prepare=self.activator.prepare_message if self.settings.prepare_workers else None,
        )
        self._placement_wanted = asyncio.Event()
        if self.settings.placement_thread:
            # a placement holds the GIL while it decides; the loop waits at most this long for it
            # when a token arrives (Python's default is 5 ms)
            sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
        # what start-up made (the model table, tokenizers, modules) lives as long as the server:
        # out of the cyclic collector's reach, whose full passes would otherwise walk all of it
        # (a quarter of a second at 10,000 models) on whichever thread allocates, the loop too
        gc.collect()
        gc.freeze()
        self._tick_task = asyncio.create_task(self._tick_loop())
        self._running = True
        for spec in self.specs.values():  # pinned models, where the policy's on-demand rule puts them
            if spec.pinned:
                try:
                    await self.admin.load(spec.name)
                except PrismError as e:
                    logger.warning("pinned model %s was not activated at start-up: %s", spec.name, e)

    async def stop(self) -> None:
        self._running = False
        gc.unfreeze()  # (start) collectable again, as at the interpreter's exit its extensions expect
        if self._tick_task is not None:
            self._tick_task.cancel()
            await asyncio.gather(self._tick_task, return_exceptions=True)
        for r in self.requests.in_flight():
            self.requests.fail(r, WorkerDiedError("the server is shutting down"))
        await self.pool.stop()
        if self.nodes.ray is not None:
            await self.nodes.ray.stop()
        self.nodes.close()
        self.cache.close()
        self._placer.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        """Between a finished ``start()`` and ``stop()``."""
        return self._running

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    # ---- what clients and operators call --------------------------------------------------------

    def generate(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        req_id: str | None = None,
        timeout_s: float | None = None,
        ttft_slo: float | None = None,
        origin: Origin = DEFAULT_ORIGIN,
    ) -> AsyncIterator[msg.TokenDelta]:
        """Stream ``model``'s output for ``prompt`` (requests.py ``Requests.stream``); ``ttft_slo``:
        this request's first-token deadline in place of the model's; ``origin``: its tenant, class
        and weight in admission."""
        return self.requests.stream(
            model, prompt, params or SamplingParams(), req_id, timeout_s, ttft_slo, origin
        )

    def is_active(self, model: str) -> bool:
        """Whether a replica of ``model`` (or of an adapter's base) can take requests now."""
        base = self.models.served(model).spec.name
        return any(slot.state is ModelState.ACTIVE for slot in self.models.slots(base))

    def snapshot(self, now: float | None = None) -> ClusterSnapshot:
        """Every model, device and engine as the policies see them now."""
        return self.snapshots.cluster(self._now() if now is None else now)

    def status(self) -> list[ModelStatus]:
        """One status per served model, its replicas inside."""
        return self.models.status(self.snapshot())

    def tokenizer(self, model: str) -> Tokenizer:
        """``model``'s tokenizer (an adapter's is its base's); UnknownModelError (404) if not served."""
        return self.models.tokenizer(model)

    def adapter(self, name: str, finishing: bool = False) -> AdapterSpec | None:
        """Adapter ``name`` if loaded; with ``finishing``, also while it is being unloaded."""
        table = self.models.adapters
        return table.by_name.get(name) if finishing else table.get(name)

    def adapters(self) -> list[AdapterSpec]:
        """Every adapter loaded (those being unloaded too), in load order."""
        return list(self.models.adapters.by_name.values())

    def device_memory(self) -> dict[str, LedgerSnapshot]:
        """Each device's ledger as it is now (what is mapped, by whom)."""
        return {device: self.nodes.ledger(device).peek() for device in self.devices}

    async def load(self, model: str, device: str | None = None) -> msg.ActivationPhases | None:
        return await self.admin.load(model, device)

    async def unload(self, model: str, force: bool = True, drain_s: float = 0.0) -> bool:
        return await self.admin.unload(model, force, drain_s)

    def pin(self, model: str, pinned: bool = True) -> None:
        self.admin.pin(model, pinned)

    # ---- LoRA adapters (runtime/adapters.py) ----------------------------------------------------

    async def load_adapter(
        self, name: str, path: str, base: str | None = None, ttft_slo: float | None = None,
        tpot_slo: float | None = None,
    ) -> AdapterSpec:  # fmt: skip
        """Register adapter ``name`` (PEFT directory ``path``) over ``base`` (None: the one model with
        adapter slots), checked against the base's shape; the workers running the base take it at
        once, later activations with the base. InvalidAdapterError (400) naming what is wrong."""
        if not name or name.strip() != name or len(name) > 256 or REPLICA_SEPARATOR in name:
            raise InvalidAdapterError(
                f"adapter name {quoted(name)}: 1-256 characters, no '#', no spaces around it"
            )
        bases = [n for n, s in self.specs.items() if s.engine.max_loras]
        if base is None:
            if len(bases) != 1:
                raise InvalidAdapterError(
                    f"adapter {name!r}: say which base model it is for (base_model_name); models with "
                    f"adapter slots: {', '.join(bases) or 'none (set max_loras on a model)'}"
                )
            base = bases[0]
        if base not in self.specs:
            raise InvalidAdapterError(f"adapter {name!r}: base {quoted(base)} is not a model served here")
        if base not in bases:
            raise InvalidAdapterError(f"adapter {name!r}: base {base!r} has no adapter slots (max_loras: 0)")
        if name in self.specs or name in self.models.adapters.by_name:
            raise InvalidAdapterError(f"adapter {name!r}: the name is taken (a model or an adapter)")
        b = self.models.served(base)
        config = config_from_dict(b.cached.config)
        spec = await asyncio.get_running_loop().run_in_executor(
            None, AdapterSpec.read, name, base, path, config, b.spec.engine.max_lora_rank,
            ttft_slo or b.spec.ttft_slo, tpot_slo or b.spec.tpot_slo,
            self.cache if b.spec.engine_kind == "builtin" else None,  # vLLM reads the directory
        )  # fmt: skip
        try:
            self.models.adapters.add(spec)
        except InvalidAdapterError:  # the same name registered meanwhile
            self.cache.drop_adapter(spec.file.cache_path)
            raise
        message = msg.LoadAdapter(spec.file)
        for m in self.models.slots(base):
            # active, or activating with a message made before this adapter: the worker takes it
            # after the activation (its messages are handled in order)
            if m.worker is not None:
                self.pool.try_send(m.worker, msg.encode(message))
        return spec

    async def unload_adapter(self, name: str, force: bool = False, poll_s: float = 0.05) -> int:
        """Remove adapter ``name``: it takes no new requests; those in flight finish first (with
        ``force``, they fail with 503 now). Returns how many were in flight."""
        spec = self.models.adapters.get(name)
        if spec is None:
            raise UnknownModelError(f"adapter {quoted(name)} is not loaded")
        self.models.adapters.unloading.add(name)
        try:
            users = [r for r in self.requests.in_flight() if r.adapter == name]
            if force:
                for r in users:
                    self.requests.fail(r, WorkerDiedError(f"adapter {name} was unloaded"))
            while any(not r.done for r in users):
                await asyncio.sleep(poll_s)
            for m in self.models.slots(spec.base):  # active or activating, as load_adapter
                if m.worker is not None:
                    self.pool.try_send(m.worker, msg.encode(msg.UnloadAdapter(name)))
        finally:
            self.models.adapters.remove(name)
            self.cache.drop_adapter(spec.file.cache_path)
        return len(users)

    # ---- the control loop's body: its view of the state, and its effects ------------------------

    def cluster(self, now: float) -> ClusterSnapshot:
        return self.snapshot(now)

    def admission_view(self, device: str, now: float) -> tuple[DeviceSnapshot, dict[str, EngineSnapshot]]:
        snap = self.snapshot(now)
        return snap.devices[device], snap.engines

    def model_state(self, model: str) -> tuple[ModelState, int]:
        m = self.models.entry(model)
        return m.state, m.num_running

    def reject(self, request: Request, reason: RejectReason, detail: str, now: float) -> None:
        self.requests.reject(request, reason, detail)

    def dispatch(self, request: Request, device: str, now: float) -> bool:
        return self.requests.dispatch(request)

    def activate(self, model: str, devices: tuple[str, ...], now: float) -> None:
        self.activator.activate(self.models.entry(model), devices)

    def evict(self, model: str, now: float) -> list[Request]:
        # graceful: a worker with requests in flight refuses (EvictRefused), so nothing restarts
        self.activator.evict(self.models.entry(model), force=False)
        return []

    def set_kv_quota(self, model: str, device: str, quota_bytes: int | None) -> None:
        self.activator.set_kv_quota(self.models.entry(model), quota_bytes)

    def tick(self) -> None:
        """One placement tick, all on the loop: ``policy.place``, deferred requests resubmitted,
        every device admits."""
        self.loop.tick(self._now())

    async def tick_off_loop(self) -> None:
        """One placement tick with ``policy.place`` on the placement thread (module docstring); on
        the loop after ``_OFF_LOOP_TRIES`` decisions whose actions the state moved under."""
        if not self.settings.placement_thread:
            self.tick()
            return
        serving = asyncio.get_running_loop()
        for _ in range(_OFF_LOOP_TRIES):
            run = self.loop.begin_tick(self._now())
            actions = await serving.run_in_executor(self._placer, self.loop.decide, run)
            if self.loop.end_tick(run, actions, self._now()):
                return
        self.tick()

    def _want_placement(self) -> None:
        """The control loop's ``place_later``: a model finished activating; a tick (off the loop)
        ``placement_coalesce_s`` from now, together with any other activation that finishes
        meanwhile or before that tick starts."""
        if self._placement_wanted is not None:
            self._placement_wanted.set()

    async def _tick_loop(self) -> None:
        wanted = self._placement_wanted
        assert wanted is not None
        while True:
            try:
                await asyncio.wait_for(wanted.wait(), self.settings.tick_interval_s)
            except TimeoutError:
                pass
            else:  # an activation finished: the others finishing meanwhile share this tick
                await asyncio.sleep(self.settings.placement_coalesce_s)
            wanted.clear()
            try:
                await self.tick_off_loop()
            except Exception:
                logger.exception("placement tick failed")

    # ---- events from the workers and the nodes --------------------------------------------------

    def _on_message(self, handle: WorkerHandle, m: msg.Message) -> None:
        match m:
            case msg.StepOutputs(outputs, stats):
                served = self.models.get(handle.model or "")
                if served is not None and served.worker is handle:
                    served.count_engine_time(handle.stats, stats)
                handle.stats = stats
                if self.requests.on_outputs(outputs):
                    self.loop.capacity_freed([handle.device.name], self._now())
            case msg.RequestFailed(req_id, error, message):
                if self.requests.on_failed(req_id, error, message):
                    self.loop.capacity_freed([handle.device.name], self._now())
            case msg.ModelActivated() | msg.ActivationFailed() | msg.ModelEvicted() | msg.EvictRefused():
                self.activator.on_reply(handle, m)
            case msg.ModelLost(_, why):
                # rank 0 failed what it held; requests sent meanwhile would find no model there
                self.requests.fail_on(handle, lambda _: why)
                self.activator.model_lost(handle, m)
                self.loop.capacity_freed([handle.device.name], self._now())

    def _on_worker_death(self, handle: WorkerHandle) -> None:
        """Fail what the dead worker was running, reclaim its ledger entries, and forget its
        model's residency (its queued requests go back through the policy, which sees the
        reclaimed memory)."""
        self.requests.fail_on(handle, lambda model: f"worker {handle.worker_id} serving {model} died")
        self.nodes.reclaim(handle.device.name)
        self.activator.worker_died(handle)

    def _on_node_added(self, node: Node) -> None:
        """A node joined the Ray cluster: its devices join the placement, with their workers."""
        for d in self.nodes.add(node):
            self.loop.add_device(d.name)
            self.pool.add_device(d, d.memory_bytes)
        self.tick()

    def _on_node_lost(self, node: Node, why: str) -> None:
        """A node left (its agent, or the whole machine, died): what ran there fails with 503, its
        models are evicted, its devices leave the placement and the snapshots, then its workers are
        handled as dead (their models' waiting requests go back through the policy)."""
        gone = {d.name for d in node.devices}
        left = f"node {node.name} left the cluster ({why})"
        for d in gone:
            for handle in self.pool.on_device(d):
                self.requests.fail_on(handle, lambda model: f"{model}: {left}")
        self.activator.devices_lost(gone)
        self.nodes.remove(node)
        now = self._now()
        for d in gone:
            self.loop.remove_device(d, now)
        for d in gone:
            self.pool.lose_device(d, f"node {node.name} left the cluster: {why}")
        self.tick()
