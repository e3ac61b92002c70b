"""The engine: one model, one KV cache, and a step that is ``schedule -> run -> postprocess``."""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.config import resolve_max_model_len as resolve_max_model_len  # re-exported
from prism_serve.engine.interface import RequestCounts
from prism_serve.engine.kv_cache import BlockAllocator, FixedBlockAllocator, KVCache, KVGroups
from prism_serve.engine.lora import (
    AdapterSlots,
    InvalidAdapterError,
    LoraAdapter,
    LoraSlots,
    read_adapter,
)
from prism_serve.engine.machine import keep_freed_buffers, resolve_dtype
from prism_serve.engine.models import build_model
from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.prefix_cache import PrefixCache
from prism_serve.engine.runner import ModelRunner
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.scheduler import Scheduler, SchedulerOutput
from prism_serve.engine.sequence import RequestMetrics, RequestOutput, Sequence
from prism_serve.engine.structured import GrammarCompiler
from prism_serve.engine.tokenizer import IncrementalDetokenizer
from prism_serve.engine.validation import check_prompt
from prism_serve.engine.weights import LoadedWeights, load_weights
from prism_serve.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    UnsupportedModelError,
)
from prism_serve.memory.kv_pool import ElasticKVPool, FixedKVPool

if TYPE_CHECKING:
    from prism_serve.engine.models import Model

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def torch_dtype(config: EngineConfig) -> torch.dtype:
    return DTYPES[resolve_dtype(config.dtype, config.device.split(":", 1)[0])]


Prompt = str | list[int]


def _has_cuda_device(device: torch.device) -> bool:
    return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()


class LLMEngine(RequestCounts):
    def __init__(
        self,
        config: EngineConfig | None = None,
        weights: LoadedWeights | None = None,
        allocator: BlockAllocator | None = None,
        clock: Callable[[], float] = time.monotonic,
        model: Model | None = None,
        lora_storage: torch.Tensor | None = None,
        reduce: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``model``: a decoder already built over its tensors (the runtime activates one from its
        host weight cache); ``weights`` then supplies only the config and tokenizer.
        ``lora_storage``: where the adapter slots (``max_loras``) are laid out (the runtime's
        weight pages after the weights, ``LoraSlots.bytes_for`` of them); None: fresh memory.
        ``reduce``: this engine is one rank of a tensor-parallel model (``weights`` its shard,
        engine/tensor_parallel.py) and this sums a partial output over the ranks in place."""
        self.config = config = config or EngineConfig()
        keep_freed_buffers()  # activation buffers reused across steps, not page-faulted afresh
        dtype = torch_dtype(config)
        if weights is None:
            weights = load_weights(config.model, dtype=dtype, seed=config.seed)
        self.weights_source = weights.source
        self.synthetic = weights.synthetic
        self.model_config = weights.config
        self.tokenizer = weights.tokenizer
        self.max_model_len = config.resolve_max_model_len(weights.config)
        # a CUDA engine builds the model on the host (fusing, re-laying out) and copies it over;
        # a model handed in already lives where it computes (the runtime's weight range)
        device = torch.device(config.device if config.device.startswith("cuda") else "cpu")
        if device.type == "cuda" and model is None and not _has_cuda_device(device):
            raise InvalidRequestError(
                f"device {config.device} asked for, but this torch ({torch.__version__}) sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA devices"
            )
        self.model = model or build_model(
            weights.config, weights.tensors, dtype, self.max_model_len, weights.rope_freq_factors
        ).to(device)
        device = self.model.norm.device
        # an encoder (models/bert.py) reads each input whole in one step and keeps no KV: its
        # requests get no blocks, and a step's budget holds its longest input
        encoder = weights.config.encoder
        if encoder and (reduce is not None or config.max_loras):
            raise UnsupportedModelError("an encoder runs on one device, without LoRA adapters")
        if reduce is not None:
            if config.max_loras:
                raise UnsupportedModelError("LoRA adapters of a tensor-parallel model are not supported")
            self.model.reduce = reduce
        # sliding-window layers apart from full-context ones, so their old blocks can go (KVGroups)
        self.kv_groups = KVGroups.of(weights.config, self.max_model_len, config.windowed_kv)
        block_bytes = KVCache.block_bytes(weights.config, config.block_size, dtype, self.kv_groups)
        num_blocks = 1 if encoder else config.num_kv_blocks or max(1, config.kv_cache_bytes // block_bytes)
        self._owned_pool: ElasticKVPool | None = None
        if allocator is None and config.elastic_kv is not None:
            allocator = self._owned_pool = ElasticKVPool.create(
                block_bytes, num_blocks * block_bytes, name=config.model, config=config.elastic_kv
            )
        self.allocator = allocator or FixedBlockAllocator(num_blocks)
        storage = None
        if isinstance(self.allocator, ElasticKVPool | FixedKVPool):  # KV in a reserved range's pages
            if self.allocator.vrange.device.split(":")[0] != device.type:
                raise InvalidRequestError(
                    f"the KV pool is on {self.allocator.vrange.device}; this engine computes on {device}"
                )
            if self.allocator.block_bytes != block_bytes:
                raise InvalidRequestError(
                    f"KV pool blocks are {self.allocator.block_bytes} bytes; this model needs {block_bytes}"
                )
            storage = self.allocator.kv_tensor(dtype)
        blocks = self.allocator.num_total_blocks
        self.kv_cache = KVCache(
            weights.config, blocks, config.block_size, dtype, storage, device, self.kv_groups
        )
        self.adapters: AdapterSlots | None = None  # LoRA slots, with max_loras
        if config.max_loras:
            slots = LoraSlots(
                weights.config, config.max_loras, config.max_lora_rank, dtype, device, lora_storage
            )
            self.adapters = AdapterSlots(slots)
        # prefix caching: full blocks kept by content after their requests end (engine/prefix_cache.py)
        self.prefix_cache = (
            PrefixCache(self.allocator, config.block_size) if config.prefix_caching and not encoder else None
        )
        self._adapter_salts: dict[str, bytes] = {}  # each registration's own: a re-registered name misses
        self._registrations = itertools.count()
        budget = (
            max(config.max_num_batched_tokens, self.max_model_len)
            if encoder
            else config.max_num_batched_tokens
        )
        self.scheduler = Scheduler(
            self.allocator, config.block_size, config.max_num_seqs, budget, self.adapters, self.prefix_cache,
            whole_inputs=encoder, groups=self.kv_groups,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            seed=config.seed,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_num_seqs=config.max_num_seqs,
            adapters=self.adapters,
            cuda_graphs=reduce is None,  # a graph would replay the all-reduces outside the group's calls
        )
        self.grammars = GrammarCompiler(self.tokenizer, weights.config.vocab_size)
        self._clock = clock
        self._requests: dict[str, Sequence] = {}
        self.stalled = False
        self.last_step_tokens = 0  # tokens the last step computed (prefill chunks + decodes)
        self.last_step_seqs = 0  # sequences in the last step
        # set True to have step() record last_step_batch (step traces, the CPU-profile fit)
        self.record_step_batches = False
        self.last_step_batch: list[tuple[int, int, bool]] = []
        self._ids = itertools.count()

    def close(self) -> None:
        """Abort what is in flight and give back KV memory the engine mapped itself (elastic pool)."""
        self.abort_all()
        if self._owned_pool is not None:
            self._owned_pool.close()
            self._owned_pool = None

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests -----------------------------------------------------------------------------

    @functools.cached_property
    def max_seq_len(self) -> int:
        """Longest sequence (prompt + output) that fits both the context and the whole KV cache (a
        fixed number of blocks: found once, not at every request and step that checks it)."""
        if self.model_config.encoder:  # it keeps no KV
            return self.max_model_len
        bs, blocks = self.config.block_size, self.allocator.num_total_blocks
        groups, chunk = self.kv_groups, self.config.max_num_batched_tokens
        if groups.num_groups == 1:
            return min(self.max_model_len, blocks * bs)
        # the longest whose blocks of every group fit at once (a windowed group holds its window)
        lo, hi = 0, self.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if groups.max_blocks(mid, bs, chunk) <= blocks else (lo, mid - 1)
        return lo

    # ---- LoRA adapters ------------------------------------------------------------------------

    def add_lora(self, path: str | Path, name: str | None = None) -> LoraAdapter:
        """Register the PEFT adapter in directory ``path`` (InvalidAdapterError naming what is wrong)."""
        if self.adapters is None:
            raise InvalidAdapterError("this engine has no adapter slots (max_loras is 0)")
        adapter = read_adapter(path, self.model_config, self.config.max_lora_rank, name)
        if adapter.name in self.adapters.adapters:
            raise InvalidAdapterError(f"adapter {adapter.name!r} is already registered")
        self._register(adapter)
        return adapter

    def _register(self, adapter: LoraAdapter) -> None:
        self.adapters.register(adapter)
        salt = f"{adapter.name}\0{next(self._registrations)}".encode()
        self._adapter_salts[adapter.name] = hashlib.blake2b(salt, digest_size=16).digest()

    def register_adapter(self, name: str, path: str, load: Callable[[ArchConfig, int], LoraAdapter]) -> None:
        """The worker's registration (engine/interface.py): ``load`` gives the weights (views of
        the host cache: nothing is copied until the adapter takes a slot)."""
        if self.adapters is None:
            raise InvalidAdapterError("this engine has no adapter slots (max_loras is 0)")
        adapter = load(self.model_config, self.config.max_lora_rank)
        if adapter.name != name:
            raise InvalidAdapterError(f"adapter {name!r}: its weights are registered as {adapter.name!r}")
        self._register(adapter)

    def remove_lora(self, name: str, force: bool = False) -> list[str]:
        """Forget adapter ``name``. Its requests must have finished (AdapterInUseError), unless
        ``force``: then they are aborted (their ids returned)."""
        users = self._end_adapter_requests(name, force)
        self.adapters.unregister(name)
        self._adapter_salts.pop(name, None)
        return users

    def make_sequence(
        self, prompt: Prompt, params: SamplingParams | None = None, req_id: str | None = None,
        adapter: str | None = None,
    ) -> Sequence:  # fmt: skip
        """Validate and tokenize a request without touching engine state (safe from any thread).
        ``adapter``: a registered LoRA adapter it runs with (None: the base model)."""
        if adapter is not None and (self.adapters is None or adapter not in self.adapters.adapters):
            raise InvalidAdapterError(f"adapter {adapter!r} is not registered on this engine")
        params = params or SamplingParams()
        if self.model_config.encoder and params.pooling is None:
            raise InvalidRequestError("this model is an encoder: it embeds or scores, it does not generate")
        vocab = self.model_config.vocab_size
        for t in params.logit_bias:
            if t >= vocab:
                raise InvalidSamplingParamsError(
                    f"logit_bias token id {t} is out of range: this model's vocabulary has {vocab} tokens"
                )
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        limit = (
            f" (here {self.max_seq_len}: its KV cache has {self.allocator.num_total_blocks} blocks of "
            f"{self.config.block_size} tokens)"
            if self.max_seq_len < self.max_model_len
            else ""
        )
        pooled = 0 if params.pooling is not None else None  # an embedding or score generates nothing
        check_prompt(token_ids, vocab, self.max_seq_len, pooled, limit=limit)
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        matcher = None if params.structured is None else self.grammars.matcher(params.structured)
        return Sequence(
            req_id=req_id if req_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens),
            metrics=RequestMetrics(arrival_time=self._clock()),
            generator=generator,
            matcher=matcher,
            adapter=adapter,
            cache_salt=b"" if adapter is None else self._adapter_salts[adapter],
        )

    def add_sequence(self, seq: Sequence) -> None:
        if seq.req_id in self._requests:
            raise DuplicateRequestError(f"request id {seq.req_id!r} is already in flight")
        self._requests[seq.req_id] = seq
        self.scheduler.add(seq)

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, req_id: str | None = None,
        adapter: str | None = None,
    ) -> str:  # fmt: skip
        seq = self.make_sequence(prompt, params, req_id, adapter)
        self.add_sequence(seq)
        return seq.req_id

    def abort_request(self, req_id: str) -> bool:
        """Stop a request and free its KV blocks. False if it is not in flight."""
        seq = self._requests.pop(req_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        return True

    def abort_all(self) -> list[str]:
        """Abort every request in flight; returns their ids."""
        ids = list(self._requests)
        for req_id in ids:
            self.abort_request(req_id)
        return ids

    # ---- the prefix cache ---------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """KV blocks the prefix cache keeps that no request holds: reclaimable memory."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_evictable_blocks

    def cached_blocks(self) -> list[int]:
        """Those blocks' ids, least recently used first."""
        return [] if self.prefix_cache is None else self.prefix_cache.evictable_blocks()

    def drop_cached(self, num_blocks: int | None = None) -> int:
        """Give up to ``num_blocks`` (None: all) of them back to the allocator, least recently used
        first (the device needs the memory); returns how many went."""
        return 0 if self.prefix_cache is None else len(self.prefix_cache.drop(num_blocks))

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        # Nothing fits while requests wait: only possible when an outside allocator (the shared
        # device budget) refuses blocks for now. Callers back off instead of spinning.
        self.stalled = not sched.scheduled and self.has_unfinished_requests()
        self.last_step_tokens = sum(s.num_new_tokens for s in sched.scheduled)
        self.last_step_seqs = len(sched.scheduled)  # == last_step_tokens: a pure decode step
        # (new tokens, cached tokens before them, samples) per request: the step's shape
        if self.record_step_batches:
            self.last_step_batch = [
                (s.num_new_tokens, s.seq.num_computed_tokens, s.samples) for s in sched.scheduled
            ]
        if not sched.scheduled:
            return []
        now = self._clock()
        for s in sched.scheduled:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = now
        sampled = self.runner.execute(sched)
        return self._postprocess(sched, sampled)

    def _postprocess(self, sched: SchedulerOutput, sampled: list[int | None]) -> list[RequestOutput]:
        now = self._clock()
        outputs = []
        for s, token in zip(sched.scheduled, sampled, strict=True):
            seq = s.seq
            last_chunk = s.samples  # (read before the count moves past the chunk)
            seq.num_computed_tokens += s.num_new_tokens
            self.scheduler.cache_computed(seq)
            if seq.params.pooling is not None:  # an embedding: done once its prompt is
                if last_chunk:
                    seq.metrics.first_token_time = seq.metrics.finish_time = now
                    seq.finish_reason = "stop"
                    self.scheduler.finish(seq)
                    del self._requests[seq.req_id]
                    outputs.append(self._make_output(seq))
                continue
            if token is None:
                continue
            seq.token_ids.append(token)
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            if not _stops_on(seq.params, token, self.tokenizer.eos_token_ids):
                seq.output_text += seq.detokenizer.push(token)
            if seq.matcher is not None:
                seq.matcher.consume_token(token)  # masked to what it accepts, so this succeeds
            self._check_stop(seq, token)
            if seq.finished:
                seq.metrics.finish_time = now
                del self._requests[seq.req_id]
            outputs.append(self._make_output(seq))
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        reason: str | None = None
        if seq.matcher is not None and seq.matcher.is_stopped():
            reason = "stop"  # the grammar is complete (or allows only EOS): nothing may follow
        elif seq.num_output_tokens < p.min_tokens:
            # The sampler masks EOS and stop_token_ids until min_tokens; stop strings that end in
            # this text do not count either, not even once min_tokens is reached.
            seq.num_min_tokens_chars = len(seq.output_text)
            if seq.num_tokens >= self.max_seq_len:
                reason = "length"
        elif not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif p.stop and (hit := _find_stop(seq.output_text, p.stop, seq.stop_search_start)) is not None:
            idx, stop = hit
            seq.output_text = seq.output_text[: idx + len(stop) if p.include_stop_str_in_output else idx]
            reason, seq.stop_reason = "stop", stop
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_seq_len:
            reason = "length"
        if reason is None:
            return
        if seq.stop_reason is None or isinstance(seq.stop_reason, int):
            seq.output_text += seq.detokenizer.flush()
        seq.finish_reason = reason
        self.scheduler.finish(seq)

    def _make_output(self, seq: Sequence) -> RequestOutput:
        # While streaming, hold back the tail that may still grow into a stop string.
        visible = len(seq.output_text) if seq.finished else len(seq.output_text) - seq.params.stop_holdback
        visible = max(visible, seq.num_sent_chars)
        delta = seq.output_text[seq.num_sent_chars : visible]
        seq.num_sent_chars = visible
        delta_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_sent_tokens :]
        logprobs = None if seq.logprobs is None else seq.logprobs[seq.num_sent_tokens :]
        prompt_logprobs = seq.prompt_logprobs if seq.num_sent_tokens == 0 else None
        seq.num_sent_tokens = seq.num_output_tokens
        return RequestOutput(
            req_id=seq.req_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.output_text[:visible],
            delta_text=delta,
            delta_token_ids=delta_ids,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            metrics=seq.metrics,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            embedding=seq.pooled if seq.finished and seq.params.pooling is not None else None,
        )


def _find_stop(text: str, stops: list[str], searched_upto: int) -> tuple[int, str] | None:
    """First stop string in ``text``; text before ``searched_upto`` minus the longest stop was
    already searched, so the scan is incremental."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, searched_upto - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def _stops_on(p: SamplingParams, token: int, eos: tuple[int, ...]) -> bool:
    """Whether ``token`` ends the output as a stop token whose text stays out of it, as in vLLM: an
    EOS (unless ignored) or one of ``stop_token_ids``, without ``include_stop_str_in_output``. (The
    sampler masks them before ``min_tokens``; with special tokens kept, an EOS such as
    ``<|im_end|>`` would otherwise end the text.)"""
    if p.include_stop_str_in_output:
        return False
    return (not p.ignore_eos and token in eos) or token in p.stop_token_ids
