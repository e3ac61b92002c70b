"""Pages on demand under a KV buffer laid out layer by layer (vLLM's): the buffer holds ``num_layers``
regions ``layer_stride`` bytes apart, and block ``b`` of layer ``l`` is the ``block_stride`` bytes at
``l * layer_stride + b * block_stride``. One block id therefore touches one stretch of every layer,
and a page can hold blocks of two layers where a layer ends inside it.

``StridedKVPages`` keeps blocks ``[0, watermark)`` usable: every page that holds a byte of one of
those blocks in any layer is mapped, each once, and its bytes are granted in the device ledger under
the current account. ``resize`` moves the watermark, all or nothing: growing grants and maps the
missing pages (refused by the ledger: nothing changes), shrinking unmaps the pages no block below the
new watermark needs and releases their bytes. The caller keeps its used blocks below the watermark
(vLLM hands out the lowest free block ids, engine/vllm_engine.py), so a page is never unmapped under
a block in use. Growing costs up to one page per layer beyond the blocks' own bytes. A buffer of
no layers (an encoder's: vLLM gives it no KV cache) maps nothing at any watermark.
"""

from __future__ import annotations

from collections.abc import Callable

from prism_serve.memory.ledger import Account
from prism_serve.memory.vmm import VirtualRange

__all__ = ["StridedKVPages"]


class StridedKVPages:
    def __init__(
        self,
        vrange: VirtualRange,
        num_layers: int,
        layer_stride: int,
        block_stride: int,
        num_blocks: int,
        offset: int = 0,
    ) -> None:
        if num_layers < 0 or block_stride < 1 or num_blocks < 1:
            raise ValueError("need one block, a positive block stride and no negative layer count")
        if layer_stride < num_blocks * block_stride and num_layers > 1:
            raise ValueError("layers overlap: layer_stride is below num_blocks * block_stride")
        end = offset + (num_layers - 1) * layer_stride + num_blocks * block_stride if num_layers else 0
        if end > vrange.size:
            raise ValueError(f"the buffer ends at byte {end}; the range has {vrange.size}")
        self.vrange = vrange
        self.num_layers = num_layers
        self.layer_stride = layer_stride
        self.block_stride = block_stride
        self.num_blocks = num_blocks
        self.offset = offset
        self.account: Account | None = None
        self.watermark = 0
        self.mapped: set[int] = set()
        # called with (new watermark, old watermark) before a shrink unmaps anything: blocks from the
        # new watermark up lose their pages (vLLM's engine forgets its prefix cache's entries there)
        self.before_shrink: Callable[[int, int], None] | None = None

    @property
    def page_size(self) -> int:
        return self.vrange.page_size

    @property
    def mapped_bytes(self) -> int:
        return len(self.mapped) * self.page_size

    def pages_for(self, watermark: int) -> set[int]:
        """The pages blocks ``[0, watermark)`` touch, in every layer."""
        if watermark <= 0:
            return set()
        p = self.page_size
        out: set[int] = set()
        for layer in range(self.num_layers):
            start = self.offset + layer * self.layer_stride
            out.update(range(start // p, (start + watermark * self.block_stride - 1) // p + 1))
        return out

    def bytes_for(self, watermark: int) -> int:
        """The bytes of ``pages_for(watermark)``, counted without building the set."""
        if watermark <= 0:
            return 0
        p = self.page_size
        count, last = 0, -1
        for layer in range(self.num_layers):  # each layer's pages, in order; neighbours may share one
            start = self.offset + layer * self.layer_stride
            first, end = max(start // p, last + 1), (start + watermark * self.block_stride - 1) // p
            count += max(0, end - first + 1)
            last = max(last, end)
        return count * p

    def attach(self, account: Account) -> None:
        """The account that pays for the pages from now on (one model's KV account); only while
        nothing is mapped."""
        if self.mapped:
            raise RuntimeError("pages are mapped under another account")
        self.account = account

    def move_to(self, account: Account) -> bool:
        """Hand the mapped pages, bytes and all, to ``account`` (one process's entries: the ledger
        moves their bytes in one operation); False if its limit refuses them."""
        if self.account is not None and self.mapped and not self.account.move_to(account, self.mapped_bytes):
            return False
        self.account = account
        return True

    def resize(self, watermark: int) -> bool:
        """Make blocks ``[0, watermark)`` usable and no more; False (nothing changed) when the
        ledger refuses the pages growing needs."""
        watermark = max(0, min(watermark, self.num_blocks))
        if watermark < self.watermark and self.before_shrink is not None:
            self.before_shrink(watermark, self.watermark)
        want = self.pages_for(watermark)
        new = sorted(want - self.mapped)
        if new:
            if self.account is None:
                raise RuntimeError("no account to grant pages to: attach one first")
            if not self.account.try_reserve(len(new) * self.page_size):
                return False
            try:
                self.vrange.map_pages(new)  # all or none
            except BaseException:
                self.account.release(len(new) * self.page_size)
                raise
            self.mapped.update(new)
        gone = sorted(self.mapped - want)
        for page in gone:
            self.vrange.unmap_page(page)
            self.mapped.discard(page)
        if gone:
            assert self.account is not None
            self.account.release(len(gone) * self.page_size)
        self.watermark = watermark
        return True

    def grow_by_pages(self, watermark: int) -> int:
        """Grow towards ``watermark`` as far as the ledger allows (after a refusal, the highest
        watermark it grants, found by bisection); returns the watermark reached."""
        if self.resize(watermark):
            return self.watermark
        low, high = self.watermark, watermark  # resize(low) holds, resize(high) was refused
        while high - low > 1:
            mid = (low + high) // 2
            if self.resize(mid):
                low = mid
            else:
                high = mid
        return self.watermark

    def close(self) -> None:
        """Unmap everything and release its bytes."""
        if self.mapped:
            self.resize(0)
        self.watermark = 0
