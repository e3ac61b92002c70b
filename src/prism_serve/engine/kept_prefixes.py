"""Cached prefixes that outlive their engine: when a model's engine goes, the KV of its hottest
prefix-cached blocks is written to a file in host memory, and the next engine of the model reads
it back into its own prefix cache before it serves anything, so the system prompts a returning
model needs first are hits.

What goes is ``PrefixCache.hottest``'s list: blocks of the base model's chains that requests have
hit, most hits first, then those in use, then the most recently used, then those not hit yet while
the model's returns show them asked for again, each after its parent, so every leading part of the
file is whole prefixes and a restore that gets fewer blocks than the file holds keeps the most
useful ones. Each block's hit count goes with it, so a block the next engine does not hit before
the model goes again is kept again on its earlier hits.

The file: ``MAGIC``, the header's length (8 bytes, little-endian), the header (MessagePack,
``KeptHeader``), zeros up to a 4 KiB boundary, then each listed block's KV bytes (one block's
bytes across all layers are contiguous, engine/kv_cache.py) in the header's order. Its header names
what the KV was computed with (``fingerprint``: the weights, dtype and block size), and a restore
into an engine with another fingerprint or block size takes nothing. The file takes its memory
when created (``posix_fallocate``): a host without room writes nothing, never a SIGBUS.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import struct
from pathlib import Path

import msgspec
import torch

from prism_serve.engine.kv_cache import KVCache
from prism_serve.engine.prefix_cache import PrefixCache

__all__ = ["KeptHeader", "read_header", "restore_prefixes", "save_prefixes"]

MAGIC = b"PRISMKV1"
_ALIGN = 4096
_MADV_POPULATE_READ = 22  # Linux 5.14+ (mmap lacks the name)

logger = logging.getLogger(__name__)


class KeptHeader(msgspec.Struct, frozen=True):
    fingerprint: str  # what the KV was computed with (the caller's: weights, dtype, block size)
    block_bytes: int
    keys: list[bytes]  # each block's prefix-cache key, in file order
    parents: list[bytes]  # the key each is chained on (b"": a first block of the base model)
    hits: list[int] = []  # how many times requests had found each cached (PrefixCache.hits_of)


def _block_rows(kv: KVCache) -> torch.Tensor:
    """The KV tensor as one row of bytes per block."""
    return kv.tensor.view(kv.tensor.shape[0], -1).view(torch.uint8)


def _data_offset(header: bytes) -> int:
    return -(-(len(MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN


def save_prefixes(cache: PrefixCache, kv: KVCache, path: str | Path, max_bytes: int, fingerprint: str) -> int:
    """Write the hottest cached blocks that fit in ``max_bytes`` (header included) to a new file at
    ``path``; returns the file's size, 0 when nothing was written (nothing cached, no room in the
    budget or on the host: then no file exists)."""
    rows = _block_rows(kv)
    block_bytes = rows.shape[1]
    chosen = cache.hottest(max(0, (max_bytes - _ALIGN) // block_bytes))
    n = len(chosen)
    while n:
        part = chosen[:n]
        keys, parents = [k for _, k, _ in part], [p for _, _, p in part]
        header = msgspec.msgpack.encode(
            KeptHeader(fingerprint, block_bytes, keys, parents, [cache.hits_of(b) for b, _, _ in part])
        )
        over = _data_offset(header) + n * block_bytes - max_bytes
        if over <= 0:
            break
        n -= max(1, -(-over // block_bytes))  # the header took more than the page set aside
    if n <= 0:
        return 0
    chosen = chosen[:n]
    offset = _data_offset(header)
    size = offset + len(chosen) * block_bytes
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise
            logger.warning("no room in host memory for %d bytes of cached prefixes: %s", size, e.strerror)
            Path(path).unlink(missing_ok=True)
            return 0
        with mmap.mmap(fd, size) as mm:
            mm[: len(MAGIC) + 8 + len(header)] = MAGIC + struct.pack("<Q", len(header)) + header
            data = torch.frombuffer(mm, dtype=torch.uint8, offset=offset, count=size - offset)
            data = data.view(len(chosen), block_bytes)
            for i, (b, _, _) in enumerate(chosen):  # a block's bytes are contiguous: one memcpy each
                data[i].copy_(rows[b])
            del data
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return size


def read_header(buf: bytes | mmap.mmap) -> tuple[KeptHeader, int]:
    """A kept-prefix file's header and where its blocks start; ValueError if it is not one whole."""
    if len(buf) < len(MAGIC) + 8 or buf[: len(MAGIC)] != MAGIC:
        raise ValueError("not a kept-prefix file")
    (length,) = struct.unpack("<Q", buf[len(MAGIC) : len(MAGIC) + 8])
    raw = buf[len(MAGIC) + 8 : len(MAGIC) + 8 + length]
    header = msgspec.msgpack.decode(raw, type=KeptHeader)
    offset = _data_offset(raw)
    if len(header.keys) != len(header.parents) or len(buf) < offset + len(header.keys) * header.block_bytes:
        raise ValueError("a kept-prefix file cut short")
    return header, offset


def restore_prefixes(cache: PrefixCache, kv: KVCache, path: str | Path, fingerprint: str) -> int:
    """Read a file ``save_prefixes`` wrote into ``cache`` (an engine's, of the same fingerprint) as
    cached, unheld blocks, as many as its allocator grants now; returns how many. A file of another
    fingerprint or block size, or not one at all, restores nothing (logged)."""
    rows = _block_rows(kv)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        with contextlib.suppress(OSError, ValueError):  # page tables at once, not a fault per page
            mm.madvise(_MADV_POPULATE_READ)
        try:
            header, offset = read_header(mm)
        except (ValueError, msgspec.DecodeError) as e:
            logger.warning("cached prefixes in %s not restored: %s", path, e)
            return 0
        if header.fingerprint != fingerprint or header.block_bytes != rows.shape[1]:
            logger.warning("cached prefixes in %s are of another engine; not restored", path)
            return 0
        taken = cache.adopt(header.keys, header.parents, header.hits)
        if not taken:
            return 0
        n = len(header.keys)
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=offset, count=n * header.block_bytes)
        data = data.view(n, header.block_bytes)
        for e, b in taken:  # one memcpy each (index_copy_ of bytes runs element by element)
            rows[b].copy_(data[e])
        del data
    return len(taken)
