"""How many empty pages an elastic KV pool keeps mapped ahead of its engine (``BufferTarget``).

The pool's background thread asks it, each round, which empty pages to unmap and how many to keep
ready. The target adapts to the engine and to the device:

- ``refill``: pages mapped ahead. It starts at ``buffer_min_pages``, doubles (up to
  ``buffer_max_pages``) whenever one allocate call found the buffer dry (a batch whose sequences
  cross a block boundary in the same step), and drops a page per ``buffer_decay_s`` without a miss;
- ``keep`` and ``linger``: empty pages beyond ``keep`` are unmapped once they emptied ``linger``
  seconds ago. While the device is short of memory (less than ``buffer_max_pages`` free, or a
  grant refused lately) ``keep`` is ``buffer_min_pages`` and nothing lingers, so an idle engine's
  buffer never starves a neighbour's KV or an activation.

No locks and no pages here: the pool calls it under its own lock with what it knows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["BufferTarget"]


class BufferKnobs(Protocol):
    """The pool's knobs this reads (memory/kv_pool.py ``PoolConfig``)."""

    buffer_min_pages: int
    buffer_max_pages: int | None
    buffer_decay_s: float
    linger_s: float | None


class BufferTarget:
    def __init__(self, config: BufferKnobs) -> None:
        self._min = config.buffer_min_pages
        self._max = config.buffer_max_pages or 0
        self._decay_s = config.buffer_decay_s
        self._linger_s = config.linger_s or 0.0
        self.refill = self._min  # pages to keep mapped ahead now
        self.keep = self._max  # empty pages not unmapped (buffer_min while the device is short)
        self.linger = self._linger_s  # seconds an emptied page beyond ``keep`` stays (0 when short)
        self._last_miss = 0.0

    def missed(self, now: float) -> None:
        """The buffer ran dry inside one allocate call: keep twice as many pages ready from now on."""
        self.refill = min(self._max, max(1, 2 * self.refill))
        self._last_miss = now

    def idle(self) -> None:
        """The engine went idle: refill to no more than the minimum until the next burst."""
        self.refill = self._min

    def update(self, short: bool, now: float) -> None:
        """One round of the pool's thread: ``short`` says whether the device is short of memory."""
        self.keep = self._min if short else self._max
        self.linger = 0.0 if short else self._linger_s
        if short:
            self.refill = self._min
        elif self.refill > self._min and now - self._last_miss > self._decay_s:
            self.refill -= 1
            self._last_miss = now  # one page per decay period

    def surplus(self, empty: Mapping[int, float], over_limit_pages: int | None, now: float) -> list[int]:
        """Empty pages (page -> when it emptied) to unmap this round, highest first: those above the
        engine's limit (``over_limit_pages``: how many pages the pool maps beyond it, None when
        within), then those beyond ``keep`` that emptied more than ``linger`` ago."""
        extra = len(empty) - self.keep
        if over_limit_pages is not None:  # lingering does not count
            return sorted(empty, reverse=True)[: max(over_limit_pages, extra)]
        if extra <= 0:
            return []
        aged = [p for p, since in empty.items() if now - since >= self.linger]
        return sorted(aged, reverse=True)[:extra]
