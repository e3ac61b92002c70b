"""Scheduler and block allocator, without a model: a fake runner appends a token for every
request whose chunk reaches its end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.engine.kv_cache import BlockAllocator, FixedBlockAllocator
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.scheduler import Scheduler
from prism_serve.engine.sequence import RequestMetrics, Sequence, SequenceStatus


def make_seq(req_id: str, prompt_len: int) -> Sequence:
    return Sequence(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=100),
        detokenizer=None,  # type: ignore[arg-type]  # the scheduler never detokenizes
        metrics=RequestMetrics(arrival_time=0.0),
    )


def fake_step(sched: Scheduler):
    out = sched.schedule()
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        if samples:
            s.seq.token_ids.append(7)
    return out


def check_blocks(sched: Scheduler, alloc: BlockAllocator) -> None:
    tables = [b for s in sched.running for b in s.block_table]
    assert len(tables) == len(set(tables)), "a block is in two block tables"
    assert all(not s.block_table for s in sched.waiting), "a waiting request holds blocks"
    assert len(tables) + alloc.num_free_blocks == alloc.num_total_blocks
    for s in sched.running:
        assert len(s.block_table) * sched.block_size >= s.num_computed_tokens


def test_fixed_allocator_refuses_with_none_and_detects_double_free():
    alloc = FixedBlockAllocator(4)
    a = alloc.allocate(3)
    assert alloc.allocate(2) is None
    assert alloc.num_free_blocks == 1
    alloc.free(a)
    assert alloc.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([a[0]])
    assert isinstance(alloc, BlockAllocator)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_fixed_allocator_never_grants_a_block_twice(ops):
    alloc = FixedBlockAllocator(16)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc or not held:
            got = alloc.allocate(n)
            owned = sum(len(h) for h in held)
            assert (got is None) == (n > 16 - owned)
            if got is not None:
                held.append(got)
        else:
            alloc.free(held.pop(n % len(held)))
        flat = [b for h in held for b in h]
        assert len(flat) == len(set(flat))
        assert alloc.num_free_blocks == 16 - len(flat)


def test_token_budget_chunks_the_prompt_that_does_not_fit():
    sched = Scheduler(FixedBlockAllocator(100), block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    for i, n in enumerate([10, 20, 30]):
        sched.add(make_seq(f"r{i}", n))
    out = fake_step(sched)
    assert [(s.seq.req_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 10), ("r1", 20), ("r2", 2)]
    out = sched.schedule()
    # Decodes of r0 and r1 first, then the last chunk of r2, which completes its prompt.
    assert [(s.seq.req_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 1), ("r1", 1), ("r2", 28)]
    assert [s.samples for s in out.scheduled] == [True, True, True]


def test_max_num_seqs_caps_running():
    sched = Scheduler(FixedBlockAllocator(100), block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(make_seq(f"r{i}", 5))
    fake_step(sched)
    assert [s.req_id for s in sched.running] == ["r0", "r1"]
    assert [s.req_id for s in sched.waiting] == ["r2"]


def test_newest_request_is_preempted_and_requeued_first():
    alloc = FixedBlockAllocator(4)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq("a", 8), make_seq("b", 8)
    sched.add(a)
    sched.add(b)
    sched.add(make_seq("c", 3))
    fake_step(sched)  # a and b take 2 blocks each; c does not fit
    assert [s.req_id for s in sched.running] == ["a", "b"]
    out = fake_step(sched)  # a needs a third block: b is preempted
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert b.num_tokens == 9, "preemption keeps generated tokens; they are recomputed"
    assert [s.req_id for s in sched.waiting] == ["b", "c"]
    assert [s.seq.req_id for s in out.scheduled] == ["a"]
    check_blocks(sched, alloc)


def test_lone_request_preempts_itself_when_nothing_else_can_go():
    alloc = FixedBlockAllocator(2)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq("a", 8)
    sched.add(a)
    fake_step(sched)
    out = fake_step(sched)
    assert out.preempted == [a] and out.scheduled == []
    check_blocks(sched, alloc)


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 6),
)
def test_random_workloads_keep_block_invariants_and_finish(
    prompt_lens, num_blocks, block_size, budget, max_seqs
):
    max_len = 44  # prompt + output, must fit the cache alone
    num_blocks = max(num_blocks, -(-max_len // block_size))
    alloc = FixedBlockAllocator(num_blocks)
    sched = Scheduler(alloc, block_size=block_size, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    seqs = [make_seq(f"r{i}", n) for i, n in enumerate(prompt_lens)]
    for s in seqs:
        sched.add(s)
    for _ in range(5000):
        if not sched.num_unfinished:
            break
        out = fake_step(sched)
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= max_seqs
        for s in list(sched.running):
            if s.num_tokens >= min(s.num_prompt_tokens + 4, max_len):
                sched.finish(s)
        check_blocks(sched, alloc)
    assert sched.num_unfinished == 0, "the scheduler stopped making progress"
    assert alloc.num_free_blocks == num_blocks
