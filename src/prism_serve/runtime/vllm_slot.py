"""A vLLM worker's engine between activations, and the memory of the model it serves.

A worker started with ``--engine vllm`` (runtime/workers.py starts it with the vLLM environment's
Python) keeps one ``VllmEngine`` built: the first activation of a model shape builds it over dummy
weights (seconds: vLLM's start), later activations of that shape only load weights into it. Every
byte the active model holds is in the device ledger under the model's two accounts, and an evicted
model leaves nothing there (engine/vllm_engine.py says where each byte lives):

- weight account: the pages of the data parameters in the worker's weight range, plus the packed
  linear weights vLLM keeps itself, granted as bytes (estimated as the checkpoint's bytes less the
  data parameters': the packing stores the same numbers in another order);
- KV account: the pages of vLLM's KV buffer in the worker's KV range, all mapped while active.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.vllm_engine import VllmEngine, shape_key
from prism_serve.memory.ledger import Account
from prism_serve.memory.spare import grant_waiting
from prism_serve.memory.vmm import VirtualRange
from prism_serve.runtime.loading import DeviceMemoryExhaustedError, map_weight_pages, unmap_weight_pages

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class VllmMemory:
    """What the active vLLM model holds; ``close()`` gives all of it back (the engine stays built)."""

    engine: VllmEngine
    weight_range: VirtualRange
    kv_range: VirtualRange
    weight_account: Account
    kv_account: Account
    weight_pages: int
    kv_pages: int
    packed_bytes: int
    closed: bool = False

    @property
    def block_bytes(self) -> int:
        return self.engine.block_bytes

    @property
    def num_total_blocks(self) -> int:
        return self.engine.num_kv_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.engine.num_used_blocks

    def shrink_buffer(self) -> int:
        return 0  # the whole buffer stays mapped while the model is active

    def set_limit(self, limit_bytes: int | None) -> None:
        """The buffer's size was fixed when the engine was built; a limit does not move it."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine.abort_all()
        self.engine.unload()
        gc.collect()  # the packed weights' last references go with their closures
        self.weight_account.release(self.packed_bytes)
        unmap_weight_pages(self.weight_range, self.weight_account, self.weight_pages)
        unmap_weight_pages(self.kv_range, self.kv_account, self.kv_pages)


class VllmSlot:
    """The one vLLM engine of a worker, rebuilt only when a model of another shape activates."""

    def __init__(self, weight_range: VirtualRange, kv_range: VirtualRange, loader) -> None:
        self.weight_range = weight_range
        self.kv_range = kv_range
        self.loader = loader  # the worker's thread pool (maps pages in parallel)
        self.engine: VllmEngine | None = None
        self.key: tuple | None = None
        self.builds = 0

    def activate(
        self,
        source: str,
        config: EngineConfig,
        kv_bytes: int,
        tensors: dict[str, torch.Tensor],
        checkpoint_bytes: int,
        weight_account: Account,
        kv_account: Account,
    ) -> tuple[VllmEngine, VllmMemory, float]:
        """Serve the model whose checkpoint tensors are ``tensors`` (views of the host cache file).
        Returns the engine, its memory, and the seconds spent building vLLM's engine (0 when the
        pooled one was reused). On failure nothing stays granted or mapped."""
        key = (shape_key(source), config, kv_bytes)
        if self.engine is not None and self.key != key:
            self.drop()
        built_s = 0.0
        kv_pages = weight_pages = packed = 0
        engine = self.engine
        try:
            if engine is None:
                t0 = time.monotonic()
                engine, kv_pages = self._build(source, config, kv_bytes, kv_account)
                self.engine, self.key = engine, key
                weight_pages = self._map(self.weight_range, weight_account, engine.parameter_bytes())
                engine.move_parameters(self.weight_range.as_tensor())
                built_s = time.monotonic() - t0
            else:
                kv_pages = self._map(self.kv_range, kv_account, engine.kv_bytes)
                weight_pages = self._map(self.weight_range, weight_account, engine.parameter_bytes())
            need = max(0, checkpoint_bytes - engine.parameter_bytes())
            if not grant_waiting(weight_account, need):
                raise DeviceMemoryExhaustedError(
                    f"the {self.weight_range.device} ledger cannot grant {need} bytes for packed weights"
                )
            packed = need
            engine.load(tensors.items())
        except BaseException:
            if engine is not None:
                engine.unload()
            weight_account.release(packed)
            if weight_pages:
                unmap_weight_pages(self.weight_range, weight_account, weight_pages)
            if kv_pages:
                unmap_weight_pages(self.kv_range, kv_account, kv_pages)
            raise
        memory = VllmMemory(
            engine,
            self.weight_range,
            self.kv_range,
            weight_account,
            kv_account,
            weight_pages,
            kv_pages,
            packed,
        )
        return engine, memory, built_s

    def _map(self, vrange: VirtualRange, account: Account, num_bytes: int) -> int:
        return map_weight_pages(vrange, account, num_bytes, self.loader)[0] if num_bytes else 0

    def _build(
        self, source: str, config: EngineConfig, kv_bytes: int, kv_account: Account
    ) -> tuple[VllmEngine, int]:
        """The engine over dummy weights, its KV pages mapped (and granted) during the build; returns
        the engine and those pages."""
        mapped = [0]

        def map_kv(num_bytes: int) -> None:
            mapped[0] = self._map(self.kv_range, kv_account, num_bytes)

        try:
            engine = VllmEngine.build(source, config, self.kv_range, kv_bytes, map_kv)
        except BaseException:
            if mapped[0]:
                unmap_weight_pages(self.kv_range, kv_account, mapped[0])
            raise
        self.builds += 1
        return engine, mapped[0]

    def drop(self) -> None:
        """Tear the built engine down (a model of another shape needs the ranges)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.key = None
            gc.collect()
