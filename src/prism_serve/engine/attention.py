"""Attention over the paged KV cache, for a batch that mixes decodes and prefill chunks.

Decodes (one new token each) come first in the batch and run as one batched SDPA call over their
block tables, gathered and padded to the longest context. Prefill chunks follow, one SDPA call
each, attending to their cached prefix plus themselves (causal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the batch
    query_len: int
    context_len: int  # cached tokens + this chunk
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids
    mask: torch.Tensor | None  # [query_len, context_len] bool; None when the chunk is the whole context


@dataclass(slots=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id where each new token's K/V goes
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]; None = no padding
    decode_context_len: int = 0  # keys attended by every decode row (padded length)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Scratch for gathered K and V, reused by every layer and step: allocating ~10 MB per layer
    # costs page faults that showed up as a third of a batched fp32 decode step.
    gather_k: torch.Tensor | None = None  # flat, at least max_gather_blocks * block numel
    gather_v: torch.Tensor | None = None

    @property
    def max_gather_blocks(self) -> int:
        """Most blocks any one attention call of this batch gathers."""
        most = 0 if self.decode_block_tables is None else self.decode_block_tables.numel()
        return max([most, *(p.block_table.numel() for p in self.prefills)])


def causal_chunk_mask(query_len: int, context_len: int) -> torch.Tensor | None:
    """Query i sits at position context_len - query_len + i and sees keys up to there."""
    if query_len == context_len:
        return None
    offset = context_len - query_len
    q_pos = torch.arange(query_len).unsqueeze(1) + offset
    return torch.arange(context_len).unsqueeze(0) <= q_pos


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = q.new_empty(num_tokens, num_heads, head_dim)

    nd = meta.num_decodes
    if nd:
        # Each KV head's query group acts as a short query sequence: [nd, kv_heads, group, head_dim].
        qd = q[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        kd = _gather(k_cache, meta.decode_block_tables, meta.gather_k).transpose(1, 2)  # [nd, kvh, L, hd]
        vd = _gather(v_cache, meta.decode_block_tables, meta.gather_v).transpose(1, 2)
        if meta.decode_mask is None:
            kd, vd = kd[:, :, : meta.decode_context_len], vd[:, :, : meta.decode_context_len]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)

    for p in meta.prefills:
        end = p.query_start + p.query_len
        # A leading batch dimension of 1: with 3-D inputs torch picks a generic CPU kernel that
        # is ~3x slower than the flash kernel it uses for 4-D ones.
        kp = _gather(k_cache, p.block_table, meta.gather_k)[: p.context_len].transpose(0, 1)[None]
        vp = _gather(v_cache, p.block_table, meta.gather_v)[: p.context_len].transpose(0, 1)[None]
        qp = q[p.query_start : end].transpose(0, 1)[None]  # [1, heads, qlen, hd]
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
        )
        out[p.query_start : end] = op[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)


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
