"""Devices on many machines through Ray (``prism serve --ray ADDRESS``).

The controller, the control/ policies and the HTTP server stay one process. Ray starts and
supervises one ``NodeAgent`` actor per node of the cluster; the agent owns what is local to its
machine:
- the ledgers of the node's devices (shared memory, as on one machine);
- the node's host weight cache (every model read once per node, from that node's disk);
- the worker processes (``python -m prism_serve.runtime.worker``), started on request.

Workers connect their ZeroMQ socket straight to the controller's TCP endpoint, so activations,
requests and token streams never pass through Ray: Ray places and watches the agents, and carries
only the control calls (spawn a worker, read the node's ledgers and its workers' exit codes).

The controller sees one cluster. A device of node ``n1`` is called ``n1/cpu:0`` (``DeviceSpec.node``);
nodes are named ``n0`` (Ray's head node), ``n1``, ... in the order they were first seen. Every
``poll_interval_s`` the controller polls each agent (workers that exited, ledger bytes) and Ray's
node table: a node whose agent stops answering is lost (its workers' requests fail with 503, its
devices leave the placement, its models serve again where the policy activates them next); a node
that joins gets an agent, its cache is filled, and its devices join the placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prism_serve.control.placement import node_of
from prism_serve.errors import PrismError
from prism_serve.memory.ledger import DeviceLedger, LedgerSnapshot, default_namespace
from prism_serve.runtime import messages as msg
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec
from prism_serve.runtime.weight_cache import HostWeightCache
from prism_serve.runtime.workers import WorkerStartError, prism_path

logger = logging.getLogger(__name__)

# A node's devices as its agent builds them there: a function of nothing but that machine (so a
# device group splits each node's own cores). build.py passes config.devices through it.
DeviceTemplate = Callable[[], list[DeviceSpec]]


class ClusterError(PrismError):
    """The Ray cluster cannot be reached, or holds no node prism can use."""

    status_code = 503
    error_type = "service_unavailable"


def node_namespace(namespace: str, node: str) -> str:
    """The ledger and host-cache namespace of ``node``: distinct per node even when several Ray
    nodes share one machine (``ray.cluster_utils.Cluster``), and outside the plain namespace's files."""
    return f"{namespace}.{node}"


class NodeAgent:
    """One node's devices, ledgers, host weight cache and worker processes (run as a Ray actor)."""

    def __init__(self, node: str, namespace: str, template: DeviceTemplate, family: str = "") -> None:
        self.node = node
        self.namespace = namespace
        self.devices = {d.name: d for d in template()}
        self.ledgers: dict[str, DeviceLedger] = {}
        for d in self.devices.values():
            ledger = DeviceLedger(d.name, d.memory_bytes, namespace)
            if ledger.budget_bytes != d.memory_bytes:
                ledger.set_budget(d.memory_bytes)
            self.ledgers[d.name] = ledger
        self.cache = HostWeightCache(namespace)
        if family:  # cache files of this deployment's agents that died on this machine
            self.cache.remove_stale(family)
        self.procs: dict[str, subprocess.Popen] = {}

    def describe(self) -> dict[str, Any]:
        """The node's devices (local names) and what the controller logs about the machine."""
        return {
            "devices": [(d.name, d.memory_bytes, d.cores, d.num_workers) for d in self.devices.values()],
            "host": os.uname().nodename,
            "pid": os.getpid(),
        }

    def load(self, specs: list[ModelSpec]) -> dict[str, tuple[list[str], str]]:
        """Read every model into this node's host cache (once); its cache files (one per tensor
        parallel rank) and tokenizer paths."""
        out = {}
        for spec in specs:
            cached = self.cache.load(spec)
            out[spec.name] = (list(cached.files), cached.tokenizer_path)
        return out

    def prepare(self, engine: str = "builtin") -> msg.Prepare:
        """The Prepare message for this node's idle workers of ``engine``."""
        return self.cache.prepare_message(engine=engine)

    def spawn(self, worker_id: str, args: list[str], python: str | None = None) -> tuple[int, int]:
        """Start a worker here, with ``python`` (a vLLM worker: the config's vllm_python, at the
        same path on every node) or the agent's own; it dies with this agent (``--parent-pid``).
        Its pid and niceness."""
        cmd = [
            python or sys.executable, "-m", "prism_serve.runtime.worker", *args,
            "--namespace", self.namespace, "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        env = _worker_env(with_this_prism=python is not None)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, preexec_fn=_normal_priority)
        self.procs[worker_id] = proc
        try:
            niceness = os.getpriority(os.PRIO_PROCESS, proc.pid)
        except OSError:  # exited already: the next poll reports it
            niceness = 0
        return proc.pid, niceness

    def poll(self) -> tuple[dict[str, int], dict[str, LedgerSnapshot]]:
        """Exit codes of the workers that exited since the last poll, and every ledger's snapshot
        (taking one also reclaims the entries of dead processes)."""
        exited = {w: p.returncode for w, p in self.procs.items() if p.poll() is not None}
        for w in exited:
            del self.procs[w]
        return exited, {name: ledger.snapshot() for name, ledger in self.ledgers.items()}

    def kill(self, worker_id: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.get(worker_id)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every worker, then drop this node's cache files and unused ledgers."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        for ledger in self.ledgers.values():
            if not ledger.snapshot().entries:
                ledger.unlink()
            ledger.close()
        self.cache.close()


def _worker_env(with_this_prism: bool = False) -> dict[str, str]:
    """The agent's environment for a worker, less what Ray sets for its own task processes: a
    worker sizes its thread pools from its device's cores, as on one machine. ``with_this_prism``:
    for another environment's Python (vLLM's), this prism's package first on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if with_this_prism:
        env["PYTHONPATH"] = prism_path(env.get("PYTHONPATH"))
    return env


def _normal_priority() -> None:
    """Ray runs actors at a lowered priority (``RAY_worker_niceness``, 15); an engine worker runs at
    normal priority where the OS allows it (root or CAP_SYS_NICE), else as the agent does."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)


class RemoteProcess:
    """A worker process on another node, as the pool sees it (``WorkerProcess``): its exit code
    comes from the agent's polls, and kill/terminate are sent to the agent."""

    def __init__(self, agent: Any, worker_id: str, pid: int) -> None:
        self._agent = agent
        self.worker_id = worker_id
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def _signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(Exception):  # a lost node's agent: its workers died with it
                self._agent.kill.remote(self.worker_id, int(sig))

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class LedgerMirror:
    """A ledger of another node, as the controller reads it: the snapshot of the agent's last poll."""

    def __init__(self, device: str, budget_bytes: int) -> None:
        self._snapshot = LedgerSnapshot(device, budget_bytes, ())

    def update(self, snap: LedgerSnapshot) -> None:
        self._snapshot = snap

    def snapshot(self) -> LedgerSnapshot:
        return self._snapshot

    peek = snapshot

    @property
    def budget_bytes(self) -> int:
        return self._snapshot.budget_bytes

    def close(self) -> None:
        pass

    def unlink(self) -> None:
        pass


@dataclass(eq=False)
class Node:
    name: str
    ray_id: str
    agent: Any
    devices: list[DeviceSpec] = field(default_factory=list)  # qualified: "n1/cpu:0"
    # model -> its cache files (one per tensor parallel rank), tokenizer
    paths: dict[str, tuple[list[str], str]] = field(default_factory=dict)
    prepares: dict[str, msg.Prepare] = field(default_factory=dict)  # by engine
    procs: dict[str, RemoteProcess] = field(default_factory=dict)
    ledgers: dict[str, LedgerMirror] = field(default_factory=dict)  # by qualified device name
    ready: bool = False  # its cache is filled and its devices are in the controller's placement
    warned_niceness: bool = False


@contextlib.contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """This process's SIGTERM and SIGINT handlers, as they were, after the block: Ray installs its
    own when it starts a driver or a node here. Only the main thread can set handlers; elsewhere
    there are none to restore."""
    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


OnNodeAdded = Callable[[Node], Awaitable[None] | None]
OnNodeLost = Callable[[Node, str], None]


class RayNodes:
    """The controller's side of a Ray cluster: one agent per node, the workers they start
    (``workers.Launcher``), and the watch that notices nodes leaving and joining."""

    def __init__(
        self,
        address: str,
        template: DeviceTemplate,
        namespace: str | None = None,
        *,
        poll_interval_s: float = 0.5,
        poll_timeout_s: float = 10.0,
    ) -> None:
        self.address = address
        self.template = template
        self.namespace = namespace or default_namespace()
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.nodes: dict[str, Node] = {}  # by prism name (n0, n1, ...)
        self._seen: set[str] = set()  # Ray node ids ever given a name (a lost node does not come back)
        self._specs: list[ModelSpec] = []
        self._task: asyncio.Task | None = None
        self._on_added: OnNodeAdded | None = None
        self._on_lost: OnNodeLost | None = None
        self._inited = False
        self._ip: str | None = None
        # the watch's calls to Ray's node table, off the event loop; stop() waits for one in flight
        # (a cancelled await leaves its thread running) before it shuts Ray down under it
        self._table = ThreadPoolExecutor(1, thread_name_prefix="prism-ray-nodes")

    # ---- joining the cluster ------------------------------------------------------------------

    def connect(self) -> list[DeviceSpec]:
        """Join the Ray cluster and start an agent on every live node; their devices, qualified.
        Synchronous: the controller's device list is known before it is built."""
        try:
            import ray
        except ImportError as e:
            raise ClusterError(f"--ray needs the ray package: pip install 'prism-serve[ray]' ({e})") from None
        if not ray.is_initialized():
            # Ray's driver takes SIGTERM and SIGINT (exit with status 15 at once); the server's own
            # handlers stay, so a SIGTERM still shuts the server down gracefully
            try:
                with keep_signal_handlers():
                    ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
            except Exception as e:  # ConnectionError, or Ray's own for a bad address
                raise ClusterError(f"cannot join the Ray cluster at {self.address!r}: {e}") from None
            self._inited = True
        self._ip = ray.util.get_node_ip_address()
        for ray_id in self._alive_nodes():
            self._start_agent(ray_id)
        if not self.nodes:
            raise ClusterError(f"the Ray cluster at {self.address!r} has no live node")
        try:
            described = ray.get([n.agent.describe.remote() for n in self.nodes.values()])
        except Exception as e:  # an agent that could not start: a device the config names that
            # this node lacks, or prism-serve missing there
            # Ray's text ends with the agent's own traceback: its last line names the error
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ClusterError(f"a node agent did not start: {last}") from None
        for node, info in zip(self.nodes.values(), described, strict=True):
            self._set_devices(node, info)
        devices = [d for n in self.nodes.values() for d in n.devices]
        if not devices:
            raise ClusterError("no node of the Ray cluster has a device")
        return devices

    def _alive_nodes(self) -> list[str]:
        """Ray ids of live nodes not seen before, the head first."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in self._seen]
        nodes.sort(key=lambda n: "node:__internal_head__" not in n.get("Resources", {}))
        return [n["NodeID"] for n in nodes]

    def _start_agent(self, ray_id: str) -> Node:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = f"n{len(self._seen)}"
        self._seen.add(ray_id)
        actor = ray.remote(NodeAgent).options(
            num_cpus=0,
            name=f"prism-agent-{self.namespace}-{name}",
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_id, soft=False),
            max_restarts=0,
        )
        agent = actor.remote(name, node_namespace(self.namespace, name), self.template, self.namespace)
        node = Node(name, ray_id, agent)
        self.nodes[name] = node
        return node

    def _set_devices(self, node: Node, info: dict[str, Any]) -> None:
        node.devices = [
            DeviceSpec(f"{node.name}/{local}", memory, tuple(cores), workers)
            for local, memory, cores, workers in info["devices"]
        ]
        node.ledgers = {d.name: LedgerMirror(d.local_name, d.memory_bytes) for d in node.devices}
        logger.info(
            "node %s (%s, agent pid %s): %s", node.name, info["host"], info["pid"],
            ", ".join(d.describe() for d in node.devices),
        )  # fmt: skip

    async def start(self, specs: Iterable[ModelSpec], on_added: OnNodeAdded, on_lost: OnNodeLost) -> None:
        """Fill every node's host cache (the nodes in parallel), then watch the cluster."""
        self._specs = list(specs)
        self._on_added, self._on_lost = on_added, on_lost
        await asyncio.gather(*(self._fill(n) for n in self.nodes.values()))
        self._task = asyncio.create_task(self._watch())

    async def _fill(self, node: Node) -> None:
        node.paths = await node.agent.load.remote(self._specs)
        for engine in sorted({s.engine_kind for s in self._specs}):
            node.prepares[engine] = await node.agent.prepare.remote(engine)
        node.ready = True

    # ---- what the controller and the pool ask ------------------------------------------------

    def node_of(self, device: str) -> Node:
        return self.nodes[node_of(device)]

    def ledger(self, device: str) -> LedgerMirror:
        return self.node_of(device).ledgers[device]

    def spawn(
        self, device: DeviceSpec, worker_id: str, args: list[str], python: str | None = None
    ) -> RemoteProcess:
        import ray

        node = self.nodes.get(device.node)
        if node is None:
            raise WorkerStartError(f"node {device.node} of {device.name} is gone")
        call = node.agent.spawn.remote(worker_id, args, python)
        pid, niceness = ray.get(call, timeout=self.poll_timeout_s)
        if niceness > 0 and not node.warned_niceness:
            node.warned_niceness = True
            logger.warning(
                "node %s: workers run at niceness %d, as Ray runs its actors, with no permission to "
                "raise it; start Ray there with RAY_worker_niceness=0 so that engines are not starved",
                node.name, niceness,
            )  # fmt: skip
        proc = RemoteProcess(node.agent, worker_id, pid)
        node.procs[worker_id] = proc
        return proc

    def endpoint_host(self) -> str:
        assert self._ip is not None, "connect() first"
        return self._ip

    def activate_paths(self, device: str, model: str, rank: int = 0) -> tuple[str, str]:
        """``model``'s cache file (``rank``'s) and tokenizer on the node of ``device``."""
        files, tokenizer = self.node_of(device).paths[model]
        return files[rank], tokenizer

    # ---- the watch ----------------------------------------------------------------------------

    async def _watch(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await asyncio.gather(*(self._poll(n) for n in list(self.nodes.values()) if n.ready))
                rounds += 1
                if rounds % 4 == 0:  # Ray's node table: about every two seconds
                    await self._join_new()
            except Exception:
                logger.exception("watching the Ray cluster failed")

    async def _poll(self, node: Node) -> None:
        try:
            exited, ledgers = await asyncio.wait_for(node.agent.poll.remote(), self.poll_timeout_s)
        except Exception as e:  # RayActorError (the agent or its node died), or no answer in time
            self._lose(node, f"its agent stopped answering ({type(e).__name__})")
            return
        for worker_id, code in exited.items():
            proc = node.procs.pop(worker_id, None)
            if proc is not None:
                proc.returncode = code
        for local, snap in ledgers.items():
            mirror = node.ledgers.get(f"{node.name}/{local}")
            if mirror is not None:
                mirror.update(snap)

    def _lose(self, node: Node, why: str) -> None:
        if self.nodes.pop(node.name, None) is None:
            return
        logger.warning("node %s left the cluster: %s", node.name, why)
        for proc in node.procs.values():
            proc.returncode = -signal.SIGKILL
        if self._on_lost is not None:
            self._on_lost(node, why)

    async def _join_new(self) -> None:
        # Ray's node table is a call to its GCS, perhaps over the network: not on the event loop
        fresh = await asyncio.get_running_loop().run_in_executor(self._table, self._alive_nodes)
        for ray_id in fresh:
            node = self._start_agent(ray_id)
            try:
                self._set_devices(node, await node.agent.describe.remote())
                await self._fill(node)
            except Exception as e:
                self._lose(node, f"its agent did not start ({type(e).__name__}: {e})")
                continue
            logger.info("node %s joined with %d devices", node.name, len(node.devices))
            if self._on_added is not None:
                done = self._on_added(node)
                if asyncio.iscoroutine(done):
                    await done

    # ---- shutdown -----------------------------------------------------------------------------

    async def stop(self) -> None:
        import ray

        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        stops = [n.agent.stop.remote() for n in self.nodes.values()]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), 30)
        for n in self.nodes.values():
            with contextlib.suppress(Exception):
                ray.kill(n.agent)
        self.nodes.clear()
        await asyncio.get_running_loop().run_in_executor(None, self._table.shutdown)
        if self._inited:
            ray.shutdown()
