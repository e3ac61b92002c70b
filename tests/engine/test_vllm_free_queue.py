"""The free block queue the vLLM engine puts into vLLM's block pool (engine/vllm_engine.py): the
lowest free ids first, so the blocks in use stay at the bottom of the KV buffer, and the highest
block in use tracked as blocks come and go (the KV pages above it can be unmapped). vLLM itself is
not needed: its queue is a linked list of blocks, built here the same way."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.engine.vllm_kv import LowestFirst


def vllm_queue(num_blocks: int):
    """Blocks 0..n-1 and vLLM's free list holding all but block 0 (its null block), in order."""
    blocks = [SimpleNamespace(block_id=i, next_free_block=None) for i in range(num_blocks)]
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
