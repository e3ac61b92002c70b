"""vLLM's KV cache over prism's pages: the two pieces engine/vllm_engine.py puts into vLLM.

- ``FromRange`` stands in for the torch module inside vLLM's KV allocation, so the one buffer vLLM
  allocates is a view of the worker's reserved KV range (pages mapped on demand by
  memory/strided_kv.py), not memory of its own.
- ``LowestFirst`` replaces the free block queue of vLLM's block pool: the lowest free block ids
  go first, so the blocks in use stay at the bottom of the buffer and the pages above them can be
  unmapped; it tracks the highest block in use as blocks come and go. With prefix caching, a block
  whose request ended keeps its KV and its hash in vLLM's prefix cache while it waits in the queue
  (it counts as free); the queue also keeps the set of those cached free blocks, so the engine can
  keep their pages mapped, and evict them from vLLM's prefix cache (``forget_from``, then vLLM's
  ``evict_blocks``) before it unmaps their pages. A cached block handed out for new content loses
  its hash in vLLM's pool (``get_new_blocks``) before anything is written to it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

import torch

from prism_serve.errors import InvalidRequestError

__all__ = ["FromRange", "LowestFirst", "is_cached", "queued_blocks"]


class FromRange:
    """Stands in for the torch module inside vLLM's KV allocation: its ``zeros`` is a view of the
    reserved range (mapped by the caller), everything else is torch's."""

    def __init__(self, flat: torch.Tensor) -> None:
        self._flat = flat

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def zeros(self, n: int, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        if n > self._flat.numel():
            raise InvalidRequestError(
                f"vLLM's KV cache needs {n} bytes; the worker reserved {self._flat.numel()}"
            )
        return self._flat[:n].view(dtype or torch.float32)


class LowestFirst:
    """vLLM's free block queue, handing out the lowest free block ids first, so the blocks in use
    stay at the bottom of the buffer and its pages above them can be unmapped. ``is_cached`` tells
    whether a block holds a prefix-cache entry (vLLM's ``block_hash``, or a partial entry): such a
    block, freed, is in ``cached`` until it is handed out, taken back by a request that matched
    it, or forgotten (``forget_from``)."""

    def __init__(self, blocks: list, queue: Any, is_cached: Callable[[Any], bool] = lambda b: False) -> None:
        self._blocks = blocks
        self._is_cached = is_cached
        self._free = {b.block_id for b in queued_blocks(queue)}
        self._heap = sorted(self._free)
        # the highest block id not free (0: only vLLM's null block, which is never free)
        self.top = max((i for i in range(len(blocks)) if i not in self._free), default=0)
        self.cached: set[int] = set()  # free blocks whose KV a prefix-cache entry still names

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def highest_cached(self) -> int:
        """The highest cached free block id (0: none)."""
        return max(self.cached, default=0)

    def _lower_top(self) -> None:
        while self.top > 0 and self.top in self._free:
            self.top -= 1

    def popleft(self) -> Any:
        while True:
            i = heapq.heappop(self._heap)
            if i in self._free:
                self._free.discard(i)
                self.cached.discard(i)  # vLLM drops its hash as it hands it out (``get_new_blocks``)
                self.top = max(self.top, i)
                return self._blocks[i]

    def popleft_n(self, n: int) -> list:
        if n > len(self._free):
            raise ValueError(f"cannot take {n} blocks: {len(self._free)} are free")
        return [self.popleft() for _ in range(n)]

    def append(self, block: Any) -> None:
        if block.block_id not in self._free:
            self._free.add(block.block_id)
            heapq.heappush(self._heap, block.block_id)
            if self._is_cached(block):
                self.cached.add(block.block_id)
            if block.block_id == self.top:
                self._lower_top()

    def append_n(self, blocks: Iterable) -> None:
        for b in blocks:
            self.append(b)

    prepend_n = append_n  # the order is by id either way

    def remove(self, block: Any) -> None:
        """A request took a cached free block it matched (vLLM's ``touch``)."""
        self._free.discard(block.block_id)  # its heap entry is skipped when popped
        self.cached.discard(block.block_id)
        self.top = max(self.top, block.block_id)

    def forget_from(self, watermark: int) -> set[int]:
        """The cached free blocks from ``watermark`` up, no longer counted as cached: the caller
        evicts them from vLLM's prefix cache (``BlockPool.evict_blocks``) before their pages go."""
        gone = {i for i in self.cached if i >= watermark}
        self.cached -= gone
        return gone

    def get_all_free_blocks(self) -> list:
        return [self._blocks[i] for i in sorted(self._free)]


def queued_blocks(queue: Any) -> list:
    """The blocks in vLLM's linked free list."""
    out, b = [], queue.fake_free_list_head.next_free_block
    while b is not queue.fake_free_list_tail:
        out.append(b)
        b = b.next_free_block
    return out


def is_cached(pool: Any, block: Any) -> bool:
    """Whether vLLM's prefix cache names ``block``: its own hash, or a partial entry tracked
    beside it (vLLM 0.32's ``cached_block_hashes_by_block``)."""
    return block.block_hash is not None or block.block_id in pool.cached_block_hashes_by_block
