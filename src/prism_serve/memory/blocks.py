"""A fixed set of KV block ids: the engine's allocator when nothing else provides one, and the free
list of memory/kv_pool.py's ``FixedKVPool``. Integer ids only: no torch, nothing mapped."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["FixedBlockAllocator"]


class FixedBlockAllocator:
    """A fixed pool of ``num_blocks`` ids. Freed ids are reused first (their memory is warm)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = bytearray(num_blocks)

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            return None
        ids = self._free[len(self._free) - num_blocks :]
        del self._free[len(self._free) - num_blocks :]
        for i in ids:
            self._used[i] = 1
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        for i in block_ids:
            if not 0 <= i < self._num_blocks or not self._used[i]:
                raise RuntimeError(f"block {i} freed but not allocated (double free or foreign id)")
            self._used[i] = 0
        self._free.extend(reversed(block_ids))
