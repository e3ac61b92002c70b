"""Paged KV cache: the block allocator (integer ids only) and the KV tensors it indexes.

The allocator knows nothing about tensors, so it is trivial to test and can be replaced by the
elastic-memory pool (which maps pages behind the same ids) without touching the scheduler.
Only ``KVCache`` needs torch, and it imports it itself, so the allocator and the scheduler import
without torch (checked in tests/sim/test_engine_parity.py, next to the simulator they are compared to).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from prism_serve.engine.models.config import ArchConfig
from prism_serve.memory.blocks import FixedBlockAllocator

__all__ = ["BlockAllocator", "FixedBlockAllocator", "KVCache"]

if TYPE_CHECKING:
    import torch


@runtime_checkable
class BlockAllocator(Protocol):
    """Hands out KV block ids. ``allocate`` returns None, never raises, when memory is short."""

    @property
    def num_total_blocks(self) -> int:
        """Most blocks this allocator can ever grant at once (the KV tensors hold this many)."""
        ...

    @property
    def num_free_blocks(self) -> int: ...

    def allocate(self, num_blocks: int) -> list[int] | None: ...

    def free(self, block_ids: Sequence[int]) -> None: ...


class KVCache:
    """K and V for every layer, in blocks of ``block_size`` tokens.

    Layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: one block id owns one
    contiguous byte range across all layers, so a memory pool can back a block by mapping pages,
    and freeing a block frees all of its layers at once.
    """

    def __init__(
        self,
        config: ArchConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        storage: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        import torch  # here, not at the top: the allocator above must import without torch

        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)
        if storage is None:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        else:
            numel = torch.Size(shape).numel()
            if storage.dtype != dtype or storage.numel() < numel:
                raise ValueError("KV storage is too small or has the wrong dtype")
            self.tensor = storage.view(-1)[:numel].view(shape)
        # Per-layer (K, V) views [num_blocks, block_size, num_kv_heads, head_dim]; strided, no copy.
        self.layers = [(self.tensor[:, i, 0], self.tensor[:, i, 1]) for i in range(config.num_layers)]
        # The same per layer as rows of one token's K (or V), [rows, num_kv_heads * head_dim]: token
        # ``offset`` of block ``b`` is row ``b * rows_per_block + offset`` (``slot_rows``). New
        # tokens are written with one index_copy_ of whole rows, which on CPU is ~100x faster than
        # the element-wise scatter of indexing by (block, offset).
        self.rows_per_block = config.num_layers * 2 * block_size
        row = config.num_kv_heads * config.head_dim
        num_rows = (num_blocks - 1) * self.rows_per_block + block_size
        base = self.tensor.storage_offset()
        self.layer_rows = [
            tuple(
                self.tensor.as_strided((num_rows, row), (row, 1), base + (2 * i + kv) * block_size * row)
                for kv in (0, 1)
            )
            for i in range(config.num_layers)
        ]

    def slot_rows(self, blocks: torch.Tensor | int, offsets: torch.Tensor | int) -> torch.Tensor | int:
        """Rows of ``layer_rows`` for tokens at ``offsets`` in ``blocks`` (tensors, or one token's ints)."""
        return blocks * self.rows_per_block + offsets

    @property
    def layer_block_numel(self) -> int:
        """Elements of one block of K (or V) in one layer."""
        return self.tensor[0, 0, 0].numel()

    @staticmethod
    def block_bytes(config: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
        return block_size * config.kv_bytes_per_token(dtype.itemsize)
