"""The engine pool's worker starts: a CPU device's workers run on its cores whatever the server
runs on, and a device whose workers keep dying before they are ready gets its next starts after
growing pauses instead of in a loop (runtime/workers.py)."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import zmq
import zmq.asyncio

from prism_serve.errors import WorkerDiedError
from prism_serve.runtime import messages as msg
from prism_serve.runtime import workers as workers_mod
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.workers import WorkerHandle, WorkerPool, WorkerState


async def until(started: list, n: int, timeout_s: float = 10.0) -> None:
    """Wait until ``n`` workers were started (a test that expects none more fails, not hangs)."""

    async def wait() -> None:
        while len(started) < n:
            await asyncio.sleep(0.005)

    await asyncio.wait_for(wait(), timeout_s)


def make_pool(devices: list[DeviceSpec], **kw) -> WorkerPool:
    return WorkerPool(
        devices, on_message=lambda h, m: None, on_death=lambda h: None, namespace=kw.pop("namespace", None),
        reserve_bytes={d.name: 2**26 for d in devices}, page_size=2**21, load_threads=1, **kw,
    )  # fmt: skip


def test_a_worker_runs_on_its_device_cores_when_the_server_was_moved_off_them() -> None:
    """An operator (or a benchmark) pins the server's process to one core after it started; the
    next worker it starts inherits that core. It must still run on its device's cores: before, it
    found its cores "not available to this process", exited, and was started again every two
    seconds, each start an interpreter and torch on the server's core."""
    mine = sorted(os.sched_getaffinity(0))
    assert len(mine) >= 2, "needs two cores: one for this process, another for the device"
    device_core, server_core = mine[-1], mine[0]
    pool = make_pool([DeviceSpec("cpu:0", 2**28, (device_core,), 1)], namespace=f"pool-{os.getpid()}")

    async def run() -> tuple[set[int], WorkerState]:
        await pool.start()
        os.sched_setaffinity(0, {server_core})  # this process stands for the server, moved
        try:
            handle = pool.spawn(pool.devices["cpu:0"])
            await pool.wait_ready(handle)
            return os.sched_getaffinity(handle.pid), handle.state
        finally:
            os.sched_setaffinity(0, mine)
            await pool.stop(timeout_s=10.0)

    assert asyncio.run(run()) == ({device_core}, WorkerState.IDLE)


class _Exited:
    """A worker process that has exited with status 1 (as one whose start failed)."""

    pid = 4242
    returncode = 1

    def poll(self) -> int:
        return 1

    def kill(self) -> None:
        pass

    def terminate(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return 1


class _Launcher:
    """Starts the workers of another node's devices: here every one exits at once, unless told to
    leave the next one running (then the test plays its part: WorkerReady from its socket)."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float]] = []  # worker id, loop time
        self.survive = False

    def spawn(self, device, worker_id, args, python=None):
        self.started.append((worker_id, asyncio.get_running_loop().time()))
        if self.survive:
            return _Running()
        return _Exited()

    def endpoint_host(self) -> str:
        return "127.0.0.1"


class _Running(_Exited):
    returncode = None

    def poll(self) -> None:
        return None


def test_workers_dying_before_ready_are_started_again_after_doubling_pauses(monkeypatch, caplog) -> None:
    monkeypatch.setattr(workers_mod, "_RESPAWN_FIRST_S", 0.02)
    monkeypatch.setattr(workers_mod, "_RESPAWN_MAX_S", 0.08)
    launcher = _Launcher()
    pool = make_pool([DeviceSpec("n1/cpu:0", 2**28, (), 1)], launcher=launcher, poll_interval_s=0.005)
    deaths: list[float] = []
    pool._on_death = lambda h: deaths.append(asyncio.get_running_loop().time())

    async def run() -> None:
        try:
            with pytest.raises(WorkerDiedError):
                await pool.start()
            await until(launcher.started, 6)
        finally:
            await pool.stop(timeout_s=1.0)

    with caplog.at_level(logging.WARNING, logger="prism_serve.runtime.workers"):
        asyncio.run(run())
    # each start waits out the pause its predecessors' deaths set: 0.02, 0.04, 0.08, 0.08, 0.08 s
    # (a timer never fires early; how late it fires is the host's business)
    starts = [t for _, t in launcher.started]
    for k, pause in enumerate([0.02, 0.04, 0.08, 0.08, 0.08]):
        assert starts[k + 1] - deaths[k] >= pause - 1e-3, (k, starts, deaths)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) >= 3 and "3 builtin workers in a row died before they were ready" in errors[0].message
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "died" in r.message]


def test_an_activation_waits_out_the_pause_and_a_ready_worker_ends_it(monkeypatch) -> None:
    """take() during a pause starts nothing before it ends; the worker that then reports ready is
    the one it gets, and the next death starts a replacement at once (the count is reset)."""
    monkeypatch.setattr(workers_mod, "_RESPAWN_FIRST_S", 0.05)
    launcher = _Launcher()
    pool = make_pool([DeviceSpec("n1/cpu:0", 2**28, (), 1)], launcher=launcher, poll_interval_s=0.005)

    async def run() -> None:
        try:
            await steps()
        finally:
            await pool.stop(timeout_s=1.0)

    async def steps() -> None:
        with pytest.raises(WorkerDiedError):
            await pool.start()
        await asyncio.sleep(0.01)  # the death is seen; the replacement waits for 0.05 s
        assert len(launcher.started) == 1 and ("n1/cpu:0", "builtin") in pool._due
        launcher.survive = True
        taking = asyncio.ensure_future(asyncio.wait_for(pool.take("n1/cpu:0"), 5.0))
        await asyncio.sleep(0.02)
        assert len(launcher.started) == 1 and not taking.done()  # still in the pause
        await until(launcher.started, 2)
        worker_id = launcher.started[-1][0]
        assert launcher.started[-1][1] - launcher.started[0][1] >= 0.05 - 1e-3
        # the worker reports ready over the pool's socket, as a real one does
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(pool._remote_endpoint())
        await sock.send(msg.encode(msg.WorkerReady(worker_id, 1, "cpu:0", 0, 0.1)))
        taken = await taking
        assert taken.worker_id == worker_id and taken.state is WorkerState.ACTIVATING
        assert ("n1/cpu:0", "builtin") not in pool._failed_starts
        # a started worker dying is no failed start: its replacement starts at once
        launcher.survive = False
        pool._died(taken, "killed")
        assert len(launcher.started) == 3 and not pool._due
        sock.close()
        ctx.term()

    asyncio.run(run())


def test_stopping_cancels_a_start_that_waits_for_its_pause(monkeypatch) -> None:
    monkeypatch.setattr(workers_mod, "_RESPAWN_FIRST_S", 0.05)
    launcher = _Launcher()
    pool = make_pool([DeviceSpec("n1/cpu:0", 2**28, (), 1)], launcher=launcher, poll_interval_s=0.005)

    reported: list[dict] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        try:
            with pytest.raises(WorkerDiedError):
                await pool.start()
            await asyncio.sleep(0.01)
            assert pool._due
        finally:
            await pool.stop(timeout_s=1.0)
        await asyncio.sleep(0.1)  # past the pause: nothing starts after stop, nothing fails
        pool.refill("n1/cpu:0")

    asyncio.run(run())
    assert len(launcher.started) == 1 and not pool._due and reported == []


def test_a_refill_asked_during_a_pause_starts_its_worker_when_the_pause_ends(monkeypatch) -> None:
    """The replacement waiting out the pause is not needed (the device has its one worker, busy
    with a model), but an activation finished meanwhile asked for an idle worker: the start that
    ends the pause serves both."""
    monkeypatch.setattr(workers_mod, "_RESPAWN_FIRST_S", 0.05)
    launcher = _Launcher()
    pool = make_pool([DeviceSpec("n1/cpu:0", 2**28, (), 1)], launcher=launcher, poll_interval_s=0.005)

    async def run() -> None:
        try:
            with pytest.raises(WorkerDiedError):
                await pool.start()
            await asyncio.sleep(0.01)
            assert ("n1/cpu:0", "builtin") in pool._due
            busy = WorkerHandle("n1/cpu:0/w9", pool.devices["n1/cpu:0"], _Running(), WorkerState.ACTIVATING)
            pool.workers[busy.worker_id] = busy  # the device's one worker, serving a model
            launcher.survive = True
            pool.refill("n1/cpu:0")  # its activation is done: the pool wants an idle worker again
            assert len(launcher.started) == 1  # not before the pause ends
            await until(launcher.started, 2)
            assert launcher.started[1][1] - launcher.started[0][1] >= 0.05 - 1e-3
        finally:
            await pool.stop(timeout_s=0.1)

    asyncio.run(run())
