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
        kd = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)  # [nd, kv_heads, L, hd]
        vd = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)
        if meta.decode_mask is None:
            kd, vd = kd[:, :, : meta.decode_context_len], vd[:, :, : meta.decode_context_len]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)

    for p in meta.prefills:
        end = p.query_start + p.query_len
        kp = _gather(k_cache, p.block_table)[: p.context_len].transpose(0, 1)  # [kv_heads, ctx, hd]
        vp = _gather(v_cache, p.block_table)[: p.context_len].transpose(0, 1)
        qp = q[p.query_start : end].transpose(0, 1)  # [heads, qlen, hd]
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
        )
        out[p.query_start : end] = op.transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Copy the blocks of ``block_table`` ([..., num_blocks]) out of ``cache`` as one run of tokens:
    [..., num_blocks * block_size, kv_heads, head_dim]. index_select copies whole blocks; advanced
    indexing (cache[table]) copies element by element and is ~20x slower on CPU."""
    blocks = cache.index_select(0, block_table.flatten())
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])
