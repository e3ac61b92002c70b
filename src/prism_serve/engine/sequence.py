"""A request inside the engine, and what the engine reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # a sequence only carries these; the scheduler imports this without torch
    import llguidance
    import torch


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """A token's logprob under the model's raw distribution and the most likely alternatives.

    A msgspec struct because it crosses the worker boundary as is: runtime/messages.py re-exports
    it inside ``TokenDelta``, so the engine, the worker and the API share one type.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # the top alternatives (token_id, logprob), most likely first


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True, eq=False)
class Sequence:
    """One request: its tokens, its KV blocks and how far the model has computed them.

    ``token_ids`` holds prompt and output. ``num_computed_tokens`` counts the tokens whose KV is in
    the cache; the scheduler feeds the rest to the model, in chunks. Preemption drops the KV and
    sets it back to 0, so the tokens are recomputed later (outputs are kept).

    ``logprobs`` has one entry per output token (when requested); ``prompt_logprobs`` one per prompt
    token, ``None`` for the first, filled as prefill chunks pass and never twice (a recomputed
    prompt skips the entries it already has).
    """

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # a model whose layers are split into KV groups (kv_cache.KVGroups): the block tables of groups
    # 1.. (block_table is group 0's), and how many leading blocks the windowed groups have freed
    # (those entries are -1: no query reads them again)
    group_tables: list[list[int]] = field(default_factory=list)
    window_start: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    output_text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Output characters made before min_tokens was reached: no stop string may end inside them.
    num_min_tokens_chars: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    matcher: llguidance.LLMatcher | None = None  # structured output: which tokens may come next
    adapter: str | None = None  # the LoRA adapter it runs with (engine/lora.py), None: the base
    lora_slot: int | None = None  # the adapter's slot while the request holds one
    # prefix caching (engine/prefix_cache.py): what else its KV depends on (the adapter), its full
    # blocks' keys so far, how many of its blocks are registered, and the prompt tokens its first
    # admission found cached (usage's cached_tokens)
    cache_salt: bytes = b""
    block_keys: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # an embedding request (params.pooling): the pooled hidden states so far (mean: their sum over
    # the first num_pooled prompt positions), then the vector itself; a score request
    # (params.score_tokens): those tokens' logits
    pooled: torch.Tensor | None = None
    num_pooled: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no prefix to be scored on

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def stop_search_start(self) -> int:
        """Stop strings must end after this many output characters: the text before was streamed
        (it was searched already) or made before min_tokens was reached."""
        return max(self.num_sent_chars, self.num_min_tokens_chars)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(slots=True)
class RequestOutput:
    """A request's state after an engine step. ``text`` and ``token_ids`` are everything so far;
    ``delta_text`` and ``delta_token_ids`` are what is new since the previous output.

    ``logprobs`` (when requested) has one entry per ``delta_token_ids`` entry; ``prompt_logprobs``
    (when requested) comes whole in the first output, which always carries a token, and is None after.
    """

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # an embedding request's vector, or a score request's logits (float32, on the host)
    embedding: torch.Tensor | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
