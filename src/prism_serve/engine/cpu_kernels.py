"""CPU kernels the engine builds from its own C++ source at first use (``csrc/``).

- ``paged_decode``: decode attention that reads K and V in place in the paged cache
  (``csrc/paged_decode.cpp``), instead of gathering every decode's blocks into a padded buffer
  and running SDPA over it;
- ``add_rms_norm`` and ``rope``: a layer's residual add + RMSNorm, and its rotary embedding, one
  pass each instead of a chain of torch ops (``csrc/layer_ops.cpp``), rounded as those ops round;
- ``lora_apply``: the LoRA updates of a batch whose rows use different adapters, each row reading
  its own adapter's weights in place (``csrc/lora.cpp``, engine/lora.py).

The library is compiled with the machine's C++ compiler for this CPU (``-march=native``) into a
cache directory keyed by the sources, the compiler and the CPU's flags, so a second process, or a
later run, loads it without compiling (about a second the first time). It is called through
ctypes (the GIL is released during a call) and its OpenMP threads are torch's: the library links
``libgomp.so.1``, which resolves to the copy torch has already loaded.

``PRISM_CPU_KERNELS``: ``auto`` (default: the kernels where they build, else torch ops, with one
warning), ``on`` (the kernels or an error) or ``off`` (torch ops only). ``PRISM_KERNEL_CACHE``
overrides where the built library goes (default ``~/.cache/prism-serve/kernels``).
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

__all__ = [
    "KernelBuildError",
    "add_rms_norm",
    "kernels_enabled",
    "kernels_mode",
    "lora_apply",
    "paged_decode",
    "rope",
]

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++17", "-fno-math-errno"]
# Each source with its own flags. Vectorized expf (glibc's libmvec) needs fast-math at compile
# time; it is kept out of the link step: linking a shared library with -ffast-math adds
# crtfastmath.o, which would turn on flush-to-zero for the whole process when the library loads.
# The layer ops must round as torch does: no fused multiply-adds.
SOURCES = {"paged_decode.cpp": ["-ffast-math"], "layer_ops.cpp": ["-ffp-contract=off"], "lora.cpp": []}
HEADERS = ("bf16.h",)  # included by the sources


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded on this machine."""


def kernels_mode() -> str:
    mode = os.environ.get("PRISM_CPU_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"PRISM_CPU_KERNELS={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def kernels_enabled() -> bool:
    """Whether a CPU engine uses these kernels (``PRISM_CPU_KERNELS``); builds them if needed."""
    mode = kernels_mode()
    if mode == "off":
        return False
    error = _build_error()
    if error is None:
        return True
    if mode == "on":
        raise error
    return False


@functools.cache
def _build_error() -> KernelBuildError | None:
    """Why the library cannot be had here (None: it loads). Tried once per process: a machine
    without a compiler does not try again at every forward pass."""
    try:
        _library()
    except KernelBuildError as e:
        log.warning("CPU kernels unavailable, the engine uses torch ops (slower): %s", e)
        return e
    return None


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
        raise KernelBuildError("no C++ compiler (c++ or g++) on PATH; set CXX, or PRISM_CPU_KERNELS=off")
    return cxx


def _cache_dir() -> Path:
    root = os.environ.get("PRISM_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "prism-serve" / "kernels"


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {  # (argument types, result type) of every exported function, f32 and bf16 alike
    "prism_paged_decode": ([_P] * 3 + [_I] * 2 + [_P] * 2 + [_I] * 6 + [_F, _I, _F, _P], ctypes.c_int),
    "prism_add_rms_norm": ([_P] * 4 + [_I] * 2 + [_F], None),
    "prism_rope": ([_P] + [_I] * 4 + [_P] * 3, None),
    "prism_lora_apply": ([_P, _I, _P, _I] + [_P] * 4 + [_I] * 4, None),
}


@functools.cache
def _library() -> ctypes.CDLL:
    csrc = files("prism_serve.engine").joinpath("csrc")
    sources = {name: csrc.joinpath(name).read_bytes() for name in SOURCES}
    headers = {name: csrc.joinpath(name).read_bytes() for name in HEADERS}
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from e
    parts = [version.encode(), " ".join(CFLAGS).encode(), _cpu_flags().encode()]
    for name, source in sources.items():
        parts += [name.encode(), " ".join(SOURCES[name]).encode(), source]
    for name, header in headers.items():
        parts += [name.encode(), header]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = _cache_dir() / f"prism_cpu-{key}.so"
    if not path.exists():
        try:
            _build(cxx, sources, headers, path)
        except OSError as e:  # the cache directory cannot be made or written
            raise KernelBuildError(f"cannot build into {path.parent}: {e}") from e
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e
    for stem, (args, result) in _SIGNATURES.items():
        for suffix in ("_f32", "_bf16"):
            fn = getattr(lib, stem + suffix)
            fn.argtypes, fn.restype = args, result
    return lib


def _build(cxx: str, sources: dict[str, bytes], headers: dict[str, bytes], path: Path) -> None:
    """Compile into a private directory, then rename into place: processes that build at once
    each finish with a whole library, and the last rename wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        for name, header in headers.items():
            (Path(tmp) / name).write_bytes(header)
        objects, lib = [], Path(tmp) / "k.so"
        steps = []
        for name, source in sources.items():
            src, obj = Path(tmp) / name, Path(tmp) / f"{Path(name).stem}.o"
            src.write_bytes(source)
            steps.append([cxx, *CFLAGS, *SOURCES[name], "-c", str(src), "-o", str(obj)])
            objects.append(str(obj))
        steps.append([cxx, "-shared", "-fopenmp", *objects, "-o", str(lib)])
        for cmd in steps:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise KernelBuildError(f"{' '.join(cmd)}: {e}") from e
            if done.returncode != 0:
                raise KernelBuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(lib, path)
    log.info("built the CPU kernels: %s", path)


_SUFFIX = {torch.float32: "_f32", torch.bfloat16: "_bf16"}


def _fn(stem: str, *tensors: torch.Tensor):
    """The kernel ``stem`` for the tensors' one dtype (float32 or bfloat16)."""
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX or any(t.dtype != dtype for t in tensors):
        got = ", ".join(str(t.dtype) for t in tensors)
        raise TypeError(f"{stem[6:]} takes float32 or bfloat16 tensors of one dtype, got {got}")
    return getattr(_library(), stem + _SUFFIX[dtype])


def paged_decode(
    q: torch.Tensor,  # [n, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any block stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [n, max_blocks] int64
    lens: torch.Tensor,  # [n] int64: keys each query attends to
    scale: float,
    out: torch.Tensor | None = None,  # [n, num_heads, head_dim]
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its first ``lens[i]`` cached tokens, the
    last ``window`` of them with a sliding window; scores soft-capped (``softcap * tanh(s /
    softcap)``) when ``softcap`` is given."""
    fn = _fn("prism_paged_decode", q, k_cache, v_cache)
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
    rc = fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        tables.data_ptr(), lens.data_ptr(), n, tables.shape[1], num_heads, num_kv_heads, head_dim,
        block_size, scale, window or 0, softcap or 0.0, out.data_ptr(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"paged_decode rejected its arguments (code {rc}): lens must be in "
                         f"1..max_blocks*block_size, heads a multiple of KV heads and at most 64, "
                         f"head_dim <= 256, heads x head_dim <= 8192, block_size <= 64")  # fmt: skip
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += y`` in place (when ``y`` is given), then RMSNorm(x) * weight as a new tensor.
    x, y: [rows, hidden] contiguous; weight: [hidden]."""
    fn = _fn("prism_add_rms_norm", x, weight, *([] if y is None else [y]))
    if x.dim() != 2 or not x.is_contiguous() or weight.shape != x.shape[1:] or not weight.is_contiguous():
        raise ValueError(
            f"add_rms_norm takes a contiguous [rows, hidden] x and a [hidden] weight, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if y is not None and (y.shape != x.shape or not y.is_contiguous()):
        raise ValueError(f"y must be contiguous and shaped like x {tuple(x.shape)}, got {tuple(y.shape)}")
    out = torch.empty_like(x)
    y_ptr = 0 if y is None else y.data_ptr()
    fn(x.data_ptr(), y_ptr, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([tokens, heads, head_dim], heads contiguous, rows any distance apart) in place
    by the half-split rotary embedding at ``positions`` (rows of ``cos`` and ``sin``, each
    [max_positions, head_dim / 2]). Returns ``x``."""
    fn = _fn("prism_rope", x, cos, sin)
    tokens, heads, head_dim = x.shape
    if x.stride()[1:] != (head_dim, 1) or head_dim % 2 or (tokens > 1 and x.stride(0) < heads * head_dim):
        raise ValueError(
            f"rope takes [tokens, heads, head_dim] with contiguous heads, got stride {x.stride()}"
        )
    half = head_dim // 2
    if (
        cos.shape != sin.shape
        or cos.shape[1:] != (half,)
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        raise ValueError(f"cos and sin must be contiguous [positions, {half}], got {tuple(cos.shape)}")
    positions = positions.to(torch.int64).contiguous()
    if positions.shape != (tokens,):
        raise ValueError(f"one position per token: {tokens} tokens, positions {tuple(positions.shape)}")
    if tokens:
        lo, hi = torch.aminmax(positions)
        if lo < 0 or hi >= cos.shape[0]:
            raise ValueError(f"positions {int(lo)}..{int(hi)} outside the {cos.shape[0]} rows of cos and sin")
        fn(
            x.data_ptr(),
            tokens,
            heads,
            head_dim,
            x.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
        )
    return x


def lora_operands(
    x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
    ranks: torch.Tensor, check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Check the operands of a LoRA kernel (this one, and cuda_kernels.lora_apply), ValueError
    naming them; the slots and ranks as contiguous int64. ``check_values``: also that every slot
    and rank is inside the stacked weights (reading them: a device sync on a GPU)."""
    rows, fan_in = x.shape
    num_slots, max_rank, fan_out = b.shape
    if (
        x.stride(1) != 1
        or out.stride(1) != 1
        or out.shape != (rows, fan_out)
        or a.shape != (num_slots, max_rank, fan_in)
        or not (a.is_contiguous() and b.is_contiguous())
    ):
        raise ValueError(
            f"lora_apply: x {tuple(x.shape)}, out {tuple(out.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    slots = slots.to(torch.int64).contiguous()
    ranks = ranks.to(torch.int64).contiguous()
    if slots.shape != (rows,) or ranks.shape != (num_slots,):
        raise ValueError(f"lora_apply: {rows} rows need {rows} slots, {num_slots} slots need their ranks")
    if check_values and rows and (int(slots.max()) >= num_slots or int(ranks.max()) > max_rank):
        raise ValueError("lora_apply: a slot or rank outside the stacked weights")
    return slots, ranks


def lora_apply(
    x: torch.Tensor,  # [rows, in], rows any distance apart
    out: torch.Tensor,  # [rows, out], rows any distance apart (a column range of a fused output)
    a: torch.Tensor,  # [slots, max_rank, in]
    b: torch.Tensor,  # [slots, max_rank, out]
    slots: torch.Tensor,  # [rows] int64, -1: no adapter
    ranks: torch.Tensor,  # [slots] int64
) -> None:
    """``out[t] += (x[t] @ a[s, :r].T) @ b[s, :r]`` for each row ``t`` with slot ``s = slots[t]``
    and ``r = ranks[s]``, in place."""
    fn = _fn("prism_lora_apply", x, out, a, b)
    slots, ranks = lora_operands(x, out, a, b, slots, ranks)
    rows, fan_in = x.shape
    max_rank, fan_out = b.shape[1:]
    if rows:
        fn(
            x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), a.data_ptr(), b.data_ptr(),
            slots.data_ptr(), ranks.data_ptr(), rows, fan_in, fan_out, max_rank,
        )  # fmt: skip
