"""Paged KV cache: the block allocator (integer ids only) and the KV tensors it indexes.

The allocator knows nothing about tensors, so it is trivial to test and can be replaced by the
elastic-memory pool (which maps pages behind the same ids) without touching the scheduler.
Only ``KVCache`` needs torch, and it imports it itself, so the allocator and the scheduler import
without torch (checked in tests/sim/test_engine_parity.py, next to the simulator they are compared to).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from prism_serve.engine.models.config import ArchConfig
from prism_serve.errors import UnsupportedModelError
from prism_serve.memory.blocks import FixedBlockAllocator

__all__ = ["BlockAllocator", "FixedBlockAllocator", "KVCache", "KVGroups"]

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


@dataclass(frozen=True, slots=True)
class KVGroups:
    """Which layers share a KV block, so that sliding-window layers can let go of their old tokens.

    A model whose layers all attend to their whole context (or all through one window) has one
    group: a block holds a run of tokens for every layer. A model that mixes the two (Gemma 2 and
    3) splits its layers into groups of ``layers_per_group`` layers, full-context groups first,
    then the windowed ones (the last padded to the group size); a block holds a run of tokens for
    one group's layers, so every block has the same size and all come from one pool. A sequence
    holds one block table per group. A windowed group's blocks whose tokens no later query can
    see (all before the window of the next token computed) are freed, so the sequence's KV grows
    like its full-context layers only, plus one window per windowed group. The group size is the
    smaller of the two layer counts: Gemma 3 1B's 4 global and 22 local layers make 1 + 6 groups
    of 4 (2 slots of padding, 8% of a block while all of it is in the window)."""

    layers_per_group: int
    group_of: tuple[int, ...]  # layer -> its group
    slot_of: tuple[int, ...]  # layer -> its place among its group's layers in a block
    windowed: tuple[bool, ...]  # group -> attends through the window
    window: int | None  # the windowed groups' window (tokens), None when no group is windowed

    @classmethod
    def of(cls, config: ArchConfig, max_positions: int | None = None, split: bool = True) -> KVGroups:
        """The grouping for ``config`` served up to ``max_positions`` (ArchConfig.layer_windows);
        ``split=False``: one group of every layer, none of them freeing (EngineConfig.windowed_kv)."""
        windows = config.layer_windows(max_positions) if split else [None] * config.num_layers
        n = len(windows)
        sizes = {w for w in windows if w is not None}
        full = [i for i, w in enumerate(windows) if w is None]
        local = [i for i, w in enumerate(windows) if w is not None]
        if len(sizes) > 1:
            raise UnsupportedModelError(
                f"sliding windows of different sizes {sorted(sizes)} are not supported"
            )
        window = next(iter(sizes), None)
        if not full or not local:  # one group: every layer alike
            return cls(n, (0,) * n, tuple(range(n)), (window is not None,), window)
        g = min(len(full), len(local))
        group_of, slot_of = [0] * n, [0] * n
        windowed: list[bool] = []
        for layers, is_windowed in ((full, False), (local, True)):
            first = len(windowed)
            for j, layer in enumerate(layers):
                group_of[layer], slot_of[layer] = first + j // g, j % g
            windowed += [is_windowed] * -(-len(layers) // g)
        return cls(g, tuple(group_of), tuple(slot_of), tuple(windowed), window)

    @property
    def num_groups(self) -> int:
        return len(self.windowed)

    @property
    def splits(self) -> bool:
        """Whether windowed groups sit beside full-context ones (so a sequence's KV shrinks behind
        its window); one group of every layer never frees a block."""
        return self.window is not None and self.num_groups > 1

    def first_read(self, position: int, block_size: int) -> int:
        """The first block a query at ``position``, or any after it, reads in a windowed group."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // block_size

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks a sequence of ``num_tokens`` holds at once, computed ``chunk`` tokens a step
        at most: every full-context group's blocks, and a windowed group's window, the step's
        chunk and a block each side."""
        blocks = -(-num_tokens // block_size)
        if self.window is None:
            return blocks * self.num_groups
        window_blocks = min(blocks, (self.window - 1 + chunk) // block_size + 2)
        return sum(window_blocks if w else blocks for w in self.windowed)

    def kv_split(self, per_token: int, chunk: int, block_size: int) -> tuple[int, tuple[int, int] | None]:
        """How a sequence's KV grows with its length, for a model whose every layer together takes
        ``per_token`` bytes a token: (bytes per token of its full-context groups, (tokens a windowed
        group holds at most: the window, a step's ``chunk`` and a block each side; bytes per token
        of the windowed groups)), or (``per_token``, None) where nothing is freed. Groups are
        counted whole, the last windowed group's padding included."""
        if not self.splits:
            return per_token, None
        per_group = per_token * self.layers_per_group // len(self.group_of)
        windowed = sum(self.windowed)
        held = self.window - 1 + chunk + 2 * block_size
        return per_group * (self.num_groups - windowed), (held, per_group * windowed)


class KVCache:
    """K and V for every layer, in blocks of ``block_size`` tokens.

    Layout ``[num_blocks, layers_per_group, 2, block_size, num_kv_heads, head_dim]``: one block id
    owns one contiguous byte range across the layers of its group (all layers, unless ``groups``
    splits them: KVGroups), so a memory pool can back a block by mapping pages, and freeing a
    block frees all of its layers at once.
    """

    def __init__(
        self,
        config: ArchConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        storage: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        groups: KVGroups | None = None,
    ) -> None:
        import torch  # here, not at the top: the allocator above must import without torch

        self.block_size = block_size
        self.num_blocks = num_blocks
        self.groups = groups or KVGroups.of(config, split=False)
        g = self.groups.layers_per_group
        shape = (num_blocks, g, 2, block_size, config.num_kv_heads, config.head_dim)
        if storage is None:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        else:
            numel = torch.Size(shape).numel()
            if storage.dtype != dtype or storage.numel() < numel:
                raise ValueError("KV storage is too small or has the wrong dtype")
            self.tensor = storage.view(-1)[:numel].view(shape)
        # Per-layer (K, V) views [num_blocks, block_size, num_kv_heads, head_dim]; strided, no copy.
        slots = self.groups.slot_of
        self.layers = [(self.tensor[:, j, 0], self.tensor[:, j, 1]) for j in slots]
        # The same per layer as rows of one token's K (or V), [rows, num_kv_heads * head_dim]: token
        # ``offset`` of block ``b`` is row ``b * rows_per_block + offset`` (``slot_rows``). New
        # tokens are written with one index_copy_ of whole rows, which on CPU is ~100x faster than
        # the element-wise scatter of indexing by (block, offset).
        self.rows_per_block = g * 2 * block_size
        row = config.num_kv_heads * config.head_dim
        num_rows = (num_blocks - 1) * self.rows_per_block + block_size
        base = self.tensor.storage_offset()
        self.layer_rows = [
            tuple(
                self.tensor.as_strided((num_rows, row), (row, 1), base + (2 * j + kv) * block_size * row)
                for kv in (0, 1)
            )
            for j in slots
        ]

    def slot_rows(self, blocks: torch.Tensor | int, offsets: torch.Tensor | int) -> torch.Tensor | int:
        """Rows of ``layer_rows`` for tokens at ``offsets`` in ``blocks`` (tensors, or one token's ints)."""
        return blocks * self.rows_per_block + offsets

    @property
    def layer_block_numel(self) -> int:
        """Elements of one block of K (or V) in one layer."""
        return self.tensor[0, 0, 0].numel()

    @staticmethod
    def block_bytes(
        config: ArchConfig, block_size: int, dtype: torch.dtype, groups: KVGroups | None = None
    ) -> int:
        """Bytes of one block: ``block_size`` tokens of one group's layers (all layers when None)."""
        per_layer = config.kv_bytes_per_token(dtype.itemsize) // config.num_layers
        return block_size * per_layer * (config.num_layers if groups is None else groups.layers_per_group)
