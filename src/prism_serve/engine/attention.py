"""Attention over the paged KV cache, for a batch that mixes decodes and prefill chunks.

Decodes (one new token each) come first in the batch. On CPU they are attended by one call of the
paged decode kernel (``cpu_kernels.paged_decode``), which reads each decode's own context in place
in the cache; on CUDA the Triton kernel of ``cuda_kernels`` does the same (and writes the new K and
V). Elsewhere (no kernels, or ``PRISM_CPU_KERNELS=off``) they run as batched SDPA
calls over their block tables, gathered and padded to the longest context of their group: decodes
are grouped by context length (``group_decodes``) so that a short context is not padded to the
longest one of a mixed batch. Prefill chunks follow: on CUDA all of them in one launch of the
paged prefill kernel (``cuda_kernels.paged_prefill``; ``PRISM_CUDA_PREFILL_KERNEL=0`` turns it
off), elsewhere one SDPA call each, attending to their cached prefix plus themselves (causal); a
chunk that is its whole context (a prompt prefilled in one step) attends to the K and V it just
computed, with no gather.

A layer may attend through a sliding window (the query and the window - 1 tokens before it) and
soft-cap its scores (``softcap * tanh(s / softcap)``, Gemma 2): the CPU kernel does both, the SDPA
paths mask the window and compute soft-capped scores by hand; the CUDA kernels do neither, so the
runner does not use them for a model that needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from prism_serve.engine import cuda_kernels
from prism_serve.engine.cpu_kernels import paged_decode


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the batch
    query_len: int
    context_len: int  # cached tokens + this chunk
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids
    mask: torch.Tensor | None  # [query_len, context_len] bool; None when the chunk is the whole context
    # the mask within each sliding window the model's layers use, made by the first such layer
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def windowed(self, window: int | None) -> torch.Tensor | None:
        """The chunk's mask within ``window`` (None: no window, or one no shorter than its context)."""
        if window is None or window >= self.context_len:
            return self.mask
        if window not in self.window_masks:
            self.window_masks[window] = window_mask(
                self.query_len, self.context_len, window, self.block_table.device
            )
        return self.window_masks[window]


@dataclass(slots=True)
class DecodeGroup:
    """Decodes attended in one SDPA call: their rows of the batch, block tables padded to the
    group's longest context, and a mask hiding the padding (None when all have one length)."""

    rows: torch.Tensor | None  # [n] rows of the batch; None: every decode, in batch order
    block_tables: torch.Tensor  # [n, max_blocks]
    mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size]
    context_len: int  # keys attended when there is no mask
    lens: torch.Tensor  # [n] keys each decode attends to (for a sliding window's mask)
    # the mask within each sliding window the model's layers use, made by the first such layer
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def windowed(self, window: int | None, num_keys: int) -> torch.Tensor | None:
        """The group's mask over its first ``num_keys`` gathered keys, hiding those before
        ``window`` too (None: no window and one length)."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            keys = torch.arange(num_keys, device=self.lens.device)
            inside = (keys.unsqueeze(0) >= (self.lens - window).unsqueeze(1))[:, None, None, :]
            self.window_masks[window] = inside if self.mask is None else self.mask & inside
        return self.window_masks[window]


@dataclass(slots=True)
class PagedDecodes:
    """Every decode of the batch for the paged kernel: block tables (short ones padded with a
    valid id the kernel never reads) and the keys each attends to."""

    block_tables: torch.Tensor  # [n, max_blocks] int64
    lens: torch.Tensor  # [n] int64
    splits: int = 1  # CUDA: programs each sequence's blocks are split over (cuda_kernels.num_splits)


@dataclass(slots=True)
class PagedPrefills:
    """Every prefill chunk of the batch for the CUDA prefill kernel (rows of one tensor each)."""

    block_tables: torch.Tensor  # [n, max_blocks] int64, short ones padded with a valid id
    query_starts: torch.Tensor  # [n] int64 first row of each chunk in the batch
    query_lens: torch.Tensor  # [n] int64
    context_lens: torch.Tensor  # [n] int64 cached tokens + the chunk
    max_query_len: int


@dataclass(slots=True)
class AttentionMetadata:
    slot_rows: torch.Tensor  # [T] row of KVCache.layer_rows where each new token's K/V goes
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # SDPA over gathered blocks
    paged_decodes: PagedDecodes | None = None  # or the kernel that reads the cache in place
    kernels: bool = False  # the step runs the CPU kernels (ModelRunner.kernels), layer ops included
    cuda: bool = False  # the step runs the CUDA kernels: cache writes and decode attention
    prefills: list[PrefillChunk] = field(default_factory=list)  # SDPA, one call per chunk
    paged_prefills: PagedPrefills | None = None  # or the CUDA kernel, every chunk in one launch
    # Scratch for gathered K and V, reused by every layer and step: allocating ~10 MB per layer
    # costs page faults that showed up as a third of a batched fp32 decode step.
    gather_k: torch.Tensor | None = None  # flat, at least max_gather_blocks * block numel
    gather_v: torch.Tensor | None = None
    # an encoder's step (models/bert.py): each token's type (1 in a pair's second segment); None: all 0
    token_types: torch.Tensor | None = None
    # a model with several KV groups (kv_cache.KVGroups): each group's metadata, this one first
    by_group: list[AttentionMetadata] = field(default_factory=list)

    def for_layer(self, group: int) -> AttentionMetadata:
        """The metadata of the layers of KV group ``group``."""
        return self.by_group[group] if self.by_group else self

    @property
    def max_gather_blocks(self) -> int:
        """Most blocks any one attention call of this batch gathers."""
        return max([0, *(g.block_tables.numel() for g in self.decode_groups),
                    *(p.block_table.numel() for p in self.prefills)])  # fmt: skip


def causal_chunk_mask(
    query_len: int, context_len: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """Query i sits at position context_len - query_len + i and sees keys up to there."""
    if query_len == context_len:
        return None
    offset = context_len - query_len
    q_pos = torch.arange(query_len, device=device).unsqueeze(1) + offset
    return torch.arange(context_len, device=device).unsqueeze(0) <= q_pos


def window_mask(
    query_len: int, context_len: int, window: int, device: torch.device | None = None
) -> torch.Tensor:
    """A chunk's causal mask within a sliding window: query i (at position context_len -
    query_len + i) sees itself and the window - 1 keys before it."""
    q_pos = torch.arange(query_len, device=device).unsqueeze(1) + (context_len - query_len)
    keys = torch.arange(context_len, device=device).unsqueeze(0)
    return (keys <= q_pos) & (keys > q_pos - window)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],  # the same caches as token rows (KVCache.layer_rows)
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # a sliding window (ArchConfig.layer_window)
    softcap: float | None = None,  # soft-capped scores (ArchConfig.attn_softcap)
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    if meta.cuda:  # skips negative slots (the padding rows of a CUDA graph's batch)
        cuda_kernels.store_kv(k, v, rows[0], rows[1], meta.slot_rows)
    else:
        rows[0].index_copy_(0, meta.slot_rows, k.reshape(num_tokens, -1))
        rows[1].index_copy_(0, meta.slot_rows, v.reshape(num_tokens, -1))
    num_kv_heads = k.shape[1]
    out = q.new_empty(num_tokens, num_heads, head_dim)

    nd = meta.num_decodes
    if meta.paged_decodes is not None:
        pd = meta.paged_decodes
        if meta.cuda:
            if window is not None or softcap is not None:
                raise NotImplementedError("the CUDA decode kernel has no sliding window or soft cap")
            cuda_kernels.paged_decode(
                q[:nd], k_cache, v_cache, pd.block_tables, pd.lens, scale, out[:nd], pd.splits
            )
        else:
            paged_decode(q[:nd], k_cache, v_cache, pd.block_tables, pd.lens, scale, out[:nd], window, softcap)
    for g in meta.decode_groups:
        n = g.block_tables.shape[0]
        # Each KV head's query group acts as a short query sequence: [n, kv_heads, group, head_dim].
        qg = q[:nd] if g.rows is None else q.index_select(0, g.rows)
        qd = qg.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        kd = _gather(k_cache, g.block_tables, meta.gather_k).transpose(1, 2)  # [n, kvh, L, hd]
        vd = _gather(v_cache, g.block_tables, meta.gather_v).transpose(1, 2)
        if g.mask is None:
            kd, vd = kd[:, :, : g.context_len], vd[:, :, : g.context_len]
        od = _attend(qd, kd, vd, g.windowed(window, kd.shape[2]), False, scale, softcap, gqa=False)
        if g.rows is None:
            out[:nd] = od.reshape(n, num_heads, head_dim)
        else:
            out.index_copy_(0, g.rows, od.reshape(n, num_heads, head_dim))

    if meta.paged_prefills is not None:
        if window is not None or softcap is not None:
            raise NotImplementedError("the CUDA prefill kernel has no sliding window or soft cap")
        pp = meta.paged_prefills
        cuda_kernels.paged_prefill(
            q, k_cache, v_cache, pp.block_tables, pp.query_starts, pp.query_lens, pp.context_lens,
            pp.max_query_len, scale, out,
        )  # fmt: skip
    for p in meta.prefills:
        end = p.query_start + p.query_len
        # A leading batch dimension of 1: with 3-D inputs torch picks a generic CPU kernel that
        # is ~3x slower than the flash kernel it uses for 4-D ones.
        if p.query_len == p.context_len:  # nothing cached before it: its own K and V are all of it
            kp = k[p.query_start : end].transpose(0, 1)[None]
            vp = v[p.query_start : end].transpose(0, 1)[None]
        else:
            kp = _gather(k_cache, p.block_table, meta.gather_k)[: p.context_len].transpose(0, 1)[None]
            vp = _gather(v_cache, p.block_table, meta.gather_v)[: p.context_len].transpose(0, 1)[None]
        qp = q[p.query_start : end].transpose(0, 1)[None]  # [1, heads, qlen, hd]
        mask = p.windowed(window)
        op = _attend(qp, kp, vp, mask, mask is None, scale, softcap, gqa=True)
        out[p.query_start : end] = op[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)


def _attend(
    q: torch.Tensor,  # [batch, heads, queries, head_dim]
    k: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcast to [batch, 1, queries, keys]; True: attended
    causal: bool,
    scale: float,
    softcap: float | None,
    gqa: bool,
) -> torch.Tensor:
    """SDPA, or with soft-capped scores (which SDPA cannot do) the same computed in steps: scores
    in fp32, capped, masked, softmax, weighted values. Query heads share KV heads in groups."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    b, heads, queries, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    qg = q.view(b, kv_heads, heads // kv_heads, queries, head_dim)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).float().mul_(scale)
    scores = torch.tanh(scores.div_(softcap)).mul_(softcap)  # [b, kv_heads, group, queries, keys]
    if causal:
        mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
    if mask is not None:
        scores.masked_fill_(~(mask if mask.dim() <= 2 else mask.unsqueeze(2)), float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(v.dtype), v.unsqueeze(2))
    return out.view(b, heads, queries, head_dim)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
    """Copy the blocks of ``block_table`` ([..., num_blocks]) out of ``cache`` as one run of tokens:
    [..., num_blocks * block_size, kv_heads, head_dim], into ``scratch`` when given. index_select
    copies whole blocks; advanced indexing (cache[table]) copies element by element and is ~20x
    slower on CPU."""
    ids = block_table.flatten()
    if scratch is None:
        blocks = cache.index_select(0, ids)
    else:
        block_shape = cache.shape[1:]
        blocks = scratch[: ids.numel() * block_shape.numel()].view(ids.numel(), *block_shape)
        torch.index_select(cache, 0, ids, out=blocks)
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])
