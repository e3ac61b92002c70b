"""Spare weight pages (memory/spare.py) on the real host backend: pages kept mapped across a model
change are reused in place (no page created, the bytes on them untouched until the copy), the
ledger accounts every byte to exactly one entry, and spare pages yield to a grant that needs them,
also one made by another process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prism_serve.memory.spare import BACKGROUND_NICE, SparePages
from prism_serve.memory.vmm import HostVirtualRange
from prism_serve.runtime.loading import DeviceMemoryExhaustedError, map_weight_pages, unmap_weight_pages

MiB = 2**20
PAGE = 2 * MiB


@pytest.fixture
def vrange():
    r = HostVirtualRange("cpu:0", 64 * MiB, PAGE)
    yield r
    r.close()


@pytest.fixture
def loader():
    with ThreadPoolExecutor(2) as pool:
        yield pool


def _by_name(ledger) -> dict[str, int]:
    return {e.name: e.mapped_bytes for e in ledger.snapshot().entries}


def _exact(ledger, vrange) -> None:
    """What the ledger grants this process equals the pages mapped, and the memory behind them."""
    snap = ledger.snapshot()
    assert snap.used_bytes == vrange.mapped_bytes == vrange.physical_bytes()


def test_an_evicted_models_pages_are_reused_in_place(make_ledger, vrange, loader):
    ledger = make_ledger(budget_bytes=64 * MiB)
    spare = SparePages(vrange, ledger, "w0 spare", target_bytes=16 * MiB, thread=False)
    a = ledger.account("a weights")
    n, reused = map_weight_pages(vrange, a, 10 * MiB, loader, spare)
    assert (n, reused) == (5, 0)  # nothing spare yet: five pages created
    flat = vrange.as_tensor()
    flat[: 10 * MiB].fill_(7)
    _exact(ledger, vrange)
    unmap_weight_pages(vrange, a, n, spare)
    a.close()
    assert _by_name(ledger) == {"w0 spare": 10 * MiB}  # still mapped, now owned by no model
    assert vrange.mapped_bytes == 10 * MiB and int(flat[: 10 * MiB].min()) == 7  # untouched
    b = ledger.account("b weights")
    n, reused = map_weight_pages(vrange, b, 14 * MiB, loader, spare)
    assert (n, reused) == (7, 5)  # five in place, two created
    assert _by_name(ledger) == {"w0 spare": 0, "b weights": 14 * MiB}
    _exact(ledger, vrange)
    # a smaller model next: the pages it does not need stay spare above it
    unmap_weight_pages(vrange, b, n, spare)
    b.close()
    c = ledger.account("c weights")
    n, reused = map_weight_pages(vrange, c, 3 * MiB, loader, spare)
    assert (n, reused) == (2, 2) and _by_name(ledger) == {"w0 spare": 10 * MiB, "c weights": 4 * MiB}
    _exact(ledger, vrange)
    assert spare.stats().reused == 7 and spare.stats().kept == 5 + 7
    unmap_weight_pages(vrange, c, n, spare)
    c.close()
    spare.close()
    assert vrange.mapped_bytes == 0 and vrange.physical_bytes() == 0
    assert ledger.snapshot().used_bytes == 0


def test_keeping_stops_at_the_target_and_off_means_off(make_ledger, vrange, loader):
    ledger = make_ledger(budget_bytes=64 * MiB)
    spare = SparePages(vrange, ledger, "w0 spare", target_bytes=4 * MiB, thread=False)
    a = ledger.account("a weights")
    n, _ = map_weight_pages(vrange, a, 12 * MiB, loader, spare)
    unmap_weight_pages(vrange, a, n, spare)
    assert _by_name(ledger)["w0 spare"] == 4 * MiB and vrange.physical_bytes() == 4 * MiB
    assert a.entry().mapped_bytes == 0
    spare.close()
    off = SparePages(vrange, ledger, "w1 spare", target_bytes=0, thread=False)
    n, reused = map_weight_pages(vrange, a, 6 * MiB, loader, off)
    unmap_weight_pages(vrange, a, n, off)
    assert reused == 0 and vrange.mapped_bytes == 0 and ledger.snapshot().used_bytes == 0
    off.close()


def test_pages_are_made_ahead_of_time_within_the_headroom(make_ledger, vrange, loader):
    ledger = make_ledger(budget_bytes=40 * MiB)
    spare = SparePages(vrange, ledger, "w0 spare", target_bytes=12 * MiB, headroom=0.25, thread=False)
    other = ledger.account("other model")
    assert other.try_reserve(22 * MiB)  # 18 MiB free, 10 MiB of headroom: room for 4 pages
    spare.tend()
    assert spare.spare_bytes == 8 * MiB and _by_name(ledger)["w0 spare"] == 8 * MiB
    other.release(22 * MiB)
    spare.tend()
    assert spare.spare_bytes == 12 * MiB  # up to the target, no further
    a = ledger.account("a weights")
    n, reused = map_weight_pages(vrange, a, 12 * MiB, loader, spare)
    assert (n, reused) == (6, 6)  # the activation created nothing
    _exact(ledger, vrange)
    spare.tend()  # the active model's pages count toward the target: nothing more is made
    assert spare.spare_bytes == 0 and vrange.mapped_bytes == 12 * MiB
    unmap_weight_pages(vrange, a, n, spare)
    spare.close()


def test_one_idle_worker_per_device_makes_the_pages_ahead(make_ledger, loader):
    """Each worker's thread makes pages ahead, but the device keeps one model's worth: they go to
    one idle worker (the most spare, then the lowest slot), so the activation the pool hands it
    reuses them all instead of finding a share in each worker."""
    ledger = make_ledger(budget_bytes=64 * MiB)
    r0, r1 = HostVirtualRange("cpu:0", 32 * MiB, PAGE), HostVirtualRange("cpu:0", 32 * MiB, PAGE)
    w0 = SparePages(r0, ledger, "w0 spare", target_bytes=12 * MiB, headroom=0.1, thread=False)
    w1 = SparePages(r1, ledger, "w1 spare", target_bytes=12 * MiB, headroom=0.1, thread=False)
    try:
        w1.tend()  # a tie at nothing: the lower slot (w0) leads, w1 waits
        assert w1.spare_bytes == 0
        w0.tend()
        w1.tend()
        assert (w0.spare_bytes, w1.spare_bytes) == (12 * MiB, 0)
        a = ledger.account("a weights")  # w0 becomes an engine: its pages are the model's
        n, reused = map_weight_pages(r0, a, 12 * MiB, loader, w0)
        assert (n, reused) == (6, 6)
        w1.tend()  # now w1 is the idle worker with the most spare: it makes the next model's pages
        assert w1.spare_bytes == 12 * MiB
        unmap_weight_pages(r0, a, n, w0)  # w0's model pages become spare again, up to the target
        assert w0.spare_bytes + w1.spare_bytes <= 24 * MiB
    finally:
        w0.close()
        w1.close()
        r0.close()
        r1.close()


def test_spare_pages_yield_to_a_grant_that_needs_them(make_ledger, vrange, loader):
    ledger = make_ledger(budget_bytes=16 * MiB)
    spare = SparePages(vrange, ledger, "w0 spare", target_bytes=12 * MiB, headroom=0.0, poll_interval_s=0.005)
    deadline = time.monotonic() + 10
    while spare.spare_bytes < 12 * MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spare.spare_bytes == 12 * MiB and ledger.snapshot().spare_bytes == 12 * MiB
    other = ledger.account("kv of another model")
    assert not other.try_reserve(8 * MiB)  # refused now: 4 MiB free; the spare holder is asked
    assert ledger.snapshot().reclaim_bytes == 4 * MiB
    deadline = time.monotonic() + 10
    while not other.try_reserve(8 * MiB):
        assert time.monotonic() < deadline, "the spare pages were never given back"
        time.sleep(0.005)
    snap = ledger.snapshot()
    assert snap.used_bytes <= snap.budget_bytes and snap.spare_bytes == 8 * MiB
    assert vrange.physical_bytes() == 8 * MiB  # really unmapped, not just un-accounted
    assert spare.stats().given_back == 2
    other.close()
    spare.close()


def test_the_thread_that_makes_pages_runs_at_the_lowest_priority(make_ledger, vrange):
    """Pages are made on the device's cores while other engines step there: the thread is nice 19
    (the worker's main thread, which serves, keeps its priority)."""
    ledger = make_ledger(budget_bytes=16 * MiB)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    spare = SparePages(vrange, ledger, "w0 spare", target_bytes=4 * MiB, headroom=0.0, poll_interval_s=0.005)
    try:
        deadline = time.monotonic() + 10
        while spare.thread_nice is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert spare.thread_nice == BACKGROUND_NICE == 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        spare.close()


def test_weights_wait_for_another_processes_spare_pages(make_ledger, namespace, vrange, loader):
    """A worker in another process holds the device's free memory as spare pages; an activation
    here needs more than is free: the ledger asks, the other process unmaps, the activation goes on."""
    ledger = make_ledger(budget_bytes=24 * MiB)
    code = (
        "import sys, time\n"
        "from prism_serve.memory.ledger import DeviceLedger\n"
        "from prism_serve.memory.spare import BACKGROUND_NICE, SparePages\n"
        "from prism_serve.memory.vmm import HostVirtualRange\n"
        f"l = DeviceLedger('cpu:0', namespace='{namespace}')\n"
        "r = HostVirtualRange('cpu:0', 32 * 2**20)\n"
        "s = SparePages(r, l, 'other spare', target_bytes=20 * 2**20, headroom=0.0, poll_interval_s=0.005)\n"
        "while s.spare_bytes < 20 * 2**20: time.sleep(0.01)\n"
        "print('READY', r.physical_bytes(), flush=True)\n"
        "sys.stdin.readline()\n"
        "print(r.physical_bytes(), s.stats().given_back, flush=True)\n"
        "s.close(); r.close()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().split() == ["READY", str(20 * MiB)]
        mine = ledger.account("my weights")
        with pytest.raises(DeviceMemoryExhaustedError):  # more than the budget: no waiting helps
            map_weight_pages(vrange, mine, 26 * MiB, loader)
        n, _ = map_weight_pages(vrange, mine, 10 * MiB, loader)  # 4 MiB free: waits for 6 more
        assert n == 5 and mine.entry().mapped_bytes == 10 * MiB
        snap = ledger.snapshot()
        assert snap.used_bytes <= snap.budget_bytes
        child.stdin.write("\n")
        child.stdin.flush()
        physical, given_back = map(int, child.stdout.readline().split())
        assert given_back >= 3 and physical == 20 * MiB - given_back * PAGE
        assert physical + vrange.physical_bytes() <= 24 * MiB  # the device never held more than its budget
        unmap_weight_pages(vrange, mine, n)
        mine.close()
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_a_move_changes_owner_not_totals(make_ledger):
    ledger = make_ledger(budget_bytes=10 * MiB)
    a, b = ledger.account("a", spare=True), ledger.account("b", limit_bytes=3 * MiB)
    assert a.try_reserve(6 * MiB)
    assert not a.move_to(b, 4 * MiB)  # over b's limit: nothing moves
    assert a.move_to(b, 2 * MiB)
    snap = ledger.snapshot()
    assert snap.used_bytes == 6 * MiB and snap.spare_bytes == 4 * MiB
    assert {e.name: (e.mapped_bytes, e.spare) for e in snap.entries} == {
        "a": (4 * MiB, True), "b": (2 * MiB, False)
    }  # fmt: skip
    from prism_serve.memory.ledger import LedgerError

    with pytest.raises(LedgerError):
        b.move_to(a, 3 * MiB)  # more than b holds
