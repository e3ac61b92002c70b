"""What this machine's CPU can do, and the dtype ``auto`` resolves to on it.

bf16 pays only where the CPU has native bf16 matrix instructions (AVX512_BF16 or AMX): without
them torch emulates bf16 matmuls, about 6x slower than fp32 on an AVX2 EPYC (15 against 98 GFLOP/s,
benchmarks/cpu_gemm.py). So ``dtype: auto`` is bf16 on such CPUs and fp32 elsewhere; a CUDA device (the GPU
backend) has bf16 tensor cores and takes bf16. No torch here: the deployment config imports it.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "BF16_FLAGS",
    "cpu_flags",
    "cpu_model",
    "cpu_seconds",
    "keep_freed_buffers",
    "native_bf16",
    "resolve_dtype",
    "vector_flags",
]

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names of native bf16 matmuls
_CONCRETE = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


@functools.cache
def _cpuinfo() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:  # not Linux: no flags known, so auto picks fp32 (always correct, maybe slower)
        return ()


def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags as /proc/cpuinfo names them (empty where it is unreadable)."""
    line = next((ln for ln in _cpuinfo() if ln.startswith("flags")), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_model() -> str:
    line = next((ln for ln in _cpuinfo() if ln.startswith("model name")), "")
    return line.split(":", 1)[1].strip() if ":" in line else (platform.processor() or "unknown")


def vector_flags() -> str:
    """The vector-extension flags, for a benchmark's machine line ("no AVX-512" said when absent)."""
    flags = cpu_flags()
    simd = " ".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))))
    return (simd or "unknown") + ("" if any(f.startswith("avx512") for f in flags) else " (no AVX-512)")


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    return bool((cpu_flags() if flags is None else flags) & BF16_FLAGS)


def resolve_dtype(dtype: str, device_kind: str = "cpu", flags: frozenset[str] | None = None) -> str:
    """``float32`` or ``bfloat16`` for a dtype name (aliases fp32 / bf16; ``auto``: bf16 on a CUDA
    device or a CPU with native bf16 matmuls, else fp32)."""
    if dtype == "auto":
        return "bfloat16" if device_kind == "cuda" or native_bf16(flags) else "float32"
    try:
        return _CONCRETE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; one of auto, {', '.join(_CONCRETE)}") from None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


@functools.cache
def keep_freed_buffers() -> bool:
    """Let this process reuse the memory of freed activation buffers instead of getting fresh
    pages for every one (glibc only; a no-op elsewhere). Returns whether it took effect.

    A forward step allocates and frees buffers of a few MB per op (a 512-token chunk's MLP
    activations are 6 MB in fp32). glibc serves anything above its mmap threshold with a fresh
    mmap, which the kernel zero-fills page by page on first touch, and hands it back on free, so
    every step pays those page faults again. Raising the mmap threshold to its maximum (32 MiB) and
    the trim threshold to 256 MiB keeps those buffers in the heap for the next step. Called once by
    every engine; it changes only where the process's malloc gets memory, never a result.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, 256 * 2**20))


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine since boot, CPU seconds of this process): two readings
    give the cores other processes kept busy in between."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    t = os.times()
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), t.user + t.system


def pin_to_cores(cores: Iterable[int]) -> None:
    """Run this process on ``cores`` with one torch thread per core, as a live CPU device's workers
    run (runtime/devices.py ``pin_process``; the fit and its compute-sharing engines do the same)."""
    import torch

    cores = set(cores)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
