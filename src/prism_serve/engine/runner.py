"""Turns a SchedulerOutput into model inputs, runs the model, samples.

Logprobs are recorded on the sequences here, where the logits are (one entry per sampled token,
and prompt entries as prefill chunks pass); the engine appends the sampled tokens themselves.
"""

from __future__ import annotations

import torch

from prism_serve.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedDecodes,
    PrefillChunk,
    causal_chunk_mask,
)
from prism_serve.engine.cpu_kernels import kernels_enabled
from prism_serve.engine.grouping import group_decodes
from prism_serve.engine.kv_cache import KVCache
from prism_serve.engine.models.llama import LlamaForCausalLM
from prism_serve.engine.sampler import sample, token_logprobs
from prism_serve.engine.scheduler import ScheduledSeq, SchedulerOutput
from prism_serve.engine.sequence import TokenLogprob
from prism_serve.engine.structured import allowed_tokens

# Prompt positions whose logits are computed at once for prompt_logprobs: [rows, vocab] fp32 twice
# (logits and log_softmax), about 100 MB for a 49k vocabulary, whatever the chunk length.
PROMPT_LOGITS_ROWS = 256


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, seed: int = 0, eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids  # what min_tokens forbids besides a request's stop_token_ids
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.generator = torch.Generator().manual_seed(seed)
        self._gather_k = torch.empty(0, dtype=kv_cache.tensor.dtype)
        self._gather_v = torch.empty(0, dtype=kv_cache.tensor.dtype)
        # the CPU kernels (decode attention reading the cache in place, the layer's element-wise
        # ops), or torch ops with decodes gathered for SDPA: decided once, carried by every step's
        # AttentionMetadata to attention and the model
        self.kernels = kv_cache.tensor.device.type == "cpu" and kernels_enabled()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[int | None]:
        """The sampled token of each scheduled request, None where its chunk ends mid-prompt."""
        # Decodes (one new token) go first so attention can batch them; the order of the
        # returned list follows sched.scheduled.
        order = sorted(range(len(sched.scheduled)), key=lambda i: sched.scheduled[i].num_new_tokens != 1)
        batch = [sched.scheduled[i] for i in order]
        input_ids, positions, meta, last_index = self._prepare(batch)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)

        for s, last in zip(batch, last_index, strict=True):
            if s.seq.prompt_logprobs is not None:
                self._prompt_logprobs(hidden, s, last, s.seq.prompt_logprobs)

        sampling = [j for j, s in enumerate(batch) if s.samples]
        out: list[int | None] = [None] * len(batch)
        if sampling:
            logits = self.model.compute_logits(hidden[[last_index[j] for j in sampling]])
            seqs = [batch[j].seq for j in sampling]
            constrained = [r for r, s in enumerate(seqs) if s.matcher is not None]
            allowed = None
            if constrained:
                matchers = [seqs[r].matcher for r in constrained]
                allowed = (constrained, allowed_tokens(matchers, logits.shape[1]))  # type: ignore[arg-type]
            tokens = sample(
                logits,
                [s.params for s in seqs],
                [s.generator for s in seqs],
                self.generator,
                seqs,
                self.eos_token_ids,
                allowed,
            )
            want = [r for r, s in enumerate(seqs) if s.logprobs is not None]
            if want:
                entries = token_logprobs(
                    logits[want], [tokens[r] for r in want], [seqs[r].params.logprobs or 0 for r in want]
                )
                for r, entry in zip(want, entries, strict=True):
                    seqs[r].logprobs.append(entry)  # type: ignore[union-attr]
            for j, tok in zip(sampling, tokens, strict=True):
                out[order[j]] = tok  # back to the position in sched.scheduled
        return out

    def _prompt_logprobs(
        self, hidden: torch.Tensor, s: ScheduledSeq, last: int, entries: list[TokenLogprob | None]
    ) -> None:
        """Score the prompt tokens this chunk reaches that have no entry yet: the hidden state at
        position p predicts token p + 1. A prompt recomputed after preemption finds its entries
        there already and adds none; the last prompt position predicts the first output token,
        which is sampled, not scored here."""
        seq = s.seq
        start = seq.num_computed_tokens
        first_row = last - s.num_new_tokens + 1  # hidden row of position `start`
        begin = max(start, len(entries) - 1)
        end = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
        k = seq.params.prompt_logprobs or 0
        for a in range(begin, end, PROMPT_LOGITS_ROWS):
            b = min(a + PROMPT_LOGITS_ROWS, end)
            logits = self.model.compute_logits(hidden[first_row + a - start : first_row + b - start])
            entries.extend(token_logprobs(logits, seq.token_ids[a + 1 : b + 1], [k] * (b - a)))

    def _prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        last_index: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for s in batch:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            end = start + n
            table = seq.block_table
            ids.extend(seq.token_ids[start:end])
            span = range(start, end)
            pos.extend(span)
            slot_blocks.extend(table[p // bs] for p in span)
            if n == 1:
                decode_tables.append(table[: -(-end // bs)])
                decode_lens.append(end)
            else:
                prefills.append(
                    PrefillChunk(
                        query_start=len(ids) - n,
                        query_len=n,
                        context_len=end,
                        block_table=torch.tensor(table[: -(-end // bs)]),
                        mask=causal_chunk_mask(n, end),
                    )
                )
            last_index.append(len(ids) - 1)

        positions = torch.tensor(pos)
        meta = AttentionMetadata(
            slot_rows=self.kv_cache.slot_rows(torch.tensor(slot_blocks), positions % bs), prefills=prefills
        )
        meta.num_decodes = len(decode_tables)
        meta.kernels = self.kernels
        if self.kernels and decode_tables:
            meta.paged_decodes = PagedDecodes(_padded_tables(decode_tables), torch.tensor(decode_lens))
        groups = [] if self.kernels else group_decodes(decode_lens)
        for g in groups:
            tables, lens = [decode_tables[i] for i in g], [decode_lens[i] for i in g]
            max_blocks = max(len(t) for t in tables)
            padded = _padded_tables(tables)
            rows = None if len(groups) == 1 else torch.tensor(g)
            if min(lens) == max(lens):
                meta.decode_groups.append(DecodeGroup(rows, padded, None, lens[0]))
            else:
                keys = torch.arange(max_blocks * bs)
                mask = (keys.unsqueeze(0) < torch.tensor(lens).unsqueeze(1))[:, None, None, :]
                meta.decode_groups.append(DecodeGroup(rows, padded, mask, max(lens)))
        need = meta.max_gather_blocks * self.kv_cache.layer_block_numel
        if self._gather_k.numel() < need:  # grow (with headroom) and keep for later steps
            self._gather_k = self._gather_k.new_empty(need * 5 // 4)
            self._gather_v = self._gather_v.new_empty(need * 5 // 4)
        meta.gather_k, meta.gather_v = self._gather_k, self._gather_v
        return torch.tensor(ids), positions, meta, last_index


def _padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [n, longest] tensor, short ones padded with their own first block: a
    valid id whose keys the mask hides (SDPA) or the kernel never reads (past the context)."""
    longest = max(len(t) for t in tables)
    return torch.tensor([t + [t[0]] * (longest - len(t)) for t in tables])
