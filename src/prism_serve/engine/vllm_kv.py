"""vLLM's KV cache over prism's pages: the two pieces engine/vllm_engine.py puts into vLLM.

- ``FromRange`` stands in for the torch module inside vLLM's KV allocation, so the one buffer vLLM
  allocates is a view of the worker's reserved KV range (pages mapped on demand by
  memory/strided_kv.py), not memory of its own.
- ``LowestFirst`` replaces the free block queue of vLLM's block pool (prefix caching off): the
  lowest free block ids go first, so the blocks in use stay at the bottom of the buffer and the
  pages above them can be unmapped; it tracks the highest block in use as blocks come and go.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

import torch

from prism_serve.errors import InvalidRequestError

__all__ = ["FromRange", "LowestFirst", "queued_blocks"]


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
    """vLLM's free block queue (prefix caching off), handing out the lowest free block ids first,
    so the blocks in use stay at the bottom of the buffer and its pages above them can be unmapped."""

    def __init__(self, blocks: list, queue: Any) -> None:
        self._blocks = blocks
        self._free = {b.block_id for b in queued_blocks(queue)}
        self._heap = sorted(self._free)
        # the highest block id not free (0: only vLLM's null block, which is never free)
        self.top = max((i for i in range(len(blocks)) if i not in self._free), default=0)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def _lower_top(self) -> None:
        while self.top > 0 and self.top in self._free:
            self.top -= 1

    def popleft(self) -> Any:
        while True:
            i = heapq.heappop(self._heap)
            if i in self._free:
                self._free.discard(i)
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
            if block.block_id == self.top:
                self._lower_top()

    def append_n(self, blocks: Iterable) -> None:
        for b in blocks:
            self.append(b)

    prepend_n = append_n  # the order is by id either way

    def remove(self, block: Any) -> None:
        self._free.discard(block.block_id)  # its heap entry is skipped when popped
        self.top = max(self.top, block.block_id)

    def get_all_free_blocks(self) -> list:
        return [self._blocks[i] for i in sorted(self._free)]


def queued_blocks(queue: Any) -> list:
    """The blocks in vLLM's linked free list."""
    out, b = [], queue.fake_free_list_head.next_free_block
    while b is not queue.fake_free_list_tail:
        out.append(b)
        b = b.next_free_block
    return out
