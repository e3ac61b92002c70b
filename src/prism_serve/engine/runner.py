"""Turns a SchedulerOutput into model inputs, runs the model, samples."""

from __future__ import annotations

import torch

from prism_serve.engine.attention import AttentionMetadata, PrefillChunk, causal_chunk_mask
from prism_serve.engine.kv_cache import KVCache
from prism_serve.engine.models.llama import LlamaForCausalLM
from prism_serve.engine.sampler import sample
from prism_serve.engine.scheduler import ScheduledSeq, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.generator = torch.Generator().manual_seed(seed)
        self._gather_k = torch.empty(0, dtype=kv_cache.tensor.dtype)
        self._gather_v = torch.empty(0, dtype=kv_cache.tensor.dtype)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[int | None]:
        """The sampled token of each scheduled request, None where its chunk ends mid-prompt."""
        # Decodes (one new token) go first so attention can batch them; the order of the
        # returned list follows sched.scheduled.
        order = sorted(range(len(sched.scheduled)), key=lambda i: sched.scheduled[i].num_new_tokens != 1)
        batch = [sched.scheduled[i] for i in order]
        input_ids, positions, meta, last_index = self._prepare(batch)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)

        sampling = [j for j, s in enumerate(batch) if s.samples]
        out: list[int | None] = [None] * len(batch)
        if sampling:
            logits = self.model.compute_logits(hidden[[last_index[j] for j in sampling]])
            seqs = [batch[j].seq for j in sampling]
            tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator)
            for j, tok in zip(sampling, tokens, strict=True):
                out[order[j]] = tok  # back to the position in sched.scheduled
        return out

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
            slot_blocks=torch.tensor(slot_blocks), slot_offsets=positions % bs, prefills=prefills
        )
        if decode_tables:
            max_blocks = max(len(t) for t in decode_tables)
            # Pad short tables with their own first block: a valid id whose keys the mask hides.
            padded = [t + [t[0]] * (max_blocks - len(t)) for t in decode_tables]
            meta.num_decodes = len(decode_tables)
            meta.decode_block_tables = torch.tensor(padded)
            if min(decode_lens) == max(decode_lens):
                meta.decode_context_len = decode_lens[0]
            else:
                lens = torch.tensor(decode_lens)
                keys = torch.arange(max_blocks * bs)
                meta.decode_mask = (keys.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
        need = meta.max_gather_blocks * self.kv_cache.layer_block_numel
        if self._gather_k.numel() < need:  # grow (with headroom) and keep for later steps
            self._gather_k = self._gather_k.new_empty(need * 5 // 4)
            self._gather_v = self._gather_v.new_empty(need * 5 // 4)
        meta.gather_k, meta.gather_v = self._gather_k, self._gather_v
        return torch.tensor(ids), positions, meta, last_index
