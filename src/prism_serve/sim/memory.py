"""Simulated device memory under the elastic ledger's rules (see memory/README.md).

- Memory is granted in pages of ``page_size``; each device has one budget (its capacity) shared by
  every engine and every model's weights on it. Grant before map: an allocation either fits in the
  free pages of every device it touches, or nothing changes and the caller gets ``False``.
- An engine's KV is a count of blocks; the pages it maps on a device cover
  ``blocks * block_bytes`` rounded up to whole pages (blocks pack densely, as the pool packs them),
  so pages empty out and return to the device as soon as blocks are freed.
- A per-engine limit (``SetKVQuota``) caps its KV bytes on every device, like the ledger's limit.
- Weights of a model are mapped whole on activation and unmapped whole on eviction.
- *Claims* are bytes promised but not yet mapped (weights of an activation waiting for memory,
  prompts dispatched but not yet scheduled); they are reported to the policy as mapped so admission
  does not hand the same memory out twice, but a real allocation may still use them.
- An engine's prefix cache keeps the blocks no request holds in memory nobody has mapped (they are
  not counted here); it registers a *shrink watcher* that is called whenever the free pages shrink,
  so it can evict what no longer fits (engine.py).
"""

from __future__ import annotations

from collections.abc import Callable

from prism_serve.sim.errors import SimStateError

__all__ = ["SimDevice"]


class SimDevice:
    __slots__ = (
        "capacity_bytes",
        "changed",
        "claims",
        "kv_pages",
        "name",
        "page_size",
        "shrink_watchers",
        "used_pages",
        "version",
        "weight_pages",
    )

    def __init__(
        self, name: str, capacity_bytes: int, page_size: int, changed: dict[str, None] | None = None
    ) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.page_size = page_size
        self.used_pages = 0
        self.weight_pages: dict[str, int] = {}  # model -> pages of its weights here
        self.kv_pages: dict[str, int] = {}  # model -> pages of its engine's KV here
        self.claims: dict[str, int] = {}  # owner key -> bytes promised, not mapped
        self.version = 0  # bumps on every change, so the simulator can reuse an unchanged snapshot
        # where the device writes its name when it changes (the simulator's snapshot builder reads
        # and clears it, instead of asking every device at every snapshot)
        self.changed = changed
        # engine name -> called after the free pages shrank (prefix caches evict what no longer fits)
        self.shrink_watchers: dict[str, Callable[[], None]] = {}

    def _shrank(self) -> None:
        for watcher in self.shrink_watchers.values():
            watcher()

    def touch(self) -> None:
        self.version += 1
        if self.changed is not None:
            self.changed[self.name] = None

    @property
    def total_pages(self) -> int:
        return self.capacity_bytes // self.page_size

    @property
    def free_pages(self) -> int:
        return self.total_pages - self.used_pages

    @property
    def mapped_bytes(self) -> int:
        """What the policy sees: mapped pages plus outstanding claims, at most the capacity."""
        return min(self.capacity_bytes, self.used_pages * self.page_size + sum(self.claims.values()))

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size)

    # -- weights ----------------------------------------------------------------------------------

    def map_weights(self, model: str, nbytes: int) -> bool:
        pages = self.pages_for(nbytes)
        if model in self.weight_pages:
            raise SimStateError(f"{model}: weights already mapped on {self.name}")
        if pages > self.free_pages:
            return False
        self.weight_pages[model] = pages
        self.used_pages += pages
        self.touch()
        if self.shrink_watchers:
            self._shrank()
        return True

    def unmap_weights(self, model: str) -> None:
        self.used_pages -= self.weight_pages.pop(model, 0)
        self.touch()

    # -- KV -----------------------------------------------------------------------------------------

    def kv_delta_pages(self, model: str, kv_bytes: int) -> int:
        return self.pages_for(kv_bytes) - self.kv_pages.get(model, 0)

    def set_kv(self, model: str, kv_bytes: int) -> None:
        """Map or unmap pages so the engine of ``model`` holds exactly enough for ``kv_bytes``."""
        pages = self.pages_for(kv_bytes)
        old = self.kv_pages.get(model, 0)
        if pages == old:
            return
        self.touch()
        self.used_pages += pages - old
        if pages:
            self.kv_pages[model] = pages
        else:
            self.kv_pages.pop(model, None)
        if pages > old and self.shrink_watchers:
            self._shrank()

    def kv_mapped_bytes(self, model: str) -> int:
        return self.kv_pages.get(model, 0) * self.page_size

    def claim(self, key: str, nbytes: int) -> None:
        """Set the bytes ``key`` has promised here (0 drops the claim)."""
        if self.claims.get(key, 0) == nbytes:
            return
        self.touch()
        if nbytes > 0:
            self.claims[key] = nbytes
        else:
            self.claims.pop(key, None)
