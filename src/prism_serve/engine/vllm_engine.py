"""vLLM's engine inside a prism worker process, behind the interface the worker drives the built-in
engine through (``add_request``, ``step``, aborts, counts, ``close``).

Runs only in a Python environment that has vLLM (``scripts/vllm-server-env.sh`` makes one; the
controller starts vLLM workers with it, see runtime/workers.py). The engine core runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no extra server or engine process.

Memory (every byte in the device ledger):

- **KV cache.** vLLM allocates its KV cache as one buffer at build time. ``build`` hands it a view
  of the worker's reserved KV range instead (the patches of vLLM here: ``allocate_kv_cache``'s
  ``torch.zeros`` for that buffer is served from the range while the engine is built, and the block
  pool's free queue and free count are replaced on the built engine's instance; no file of vLLM is
  edited; the two stand-ins are in engine/vllm_kv.py). Pages are mapped as blocks are used
  (memory/strided_kv.py): vLLM hands out the lowest free block ids and sees only the free blocks
  below a watermark, which ``fit_pages`` moves a step ahead of the requests before each step, as
  far as the ledger allows. The tensor vLLM holds stays valid because the range's address never
  changes.
- **Prefix cache** (``EngineConfig.prefix_caching``: vLLM's automatic prefix caching). A block
  whose request ended keeps its KV and its hash in vLLM's free queue; a later request whose prompt
  starts with the same full blocks takes them back instead of computing them
  (``RequestOutput.num_cached_tokens``). The pages of cached free blocks stay mapped, even when the
  engine is idle, and are the first KV memory given back: the ledger counts them as reclaimable
  (``Account.set_reclaimable``), and a refused grant elsewhere on the device
  (``DeviceLedger.reclaim_wanted``) or the model's KV limit makes the worker shrink the watermark
  down to what the requests need (``give_back_cached``, from runtime/vllm_slot.py). Every shrink
  first evicts the cached blocks at or above the new watermark from vLLM's prefix cache
  (``StridedKVPages.before_shrink``), so no request matches a block whose pages were unmapped; a
  shrink to the null block (the model leaving the engine) empties the cache. New content still
  goes to the lowest free ids, cached or not (a cached block loses its hash as vLLM hands it out).
  A request with ``prompt_logprobs`` reads nothing from the cache (vLLM 0.32 sets its
  ``skip_reading_prefix_cache``, so every prompt position is computed); its blocks are cached for
  later requests. Requests of a LoRA adapter carry a salt naming the adapter's registration, so a
  name registered again over changed files never matches the blocks of the old one.
- **Weights.** After the build, every parameter that holds data (embeddings, norms, biases) is moved
  into the worker's reserved weight range; vLLM's CPU post-processing packs each linear layer's
  weight into a kernel format it keeps itself (``cpu_linear``). Activation maps the weight pages and
  loads the model's checkpoint tensors into them by a load plan checked against vLLM's own
  in-place ``reload_weights`` (engine/vllm_load.py; the reload where there is no plan), which
  repacks the linears; eviction drops the packed linears and unmaps the pages, unless the worker
  keeps them for the model's next activation (runtime/vllm_slot.py). The packed bytes are granted in the
  ledger beside the pages.

- **LoRA adapter slots** (a base with ``max_loras``). vLLM's LoRA layers allocate their stacked
  adapter tensors (``max_loras`` + 1 slots, the last kept zero for the base's rows, x
  ``max_lora_rank``, for every projection, the embedding and the LM head) at build time;
  ``move_parameters`` moves them into the weight range after the data parameters, so their pages
  are mapped, granted and given back with the weights (``lora_slot_bytes`` is their size, known
  before the build). Adapters go through vLLM's own LoRA support: a registered adapter is a
  ``LoRARequest`` of its PEFT directory, which vLLM reads at the adapter's first use into its LRU
  of ``max_loras`` + 1 adapters and copies into a slot. When the model leaves the engine every
  adapter is removed from vLLM (its slots' pages may go), and the next activation registers them
  again.

- **Pooling models** (``EngineConfig.pooling``: an embedder or a cross-encoder). The engine is vLLM's
  pooling runner, built with the model's pooling (a decoder checkpoint is converted to an
  embedding model by vLLM; a decoder reranker, ``score_tokens``, to a one-output classifier whose
  weight ``load`` makes from the LM head: yes row less no row). A request answers with the raw
  pooled state or head output; the server normalises or takes the sigmoid, as for the built-in
  engine. An encoder has no KV cache: vLLM allocates none, and its ``StridedKVPages`` has no
  layers, so nothing is mapped or granted for KV.

The engine itself (scheduler, compiled kernels, tokenizer) stays built between models of one shape,
which is what makes an activation a weight load and not a vLLM start.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from prism_serve.engine.config import EngineConfig, within_context
from prism_serve.engine.interface import RequestCounts
from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.sequence import RequestMetrics, RequestOutput, TokenLogprob
from prism_serve.engine.validation import check_prompt
from prism_serve.engine.vllm_kv import FromRange, LowestFirst, is_cached
from prism_serve.engine.vllm_load import (
    LoadPlan,
    checkpoint_signature,
    make_plan,
    synthetic_checkpoint,
    unused_layer,
    verify,
)
from prism_serve.errors import (
    InvalidRequestError,
    InvalidSamplingParamsError,
    UnsupportedModelError,
)
from prism_serve.memory.ledger import Account, LedgerError
from prism_serve.memory.strided_kv import StridedKVPages
from prism_serve.memory.vmm import VirtualRange

__all__ = ["VllmEngine", "engine_key", "lora_slot_bytes", "vllm_environment"]

logger = logging.getLogger(__name__)

_SHAPE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def vllm_environment(cores: Iterable[int] = ()) -> None:
    """What vLLM must read before its first import: its engine core in this process, no usage
    report, no model hub, and its OpenMP threads on this worker's cores."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines at every build and load
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM 0.32's AOT compile cache fails to load what it saved ("'function' object has no attribute
    # 'finalize_loading'") and recompiles at every start; its older cache (inductor's artifacts by
    # graph hash) loads: a compiled build from it takes about 20 s instead of about 55 s here
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    cores = sorted(cores)
    if cores:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))


def engine_key(source: str, config: EngineConfig) -> str:
    """What one built engine can serve: models with the same config and tokenizer files (fine-tunes
    of one base) and the same engine knobs share a pooled engine; only their weights differ. The
    model's name is not part of it."""
    h = hashlib.sha256()
    for name in _SHAPE_FILES:
        p = Path(source) / name
        h.update(name.encode())
        h.update(p.read_bytes() if p.is_file() else b"-")
    h.update(msgspec.json.encode(msgspec.structs.replace(config, model="")))
    return h.hexdigest()[:16]


def _lora_tensor_elements(config: ArchConfig, slots: int, rank: int) -> list[int]:
    """The elements of each stacked tensor vLLM's LoRA layers allocate for a Llama-shaped model:
    A and B of every projection of every layer, of the embedding and of the LM head."""
    out = [slots * rank * config.vocab_size, slots * rank * config.hidden_size] * 2
    for _ in range(config.num_layers):
        for fan_in, fan_out in config.projection_shapes().values():
            out += [slots * rank * fan_in, slots * rank * fan_out]
    return out


def lora_slot_bytes(config: ArchConfig, slots: int, rank: int, itemsize: int, align: int = 4096) -> int:
    """The weight-range bytes vLLM's adapter slots take once moved there (``move_parameters``)."""
    if not slots:
        return 0
    return sum(-(-n * itemsize // align) * align for n in _lora_tensor_elements(config, slots, rank))


def _quiet_rotary_reload_warning(record: logging.LogRecord) -> bool:
    """False for vLLM's warning that a rotary embedding "failed to load weights" at each reload:
    its cos/sin cache is computed, not in any checkpoint, and vLLM puts it back as it was."""
    return not (
        record.msg == "%s: Failed to load weights"
        and isinstance(record.args, tuple)
        and str(record.args[0]).endswith("RotaryEmbedding")
    )


@dataclass(slots=True)
class _Request:
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    logprobs: int | None  # the top-k asked for, per sampled and per prompt token
    prompt_logprobs: int | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_logprobs_sent: bool = False
    adapter: str | None = None


class VllmAdapters:
    """The adapters registered in a vLLM engine: each a ``LoRARequest`` of its directory."""

    def __init__(self) -> None:
        self.adapters: dict[str, Any] = {}  # name -> LoRARequest
        self._next_id = 1  # vLLM's adapter ids are positive and must not be reused for another adapter

    def register(self, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        self.adapters[name] = LoRARequest(name, self._next_id, path)
        self._next_id += 1


class VllmEngine(RequestCounts):
    """One vLLM engine, built over dummy weights of a model shape, serving one model at a time."""

    def __init__(self, engine: Any, config: EngineConfig, kv: StridedKVPages, source: str) -> None:
        self._engine = engine
        self.config = config
        self.source = source
        self.kv = kv  # the KV buffer's pages, mapped block by block as requests need them
        self.compiled = False  # built with vLLM's torch.compile (``build``)
        self._model_dtype = engine.model_config.dtype
        # checked load plans by checkpoint signature; None: none works, vLLM's reload loads it
        self._plans: dict[Any, LoadPlan | None] = {}
        core = engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self._runner = core.model_executor.driver_worker.worker.model_runner
        self._model = self._runner.get_model()
        self._drop_unused_layers()
        self.max_model_len = int(engine.model_config.max_model_len)
        self.vocab_size = int(engine.model_config.get_vocab_size())
        self._pool = self.scheduler.kv_cache_manager.block_pool
        self.num_kv_blocks = int(self._pool.num_gpu_blocks)
        self.block_bytes = kv.block_stride * kv.num_layers  # one block id in every layer
        groups = self.scheduler.kv_cache_config.kv_cache_groups
        # an encoder (bidirectional attention) has no KV cache: no group, no layer in ``kv``
        self.block_size = int(groups[0].kv_cache_spec.block_size) if groups else config.block_size
        hf_config = engine.model_config.hf_config
        # BERT's token types: a pair's second segment is type 1 (vLLM's compressed_token_type_ids)
        self._token_types = int(getattr(hf_config, "type_vocab_size", 0) or 0) > 1
        self._step_tokens = int(engine.vllm_config.scheduler_config.max_num_batched_tokens)
        self.kv_bytes_per_token = self.block_bytes // self.block_size
        # vLLM hands out the lowest free block ids and sees only the blocks below the watermark
        cached = functools.partial(is_cached, self._pool) if self._pool.enable_caching else (lambda b: False)
        self._free = LowestFirst(self._pool.blocks, self._pool.free_block_queue, cached)
        self._pool.free_block_queue = self._free
        self._pool.get_num_free_blocks = self._usable_free_blocks
        kv.before_shrink = self._forget_cached_from
        # what the ledger was last told the cached blocks' pages hold, and under which account
        self._told: tuple[Account | None, int] = (None, 0)
        self._requests: dict[str, _Request] = {}
        self.stalled = False  # the ledger refused the KV pages a waiting request needs
        self.adapters = VllmAdapters() if config.max_loras else None
        self.last_step_seqs = 0
        self.last_step_tokens = 0
        self.last_step_batch = None
        self.record_step_batches = False
        schedule = self.scheduler.schedule

        def counted_schedule(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            self.last_step_seqs = len(out.num_scheduled_tokens)
            self.last_step_tokens = int(out.total_num_scheduled_tokens)
            return out

        self.scheduler.schedule = counted_schedule  # the step's shape, for the worker's statistics

    # ---- building and activation --------------------------------------------------------------

    @classmethod
    def build(
        cls,
        source: str,
        config: EngineConfig,
        kv_range: VirtualRange,
        account: Account,
        compiled: bool = False,
    ) -> VllmEngine:
        """vLLM's engine for ``source``'s shape over dummy weights, its KV buffer the whole of
        ``kv_range`` (address space: pages are mapped as blocks are used). The pages of block 0
        (vLLM's null block, which its kernels may read) are mapped under ``account`` before vLLM
        touches the buffer; on failure nothing stays mapped. ``compiled``: vLLM's torch.compile of
        the model (its compile cache makes later builds of the shape faster), else eager. Weights
        loaded later go into the compiled graph's own parameters in place, and the packed linears
        are read through the layers' attributes at each call, so reloads and kept-weight swaps
        need no recompile."""
        import vllm.v1.worker.gpu_model_runner as runner_module
        import vllm.v1.worker.utils as worker_utils
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if _quiet_rotary_reload_warning not in reload_log.filters:
            reload_log.addFilter(_quiet_rotary_reload_warning)

        original = runner_module.allocate_kv_cache
        made: list[StridedKVPages] = []

        def allocate_in_range(kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
            tensors = kv_cache_config.kv_cache_tensors
            if not tensors:  # an encoder: vLLM keeps no KV, and neither do the pages
                made.append(StridedKVPages(kv_range, 0, 0, 1, 1))
                made[-1].attach(account)
                return original(kv_cache_config, *args, **kwargs)
            if len(tensors) != 1:
                raise UnsupportedModelError(
                    f"{source}: vLLM lays its KV cache out in {len(tensors)} buffers; prism maps one"
                )
            t = tensors[0]
            kv = StridedKVPages(
                kv_range, len(t.layers), t.layer_stride, t.block_stride, kv_cache_config.num_blocks, t.offset
            )
            kv.attach(account)
            if not kv.resize(1):
                raise LedgerError(f"the ledger cannot grant the pages of {source}'s first KV block")
            made.append(kv)
            worker_utils.torch = FromRange(kv_range.as_tensor())
            try:
                return original(kv_cache_config, *args, **kwargs)
            finally:
                worker_utils.torch = torch

        hf = _hf_config(source)  # read once: the context and a reranker's architecture
        args = EngineArgs(
            model=source, dtype=config.dtype, load_format="dummy", enforce_eager=not compiled,
            max_model_len=_max_model_len(hf, config.max_model_len), max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            # a pooling model: vLLM's own choice (an encoder has no KV to cache)
            enable_prefix_caching=config.prefix_caching if config.pooling is None else None,
            kv_cache_memory_bytes=kv_range.size,
            seed=config.seed, **_pooling_args(source, hf, config),
            # one slot more than max_loras, kept zero: ``_zero_slot_for_the_base``
            **(
                dict(enable_lora=True, max_loras=config.max_loras + 1, max_cpu_loras=config.max_loras + 1,
                     max_lora_rank=config.max_lora_rank)
                if config.max_loras
                else {}
            ),
        )  # fmt: skip
        runner_module.allocate_kv_cache = allocate_in_range
        try:
            engine = LLMEngine.from_engine_args(args)
        except BaseException:
            for kv in made:
                kv.close()
            raise
        finally:
            runner_module.allocate_kv_cache = original
        out = cls(engine, config, made[-1], source)
        out.compiled = compiled
        if config.max_loras:
            out._zero_slot_for_the_base(config.max_loras)
        return out

    def _drop_unused_layers(self) -> None:
        """Empty the layers vLLM keeps but never calls (its ``StageMissingLayer``: a pooling model's
        LM head, converted away): their weights, dummy values of the vocabulary's size allocated
        at the build (113 MB for SmolLM2 in fp32), would stay in the worker for nothing and
        outside the ledger."""
        for m in self._model.modules():
            inner = m.__dict__.get("module") if unused_layer(m) else None
            if inner is None:
                continue
            for sub in inner.modules():
                for name, p in list(sub.named_parameters(recurse=False)):
                    setattr(sub, name, torch.nn.Parameter(p.new_empty(0), requires_grad=False))
                if getattr(sub, "cpu_linear", None) is not None:
                    sub.cpu_linear = None

    def _zero_slot_for_the_base(self, max_loras: int) -> None:
        """vLLM 0.32's CPU LoRA ops (torch ops) index the stacked slots with each token's slot, -1
        for a token without an adapter, which reads the last slot: with every slot holding an
        adapter, the base's rows of a mixed batch were computed with the last slot's adapter. The
        engine is built with one slot more, and vLLM's scheduler and LoRA manager are limited to
        ``max_loras`` here, so that last slot is never filled and the base's rows add zero."""
        from vllm.lora.model_manager import AdapterLRUCache

        manager = self._runner.lora_manager._adapter_manager
        self._engine.vllm_config.lora_config.max_loras = max_loras  # the scheduler's and manager's
        assert manager.lora_slots == max_loras and not manager._active_adapters
        manager.lora_index_to_id = [None] * max_loras
        manager._active_adapters = AdapterLRUCache(max_loras, manager._deactivate_adapter)

    def data_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters that hold data after vLLM's post-processing (the packed linears' own
        ``weight`` is empty), each once (a tied LM head shares the embedding's)."""
        seen: set[int] = set()
        out = []
        for p in self._model.parameters():
            if p.numel() and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def _lora_layers(self) -> list[Any]:
        """vLLM's LoRA-wrapped layers (none without ``max_loras``)."""
        return [m for m in self._model.modules() if hasattr(m, "lora_a_stacked")]

    def move_parameters(self, flat: torch.Tensor, align: int = 4096) -> int:
        """Put every data parameter into ``flat`` (the mapped weight range) back to back, then the
        adapter slots' stacked tensors; returns the bytes used. vLLM's reload copies into these
        tensors, and its LoRA manager into the slots, so they stay there."""
        offset = 0

        def move(t: torch.Tensor) -> torch.Tensor:
            nonlocal offset
            nbytes = t.numel() * t.element_size()
            view = flat[offset : offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            offset += -(-nbytes // align) * align
            return view

        for p in self.data_parameters():
            p.data = move(p.data)
        for layer in self._lora_layers():
            for attr in ("lora_a_stacked", "lora_b_stacked"):
                v = getattr(layer, attr)
                setattr(layer, attr, tuple(move(t) for t in v) if isinstance(v, tuple) else move(v))
            if hasattr(layer, "lora_a_stacked_2d"):  # the embedding's flat view of its A
                a = layer.lora_a_stacked
                layer.lora_a_stacked_2d = a.view(a.shape[0] * a.shape[1], a.shape[2])
        return offset

    def parameter_bytes(self, align: int = 4096) -> int:
        """The data parameters' bytes in the weight range."""
        return sum(-(-p.numel() * p.element_size() // align) * align for p in self.data_parameters())

    def lora_bytes(self, align: int = 4096) -> int:
        """The adapter slots' bytes in the weight range, after the data parameters."""
        tensors = []
        for layer in self._lora_layers():
            for attr in ("lora_a_stacked", "lora_b_stacked"):
                v = getattr(layer, attr)
                tensors += list(v) if isinstance(v, tuple) else [v]
        return sum(-(-t.numel() * t.element_size() // align) * align for t in tensors)

    # ---- LoRA adapters ------------------------------------------------------------------------

    def register_adapter(self, name: str, path: str, load: Any = None) -> None:
        """engine/interface.py's registration: vLLM reads the directory at the adapter's first use
        (``load`` is not called)."""
        if self.adapters is None:
            raise InvalidRequestError(f"adapter {name!r}: this engine has no adapter slots (max_loras is 0)")
        self.adapters.register(name, path)

    def remove_lora(self, name: str, force: bool = False) -> list[str]:
        users = self._end_adapter_requests(name, force)
        request = self.adapters.adapters.pop(name)
        self._engine.remove_lora(request.lora_int_id)
        return users

    def _drop_adapters(self) -> None:
        """Every adapter out of vLLM and out of the registry (the model is leaving the engine)."""
        if self.adapters is None:
            return
        for request in self.adapters.adapters.values():
            self._engine.remove_lora(request.lora_int_id)
        self.adapters.adapters.clear()

    def load(self, tensors: dict[str, torch.Tensor]) -> str:
        """A model's checkpoint tensors (HF names) into the engine, in place; returns how: "plan"
        (engine/vllm_load.py: copies and repacks only, about half of vLLM's reload here) once a
        plan for this checkpoint's names and shapes has been checked on this engine, else "reload"
        (vLLM's ``reload_weights``). The first load of a signature makes and checks the plan. A
        checkpoint that ties its LM head to the embedding stores only the embedding; vLLM's
        reload wants both names. Whatever the prefix cache holds was computed with other weights:
        it is emptied first."""
        self._forget_cached_from(1, self.kv.watermark)
        named = dict(tensors)
        tied = bool(getattr(self._engine.model_config.hf_config, "tie_word_embeddings", False))
        if self.config.score_tokens is not None:
            named = _reranker_checkpoint(named, self.config.score_tokens)
        elif self.config.pooling is not None:  # an embedder or a cross-encoder: no LM head to load
            named.pop("lm_head.weight", None)
        elif tied and "lm_head.weight" not in named:
            embed = _embedding(named)
            if embed is not None:
                named["lm_head.weight"] = embed
        signature = checkpoint_signature(named)
        plan = self._plans.get(signature)
        if plan is not None:
            plan.apply(self._model, named)
            return "plan"
        if signature not in self._plans:
            plan = make_plan(self._model, named, tied)
            reload = functools.partial(self._reload, named)
            if plan is not None and verify(plan, self._model, named, reload, self._model_dtype):
                self._plans[signature] = plan
                return "plan"
            self._plans[signature] = None  # vLLM's reload from now on, without asking again
            if plan is not None:
                logger.warning(
                    "%s: direct weight load differs from vLLM's reload; using the reload", self.source
                )
                return "reload"  # verify left vLLM's load in place
        self._reload(named)
        return "reload"

    def _reload(self, named: dict[str, torch.Tensor]) -> None:
        self._runner.reload_weights(weights_iterator=iter(named.items()), is_checkpoint_format=True)

    def learn_load_plan(self, source: str) -> bool:
        """Make and check the load plan of ``source``'s checkpoint on synthetic tensors of its
        names, shapes and dtypes (a Prepare's build, idle time: about a second here), so that the
        first real activation already loads by the plan. True when there is one. A failure here
        leaves the engine as built: the first activation then loads by vLLM's reload and tries
        the plan with the real tensors."""
        try:
            named = synthetic_checkpoint(source, self._model_dtype)
            return bool(named) and self.load(named) == "plan"
        except Exception as e:  # an unreadable header, a vLLM loader that wants other names
            logger.warning("%s: no load plan from the checkpoint's headers: %s", source, e)
            return False

    def take_packed(self) -> dict[str, Any]:
        """Each linear layer's packed weight (its ``cpu_linear``), by module name, taken out of
        the model (which computes nothing until ``put_packed`` or ``load``)."""
        out = {}
        for name, m in self._model.named_modules():
            if getattr(m, "cpu_linear", None) is not None:
                out[name] = m.cpu_linear
                m.cpu_linear = None
        return out

    def put_packed(self, packed: dict[str, Any]) -> None:
        modules = dict(self._model.named_modules())
        for name, fn in packed.items():
            modules[name].cpu_linear = fn

    def unload(self) -> None:
        """Drop the packed linear weights (their memory goes back to the allocator); the data
        parameters stay in the weight range, which the caller unmaps."""
        self.take_packed().clear()

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, req_id: str, adapter: str | None = None
    ) -> None:
        lora = None
        if adapter is not None:
            lora = None if self.adapters is None else self.adapters.adapters.get(adapter)
            if lora is None:
                raise InvalidRequestError(f"adapter {adapter!r} is not registered on this engine")
        if req_id in self._requests:
            raise InvalidRequestError(f"request id {req_id!r} is already running")
        pooled = params.pooling is not None
        check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len, 0 if pooled else None)
        if pooled != (self.config.pooling is not None):
            raise InvalidRequestError(
                f"{self.source}: this vLLM engine was built to "
                f"{'pool (embed or score)' if self.config.pooling else 'generate'}; the request "
                f"{'pools' if pooled else 'generates'}"
            )
        sp = (
            self._pooling_params(params)
            if pooled
            else _vllm_params(params, self.max_model_len - len(prompt_token_ids))
        )
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
        if lora is not None:  # vLLM hashes an adapter's blocks by its name and path, not its weights
            prompt["cache_salt"] = f"lora-{lora.lora_int_id}"
        now = time.monotonic()
        try:
            self._engine.add_request(req_id, prompt, sp, lora_request=lora)
        except ValueError as e:  # vLLM's own validation (a grammar it cannot compile, ...)
            raise InvalidSamplingParamsError(str(e)) from None
        self._requests[req_id] = _Request(
            list(prompt_token_ids), RequestMetrics(arrival_time=now), params.logprobs,
            params.prompt_logprobs, adapter=adapter,
        )  # fmt: skip

    def _pooling_params(self, params: SamplingParams) -> Any:
        """vLLM's request for an embedding or a cross-encoder's score: the raw pooled state or head
        output (no normalisation or sigmoid: the server applies those, as for the built-in engine),
        a pair's token types where the model has them."""
        from vllm import PoolingParams

        if tuple(params.score_tokens) != (self.config.score_tokens or ()):
            raise InvalidRequestError(
                f"{self.source}: this vLLM engine scores with answer tokens {self.config.score_tokens}; "
                f"the request asks for {tuple(params.score_tokens) or 'none'}"
            )
        extra = None
        if params.pair_start is not None and self._token_types:
            extra = {"compressed_token_type_ids": int(params.pair_start)}
        task = "classify" if self.config.pooling == "classify" else "embed"
        return PoolingParams(task=task, use_activation=False, extra_kwargs=extra)

    # ---- KV pages -------------------------------------------------------------------------------

    def _usable_free_blocks(self) -> int:
        """What vLLM's scheduler may allocate: the free blocks below the watermark (every block in
        use is below it; the null block 0 is never free)."""
        used = self.num_used_blocks
        return max(0, min(self._free.num_free_blocks, self.kv.watermark - 1 - used))

    def _highest_used(self) -> int:
        return self._free.top  # blocks not in the free queue are in use (cached free blocks are in it)

    def _headroom(self) -> int:
        """Blocks one step may add beyond those in use: for each running request, its next chunk
        (a prompt's rest up to the step's token budget, or one decoded token) and a block of
        rounding; for the waiting requests the step may admit (those whose tokens fit one step's
        budget, and always the first), their whole sequence, since vLLM admits a request only
        when all of it fits; vLLM's own admission margin; and one more."""
        bs, budget = self.block_size, self._step_tokens
        need = sum(
            math.ceil(min(r.num_tokens - r.num_computed_tokens, budget) / bs) + 1
            for r in self.scheduler.running
        )
        tokens = 0
        for i, r in enumerate(self.scheduler.waiting):
            n = max(0, r.num_tokens - r.num_computed_tokens)
            if i and tokens + n > budget:
                break
            tokens += n
            need += math.ceil(r.num_tokens / bs)
        return need + self.scheduler.kv_cache_manager.watermark_blocks + 1

    def fit_pages(self) -> None:
        """Map the blocks the next step may need (as far as the ledger allows) and unmap those
        above what it needs twice over, unless a cached block lies there: pages follow the
        requests, a step ahead, and keep the prefix cache until the device wants them back."""
        if not self.kv.num_layers:  # an encoder's engine: no KV to map
            return
        high = self._highest_used() + 1
        headroom = self._headroom()
        need = high + headroom
        keep = max(need, self._free.highest_cached() + 1)
        if self.kv.watermark < need:
            reached = self.kv.grow_by_pages(need)
            self.stalled = reached < need and self.num_waiting > 0
        elif self.kv.watermark > keep + headroom:
            self.kv.resize(keep)
            self.stalled = False
        self._report_reclaimable(need)

    def shrink_idle(self) -> int:
        """No request left: keep the pages of the null block and of the cached blocks only;
        returns the bytes given back."""
        before = self.kv.mapped_bytes
        self.kv.resize(max(self._highest_used(), self._free.highest_cached()) + 1)
        self._report_reclaimable(self._floor())
        return before - self.kv.mapped_bytes

    def _floor(self) -> int:
        """The watermark the requests need: what giving the cache back shrinks to."""
        if not self._requests:
            return self._highest_used() + 1
        return self._highest_used() + 1 + self._headroom()

    def give_back_cached(self, num_bytes: int) -> int:
        """At least ``num_bytes`` of KV pages back to the device, or as many as the requests do
        not need: the watermark comes down to the highest one that frees that much, evicting the
        cached blocks above it first. Returns the bytes given back."""
        floor, kv = self._floor(), self.kv
        if kv.watermark <= floor:
            self._report_reclaimable(floor)
            return 0
        before = kv.mapped_bytes
        low, high = floor, kv.watermark  # frees enough at low (or nothing does); not at high
        if before - kv.bytes_for(low) >= num_bytes:
            while high - low > 1:
                mid = (low + high) // 2
                if before - kv.bytes_for(mid) >= num_bytes:
                    low = mid
                else:
                    high = mid
        kv.resize(low)
        self._report_reclaimable(floor)
        return before - kv.mapped_bytes

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks whose KV the prefix cache keeps (counted free by ``num_used_blocks``)."""
        return len(self._free.cached)

    def cached_blocks(self) -> list[int]:
        """Their ids, in the order they are given back (highest first: the watermark comes down)."""
        return sorted(self._free.cached, reverse=True)

    def drop_cached(self, num_blocks: int | None = None) -> int:
        """Evict up to ``num_blocks`` (None: all) of them from vLLM's prefix cache, highest first,
        and unmap the pages above what the requests need; returns how many. One below that floor
        only loses its entry (its pages hold blocks in use too)."""
        ids = self.cached_blocks()[:num_blocks]
        if not ids:
            return 0
        floor = self._floor()
        if self.kv.watermark > max(floor, ids[-1]):
            self.kv.resize(max(floor, ids[-1]))  # evicts those at or above it first
        rest = self._free.forget_from(ids[-1])
        if rest:
            self._pool.evict_blocks(rest)
        self._report_reclaimable(floor)
        return len(ids)

    @property
    def reclaimable_bytes(self) -> int:
        """KV bytes mapped for cached blocks alone, as last told to the ledger."""
        return self._told[1] if self._free.cached else 0

    def _forget_cached_from(self, watermark: int, old: int) -> None:
        """``StridedKVPages.before_shrink``: blocks from ``watermark`` up lose their pages, so the
        cached ones leave vLLM's prefix cache first (vLLM's ``evict_blocks`` removes their hashes;
        a block in use is never above the watermark)."""
        gone = self._free.forget_from(watermark)
        if gone:
            self._pool.evict_blocks(gone)
        self._told = (None, self._told[1])  # the ledger lowers its count as pages go: tell it again

    def _report_reclaimable(self, floor: int) -> None:
        """Tell the ledger how many of the mapped KV bytes are there for cached blocks alone: what
        shrinking to ``floor`` would give back (nothing without cached blocks)."""
        kv = self.kv
        n = kv.mapped_bytes - kv.bytes_for(floor) if self._free.cached and kv.watermark > floor else 0
        if kv.account is not None and (kv.account, n) != self._told:
            kv.account.set_reclaimable(n)
            self._told = (kv.account, n)

    def step(self) -> list[RequestOutput]:
        self.last_step_seqs = self.last_step_tokens = 0
        self.fit_pages()
        outs = []
        for o in self._engine.step():
            r = self._requests.get(o.request_id)
            if r is None:
                continue
            if self.config.pooling is not None:
                outs.append(self._pooled_output(o, r))
                continue
            c = o.outputs[0]
            stats = o.metrics
            m = r.metrics
            if stats is not None:
                m.first_scheduled_time = stats.scheduled_ts or m.first_scheduled_time
                m.first_token_time = stats.first_token_ts or m.first_token_time
            delta = list(c.token_ids)
            r.token_ids += delta
            r.text += c.text
            prompt_lp = None
            if o.prompt_logprobs is not None and not r.prompt_logprobs_sent and delta:
                prompt_lp = [None] + [
                    None if d is None else _entry(t, d, r.prompt_logprobs)
                    for t, d in zip(r.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=False)
                ]
                r.prompt_logprobs_sent = True
            if o.finished:
                m.finish_time = time.monotonic()
                del self._requests[o.request_id]
            outs.append(
                RequestOutput(
                    req_id=o.request_id,
                    prompt_token_ids=r.prompt_token_ids,
                    token_ids=list(r.token_ids),
                    text=r.text,
                    delta_text=c.text,
                    delta_token_ids=delta,
                    finished=o.finished,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    metrics=m,
                    logprobs=None
                    if c.logprobs is None
                    else [_entry(t, d, r.logprobs) for t, d in zip(delta, c.logprobs, strict=False)],
                    prompt_logprobs=prompt_lp,
                    num_cached_tokens=o.num_cached_tokens or 0,
                )
            )
        return outs

    def _pooled_output(self, o: Any, r: _Request) -> RequestOutput:
        """A pooling request's one output: its vector (or head outputs) as float32 on the host."""
        now = time.monotonic()
        m = r.metrics
        m.first_scheduled_time = m.first_scheduled_time or now
        m.first_token_time = m.finish_time = now
        del self._requests[o.request_id]
        data = o.outputs.data
        return RequestOutput(
            req_id=o.request_id, prompt_token_ids=r.prompt_token_ids, token_ids=[], text="",
            delta_text="", delta_token_ids=[], finished=True, finish_reason="stop", stop_reason=None,
            metrics=m, num_cached_tokens=o.num_cached_tokens or 0,
            embedding=data.detach().to("cpu", torch.float32).reshape(-1),
        )  # fmt: skip

    def abort_request(self, req_id: str) -> bool:
        if self._requests.pop(req_id, None) is None:
            return False
        self._engine.abort_request([req_id])
        return True

    def abort_all(self) -> list[str]:
        ids = list(self._requests)
        if ids:
            self._engine.abort_request(ids)
        self._requests.clear()
        return ids

    @property
    def num_used_blocks(self) -> int:
        """Blocks requests hold (block 0 is vLLM's null block; cached free blocks are free)."""
        return max(0, self.num_kv_blocks - 1 - self._free.num_free_blocks)

    def close(self) -> None:
        """The model leaves the engine: its requests and adapters go (the engine stays built)."""
        self.abort_all()
        self._drop_adapters()


def _reranker_checkpoint(named: dict[str, torch.Tensor], tokens: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A decoder's checkpoint as its one-output classifier's: the LM head (the embedding where they
    are tied) gives way to ``score.weight``, its yes row less its no row, so that the classifier's
    output is logit(yes) - logit(no)."""
    out = dict(named)
    head = out.pop("lm_head.weight", None)
    if head is None:
        head = _embedding(out)
    if head is None:
        raise UnsupportedModelError("a decoder reranker's checkpoint has no LM head or embedding")
    no, yes = tokens
    out["score.weight"] = (head[yes].float() - head[no].float()).to(head.dtype).unsqueeze(0).contiguous()
    return out


def _embedding(named: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """A checkpoint's input embedding (under any model prefix), the LM head of a tied model."""
    return next((t for n, t in named.items() if n.endswith("embed_tokens.weight")), None)


def _hf_config(source: str) -> dict[str, Any]:
    """``source``'s config.json as a dict (empty where there is none, or it is not an object)."""
    path = Path(source) / "config.json"
    cfg = msgspec.json.decode(path.read_bytes()) if path.is_file() else {}
    return cfg if isinstance(cfg, dict) else {}


def _max_model_len(cfg: dict[str, Any], asked: int | None) -> int | None:
    """``EngineConfig.max_model_len`` as the built-in engine reads it (resolve_max_model_len):
    never beyond the context config.json (``cfg``) gives (vLLM refuses a longer one: a 512-token
    encoder under the default 2048), None's default capped; ``asked`` as it is where config.json
    gives no context."""
    ctx = cfg.get("max_position_embeddings")
    if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx <= 0:
        return asked
    return within_context(asked, ctx)


def _pooling_args(source: str, cfg: dict[str, Any], config: EngineConfig) -> dict[str, Any]:
    """EngineArgs for ``EngineConfig.pooling``: vLLM's pooling runner (a decoder checkpoint is
    converted to an embedding model), pooling as the model's config says; a classifier pools as
    its own model does. A decoder reranker (``score_tokens``) is built as its architecture's
    one-output sequence classifier (``VllmEngine.load`` makes the weight); ``cfg``: its
    config.json."""
    pooling = config.pooling
    if pooling is None:
        return {}
    if config.score_tokens is not None:
        arch = next(iter(cfg.get("architectures") or ()), "")
        if not arch.endswith("ForCausalLM"):
            raise UnsupportedModelError(
                f"{source}: a decoder reranker on vLLM needs a ...ForCausalLM checkpoint, found {arch!r}"
            )
        classifier = arch.removesuffix("ForCausalLM") + "ForSequenceClassification"
        return {"runner": "pooling", "hf_overrides": {"architectures": [classifier], "num_labels": 1}}
    if pooling == "classify":
        return {"runner": "pooling"}
    from vllm.config import PoolerConfig

    return {"runner": "pooling", "pooler_config": PoolerConfig(seq_pooling_type=pooling.upper())}


def _vllm_params(p: SamplingParams, room: int) -> Any:
    from vllm import SamplingParams as VP
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if p.structured is not None:
        s = p.structured
        structured = StructuredOutputsParams(
            **{
                "json_object": {"json_object": True},
                "json_schema": {"json": s.spec},
                "regex": {"regex": s.spec},
                "grammar": {"grammar": s.spec},
            }[s.kind]
        )
    try:
        return VP(
            max_tokens=min(p.max_tokens, room), temperature=p.temperature, top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else 0, min_p=p.min_p, seed=p.seed, stop=list(p.stop) or None,
            stop_token_ids=list(p.stop_token_ids) or None, ignore_eos=p.ignore_eos,
            include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens, min_tokens=p.min_tokens,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, logit_bias=dict(p.logit_bias) or None,
            logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
    except ValueError as e:
        raise InvalidSamplingParamsError(str(e)) from None


def _entry(token_id: int, d: dict, k: int | None) -> TokenLogprob:
    """prism's logprob entry from vLLM's dict: the chosen token's logprob, and the top ``k``
    alternatives by rank (vLLM's dict holds those and the chosen token, whatever its rank)."""
    top = sorted(
        (lp.rank, t, float(lp.logprob)) for t, lp in d.items() if lp.rank is not None and lp.rank <= (k or 0)
    )
    chosen = d.get(token_id)
    logprob = float(chosen.logprob) if chosen is not None else float("-inf")
    return TokenLogprob(token_id, logprob, [(t, lp) for _, t, lp in top])
