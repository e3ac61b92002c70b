"""The engine pool: worker processes per device, the controller's ZeroMQ socket, and the watch
that notices a dead worker.

Every worker is a real process (``python -m prism_serve.runtime.worker``) started before any model
needs it; the pool keeps ``DeviceSpec.num_workers`` of them per device at start and at least one idle
worker per device afterwards, so an activation never waits for a process to start unless many
models activate on one device at once. A worker that reports ready is sent ``prepare()`` (the host
cache files and tokenizers to open while it waits), so its first activation costs what later ones do.

A worker of a CPU device runs on that device's cores from its first instruction: the pool pins the
process as it starts it, so an interpreter and torch starting up take the device's cores, not the
server's. Where a device's workers keep dying before they report ready (a core list the machine no
longer grants, a broken driver, a Python without vLLM), each further start of one waits twice as
long as the last (1 s, 2 s, ... 60 s), and from the third an error says so: every start is an
interpreter and its imports, which a start failing in a loop would spend forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from prism_serve.errors import PrismError, WorkerDiedError
from prism_serve.runtime import messages as msg
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.loading import LOAD_THREADS

logger = logging.getLogger(__name__)

# the pause before a device's next worker start after its workers died before reporting ready, n
# times in a row: _RESPAWN_FIRST_S * 2 ** (n - 1), at most _RESPAWN_MAX_S
_RESPAWN_FIRST_S = 1.0
_RESPAWN_MAX_S = 60.0


def shielded(fut: asyncio.Future) -> asyncio.Future:
    """``asyncio.shield(fut)`` whose outcome is retrieved even when nobody awaits it any more: a
    wait for one of several starting workers leaves the others' shields behind, and one of those
    workers dying later (at shutdown, say) would log "Future exception was never retrieved"."""
    outer = asyncio.shield(fut)
    outer.add_done_callback(lambda f: f.cancelled() or f.exception())
    return outer


class WorkerStartError(PrismError):
    """A worker process exited or did not report ready in time."""

    status_code = 503
    error_type = "service_unavailable"


class WorkerState(enum.Enum):
    STARTING = "starting"
    IDLE = "idle"  # in the pool, no model
    ACTIVATING = "activating"
    SERVING = "serving"
    EVICTING = "evicting"
    DEAD = "dead"


class WorkerProcess(Protocol):
    """What the pool needs of a worker's process: ``subprocess.Popen`` for a worker of this machine,
    ``cluster.RemoteProcess`` for one a node agent started on another."""

    pid: int | None
    returncode: int | None

    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def terminate(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int | None: ...


def prism_path(pythonpath: str | None) -> str:
    """``PYTHONPATH`` for a worker started with another environment's Python (vLLM's): prism from
    this checkout or install first, whatever that environment has installed."""
    return os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), pythonpath]))


class Launcher(Protocol):
    """Starts workers on the devices of other nodes (``cluster.RayNodes``)."""

    def spawn(
        self, device: DeviceSpec, worker_id: str, args: list[str], python: str | None = None
    ) -> WorkerProcess: ...

    def endpoint_host(self) -> str: ...


@dataclass(eq=False)
class WorkerHandle:
    worker_id: str
    device: DeviceSpec
    proc: WorkerProcess
    state: WorkerState = WorkerState.STARTING
    model: str | None = None
    pid: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # The reply the controller awaits for an ActivateModel or EvictModel in flight.
    reply: asyncio.Future | None = None
    in_flight: set[str] = field(default_factory=set)  # request ids dispatched to this worker
    stats: msg.EngineStats | None = None
    prepared: msg.Prepared | None = None  # what it opened ahead of activations, once it finished
    engine: str = "builtin"  # the engine it runs: builtin, or vllm (started with the vLLM Python)
    # the weights source it activated last (a vLLM worker keeps that model's weights and shape)
    last_source: str | None = None
    # a vLLM worker's built engine (engine_key, engine/vllm_engine.py): from its Prepare, then
    # from the models it activated
    engine_key: str | None = None

    @property
    def identity(self) -> bytes:
        return self.worker_id.encode()


OnMessage = Callable[[WorkerHandle, msg.Message], None]
OnDeath = Callable[[WorkerHandle], None]


class WorkerPool:
    def __init__(
        self,
        devices: list[DeviceSpec],
        *,
        on_message: OnMessage,
        on_death: OnDeath,
        namespace: str | None,
        reserve_bytes: dict[str, int],
        page_size: int,
        load_threads: int = LOAD_THREADS,
        spare_of: Callable[[WorkerHandle], int] | None = None,
        start_timeout_s: float = 120.0,
        poll_interval_s: float = 0.05,
        launcher: Launcher | None = None,
        vllm_python: str | None = None,
    ) -> None:
        self.devices = {d.name: d for d in devices}
        self.workers: dict[str, WorkerHandle] = {}
        self._on_message = on_message
        self._on_death = on_death
        self._namespace = namespace
        self._reserve_bytes = reserve_bytes
        self.page_size = page_size
        self._load_threads = load_threads
        self._spare_bytes = 0
        self._spare_of = spare_of
        self._prepare: Callable[[WorkerHandle], msg.Prepare] | None = None
        self._start_timeout_s = start_timeout_s
        self._poll_interval_s = poll_interval_s
        self._launcher = launcher
        # the Python of an environment with vLLM: vLLM workers start with it (None: no vLLM workers)
        self._vllm_python = vllm_python
        self._tcp_endpoint: str | None = None  # bound on first use, for workers of other nodes
        self._ids = itertools.count()
        self._tmp = tempfile.TemporaryDirectory(prefix="prism-ipc-")
        self.endpoint = f"ipc://{Path(self._tmp.name) / 'controller.sock'}"
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone worker raises, not drops
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._decoder = msg.from_worker_decoder()
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        # (device, engine) -> workers of it that died before ready, in a row, and when the last did
        self._failed_starts: dict[tuple[str, str], tuple[int, float]] = {}
        # (device, engine) -> the start that waits for its pause to pass, and what asked for it
        self._due: dict[tuple[str, str], tuple[asyncio.TimerHandle, list[Callable[[], bool]]]] = {}

    async def start(
        self, *, spare_bytes: int = 0, prepare: Callable[[WorkerHandle], msg.Prepare] | None = None
    ) -> None:
        """Start every device's workers and wait until they are ready. ``spare_bytes``: weight pages
        each built-in worker keeps ready (memory/spare.py); ``prepare``: what a worker that reports
        ready opens ahead of activations (None: nothing)."""
        self._spare_bytes = spare_bytes
        self._prepare = prepare
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watch_loop())]
        handles = [self.spawn(d) for d in self.devices.values() for _ in range(d.num_workers)]
        if self._vllm_python:  # one vLLM worker per device, ready before it is needed
            handles += [self.spawn(d, "vllm") for d in self.devices.values()]
        await asyncio.gather(*(self.wait_ready(h) for h in handles))

    # ---- workers ------------------------------------------------------------------------------

    def spawn(self, device: DeviceSpec, engine: str = "builtin") -> WorkerHandle:
        if self._closing:  # stop() waits for the workers it knows; one started now would outlive it
            raise WorkerStartError("the server is shutting down")
        worker_id = f"{device.name}/{'v' if engine == 'vllm' else 'w'}{next(self._ids)}"
        args = [
            "--worker-id", worker_id,
            "--device", device.local_name,
            "--memory-bytes", str(device.memory_bytes),
            "--cores", ",".join(map(str, device.cores)),
            "--endpoint", self._remote_endpoint() if device.node else self.endpoint,
            "--reserve-bytes", str(self._reserve_bytes[device.name]),
            "--page-size", str(self.page_size),
            "--load-threads", str(self._load_threads),
            "--spare-bytes", str(self._spare_bytes if engine == "builtin" else 0),
        ]  # fmt: skip
        env, python = None, None  # None: this Python, as it is
        if engine == "vllm":
            if not self._vllm_python:
                raise WorkerStartError("a vLLM model needs a Python with vLLM (vllm_python in the config)")
            args += ["--engine", "vllm"]
            python = self._vllm_python
            env = {**os.environ, "PYTHONPATH": prism_path(os.environ.get("PYTHONPATH"))}
        if device.node:  # its node agent starts it there, in that node's namespace
            if self._launcher is None:
                raise WorkerStartError(f"{device.name} is on node {device.node!r}: no Ray cluster given")
            proc = self._launcher.spawn(device, worker_id, args, python)
        else:
            if self._namespace:
                args += ["--namespace", self._namespace]
            cmd = [python or sys.executable, "-m", "prism_serve.runtime.worker", *args]
            cmd += ["--parent-pid", str(os.getpid())]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)
            if device.cores and not device.is_cuda:
                # on the device's cores before its imports run, whatever this process runs on now;
                # if it cannot be, the worker's own check of its cores says why and it exits
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(proc.pid, device.cores)
        handle = WorkerHandle(worker_id, device, proc, pid=proc.pid, engine=engine)
        self.workers[worker_id] = handle
        return handle

    def _remote_endpoint(self) -> str:
        """A TCP endpoint on this node's cluster address that workers of other nodes connect to."""
        if self._tcp_endpoint is None:
            assert self._launcher is not None
            host = self._launcher.endpoint_host()
            port = self._sock.bind_to_random_port(f"tcp://{host}")
            self._tcp_endpoint = f"tcp://{host}:{port}"
        return self._tcp_endpoint

    async def wait_ready(self, handle: WorkerHandle) -> WorkerHandle:
        try:
            await asyncio.wait_for(shielded(handle.ready), self._start_timeout_s)
        except TimeoutError:
            handle.proc.kill()
            raise WorkerStartError(
                f"worker {handle.worker_id} did not start in {self._start_timeout_s} s"
            ) from None
        return handle

    def idle(self, device: str, engine: str = "builtin") -> list[WorkerHandle]:
        return [w for w in self.on_device(device) if w.state is WorkerState.IDLE and w.engine == engine]

    async def take(
        self, device: str, engine: str = "builtin", source: str | None = None, key: str | None = None
    ) -> WorkerHandle:
        """An idle worker of ``device`` that runs ``engine``, now marked ACTIVATING (``refill``
        replaces it in the pool). Among several: for vLLM, the one that last activated ``source``
        (it keeps that model's weights and engine, runtime/vllm_slot.py), then one whose engine is
        built for ``key`` (the model's engine_key), of those the one with the most spare memory (the
        kept weights of another model of the shape, whose pages the new one takes); else the one
        with the most spare weight pages (its activation creates the fewest)."""
        spec = self.devices.get(device)
        while True:
            if device not in self.devices:  # at the call, or while it waited for a worker
                raise WorkerStartError(f"device {device} is gone (its node left the cluster)")
            idle = self.idle(device, engine)
            if idle:
                same = [
                    w for w in idle if engine == "vllm" and source is not None and w.last_source == source
                ] or [w for w in idle if engine == "vllm" and key is not None and w.engine_key == key]
                if same:  # of those, the one that kept a model's weights: they take the new ones
                    handle = max(same, key=self._spare_of) if self._spare_of else same[0]
                elif self._spare_of and len(idle) > 1:
                    handle = max(idle, key=self._spare_of)
                else:
                    handle = idle[0]
                handle.state = WorkerState.ACTIVATING
                return handle  # the caller refills the pool once this activation is done
            starting = self._starting(device, engine)
            if not starting:
                pause = self._pause_left(device, engine)
                if pause > 0:  # its workers keep dying at start: the next one after the pause
                    await asyncio.sleep(pause)
                    continue
                starting = [self.spawn(spec, engine)]
            await asyncio.wait([shielded(h.ready) for h in starting], return_when=asyncio.FIRST_COMPLETED)

    def refill(self, device: str, engine: str = "builtin") -> None:
        """Keep one idle worker of ``engine`` ready on ``device`` for the next activation. Called
        when an activation that took one is done, not as it takes it: a new worker's start (and a
        vLLM worker's engine build) would compete for the cores with that activation."""
        self._spawn_when_due(
            device, engine, lambda: not self.idle(device, engine) and not self._starting(device, engine)
        )

    def _pause_left(self, device: str, engine: str) -> float:
        """Seconds until a worker of ``engine`` may start on ``device`` (> 0 only while its workers
        keep dying before they report ready)."""
        failed = self._failed_starts.get((device, engine))
        if failed is None:
            return 0.0
        n, at = failed
        return at + min(_RESPAWN_MAX_S, _RESPAWN_FIRST_S * 2 ** (n - 1)) - time.monotonic()

    def _spawn_when_due(self, device: str, engine: str, wanted: Callable[[], bool]) -> None:
        """Start a worker of ``engine`` on ``device`` if ``wanted()``: now, or once the pause after
        failed starts has passed (one start waits per device and engine; it starts then if any
        of those that asked for it meanwhile still wants it)."""
        key = (device, engine)
        spec = self.devices.get(device)
        if self._closing or spec is None:
            return
        if key in self._due:
            self._due[key][1].append(wanted)
            return
        pause = self._pause_left(device, engine)
        if pause <= 0:
            if wanted():
                self.spawn(spec, engine)
            return

        def due() -> None:
            wants = self._due.pop(key)[1]
            self._spawn_when_due(device, engine, lambda: any(w() for w in wants))

        self._due[key] = (asyncio.get_running_loop().call_later(pause, due), [wanted])

    def _starting(self, device: str, engine: str = "builtin") -> list[WorkerHandle]:
        return [w for w in self.on_device(device) if w.state is WorkerState.STARTING and w.engine == engine]

    def on_device(self, device: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.device.name == device]

    def send(self, handle: WorkerHandle, message: msg.Message | bytes) -> None:
        """Send a message (or one already encoded) without blocking. A worker whose socket is gone
        (ROUTER_MANDATORY: EHOSTUNREACH) is handled as dead; the asyncio socket reports that through
        the send's future."""
        if handle.state is WorkerState.DEAD:
            raise WorkerDiedError(f"worker {handle.worker_id} is dead")
        data = message if isinstance(message, bytes) else msg.encode(message)
        fut = self._sock.send_multipart([handle.identity, data], flags=zmq.NOBLOCK)

        def check(f: asyncio.Future) -> None:
            e = None if f.cancelled() else f.exception()
            if e is not None:
                self._died(handle, f"send failed: {e}")

        if fut.done():
            check(fut)
            if handle.state is WorkerState.DEAD:
                raise WorkerDiedError(f"worker {handle.worker_id} is unreachable")
        else:
            fut.add_done_callback(check)

    def try_send(self, handle: WorkerHandle, message: msg.Message | bytes) -> bool:
        """``send``; False (logged) if the send itself failed. A dead worker counts as sent: the
        death handler fails what was in flight."""
        try:
            self.send(handle, message)
        except WorkerDiedError:
            pass
        except Exception:
            logger.exception("sending to %s failed", handle.worker_id)
            return False
        return True

    # ---- background loops ---------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            identity, payload = await self._sock.recv_multipart()
            handle = self.workers.get(identity.decode())
            if handle is None or handle.state is WorkerState.DEAD:
                continue
            try:
                m = self._decoder.decode(payload)
            except Exception:
                logger.exception("undecodable message from %s", handle.worker_id)
                continue
            if isinstance(m, msg.WorkerReady):
                handle.state = WorkerState.IDLE
                self._failed_starts.pop((handle.device.name, handle.engine), None)
                if self._prepare is not None:
                    with contextlib.suppress(WorkerDiedError):
                        self.send(handle, self._prepare(handle))
                if not handle.ready.done():
                    handle.ready.set_result(handle)
                continue
            if isinstance(m, msg.Prepared):
                handle.prepared = m
                if m.engines:
                    handle.engine_key = m.engines[-1]
                continue
            try:
                self._on_message(handle, m)
            except Exception:  # a bug in one handler must not stop every other message
                logger.exception("handling %s from %s failed", type(m).__name__, handle.worker_id)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            for handle in list(self.workers.values()):
                if handle.state is not WorkerState.DEAD and handle.proc.poll() is not None:
                    self._died(handle, f"exit status {handle.proc.returncode}")

    def _died(self, handle: WorkerHandle, why: str) -> None:
        if handle.state is WorkerState.DEAD:
            return
        was = handle.state
        handle.state = WorkerState.DEAD
        self.workers.pop(handle.worker_id, None)
        if handle.proc.poll() is None:
            handle.proc.kill()
        if not self._closing:
            logger.warning("worker %s (pid %s, %s) died: %s", handle.worker_id, handle.pid, was.value, why)
        error = WorkerDiedError(f"worker {handle.worker_id} died ({why})")
        if not handle.ready.done():
            handle.ready.set_exception(error)
            handle.ready.exception()  # retrieved: nobody may be waiting on a replacement's start
        if handle.reply is not None and not handle.reply.done():
            handle.reply.set_exception(error)
            # retrieved: its waiter gets it, unless shutdown cancelled the waiter first (then asyncio
            # would log "Future exception was never retrieved" as the server stops)
            handle.reply.exception()
        if self._closing:
            return
        name, engine = handle.device.name, handle.engine
        if was is WorkerState.STARTING:
            n = self._failed_starts.get((name, engine), (0, 0.0))[0] + 1
            self._failed_starts[name, engine] = (n, time.monotonic())
            if n >= 3:
                logger.error(
                    "%s: %d %s workers in a row died before they were ready; the next starts in %.0f s",
                    name, n, engine, self._pause_left(name, engine),
                )  # fmt: skip
        self._on_death(handle)
        # the replacement
        if engine == "vllm":
            self._spawn_when_due(name, engine, lambda: not self.idle(name, "vllm"))
        else:
            self._spawn_when_due(
                name,
                engine,
                lambda: (
                    len([w for w in self.on_device(name) if w.engine == "builtin"])
                    < self.devices[name].num_workers
                ),
            )

    def add_device(self, device: DeviceSpec, reserve_bytes: int) -> None:
        """A device of a node that joined: its ``num_workers`` workers start now."""
        self.devices[device.name] = device
        self._reserve_bytes[device.name] = reserve_bytes
        for key in [k for k in self._failed_starts if k[0] == device.name]:  # a new node's start
            del self._failed_starts[key]
        for _ in range(device.num_workers):
            self.spawn(device)

    def lose_device(self, device: str, why: str) -> None:
        """``device`` is gone with its node: no replacement starts there, and its workers die now
        (what they ran fails, through ``on_death``)."""
        self.devices.pop(device, None)
        for handle in self.on_device(device):
            with contextlib.suppress(Exception):
                handle.proc.kill()
            self._died(handle, why)

    # ---- shutdown -----------------------------------------------------------------------------

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        for timer, _ in self._due.values():
            timer.cancel()
        self._due.clear()
        for handle in list(self.workers.values()):
            if handle.state is WorkerState.STARTING:  # not connected yet: it cannot hear Shutdown
                handle.proc.terminate()
            elif handle.state is not WorkerState.DEAD:
                with contextlib.suppress(WorkerDiedError):
                    self.send(handle, msg.Shutdown())
        deadline = time.monotonic() + timeout_s
        for handle in list(self.workers.values()):
            while handle.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if handle.proc.poll() is None:
                handle.proc.kill()
                handle.proc.wait()
            handle.state = WorkerState.DEAD
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close()
        self._ctx.term()
        self._tmp.cleanup()
