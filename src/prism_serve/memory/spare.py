"""Spare pages: physical pages a worker keeps mapped while no model uses them, so that the next
activation copies weights into pages that exist instead of creating them.

Creating a page is what makes an activation slow: on the host backend ``fallocate`` allocates and
zeroes it and ``mmap(MAP_POPULATE)`` builds its page tables (about 2 GB/s here, against 12 GB/s
for the copy); on an H200, creating, mapping and opening a 2 MiB page cost ~36 us on one thread,
and an 8B model's 7,659 pages took 1.0 s on four (its copy: 0.29 s; docs/results.md, "On a GPU (H200)").
So the pages of an evicted model's weights stay mapped where they are (pages ``0..n-1`` of the
worker's weight range), and pages are made ahead of time by a background thread while the device
has room; the next activation on that worker takes them in place: no create, no map, only the copy.
That thread runs at the lowest priority (nice 19): the worker that makes pages is idle, but its
device's cores serve other engines, and making a model's pages is a fraction of a second of CPU
(SmolLM2-135M fp32: 257 pages, ~0.35 s) that must not land in a colocated engine's step. Measured
live at normal priority, a 0.35 s prefill on the same core took 0.70 s while the pages were made.

Accounting stays exact. Spare pages are physical memory, so their bytes stay granted in the device
ledger, to an entry of their own registered as spare. Taking them moves their bytes to the model's
weight entry and giving them back moves them back (``DeviceLedger.move``: one operation, so the
bytes are never counted twice nor dropped). Pages belong to one process and one range, so no two
engines can hold the same page. The controller counts spare bytes as free (they are reclaimable),
and any grant the ledger refuses for lack of budget while spare pages exist asks their holders for
them back: this thread unmaps them within a poll interval and the requester retries (weights wait
up to ``DEFAULT_RECLAIM_WAIT_S``; a KV page is simply asked for again at the next step).

The same code drives the CUDA backend: a spare page there is a ``cuMemCreate`` handle left mapped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

from prism_serve.memory.ledger import Account, DeviceLedger, LedgerError, LedgerSnapshot
from prism_serve.memory.vmm import VirtualRange

__all__ = [
    "DEFAULT_RECLAIM_WAIT_S",
    "SparePages",
    "SpareStats",
    "grant_waiting",
    "spare_bytes",
    "spare_entry",
]

logger = logging.getLogger(__name__)

DEFAULT_RECLAIM_WAIT_S = 2.0
BACKGROUND_NICE = 19


def lower_this_thread() -> int | None:
    """Give the calling thread the lowest CPU priority (nice ``BACKGROUND_NICE``; on Linux
    ``setpriority`` with a thread id applies to that thread only). Returns its nice value, or None
    where the platform does not allow it. Not ``SCHED_IDLE``: a thread that holds the ledger's lock
    or the GIL must still get the core within a scheduling period while engines keep it busy."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (OSError, AttributeError):
        return None


@dataclass(frozen=True, slots=True)
class SpareStats:
    spare_pages: int  # mapped, used by no model, now
    made_ahead: int  # pages created by the thread ahead of an activation
    kept: int  # pages an eviction left spare
    reused: int  # spare pages an activation took
    given_back: int  # spare pages unmapped for a refused grant elsewhere (or over the target)


class SparePages:
    """Spare pages of one ``VirtualRange`` in this process. Pages ``0..n-1`` of the range belong to
    the active model (``take``) or are spare; the thread makes pages ahead of time up to
    ``target_bytes`` (the largest model this worker may receive) while the device keeps
    ``headroom`` of its budget free and no other worker holds that much spare already, and gives
    pages back when a refused grant asks for them. ``target_bytes`` 0 turns all of it off."""

    def __init__(
        self,
        vrange: VirtualRange,
        ledger: DeviceLedger,
        name: str,
        *,
        target_bytes: int = 0,
        headroom: float = 0.25,
        poll_interval_s: float = 0.02,
        thread: bool = True,
    ) -> None:
        self.vrange = vrange
        self.ledger = ledger
        self.page_size = vrange.page_size
        self.account = ledger.account(name, spare=True)
        self.target_pages = min(vrange.num_pages, -(-target_bytes // self.page_size))
        self.headroom = headroom
        self.poll_interval_s = poll_interval_s
        self._spare: set[int] = set()
        self._model_pages = 0  # pages 0..n-1 of the active model (off limits to the thread)
        self._lock = threading.Lock()  # held for each page the thread maps or unmaps
        self._made = self._kept = self._reused = self._given_back = 0
        self._closed = False
        self._wake = threading.Event()
        self.thread_nice: int | None = None  # the thread's nice value once it runs
        self._thread: threading.Thread | None = None
        if thread and self.target_pages:
            self._thread = threading.Thread(target=self._loop, name="prism-spare", daemon=True)
            self._thread.start()

    # ---- activation and eviction ------------------------------------------------------------------

    def take(self, num_pages: int, account: Account) -> tuple[int, list[int]]:
        """Pages ``0..num_pages-1`` for a model whose bytes ``account`` holds: the spare ones among
        them are handed over in place (their bytes move in the ledger). Returns how many were
        reused and the pages that still have to be granted and mapped."""
        with self._lock:
            reuse = [p for p in self._spare if p < num_pages]
            if reuse and not self.account.move_to(account, len(reuse) * self.page_size):
                reuse = []  # the model's entry has a limit that refuses them: map afresh
            self._spare.difference_update(reuse)
            self._reused += len(reuse)
            self._model_pages = num_pages
        return len(reuse), [p for p in range(num_pages) if not self.vrange.is_mapped(p)]

    def give_back(self, num_pages: int, account: Account) -> int:
        """The model's mapped pages among ``0..num_pages-1`` (``account`` holds their bytes) become
        spare, up to the target and unless a grant elsewhere waits for memory; the rest are
        unmapped and released. Returns the pages kept."""
        mapped = [p for p in range(num_pages) if self.vrange.is_mapped(p)]
        with self._lock:
            keep: list[int] = []
            if not self._closed and not self.ledger.reclaim_wanted():
                keep = mapped[: max(0, self.target_pages - len(self._spare))]
                if keep and not account.move_to(self.account, len(keep) * self.page_size):
                    keep = []
            self._spare.update(keep)
            self._kept += len(keep)
            self._model_pages = 0
        kept = set(keep)
        for p in mapped:
            if p not in kept:
                self.vrange.unmap_page(p)
                account.release(self.page_size)
        return len(keep)

    # ---- the thread -------------------------------------------------------------------------------

    def tend(self) -> None:
        """One round: give pages back if a refused grant waits for them (or above the target),
        else make one page ahead of time if the device has room."""
        if self.ledger.reclaim_wanted() > 0:
            # page by page, reading the request again: other holders may be answering it too
            while self.ledger.reclaim_wanted() > 0 and self._give_one():
                pass
            return
        if len(self._spare) > self.target_pages:
            for _ in range(len(self._spare) - self.target_pages):
                self._give_one()
            return
        while not self._closed and self._make_one():
            pass

    def _give_one(self) -> bool:
        with self._lock:
            if not self._spare:
                return False
            p = max(self._spare)
            self._spare.discard(p)
            self.vrange.unmap_page(p)
            self.account.release(self.page_size)
            self._given_back += 1
            return True

    def _make_one(self) -> bool:
        if len(self._spare) + self._model_pages >= self.target_pages:
            return False
        snap = self.ledger.snapshot()
        if time.time() < snap.reclaim_until:
            return False  # memory was wanted elsewhere lately: make nothing it would have to ask back
        if snap.spare_bytes + self.page_size > self.target_pages * self.page_size:
            return False  # the device already keeps enough spare pages
        if snap.free_bytes - self.page_size < self.headroom * snap.budget_bytes:
            return False
        if not self._leads(snap):
            return False  # another worker of the device is the one making pages ahead
        with self._lock:
            if self._closed:
                return False
            p = next((q for q in range(self._model_pages, self.vrange.num_pages)
                      if not self.vrange.is_mapped(q)), None)  # fmt: skip
            if p is None or p >= self.target_pages:
                return False
            if not self.account.try_reserve(self.page_size, reclaim=False):
                return False
            try:
                self.vrange.map_page(p)
            except BaseException:
                self.account.release(self.page_size)
                raise
            self._spare.add(p)
            self._made += 1
            return True

    def _leads(self, snap: LedgerSnapshot) -> bool:
        """Whether this worker makes the device's pages ahead of time: of the idle workers (no
        process whose other entries map bytes: an active engine is not handed the next activation),
        the one whose spare entry holds the most bytes, ties to the lowest ledger slot. One holder
        per device, so the worker the pool hands the next activation (the idle one with the most
        spare pages) finds a whole model's pages made. When every worker's thread made pages, the
        device-wide limit left each a share, and that activation created most of its pages itself
        (SmolLM2-135M fp32: 111 of 257 reused, 1.0 s of map instead of 0.05 s)."""
        busy = {e.pid for e in snap.entries if not e.spare and e.mapped_bytes > 0}
        mine = (-len(self._spare) * self.page_size, self.account.slot)
        return all(
            mine < (-e.mapped_bytes, e.slot)
            for e in snap.entries
            if e.spare and e.slot != self.account.slot and e.pid not in busy
        )

    def _loop(self) -> None:
        self.thread_nice = lower_this_thread()
        while not self._closed:
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()
            if self._closed:
                return
            try:
                self.tend()
            except Exception:  # the worker keeps serving; activations then create their pages
                logger.exception("spare-page thread failed a round")

    # ---- status and life cycle --------------------------------------------------------------------

    @property
    def spare_bytes(self) -> int:
        return len(self._spare) * self.page_size

    def stats(self) -> SpareStats:
        return SpareStats(len(self._spare), self._made, self._kept, self._reused, self._given_back)

    def close(self) -> None:
        """Unmap every spare page and leave the ledger."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            for p in sorted(self._spare):
                self.vrange.unmap_page(p)
            self._spare.clear()
        with contextlib.suppress(LedgerError):
            self.account.close()


def spare_entry(owner: str) -> str:
    """The name of ``owner``'s (a worker's) spare-page entry in the device ledger."""
    return f"{owner} spare"


def spare_bytes(snap: LedgerSnapshot, owner: str) -> int:
    """Bytes of spare memory ``owner`` keeps (its spare pages; a vLLM worker's kept weights), as the
    ledger snapshot ``snap`` shows them: every spare entry named after it."""
    return sum(e.mapped_bytes for e in snap.entries if e.spare and e.name.startswith(f"{owner} "))


def grant_waiting(account: Account, num_bytes: int, wait_s: float = DEFAULT_RECLAIM_WAIT_S) -> bool:
    """Grant ``num_bytes``; refused while other workers hold spare pages or cached KV, wait (up to
    ``wait_s``) for them to give those back. False if the budget still does not allow it, at once for an
    account that asks no one for spare pages (``Account.reclaim`` false)."""
    deadline = time.monotonic() + wait_s
    while True:
        if account.try_reserve(num_bytes):
            return True
        if not account.reclaim:
            return False
        snap = account.ledger.snapshot()
        if snap.budget_bytes - snap.used_bytes + snap.reclaimable_bytes < num_bytes:
            return False  # not even with every spare page and cached KV block given back
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
