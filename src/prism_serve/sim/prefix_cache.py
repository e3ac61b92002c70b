"""One simulated engine's prefix cache: which full KV blocks it holds, by chained block key.

A block is either *in use* (held by running requests: a reference count, shared by every request
whose prompt starts with it) or *free* (no request holds it; its contents stay until its memory is
needed). Free blocks are kept least recently freed first: the engine evicts from that end. A request
gives its blocks back last block first, so a prefix's tail is evicted before its head (the head is
what most requests share). Integer keys only: the engine does the memory accounting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PrefixCache"]


class PrefixCache:
    __slots__ = ("_free", "_refs", "num_evicted")

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # in use: key -> running requests holding it
        self._free: OrderedDict[int, None] = OrderedDict()  # no request holds it; oldest first
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return len(self._refs)

    def free_keys(self) -> list[int]:
        """The free blocks' keys, the next to be evicted first."""
        return list(self._free)

    def match(self, keys: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """(n, f): the first ``n`` of ``keys`` (at most ``max_blocks``) are cached, ``f`` of them free."""
        n = f = 0
        refs, free = self._refs, self._free
        for key in keys[:max_blocks]:
            if key in free:
                f += 1
            elif key not in refs:
                break
            n += 1
        return n, f

    def acquire(self, keys: Sequence[int]) -> None:
        """A request takes these cached blocks (every one must be cached)."""
        refs, free = self._refs, self._free
        for key in keys:
            if key in refs:
                refs[key] += 1
            else:
                del free[key]
                refs[key] = 1

    def register(self, key: int) -> bool:
        """A request computed the block ``key``: it joins the cache, held by that request. False if
        ``key`` is cached already (another request computed the same block meanwhile): the request's
        copy stays its own, uncached, as the live engine leaves it."""
        if key in self._refs or key in self._free:
            return False
        self._refs[key] = 1
        return True

    def release(self, keys: Sequence[int]) -> int:
        """A request gives back blocks it held through the cache; how many no request holds now
        (they become free, the last of ``keys`` the first to go)."""
        refs, free = self._refs, self._free
        freed = 0
        for key in reversed(keys):
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]
                free[key] = None
                freed += 1
        return freed

    def evict(self, n: int) -> None:
        """Forget the ``n`` least recently freed blocks (their memory is needed)."""
        free = self._free
        k = max(0, min(n, len(free)))
        for _ in range(k):
            free.popitem(last=False)
        self.num_evicted += k

    def hottest(self, n: int) -> list[int]:
        """Up to ``n`` cached keys, those in use first, then the free ones most recently freed
        first: what a model evicted now keeps in host memory (memory/kept.py)."""
        keys = list(self._refs)[:n]
        if len(keys) < n:
            keys += list(reversed(self._free))[: n - len(keys)]
        return keys

    def adopt(self, keys: Sequence[int]) -> int:
        """Cache ``keys`` (a ``hottest`` list) as free blocks in its order of recency, the first the
        most recent; keys cached already are skipped. How many were added."""
        free = self._free
        added = 0
        for key in reversed(keys):
            if key not in self._refs and key not in free:
                free[key] = None
                added += 1
        return added

    def clear(self) -> None:
        self._refs.clear()
        self._free.clear()
