"""Where the controller's devices live: ``NodeSet``.

Each device has a ledger: the shared-memory ``DeviceLedger`` of this machine, or, for a device of
another node of a Ray cluster, a ``LedgerMirror`` of its node agent's last poll (runtime/cluster.py).
Devices join and leave with their node; a worker that died leaves entries in its device's ledger,
which the next read reclaims. The host cache files an idle worker prepares and an activation copies
from are its own node's: this machine's cache for local devices, the node agent's for others.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping

from prism_serve.memory.ledger import DeviceLedger
from prism_serve.memory.spare import spare_bytes
from prism_serve.memory.vmm import format_size
from prism_serve.runtime import messages as msg
from prism_serve.runtime.cluster import LedgerMirror, Node, RayNodes
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.workers import WorkerHandle

__all__ = ["NodeSet"]

logger = logging.getLogger(__name__)

Ledger = DeviceLedger | LedgerMirror


class NodeSet:
    def __init__(self, devices: Iterable[DeviceSpec], namespace: str | None, ray: RayNodes | None) -> None:
        self.devices = {d.name: d for d in devices}
        self.namespace = namespace
        self.ray = ray  # the Ray cluster that holds the devices of other nodes, or None
        if bad := [d for d in self.devices.values() if d.node and ray is None]:
            raise ValueError(f"devices {[d.name for d in bad]} are on other nodes: give the Ray cluster")
        self._ledgers: dict[str, Ledger] = {}

    @property
    def ledgers(self) -> Mapping[str, Ledger]:
        return self._ledgers

    def max_devices_per_node(self) -> int:
        """The most devices one node has (a tensor parallel model's ranks never span nodes)."""
        per_node = Counter(d.node for d in self.devices.values())
        return max(per_node.values(), default=0)

    def ledger(self, device: str) -> Ledger:
        return self._ledgers[device]

    def open(self) -> None:
        """Open every device's ledger (creating this machine's with the device's budget)."""
        for d in self.devices.values():
            self._ledgers[d.name] = self._open(d)

    def close(self) -> None:
        for ledger in self._ledgers.values():
            if not ledger.snapshot().entries:  # nobody else on the device: leave no file behind
                ledger.unlink()
            ledger.close()

    def _open(self, d: DeviceSpec) -> Ledger:
        if d.node:
            assert self.ray is not None
            return self.ray.ledger(d.name)
        ledger = DeviceLedger(d.name, d.memory_bytes, self.namespace)
        if ledger.budget_bytes != d.memory_bytes:
            ledger.set_budget(d.memory_bytes)
        return ledger

    def spare_of(self, handle: WorkerHandle) -> int:
        """Memory a worker holds that the next model it activates takes over (its spare weight
        pages, a vLLM worker's kept weights)."""
        return spare_bytes(self._ledgers[handle.device.name].peek(), handle.worker_id)

    def reclaim(self, device: str) -> None:
        """A worker of ``device`` died: the ledger drops the entries of dead processes now."""
        ledger = self._ledgers.get(device)  # none: the device left with its node
        if ledger is not None:
            reclaimed = ledger.snapshot()
            logger.warning("%s: ledger now %s mapped", device, format_size(reclaimed.used_bytes))

    # ---- the host cache of another node ---------------------------------------------------------

    def prepare_message(self, node: str, engine: str) -> msg.Prepare | None:
        """What an idle worker of another node prepares: that node's cache files of the models on
        ``engine`` (None until its cache is filled)."""
        assert self.ray is not None
        joined = self.ray.nodes.get(node)
        return joined.prepares.get(engine) if joined is not None else None

    def activate_paths(self, device: str, model: str, rank: int = 0) -> tuple[str, str] | None:
        """``model``'s cache file (a tensor parallel model's: ``rank``'s) and tokenizer on
        ``device``'s node (None: this machine's cache)."""
        if not self.devices[device].node or self.ray is None:
            return None
        return self.ray.activate_paths(device, model, rank)

    # ---- nodes joining and leaving (Ray) --------------------------------------------------------

    def add(self, node: Node) -> list[DeviceSpec]:
        """A node joined the Ray cluster: its devices and their ledgers join."""
        for d in node.devices:
            self.devices[d.name] = d
            self._ledgers[d.name] = self._open(d)
        logger.warning("node %s joined: %s", node.name, ", ".join(d.name for d in node.devices))
        return list(node.devices)

    def remove(self, node: Node) -> None:
        """A node left: its devices and their ledgers go."""
        for d in node.devices:
            self.devices.pop(d.name, None)
            self._ledgers.pop(d.name, None)
