"""The host weight cache: each model's weights, read from disk once, kept in shared memory in the
exact layout the engine computes with, so any worker activates a model with one memory copy and
nothing passes through the controller.

A cache file is ``/dev/shm/prism-weights-<namespace>-<controller pid>-<n>``: the tensors of
the model's ``packed_tensors()`` back to back, each at a 4 KiB-aligned offset. A worker maps
the file read-only (``SharedWeights``) and copies byte ranges into the model's device pages at the
same offsets, then builds the model over views of those pages. The tokenizer travels in a JSON file
next to it, one file per distinct tokenizer (fine-tunes of one base share it, and a worker parses it
once for all of them). A LoRA adapter's checked weights are a ``.lora`` file of their own
(``write_adapter``), which workers map read-only and copy into an adapter slot at its first use.
Files of controllers that died are removed when the next cache opens. A file takes all of its
memory when it is created, so a /dev/shm without room is ``HostCacheFullError`` and never a SIGBUS
in the middle of the copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import json
import logging
import mmap
import os
import re
import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prism_serve.engine.llm_engine import DTYPES
from prism_serve.engine.lora import LoraAdapter
from prism_serve.engine.models import build_model
from prism_serve.engine.models.config import ArchConfig, RopeScaling
from prism_serve.engine.tensor_parallel import shard_plan, shard_weights
from prism_serve.engine.weights import load_checkpoint, load_weights
from prism_serve.errors import PrismError
from prism_serve.memory.kept import KeptBudget, default_kept_prefix_bytes
from prism_serve.memory.ledger import default_namespace
from prism_serve.memory.vmm import format_size
from prism_serve.runtime.messages import AdapterFile, CacheFile, LoraEntry, Prepare, TensorEntry
from prism_serve.runtime.models import ModelSpec

logger = logging.getLogger(__name__)

ALIGN = 4096
# What a pooled worker parses ahead of activations: tokenizers up to this many bytes of JSON (a
# 49k-token BPE tokenizer is 2.1 MB and ~15 MB parsed); the cache files are mapped whatever their size
# (a mapping costs page tables only, ~0.2% of the file).
PREPARE_TOKENIZER_BYTES = 64 * 2**20
# A pooled worker pre-faults a cache file this much between two polls of its socket (~35 ms here),
# so an activation that arrives meanwhile waits for one piece, not a whole 16 GB file.
PREFAULT_CHUNK_BYTES = 256 * 2**20
_MADV_POPULATE_READ = 22  # Linux 5.14+: fault a range's page tables in now (mmap lacks the name)
_FILE_RE = re.compile(r"^prism-weights-(?P<ns>.+)-(?P<pid>\d+)-\d+(\.tok\.json|\.lora|\.tp|\.tp\.ar|\.kv)?$")


class HostCacheFullError(PrismError):
    """The host weight cache's directory (``/dev/shm``) has no room for a model's or an adapter's
    file; nothing of it was kept, and the models already cached are untouched."""

    status_code = 503
    error_type = "service_unavailable"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def cache_layout(packed: dict[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Where each packed tensor sits in a cache file (and in the device's weight range): back to
    back in order, each at an ``ALIGN``-aligned offset; with the file's size. Reads shapes and dtypes
    only, so meta tensors lay out a model that was never built."""
    entries, offset = [], 0
    for name, t in packed.items():
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset = _align(offset + nbytes)
    return entries, max(offset, ALIGN)


# Checkpoint tensors that vLLM stacks into one weight (its models' packed_modules_mapping), by the
# usual names, in vLLM's order. Kept back to back in the cache file, a stacked weight is one view
# of them and needs no copy (engine/vllm_load.py); under other names they are copied together.
_STACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def shards_together(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` in checkpoint order, except that the shards of one stacked weight follow each
    other (at the first one's place), in stacking order."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in out:
            continue
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        group = next((g for g in _STACKED if last in g), None)
        names = [f"{parent}.{s}.{leaf}" for s in group] if group else [name]
        if group and all(n in tensors for n in names):
            out.update((n, tensors[n]) for n in names)
        else:
            out[name] = t
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_to_dict(config: ArchConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(d: dict[str, Any]) -> ArchConfig:
    rs = d.get("rope_scaling")
    return ArchConfig(**{**d, "rope_scaling": RopeScaling(**rs) if rs else None})


@dataclass(frozen=True, slots=True)
class CachedRank:
    """One rank's shard of a tensor parallel model: a cache file of its own, laid out as any
    model's, whose config is the shard's shape (engine/tensor_parallel.py ``shard_config``)."""

    path: str
    tensors: tuple[TensorEntry, ...]
    weight_bytes: int
    config: dict[str, Any]
    kv_bytes_per_token: int


@dataclass(frozen=True, slots=True)
class CachedModel:
    """One model in the host cache: where its bytes are and what a worker needs to serve it. A
    tensor parallel model's file, tensors and size here are rank 0's, ``ranks`` has every rank's;
    its config and KV bytes per token are the whole model's."""

    spec: ModelSpec
    path: str
    tensors: tuple[TensorEntry, ...]
    weight_bytes: int  # the file's size (tensors + alignment): the device pages must hold this
    config: dict[str, Any]
    tokenizer_path: str
    source: str
    synthetic: bool
    kv_bytes_per_token: int
    load_s: float  # disk -> cache, once
    ranks: tuple[CachedRank, ...] = ()  # tensor parallel (spec.tp > 1): each rank's shard

    @property
    def files(self) -> dict[str, int]:
        """Its cache files and their sizes (a tensor parallel model's: one per rank)."""
        if self.ranks:
            return {r.path: r.weight_bytes for r in self.ranks}
        return {self.path: self.weight_bytes}


class HostWeightCache:
    """Loads each model once and keeps it in shared memory until ``close()`` (or ``drop``)."""

    def __init__(
        self,
        namespace: str | None = None,
        directory: str | Path = "/dev/shm",
        kept_prefix_bytes: int | None = None,
    ) -> None:
        """``kept_prefix_bytes``: host memory for the cached prefixes of evicted models
        (``keep_prefixes``), in all; None: ``KEPT_PREFIX_SHARE`` of the directory's size."""
        self.namespace = namespace or default_namespace()
        self.directory = Path(directory)
        if kept_prefix_bytes is None:
            kept_prefix_bytes = default_kept_prefix_bytes(self.directory)
        self._kept: KeptBudget[str] = KeptBudget(kept_prefix_bytes)  # the kept prefix files
        self._lock = threading.Lock()
        self._file_locks: dict[tuple, threading.Lock] = {}
        self._files: dict[tuple, CachedModel] = {}  # by weights key; spec = the first model's
        self._models: dict[str, CachedModel] = {}
        self._tokenizers: dict[str, str] = {}  # tokenizer JSON digest -> its file
        self._adapters: dict[str, int] = {}  # adapter files -> their bytes
        self._counter = 0
        self._closed = False
        self.remove_stale()

    # ---- loading ------------------------------------------------------------------------------

    def get(self, name: str) -> CachedModel | None:
        return self._models.get(name)

    def load(self, spec: ModelSpec) -> CachedModel:
        """The cached copy of ``spec``'s weights, reading them from disk the first time. Models with
        the same weights (source, dtype and seed) share one cache file."""
        key = _weights_key(spec)
        with self._lock:
            if self._closed:
                raise RuntimeError("the host weight cache is closed")
            if spec.name in self._models:
                return self._models[spec.name]
            lock = self._file_locks.setdefault(key, threading.Lock())
        with lock:  # one disk read per weights even when several models or requests want them
            base = self._files.get(key)
            if base is None:
                base = self._load(spec)
                self._files[key] = base
                release_freed_memory()
        cached = dataclasses.replace(base, spec=spec)
        with self._lock:
            return self._models.setdefault(spec.name, cached)

    def _load(self, spec: ModelSpec) -> CachedModel:
        start = time.monotonic()
        dtype = DTYPES[spec.engine.dtype]
        element = torch.empty((), dtype=dtype).element_size()
        ranks: tuple[CachedRank, ...] = ()
        if spec.engine_kind == "vllm":
            # vLLM loads checkpoint tensors under their own names and packs them itself
            weights = load_checkpoint(Path(spec.source).expanduser(), dtype)
            path, entries, total = self._write(shards_together(weights.tensors))
        else:
            weights = load_weights(spec.source, dtype=dtype, seed=spec.engine.seed)
            parts = [weights]
            if spec.tp > 1:  # one file per rank: its shard, itself a smaller Llama
                parts = [shard_weights(weights, s) for s in shard_plan(weights.config, spec.tp)]
            files = []
            for part in parts:
                # Build the model once here to get the engine's own layout (fused QKV, transposed
                # fp32), so activations never redo that work. One RoPE position: the tables are not
                # cached.
                packed = build_model(
                    part.config, part.tensors, dtype, 1, weights.rope_freq_factors
                ).packed_tensors()
                files.append((part.config, *self._write(packed)))
                part.tensors.clear()
            weights.tensors.clear()
            if spec.tp > 1:
                ranks = tuple(
                    CachedRank(p, tuple(e), n, config_to_dict(c), c.kv_bytes_per_token(element))
                    for c, p, e, n in files
                )
            _, path, entries, total = files[0]
        tok_path = self._tokenizer_file(json.dumps(weights.tokenizer.to_state()), Path(path))
        return CachedModel(
            spec=spec,
            path=path,
            tensors=tuple(entries),
            weight_bytes=total,
            config=config_to_dict(weights.config),
            tokenizer_path=tok_path,
            source=weights.source,
            synthetic=weights.synthetic,
            kv_bytes_per_token=weights.config.kv_bytes_per_token(element),
            load_s=time.monotonic() - start,
            ranks=ranks,
        )

    def _write(self, packed: dict[str, torch.Tensor]) -> tuple[str, list[TensorEntry], int]:
        """A new cache file holding ``packed`` (emptied meanwhile): its path, layout and size."""
        entries, total = cache_layout(packed)
        path, fd = self._new_file(total)
        try:
            with mmap.mmap(fd, total) as mm:
                flat = torch.frombuffer(mm, dtype=torch.uint8)
                for e, t in zip(entries, packed.values(), strict=True):
                    flat[e.offset : e.offset + e.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
                del flat
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        packed.clear()  # the cache file holds them now
        return path, entries, total

    def _new_file(self, size: int, suffix: str = "") -> tuple[str, int]:
        """A new cache file of ``size`` bytes (zeros): its path and an open descriptor."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the host weight cache is closed")
            self._counter += 1
            path = self.directory / f"prism-weights-{self.namespace}-{os.getpid()}-{self._counter}{suffix}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # the file's memory is taken now, not page by page as the copy through the mapping
            # first writes it: a full /dev/shm is then this error, where a write through the
            # mapping would have killed the process with SIGBUS
            os.posix_fallocate(fd, 0, size)
        except BaseException as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise HostCacheFullError(
                    f"no room in {self.directory} for a {format_size(size)} cache file: {e.strerror}"
                ) from None
            raise
        return str(path), fd

    def rendezvous_file(self) -> Path:
        """A fresh path (not created) where the ranks of a tensor parallel model meet
        (torch.distributed's file:// init_method); it goes with the cache's other stale files."""
        with self._lock:
            self._counter += 1
            return self.directory / f"prism-weights-{self.namespace}-{os.getpid()}-{self._counter}.tp"

    # ---- cached prefixes of evicted models ----------------------------------------------------

    @property
    def kept_prefix_bytes(self) -> int:
        """What the kept prefix files may take in all (0: none are kept)."""
        return self._kept.budget_bytes

    @kept_prefix_bytes.setter
    def kept_prefix_bytes(self, budget: int) -> None:
        self._kept.budget_bytes = max(0, budget)

    def prefix_room(self, model: str) -> tuple[str, int]:
        """Where and how much of ``model``'s cached prefixes its worker may keep as it is evicted:
        a fresh path (not created) and a byte allowance, by memory/kept.py's rule (its earlier file
        and the oldest other models' files go first)."""
        with self._lock:
            allowance, gone = self._kept.room(model)
            self._counter += 1
            path = self.directory / f"prism-weights-{self.namespace}-{os.getpid()}-{self._counter}.kv"
        for old in gone:
            Path(old).unlink(missing_ok=True)
        return str(path), allowance

    def keep_prefixes(self, model: str, path: str, size: int) -> None:
        """The worker wrote ``model``'s cached prefixes to ``path`` (``size`` bytes; 0: nothing)."""
        with self._lock:
            kept = size > 0 and not self._closed
            if kept:
                self._kept.keep(model, path, size)
        if not kept:
            Path(path).unlink(missing_ok=True)

    def kept_prefixes(self, model: str) -> str | None:
        """The file of ``model``'s cached prefixes kept at its last eviction, if any."""
        with self._lock:
            return self._kept.get(model)

    def drop_prefixes(self, model: str) -> None:
        """Forget ``model``'s kept prefixes (restored into its engine, or replaced) and free them."""
        with self._lock:
            path = self._kept.take(model)
        if path is not None:
            Path(path).unlink(missing_ok=True)

    @property
    def kept_bytes(self) -> int:
        """Host memory the kept prefix files take."""
        return self._kept.used_bytes

    def write_adapter(self, adapter: LoraAdapter) -> AdapterFile:
        """Put a checked adapter's weights in shared memory (each module's A then B, float32, at
        64-byte boundaries); the returned AdapterFile tells a worker where they are."""
        entries, at = [], 0
        for (layer, module), (a, b) in adapter.weights.items():
            entries.append(LoraEntry(layer, module, at, a.shape[0], a.shape[1], b.shape[0]))
            at += -(-(a.nbytes + b.nbytes) // 64) * 64
        path, fd = self._new_file(max(at, 1), ".lora")
        try:
            with mmap.mmap(fd, max(at, 1)) as mm:
                flat = torch.frombuffer(mm, dtype=torch.uint8)
                for e, (a, b) in zip(entries, adapter.weights.values(), strict=True):
                    n = a.nbytes
                    flat[e.offset : e.offset + n].copy_(a.float().contiguous().view(-1).view(torch.uint8))
                    flat[e.offset + n : e.offset + n + b.nbytes].copy_(
                        b.float().contiguous().view(-1).view(torch.uint8)
                    )
                del flat
        except BaseException:
            Path(path).unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        with self._lock:
            self._adapters[path] = at
        return AdapterFile(adapter.name, adapter.path, path, at, adapter.rank, tuple(entries))

    def drop_adapter(self, path: str) -> None:
        """Remove an adapter's file (workers that mapped it keep their mapping until they close it)."""
        with self._lock:
            known = self._adapters.pop(path, None) is not None
        if known:
            Path(path).unlink(missing_ok=True)

    def _tokenizer_file(self, text: str, base: Path) -> str:
        """The file holding this tokenizer: the one an earlier model wrote, or a new one next to
        ``base``."""
        digest = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            path = self._tokenizers.get(digest)
            if path is None:
                path = self._tokenizers[digest] = f"{base}.tok.json"
                Path(path).write_text(text)
        return path

    # ---- housekeeping -------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        """Host memory the cache files take (shared weights counted once, adapters' included)."""
        return sum(n for f in self._files.values() for n in f.files.values()) + sum(self._adapters.values())

    def models(self) -> Iterable[CachedModel]:
        return list(self._models.values())

    def prepare_message(
        self, tokenizer_bytes: int = PREPARE_TOKENIZER_BYTES, engine: str | None = None
    ) -> Prepare:
        """What an idle worker opens ahead of any activation: every cache file (of the models on
        ``engine``, when given: a worker runs one engine), and the tokenizers in the order of the
        models up to ``tokenizer_bytes`` of JSON (each file once; none for a vLLM worker, as vLLM
        tokenizes for itself)."""
        files: dict[str, CacheFile] = {}
        tokenizers: list[str] = []
        budget = 0 if engine == "vllm" else tokenizer_bytes
        for m in self.models():
            if engine is not None and m.spec.engine_kind != engine:
                continue
            for path, size in m.files.items():
                files.setdefault(path, CacheFile(path, size))
            if m.tokenizer_path in tokenizers:
                continue
            with contextlib.suppress(OSError):
                size = os.path.getsize(m.tokenizer_path)
                if size <= budget:
                    tokenizers.append(m.tokenizer_path)
                    budget -= size
        return Prepare(list(files.values()), tokenizers)

    def drop(self, name: str) -> None:
        """Forget one model; its files go when no other model shares them (workers that mapped
        them keep their mapping until they close it)."""
        self.drop_prefixes(name)
        with self._lock:
            cached = self._models.pop(name, None)
            if cached is None:
                return
            gone = []
            if not any(m.path == cached.path for m in self._models.values()):
                self._files = {k: f for k, f in self._files.items() if f.path != cached.path}
                gone.extend(cached.files)
            if not any(m.tokenizer_path == cached.tokenizer_path for m in self._models.values()):
                self._tokenizers = {k: p for k, p in self._tokenizers.items() if p != cached.tokenizer_path}
                gone.append(cached.tokenizer_path)
        for p in gone:
            Path(p).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            names = list(self._models)
            adapters = list(self._adapters)
        for name in names:
            self.drop(name)
        for path in adapters:
            self.drop_adapter(path)
        for path in self._kept.items():
            Path(path).unlink(missing_ok=True)
        self._kept = KeptBudget(self._kept.budget_bytes)

    def __enter__(self) -> HostWeightCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def remove_stale(self, family: str | None = None) -> int:
        """Delete cache files of this namespace whose controller process no longer exists; with
        ``family``, of every namespace ``<family>.<node>`` too (the node caches of a Ray deployment:
        a node agent that was killed could not remove its own, and its node's name is not reused)."""
        removed = 0
        pattern = f"prism-weights-{family}.*" if family else f"prism-weights-{self.namespace}-*"
        for p in self.directory.glob(pattern):
            m = _FILE_RE.match(p.name)
            if m is None or not (m["ns"].startswith(family + ".") if family else m["ns"] == self.namespace):
                continue
            pid = int(m["pid"])
            if pid != os.getpid() and not _alive(pid):
                p.unlink(missing_ok=True)
                removed += 1
        return removed


def release_freed_memory() -> None:
    """Give the heap pages freed after a load (a model's, an adapter's) back to the kernel.
    Reading and packing a model allocates about twice its size; glibc keeps freed pages for
    reuse, so without this the server process would hold a private copy's worth of memory (1.1 GB
    for the default models) that it never touches again, beside the shared cache file."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _weights_key(spec: ModelSpec) -> tuple:
    seed = spec.engine.seed if spec.source.startswith("random:") else 0  # the seed only matters there
    return (spec.source, spec.engine.dtype, seed, spec.engine_kind, spec.tp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedWeights:
    """A worker's read-only view of one cache file, pre-faulted so copies run at memory speed:
    at once (``populate``), or piece by piece with ``prefault`` (a pooled worker between polls)."""

    def __init__(self, path: str, size: int, populate: bool = True) -> None:
        fd = os.open(path, os.O_RDONLY)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        try:
            self._mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # torch warns about read-only buffers; we never write to it
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.path, self.size = path, size
        self.faulted = size if populate else 0  # bytes from the start whose page tables are built
        self.pinned = False  # registered with the CUDA driver (``pin``)

    @property
    def complete(self) -> bool:
        return self.faulted >= self.size

    def prefault(self, num_bytes: int) -> bool:
        """Build the page tables of the next ``num_bytes`` (from where the last call stopped; a
        multiple of 4 KiB keeps every call page-aligned); True once the whole file is done."""
        start, end = self.faulted, min(self.size, self.faulted + num_bytes)
        if end > start:
            try:
                self._mm.madvise(_MADV_POPULATE_READ, start, end - start)
            except (OSError, ValueError):  # before Linux 5.14: read one byte of every page
                self.bytes[start : end : mmap.PAGESIZE].sum()
            self.faulted = end
        return self.complete

    def pin(self) -> bool:
        """Page-lock the mapping for the CUDA driver (``cudaHostRegister``, read-only), so that a
        copy to a GPU is a DMA from these pages rather than through a staging buffer. False, with
        a warning, where the driver refuses (the copies then still work, slower)."""
        if not self.pinned and self.size:
            read_only = 8  # cudaHostRegisterReadOnly: the mapping is PROT_READ
            err = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.size, read_only)
            if int(err) != 0:
                logger.warning("could not page-lock %s for the GPU: CUDA error %s", self.path, err)
                return False
            self.pinned = True
        return self.pinned

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        self.bytes = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view is still alive; the mapping goes with it
            self._mm.close()
