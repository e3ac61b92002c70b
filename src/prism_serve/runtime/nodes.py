"""Where the controller's devices live: each device's ledger (the shared-memory ledger on this
machine, or a mirror of its node agent's polls on another), the host cache files an idle worker
prepares and an activation copies from (those of the worker's own node), and devices joining and
leaving with their node (runtime/cluster.py), and what a worker's death undoes. A mixin of
Controller, like admin.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from prism_serve.control import ModelState
from prism_serve.engine.vllm_engine import engine_key
from prism_serve.errors import WorkerDiedError
from prism_serve.memory.ledger import DeviceLedger
from prism_serve.memory.vmm import format_size
from prism_serve.runtime import messages as msg
from prism_serve.runtime.cluster import LedgerMirror, Node
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.state import ModelEntry
from prism_serve.runtime.workers import WorkerHandle

if TYPE_CHECKING:
    from prism_serve.runtime.controller import Controller

__all__ = ["NodeOps"]

logger = logging.getLogger(__name__)


class NodeOps:
    def ledger(self: Controller, device: str) -> DeviceLedger | LedgerMirror:
        return self._ledgers[device]

    def _open_ledger(self: Controller, d: DeviceSpec) -> DeviceLedger | LedgerMirror:
        if d.node:
            assert self.nodes is not None
            return self.nodes.ledger(d.name)
        ledger = DeviceLedger(d.name, d.memory_bytes, self.namespace)
        if ledger.budget_bytes != d.memory_bytes:
            ledger.set_budget(d.memory_bytes)
        return ledger

    def _prepare_message(self: Controller, handle: WorkerHandle) -> msg.Prepare:
        """What an idle worker opens ahead of activations: its own node's host cache files of the
        models on its engine (and for a vLLM worker, the engine to build)."""
        if handle.device.node and self.nodes is not None:
            node = self.nodes.nodes.get(handle.device.node)
            message = node.prepares.get(handle.engine) if node is not None else None
            if message is None:
                return msg.Prepare([], [])
        else:
            message = self.cache.prepare_message(engine=handle.engine)
        if handle.engine == "vllm":
            return msgspec.structs.replace(message, engines=self._vllm_shapes())
        return message

    def _refill(self: Controller, handle: WorkerHandle | None, device: str, m: ModelEntry) -> None:
        """An activation that took a worker from the pool is done: the pool starts its replacement."""
        if handle is not None and self._pool is not None:
            self._pool.refill(device, m.spec.engine)

    def _engine_key(self: Controller, m: ModelEntry) -> str | None:
        """A vLLM model's engine_key: which pooled vLLM engine can serve it (None: built-in)."""
        if m.spec.engine != "vllm":
            return None
        key = self._engine_keys.get(m.spec.name)
        if key is None:
            key = self._engine_keys[m.spec.name] = engine_key(m.cached.source, m.spec.engine_config())
        return key

    def _vllm_shapes(self: Controller) -> list[msg.EngineShape]:
        """The engine a fresh vLLM worker builds ahead of activations: the shape whose models had
        the most requests lately (every replica counted), then the one most vLLM models share
        (fine-tunes of one base; at start-up, before any request, this decides), the first
        configured on a tie. A worker holds one vLLM engine; a model of another shape rebuilds
        it at activation (eager: only a build ahead is compiled, under ``vllm_compile``)."""
        now = self._now()
        groups: dict[str, tuple[float, set[str], ModelEntry]] = {}  # rate, models, first model
        for name, m in self.models.items():
            key = self._engine_key(m)
            if key is None:
                continue
            rate, names, first = groups.get(key, (0.0, set(), m))
            groups[key] = (rate + self.rates.rate(name, now), names | {m.spec.name}, first)
        if not groups:
            return []
        _, _, m = max(groups.values(), key=lambda g: (g[0], len(g[1])))  # max keeps the first of equals
        return [msg.EngineShape(m.cached.source, m.spec.engine_config(), self.vllm_compile)]

    def _activate_message(
        self: Controller, m: ModelEntry, device: str, decided_at: float
    ) -> msg.ActivateModel:
        """What a worker on ``device`` activates ``m`` from: its own node's copy of the weights."""
        message = m.activate_message(decided_at, self.load_threads)
        if self.devices[device].node and self.nodes is not None:
            path, tokenizer = self.nodes.activate_paths(device, m.spec.name)
            message = msgspec.structs.replace(message, cache_path=path, tokenizer_path=tokenizer)
        return message

    # ---- nodes joining and leaving (Ray) --------------------------------------------------------

    def _node_added(self: Controller, node: Node) -> None:
        """A node joined the Ray cluster: its devices join the placement, with their workers."""
        for d in node.devices:
            self.devices[d.name] = d
            self._ledgers[d.name] = self._open_ledger(d)
            self.loop.add_device(d.name)
            self.pool.add_device(d, d.memory_bytes)
        logger.warning("node %s joined: %s", node.name, ", ".join(d.name for d in node.devices))
        self.tick()

    def _node_lost(self: Controller, node: Node, why: str) -> None:
        """A node left (its agent, or the whole machine, died): its devices leave the placement and
        the snapshots first, then its workers are handled as dead (what they ran fails with 503, and
        their models' waiting requests go back through the policy, which activates them elsewhere)."""
        gone = {d.name for d in node.devices}
        left = f"node {node.name} left the cluster ({why})"
        for d in gone:
            for handle in self.pool.on_device(d):
                self._fail_in_flight(handle, lambda model: f"{model}: {left}")
        for m in self.models.values():
            if m.device in gone:
                # an activation in flight there fails when its worker is declared dead below; it is
                # detached first, so that failure cannot undo a new placement made meanwhile
                m.state, m.device, m.worker, m.activation = ModelState.EVICTED, None, None, None
        now = self._now()
        for d in gone:
            self.devices.pop(d, None)
            self.loop.remove_device(d, now)
        for d in gone:
            self._ledgers.pop(d, None)
            self.pool.lose_device(d, f"node {node.name} left the cluster: {why}")
        self.tick()

    # ---- a worker dying -------------------------------------------------------------------------

    def _on_worker_death(self: Controller, handle: WorkerHandle) -> None:
        """Fail what the dead worker was running, forget its model's residency, make the ledger drop
        its entries, and send the model's queued requests back through the policy."""
        self._fail_in_flight(handle, lambda model: f"worker {handle.worker_id} serving {model} died")
        model = self.models.get(handle.model or "")
        if model is not None and model.worker is handle:
            model.state, model.device, model.worker = ModelState.EVICTED, None, None
            model.num_running = 0
        ledger = self._ledgers.get(handle.device.name)  # none: the device left with its node
        if ledger is not None:
            reclaimed = ledger.snapshot()  # reclaims entries of dead pids
            logger.warning("%s: ledger now %s mapped", handle.device.name, format_size(reclaimed.used_bytes))
        if model is not None:
            self.loop.worker_died(model.spec.name, self._now())

    def _fail_in_flight(self: Controller, handle: WorkerHandle, why: Callable[[str], str]) -> None:
        """Fail every request on ``handle`` with ``WorkerDiedError`` (503), saying ``why(its model)``."""
        for req_id in list(handle.in_flight):
            r = self._requests.get(req_id)
            if r is not None:
                self._fail(r, WorkerDiedError(why(r.model)))
