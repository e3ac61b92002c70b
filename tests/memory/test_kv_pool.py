from __future__ import annotations

import time

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prism_serve.engine.kv_cache import BlockAllocator
from prism_serve.errors import InvalidRequestError
from prism_serve.memory.kv_pool import (
    GPU_BUFFER_MAX_PAGES,
    GPU_LINGER_S,
    ElasticKVPool,
    FixedKVPool,
    PoolConfig,
)
from prism_serve.memory.ledger import DeviceLedger, DeviceMemoryExhaustedError, LedgerError
from prism_serve.memory.vmm import HostVirtualRange

KiB = 1024
P = 64 * KiB  # small pages keep the tests fast; the logic does not depend on the size


def make_pool(
    ledger: DeviceLedger, block_bytes: int, num_pages: int = 16, name: str = "e", **cfg
) -> ElasticKVPool:
    cfg.setdefault("prefetch", False)
    cfg.setdefault("buffer_min_pages", 0)
    cfg.setdefault("buffer_max_pages", 0)
    vrange = HostVirtualRange("cpu:0", num_pages * P, P)
    return ElasticKVPool(
        vrange, block_bytes, ledger.account(name), PoolConfig(page_size=P, **cfg), owns=False
    )


def page_of(pool: ElasticKVPool, b: int) -> int:
    return b * pool.block_bytes // P


def wait_for(cond, timeout: float = 10.0) -> None:
    """Poll a condition the prefetch thread makes true (waiting, not timing: no assertion on speed)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


def test_is_a_block_allocator(make_ledger):
    pool = make_pool(make_ledger(budget_bytes=16 * P), 16 * KiB)
    assert isinstance(pool, BlockAllocator)
    assert pool.num_total_blocks == 64 and pool.num_free_blocks == 64
    pool.close()


def test_bytes_freed_by_counts_only_pages_no_other_block_touches(make_ledger):
    """What a prefix cache's unheld blocks are worth to the device: the pages freeing them would
    let the pool unmap, not their blocks' bytes (a page shared with a block in use stays)."""
    pool = make_pool(make_ledger(budget_bytes=16 * P), 16 * KiB)  # 4 blocks per page
    blocks = pool.allocate(6)  # a full page and half of the next
    by_page: dict[int, list[int]] = {}
    for b in blocks:
        by_page.setdefault(page_of(pool, b), []).append(b)
    full, half = sorted(by_page, key=lambda p: -len(by_page[p]))
    assert pool.bytes_freed_by(by_page[full]) == P
    assert pool.bytes_freed_by(by_page[full] + by_page[half][:1]) == P  # the other half is in use
    assert pool.bytes_freed_by(blocks) == 2 * P
    pool.free(blocks)
    pool.close()


def test_allocation_prefers_the_most_utilized_partly_filled_page(make_ledger):
    pool = make_pool(make_ledger(budget_bytes=16 * P), 16 * KiB)  # 4 blocks per page
    ids = pool.allocate(8)  # pages 0 and 1 full
    assert sorted(page_of(pool, b) for b in ids) == [0] * 4 + [1] * 4
    on0 = [b for b in ids if page_of(pool, b) == 0]
    on1 = [b for b in ids if page_of(pool, b) == 1]
    pool.free(on0[:1] + on1[:2])  # page 0: 3 used, page 1: 2 used
    assert [page_of(pool, b) for b in pool.allocate(1)] == [0]
    assert [page_of(pool, b) for b in pool.allocate(2)] == [1, 1]
    assert pool.stats().mapped_pages == 2
    assert pool.stats().sync_maps == 2  # only the first two pages were ever mapped
    pool.close()


def test_empty_pages_are_unmapped_and_their_bytes_return_to_the_ledger(make_ledger):
    ledger = make_ledger(budget_bytes=16 * P)
    pool = make_pool(ledger, 16 * KiB)
    ids = pool.allocate(12)
    assert pool.vrange.physical_bytes() == 3 * P == ledger.snapshot().used_bytes
    pool.free([b for b in ids if page_of(pool, b) != 1])
    assert pool.stats().mapped_pages == 1
    assert pool.vrange.physical_bytes() == P == ledger.snapshot().used_bytes
    pool.free([b for b in ids if page_of(pool, b) == 1])
    assert pool.vrange.physical_bytes() == 0 == ledger.snapshot().used_bytes
    pool.close()


def test_refusal_returns_none_and_keeps_nothing(make_ledger):
    ledger = make_ledger(budget_bytes=3 * P)
    other = ledger.account("other")
    assert other.try_reserve(P)
    pool = make_pool(ledger, 16 * KiB)
    first = pool.allocate(5)  # two pages
    assert first is not None
    assert pool.allocate(4) is None  # needs a third page of its own: the device is full
    assert pool.num_used_blocks == 5 and pool.stats().mapped_pages == 2
    assert ledger.snapshot().used_bytes == 3 * P
    assert pool.allocate(3) is not None  # what still fits on mapped pages is granted
    other.release(P)
    assert pool.allocate(4) is not None  # memory another engine gave back is usable at once
    pool.close()


def test_blocks_that_straddle_pages_need_every_page_they_touch(make_ledger):
    ledger = make_ledger(budget_bytes=16 * P)
    pool = make_pool(ledger, 40 * KiB)  # 1.6 blocks per page: most blocks straddle two pages
    view = pool.kv_tensor(torch.uint8).view(-1, 40 * KiB)
    ids = pool.allocate(10)
    for b in ids:
        assert all(pool.vrange.is_mapped(q) for q in pool._pages_of(b))
        view[b].fill_(b + 1)
    pool.free(ids[::2])
    for b in ids[1::2]:
        assert bool((view[b] == b + 1).all())
    pool.free(ids[1::2])
    assert pool.stats().mapped_pages == 0 and ledger.snapshot().used_bytes == 0
    pool.close()


def test_a_page_being_unmapped_makes_no_straddling_block_ready(make_ledger, monkeypatch):
    """The prefetch thread unmaps with the lock released; an allocation meanwhile may map the page
    below. A block straddling both pages must not become ready then: once the unmap lands it would
    be handed out over an unmapped page (a worker segfaulted writing one)."""
    ledger = make_ledger(budget_bytes=16 * P)
    pool = make_pool(ledger, 40 * KiB, buffer_max_pages=4)  # block 1 straddles pages 0 and 1
    pool.free(pool.allocate(3))  # blocks 0-2: pages 0 and 1 mapped, empty, kept
    pool._unmap_in_background(0)  # page 0 goes; page 1 stays, so nothing free is ready
    unmap = pool.vrange.unmap_page
    taken: list[int] = []

    def unmap_with_an_allocation_meanwhile(page: int) -> None:
        if page == 1 and not taken:
            taken.extend(pool.allocate(1))  # maps page 0 while page 1 is in flight
        unmap(page)

    monkeypatch.setattr(pool.vrange, "unmap_page", unmap_with_an_allocation_meanwhile)
    pool._unmap_in_background(1)
    assert taken == [0] and not pool.vrange.is_mapped(1)
    ids = []
    for _ in range(3):  # each handed out over mapped pages, and never twice
        ids += pool.allocate(1)
        b = ids[-1]
        assert all(pool.vrange.is_mapped(q) for q in pool._pages_of(b)), f"block {b} over an unmapped page"
    assert len(set(ids + taken)) == 4
    pool.free(ids + taken)
    pool.close()


def test_blocks_larger_than_a_page(make_ledger):
    ledger = make_ledger(budget_bytes=16 * P)
    pool = make_pool(ledger, 3 * P // 2)
    ids = pool.allocate(3)
    assert ids is not None and pool.stats().mapped_pages == 5  # 4.5 pages, rounded up
    pool.free(ids)
    assert pool.stats().mapped_pages == 0
    pool.close()


def test_double_free_and_foreign_ids_raise(make_ledger):
    pool = make_pool(make_ledger(budget_bytes=16 * P), 16 * KiB)
    ids = pool.allocate(2)
    pool.free(ids[:1])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(ids[:1])
    with pytest.raises(RuntimeError):
        pool.free([ids[1], ids[1]])
    with pytest.raises(RuntimeError):
        pool.free([10_000])
    pool.free(ids[1:])  # the failed calls changed nothing
    assert pool.num_used_blocks == 0
    pool.close()


def test_prefetch_thread_keeps_a_buffer_between_min_and_max(make_ledger):
    ledger = make_ledger(budget_bytes=64 * P)
    pool = make_pool(ledger, 16 * KiB, num_pages=64, prefetch=True, buffer_min_pages=2, buffer_max_pages=4)
    wait_for(lambda: pool.stats().empty_pages == 2)
    ids = pool.allocate(4)  # one page's worth from the buffer: no map on this thread
    st = pool.stats()
    assert st.sync_maps == 0 and st.blocks_without_map == 4
    wait_for(lambda: pool.stats().empty_pages >= 2)  # refilled in the background
    more = pool.allocate(40)
    pool.free(ids + more)
    wait_for(lambda: pool.stats().empty_pages == 4)  # trimmed back to the buffer's max
    assert ledger.snapshot().used_bytes == 4 * P == pool.vrange.physical_bytes()
    pool.close()
    assert ledger.snapshot().used_bytes == 0


def test_the_refill_target_grows_after_a_burst_and_decays_after(make_ledger):
    ledger = make_ledger(budget_bytes=64 * P)
    pool = make_pool(
        ledger,
        16 * KiB,
        num_pages=64,
        prefetch=True,
        buffer_min_pages=1,
        buffer_max_pages=8,
        buffer_decay_s=0.3,
    )
    wait_for(lambda: pool.stats().empty_pages == 1)
    burst = pool.allocate(12)  # three pages at once: the one-page buffer runs dry
    assert pool.stats().sync_maps > 0 and pool.stats().refill_target == 2
    wait_for(lambda: pool.stats().empty_pages == 2)
    burst += pool.allocate(12)
    assert pool.stats().refill_target == 4
    wait_for(lambda: pool.stats().empty_pages == 4)
    maps = pool.stats().sync_maps
    burst += pool.allocate(12)  # the same burst again: served from the grown buffer
    assert pool.stats().sync_maps == maps
    wait_for(lambda: pool.stats().refill_target == 1)  # no misses for a while: back to the minimum
    pool.free(burst)
    pool.close()


def test_shrinking_the_limit_waits_for_pages_to_empty(make_ledger):
    ledger = make_ledger(budget_bytes=64 * P)
    pool = make_pool(ledger, 16 * KiB, prefetch=True, buffer_min_pages=1, buffer_max_pages=2)
    ids = pool.allocate(16)  # 4 full pages
    pool.set_limit(2 * P)
    assert pool.vrange.mapped_bytes >= 4 * P  # live blocks are never taken away
    assert pool.allocate(pool.num_free_blocks + 1) is None
    pool.free(ids[:12])
    wait_for(lambda: pool.vrange.mapped_bytes <= 2 * P)
    assert ledger.snapshot().used_bytes <= 2 * P
    pool.set_limit(None)
    assert pool.allocate(20) is not None
    pool.close()


def test_a_limit_set_from_another_process_reaches_the_pool(make_ledger):
    ledger = make_ledger(budget_bytes=64 * P)
    pool = make_pool(ledger, 16 * KiB, name="target", prefetch=True, buffer_min_pages=2, buffer_max_pages=2)
    wait_for(lambda: pool.stats().empty_pages == 2)
    other_view = DeviceLedger("cpu:0", namespace=None)  # e.g. `prism memory --set-limit`
    other_view.set_limit(other_view.find("target")[0], 0)
    other_view.close()
    wait_for(lambda: pool.stats().mapped_pages == 0)
    assert pool.allocate(1) is None
    pool.close()


class PoolMachine(RuleBasedStateMachine):
    """Random alloc/free/trim/limit on one pool against a second engine on the same ledger."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger: DeviceLedger | None = None

    @initialize(
        block_kib=st.sampled_from([16, 24, 40, 64, 100]),
        budget_pages=st.integers(2, 12),
        buffer=st.integers(0, 2),
    )
    def setup(self, block_kib, budget_pages, buffer):
        PoolMachine.examples += 1  # a fresh ledger per example: no state carried between examples
        self.ledger = DeviceLedger(f"cpu:{PoolMachine.examples}", budget_pages * P, namespace=self.ns)
        self.budget = budget_pages * P
        self.pool = make_pool(self.ledger, block_kib * KiB, num_pages=16, buffer_max_pages=buffer)
        self.view = self.pool.kv_tensor(torch.uint8).view(-1, block_kib * KiB)
        self.other = self.ledger.account("other")
        self.other_held = 0
        self.held: set[int] = set()

    @rule(n=st.integers(1, 8))
    def alloc(self, n):
        free_before = self.ledger.snapshot().free_bytes
        ids = self.pool.allocate(n)
        if ids is None:
            # Refused only if the missing pages really did not fit: n blocks need at most this much.
            worst = n * (-(-self.pool.block_bytes // P) + 1) * P
            assert free_before < worst or self.pool.num_used_blocks + n > self.pool.num_total_blocks
            return
        assert len(set(ids)) == n and not self.held & set(ids)
        for b in ids:
            self.view[b, ::997].fill_(b % 251)
        self.held.update(ids)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        for b in ids:
            assert bool((self.view[b, ::997] == b % 251).all()), f"block {b} lost its data"
        self.pool.free(ids)
        self.held.difference_update(ids)

    @rule(pages=st.integers(0, 3))
    def other_engine_grabs(self, pages):
        if self.other.try_reserve(pages * P):
            self.other_held += pages * P

    @precondition(lambda self: self.other_held)
    @rule()
    def other_engine_releases(self):
        self.other.release(self.other_held)
        self.other_held = 0

    @rule()
    def trim(self):
        self.pool.trim(0)
        assert self.pool.stats().empty_pages == 0

    @invariant()
    def accounting_matches_reality(self):
        if self.ledger is None:
            return
        snap = self.ledger.snapshot()
        assert snap.used_bytes <= self.budget
        mine = next(e for e in snap.entries if e.name == "e").mapped_bytes
        assert mine == self.pool.vrange.mapped_bytes == self.pool.vrange.physical_bytes()
        for b in self.held:
            assert all(self.pool.vrange.is_mapped(q) for q in self.pool._pages_of(b))
        assert self.pool.num_used_blocks == len(self.held)
        assert self.pool.stats().empty_pages <= self.pool.config.buffer_max_pages

    def teardown(self):
        if self.ledger is None:
            return
        self.pool.free(sorted(self.held))
        self.pool.trim(0)
        assert self.pool.vrange.physical_bytes() == 0  # no page leaked
        assert self.ledger.snapshot().used_bytes == self.other_held
        self.pool.close()
        self.pool.vrange.close()
        self.ledger.unlink()
        self.ledger.close()


def test_pool_state_machine(namespace):
    PoolMachine.ns = namespace
    PoolMachine.examples = 0
    PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    PoolMachine.TestCase().runTest()


def test_emptied_pages_linger_then_age_out(make_ledger):
    """Pages emptied beyond the buffer stay mapped for linger_s (a next batch reuses them with no
    map), the newest emptied first, then go back to the ledger."""
    ledger = make_ledger(budget_bytes=64 * P)
    pool = make_pool(ledger, 16 * KiB, num_pages=64, prefetch=True, buffer_min_pages=1,
                     buffer_max_pages=2, linger_s=1.5)  # fmt: skip
    ids = pool.allocate(40)  # 10 pages
    pool.free(ids)
    time.sleep(0.3)  # several poll rounds: nothing unmapped yet
    assert pool.stats().mapped_pages >= 10 and pool.stats().unmaps == 0
    maps = pool.stats().sync_maps + pool.stats().prefetch_maps
    again = pool.allocate(8)  # two pages' worth, from lingering pages
    assert pool.stats().sync_maps + pool.stats().prefetch_maps == maps
    wait_for(lambda: pool.stats().empty_pages == 2)  # the rest aged out, down to the buffer's max
    assert ledger.snapshot().used_bytes == pool.vrange.mapped_bytes == (2 + 2) * P
    pool.free(again)
    pool.close()
    assert ledger.snapshot().used_bytes == 0


def test_lingering_pages_go_back_when_another_grant_is_refused(make_ledger):
    ledger = make_ledger(budget_bytes=16 * P)
    pool = make_pool(ledger, 16 * KiB, num_pages=16, prefetch=True, buffer_min_pages=1,
                     buffer_max_pages=2, linger_s=3600.0)  # fmt: skip
    pool.free(pool.allocate(40))  # 10 pages lingering, 6 free on the device
    other = ledger.account("neighbour")
    assert not other.try_reserve(8 * P, reclaim=False)  # asks nobody (spare pages made ahead)
    time.sleep(0.3)
    assert ledger.snapshot().refused_at == 0 and pool.stats().mapped_pages >= 10
    assert not other.try_reserve(8 * P)  # refused: the ledger notes it
    assert time.time() - ledger.snapshot().refused_at < 5
    wait_for(lambda: pool.stats().mapped_pages <= 1)  # lingering and buffer gone to the minimum
    assert other.try_reserve(8 * P)
    other.release(8 * P)
    pool.close()


def test_the_prefetch_thread_maps_a_batch_with_one_grant(make_ledger):
    ledger = make_ledger(budget_bytes=64 * P)
    pool = make_pool(ledger, 16 * KiB, num_pages=64, prefetch=True, buffer_min_pages=12, buffer_max_pages=12)
    wait_for(lambda: pool.stats().empty_pages == 12)
    ops = ledger.snapshot()  # every page is granted and counted
    assert ops.used_bytes == 12 * P == pool.vrange.physical_bytes()
    assert pool.stats().prefetch_maps == 12
    ids = pool.allocate(48)  # the whole buffer, every block writable
    pool.kv_tensor(torch.uint8)[: 48 * 16 * KiB].fill_(3)
    pool.free(ids)
    pool.close()
    assert ledger.snapshot().used_bytes == 0


def test_a_range_whose_base_must_stay_mapped_keeps_block_0_mapped(make_ledger, monkeypatch):
    """CUDA ranges (Triton checks kernel pointers with the driver): block 0's page is mapped from
    the start and never unmapped, whatever empties; a pool with no room for it is an error that
    leaves nothing in the ledger."""
    monkeypatch.setattr(HostVirtualRange, "base_must_be_mapped", True)
    ledger = make_ledger(budget_bytes=16 * P)
    pool = make_pool(ledger, 16 * KiB, num_pages=16)
    assert pool.vrange.is_mapped(0) and ledger.snapshot().used_bytes == P
    ids = pool.allocate(12)
    assert pool.stats().mapped_pages == 3
    pool.free(ids)  # no buffer: every emptied page goes back, but page 0 stays
    assert pool.trim(0) == 0 and pool.stats().mapped_pages == 1 and pool.vrange.is_mapped(0)
    assert pool.stats().empty_pages == 0 and pool.num_free_blocks >= 4
    pool.close()
    assert ledger.snapshot().used_bytes == 0
    full = make_ledger("cpu:1", budget_bytes=0)
    with pytest.raises(LedgerError):
        ElasticKVPool.create(16 * KiB, 16 * P, "no-room", PoolConfig(device="cpu:1", page_size=P))
    assert full.snapshot().entries == ()


def test_a_gpu_pool_keeps_a_larger_buffer_unless_told_otherwise():
    assert PoolConfig().buffer_max_pages == 8
    assert PoolConfig().linger_s == 0 and PoolConfig(device="cuda:0").linger_s == GPU_LINGER_S
    assert PoolConfig(device="cuda:1").buffer_max_pages == GPU_BUFFER_MAX_PAGES
    assert PoolConfig(device="cuda:0", buffer_max_pages=4).buffer_max_pages == 4
    with pytest.raises(InvalidRequestError):
        PoolConfig(device="cuda:0", buffer_min_pages=80)


def test_a_fixed_pool_maps_every_block_at_once_and_gives_them_back_at_close(make_ledger):
    """A tensor parallel rank's KV: all its blocks granted at creation, each page mapped when a
    block on it is first allocated, never refused whatever the device's other engines do, and
    every byte back at close."""
    ledger = make_ledger(budget_bytes=8 * P)
    vrange = HostVirtualRange("cpu:0", 16 * P, P)
    pool = FixedKVPool(vrange, 24 * KiB, 10, ledger.account("tp rank kv"))  # 240 KiB: 4 pages
    assert isinstance(pool, BlockAllocator)
    assert ledger.snapshot().used_bytes == 4 * P and vrange.mapped_bytes == 0
    assert pool.num_total_blocks == 10 and pool.num_free_blocks == 10
    other = ledger.account("neighbour")
    assert other.try_reserve(4 * P) and not other.try_reserve(1)  # the device is full now
    first = pool.allocate(3)  # blocks 0-2: 72 KiB, on pages 0 and 1
    assert sorted(first) == [0, 1, 2] and vrange.mapped_bytes == 2 * P
    blocks = first + pool.allocate(7)
    assert sorted(blocks) == list(range(10)) and pool.allocate(1) is None and pool.num_used_blocks == 10
    assert vrange.mapped_bytes == 4 * P
    pool.kv_tensor(torch.float32)[:] = 1.0  # every block's bytes are mapped
    pool.free(blocks[:3])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])  # twice
    assert pool.allocate(3) is not None
    pool.close()
    assert vrange.mapped_bytes == 0 and ledger.snapshot().used_bytes == 4 * P  # the neighbour's only
    with pytest.raises(DeviceMemoryExhaustedError):  # 5 pages with 4 free: refused, nothing kept
        FixedKVPool(vrange, P, 5, ledger.account("too big"))
    assert vrange.mapped_bytes == 0 and ledger.snapshot().used_bytes == 4 * P
    vrange.close()


def test_a_refused_allocation_asks_spare_memory_for_all_it_lacks(make_ledger):
    """Spare pages (another worker's, kept for its next activation) hold the device's free budget:
    a refused allocation of many blocks asks their holder for the bytes of every block it lacks,
    not for the one page it was refused, so one round of giving back lets the retry through."""
    ledger = make_ledger(budget_bytes=16 * P)
    spare = ledger.account("w1 spare", spare=True)
    assert spare.try_reserve(12 * P)
    pool = make_pool(ledger, 16 * KiB)  # 4 blocks a page; block 0's page is mapped at creation
    assert pool.allocate(24) is None  # 6 pages: the budget has 3 free
    wanted = ledger.snapshot().reclaim_bytes
    assert wanted >= 2 * P  # what the allocation lacked beyond the 3 free pages, not one page
    spare.release(wanted)  # the holder gives back what was asked, in one round
    assert pool.allocate(24) is not None
    assert ledger.snapshot().used_bytes <= 16 * P
    pool.close()
    spare.close()


def test_a_refusal_by_the_engines_own_limit_asks_nobody(make_ledger):
    ledger = make_ledger(budget_bytes=16 * P)
    spare = ledger.account("w1 spare", spare=True)
    assert spare.try_reserve(12 * P)
    pool = make_pool(ledger, 16 * KiB, limit_bytes=2 * P)
    assert pool.allocate(24) is None
    assert ledger.snapshot().reclaim_bytes == 0
    pool.close()
    spare.close()


def test_a_refusal_by_a_full_range_asks_nobody(make_ledger):
    ledger = make_ledger(budget_bytes=12 * P)  # the pool's 4 pages and the spare ones fill it
    spare = ledger.account("w1 spare", spare=True)
    assert spare.try_reserve(8 * P)
    pool = make_pool(ledger, 16 * KiB, num_pages=4)  # 16 blocks at most, whatever the device has
    assert pool.allocate(20) is None
    assert ledger.snapshot().reclaim_bytes == 0
    pool.close()
    spare.close()
