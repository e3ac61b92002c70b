"""Automatic prefix caching: full KV blocks addressed by their content, shared and kept after use.

Integer block ids only (no torch), like the allocator it sits on, so it is tested without a model.

A full block's key is a hash chained over the previous block's key and the block's token ids; the
first block's chain starts from a salt naming what else changes the KV (the LoRA adapter's
registration: a base block and an adapter block never match, nor two registrations of one name).
A key therefore names a whole prefix, not one block's tokens. Blocks are registered under their
key once the model has computed every token in them; a new request takes the longest run of
registered blocks its own keys name (``match``) and the engine prefills only what follows.

Blocks are reference-counted: a registered block may be in several running requests' block
tables at once, read-only (a request only ever writes positions past what it matched, which lie
in blocks of its own). When the last holder frees a registered block it stays registered, unheld,
in least-recently-used order; those blocks are the first memory given up: ``allocate`` takes them
(oldest first) when the allocator below refuses, and ``drop`` hands them back to the allocator
when the device needs the memory elsewhere. A block is unregistered before it is handed out for
other content, so a key can never name a block that was rewritten.

A model whose layers are split into KV groups (kv_cache.KVGroups) registers each group's block
under the block's key tagged with the group (group 0's untagged), chained on the block's own group-0
key, so a group's block is never kept without its full-context sibling. A windowed group's early
blocks may be gone while the prefix is cached; a match needs only the blocks the next query reads
(``match_groups``).

A model's hottest prefixes can outlive its engine: ``hottest`` lists cached blocks of the base
model's chains, every block after its parent, and a new engine's cache ``adopt``s such a list with
its hit counts (engine/kept_prefixes.py copies the blocks' KV to host memory and back). First the
blocks requests have hit (found cached by ``match``), most hits first, then the most recently used.
Then the blocks no request has hit yet, most recent first: a conversation's latest turn, which its
next turn will ask for, or a prompt seen once, which nothing will; keeping those costs a copy at
each eviction and activation, on every swap. So they go by the evidence of the last return: all
of them unless this engine adopted blocks without hits, served requests, and not one of those
blocks was hit since (the traffic resends nothing), and then only the first of the most recent
request's, a probe (one block's copy) whose hit puts all of them back at the next eviction. A
return that served nothing (a model warmed ahead of demand) says nothing, and keeps them all.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from prism_serve.engine.kv_cache import BlockAllocator, KVGroups

__all__ = ["CacheStats", "PrefixCache", "block_keys"]


def block_keys(
    token_ids: Sequence[int], block_size: int, salt: bytes, keys: list[bytes], digest_size: int = 16
) -> list[bytes]:
    """Extend ``keys`` (the keys of the first ``len(keys)`` full blocks of ``token_ids``) to every
    full block of ``token_ids``; returns ``keys``. A key is ``digest_size`` bytes of BLAKE2b keyed
    by the previous key (``salt`` for the first block) over the block's token ids as little-endian
    64-bit integers: the same in every process and on every machine."""
    for i in range(len(keys), len(token_ids) // block_size):
        parent = keys[i - 1] if i else salt
        ids = array("q", token_ids[i * block_size : (i + 1) * block_size])
        if sys.byteorder == "big":
            ids.byteswap()
        keys.append(hashlib.blake2b(ids.tobytes(), digest_size=digest_size, key=parent[:64]).digest())
    return keys


def group_key(key: bytes, group: int) -> bytes:
    """A block's key in KV group ``group`` (group 0's is the block's own)."""
    return key + bytes((group,)) if group else key


@dataclass(frozen=True, slots=True)
class CacheStats:
    queries: int  # prompt tokens looked up
    hits: int  # of those, tokens found cached
    cached_blocks: int  # registered blocks (held or not)
    evictable_blocks: int  # registered blocks no request holds: reclaimable
    evictions: int  # registered blocks given up (reused for other content or dropped)


class PrefixCache:
    """The engine's block source when prefix caching is on: ``allocator``'s blocks plus the
    registered blocks no request holds, which it gives up least recently used first."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}  # key -> registered block
        self._key_of: dict[int, bytes] = {}  # registered block -> its key
        self._refs: dict[int, int] = {}  # registered block -> requests holding it (0: evictable)
        self._lru: dict[int, None] = {}  # registered blocks nobody holds, least recently used first
        self._hit_count: dict[int, int] = {}  # registered block -> times a request found it cached
        # blocks adopted without a hit and not hit since, and how many were adopted and hit so
        self._unproven: set[int] = set()
        self.adopted_unhit = self.adopted_unhit_hit = 0
        # key -> the key it is chained on: the previous block's, or the salt for a first block
        self._parent: dict[bytes, bytes] = {}
        self._queries = self._hits = self._evictions = 0

    # ---- blocks ----------------------------------------------------------------------------------

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request holds: memory that is given up before anything is refused."""
        return len(self._lru)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks + len(self._lru)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` blocks for new content: from the allocator while it grants them, then
        the least recently used cached blocks. None (nothing taken) if even those are too few."""
        got = self.allocator.allocate(num_blocks)
        if got is not None or not self._lru:
            return got
        # only what the allocator cannot grant comes from the cache (all of it if that changed)
        reuse = min(len(self._lru), num_blocks - min(num_blocks, self.allocator.num_free_blocks))
        rest = self.allocator.allocate(num_blocks - reuse) if num_blocks > reuse else []
        if rest is None and reuse < len(self._lru) and reuse < num_blocks:
            reuse = min(num_blocks, len(self._lru))
            rest = self.allocator.allocate(num_blocks - reuse) if num_blocks > reuse else []
        if rest is None:
            return None
        return [self._evict_oldest() for _ in range(reuse)] + rest

    def free(self, block_ids: Sequence[int]) -> None:
        """A request lets go of its blocks (in table order). Registered ones stay cached, its last
        blocks ahead of its first in the eviction order (a prefix outlives its continuations);
        the others go back to the allocator."""
        private = []
        for b in reversed(block_ids):
            refs = self._refs.get(b)
            if refs is None:
                private.append(b)
            elif refs == 1:
                self._refs[b] = 0
                self._lru[b] = None
            elif refs > 1:
                self._refs[b] = refs - 1
            else:
                raise RuntimeError(f"cached block {b} freed but not held (double free)")
        if private:
            self.allocator.free(private[::-1])

    def drop(self, num_blocks: int | None = None) -> list[int]:
        """Give up to ``num_blocks`` (None: all) unheld cached blocks back to the allocator, least
        recently used first; returns their ids (for the caller to see what memory it frees)."""
        n = len(self._lru) if num_blocks is None else min(num_blocks, len(self._lru))
        dropped = [self._evict_oldest() for _ in range(n)]
        if dropped:
            self.allocator.free(dropped)
        return dropped

    def evictable_blocks(self) -> list[int]:
        """The unheld cached blocks, least recently used first."""
        return list(self._lru)

    # ---- content -------------------------------------------------------------------------------

    def match(self, keys: Sequence[bytes], num_prompt_tokens: int) -> list[int]:
        """Take the registered blocks of the longest run of ``keys`` (a request's leading full
        blocks) for a request of ``num_prompt_tokens``: at most ``num_prompt_tokens - 1`` tokens,
        so that its last token is computed and gives the next token's logits. The caller holds
        them until it ``free``s them."""
        return self.match_groups(keys, num_prompt_tokens)[0][0]

    def match_groups(
        self, keys: Sequence[bytes], num_prompt_tokens: int, groups: KVGroups | None = None
    ) -> tuple[list[list[int]], int]:
        """``match`` for a model with KV ``groups``: the block tables of each group for the longest
        prefix whose full-context groups have every block and whose windowed groups have the blocks
        the next query reads, and how many leading blocks the windowed groups' tables lack (-1)."""
        limit = min(len(keys), (num_prompt_tokens - 1) // self.block_size)
        windowed = (False,) if groups is None else groups.windowed
        block_of = self._block_of

        def block(group: int, i: int) -> int | None:
            return block_of.get(group_key(keys[i], group))

        n = limit
        for group, w in enumerate(windowed):
            if not w:
                run = 0
                while run < n and block(group, run) is not None:
                    run += 1
                n = run
        first = 0
        if groups is not None and groups.window is not None:
            while n > 0:
                first = groups.first_read(n * self.block_size, self.block_size)
                lost = [
                    i for g, w in enumerate(windowed) if w for i in range(first, n) if block(g, i) is None
                ]
                if not lost:
                    break
                n = max(lost)  # every longer prefix reads that block too
            first = first if n else 0
        # every block named here was found above: the full groups' run, the windowed groups' reads
        tables: list[list[int]] = [
            [-1] * first + [block_of[group_key(keys[i], g)] for i in range(first, n)]
            if w
            else [block_of[group_key(keys[i], g)] for i in range(n)]
            for g, w in enumerate(windowed)
        ]
        hit_count = self._hit_count
        for table, w in zip(tables, windowed, strict=True):
            for b in table[first:] if w else table:
                if self._refs[b] == 0:
                    del self._lru[b]
                self._refs[b] += 1
                hit_count[b] = hit_count.get(b, 0) + 1
                if b in self._unproven:
                    self._unproven.discard(b)
                    self.adopted_unhit_hit += 1
        self._queries += num_prompt_tokens
        self._hits += n * self.block_size
        return tables, first

    def register(
        self, keys: Sequence[bytes], block_table: Sequence[int], start: int, end: int, salt: bytes = b"",
        group: int = 0,
    ) -> int:  # fmt: skip
        """Register blocks ``start..end-1`` of a request (computed in full; ``keys`` the request's
        block keys, at least ``end`` of them, chained from ``salt``) and return ``end``, the next
        call's ``start``. A key another block holds already leaves this one private (two requests
        computed the same prefix at once): it is freed to the allocator with its request.
        ``block_table`` is KV group ``group``'s (its freed blocks, -1, are skipped)."""
        for i in range(start, end):
            b = block_table[i]
            key = group_key(keys[i], group)
            if b < 0 or b in self._refs or key in self._block_of:
                continue  # freed, matched from the cache (already registered), or a duplicate
            self._block_of[key] = b
            self._key_of[b] = key
            self._parent[key] = keys[i] if group else keys[i - 1] if i else salt
            self._refs[b] = 1
        return end

    def hits_of(self, block: int) -> int:
        """How many times requests found ``block`` cached (in this engine, plus the count it was
        adopted with)."""
        return self._hit_count.get(block, 0)

    @property
    def keeps_unhit(self) -> bool:
        """Whether ``hottest`` lists every block no request has hit, or only the first of the most
        recent request's: False once this engine, given blocks without a hit, served requests and
        none of them hit one of those blocks."""
        return self.adopted_unhit == 0 or self.adopted_unhit_hit > 0 or self._queries == 0

    def hottest(self, max_blocks: int) -> list[tuple[int, bytes, bytes]]:
        """Up to ``max_blocks`` registered blocks of the base model's chains (salt ``b""``; an
        adapter's salt names its registration in this engine only) as ``(block, key, parent
        key)``: those requests have hit, most hits first, then those in use, then the unheld ones
        most recently used first; then, in the same order of use, those not hit (all of them, or
        the most recent request's first one: ``keeps_unhit``, the module's doc). Each is listed only
        after its parent, so every leading part of the list is a set of whole prefixes."""
        hit_count = self._hit_count
        recent = [b for b, refs in self._refs.items() if refs > 0] + list(reversed(self._lru))
        candidates = [b for b in recent if b in hit_count]  # held ones in registration order
        candidates.sort(key=lambda b: -hit_count[b])  # stable: recency within a count
        unhit = [b for b in recent if b not in hit_count]
        if not self.keeps_unhit:
            # the probe: the most recent one whose chain before it is kept (or that starts one)
            known = {self._key_of[b] for b in candidates} | {b""}
            unhit = [b for b in unhit if self._parent[self._key_of[b]] in known][:1]
        candidates += unhit
        chosen: list[tuple[int, bytes, bytes]] = []
        kept: set[bytes] = set()
        while candidates and len(chosen) < max_blocks:
            later = []
            for b in candidates:
                key = self._key_of[b]
                parent = self._parent[key]
                if len(chosen) == max_blocks:
                    break
                if parent == b"" or parent in kept:
                    chosen.append((b, key, parent))
                    kept.add(key)
                elif parent in self._block_of:
                    later.append(b)  # its parent may come later in the order
            if len(later) == len(candidates):
                break  # the rest hang off chains that were not kept
            candidates = later
        return chosen

    def adopt(
        self, keys: Sequence[bytes], parents: Sequence[bytes], hits: Sequence[int] = ()
    ) -> list[tuple[int, int]]:
        """Register blocks from a list ``hottest`` made (in its order) as cached and unheld, keeping
        its order as their recency, in blocks the allocator grants now: as many leading entries as
        it grants, each with its count of ``hits`` (none given: 0, a block no request has hit; this
        engine counts how many of those requests then hit, ``keeps_unhit``). Entries already
        registered, or whose parent is not, are skipped. Returns ``(entry, block)`` for each block
        taken; the caller writes each entry's KV into its block."""
        n = min(len(keys), self.allocator.num_free_blocks)
        blocks = None
        while n and blocks is None:  # an elastic allocator may grant fewer than it has free
            blocks = self.allocator.allocate(n)
            if blocks is None:
                n //= 2
        if not blocks:
            return []
        taken: list[tuple[int, int]] = []
        unused: list[int] = []
        for i, b in enumerate(blocks):
            key, parent = keys[i], parents[i]
            if key in self._block_of or not (parent == b"" or parent in self._block_of):
                unused.append(b)
                continue
            self._block_of[key] = b
            self._key_of[b] = key
            self._parent[key] = parent
            self._refs[b] = 0
            if i < len(hits) and hits[i] > 0:
                self._hit_count[b] = hits[i]
            else:
                self._unproven.add(b)
                self.adopted_unhit += 1
            taken.append((i, b))
        if unused:
            self.allocator.free(unused)
        for _, b in reversed(taken):  # the list's first entry is the most recently used
            self._lru[b] = None
        return taken

    def stats(self) -> CacheStats:
        return CacheStats(self._queries, self._hits, len(self._key_of), len(self._lru), self._evictions)

    def _evict_oldest(self) -> int:
        b = next(iter(self._lru))
        del self._lru[b]
        del self._refs[b]
        self._hit_count.pop(b, None)
        self._unproven.discard(b)
        key = self._key_of.pop(b)
        del self._block_of[key]
        del self._parent[key]
        self._evictions += 1
        return b
