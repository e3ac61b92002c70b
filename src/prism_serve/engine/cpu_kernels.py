"""CPU kernels the engine builds from its own C++ source at first use (``csrc/``).

Today there is one: decode attention that reads K and V in place in the paged cache
(``csrc/paged_decode.cpp``), which replaces gathering every decode's blocks into a padded buffer
and running SDPA over it. The library is compiled with the machine's C++ compiler for this CPU
(``-march=native``) into a cache directory keyed by the source, the compiler and the CPU's flags,
so a second process, or a later run, loads it without compiling. It is called through ctypes (the
GIL is released during the call) and its OpenMP threads are torch's: the library links
``libgomp.so.1``, which resolves to the copy torch has already loaded.

``PRISM_CPU_ATTENTION`` picks the decode attention: ``auto`` (default: the kernel where it builds,
else SDPA, with one warning), ``kernel`` (the kernel or an error) or ``sdpa``.
``PRISM_KERNEL_CACHE`` overrides where the built library goes (default
``~/.cache/prism-serve/kernels``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib.resources import files
from pathlib import Path

import torch

__all__ = ["KernelBuildError", "attention_mode", "decode_kernel", "paged_decode"]

log = logging.getLogger(__name__)

MODES = ("auto", "kernel", "sdpa")
SOURCE = "paged_decode.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++17", "-fno-math-errno"]
# Vectorized expf (glibc's libmvec) needs fast-math at compile time. It is kept out of the link
# step: linking a shared library with -ffast-math adds crtfastmath.o, which would turn on
# flush-to-zero for the whole process when the library loads.
COMPILE_ONLY = ["-ffast-math"]


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded on this machine."""


def attention_mode() -> str:
    mode = os.environ.get("PRISM_CPU_ATTENTION", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"PRISM_CPU_ATTENTION={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def decode_kernel() -> bool:
    """Whether the engine's decode attention uses the paged kernel (``PRISM_CPU_ATTENTION``)."""
    mode = attention_mode()
    if mode == "sdpa":
        return False
    try:
        _library()
    except KernelBuildError as e:
        if mode == "kernel":
            raise
        _warn_fallback(str(e))
        return False
    return True


@functools.cache
def _warn_fallback(reason: str) -> None:
    log.warning("paged decode kernel unavailable, decode attention uses SDPA: %s", reason)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelBuildError("no C++ compiler (c++ or g++) on PATH; set CXX or PRISM_CPU_ATTENTION=sdpa")
    return cxx


def _cache_dir() -> Path:
    root = os.environ.get("PRISM_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "prism-serve" / "kernels"


@functools.cache
def _library() -> ctypes.CDLL:
    source = files("prism_serve.engine").joinpath("csrc", SOURCE).read_bytes()
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from e
    key = hashlib.sha256(
        b"\0".join(
            [source, version.encode(), " ".join(CFLAGS + COMPILE_ONLY).encode(), _cpu_flags().encode()]
        )
    ).hexdigest()[:16]
    path = _cache_dir() / f"paged_decode-{key}.so"
    if not path.exists():
        _build(cxx, source, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e
    args = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
    args += [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p]
    for name in ("prism_paged_decode_f32", "prism_paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def _build(cxx: str, source: bytes, path: Path) -> None:
    """Compile into a private directory, then rename into place: processes that build at once
    each finish with a whole library, and the last rename wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, obj, lib = Path(tmp) / SOURCE, Path(tmp) / "k.o", Path(tmp) / "k.so"
        src.write_bytes(source)
        steps = [
            [cxx, *CFLAGS, *COMPILE_ONLY, "-c", str(src), "-o", str(obj)],
            [cxx, "-shared", "-fopenmp", str(obj), "-o", str(lib)],
        ]
        for cmd in steps:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise KernelBuildError(f"{' '.join(cmd)}: {e}") from e
            if done.returncode != 0:
                raise KernelBuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(lib, path)
    log.info("built the paged decode kernel: %s", path)


_DTYPES = {torch.float32: "prism_paged_decode_f32", torch.bfloat16: "prism_paged_decode_bf16"}


def paged_decode(
    q: torch.Tensor,  # [n, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any block stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [n, max_blocks] int64
    lens: torch.Tensor,  # [n] int64: keys each query attends to
    scale: float,
    out: torch.Tensor | None = None,  # [n, num_heads, head_dim]
) -> torch.Tensor:
    """Attention of one query token per sequence over its first ``lens[i]`` cached tokens."""
    name = _DTYPES.get(q.dtype)
    if name is None or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"paged_decode takes float32 or bfloat16 tensors of one dtype, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")  # fmt: skip
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("K and V caches must have the same shape and strides")
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, hd = k_cache.shape
    # A token's K row must be contiguous heads x head_dim; blocks may be any distance apart.
    if hd != head_dim or k_cache.stride()[2:] != (head_dim, 1):
        raise ValueError(f"unexpected K cache layout {tuple(k_cache.shape)} / {k_cache.stride()}")
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    if tables.shape[0] != n or lens.shape != (n,):
        raise ValueError("block_tables and lens must have one row per query")
    if out is None:
        out = torch.empty_like(q)
    elif not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("out must be a contiguous tensor shaped like q")
    if n == 0:
        return out
    lo, hi = torch.aminmax(tables)
    if lo < 0 or hi >= k_cache.shape[0]:
        raise ValueError(f"block ids {int(lo)}..{int(hi)} outside the cache's {k_cache.shape[0]} blocks")
    rc = getattr(_library(), name)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        tables.data_ptr(), lens.data_ptr(), n, tables.shape[1], num_heads, num_kv_heads, head_dim,
        block_size, scale, out.data_ptr(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"paged_decode rejected its arguments (code {rc}): lens must be in "
                         f"1..max_blocks*block_size, heads a multiple of KV heads and at most 64, "
                         f"head_dim <= 256, heads x head_dim <= 8192, block_size <= 64")  # fmt: skip
    return out
