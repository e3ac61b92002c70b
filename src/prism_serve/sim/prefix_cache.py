"""One simulated engine's prefix cache: which full KV blocks it holds, by chained block key.

A block is either *in use* (held by running requests: a reference count, shared by every request
whose prompt starts with it) or *free* (no request holds it; its contents stay until its memory is
needed). Free blocks are kept least recently freed first: the engine evicts from that end. A request
gives its blocks back last block first, so a prefix's tail is evicted before its head (the head is
what most requests share). Integer keys only: the engine does the memory accounting.

What a model evicted keeps in host memory (``hottest``) is the live engine's rule
(engine/prefix_cache.py): the blocks requests have found cached, most hits first, then those in
use, then the most recently freed, each with its hit count; then those no request has hit, all of
them unless this engine adopted such blocks, served requests and none was hit since, and then only
the first of the most recent request's (here: of the last ``release``'s blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PrefixCache"]


class PrefixCache:
    __slots__ = ("_free", "_hits", "_last", "_refs", "_unproven", "adopted_unhit", "adopted_unhit_hit",
                 "lookups", "num_evicted")  # fmt: skip

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # in use: key -> running requests holding it
        self._free: OrderedDict[int, None] = OrderedDict()  # no request holds it; oldest first
        self._hits: dict[int, int] = {}  # key -> times a request found it cached
        # keys adopted without a hit and not hit since, and how many were adopted and hit so
        self._unproven: set[int] = set()
        self.adopted_unhit = self.adopted_unhit_hit = 0
        self._last: list[int] = []  # the keys the latest release freed, its first block first
        self.lookups = 0  # requests matched against the cache
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
        self.lookups += 1
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
        """A request takes these cached blocks (every one must be cached): a hit on each."""
        refs, free, hits = self._refs, self._free, self._hits
        for key in keys:
            if key in refs:
                refs[key] += 1
            else:
                del free[key]
                refs[key] = 1
            hits[key] = hits.get(key, 0) + 1
            if key in self._unproven:
                self._unproven.discard(key)
                self.adopted_unhit_hit += 1

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
        gone = []
        for key in reversed(keys):
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]
                free[key] = None
                gone.append(key)
        if gone:
            self._last = gone[::-1]
        return len(gone)

    def evict(self, n: int) -> None:
        """Forget the ``n`` least recently freed blocks (their memory is needed)."""
        free, hits = self._free, self._hits
        k = max(0, min(n, len(free)))
        for _ in range(k):
            key = free.popitem(last=False)[0]
            hits.pop(key, None)
            self._unproven.discard(key)
        self.num_evicted += k

    @property
    def keeps_unhit(self) -> bool:
        """Whether ``hottest`` lists every key no request has hit, or only the latest release's first
        (the live engine's rule: engine/prefix_cache.py ``keeps_unhit``)."""
        return self.adopted_unhit == 0 or self.adopted_unhit_hit > 0 or self.lookups == 0

    def hottest(self, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` cached keys with their hit counts: those requests have hit, most hits first,
        then those in use, then the free ones most recently freed first; then, in the same order,
        those not hit (all of them, or the latest release's first: ``keeps_unhit``): what a model
        evicted now keeps in host memory (memory/kept.py)."""
        hits, refs, free = self._hits, self._refs, self._free
        recent = [*refs, *reversed(free)]
        keys = [k for k in recent if k in hits]
        keys.sort(key=lambda k: -hits[k])  # stable: the order above within a count
        if self.keeps_unhit:
            keys += [k for k in recent if k not in hits]
        else:
            keys += [k for k in self._last if k not in hits and (k in free or k in refs)][:1]
        return [(k, hits.get(k, 0)) for k in keys[:n]]

    def adopt(self, kept: Sequence[tuple[int, int]]) -> int:
        """Cache ``kept`` (a ``hottest`` list) as free blocks with their hit counts, in its order of
        recency, the first the most recent; keys cached already are skipped. How many were added."""
        free, hits = self._free, self._hits
        added = 0
        for key, count in reversed(kept):
            if key not in self._refs and key not in free:
                free[key] = None
                if count > 0:
                    hits[key] = count
                else:
                    self._unproven.add(key)
                    self.adopted_unhit += 1
                added += 1
        return added

    def clear(self) -> None:
        self._refs.clear()
        self._free.clear()
        self._hits.clear()
        self._unproven.clear()
        self._last = []
        self.adopted_unhit = self.adopted_unhit_hit = self.lookups = 0
