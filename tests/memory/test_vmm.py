from __future__ import annotations

import os

import pytest
import torch

from prism_serve.errors import InvalidRequestError
from prism_serve.memory.vmm import (
    DEFAULT_PAGE_SIZE,
    CudaVirtualRange,
    HostVirtualRange,
    MemoryBackendError,
    _runs,
    format_size,
    parse_size,
    reserve,
)

MiB = 2**20


def rss_shmem() -> int:
    """Shared-memory resident bytes of this process (memfd pages count here)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssShmem in /proc/self/status")


def test_reservation_costs_no_memory_and_mapping_does():
    with reserve("cpu:0", 64 * 2**30) as r:  # 64 GiB of address space
        assert isinstance(r, HostVirtualRange)
        assert r.page_size == DEFAULT_PAGE_SIZE and r.num_pages == 32768
        assert r.physical_bytes() == 0 and r.num_mapped_pages == 0
        for p in (0, 3, 32767):
            r.map_page(p)
        assert r.physical_bytes() == 3 * DEFAULT_PAGE_SIZE == r.mapped_bytes


def test_unmapping_returns_memory_to_the_os():
    with reserve("cpu:0", 256 * MiB) as r:
        t = r.as_tensor()
        base_rss = rss_shmem()
        for p in range(32):  # 64 MiB
            r.map_page(p)
        t[: 64 * MiB].fill_(1)
        assert r.physical_bytes() == 64 * MiB
        assert rss_shmem() - base_rss >= 60 * MiB
        for p in range(32):
            r.unmap_page(p)
        assert r.physical_bytes() == 0
        assert rss_shmem() - base_rss <= 4 * MiB


def test_data_survives_unrelated_map_and_unmap_and_the_address_is_stable():
    with reserve("cpu:0", 64 * MiB, page_size=MiB) as r:
        t = r.as_tensor()
        addr = t.data_ptr()
        assert addr == r.address
        kept = [1, 5, 9]
        for p in kept:
            r.map_page(p)
            t[p * MiB : (p + 1) * MiB].view(torch.int32).fill_(1000 + p)
        for round_ in range(5):  # churn the pages in between and around
            others = [p for p in range(16) if p not in kept]
            for p in others:
                r.map_page(p)
                t[p * MiB : (p + 1) * MiB].fill_(round_)
            for p in others:
                r.unmap_page(p)
        assert r.as_tensor().data_ptr() == addr
        for p in kept:
            assert bool((t[p * MiB : (p + 1) * MiB].view(torch.int32) == 1000 + p).all())


def test_a_remapped_page_is_fresh_memory():
    with reserve("cpu:0", 4 * MiB, page_size=MiB) as r:
        t = r.as_tensor()
        r.map_page(2)
        t[2 * MiB : 3 * MiB].fill_(9)
        r.unmap_page(2)
        r.map_page(2)
        assert int(t[2 * MiB : 3 * MiB].sum()) == 0


def test_misuse_raises_named_errors():
    with pytest.raises(InvalidRequestError):
        reserve("cpu:0", MiB, page_size=3 * 4096)
    with pytest.raises(InvalidRequestError):
        reserve("cpu:0", 0)
    with pytest.raises(InvalidRequestError):
        reserve("tpu:0", MiB)
    r = reserve("cpu:0", 4 * MiB, page_size=MiB)
    r.map_page(0)
    with pytest.raises(MemoryBackendError, match="already mapped"):
        r.map_page(0)
    with pytest.raises(MemoryBackendError, match="not mapped"):
        r.unmap_page(1)
    with pytest.raises(MemoryBackendError, match="outside"):
        r.map_page(4)
    r.close()
    with pytest.raises(MemoryBackendError, match="closed"):
        r.map_page(1)
    r.close()  # idempotent


def test_close_gives_everything_back():
    r = reserve("cpu:0", 16 * MiB, page_size=MiB)
    fd = r._fd
    for p in range(8):
        r.map_page(p)
    r.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # the memfd, and with it the physical pool, is gone


def test_phase_timings_are_recorded_when_asked():
    with reserve("cpu:0", 8 * MiB, page_size=MiB) as r:
        r.map_page(0)
        assert not r.phase_ns
        r.record_phases = True
        r.map_page(1)
        r.unmap_page(1)
        assert {k: len(v) for k, v in r.phase_ns.items()} == {"create": 1, "map": 1, "unmap": 1, "release": 1}


@pytest.mark.parametrize(
    ("text", "expected"),
    [(123, 123), ("512MiB", 512 * MiB), ("2 GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("64k", 64_000)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_garbage_and_format_size_reads_back():
    for bad in ("lots", "-1", "5 XB", -3):
        with pytest.raises(InvalidRequestError):
            parse_size(bad)
    assert format_size(1536) == "1.5 KiB" and format_size(3 * 2**30) == "3.0 GiB" and format_size(7) == "7 B"


def test_map_pages_maps_all_or_none():
    with reserve("cpu:0", 8 * DEFAULT_PAGE_SIZE) as r:
        r.map_page(5)
        with pytest.raises(MemoryBackendError):
            r.map_pages([1, 2, 5])  # one is mapped already: none is mapped
        assert r.num_mapped_pages == 1 and not r.is_mapped(1)
        r.map_pages([0, 1, 2, 6])
        assert r.num_mapped_pages == 5 and r.physical_bytes() == 5 * DEFAULT_PAGE_SIZE
        r.as_tensor()[: 3 * DEFAULT_PAGE_SIZE].fill_(9)
        assert int(r.as_tensor()[: 3 * DEFAULT_PAGE_SIZE].sum()) == 9 * 3 * DEFAULT_PAGE_SIZE


def test_runs_of_neighbouring_pages():
    assert _runs([]) == [] and _runs([4]) == [(4, 1)]
    assert _runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 2), (9, 1)]


@pytest.mark.gpu
def test_cuda_map_pages_opens_every_page_of_each_run():
    """One cuMemSetAccess per run of neighbours: every page of two runs reads and writes, and a
    page unmapped from the middle of a run leaves its neighbours intact."""
    with reserve("cuda:0", 64 * MiB) as r:
        t = r.as_tensor()
        r.map_pages([3, 4, 5, 9, 10])
        for page in (3, 4, 5, 9, 10):
            t[page * DEFAULT_PAGE_SIZE : (page + 1) * DEFAULT_PAGE_SIZE].fill_(page)
        r.unmap_page(4)
        for page in (3, 5, 9, 10):
            chunk = t[page * DEFAULT_PAGE_SIZE : (page + 1) * DEFAULT_PAGE_SIZE]
            assert int(chunk.min()) == int(chunk.max()) == page
        assert r.physical_bytes() == 4 * DEFAULT_PAGE_SIZE


@pytest.mark.gpu
def test_cuda_range_maps_reads_and_writes_across_unrelated_unmaps():
    with reserve("cuda:0", 64 * MiB) as r:
        assert isinstance(r, CudaVirtualRange)
        t = r.as_tensor()
        assert t.device.type == "cuda" and t.data_ptr() == r.address
        r.map_page(0)
        r.map_page(3)
        t[: 2 * MiB].fill_(7)
        r.map_page(1)
        r.unmap_page(1)
        assert int(t[: 2 * MiB].float().mean().item()) == 7
        assert r.physical_bytes() == 2 * DEFAULT_PAGE_SIZE
