"""LoRA adapters the runtime serves: each runs over a base model, in its base's engine and batches
(engine/lora.py). For placement, replicas and admission a base and its adapters are one model (its
load is theirs together; each request keeps its adapter's TTFT SLO for the queue order); clients
address an adapter by its own name.

An adapter is checked against its base's shape when it is registered (from the config at start,
or ``POST /v1/load_lora_adapter`` at run time): the controller reads its files once and puts the
checked weights in the host cache (shared memory, runtime/weight_cache.py). A worker running the
base registers it in the engine (at activation, or when told) over a read-only mapping of that
file, and the engine copies it into a slot at its first use: the node holds one copy of each
adapter, whatever the number of workers. vLLM reads the adapter's directory itself (its own
LoRA loader, an LRU of ``max_loras`` adapters in the worker). A base's adapter slots
(``max_loras`` x ``max_lora_rank``) are part of its footprint on a device: granted from the ledger
with its weights, and gone with them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from prism_serve.engine.lora import MODULES, InvalidAdapterError, LoraAdapter, read_adapter
from prism_serve.engine.models.config import ArchConfig
from prism_serve.runtime.messages import AdapterFile, LoraEntry
from prism_serve.runtime.weight_cache import HostWeightCache, SharedWeights, release_freed_memory

__all__ = ["AdapterSpec", "AdapterTable", "MappedAdapters"]


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    base: str
    path: str
    ttft_slo: float
    tpot_slo: float
    rank: int
    nbytes: int  # its weights (fp32 on the host)
    target_modules: tuple[str, ...]
    file: AdapterFile  # what a worker registers: its directory, and its weights in the host cache

    @classmethod
    def read(
        cls, name: str, base: str, path: str, config: ArchConfig, max_rank: int, ttft_slo: float,
        tpot_slo: float, cache: HostWeightCache | None,
    ) -> AdapterSpec:  # fmt: skip
        """Read and check the adapter (InvalidAdapterError naming the problem), and put its weights
        in ``cache`` (None: workers read its directory)."""
        where = str(Path(path).expanduser())
        a = read_adapter(where, config, max_rank, name)
        file = cache.write_adapter(a) if cache is not None else AdapterFile(name, where)
        spec = cls(name, base, where, ttft_slo, tpot_slo, a.rank, a.nbytes, a.target_modules, file)
        del a  # its tensors: the cache file holds them now
        release_freed_memory()
        return spec


class MappedAdapters:
    """A worker's adapters over their host cache files, each mapped read-only once (no copy: the
    engine copies an adapter into a slot when a request first needs it). An adapter without a
    cache file (a node whose controller did not write one) is read from its directory."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[SharedWeights | None, LoraAdapter]] = {}

    def get(self, f: AdapterFile, config: ArchConfig, max_rank: int) -> LoraAdapter:
        key = f.cache_path or f"{f.path}\0{f.name}\0{max_rank}"
        got = self._files.get(key)
        if got is None:
            if f.cache_path:
                shared = SharedWeights(f.cache_path, f.size, populate=False)
                got = (shared, _views(f, shared.bytes))
            else:
                got = (None, read_adapter(f.path, config, max_rank, f.name))
            self._files[key] = got
        return got[1]

    def forget(self, name: str) -> None:
        """Unmap adapter ``name``'s file (its slot copy, if any, is the engine's)."""
        for key, (shared, adapter) in list(self._files.items()):
            if adapter.name == name:
                del self._files[key]
                if shared is not None:
                    shared.close()

    def close(self) -> None:
        for shared, _ in self._files.values():
            if shared is not None:
                shared.close()
        self._files.clear()


class _MappedWeights(Mapping):
    """An adapter's (layer, module) -> (A, B) as views of its mapped file, made when read (a slot
    copy) and not kept: a registered adapter costs its worker no tensors until it is used."""

    def __init__(self, entries: tuple[LoraEntry, ...], flat: torch.Tensor) -> None:
        self._entries = {(e.layer, e.module): e for e in entries}
        self._flat = flat

    def __getitem__(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor]:
        e = self._entries[key]
        na, nb = e.rank * e.fan_in * 4, e.fan_out * e.rank * 4
        a = self._flat[e.offset : e.offset + na].view(torch.float32).view(e.rank, e.fan_in)
        b = self._flat[e.offset + na : e.offset + na + nb].view(torch.float32).view(e.fan_out, e.rank)
        return a, b

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _views(f: AdapterFile, flat: torch.Tensor) -> LoraAdapter:
    targets = tuple(m for m in MODULES if any(e.module == m for e in f.entries))
    return LoraAdapter(f.name, f.path, f.rank, targets, _MappedWeights(f.entries, flat))


class AdapterTable:
    """The registered adapters by name; an adapter being unloaded takes no new requests."""

    def __init__(self) -> None:
        self.by_name: dict[str, AdapterSpec] = {}
        self.unloading: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.by_name and name not in self.unloading

    def get(self, name: str) -> AdapterSpec | None:
        return None if name in self.unloading else self.by_name.get(name)

    def of_base(self, base: str) -> list[AdapterSpec]:
        return [a for a in self.by_name.values() if a.base == base]

    def add(self, spec: AdapterSpec) -> None:
        if spec.name in self.by_name:
            raise InvalidAdapterError(f"adapter {spec.name!r} is already loaded")
        self.by_name[spec.name] = spec

    def remove(self, name: str) -> None:
        self.by_name.pop(name, None)
        self.unloading.discard(name)
