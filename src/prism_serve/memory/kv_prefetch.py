"""The elastic KV pool's background thread (``PrefetchThread``, a mixin of ``ElasticKVPool``).

Each poll interval, or when woken by an allocate that left the buffer short or a free that left
surplus, the thread re-reads the pool's limit from the ledger, decides whether the device is short
of memory (less than ``buffer_max_pages`` free, or a grant refused within ``RECLAIM_WINDOW_S``),
unmaps the empty pages the pool does not keep (beyond the buffer, and aged past ``linger_s``
unless the device is short), and maps pages into a short buffer, ``map_batch_pages`` at a time.
Pages are chosen under the pool's lock and the driver calls run without it.
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import TYPE_CHECKING

from prism_serve.memory.ledger import RECLAIM_WINDOW_S

if TYPE_CHECKING:
    from prism_serve.memory.kv_pool import ElasticKVPool

logger = logging.getLogger(__name__)


class PrefetchThread:
    """What the pool's thread does; the state it works on is ``ElasticKVPool``'s."""

    def _note_miss(self: ElasticKVPool) -> None:
        """The buffer ran dry inside one allocate call: keep twice as many pages ready from now on."""
        cfg = self.config
        self._refill_target = min(cfg.buffer_max_pages, max(1, 2 * self._refill_target))
        self._last_miss = time.monotonic()

    def _prefetch_loop(self: ElasticKVPool) -> None:
        cfg = self.config
        while True:
            self._wake.wait(cfg.poll_interval_s)
            self._wake.clear()
            if self._closed:
                return
            try:
                snap = self.account.ledger.snapshot()  # one ledger operation for every figure
                entry = next(e for e in snap.entries if e.slot == self.account.slot)
                pressure = (
                    snap.free_bytes < cfg.buffer_max_pages * self.page_size
                    or time.time() - snap.refused_at < RECLAIM_WINDOW_S
                )
                with self._lock:
                    self._limit = entry.limit_bytes  # `prism memory --set-limit` from anywhere
                    self._keep = cfg.buffer_min_pages if pressure else cfg.buffer_max_pages
                    self._linger = 0.0 if pressure else cfg.linger_s
                    now = time.monotonic()
                    if pressure:
                        self._refill_target = cfg.buffer_min_pages
                    elif (
                        self._refill_target > cfg.buffer_min_pages
                        and now - self._last_miss > cfg.buffer_decay_s
                    ):
                        self._refill_target -= 1
                        self._last_miss = now  # one page per decay period
                    surplus = self._surplus_locked(now)
                for p in surplus:
                    self._unmap_in_background(p)
                while self._map_in_background():
                    pass
            except Exception:  # the engine must keep running; it maps synchronously meanwhile
                logger.exception("KV prefetch thread failed a round")

    def _surplus_locked(self: ElasticKVPool, now: float) -> list[int]:
        """Empty pages to unmap this round, highest first: those above the limit, then those beyond
        the buffer that emptied more than ``linger_s`` ago."""
        extra = len(self._empty) - self._keep
        if self._over_limit():  # lingering does not count
            over = -(-(self.vrange.mapped_bytes - self._limit) // self.page_size)  # type: ignore[operator]
            return sorted(self._empty, reverse=True)[: max(over, extra)]
        if extra <= 0:
            return []
        aged = [p for p, since in self._empty.items() if now - since >= self._linger]
        return sorted(aged, reverse=True)[:extra]

    def _unmap_in_background(self: ElasticKVPool, p: int) -> None:
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

    def _map_in_background(self: ElasticKVPool) -> bool:
        """Map up to ``map_batch_pages`` pages into a short buffer in one call; False if nothing
        was to do or the limit or the ledger refused.

        The pages are chosen and their bookkeeping done under the lock; the driver calls run
        without it, so the engine thread allocates meanwhile and never waits for a page it does not
        need."""
        with self._lock:
            if self._closed:
                return False
            want = min(self._refill_target - len(self._empty), self.config.map_batch_pages)
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
