"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Every step: running requests first (one token per decode, the next chunk for a prefill still in
progress), then waiting requests while the token budget, the sequence cap and KV blocks last.
When a running request needs a block and none is free, the newest running request is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed later.

With a ``PrefixCache`` (engine/prefix_cache.py) blocks come from it instead of the allocator: a
request starting from nothing first takes the longest run of cached blocks its prompt's leading
full blocks name (unless it asks for prompt logprobs, which need every prompt position computed),
and ``cache_computed`` registers each block once the model has computed all of its tokens. A
preempted request's blocks stay cached, so its recompute is mostly hits.

A model whose layers are split into KV groups (kv_cache.KVGroups: Gemma's sliding-window layers
apart from its global ones) takes one block per group for each run of ``block_size`` tokens, and
before each step a windowed group gives back the blocks no query of that step or a later one
reads (they become -1 in its table; with the prefix cache, registered ones stay cached, unheld).

An encoder's scheduler (``whole_inputs``) admits a request only whole, in one step, and gives it no
blocks: every token of an encoder's input attends to every other, and nothing is kept after it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prism_serve.engine.kv_cache import BlockAllocator, KVGroups
from prism_serve.engine.prefix_cache import block_keys
from prism_serve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from prism_serve.engine.lora import AdapterSlots
    from prism_serve.engine.prefix_cache import PrefixCache


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed to the model this step, from seq.num_computed_tokens on

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so the step produces this request's next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
        adapters: AdapterSlots | None = None, cache: PrefixCache | None = None, whole_inputs: bool = False,
        groups: KVGroups | None = None,
    ) -> None:  # fmt: skip
        self.allocator = allocator
        self.cache = cache  # prefix caching: blocks come from it (it sits on the allocator)
        self.blocks: BlockAllocator | PrefixCache = cache if cache is not None else allocator
        self.adapters = adapters  # LoRA slots: a request runs once its adapter has one
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.whole_inputs = whole_inputs  # an encoder's: each request whole in one step, no KV blocks
        self.groups = groups  # the layers' KV groups (None: one group, every layer in each block)
        self.num_groups = 1 if groups is None else groups.num_groups
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._grow(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            break

        # Admit new work only when nothing had to be preempted: memory is tight otherwise.
        held: list[Sequence] = []  # requests whose adapter waits for a slot: the others go on
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.adapters is not None and not self.adapters.acquire(seq):
                held.append(self.waiting.popleft())
                continue
            self._match(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.whole_inputs and n < seq.num_tokens:
                break  # the next step has room for it (its budget holds the longest input)
            if not self._grow(seq, seq.num_computed_tokens + n):
                self._release(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(held))
        return out

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted request and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def cache_computed(self, seq: Sequence) -> None:
        """Register the request's blocks whose tokens the model has now all computed."""
        if self.cache is None:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        keys = block_keys(
            seq.token_ids[: full * self.block_size], self.block_size, seq.cache_salt, seq.block_keys
        )
        start = seq.num_registered_blocks
        for group, table in enumerate(self._tables(seq)):
            self.cache.register(keys, table, start, full, seq.cache_salt, group)
        seq.num_registered_blocks = full

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's block table of each KV group."""
        return [seq.block_table, *seq.group_tables]

    def _match(self, seq: Sequence) -> None:
        """A request starting from nothing takes the cached blocks of its longest cached prefix."""
        # positions before the last are read: scores of each prompt token, or a pooling of them
        reads_all = seq.params.prompt_logprobs is not None or seq.params.pooling in ("mean", "cls")
        if self.cache is None or seq.block_table or reads_all:
            return
        keys = block_keys(seq.token_ids, self.block_size, seq.cache_salt, seq.block_keys)
        tables, seq.window_start = self.cache.match_groups(keys, seq.num_tokens, self.groups)
        seq.block_table, *seq.group_tables = tables
        seq.num_registered_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        if seq.metrics.first_scheduled_time is None:  # the first admission: what usage reports
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        if self.whole_inputs:
            return True
        self._slide(seq)
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        blocks = self.blocks.allocate(need * self.num_groups)  # one per group, all or none
        if blocks is None:
            return False
        if self.num_groups > 1 and not seq.group_tables:
            seq.group_tables = [[] for _ in range(self.num_groups - 1)]
        for i, table in enumerate(self._tables(seq)):
            table.extend(blocks[i * need : (i + 1) * need])
        return True

    def _slide(self, seq: Sequence) -> None:
        """Free the windowed groups' blocks that no query from the next one computed on reads."""
        if self.groups is None or self.groups.window is None:
            return
        first = self.groups.first_read(seq.num_computed_tokens, self.block_size)
        if first <= seq.window_start:
            return
        freed = []
        for table, windowed in zip(self._tables(seq), self.groups.windowed, strict=True):
            if windowed:
                freed += [b for b in table[seq.window_start : first] if b >= 0]
                table[seq.window_start : first] = [-1] * (first - seq.window_start)
        seq.window_start = first
        if freed:
            self.blocks.free(freed)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if self.adapters is not None:
            self.adapters.release(seq)
        held = [b for table in self._tables(seq) for b in table if b >= 0]
        if held:
            self.blocks.free(held)
        seq.block_table, seq.group_tables, seq.window_start = [], [], 0
        seq.num_registered_blocks = 0
