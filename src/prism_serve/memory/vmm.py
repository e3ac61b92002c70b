"""Virtual memory backends: reserve an address range once, map physical pages into it on demand.

A ``VirtualRange`` is ``num_pages`` pages of ``page_size`` bytes at a fixed address. Pages are mapped
and unmapped one at a time, or mapped several at once (``map_pages``); the whole range is visible as one
torch tensor whose address never changes, so KV tensors built on it stay valid while physical
memory comes and goes. Touching an unmapped page is a fault (SIGSEGV on the host, an illegal
address on CUDA): callers only touch what they mapped, which is what the KV pool guarantees.

Each page goes through the phases of CUDA's VMM API, and the host backend mirrors them so both can be
timed the same way:

=============  =====================================  ==========================================
phase          host (memfd)                           cuda (driver API via cuda-bindings)
=============  =====================================  ==========================================
create         fallocate the page's memfd range       cuMemCreate (one physical allocation)
map            mmap MAP_FIXED|MAP_SHARED|MAP_POPULATE  cuMemMap at the page's address
set_access     (part of mmap's protection)             cuMemSetAccess read/write
unmap          mmap PROT_NONE anonymous over the page  cuMemUnmap
release        fallocate PUNCH_HOLE (memory to OS)     cuMemRelease
=============  =====================================  ==========================================

This module does no accounting; ``ledger.py`` decides whether a page may be mapped.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import TYPE_CHECKING

from prism_serve.errors import InvalidRequestError, PrismError

if TYPE_CHECKING:
    import torch

DEFAULT_PAGE_SIZE = 2 * 2**20  # CUDA's VMM granularity on current GPUs
PHASES = ("create", "map", "set_access", "unmap", "release")


class MemoryBackendError(PrismError):
    """A map/unmap/reserve call of the operating system or the CUDA driver failed."""

    status_code = 500
    error_type = "internal_error"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_size(value: int | str) -> int:
    """Bytes from ``123``, ``"512MiB"``, ``"2 GiB"``, ``"1.5GB"`` (GiB = 2**30, GB = 10**9)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidRequestError(f"size must be non-negative, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise InvalidRequestError(f"cannot parse size {value!r}; use bytes or e.g. '512MiB', '2GiB'")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    scale = 1024 ** ("kmgt".index(unit[0]) + 1) if "i" in unit else _UNITS[unit[:1]]
    return int(number * scale)


def format_size(num_bytes: int) -> str:
    """``1536 -> '1.5 KiB'``; for tables and error messages."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class VirtualRange(ABC):
    """A reserved virtual range of ``num_pages`` pages; subclasses back pages with physical memory."""

    device: str
    page_size: int
    num_pages: int
    # Whether the range's first page must stay mapped while tensors over it are used: Triton asks
    # the CUDA driver about each pointer a kernel gets, and an unmapped address fails the launch.
    base_must_be_mapped = False

    def __init__(self, device: str, num_bytes: int, page_size: int) -> None:
        if page_size <= 0 or page_size & (page_size - 1):
            raise InvalidRequestError(f"page_size must be a power of two, got {page_size}")
        if page_size % os.sysconf("SC_PAGE_SIZE"):
            raise InvalidRequestError(f"page_size must be a multiple of the OS page, got {page_size}")
        if num_bytes <= 0:
            raise InvalidRequestError(f"cannot reserve {num_bytes} bytes")
        self.device = device
        self.page_size = page_size
        self.num_pages = -(-num_bytes // page_size)
        self._mapped = bytearray(self.num_pages)
        self._num_mapped = 0
        # The KV pool's prefetch thread maps pages while the engine thread maps others.
        self._count_lock = threading.Lock()
        self._closed = False
        self._tensor: torch.Tensor | None = None
        # Phase timings in ns, filled only when record_phases is set (benchmarks).
        self.record_phases = False
        self.phase_ns: dict[str, list[int]] = defaultdict(list)

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    @property
    @abstractmethod
    def address(self) -> int:
        """Start of the reserved range (constant for the range's life)."""

    @property
    def num_mapped_pages(self) -> int:
        return self._num_mapped

    @property
    def mapped_bytes(self) -> int:
        return self._num_mapped * self.page_size

    def is_mapped(self, page: int) -> bool:
        return bool(self._mapped[page])

    def map_page(self, page: int) -> None:
        """Back ``page`` with fresh physical memory (contents unspecified) and make it read/write."""
        self._check(page)
        if self._mapped[page]:
            raise MemoryBackendError(f"page {page} of {self.device} is already mapped")
        self._map(page)
        with self._count_lock:
            self._mapped[page] = 1
            self._num_mapped += 1

    def map_pages(self, pages: list[int]) -> None:
        """Map several pages at once (all or none): like ``map_page`` for each, with the driver's
        per-range work done once per run of neighbouring pages where the backend allows it."""
        for page in pages:
            self._check(page)
            if self._mapped[page]:
                raise MemoryBackendError(f"page {page} of {self.device} is already mapped")
        if len(set(pages)) != len(pages):
            raise MemoryBackendError(f"pages {pages} named twice")
        self._map_many(pages)
        with self._count_lock:
            for page in pages:
                self._mapped[page] = 1
            self._num_mapped += len(pages)

    def _map_many(self, pages: list[int]) -> None:
        done: list[int] = []
        try:
            for page in pages:
                self._map(page)
                done.append(page)
        except BaseException:
            for page in done:
                self._unmap(page)
            raise

    def unmap_page(self, page: int) -> None:
        """Unmap ``page`` and give its physical memory back; its contents are lost."""
        self._check(page)
        if not self._mapped[page]:
            raise MemoryBackendError(f"page {page} of {self.device} is not mapped")
        self._unmap(page)
        with self._count_lock:
            self._mapped[page] = 0
            self._num_mapped -= 1

    def as_tensor(self) -> torch.Tensor:
        """The whole range as a flat uint8 tensor (same object every call; view it as KV or weights)."""
        if self._closed:
            raise MemoryBackendError(f"virtual range of {self.device} is closed")
        if self._tensor is None:
            self._tensor = self._make_tensor()
        return self._tensor

    def close(self) -> None:
        """Unmap every page and give the address range back. Tensors over it must not be used after."""
        if self._closed:
            return
        for page in range(self.num_pages):
            if self._mapped[page]:
                self.unmap_page(page)
        self._tensor = None
        self._free_range()
        self._closed = True

    def __enter__(self) -> VirtualRange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def physical_bytes(self) -> int:
        """Physical bytes backing the range right now, as the OS or driver reports them."""

    def _check(self, page: int) -> None:
        if self._closed:
            raise MemoryBackendError(f"virtual range of {self.device} is closed")
        if not 0 <= page < self.num_pages:
            raise MemoryBackendError(f"page {page} outside the range of {self.num_pages} pages")

    def _timed(self, phase: str, fn, *args):  # type: ignore[no-untyped-def]
        if not self.record_phases:
            return fn(*args)
        t0 = time.perf_counter_ns()
        out = fn(*args)
        self.phase_ns[phase].append(time.perf_counter_ns() - t0)
        return out

    @abstractmethod
    def _map(self, page: int) -> None: ...

    @abstractmethod
    def _unmap(self, page: int) -> None: ...

    @abstractmethod
    def _make_tensor(self) -> torch.Tensor: ...

    @abstractmethod
    def _free_range(self) -> None: ...


# ---- host backend ----------------------------------------------------------------------------------

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MAP_NORESERVE, _MAP_POPULATE = 0x4000, 0x8000
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


class HostVirtualRange(VirtualRange):
    """Host memory with real map/unmap: a memfd is the physical pool, an mmap PROT_NONE range the
    reservation. Page ``i`` is backed by the memfd bytes at ``i * page_size``; unmapping punches a
    hole in the memfd, so the memory goes back to the OS (RSS and the memfd's allocated size drop).
    """

    def __init__(self, device: str, num_bytes: int, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        super().__init__(device, num_bytes, page_size)
        self._libc = _libc()
        self._fd = os.memfd_create(f"prism-{device}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.size)  # sparse: no memory until a page is created
            addr = self._libc.mmap(
                None, self.size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0
            )
            if addr in (None, _MAP_FAILED):
                raise MemoryBackendError(f"reserving {format_size(self.size)}: {self._errno()}")
        except BaseException:
            os.close(self._fd)
            raise
        self._addr: int = addr

    @property
    def address(self) -> int:
        return self._addr

    def physical_bytes(self) -> int:
        return os.fstat(self._fd).st_blocks * 512

    def _errno(self) -> str:
        err = ctypes.get_errno()
        return f"{os.strerror(err)} (errno {err})"

    def _map(self, page: int) -> None:
        off = page * self.page_size
        if self._timed("create", self._libc.fallocate, self._fd, 0, off, self.page_size) != 0:
            raise MemoryBackendError(f"allocating page {page} of {self.device}: {self._errno()}")
        flags = _MAP_SHARED | _MAP_FIXED | _MAP_POPULATE
        addr = self._timed(
            "map",
            self._libc.mmap,
            self._addr + off,
            self.page_size,
            _PROT_READ | _PROT_WRITE,
            flags,
            self._fd,
            off,
        )
        if addr != self._addr + off:
            err = self._errno()
            self._libc.fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, off, self.page_size)
            raise MemoryBackendError(f"mapping page {page} of {self.device}: {err}")

    def _unmap(self, page: int) -> None:
        off = page * self.page_size
        # Replacing the page with a fresh PROT_NONE mapping keeps the reservation whole (munmap would
        # leave a hole another allocation could take).
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        addr = self._timed(
            "unmap", self._libc.mmap, self._addr + off, self.page_size, _PROT_NONE, flags, -1, 0
        )
        if addr != self._addr + off:
            raise MemoryBackendError(f"unmapping page {page} of {self.device}: {self._errno()}")
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        if self._timed("release", self._libc.fallocate, self._fd, mode, off, self.page_size) != 0:
            raise MemoryBackendError(f"releasing page {page} of {self.device}: {self._errno()}")

    def _make_tensor(self) -> torch.Tensor:
        import torch

        buf = (ctypes.c_ubyte * self.size).from_address(self._addr)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def _free_range(self) -> None:
        self._libc.munmap(self._addr, self.size)
        os.close(self._fd)


# ---- cuda backend ----------------------------------------------------------------------------------


class CudaVirtualRange(VirtualRange):
    """GPU memory through the CUDA driver's virtual memory management API (``cuda-bindings``).

    One physical allocation (``cuMemCreate``) per page, so any page can be released on its own.
    Verified on an H200 (docs/results.md, "On a GPU (H200)"); without a GPU its tests are skipped.
    """

    base_must_be_mapped = True

    def __init__(self, device: str, num_bytes: int, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise MemoryBackendError(
                "the cuda backend needs the cuda-bindings package: pip install 'prism-serve[cuda]'"
            ) from e
        super().__init__(device, num_bytes, page_size)
        self._drv = driver
        self._ordinal = int(device.split(":", 1)[1]) if ":" in device else 0
        self._call(driver.cuInit, 0)
        cu_device = self._call(driver.cuDeviceGet, self._ordinal)
        self._ctx = self._call(driver.cuDevicePrimaryCtxRetain, cu_device)
        self._cu_device = cu_device
        self._set_context()
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self._ordinal
        self._prop = prop
        granularity = self._call(
            driver.cuMemGetAllocationGranularity,
            prop,
            driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        if page_size % granularity:
            raise InvalidRequestError(
                f"page_size {page_size} is not a multiple of {device}'s granularity {granularity}"
            )
        access = driver.CUmemAccessDesc()
        access.location.type = prop.location.type
        access.location.id = self._ordinal
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self._base = self._call(driver.cuMemAddressReserve, self.size, page_size, 0, 0)
        self._handles: dict[int, object] = {}

    def _call(self, fn, *args):  # type: ignore[no-untyped-def]
        result = fn(*args)
        err, rest = result[0], result[1:]
        if err != self._drv.CUresult.CUDA_SUCCESS:
            _, name = self._drv.cuGetErrorString(err)
            raise MemoryBackendError(f"{fn.__name__} on {self.device} failed: {err!r} {name!r}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def _set_context(self) -> None:
        # Threads other than the one torch initialised (the pool's prefetch thread) have no current context.
        self._call(self._drv.cuCtxSetCurrent, self._ctx)

    @property
    def address(self) -> int:
        return int(self._base)

    def physical_bytes(self) -> int:
        return len(self._handles) * self.page_size

    def _ptr(self, page: int):  # type: ignore[no-untyped-def]
        return self._drv.CUdeviceptr(int(self._base) + page * self.page_size)

    def _map(self, page: int) -> None:
        self._set_context()
        handle = self._timed("create", self._call, self._drv.cuMemCreate, self.page_size, self._prop, 0)
        try:
            self._timed("map", self._call, self._drv.cuMemMap, self._ptr(page), self.page_size, 0, handle, 0)
            try:
                self._timed(
                    "set_access",
                    self._call,
                    self._drv.cuMemSetAccess,
                    self._ptr(page),
                    self.page_size,
                    [self._access],
                    1,
                )
            except MemoryBackendError:
                self._call(self._drv.cuMemUnmap, self._ptr(page), self.page_size)
                raise
        except MemoryBackendError:
            self._call(self._drv.cuMemRelease, handle)
            raise
        self._handles[page] = handle

    def _map_many(self, pages: list[int]) -> None:
        """Create and map every page, then open each run of neighbouring pages for reading and
        writing with one ``cuMemSetAccess``. On an H200 this cost the same per page as one call
        per page (45.9 against 45.7 us): the driver's work scales with the bytes opened."""
        if not pages:
            return
        self._set_context()
        drv = self._drv
        made: dict[int, object] = {}
        mapped: list[int] = []
        try:
            for page in pages:
                size, ptr = self.page_size, self._ptr(page)
                made[page] = self._timed("create", self._call, drv.cuMemCreate, size, self._prop, 0)
                self._timed("map", self._call, drv.cuMemMap, ptr, size, 0, made[page], 0)
                mapped.append(page)
            for first, count in _runs(sorted(pages)):
                self._timed(
                    "set_access", self._call, drv.cuMemSetAccess,
                    self._ptr(first), count * self.page_size, [self._access], 1,
                )  # fmt: skip
        except MemoryBackendError:
            for page in mapped:
                self._call(drv.cuMemUnmap, self._ptr(page), self.page_size)
            for handle in made.values():
                self._call(drv.cuMemRelease, handle)
            raise
        self._handles.update(made)

    def _unmap(self, page: int) -> None:
        self._set_context()
        self._timed("unmap", self._call, self._drv.cuMemUnmap, self._ptr(page), self.page_size)
        self._timed("release", self._call, self._drv.cuMemRelease, self._handles.pop(page))

    def _make_tensor(self) -> torch.Tensor:
        import torch

        class _Interface:  # the __cuda_array_interface__ protocol torch.as_tensor understands
            __cuda_array_interface__ = {  # noqa: RUF012 - one immutable description per range
                "shape": (self.size,),
                "typestr": "|u1",
                "data": (int(self._base), False),
                "version": 3,
                "strides": None,
            }

        return torch.as_tensor(_Interface(), device=f"cuda:{self._ordinal}")

    def _free_range(self) -> None:
        self._set_context()
        self._call(self._drv.cuMemAddressFree, self._base, self.size)
        self._call(self._drv.cuDevicePrimaryCtxRelease, self._cu_device)


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as (first page, count) runs of neighbours."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def reserve(device: str, num_bytes: int, page_size: int = DEFAULT_PAGE_SIZE) -> VirtualRange:
    """Reserve ``num_bytes`` of virtual space on ``device`` (``cpu``, ``cpu:N``, ``cuda``, ``cuda:N``)."""
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return HostVirtualRange(device, num_bytes, page_size)
    if kind == "cuda":
        return CudaVirtualRange(device, num_bytes, page_size)
    raise InvalidRequestError(f"unknown device {device!r}; expected cpu[:N] or cuda[:N]")
