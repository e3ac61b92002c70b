"""LoRA adapters the runtime serves: each runs over a base model, in its base's engine and batches
(engine/lora.py). For placement, replicas and admission a base and its adapters are one model (its
load is theirs together; each request keeps its adapter's TTFT SLO for the queue order); clients
address an adapter by its own name.

An adapter is checked against its base's shape when it is registered (from the config at start,
or ``POST /v1/load_lora_adapter`` at run time), and a worker running the base registers it in the
engine (at activation, or when told). A base's adapter slots (``max_loras`` x ``max_lora_rank``) are
part of its footprint on a device: granted from the ledger with its weights, and gone with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prism_serve.engine.lora import InvalidAdapterError, read_adapter
from prism_serve.engine.models.config import ArchConfig

__all__ = ["AdapterSpec", "AdapterTable"]


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

    @classmethod
    def read(
        cls, name: str, base: str, path: str, config: ArchConfig, max_rank: int, ttft_slo: float,
        tpot_slo: float,
    ) -> AdapterSpec:  # fmt: skip
        """Read and check the adapter (InvalidAdapterError naming the problem)."""
        a = read_adapter(Path(path).expanduser(), config, max_rank, name)
        return cls(name, base, str(Path(path).expanduser()), ttft_slo, tpot_slo, a.rank, a.nbytes,
                   a.target_modules)  # fmt: skip


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
