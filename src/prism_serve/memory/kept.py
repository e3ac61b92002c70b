"""The host memory budget for evicted models' kept prefixes, the same rule live and simulated.

When a model with a prefix cache is evicted, its hottest cached blocks may be kept in host memory
and restored at its next activation (engine/kept_prefixes.py live, sim/simulator.py simulated).
What all models keep together stays within one budget: a model keeps one set (a later eviction
replaces it; an activation consumes it), and before an eviction the sets of the models evicted
longest ago go until the evicted model may keep at least half the budget (or nothing else is kept).
Pure bookkeeping: the caller frees what a dropped entry held (a file, simulated keys).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from pathlib import Path
from typing import Generic, TypeVar

__all__ = ["KEPT_PREFIX_SHARE", "KeptBudget", "default_kept_prefix_bytes"]

T = TypeVar("T")

# what the kept prefixes may take in all, by default: this share of the host cache directory's size
KEPT_PREFIX_SHARE = 0.1


def default_kept_prefix_bytes(directory: str | Path = "/dev/shm") -> int:
    """The default budget (``policy.kept_prefix_bytes`` unset): ``KEPT_PREFIX_SHARE`` of the size
    of the filesystem the host cache files live in."""
    fs = os.statvfs(directory)
    return int(fs.f_blocks * fs.f_frsize * KEPT_PREFIX_SHARE)


class KeptBudget(Generic[T]):
    """Per model, one kept set (``item``: whatever names it) of ``size`` bytes, least recently kept
    first, within ``budget_bytes`` in all."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self._kept: dict[Hashable, tuple[T, int]] = {}

    @property
    def used_bytes(self) -> int:
        return sum(size for _, size in self._kept.values())

    def room(self, model: Hashable) -> tuple[int, list[T]]:
        """Make room for ``model``'s eviction: its own earlier set goes, then the oldest other sets
        until at least half the budget is free. Returns the bytes it may keep and the items that
        went (for the caller to free)."""
        gone = []
        own = self._kept.pop(model, None)
        if own is not None:
            gone.append(own[0])
        while self._kept and self.budget_bytes - self.used_bytes < self.budget_bytes // 2:
            gone.append(self._kept.pop(next(iter(self._kept)))[0])
        return max(0, self.budget_bytes - self.used_bytes), gone

    def keep(self, model: Hashable, item: T, size: int) -> None:
        """``model`` kept ``item`` of ``size`` bytes (within what ``room`` allowed)."""
        self._kept.pop(model, None)
        self._kept[model] = (item, size)

    def get(self, model: Hashable) -> T | None:
        kept = self._kept.get(model)
        return kept[0] if kept is not None else None

    def size_of(self, model: Hashable) -> int:
        """The bytes of ``model``'s kept set (0: none)."""
        kept = self._kept.get(model)
        return kept[1] if kept is not None else 0

    def take(self, model: Hashable) -> T | None:
        """Forget ``model``'s set (restored, or of no more use) and return its item."""
        kept = self._kept.pop(model, None)
        return kept[0] if kept is not None else None

    def items(self) -> list[T]:
        return [item for item, _ in self._kept.values()]
