"""A vLLM worker's engine between activations, and the memory of the model it serves.

A worker started with ``--engine vllm`` (runtime/workers.py starts it with the vLLM environment's
Python) keeps one ``VllmEngine`` built: its Prepare builds it over dummy weights for the shape the
controller names (seconds: vLLM's start, in the worker's idle time; ``prepare``), else the first
activation of a model shape does; later activations of that shape only load weights into it. Every
byte the active model holds is in the device ledger under the model's two accounts, and an evicted
model leaves nothing under them (what the worker keeps of it is under a spare entry, below;
engine/vllm_engine.py says where each byte lives):

- weight account: the pages of the data parameters (and, for a base with ``max_loras``, of vLLM's
  adapter slots) in the worker's weight range, plus the packed
  linear weights vLLM keeps itself, granted as bytes (estimated as the checkpoint's bytes less the
  data parameters': the packing stores the same numbers in another order);
- KV account: the pages of the KV blocks in use, mapped a step ahead of the requests that need them
  (memory/strided_kv.py), so a vLLM model's KV grows into memory a neighbour freed and shrinks when
  its requests finish, down to the blocks vLLM's prefix cache keeps. Those pages are recorded as
  reclaimable, and a refused grant elsewhere on the device or the model's KV limit makes the worker
  give them back within a poll of its loop (``VllmSlot.poll``).

Loading weights into vLLM on CPU repacks every linear layer (about 0.2 s for SmolLM2 here, by the
load plan of engine/vllm_load.py). So the last evicted model's weights stay with the worker as they
were: the packed linears, the weight pages holding the data parameters and the KV pages of vLLM's
null block, all under a ledger entry registered as spare (counted as used, since they are memory,
but reclaimable). That model's next activation on this worker moves their bytes back to its
accounts and swaps the packed linears in: no page is made, nothing is copied or repacked. Another
model of the same shape takes them over the same way and loads its own weights into them (its
data parameters copied into those pages, each linear repacked in place of the kept one): no page
is made either. A refused grant anywhere on the device (``DeviceLedger.reclaim_wanted``) makes the
worker drop them within a poll of its loop, and so does an activation of another shape, and the
worker's end.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.engine.vllm_engine import VllmEngine, engine_key, vllm_environment
from prism_serve.memory.ledger import Account, DeviceLedger, LedgerError
from prism_serve.memory.spare import grant_waiting
from prism_serve.memory.vmm import VirtualRange
from prism_serve.runtime import messages as msg
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.engine_slot import Loaded
from prism_serve.runtime.loading import (
    DeviceMemoryExhaustedError,
    map_weight_pages,
    tensor_views,
    unmap_weight_pages,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Kept:
    """The last evicted model's weights, as they were: its packed linears by module, and how many
    weight pages (from 0) still hold its data parameters."""

    weights: str  # its host cache file
    packed: dict[str, Any]
    packed_bytes: int
    weight_pages: int


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
    slot: VllmSlot
    weights: str  # the host cache file: what the kept weights are kept under
    closed: bool = False
    how: str = "kept"  # how its weights came in (VllmSlot.activate)
    reused_pages: int = 0  # of weight_pages, those it took over already mapped (kept weights')

    @property
    def block_bytes(self) -> int:
        return self.engine.block_bytes

    @property
    def num_total_blocks(self) -> int:
        return self.engine.num_kv_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks holding KV: in use, or kept by the prefix cache (as the built-in pool counts them)."""
        return self.engine.num_used_blocks + self.engine.num_cached_blocks

    @property
    def held_bytes(self) -> int:
        """The KV pages mapped now (the weights are reported on their own)."""
        return self.slot.kv_range.mapped_bytes

    def shrink_buffer(self) -> int:
        """Idle: keep only the pages of the null block and of the prefix cache's blocks; returns
        the bytes given back."""
        return self.engine.shrink_idle()

    def set_limit(self, limit_bytes: int | None) -> None:
        self.kv_account.set_limit(limit_bytes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine.abort_all()
        if self.engine.kv.watermark > 1:
            self.engine.kv.resize(1)  # the null block's pages: kept, or unmapped below
        if not self.slot.keep(self):
            self.slot.give_back(self.weight_account, self.packed_bytes, self.weight_pages)


class VllmSlot:
    """The one vLLM engine of a worker, rebuilt only when a model of another shape activates (the
    worker's ``EngineSlot``, runtime/engine_slot.py)."""

    kind = "vllm"
    needs_tokenizer = False  # vLLM tokenizes for itself
    traces_steps = False

    def __init__(
        self,
        device: DeviceSpec,
        weight_range: VirtualRange,
        kv_range: VirtualRange,
        loader: ThreadPoolExecutor,
        ledger: DeviceLedger,
        owner: str,
    ) -> None:
        vllm_environment(device.cores)  # before vLLM is first imported, at the first build
        self.weight_range = weight_range
        self.kv_range = kv_range
        self.loader = loader  # the worker's thread pool (maps pages in parallel)
        self.ledger = ledger
        self.owner = owner  # the worker's id: its kept weights' ledger entry is "<owner> vllm kept"
        self.engine: VllmEngine | None = None
        self.key: str | None = None  # engine_key of the built engine
        self.kept: _Kept | None = None
        self._kept_account: Account | None = None

    # ---- the worker's EngineSlot ----------------------------------------------------------------

    def build_ahead(self, shape: msg.EngineShape) -> None:
        self.prepare(shape.source, shape.engine, shape.compiled)

    def build_ahead_for(self, m: msg.ActivateModel, shapes: Iterable[msg.EngineShape]) -> None:
        """An activation that reaches a fresh worker before its Prepare built the engine (a model
        activated at start-up, say): the Prepare's build runs first when it is for this model's
        shape, as it would have (compiled, under ``vllm_compile``; the activation waits for it as
        it would wait for a build of its own), else it is dropped (the activation builds the
        engine it needs, eager)."""
        want = engine_key(m.source, m.engine)
        for shape in shapes:
            if self.engine is None and engine_key(shape.source, shape.engine) == want:
                try:
                    self.prepare(shape.source, shape.engine, shape.compiled)
                except Exception as e:  # the activation builds its own
                    logger.warning("building the engine ahead of %s failed: %s", m.model, e)

    def built(self) -> list[str]:
        return [self.key] if self.key is not None else []

    def activate(
        self,
        m: msg.ActivateModel,
        host: torch.Tensor,
        weight_account: Account,
        kv_account: Account,
        tokenizer: Callable[[str], Tokenizer],
    ) -> Loaded:
        t0 = time.monotonic()
        engine, memory, built_s, how = self.load(
            m.source, m.engine, m.cache_path, tensor_views(host, m.tensors), m.weight_bytes,
            weight_account, kv_account,
        )  # fmt: skip
        took = time.monotonic() - t0
        return Loaded(
            engine, memory, 0.0, took - built_s, built_s, m.weight_bytes, memory.reused_pages,
            memory.weight_pages - memory.reused_pages, how, engine.compiled, engine.kv_bytes_per_token,
        )  # fmt: skip

    def release(self, loaded: Loaded, weight_account: Account) -> None:
        loaded.engine.close()
        loaded.kv.close()  # the model's memory is kept as spare, or given back (VllmMemory.close)

    def keep_prefixes(self, loaded: Loaded, path: str, max_bytes: int, fingerprint: str) -> int:
        return 0  # vLLM's own block pool: its cached prefixes go with the model (not kept yet)

    def restore_prefixes(self, loaded: Loaded, path: str, fingerprint: str) -> int:
        return 0

    def poll(self) -> None:
        if self.kept is not None and self.ledger.reclaim_wanted() > 0:
            self.drop_kept()  # kept weights are spare memory: a grant elsewhere waits
        engine = self.engine
        if engine is not None and engine.reclaimable_bytes > 0 and engine.kv.account is not None:
            # cached KV blocks are the first KV memory given back: to a grant that waits for
            # memory, or under the model's KV limit
            entry = engine.kv.account.entry()
            over = 0 if entry.limit_bytes is None else entry.mapped_bytes - entry.limit_bytes
            wanted = max(self.ledger.reclaim_wanted(), over)
            if wanted > 0:
                engine.give_back_cached(wanted)

    def close(self) -> None:
        self.drop()

    # ---- the engine and its weights -------------------------------------------------------------

    def load(
        self,
        source: str,
        config: EngineConfig,
        weights: str,
        tensors: dict[str, torch.Tensor],
        checkpoint_bytes: int,
        weight_account: Account,
        kv_account: Account,
    ) -> tuple[VllmEngine, VllmMemory, float, str]:
        """Serve the model whose checkpoint tensors are ``tensors`` (views of the host cache file
        ``weights``). Returns the engine, its memory, the seconds spent building vLLM's engine
        (0 when the pooled one was reused), and how the weights came in: "kept" (this worker's
        own, swapped back), "plan" or "reload" (``VllmEngine.load``). On failure nothing stays
        granted or mapped."""
        key = engine_key(source, config)  # any model of this shape and these knobs, whatever its name
        if self.engine is not None and self.key != key:
            self.drop()
        if self.kept is not None and self.kept.weights == weights:
            engine, memory = self._swap_in(source, weight_account, kv_account)
            return engine, memory, 0.0, "kept"
        if self.kept is not None:  # another model of this shape (a fine-tune of one base, say)
            engine, memory = self._swap_in(source, weight_account, kv_account)
            memory = self._load_over(memory, weights, tensors, checkpoint_bytes)
            return engine, memory, 0.0, memory.how
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
            how = engine.load(tensors)
        except BaseException:
            if engine is not None:
                self.give_back(weight_account, packed, weight_pages)
            raise
        memory = VllmMemory(
            engine, self.weight_range, weight_account, kv_account, weight_pages, packed, self, weights
        )
        return engine, memory, built_s, how

    def _load_over(
        self, memory: VllmMemory, weights: str, tensors: dict[str, torch.Tensor], checkpoint_bytes: int
    ) -> VllmMemory:
        """Load another model's weights over the kept ones just swapped in: their weight pages and
        the null block's KV pages (already mapped, moved to this model's accounts: no page made)
        take its data parameters, and each linear is repacked in turn, replacing the kept one. On
        failure nothing stays granted or mapped."""
        engine = memory.engine
        try:
            need = max(0, checkpoint_bytes - engine.parameter_bytes())
            more = need - memory.packed_bytes
            if more > 0 and not grant_waiting(memory.weight_account, more):
                raise DeviceMemoryExhaustedError(
                    f"the {self.weight_range.device} ledger cannot grant {need} bytes for packed weights"
                )
            memory.weight_account.release(max(0, -more))
            memory.packed_bytes = need
            memory.how = engine.load(tensors)
        except BaseException:
            memory.closed = True
            self.give_back(memory.weight_account, memory.packed_bytes, memory.weight_pages)
            raise
        memory.weights = weights
        return memory

    def prepare(self, source: str, config: EngineConfig, compiled: bool = False) -> bool:
        """Build the engine for ``source``'s shape ahead of any activation (a Prepare, in the
        worker's idle time), so that the first activation of a model of that shape is a weight
        load; ``compiled``: with vLLM's torch.compile (tens of seconds here, which only an idle
        worker can spend: a build inside an activation is eager). The build's pages (vLLM's null
        KV block, the dummy data parameters) are granted only from free memory, asking no one for
        spare pages, and all go back after it, as at an eviction. False (nothing done) while the
        worker holds an engine or kept weights, or when the ledger has no room for the build; then
        the first activation builds the engine."""
        if self.engine is not None or self.kept is not None:
            return False
        account = self.ledger.account(f"{self.owner} vllm prepare")
        account.reclaim = False
        engine = None
        try:
            try:
                engine = VllmEngine.build(source, config, self.kv_range, account, compiled)
            except LedgerError:
                return False
            try:
                pages = self._map_weights(account, engine)
            except DeviceMemoryExhaustedError:
                engine.kv.close()
                engine.close()
                return False
            self.engine = engine
            try:
                engine.move_parameters(self.weight_range.as_tensor())
                engine.learn_load_plan(source)  # so that the first activation loads by the plan
            finally:
                self.give_back(account, 0, pages)  # KV pages, dummy packed linears, weight pages
        except BaseException:
            if engine is not None:
                engine.kv.close()
                engine.close()
            self.engine = None
            raise
        finally:
            account.close()
            gc.collect()
        self.key = engine_key(source, config)
        return True

    def _map_weights(self, account: Account, engine: VllmEngine) -> int:
        n = engine.parameter_bytes() + engine.lora_bytes()  # data parameters, then adapter slots
        return map_weight_pages(self.weight_range, account, n, self.loader)[0] if n else 0

    # ---- kept weights -------------------------------------------------------------------------

    def keep(self, memory: VllmMemory) -> bool:
        """At eviction: keep the model's weights (packed linears, weight pages) and the null
        block's KV pages where they are, their bytes moved to the spare entry. False (nothing kept)
        while a grant elsewhere waits for memory."""
        engine = self.engine
        if engine is None or engine is not memory.engine or self.ledger.reclaim_wanted() > 0:
            return False
        if os.environ.get("PRISM_VLLM_KEEP", "1") == "0":  # off: every activation reloads (to measure it)
            return False
        if self._kept_account is None:
            self._kept_account = self.ledger.account(f"{self.owner} vllm kept", spare=True)
        keeper = self._kept_account
        weight_bytes = memory.weight_pages * self.weight_range.page_size + memory.packed_bytes
        if not memory.weight_account.move_to(keeper, weight_bytes):
            return False
        if not engine.kv.move_to(keeper):
            keeper.move_to(memory.weight_account, weight_bytes)
            return False
        self.kept = _Kept(memory.weights, engine.take_packed(), memory.packed_bytes, memory.weight_pages)
        return True

    def _swap_in(
        self, source: str, weight_account: Account, kv_account: Account
    ) -> tuple[VllmEngine, VllmMemory]:
        engine, kept, keeper = self.engine, self.kept, self._kept_account
        assert engine is not None and kept is not None and keeper is not None
        weight_bytes = kept.weight_pages * self.weight_range.page_size + kept.packed_bytes
        if not keeper.move_to(weight_account, weight_bytes):
            raise DeviceMemoryExhaustedError(f"{source}'s weight limit refuses its weights")
        if not engine.kv.move_to(kv_account):
            weight_account.move_to(keeper, weight_bytes)
            raise DeviceMemoryExhaustedError(f"{source}'s KV limit refuses its first block")
        engine.put_packed(kept.packed)
        self.kept = None
        memory = VllmMemory(
            engine, self.weight_range, weight_account, kv_account, kept.weight_pages, kept.packed_bytes,
            self, kept.weights, reused_pages=kept.weight_pages,
        )  # fmt: skip
        return engine, memory

    def drop_kept(self) -> int:
        """Give back the kept weights and their pages; returns the bytes released."""
        kept, keeper = self.kept, self._kept_account
        if kept is None or keeper is None or self.engine is None:
            return 0
        self.kept = None
        before = keeper.entry().mapped_bytes
        kept.packed.clear()  # their last references
        self.give_back(keeper, kept.packed_bytes, kept.weight_pages)
        return before - keeper.entry().mapped_bytes

    def give_back(self, account: Account, packed_bytes: int, weight_pages: int) -> None:
        """A model's memory leaves the engine: its KV pages (under whichever account holds them),
        its packed linears, and its weight pages and packed bytes under ``account``."""
        assert self.engine is not None
        self.engine.kv.close()
        self.engine.unload()
        gc.collect()  # the packed weights' last references go with their closures
        account.release(packed_bytes)
        if weight_pages:
            unmap_weight_pages(self.weight_range, account, weight_pages)

    def drop(self) -> None:
        """Tear the built engine down (a model of another shape needs the ranges)."""
        self.drop_kept()  # kept weights fit only this engine's modules
        if self.engine is not None:
            self.engine.close()
            self.engine.kv.close()
            self.engine = None
            self.key = None
            gc.collect()
