"""StridedKVPages: pages on demand under a layer-by-layer KV buffer (vLLM's layout), on real host
pages and a real device ledger."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism_serve.memory.strided_kv import StridedKVPages
from prism_serve.memory.vmm import HostVirtualRange

KiB = 1024
P = 64 * KiB


def make(ledger, layers: int = 3, layer_stride: int = 5 * P + 8 * KiB, block_stride: int = 24 * KiB,
         blocks: int = 13, pages: int = 20, limit: int | None = None) -> StridedKVPages:  # fmt: skip
    vrange = HostVirtualRange("cpu:0", pages * P, P)
    kv = StridedKVPages(vrange, layers, layer_stride, block_stride, blocks)
    kv.attach(ledger.account("m kv", limit))
    return kv


def entry_bytes(ledger) -> int:
    return sum(e.mapped_bytes for e in ledger.snapshot().entries)


def test_blocks_below_the_watermark_are_usable_in_every_layer(make_ledger):
    ledger = make_ledger(budget_bytes=64 * P)
    kv = make(ledger)
    assert kv.resize(4)
    flat = kv.vrange.as_tensor()
    for layer in range(kv.num_layers):
        for b in range(4):  # every byte of the block is writable and keeps what was written
            start = layer * kv.layer_stride + b * kv.block_stride
            flat[start : start + kv.block_stride].fill_(layer * 16 + b + 1)
    for layer in range(kv.num_layers):
        for b in range(4):
            start = layer * kv.layer_stride + b * kv.block_stride
            assert torch.all(flat[start : start + kv.block_stride] == layer * 16 + b + 1)
    assert entry_bytes(ledger) == kv.mapped_bytes == len(kv.mapped) * P
    kv.close()
    assert entry_bytes(ledger) == 0 and kv.vrange.num_mapped_pages == 0


def test_a_page_shared_by_two_layers_is_mapped_and_granted_once(make_ledger):
    ledger = make_ledger(budget_bytes=64 * P)
    # layer 0's blocks end inside page 1, where layer 1 starts
    kv = make(ledger, layers=2, layer_stride=P + 32 * KiB, block_stride=16 * KiB, blocks=6)
    assert kv.resize(6)
    assert kv.pages_for(6) == {0, 1, 2} and kv.mapped == {0, 1, 2}
    assert entry_bytes(ledger) == 3 * P
    kv.close()


def test_a_refused_grant_changes_nothing(make_ledger):
    ledger = make_ledger(budget_bytes=64 * P)
    kv = make(ledger, limit=6 * P)
    assert kv.resize(2)
    before = (set(kv.mapped), kv.watermark, entry_bytes(ledger))
    assert not kv.resize(13)  # all 13 blocks need more pages than the limit allows
    assert (set(kv.mapped), kv.watermark, entry_bytes(ledger)) == before
    reached = kv.grow_by_pages(13)  # as far as the limit goes
    assert 2 < reached < 13 and entry_bytes(ledger) <= 6 * P
    assert len(kv.pages_for(reached + 1)) * P > 6 * P  # it stopped where the next block would not fit
    kv.close()
    assert entry_bytes(ledger) == 0


def test_growth_into_memory_a_neighbour_gave_back(make_ledger):
    ledger = make_ledger(budget_bytes=20 * P)
    neighbour = ledger.account("neighbour")
    assert neighbour.try_reserve(17 * P)
    kv = make(ledger)
    assert kv.resize(1) and not kv.resize(13)  # 3 pages fit beside the neighbour, 16 do not
    neighbour.release(17 * P)
    assert kv.resize(13)
    assert ledger.snapshot().used_bytes <= ledger.budget_bytes
    kv.close()


def test_account_must_be_attached_and_cannot_change_under_mapped_pages(make_ledger):
    ledger = make_ledger(budget_bytes=64 * P)
    vrange = HostVirtualRange("cpu:0", 20 * P, P)
    kv = StridedKVPages(vrange, 2, 5 * P, 24 * KiB, 8)
    with pytest.raises(RuntimeError):
        kv.resize(1)
    kv.attach(ledger.account("a"))
    assert kv.resize(1)
    with pytest.raises(RuntimeError):
        kv.attach(ledger.account("b"))
    kv.close()
    kv.attach(ledger.account("b"))  # nothing mapped: another model's account may take over


def test_bad_geometry_is_refused():
    vrange = HostVirtualRange("cpu:0", 4 * P, P)
    with pytest.raises(ValueError):
        StridedKVPages(vrange, 2, P, 32 * KiB, 4)  # layers overlap
    with pytest.raises(ValueError):
        StridedKVPages(vrange, 2, 3 * P, 32 * KiB, 4)  # past the range's end
    vrange.close()


@pytest.fixture
def shared_account(make_ledger):
    return make_ledger("cpu:7", budget_bytes=64 * P).account("m kv")


# one ledger for every example: each example maps under its own range and gives everything back
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(watermarks=st.lists(st.integers(0, 13), min_size=1, max_size=12))
def test_any_sequence_of_resizes_keeps_pages_and_ledger_in_step(shared_account, watermarks):
    ledger = shared_account.ledger
    vrange = HostVirtualRange("cpu:7", 20 * P, P)
    kv = StridedKVPages(vrange, 3, 5 * P + 8 * KiB, 24 * KiB, 13)
    kv.attach(shared_account)
    try:
        for w in watermarks:
            assert kv.resize(w)
            assert kv.mapped == kv.pages_for(w)
            assert {p for p in range(kv.vrange.num_pages) if kv.vrange.is_mapped(p)} == kv.mapped
            assert entry_bytes(ledger) == len(kv.mapped) * P
    finally:
        kv.close()
        kv.vrange.close()
    assert entry_bytes(ledger) == 0


@settings(max_examples=100, deadline=None)
@given(
    layers=st.integers(1, 5),
    block_stride=st.integers(1, 3 * P),
    offset=st.integers(0, P),
    watermark=st.integers(0, 13),
)
def test_bytes_for_counts_the_pages_of_pages_for(layers, block_stride, offset, watermark):
    """What the vLLM engine tells the ledger its cached blocks hold: the bytes of the pages a
    watermark keeps, pages shared by two layers counted once."""
    vrange = HostVirtualRange("cpu:0", 256 * P, P)
    # a layer's blocks and a gap of a third of a block: layers end and start inside one page
    kv = StridedKVPages(vrange, layers, 13 * block_stride + block_stride // 3, block_stride, 13, offset)
    assert kv.bytes_for(watermark) == len(kv.pages_for(watermark)) * P
    vrange.close()
