"""Putting a model's weights on a device: grant and map its pages, then copy the host cache into
them in parallel chunks (per tensor, split into ``chunk_bytes`` pieces, several threads).

On the host backend a chunk is one ``memmove`` (ctypes releases the GIL, so threads copy at the
same time); on CUDA it is a ``copy_`` from the pinned/shared host bytes on the thread's own stream.
The paper streams per-tensor chunks the same way to keep the interconnect busy (section 5.2).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from prism_serve.memory.ledger import Account, DeviceMemoryExhaustedError
from prism_serve.memory.spare import SparePages, grant_waiting
from prism_serve.memory.vmm import VirtualRange
from prism_serve.runtime.messages import TensorEntry

# Threads a worker copies weights and maps pages with (the pool starts every worker with this many).
LOAD_THREADS = 4


def map_weight_pages(
    vrange: VirtualRange,
    account: Account,
    num_bytes: int,
    pool: ThreadPoolExecutor,
    spare: SparePages | None = None,
) -> tuple[int, int]:
    """Pages ``0..n-1`` of ``vrange`` for ``num_bytes`` of weights, their bytes held by ``account``:
    spare pages already mapped there are taken in place, the others granted in one ledger operation
    (waiting briefly for other workers' spare pages if the budget is short) and mapped in parallel.
    Returns (pages, pages reused); on any failure nothing stays mapped or granted."""
    page = vrange.page_size
    num_pages = -(-num_bytes // page)
    if num_pages * page > vrange.size:
        raise DeviceMemoryExhaustedError(
            f"weights need {num_pages * page} bytes of address space; the worker reserved {vrange.size}"
        )
    reused, missing = spare.take(num_pages, account) if spare else (0, list(range(num_pages)))
    if missing and not grant_waiting(account, len(missing) * page):
        if spare is not None:
            spare.give_back(num_pages, account)  # the pages it took go back to the spare set
        raise DeviceMemoryExhaustedError(
            f"the {vrange.device} ledger cannot grant {len(missing) * page} bytes for weights now"
        )
    try:
        list(pool.map(vrange.map_page, missing))
    except BaseException:
        for p in missing:  # the pages this call granted: all of them go, mapped or not
            if vrange.is_mapped(p):
                vrange.unmap_page(p)
        account.release(len(missing) * page)
        if spare is not None:
            spare.give_back(num_pages, account)
        raise
    return num_pages, reused


def unmap_weight_pages(
    vrange: VirtualRange, account: Account, num_pages: int, spare: SparePages | None = None
) -> None:
    """The model's pages ``0..num_pages-1`` (all mapped, ``account`` holds their bytes) leave it:
    kept as spare pages where ``spare`` wants them, the others unmapped and their bytes released."""
    if spare is not None:
        spare.give_back(num_pages, account)
        return
    for p in range(num_pages):
        if vrange.is_mapped(p):
            vrange.unmap_page(p)
    account.release(num_pages * vrange.page_size)


def chunks(entries: Iterable[TensorEntry], chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) pieces: every tensor split into pieces of at most ``chunk_bytes``."""
    out = []
    for e in entries:
        for start in range(0, e.nbytes, chunk_bytes):
            out.append((e.offset + start, min(chunk_bytes, e.nbytes - start)))
    return out


def parallel_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    entries: Iterable[TensorEntry],
    pool: ThreadPoolExecutor,
    chunk_bytes: int,
) -> int:
    """Copy every entry's bytes from ``src`` to the same offsets of ``dst`` (both flat uint8);
    returns the bytes copied."""
    pieces = chunks(entries, chunk_bytes)
    if dst.device.type == "cpu":
        s, d = src.data_ptr(), dst.data_ptr()

        def copy(piece: tuple[int, int]) -> None:
            off, n = piece
            ctypes.memmove(d + off, s + off, n)
    else:  # CUDA: a stream per copying thread, so that chunks overlap on the link
        streams = threading.local()

        def copy(piece: tuple[int, int]) -> None:
            off, n = piece
            stream = getattr(streams, "stream", None)
            if stream is None:
                stream = streams.stream = torch.cuda.Stream(dst.device)
            with torch.cuda.stream(stream):
                dst[off : off + n].copy_(src[off : off + n], non_blocking=True)
            stream.synchronize()

    list(pool.map(copy, pieces))
    return sum(n for _, n in pieces)


def tensor_views(flat: torch.Tensor, entries: Iterable[TensorEntry]) -> dict[str, torch.Tensor]:
    """Typed views of ``flat`` (uint8) at each entry's offset: the model computes on these."""
    out = {}
    for e in entries:
        dtype = getattr(torch, e.dtype)
        out[e.name] = flat[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape)
    return out
