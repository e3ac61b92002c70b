"""The elastic KV block pool: the engine's ``BlockAllocator`` over pages mapped on demand.

KV blocks are laid out back to back in one reserved virtual range (block ``b`` owns bytes
``[b * block_bytes, (b + 1) * block_bytes)``), so the engine's KV tensor is one ordinary tensor.
A block may straddle two pages; it is usable ("ready") when every page it touches is mapped, and a
page may be unmapped only when no allocated block touches it. Physical memory therefore follows
demand at page granularity whatever the ratio of block to page size.

Where blocks come from, cheapest first:
1. a free ready block on the most-utilized page that has one (packs blocks, so pages empty out and
   fewer new pages are needed);
2. a free ready block on an empty mapped page: the pre-mapped buffer, kept between
   ``buffer_min_pages`` and ``buffer_max_pages`` by a background thread, so decode rarely maps
   (how many pages it keeps adapts to bursts and to the device: memory/kv_buffer.py);
3. mapping new pages on the caller's thread, each granted by the device ledger first; when the
   ledger refuses, ``allocate`` returns None and nothing the call took is kept, and the ledger asks
   the device's spare pages and cached KV for every byte the allocation lacked (``ask_back``), so
   the engine's retry at its next step finds them. (Asking only for the refused page's bytes
   gave the memory back a page per engine step: a 0.6B model's 192-token request waited 5-8 s
   beside 286 MiB of another worker's spare pages.)

Freed blocks make pages empty; empty pages beyond the buffer (or above the engine's limit) are
unmapped and their bytes go back to the device budget, where any other engine can take them. On a
GPU they first linger for ``linger_s``: a batch that finishes is usually followed by another that
needs the same pages, and unmapping then mapping them again costs the engine (an 8B model at batch
128 on an H200 decoded at 0.96x the fixed pool's rate with ~9,000 maps in the background). The
newest emptied page is reused first, so the ones nobody needs age out. Lingering is for speed
only: when the device has less than ``buffer_max_pages`` pages free, or any grant on it was
refused in the last ``RECLAIM_WINDOW_S`` (``LedgerSnapshot.refused_at``), every pool's thread
unmaps its lingering pages and shrinks its buffer to ``buffer_min_pages`` within one poll
interval, so neither starves a neighbour's KV or an activation.

The thread maps up to ``map_batch_pages`` pages per call (``VirtualRange.map_pages``): one ledger
operation for the batch. On an H200 that did not make the driver's work cheaper (one
``cuMemSetAccess`` over 16 pages costs what 16 do); lingering is what brought the pool to the
fixed pool's rate (docs/results.md, "Elastic memory overhead").
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prism_serve.errors import InvalidRequestError
from prism_serve.memory.blocks import FixedBlockAllocator
from prism_serve.memory.kv_buffer import BufferTarget
from prism_serve.memory.ledger import (
    RECLAIM_WINDOW_S,
    Account,
    DeviceLedger,
    DeviceMemoryExhaustedError,
    LedgerError,
)
from prism_serve.memory.vmm import DEFAULT_PAGE_SIZE, VirtualRange, reserve

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# A GPU engine's KV grows by many 2 MiB pages at once (a Llama-3-8B block of 16 tokens is one page,
# and a batch of 128 decodes crosses block boundaries together), and mapping a page on the engine's
# thread costs ~40 us of driver calls. With the CPU's buffer of 8 pages, an 8B model at batch 128 on
# an H200 mapped 5,834 pages on its own thread and decoded at 0.91x the fixed pool's rate; with 64,
# 34 pages and 0.96x (measured on an H200 before the buffer grew to 64 pages). 64 pages are 128 MiB of a GPU.
GPU_BUFFER_MAX_PAGES = 64
# How long an emptied page beyond the buffer stays mapped on a GPU while nobody else needs memory.
GPU_LINGER_S = 5.0


@dataclass(slots=True)
class PoolConfig:
    """Knobs of the elastic KV pool (the one home of memory knobs; see memory/README.md)."""

    device: str = "cpu:0"
    page_size: int = DEFAULT_PAGE_SIZE
    buffer_min_pages: int = 2  # the background thread keeps at least this many empty pages mapped
    # and unmaps empty pages beyond this many; None: 8 on a CPU device, GPU_BUFFER_MAX_PAGES on a GPU
    buffer_max_pages: int | None = None
    prefetch: bool = True  # False: no thread; pages are mapped and unmapped on the caller's thread
    poll_interval_s: float = 0.05  # the thread also re-reads this engine's limit from the ledger
    buffer_decay_s: float = 10.0  # the adaptive refill target drops a page per this long without a miss
    # emptied pages beyond the buffer stay mapped this long while the device has room (needs the
    # thread); None: 0 on a CPU device (a host page maps in ~0.3 ms), GPU_LINGER_S on a GPU
    linger_s: float | None = None
    map_batch_pages: int = 16  # pages the thread maps in one call (one ledger grant)
    limit_bytes: int | None = None  # this engine's cap in the ledger (changeable at run time)
    ledger_namespace: str | None = None  # default: $PRISM_LEDGER_NAMESPACE or the user id
    device_budget_bytes: int | None = None  # budget if this pool creates the device ledger; default: all

    def __post_init__(self) -> None:
        if self.buffer_max_pages is None:
            self.buffer_max_pages = GPU_BUFFER_MAX_PAGES if self.device.startswith("cuda") else 8
        if self.linger_s is None:
            self.linger_s = GPU_LINGER_S if self.device.startswith("cuda") else 0.0
        if self.linger_s < 0 or self.map_batch_pages < 1:
            raise InvalidRequestError("need linger_s >= 0 and map_batch_pages >= 1")
        if not 0 <= self.buffer_min_pages <= self.buffer_max_pages:
            raise InvalidRequestError("need 0 <= buffer_min_pages <= buffer_max_pages")
        if self.poll_interval_s <= 0 or self.buffer_decay_s <= 0:
            raise InvalidRequestError("poll_interval_s and buffer_decay_s must be positive")


@dataclass(frozen=True, slots=True)
class PoolStats:
    blocks_allocated: int  # blocks handed out since creation
    blocks_without_map: int  # of those, blocks whose allocate call mapped no page
    sync_maps: int  # pages mapped on the allocating thread
    prefetch_maps: int  # pages mapped by the background thread
    unmaps: int
    mapped_pages: int
    empty_pages: int  # mapped pages no allocated block touches (the buffer)
    refill_target: int  # pages the prefetch thread currently keeps ready (adaptive, min..max)
    used_blocks: int


def device_capacity(device: str) -> int:
    """Physical memory of ``device``: RAM for cpu devices, total GPU memory for cuda ones."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[1]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ElasticKVPool:
    """KV blocks of ``block_bytes`` each in ``vrange``, mapped on demand under ``account``'s ledger."""

    def __init__(
        self,
        vrange: VirtualRange,
        block_bytes: int,
        account: Account,
        config: PoolConfig | None = None,
        owns: bool = False,
    ) -> None:
        if block_bytes <= 0:
            raise InvalidRequestError(f"block_bytes must be positive, got {block_bytes}")
        self.config = config = config or PoolConfig(page_size=vrange.page_size)
        self.vrange = vrange
        self.account = account
        self.block_bytes = block_bytes
        self.page_size = P = vrange.page_size
        self._num_blocks = vrange.size // block_bytes
        if self._num_blocks == 0:
            raise InvalidRequestError(f"a {vrange.size}-byte range holds no {block_bytes}-byte block")
        self._num_pages = -(-self._num_blocks * block_bytes // P)
        self._owns = owns  # close() also closes the range and leaves the ledger
        self._lock = threading.Lock()
        # The prefetch thread maps and unmaps with the lock released (a 2 MiB map costs ~1 ms on the
        # host, ~0.2 ms on CUDA); pages it is working on are "in flight" and nobody else touches them.
        self._changed = threading.Condition(self._lock)
        self._in_flight: set[int] = set()
        self._users = [0] * self._num_pages  # allocated blocks touching each page
        self._allocated = bytearray(self._num_blocks)
        self._num_used = 0
        # Free blocks whose pages are all mapped, grouped by the page they start on; and those pages
        # grouped by how many allocated blocks touch them, so the fullest is found without a scan.
        self._ready: dict[int, dict[int, None]] = {}
        self._num_ready = 0
        max_users = -(-P // block_bytes) + 2
        self._by_users: list[dict[int, None]] = [{} for _ in range(max_users + 1)]
        self._empty: dict[int, float] = {}  # mapped pages no allocated block touches -> when they emptied
        self._unmapped = list(range(self._num_pages))  # a min-heap; entries may be stale (mapped)
        self._limit = config.limit_bytes
        self._blocks_allocated = self._blocks_without_map = 0
        self._sync_maps = self._prefetch_maps = self._unmaps = 0
        self._closed = False
        self._wake = threading.Event()
        self._buffer = BufferTarget(config)  # empty pages kept mapped ahead (memory/kv_buffer.py)
        self._thread: threading.Thread | None = None
        if vrange.base_must_be_mapped:
            self._pin_first_block()
        if config.prefetch and config.buffer_max_pages > 0:
            self._thread = threading.Thread(target=self._prefetch_loop, name="prism-kv-prefetch", daemon=True)
            self._thread.start()

    @classmethod
    def create(
        cls, block_bytes: int, reserve_bytes: int, name: str, config: PoolConfig | None = None
    ) -> ElasticKVPool:
        """Reserve ``reserve_bytes`` of virtual space on ``config.device`` and register ``name`` in the
        device's ledger (creating the ledger with ``device_budget_bytes`` if there is none)."""
        config = config or PoolConfig()
        budget = config.device_budget_bytes
        ledger = DeviceLedger(
            config.device,
            budget if budget is not None else device_capacity(config.device),
            config.ledger_namespace,
        )
        try:
            account = ledger.account(name, config.limit_bytes)
        except BaseException:
            ledger.close()
            raise
        try:
            vrange = reserve(config.device, reserve_bytes, config.page_size)
        except BaseException:
            account.close()
            ledger.close()
            raise
        try:
            return cls(vrange, block_bytes, account, config, owns=True)
        except BaseException:  # e.g. no room for the first block: nothing stays registered
            vrange.close()
            account.close()
            ledger.close()
            raise

    # ---- BlockAllocator -------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks obtainable now: ready ones plus what the ledger's headroom would map."""
        snap = self.account.ledger.snapshot()  # one ledger operation for both numbers
        entry = next(e for e in snap.entries if e.slot == self.account.slot)
        snap_free = snap.free_bytes
        headroom = (
            snap_free if entry.limit_bytes is None else min(snap_free, entry.limit_bytes - entry.mapped_bytes)
        )
        with self._lock:
            unmapped_free = self._num_blocks - self._num_used - self._num_ready
            return self._num_ready + min(unmapped_free, max(0, headroom) // self.block_bytes)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def held_bytes(self) -> int:
        """What it holds in the ledger: the pages mapped now (blocks in use, ready ones, spares)."""
        return self.vrange.mapped_bytes

    @property
    def over_limit_bytes(self) -> int:
        """Mapped bytes above this engine's limit (0: none): what its emptied pages must cover."""
        limit = self._limit
        return 0 if limit is None else max(0, self.vrange.mapped_bytes - limit)

    def bytes_freed_by(self, block_ids: Sequence[int]) -> int:
        """Bytes that freeing ``block_ids`` (allocated, distinct) would let the pool unmap: the pages
        no other allocated block touches. What a prefix cache's unheld blocks are worth to the
        device, never more (a page shared with a block in use stays)."""
        touched: dict[int, int] = {}
        for b in block_ids:
            for q in self._pages_of(b):
                touched[q] = touched.get(q, 0) + 1
        with self._lock:
            return sum(self.page_size for q, n in touched.items() if n >= self._users[q])

    def allocate(self, num_blocks: int) -> list[int] | None:
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        with self._lock:
            self._check_open()
            got: list[int] = []
            maps_before = self._sync_maps
            for _ in range(num_blocks):
                b = self._next_block()
                if b is None:
                    for g in got:
                        self._release(g)
                    self._ask_back(num_blocks)
                    if self._thread is None:
                        self._trim_locked(self.config.buffer_max_pages)
                    return None
                self._take(b)
                got.append(b)
            self._blocks_allocated += num_blocks
            if self._sync_maps == maps_before:
                self._blocks_without_map += num_blocks
            elif self._thread is not None:
                self._buffer.missed(time.monotonic())
            low = len(self._empty) < self._buffer.refill
        if low and self._thread is not None:
            self._wake.set()
        return got

    def free(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._check_open()
            seen = set()
            for b in block_ids:
                if not 0 <= b < self._num_blocks or not self._allocated[b] or b in seen:
                    raise RuntimeError(f"block {b} freed but not allocated (double free or foreign id)")
                seen.add(b)
            for b in block_ids:
                self._release(b)
            if self._thread is None:
                self._trim_locked(self.config.buffer_max_pages)
                return
            excess = (len(self._empty) > self._buffer.keep and not self._buffer.linger) or self._over_limit()
        if excess:
            self._wake.set()

    # ---- run-time control -----------------------------------------------------------------------

    def set_limit(self, limit_bytes: int | None) -> None:
        """Cap this engine's mapped bytes. Shrinking below what is mapped takes effect as pages empty:
        allocations that need a new page are refused meanwhile, and emptied pages are unmapped."""
        self.account.set_limit(limit_bytes)
        with self._lock:
            self._limit = limit_bytes
            if self._thread is None:
                self._trim_locked(self.config.buffer_max_pages)
        self._wake.set()

    def trim(self, keep_pages: int = 0) -> int:
        """Unmap empty pages until at most ``keep_pages`` stay mapped; returns how many were unmapped."""
        with self._lock:
            self._check_open()
            return self._trim_locked(keep_pages)

    def shrink_buffer(self) -> int:
        """The engine went idle: keep only ``buffer_min_pages`` empty pages (and refill to no more
        until the next burst), so colocated engines can use the rest. Returns pages unmapped."""
        with self._lock:
            self._check_open()
            self._buffer.idle()
            return self._trim_locked(self.config.buffer_min_pages)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                blocks_allocated=self._blocks_allocated,
                blocks_without_map=self._blocks_without_map,
                sync_maps=self._sync_maps,
                prefetch_maps=self._prefetch_maps,
                unmaps=self._unmaps,
                mapped_pages=self.vrange.num_mapped_pages,
                empty_pages=len(self._empty),
                refill_target=self._buffer.refill,
                used_blocks=self._num_used,
            )

    def kv_tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """All blocks as one flat tensor of ``dtype`` (the engine views it as its KV layout)."""
        flat = self.vrange.as_tensor()[: self._num_blocks * self.block_bytes]
        return flat.view(dtype)

    def close(self) -> None:
        """Stop the thread and unmap every page (allocated or not): the memory goes back at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            for p in range(self._num_pages):
                if self.vrange.is_mapped(p):
                    self._unmap(p)
        if self._owns:
            self.vrange.close()
            self.account.close()
            self.account.ledger.close()

    def __enter__(self) -> ElasticKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the background thread ------------------------------------------------------------------

    def _prefetch_loop(self) -> None:
        """Each poll interval, or when an allocate left the buffer short or a free left surplus:
        re-read the limit from the ledger, unmap the pages the buffer target does not keep, and map
        pages into a short buffer, ``map_batch_pages`` at a time. Pages are chosen under the lock
        and the driver calls run without it."""
        cfg = self.config
        while True:
            self._wake.wait(cfg.poll_interval_s)
            self._wake.clear()
            if self._closed:
                return
            try:
                snap = self.account.ledger.snapshot()  # one ledger operation for every figure
                entry = next(e for e in snap.entries if e.slot == self.account.slot)
                short = (
                    snap.free_bytes < cfg.buffer_max_pages * self.page_size
                    or time.time() - snap.refused_at < RECLAIM_WINDOW_S
                )
                with self._lock:
                    self._limit = entry.limit_bytes  # `prism memory --set-limit` from anywhere
                    now = time.monotonic()
                    self._buffer.update(short, now)
                    over = None
                    if self._over_limit():
                        over = -(-(self.vrange.mapped_bytes - self._limit) // self.page_size)  # type: ignore[operator]
                    surplus = self._buffer.surplus(self._empty, over, now)
                for p in surplus:
                    self._unmap_in_background(p)
                while self._map_in_background():
                    pass
            except Exception:  # the engine must keep running; it maps synchronously meanwhile
                logger.exception("KV prefetch thread failed a round")

    def _unmap_in_background(self, p: int) -> None:
        """Unmap empty page ``p`` with the lock released (unless it was taken meanwhile)."""
        with self._lock:
            if self._closed or p not in self._empty or p in self._in_flight:
                return
            self._forget_page(p)
            self._in_flight.add(p)
        try:
            self.vrange.unmap_page(p)
            self.account.release(self.page_size)
        finally:
            with self._lock:
                self._in_flight.discard(p)
                heapq.heappush(self._unmapped, p)
                self._unmaps += 1
                self._changed.notify_all()

    def _map_in_background(self) -> bool:
        """Map up to ``map_batch_pages`` pages into a short buffer in one call; False if nothing
        was to do or the limit or the ledger refused. The engine thread allocates meanwhile and
        never waits for a page it does not need."""
        with self._lock:
            if self._closed:
                return False
            want = min(self._buffer.refill - len(self._empty), self.config.map_batch_pages)
            if self._limit is not None:
                want = min(want, (self._limit - self.vrange.mapped_bytes) // self.page_size)
            pages: list[int] = []
            while len(pages) < want:
                p = self._lowest_unmapped()
                if p is None:
                    break
                pages.append(p)
            self._in_flight.update(pages)
        if not pages:
            return False
        dropped: list[int] = []
        mapped = False
        try:
            mapped = self._map_pages(pages)
            if not mapped and len(pages) > 1:  # the device is nearly full: one page at a time
                pages, dropped = pages[:1], pages[1:]
                mapped = self._map_pages(pages)
        finally:
            with self._lock:
                self._in_flight.difference_update(pages + dropped)
                for p in pages:
                    if mapped:
                        self._adopt_page(p)
                    else:
                        heapq.heappush(self._unmapped, p)
                for p in dropped:
                    heapq.heappush(self._unmapped, p)
                if mapped:
                    self._prefetch_maps += len(pages)
                self._changed.notify_all()
        return mapped

    # ---- block and page bookkeeping (lock held) -------------------------------------------------

    def _pin_first_block(self) -> None:
        """Map block 0's pages for the pool's life. Every per-layer view of the KV tensor starts in
        them, and Triton checks a kernel's pointer arguments with the CUDA driver, which refuses an
        address with nothing mapped behind it: on an H200 a launch failed so once the pool had
        unmapped its first page while later ones served. These pages count one user more than
        their blocks, so they never empty."""
        for q in self._pages_of(0):
            if not self._map_page(q):
                for done in range(self._pages_of(0).start, q):
                    self._unmap_page(done)
                raise LedgerError(f"no room on {self.config.device} for the first block of a KV pool")
            self._adopt_page(q)
            self._set_users(q, 1)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the KV pool is closed")

    def _pages_of(self, b: int) -> range:
        B, P = self.block_bytes, self.page_size
        return range(b * B // P, ((b + 1) * B - 1) // P + 1)

    def _blocks_of(self, p: int) -> range:
        B, P = self.block_bytes, self.page_size
        return range(p * P // B, min(self._num_blocks - 1, ((p + 1) * P - 1) // B) + 1)

    def _add_ready(self, b: int) -> None:
        a = b * self.block_bytes // self.page_size
        group = self._ready.get(a)
        if group is None:
            group = self._ready[a] = {}
            self._by_users[self._users[a]][a] = None
        group[b] = None
        self._num_ready += 1

    def _discard_ready(self, b: int) -> None:
        a = b * self.block_bytes // self.page_size
        group = self._ready.get(a)
        if group is None or b not in group:
            return
        del group[b]
        self._num_ready -= 1
        if not group:
            del self._ready[a]
            del self._by_users[self._users[a]][a]

    def _set_users(self, p: int, users: int) -> None:
        old = self._users[p]
        if p in self._ready:
            del self._by_users[old][p]
            self._by_users[users][p] = None
        self._users[p] = users
        if users == 0:
            self._empty[p] = time.monotonic()
        elif old == 0:
            self._empty.pop(p, None)

    def _pick_ready(self) -> int | None:
        for users in range(len(self._by_users) - 1, 0, -1):
            bucket = self._by_users[users]
            if bucket:
                return next(iter(self._ready[next(iter(bucket))]))
        empty = self._by_users[0]  # the newest emptied page first: the others may age out
        return next(iter(self._ready[next(reversed(empty))])) if empty else None

    def _take(self, b: int) -> None:
        self._discard_ready(b)
        self._allocated[b] = 1
        self._num_used += 1
        for q in self._pages_of(b):
            self._set_users(q, self._users[q] + 1)

    def _release(self, b: int) -> None:
        self._allocated[b] = 0
        self._num_used -= 1
        for q in self._pages_of(b):
            self._set_users(q, self._users[q] - 1)
        self._add_ready(b)

    def _over_limit(self) -> bool:
        return self._limit is not None and self.vrange.mapped_bytes > self._limit

    def _map_page(self, p: int) -> bool:
        return self._map_pages([p])

    def _map_pages(self, pages: list[int]) -> bool:
        """Map ``pages`` if the limit and the ledger grant their bytes (one grant for all); False if
        not. No bookkeeping: safe without the lock for pages that are in flight."""
        num_bytes = len(pages) * self.page_size
        limit = self._limit
        if limit is not None and self.vrange.mapped_bytes + num_bytes > limit:
            return False
        if not self.account.try_reserve(num_bytes):
            return False
        try:
            self.vrange.map_pages(pages)
        except BaseException:
            self.account.release(num_bytes)
            raise
        return True

    def _adopt_page(self, p: int) -> None:
        """Bookkeeping for a freshly mapped page: it is empty, and blocks on it may now be ready. A
        neighbour in flight does not count as mapped: the prefetch thread may be unmapping it (it
        still reads as mapped until the call returns), and a block straddling both would then be
        handed out over an unmapped page."""
        self._empty[p] = time.monotonic()
        for b in self._blocks_of(p):
            if not self._allocated[b] and all(
                self.vrange.is_mapped(q) and q not in self._in_flight for q in self._pages_of(b)
            ):
                self._add_ready(b)

    def _map(self, p: int) -> bool:
        if not self._map_page(p):
            return False
        self._adopt_page(p)
        return True

    def _forget_page(self, p: int) -> None:
        """Bookkeeping before unmapping an empty page: its free blocks are no longer ready."""
        for b in self._blocks_of(p):
            self._discard_ready(b)
        self._empty.pop(p, None)

    def _unmap_page(self, p: int) -> None:
        self.vrange.unmap_page(p)
        self.account.release(self.page_size)
        heapq.heappush(self._unmapped, p)
        self._unmaps += 1

    def _unmap(self, p: int) -> None:
        self._forget_page(p)
        self._unmap_page(p)

    def _lowest_unmapped(self) -> int | None:
        while self._unmapped:
            p = heapq.heappop(self._unmapped)
            if not self.vrange.is_mapped(p) and p not in self._in_flight:
                return p
        return None

    def _next_block(self) -> int | None:
        """A ready free block (fullest page first), else the lowest block on the lowest unmapped page
        with its pages mapped now; None if the ledger or the limit refuses, or the range is full."""
        while True:
            ready = self._pick_ready()  # the prefetch thread may have just delivered a page
            if ready is not None:
                return ready
            p = self._lowest_unmapped()
            if p is None:
                if not self._in_flight:
                    return None
                self._changed.wait()
                continue
            b = self._blocks_of(p)[0]
            if any(q in self._in_flight for q in self._pages_of(b)):  # a neighbour is being (un)mapped
                heapq.heappush(self._unmapped, p)
                self._changed.wait()
                continue
            for q in self._pages_of(b):
                if not self.vrange.is_mapped(q):
                    if not self._map(q):
                        heapq.heappush(self._unmapped, p)
                        return None
                    self._sync_maps += 1
            return b

    def _ask_back(self, num_blocks: int) -> None:
        """An allocation of ``num_blocks`` was refused: ask the device's spare pages and cached KV
        for all the bytes it lacks at once (the blocks beyond the ready ones, a page more for a
        block straddling a page already mapped), so that the step that retries it finds them. Not
        when the engine's own limit or its reserved range is what refused it: memory given back
        would not let it through."""
        lacking = (num_blocks - self._num_ready) * self.block_bytes
        if lacking > (self._num_pages - self.vrange.num_mapped_pages) * self.page_size:
            return  # the range is full: only blocks freed by its own requests can help
        need = lacking + self.page_size
        if self._limit is not None and self.vrange.mapped_bytes + need > self._limit:
            return
        self.account.ask_back(need)

    def _trim_locked(self, keep: int) -> int:
        """Unmap empty pages, highest first, down to ``keep`` (and below the limit)."""
        n = 0
        while self._empty and (len(self._empty) > keep or self._over_limit()):
            self._unmap(max(self._empty))
            n += 1
        return n


class FixedKVPool:
    """``num_blocks`` KV blocks of ``block_bytes`` in ``vrange``, every page granted by
    ``account``'s ledger at creation (one grant) and given back at ``close``: the engine's
    ``BlockAllocator`` where the blocks must not depend on the device's other engines. A tensor
    parallel model needs this: each rank's scheduler must see the same blocks, so none may be
    refused on one rank and granted on another. DeviceMemoryExhaustedError if the ledger refuses.
    A page is mapped when a block on it is first allocated (its bytes are granted already, so
    that cannot be refused): mapping them all at creation would make every activation pay for
    zeroing KV it may never use (45 ms for 60 MiB here), as the elastic pool's does not."""

    def __init__(self, vrange: VirtualRange, block_bytes: int, num_blocks: int, account: Account) -> None:
        if block_bytes <= 0 or num_blocks <= 0:
            raise InvalidRequestError(f"{num_blocks} KV blocks of {block_bytes} bytes: both must be positive")
        if num_blocks * block_bytes > vrange.size:
            raise InvalidRequestError(
                f"{num_blocks} KV blocks of {block_bytes} bytes do not fit the {vrange.size}-byte range"
            )
        self.vrange = vrange
        self.account = account
        self.block_bytes = block_bytes
        self._blocks = FixedBlockAllocator(num_blocks)
        self._num_pages = -(-num_blocks * block_bytes // vrange.page_size)
        self._granted = self._num_pages * vrange.page_size
        if not account.try_reserve(self._granted):
            raise DeviceMemoryExhaustedError(
                f"{vrange.device}: the ledger refused {self._granted} bytes for {num_blocks} KV blocks"
            )
        self._closed = False
        try:
            if vrange.base_must_be_mapped:  # the KV tensor's base address must be backed (CUDA)
                vrange.map_pages([0])
        except BaseException:
            self.close()
            raise

    @property
    def num_total_blocks(self) -> int:
        return self._blocks.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def held_bytes(self) -> int:
        """What it holds in the ledger: all of its pages, mapped yet or not."""
        return self._granted

    def allocate(self, num_blocks: int) -> list[int] | None:
        ids = self._blocks.allocate(num_blocks)
        if not ids:
            return ids
        P, size, vrange = self.vrange.page_size, self.block_bytes, self.vrange
        pages = {p for b in ids for p in range(b * size // P, ((b + 1) * size - 1) // P + 1)}
        new = sorted(p for p in pages if not vrange.is_mapped(p))
        if new:
            try:
                vrange.map_pages(new)  # granted at creation: only the operating system could refuse
            except BaseException:
                self._blocks.free(ids)
                raise
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        self._blocks.free(block_ids)

    def kv_tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """All blocks as one flat tensor of ``dtype`` (the engine views it as its KV layout)."""
        return self.vrange.as_tensor()[: self.num_total_blocks * self.block_bytes].view(dtype)

    def shrink_buffer(self) -> int:
        return 0  # nothing is mapped ahead: every block stays until the model goes

    def set_limit(self, limit_bytes: int | None) -> None:
        pass  # the size is fixed at creation (a tensor parallel model's ranks agreed on it)

    def close(self) -> None:
        """Unmap every page: the memory goes back at once."""
        if self._closed:
            return
        self._closed = True
        for p in range(self._num_pages):
            if self.vrange.is_mapped(p):
                self.vrange.unmap_page(p)
        self.account.release(self._granted)
