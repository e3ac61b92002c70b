"""The built-in engine's slot in a worker (runtime/engine_slot.py).

An activation maps the model's weight pages in the worker's weight range (granted by the device
ledger; spare pages already mapped there are taken first, memory/spare.py), copies the host cache
file into them in parallel chunks, builds the model over views of those pages (no copy), lays an
``ElasticKVPool`` with this model's block size out in the reserved KV range (the paper's "aligning
the reserved virtual space to the new model") and builds the engine. Nothing is kept between
models but the spare weight pages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import msgspec
import torch

from prism_serve.engine.kept_prefixes import restore_prefixes, save_prefixes
from prism_serve.engine.kv_cache import KVCache, KVGroups
from prism_serve.engine.llm_engine import LLMEngine, torch_dtype
from prism_serve.engine.models import model_from_packed
from prism_serve.engine.tensor_parallel import (
    Leader,
    ShmAllReduce,
    agree_min,
    all_reduce_over,
    join_group,
    leave_group,
)
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.engine.weights import LoadedWeights
from prism_serve.memory.kv_pool import ElasticKVPool, FixedKVPool, PoolConfig
from prism_serve.memory.ledger import Account, DeviceMemoryExhaustedError
from prism_serve.memory.spare import SparePages
from prism_serve.memory.vmm import VirtualRange
from prism_serve.runtime import messages as msg
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.engine_slot import Loaded
from prism_serve.runtime.loading import map_weight_pages, parallel_copy, tensor_views, unmap_weight_pages
from prism_serve.runtime.models import ActivationError
from prism_serve.runtime.weight_cache import config_from_dict

__all__ = ["BuiltinSlot"]

# what a tensor parallel rank's activation came to, agreed as the smallest over the ranks
_FAILED, _NO_MEMORY, _OK = -1, 0, 1

logger = logging.getLogger(__name__)


class BuiltinSlot:
    kind = "builtin"
    needs_tokenizer = True
    traces_steps = True

    def __init__(
        self,
        device: DeviceSpec,
        weight_range: VirtualRange,
        kv_range: VirtualRange,
        spare: SparePages,
        loader: ThreadPoolExecutor,
        namespace: str | None,
        record_steps: bool,
    ) -> None:
        self.device = device
        self.weight_range = weight_range
        self.kv_range = kv_range
        self.spare = spare  # weight pages kept mapped between models and made ahead of time
        self.loader = loader  # the worker's threads: pages mapped and chunks copied in parallel
        self.namespace = namespace
        self.record_steps = record_steps  # the engine keeps each step's batch shape (PRISM_STEP_TRACE)
        self._reduce: Callable[[torch.Tensor], None] | None = None  # a tensor parallel rank's sums
        self._joiner = ThreadPoolExecutor(1, thread_name_prefix="prism-tp-join")
        self._served: Loaded | None = None  # the model activated here, one rank alone (poll)
        self._cached_blocks = 0  # its prefix cache's unheld blocks when the ledger was last told

    def build_ahead(self, shape: msg.EngineShape) -> None:
        pass  # the engine is built per model, over its weights

    def build_ahead_for(self, m: msg.ActivateModel, shapes: Iterable[msg.EngineShape]) -> None:
        pass

    def built(self) -> list[str]:
        return []

    def activate(
        self,
        m: msg.ActivateModel,
        host: torch.Tensor,
        weight_account: Account,
        kv_account: Account,
        tokenizer: Callable[[str], Tokenizer],
    ) -> Loaded:
        if m.tp_size > 1:
            return self._activate_rank(m, host, weight_account, kv_account, tokenizer)
        self._served = self._activate(m, host, weight_account, kv_account, tokenizer)
        self._cached_blocks = 0
        return self._served

    def _activate_rank(
        self,
        m: msg.ActivateModel,
        host: torch.Tensor,
        weight_account: Account,
        kv_account: Account,
        tokenizer: Callable[[str], Tokenizer],
    ) -> Loaded:
        """One rank of a tensor parallel model: join the ranks' group (on a thread of its own,
        while this one maps and copies the rank's shard as for any model; its KV fixed:
        ``m.kv_blocks`` blocks), then agree with the other ranks whether every one of them made
        it. If any did not, every rank gives back what it mapped and raises:
        DeviceMemoryExhaustedError where only memory was short (the controller retries), else the
        rank's own error or ActivationError."""
        t0 = time.monotonic()
        if self.device.is_cuda:
            torch.cuda.set_device(self.device.local_name)  # NCCL binds the group to it
        joining = self._joiner.submit(self._join, m)
        loaded: Loaded | None = None
        try:
            outcome, error = _OK, None
            try:
                loaded = self._activate(m, host, weight_account, kv_account, tokenizer, joining)
            except Exception as e:
                outcome, error = (_NO_MEMORY if isinstance(e, DeviceMemoryExhaustedError) else _FAILED), e
            group = joining.result()  # no group: nobody to agree with (the others time out too)
            worst = agree_min(outcome, group)  # also the barrier the shared memory sums wait for
            if isinstance(self._reduce, ShmAllReduce):
                self._reduce.connect()
            if m.tp_rank == 0 and m.tp_init.startswith("file://"):  # every rank has joined: not needed
                Path(m.tp_init.removeprefix("file://")).unlink(missing_ok=True)
            if error is not None:
                raise error
            if worst == _NO_MEMORY:
                raise DeviceMemoryExhaustedError(f"{m.model}: another rank's device is short of memory")
            if worst != _OK:
                raise ActivationError(f"{m.model}: another rank failed to activate")
        except BaseException:
            if loaded is not None:  # made it, alone: the others will not follow, close without them
                loaded.engine.lost = True
                self.release(loaded, weight_account)  # leaves the group
            else:
                joining.exception()  # wait: the group may still be forming
                self._leave()
            raise
        # the group's forming and the wait for the slowest rank count as mapping
        loaded.map_s = time.monotonic() - t0 - loaded.copy_s - loaded.ready_s
        return loaded

    def _join(self, m: msg.ActivateModel):
        """Join the group of ``m``'s ranks and open its sums (``self._reduce``); the group."""
        shm = not self.device.is_cuda and m.tp_init.startswith("file://")
        path = m.tp_init.removeprefix("file://") + ".ar"
        slot = 0
        if shm:  # between CPU devices: through shared memory, sized for a step's hidden states
            element = torch.empty((), dtype=torch_dtype(m.engine)).element_size()
            tokens = max(m.engine.max_num_batched_tokens, m.engine.max_num_seqs)
            slot = tokens * config_from_dict(m.config).hidden_size * element
            if m.tp_rank == 0:
                ShmAllReduce.create(path, m.tp_size, slot)  # before the group forms: before any opens it
        group = join_group(m.tp_init, m.tp_rank, m.tp_size, self.device.name)
        if shm:
            self._reduce = ShmAllReduce(path, m.tp_rank, m.tp_size, slot, group)
        else:
            self._reduce = all_reduce_over(group)
        return group

    def _activate(
        self,
        m: msg.ActivateModel,
        host: torch.Tensor,
        weight_account: Account,
        kv_account: Account,
        tokenizer: Callable[[str], Tokenizer],
        joining: Future | None = None,
    ) -> Loaded:
        """Map, copy and build ``m``; a tensor parallel rank's group (``joining``) is awaited only
        to build the engine, so it forms while the shard is copied."""
        t0 = time.monotonic()
        # the weights, then (engine.max_loras) the adapter slots: one grant, one set of pages
        num_pages, reused = map_weight_pages(
            self.weight_range, weight_account, m.weight_bytes + m.adapter_bytes, self.loader, self.spare
        )
        try:
            t_map = time.monotonic()
            flat = self.weight_range.as_tensor()
            copied = parallel_copy(host, flat, m.tensors, self.loader, m.chunk_bytes)
            t_copy = time.monotonic()
            lora = None
            if m.adapter_bytes:
                start = -(-m.weight_bytes // msg.ADAPTER_ALIGN) * msg.ADAPTER_ALIGN
                lora = flat[start : m.weight_bytes + m.adapter_bytes]
            group = joining.result() if joining is not None else None
            engine, pool = self._build(m, flat, kv_account, tokenizer(m.tokenizer_path), lora, group)
        except BaseException:
            unmap_weight_pages(self.weight_range, weight_account, num_pages, self.spare)
            raise
        t_ready = time.monotonic()
        element = torch.empty((), dtype=torch_dtype(engine.config)).element_size()
        return Loaded(
            Leader(engine, group) if m.tp_size > 1 and m.tp_rank == 0 else engine, pool, t_map - t0,
            t_copy - t_map, t_ready - t_copy, copied, reused, num_pages - reused, "copy", False,
            engine.model_config.kv_bytes_per_token(element), num_pages, m.tp_rank, m.tp_size,
        )  # fmt: skip

    def _build(
        self, m: msg.ActivateModel, flat: torch.Tensor, kv_account: Account, tokenizer: Tokenizer,
        lora_storage: torch.Tensor | None = None, group=None,
    ) -> tuple[LLMEngine, ElasticKVPool | FixedKVPool]:  # fmt: skip
        config = config_from_dict(m.config)
        engine_config = msgspec.structs.replace(
            m.engine,
            kv_cache_bytes=self.kv_range.size,
            device=self.device.local_name if self.device.is_cuda else "cpu",
        )
        dtype = torch_dtype(engine_config)
        max_len = engine_config.resolve_max_model_len(config)
        model = model_from_packed(config, tensor_views(flat, m.tensors), dtype, max_len)
        groups = KVGroups.of(config, max_len, engine_config.windowed_kv)  # as the engine splits its KV
        block_bytes = KVCache.block_bytes(config, engine_config.block_size, dtype, groups)
        pool: ElasticKVPool | FixedKVPool
        if group is not None:  # a rank's scheduler must see the blocks every other rank sees
            pool = FixedKVPool(self.kv_range, block_bytes, m.kv_blocks, kv_account)
        else:
            pool = ElasticKVPool(
                self.kv_range,
                block_bytes,
                kv_account,
                PoolConfig(
                    device=self.device.name,
                    page_size=self.kv_range.page_size,
                    limit_bytes=m.kv_limit_bytes,
                    ledger_namespace=self.namespace,
                ),
            )
        try:
            weights = LoadedWeights(config, {}, tokenizer, m.source, m.synthetic)
            engine = LLMEngine(
                engine_config, weights=weights, allocator=pool, model=model, lora_storage=lora_storage,
                reduce=self._reduce if group is not None else None,
            )  # fmt: skip
            engine.record_step_batches = self.record_steps
        except BaseException:
            pool.close()
            raise
        return engine, pool

    def release(self, loaded: Loaded, weight_account: Account) -> None:
        if loaded is self._served:
            self._served = None
        try:
            loaded.engine.close()  # rank 0 of a tensor parallel model: ends the other ranks' loops
        finally:
            loaded.kv.close()  # unmaps every KV page and returns its bytes to the ledger
            loaded.engine = None  # type: ignore[assignment]  # no tensor view over the pages may outlive them
            unmap_weight_pages(self.weight_range, weight_account, loaded.weight_pages, self.spare)
            if loaded.world > 1:
                self._leave()

    def _leave(self) -> None:
        """This rank's part of its group goes (its shared memory sums too)."""
        if isinstance(self._reduce, ShmAllReduce):
            self._reduce.close()
        self._reduce = None
        leave_group()

    def keep_prefixes(self, loaded: Loaded, path: str, max_bytes: int, fingerprint: str) -> int:
        engine = loaded.engine
        # a tensor parallel rank holds a shard of each block: nothing kept (it is never _served)
        if loaded is not self._served or not isinstance(engine, LLMEngine) or engine.prefix_cache is None:
            return 0
        return save_prefixes(engine.prefix_cache, engine.kv_cache, path, max_bytes, fingerprint)

    def restore_prefixes(self, loaded: Loaded, path: str, fingerprint: str) -> int:
        engine = loaded.engine
        if loaded is not self._served or not isinstance(engine, LLMEngine) or engine.prefix_cache is None:
            return 0
        return restore_prefixes(engine.prefix_cache, engine.kv_cache, path, fingerprint)

    def poll(self) -> None:
        """Cached KV is the first memory given back: while a refused grant on the device waits for
        memory, or the model's KV is over its limit, drop prefix-cached blocks (least recently used
        first, a page's worth at a time) until enough pages emptied; and keep the ledger's count of
        what the cache could give back current. A tensor parallel model's ranks must keep identical
        caches, and its pool is fixed: it gives nothing back here (it is never ``_served``)."""
        loaded = self._served
        if loaded is None:
            return
        engine, pool = loaded.engine, loaded.kv
        cached = engine.num_cached_blocks
        wanted = max(self.spare.ledger.reclaim_wanted(), pool.over_limit_bytes) if cached else 0
        if wanted > 0:
            held = pool.held_bytes
            per_page = max(1, pool.page_size // pool.block_bytes)
            while engine.num_cached_blocks and held - pool.held_bytes < wanted:
                engine.drop_cached(per_page)
                pool.trim(0)
            logger.info("gave back %d bytes of cached KV", held - pool.held_bytes)
            cached = -1  # recount below
        if cached != self._cached_blocks:
            self._cached_blocks = engine.num_cached_blocks
            freed = pool.bytes_freed_by(engine.cached_blocks()) if self._cached_blocks else 0
            pool.account.set_reclaimable(freed)

    def close(self) -> None:
        self._joiner.shutdown()
