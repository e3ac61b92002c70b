"""Several real processes, each with its own elastic KV pool, sharing one device ledger."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prism_serve.memory.ledger import DeviceLedger

KiB = 1024
P = 64 * KiB
WORKER = Path(__file__).with_name("pool_worker.py")


class Worker:
    def __init__(self, namespace: str, name: str, block_bytes: int, reserve_pages: int = 32, **cfg) -> None:
        args = {
            "namespace": namespace,
            "name": name,
            "block_bytes": block_bytes,
            "page_size": P,
            "reserve_bytes": reserve_pages * P,
            **cfg,
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._read()
        self.pid, self.fd = hello["pid"], hello["fd"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, **cmd) -> dict:
        self.send(**cmd)
        return self._read()

    def physical_bytes(self) -> int:
        """What the kernel backs this worker's pool with, read from outside the process."""
        try:
            return os.stat(f"/proc/{self.pid}/fd/{self.fd}").st_blocks * 512
        except FileNotFoundError:  # say how the worker ended (its stderr, faulthandler's, is captured)
            raise AssertionError(
                f"worker {self.pid} is gone: exit status {self.proc.wait(timeout=5)}"
            ) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, BrokenPipeError):  # already gone
                self.call(op="exit")
        self.proc.wait(timeout=30)


@pytest.fixture
def workers(namespace):
    started: list[Worker] = []

    def start(name: str, block_bytes: int, **cfg) -> Worker:
        w = Worker(namespace, name, block_bytes, **cfg)
        started.append(w)
        return w

    yield start
    for w in started:
        if w.proc.poll() is None:
            w.stop()


def physical_under_lock(ledger: DeviceLedger, ws: list[Worker]) -> tuple[int, int]:
    """(sum of the workers' physical bytes, ledger used bytes), read while no grant can happen.

    A worker maps only after its grant and releases its grant only after unmapping, so under the
    lock physical <= granted holds for each, and the sum must stay within the budget."""
    with ledger:
        phys = sum(w.physical_bytes() for w in ws)
        used = int(ledger._entries["mapped"].sum())
    return phys, used


class SharedBudgetMachine(RuleBasedStateMachine):
    """Hypothesis interleaves alloc/free/trim of three processes on one device budget."""

    @initialize(budget_pages=st.integers(3, 20))
    def setup(self, budget_pages):
        self.budget = budget_pages * P
        self.ledger.set_budget(self.budget)
        self.held = {i: set() for i in range(len(self.ws))}

    @rule(i=st.integers(0, 2), n=st.integers(1, 6))
    def alloc(self, i, n):
        free_before = self.ledger.snapshot().free_bytes
        ids = self.ws[i].call(op="alloc", n=n)["ids"]
        if ids is None:
            block = self.block_bytes[i]
            assert free_before < n * (-(-block // P) + 1) * P, "refused although the budget had room"
            return
        assert len(set(ids)) == n and not self.held[i] & set(ids), "a block was granted twice"
        self.held[i].update(ids)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.sampled_from([i for i, h in self.held.items() if h]))
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held[i])), min_size=1, unique=True))
        self.ws[i].call(op="free", ids=ids)
        self.held[i].difference_update(ids)

    @rule(i=st.integers(0, 2))
    def trim(self, i):
        self.ws[i].call(op="trim")

    @invariant()
    def within_budget_and_truthful(self):
        if not hasattr(self, "held"):
            return
        phys, used = physical_under_lock(self.ledger, self.ws)
        assert phys <= used <= self.budget
        for i, w in enumerate(self.ws):
            state = w.call(op="state")
            assert state["ledger_mapped"] == state["physical"] == state["mapped_pages"] * P
            assert set(state["held"]) == self.held[i]
            assert state["pages_of_held_mapped"] and not state["bad"]

    def teardown(self):
        if not hasattr(self, "held"):
            return
        for i, w in enumerate(self.ws):
            w.call(op="free", ids=sorted(self.held[i]))
            w.call(op="trim")
        # No page leaked anywhere: every process is back to zero, in the ledger and in the kernel.
        assert physical_under_lock(self.ledger, self.ws) == (0, 0)


def test_processes_sharing_a_device_never_exceed_it_or_leak(make_ledger, workers, namespace):
    ledger = make_ledger(budget_bytes=20 * P)
    block_bytes = [16 * KiB, 40 * KiB, 96 * KiB]  # aligned, straddling, larger than a page
    ws = [workers(f"w{i}", b, buffer_max_pages=i % 2) for i, b in enumerate(block_bytes)]
    SharedBudgetMachine.ledger, SharedBudgetMachine.ws, SharedBudgetMachine.block_bytes = (
        ledger,
        ws,
        block_bytes,
    )
    SharedBudgetMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
    SharedBudgetMachine.TestCase().runTest()


def test_concurrent_churn_with_prefetch_threads_stays_within_budget(make_ledger, workers):
    budget = 24 * P
    ledger = make_ledger(budget_bytes=budget)
    ws = [
        workers(f"w{i}", b, prefetch=True, buffer_min_pages=1, buffer_max_pages=3)
        for i, b in enumerate([16 * KiB, 40 * KiB, 24 * KiB, 64 * KiB])
    ]
    for i, w in enumerate(ws):  # all four run at once
        w.send(op="loop", seed=i, steps=1500, max_n=6)
    samples = 0
    while any(select_ready(w) is False for w in ws):
        phys, used = physical_under_lock(ledger, ws)
        assert phys <= used <= budget
        samples += 1
    results = [w._read() for w in ws]
    assert samples > 0
    assert sum(r["refused"] for r in results) > 0  # the budget was really contended
    for w in ws:
        state = w.call(op="state")
        assert not state["bad"], "a live block's data changed under it"
        assert state["held"] == []
    # All blocks freed: each prefetch thread trims its empty pages down to the buffer's max (it does
    # so in the background, within a poll interval of the last free).
    deadline = time.monotonic() + 10
    while (sample := physical_under_lock(ledger, ws))[1] > 4 * 3 * P and time.monotonic() < deadline:
        time.sleep(0.01)
    phys, used = sample
    assert phys <= used <= 4 * 3 * P
    for w in ws:
        w.stop()
    assert ledger.snapshot().entries == () and ledger.snapshot().used_bytes == 0


def select_ready(w: Worker) -> bool:
    import select

    return bool(select.select([w.proc.stdout], [], [], 0.001)[0])


def test_sigkilled_engine_memory_is_usable_by_the_others(make_ledger, workers):
    ledger = make_ledger(budget_bytes=8 * P)
    victim = workers("victim", 16 * KiB)
    survivor = workers("survivor", 16 * KiB)
    assert victim.call(op="alloc", n=24)["ids"] is not None  # 6 of the 8 pages
    assert survivor.call(op="alloc", n=12)["ids"] is None
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.wait()
    ids = survivor.call(op="alloc", n=32)["ids"]  # the whole device
    assert ids is not None
    assert [e.name for e in ledger.snapshot().entries] == ["survivor"]
    assert ledger.snapshot().used_bytes == 8 * P == survivor.physical_bytes()
