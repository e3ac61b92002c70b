"""Turns a SchedulerOutput into model inputs, runs the model, samples.

Logprobs are recorded on the sequences here, where the logits are (one entry per sampled token,
and prompt entries as prefill chunks pass); the engine appends the sampled tokens themselves.

On a CUDA device the model inputs are built on the host and copied over, decodes and cache
writes run the Triton kernels (cuda_kernels.py), and a step of decodes alone replays a CUDA graph
captured for the smallest batch size bucket that holds it (``DecodeGraphs``). Greedy rows without
logit processing are sampled on the device (one argmax); anything else copies the logits to the
host and samples there, with the same code as on CPU.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from prism_serve.engine import cuda_kernels
from prism_serve.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedDecodes,
    PagedPrefills,
    PrefillChunk,
    causal_chunk_mask,
)
from prism_serve.engine.cpu_kernels import kernels_enabled
from prism_serve.engine.grouping import group_decodes
from prism_serve.engine.kv_cache import KVCache
from prism_serve.engine.lora import AdapterSlots
from prism_serve.engine.sampler import sample, token_logprobs
from prism_serve.engine.scheduler import ScheduledSeq, SchedulerOutput
from prism_serve.engine.sequence import Sequence, TokenLogprob
from prism_serve.engine.structured import allowed_tokens

if TYPE_CHECKING:
    from prism_serve.engine.models import Model

# Prompt positions whose logits are computed at once for prompt_logprobs: [rows, vocab] fp32 twice
# (logits and log_softmax), about 100 MB for a 49k vocabulary, whatever the chunk length.
PROMPT_LOGITS_ROWS = 256


# Batch sizes a CUDA graph is captured for (a decode step pads to the next one), up to max_num_seqs.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class ModelRunner:
    def __init__(
        self,
        model: Model,
        kv_cache: KVCache,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        max_num_seqs: int = 0,
        cuda_graphs: bool = True,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.model = model
        self.adapters = adapters  # LoRA slots (engine/lora.py): each row's adapter update
        self.eos_token_ids = eos_token_ids  # what min_tokens forbids besides a request's stop_token_ids
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device = kv_cache.tensor.device
        self.generator = torch.Generator().manual_seed(seed)
        self._gather_k = torch.empty(0, dtype=kv_cache.tensor.dtype, device=device)
        self._gather_v = torch.empty(0, dtype=kv_cache.tensor.dtype, device=device)
        # the CPU kernels (decode attention reading the cache in place, the layer's element-wise
        # ops), or torch ops with decodes gathered for SDPA: decided once, carried by every step's
        # AttentionMetadata to attention and the model
        self.kernels = device.type == "cpu" and kernels_enabled()
        c = model.config
        self.cuda = cuda_kernels.available(c.head_dim, self.block_size, device) and model.plain_attention
        # prefill chunks through the paged prefill kernel; PRISM_CUDA_PREFILL_KERNEL=0: one SDPA call
        # per chunk (for measuring one against the other)
        self.prefill_kernel = self.cuda and os.environ.get("PRISM_CUDA_PREFILL_KERNEL") != "0"
        self.graphs = (
            DecodeGraphs(self, max_num_seqs)
            if self.cuda and cuda_graphs and max_num_seqs > 0 and os.environ.get("PRISM_CUDA_GRAPHS") != "0"
            else None
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[int | None]:
        """The sampled token of each scheduled request, None where its chunk ends mid-prompt."""
        # Decodes (one new token) go first so attention can batch them; the order of the
        # returned list follows sched.scheduled.
        order = sorted(range(len(sched.scheduled)), key=lambda i: sched.scheduled[i].num_new_tokens != 1)
        batch = [sched.scheduled[i] for i in order]
        graphs = self.graphs
        lora = self.adapters.rows(batch, self.device, self.kernels) if self.adapters is not None else None
        if (
            graphs is not None and lora is None and 0 < len(batch) <= graphs.max_batch
            and batch[-1].num_new_tokens == 1
        ):  # fmt: skip
            hidden = graphs.run(batch)  # decodes alone: replay the captured step
            last_index = list(range(len(batch)))
        else:
            prepare = self._prepare_encoder if self.model.encoder else self._prepare
            input_ids, positions, meta, last_index = prepare(batch)
            hidden = self.model.forward(input_ids, positions, meta, self.kv_cache, lora)

        for s, last in zip(batch, last_index, strict=True):
            if s.seq.prompt_logprobs is not None:
                self._prompt_logprobs(hidden, s, last, s.seq.prompt_logprobs)
            if s.seq.params.pooling is not None and not s.seq.params.score_tokens:
                _pool(hidden, s, last)
        if self.model.encoder and self.model.classifier is not None:  # a cross-encoder's pooled states
            done = [s.seq for s in batch if s.samples and s.seq.params.pooling is not None]
            if done:
                out_rows = self.model.classify(torch.stack([seq.pooled for seq in done]).to(self.device))
                for seq, row in zip(done, out_rows.cpu(), strict=True):
                    seq.pooled = row
        scoring = [j for j, s in enumerate(batch) if s.samples and s.seq.params.score_tokens]
        if scoring:  # a reranker's pair: its answer tokens' logits at the last position
            logits = self.model.compute_logits(hidden[[last_index[j] for j in scoring]])
            for row, j in enumerate(scoring):
                seq = batch[j].seq
                seq.pooled = logits[row, list(seq.params.score_tokens)].float().cpu()

        sampling = [j for j, s in enumerate(batch) if s.samples and s.seq.params.pooling is None]
        out: list[int | None] = [None] * len(batch)
        if sampling:
            logits = self.model.compute_logits(hidden[[last_index[j] for j in sampling]])
            seqs = [batch[j].seq for j in sampling]
            if not logits.is_cpu and not all(_argmax_only(s) for s in seqs):
                logits = logits.cpu()  # the sampler's features run on the host, as on a CPU device
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
            logits = self.model.compute_logits(hidden[first_row + a - start : first_row + b - start]).cpu()
            entries.extend(token_logprobs(logits, seq.token_ids[a + 1 : b + 1], [k] * (b - a)))

    def _prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        last_index: list[int] = []
        decode_lens: list[int] = []
        decodes: list[int] = []  # index in batch of each decode, in batch order
        chunks: list[tuple[int, int, int, int]] = []  # (index in batch, query_start, query_len, context_len)
        block_of: list[int] = []  # each new token's block, by its index in its sequence's tables
        tables = [self._tables(s.seq) for s in batch]  # each sequence's table of each KV group
        for j, s in enumerate(batch):
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            block_of.extend(p // bs for p in range(start, end))
            if n == 1:
                decodes.append(j)
                decode_lens.append(end)
            else:
                chunks.append((j, len(ids) - n, n, end))
            last_index.append(len(ids) - 1)

        positions = torch.tensor(pos, device=dev)
        offsets = positions % bs
        step = (batch, tables, block_of, offsets, decodes, decode_lens, chunks)
        meta = self._group_meta(*step, 0, None)
        metas = [meta, *(self._group_meta(*step, g, meta) for g in range(1, len(tables[0]) if tables else 1))]
        if len(metas) > 1:
            meta.by_group = metas
        need = max(m.max_gather_blocks for m in metas) * self.kv_cache.layer_block_numel
        if self._gather_k.numel() < need:  # grow (with headroom) and keep for later steps
            self._gather_k = self._gather_k.new_empty(need * 5 // 4)
            self._gather_v = self._gather_v.new_empty(need * 5 // 4)
        for m in metas:
            m.gather_k, m.gather_v = self._gather_k, self._gather_v
        return torch.tensor(ids, device=dev), positions, meta, last_index

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's block table of each KV group, freed entries (-1: before the window) given
        its first live block: a valid id that the window's mask hides or the kernel never reads."""
        tables = [seq.block_table, *seq.group_tables]
        if seq.window_start:
            lo = seq.window_start
            tables = [t if t[0] >= 0 else [t[lo]] * lo + t[lo:] for t in tables]
        return tables

    def _group_meta(
        self, batch: list[ScheduledSeq], tables: list[list[list[int]]], block_of: list[int],
        offsets: torch.Tensor, decodes: list[int], decode_lens: list[int],
        chunks: list[tuple[int, int, int, int]], g: int, first: AttentionMetadata | None,
    ) -> AttentionMetadata:  # fmt: skip
        """The step's attention metadata for the layers of KV group ``g``: its own block tables,
        and ``first``'s masks (group 0's, the same for every group)."""
        bs, dev = self.block_size, self.device
        slot_blocks: list[int] = []
        row = 0
        for j, s in enumerate(batch):
            table = tables[j][g]
            slot_blocks.extend(table[b] for b in block_of[row : row + s.num_new_tokens])
            row += s.num_new_tokens
        meta = AttentionMetadata(self.kv_cache.slot_rows(torch.tensor(slot_blocks, device=dev), offsets))
        meta.kernels, meta.cuda = self.kernels, self.cuda
        meta.num_decodes = len(decodes)
        decode_tables = [tables[j][g][: -(-n // bs)] for j, n in zip(decodes, decode_lens, strict=True)]
        if (self.kernels or self.cuda) and decode_tables:
            padded = _padded_tables(decode_tables).to(dev)
            splits = self._splits(len(decode_tables), padded.shape[1]) if self.cuda else 1
            meta.paged_decodes = PagedDecodes(padded, torch.tensor(decode_lens, device=dev), splits)
        if self.prefill_kernel and chunks:
            rows = torch.tensor([c[1:] for c in chunks]).T.contiguous().to(dev)
            meta.paged_prefills = PagedPrefills(
                _padded_tables([tables[c[0]][g][: -(-c[3] // bs)] for c in chunks]).to(dev),
                rows[0], rows[1], rows[2], max(c[2] for c in chunks),
            )  # fmt: skip
        elif chunks:
            meta.prefills = [
                PrefillChunk(
                    query_start=start, query_len=n, context_len=end,
                    block_table=torch.tensor(tables[j][g][: -(-end // bs)], device=dev),
                    mask=causal_chunk_mask(n, end, dev) if first is None else first.prefills[i].mask,
                    window_masks={} if first is None else first.prefills[i].window_masks,
                )
                for i, (j, start, n, end) in enumerate(chunks)
            ]  # fmt: skip
        groups = [] if self.kernels or self.cuda else group_decodes(decode_lens)
        for i, group in enumerate(groups):
            lens = [decode_lens[k] for k in group]
            padded = _padded_tables([decode_tables[k] for k in group]).to(dev)
            if first is not None:  # group 0's rows, lengths and masks, this group's tables
                meta.decode_groups.append(replace(first.decode_groups[i], block_tables=padded))
                continue
            rows = None if len(groups) == 1 else torch.tensor(group, device=dev)
            lens_t = torch.tensor(lens, device=dev)
            if min(lens) == max(lens):
                meta.decode_groups.append(DecodeGroup(rows, padded, None, lens[0], lens_t))
            else:
                keys = torch.arange(padded.shape[1] * bs, device=dev)
                mask = (keys.unsqueeze(0) < lens_t.unsqueeze(1))[:, None, None, :]
                meta.decode_groups.append(DecodeGroup(rows, padded, mask, max(lens), lens_t))
        return meta

    def _prepare_encoder(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """An encoder's step: each input whole, one after another (no cache rows: it keeps no KV),
        with each token's type (1 from a pair's second segment on, ``SamplingParams.pair_start``)."""
        ids: list[int] = []
        pos: list[int] = []
        seconds: list[tuple[int, int]] = []  # (first row of type 1, end of its input) of each pair
        chunks, last_index = [], []
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        for s in batch:
            seq, n = s.seq, s.num_new_tokens
            ids.extend(seq.token_ids[:n])
            pos.extend(range(n))
            start = len(ids) - n
            if seq.params.pair_start is not None:
                seconds.append((start + seq.params.pair_start, len(ids)))
            chunks.append(PrefillChunk(query_start=start, query_len=n, context_len=n,
                                       block_table=empty, mask=None))  # fmt: skip
            last_index.append(len(ids) - 1)
        dev = self.device
        meta = AttentionMetadata(slot_rows=empty, prefills=chunks)
        if seconds:  # an embedder's inputs are all type 0: no tensor for them
            types = torch.zeros(len(ids), dtype=torch.long)
            for begin, end in seconds:
                types[begin:end] = 1
            meta.token_types = types.to(dev)
        return torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, last_index

    def _splits(self, num_seqs: int, max_blocks: int) -> int:
        return cuda_kernels.num_splits(num_seqs, self.model.config.num_kv_heads, max_blocks, self.device)


def _pool(hidden: torch.Tensor, s: ScheduledSeq, last: int) -> None:
    """An embedding request's chunk: the last prompt token's final hidden state (copied to the host:
    a CUDA graph's output buffer is reused), the first token's, or the sum of the positions not
    summed yet (a prompt recomputed after preemption adds none twice), divided by their number at
    the last chunk."""
    seq = s.seq
    start = seq.num_computed_tokens
    if seq.params.pooling == "last":
        if s.samples:
            seq.pooled = hidden[last].float().cpu()
        return
    if seq.params.pooling == "cls":
        if start == 0:
            seq.pooled = hidden[last - s.num_new_tokens + 1].float().cpu()
        return
    begin, end = max(start, seq.num_pooled), start + s.num_new_tokens
    if end > begin:
        first_row = last - s.num_new_tokens + 1  # the hidden row of position `start`
        part = hidden[first_row + begin - start : first_row + end - start].float().sum(0).cpu()
        seq.pooled = part if seq.pooled is None else seq.pooled.add_(part)
        seq.num_pooled = end
    if s.samples:
        seq.pooled = seq.pooled / seq.num_pooled


def _argmax_only(seq: Sequence) -> bool:
    """The row's token is the argmax of its raw logits and nothing else is read from them."""
    p = seq.params
    return p.greedy and not p.processes_logits and seq.matcher is None and seq.logprobs is None


class DecodeGraphs:
    """CUDA graphs of the model's forward pass for steps of decodes alone, one per batch size of
    ``GRAPH_BATCH_SIZES`` (captured the first time a step needs it). Inputs live in static
    buffers: the step's tokens, positions, cache rows, block tables (as wide as the longest
    context) and lengths are copied in, padding rows get slot -1 (no cache write) and length 0
    (no attention), and the graph is replayed. The KV cache's address never changes (the elastic
    pool maps pages under a fixed reservation), so a graph stays valid while pages come and go."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int) -> None:
        self.runner = runner
        self.sizes = sorted({b for b in GRAPH_BATCH_SIZES if b < max_num_seqs} | {max_num_seqs})
        self.max_batch = self.sizes[-1]
        dev = runner.device
        self.max_blocks = -(-runner.model.cos.shape[0] // runner.block_size)
        # rows: input ids, positions, cache rows, lengths
        self.inputs = torch.zeros(4, self.max_batch, dtype=torch.long, device=dev)
        self.tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        n = len(batch)
        size = next(b for b in self.sizes if b >= n)
        bs, kv_cache = self.runner.block_size, self.runner.kv_cache
        pad = size - n
        ids, pos, slots, lens, tables = [], [], [], [], []
        for s in batch:
            seq = s.seq
            p = seq.num_computed_tokens
            tables.append(seq.block_table[: p // bs + 1])
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(kv_cache.slot_rows(tables[-1][-1], p % bs))
            lens.append(p + 1)
        zeros = [0] * pad
        host = torch.tensor([ids + zeros, pos + zeros, slots + [-1] * pad, lens + zeros])
        self.inputs[:, :size].copy_(host)
        # the real rows, only as wide as their longest table: the kernel reads no further, nor
        # any row of the padding (length 0)
        padded = _padded_tables(tables)
        self.tables[:n, : padded.shape[1]].copy_(padded)
        graph = self.graphs.get(size)
        if graph is None:
            graph = self._capture(size)
        graph.replay()
        return self.outputs[size][:n]

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        r = self.runner
        ids, positions, slots, lens = self.inputs[:, :size]
        splits = r._splits(size, self.max_blocks)
        meta = AttentionMetadata(
            slot_rows=slots, num_decodes=size, cuda=True,
            paged_decodes=PagedDecodes(self.tables[:size], lens, splits),
        )  # fmt: skip
        stream = torch.cuda.Stream(r.device)
        stream.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(stream):  # compiles the kernels and settles the allocator first
            r.model.forward(ids, positions, meta, r.kv_cache)
        torch.cuda.current_stream(r.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the KV pool's prefetch thread may map pages (cuMemMap) during the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[size] = r.model.forward(ids, positions, meta, r.kv_cache)
        self.pool = graph.pool()
        self.graphs[size] = graph
        return graph


def _padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [n, longest] tensor, short ones padded with their own first block: a
    valid id whose keys the mask hides (SDPA) or the kernel never reads (past the context)."""
    longest = max(len(t) for t in tables)
    return torch.tensor([t + [t[0]] * (longest - len(t)) for t in tables])
