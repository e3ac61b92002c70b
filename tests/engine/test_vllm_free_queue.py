"""The free block queue the vLLM engine puts into vLLM's block pool (engine/vllm_engine.py): the
lowest free ids first, so the blocks in use stay at the bottom of the KV buffer, and the highest
block in use tracked as blocks come and go (the KV pages above it can be unmapped). With prefix
caching, freed blocks that vLLM's prefix cache names stay cached (their KV kept) until they are
handed out, matched again, or evicted by a shrink of the watermark before their pages are unmapped.
vLLM itself is not needed: its queue is a linked list of blocks, built here the same way, and its
block pool's hashes are an attribute of each block."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.engine.vllm_kv import LowestFirst
from prism_serve.memory.ledger import DeviceLedger
from prism_serve.memory.strided_kv import StridedKVPages
from prism_serve.memory.vmm import HostVirtualRange


def vllm_queue(num_blocks: int):
    """Blocks 0..n-1 and vLLM's free list holding all but block 0 (its null block), in order."""
    blocks = [SimpleNamespace(block_id=i, next_free_block=None, block_hash=None) for i in range(num_blocks)]
    head, tail = SimpleNamespace(next_free_block=None), SimpleNamespace()
    prev = head
    for b in blocks[1:]:
        prev.next_free_block = b
        prev = b
    prev.next_free_block = tail
    return blocks, SimpleNamespace(fake_free_list_head=head, fake_free_list_tail=tail)


def test_the_lowest_free_blocks_go_first_and_the_top_follows_them():
    blocks, queue = vllm_queue(10)
    q = LowestFirst(blocks, queue)
    assert q.num_free_blocks == 9 and q.top == 0
    assert [b.block_id for b in q.popleft_n(4)] == [1, 2, 3, 4] and q.top == 4
    q.append_n([blocks[2], blocks[4]])
    assert q.top == 3 and q.popleft().block_id == 2  # the lowest free id again
    q.append_n([blocks[1], blocks[2], blocks[3]])
    assert q.top == 0 and q.num_free_blocks == 9
    q.remove(blocks[7])  # taken out of the queue by vLLM directly
    assert q.top == 7 and blocks[7] not in q.get_all_free_blocks()


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["pop", "free", "remove"]), st.integers(1, 15)), max_size=60))
def test_top_is_always_the_highest_block_in_use(ops):
    blocks, queue = vllm_queue(16)
    q = LowestFirst(blocks, queue)
    used: set[int] = set()
    for op, i in ops:
        if op == "pop" and q.num_free_blocks:
            b = q.popleft()
            assert b.block_id == min(set(range(1, 16)) - used)
            used.add(b.block_id)
        elif op == "free" and i in used:
            q.append(blocks[i])
            used.discard(i)
        elif op == "remove" and i not in used:
            q.remove(blocks[i])
            used.add(i)
        assert q.top == max(used, default=0)
        assert q.num_free_blocks == 15 - len(used)


OPS = ["pop", "fill", "free", "match", "shrink"]


def cached(block) -> bool:
    return block.block_hash is not None


def test_cached_free_blocks_keep_their_content_until_handed_out_or_matched():
    blocks, queue = vllm_queue(10)
    q = LowestFirst(blocks, queue, cached)
    taken = q.popleft_n(5)
    for b in taken[:3]:  # blocks 1-3 filled up and were cached by vLLM while in use
        b.block_hash = f"h{b.block_id}"
    q.append_n(reversed(taken))  # the request ended
    assert q.cached == {1, 2, 3} and q.highest_cached() == 3 and q.top == 0 and q.num_free_blocks == 9
    # new content goes to the lowest free id, cached or not (vLLM drops its hash as it hands it out)
    assert q.popleft().block_id == 1 and q.cached == {2, 3} and q.top == 1
    blocks[1].block_hash = None
    q.remove(blocks[3])  # a request matched block 3's prefix: it is in use again, content and all
    assert q.cached == {2} and q.top == 3 and q.highest_cached() == 2
    q.append_n([blocks[1], blocks[3]])
    assert q.cached == {2, 3} and q.top == 0
    assert q.forget_from(3) == {3} and q.cached == {2}  # evicted by a shrink to 3
    assert q.forget_from(5) == set() and q.highest_cached() == 2


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(1, 15)), max_size=80))
def test_the_cached_set_is_the_free_blocks_vllm_still_names(ops):
    """vLLM's part, simulated: a block handed out loses its hash, a block in use may get one, a
    cached free block is matched (taken back) or evicted by a shrink."""
    blocks, queue = vllm_queue(16)
    q = LowestFirst(blocks, queue, cached)
    used: set[int] = set()
    for op, i in ops:
        if op == "pop" and q.num_free_blocks:
            b = q.popleft()
            b.block_hash = None  # BlockPool.get_new_blocks evicts it from the prefix cache
            assert b.block_id == min(set(range(1, 16)) - used)
            used.add(b.block_id)
        elif op == "fill" and i in used:
            blocks[i].block_hash = f"h{i}"
        elif op == "free" and i in used:
            q.append(blocks[i])
            used.discard(i)
        elif op == "match" and i in q.cached:
            q.remove(blocks[i])
            used.add(i)
        elif op == "shrink":
            for j in q.forget_from(i):
                blocks[j].block_hash = None  # BlockPool.evict_blocks
        free = set(range(1, 16)) - used
        assert q.cached == {j for j in free if blocks[j].block_hash is not None}
        assert q.top == max(used, default=0) and q.num_free_blocks == len(free)


def test_a_shrink_evicts_the_cached_blocks_above_the_watermark_before_their_pages_go():
    """Wired as the engine wires it: ``StridedKVPages.before_shrink`` evicts the cached free
    blocks from the new watermark up while their pages are still mapped; the cached blocks below
    keep their KV bytes; growing again brings back pages, not entries."""
    ledger = DeviceLedger("cpu:0", 2**26, namespace=f"test{uuid.uuid4().hex[:12]}")
    try:
        page = 64 * 1024
        kv = StridedKVPages(HostVirtualRange("cpu:0", 64 * page, page), 2, 24 * page, 2 * page, 12)
        kv.attach(ledger.account("m kv"))
        blocks, queue = vllm_queue(12)
        q = LowestFirst(blocks, queue, cached)
        evicted: list[int] = []

        def evict_blocks(ids: set[int]) -> None:  # vLLM's BlockPool.evict_blocks
            for i in ids:
                assert all(kv.vrange.is_mapped(p) for p in block_pages(kv, i)), "unmapped before eviction"
                blocks[i].block_hash = None
                evicted.append(i)

        kv.before_shrink = lambda new, old: evict_blocks(q.forget_from(new))
        assert kv.resize(11)
        flat = kv.vrange.as_tensor()
        for b in q.popleft_n(10):  # blocks 1-10: written, cached, freed
            b.block_hash = f"h{b.block_id}"
            for start in block_starts(kv, b.block_id):
                flat[start : start + kv.block_stride].fill_(b.block_id)
        q.append_n(blocks[1:11])
        assert q.cached == set(range(1, 11)) and q.top == 0
        assert kv.resize(6)  # pressure: blocks 6-10 go, evicted first
        assert sorted(evicted) == [6, 7, 8, 9, 10] and q.cached == {1, 2, 3, 4, 5}
        assert kv.mapped_bytes == kv.bytes_for(6) == len(kv.pages_for(6)) * page
        for i in range(1, 6):  # below the watermark: still cached, still their bytes
            assert blocks[i].block_hash == f"h{i}"
            for start in block_starts(kv, i):
                assert torch.all(flat[start : start + kv.block_stride] == i)
        assert kv.resize(11) and q.cached == {1, 2, 3, 4, 5}  # pages again, not entries
        assert all(blocks[i].block_hash is None for i in range(6, 11))
        kv.close()  # the model leaves: every entry goes
        assert q.cached == set() and sorted(evicted) == list(range(1, 11))
    finally:
        ledger.close()
        ledger.unlink()


def block_starts(kv: StridedKVPages, block: int) -> list[int]:
    return [kv.offset + layer * kv.layer_stride + block * kv.block_stride for layer in range(kv.num_layers)]


def block_pages(kv: StridedKVPages, block: int) -> set[int]:
    p = kv.page_size
    return {q for s in block_starts(kv, block) for q in range(s // p, (s + kv.block_stride - 1) // p + 1)}
