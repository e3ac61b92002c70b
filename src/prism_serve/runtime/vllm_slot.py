"""A vLLM worker's engine between activations, and the memory of the model it serves.

A worker started with ``--engine vllm`` (runtime/workers.py starts it with the vLLM environment's
Python) keeps one ``VllmEngine`` built: the first activation of a model shape builds it over dummy
weights (seconds: vLLM's start), later activations of that shape only load weights into it. Every
byte the active model holds is in the device ledger under the model's two accounts, and an evicted
model leaves nothing there (engine/vllm_engine.py says where each byte lives):

- weight account: the pages of the data parameters in the worker's weight range, plus the packed
  linear weights vLLM keeps itself, granted as bytes (estimated as the checkpoint's bytes less the
  data parameters': the packing stores the same numbers in another order);
- KV account: the pages of the KV blocks in use, mapped a step ahead of the requests that need them
  (memory/strided_kv.py), so a vLLM model's KV grows into memory a neighbour freed and shrinks when
  its requests finish.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.vllm_engine import VllmEngine, shape_key
from prism_serve.memory.ledger import Account, LedgerError
from prism_serve.memory.spare import grant_waiting
from prism_serve.memory.vmm import VirtualRange
from prism_serve.runtime.loading import DeviceMemoryExhaustedError, map_weight_pages, unmap_weight_pages


@dataclass(slots=True)
class VllmMemory:
    """What the active vLLM model holds; ``close()`` gives all of it back (the engine stays built).
    Stands where the built-in engine's ``ElasticKVPool`` stands in the worker."""

    engine: VllmEngine
    weight_range: VirtualRange
    weight_account: Account
    kv_account: Account
    weight_pages: int
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
        """Idle: keep only the null block's pages; returns the bytes given back."""
        before = self.engine.kv.mapped_bytes
        self.engine.kv.resize(1)
        return before - self.engine.kv.mapped_bytes

    def set_limit(self, limit_bytes: int | None) -> None:
        self.kv_account.set_limit(limit_bytes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine.abort_all()
        self.engine.kv.close()
        self.engine.unload()
        gc.collect()  # the packed weights' last references go with their closures
        self.weight_account.release(self.packed_bytes)
        unmap_weight_pages(self.weight_range, self.weight_account, self.weight_pages)


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
        tensors: dict[str, torch.Tensor],
        checkpoint_bytes: int,
        weight_account: Account,
        kv_account: Account,
    ) -> tuple[VllmEngine, VllmMemory, float]:
        """Serve the model whose checkpoint tensors are ``tensors`` (views of the host cache file).
        Returns the engine, its memory, and the seconds spent building vLLM's engine (0 when the
        pooled one was reused). On failure nothing stays granted or mapped."""
        key = (shape_key(source), config)
        if self.engine is not None and self.key != key:
            self.drop()
        built_s = 0.0
        weight_pages = packed = 0
        engine = self.engine
        try:
            if engine is None:
                t0 = time.monotonic()
                try:
                    engine = VllmEngine.build(source, config, self.kv_range, kv_account)
                except LedgerError as e:
                    raise DeviceMemoryExhaustedError(str(e)) from None
                self.engine, self.key = engine, key
                self.builds += 1
                weight_pages = self._map_weights(weight_account, engine)
                engine.move_parameters(self.weight_range.as_tensor())
                built_s = time.monotonic() - t0
            else:
                engine.kv.attach(kv_account)
                if not engine.kv.resize(1):
                    raise DeviceMemoryExhaustedError(f"the ledger cannot grant {source}'s first KV block")
                weight_pages = self._map_weights(weight_account, engine)
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
                engine.kv.close()
            weight_account.release(packed)
            if weight_pages:
                unmap_weight_pages(self.weight_range, weight_account, weight_pages)
            raise
        memory = VllmMemory(engine, self.weight_range, weight_account, kv_account, weight_pages, packed)
        return engine, memory, built_s

    def _map_weights(self, account: Account, engine: VllmEngine) -> int:
        n = engine.parameter_bytes()
        return map_weight_pages(self.weight_range, account, n, self.loader)[0] if n else 0

    def drop(self) -> None:
        """Tear the built engine down (a model of another shape needs the ranges)."""
        if self.engine is not None:
            self.engine.close()
            self.engine.kv.close()
            self.engine = None
            self.key = None
            gc.collect()
