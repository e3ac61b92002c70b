"""Paged attention's pieces against plain references: decodes grouped by context length give what
one padded batch gives, a whole-prompt chunk without the gather gives what the gathered one gives,
and new K/V written as rows land where (block, offset) indexing puts them."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from prism_serve.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    paged_attention,
)
from prism_serve.engine.grouping import group_decodes, padded_decode_context
from prism_serve.engine.kv_cache import KVCache
from prism_serve.engine.models.config import ArchConfig

BS, HEADS, KV_HEADS, HD = 4, 6, 2, 8


def _cache(num_blocks: int = 64) -> KVCache:
    config = ArchConfig(architecture="llama", vocab_size=32, hidden_size=HEADS * HD, intermediate_size=16,
                        num_layers=3, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HD,
                        max_position_embeddings=512)  # fmt: skip
    return KVCache(config, num_blocks, BS, torch.float32)


def test_groups_split_where_contexts_differ_most():
    assert group_decodes([]) == []
    assert group_decodes([10, 10, 10]) == [[0, 1, 2]]
    lens = [500, 20, 480, 300, 25, 900]
    groups = group_decodes(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))  # every row once
    for g in groups:
        longest = max(lens[i] for i in g)
        assert all(lens[i] >= 0.6 * longest for i in g)
    assert len(group_decodes(list(range(1, 200, 3)))) <= 4  # at most MAX_GROUPS calls per layer


def test_padded_context_counts_the_keys_of_the_groups():
    """The simulator's count (no torch): each decode padded to its group's longest context."""
    assert padded_decode_context([]) == 0
    assert padded_decode_context([10, 10, 10]) == 30
    assert padded_decode_context([300, 200]) == 600  # 200 >= 0.6 * 300: one group
    assert padded_decode_context([300, 100]) == 400  # two groups, nothing padded
    # groups 900 | 500, 480, 300 | 25, 20
    assert padded_decode_context([500, 20, 480, 300, 25, 900]) == 900 + 3 * 500 + 2 * 25


def test_rows_are_the_blocks_and_offsets_of_every_layer():
    kv = _cache()
    blocks, offsets = torch.tensor([5, 63, 0, 5]), torch.tensor([0, 3, 2, 1])
    rows = kv.slot_rows(blocks, offsets)
    for layer, ((k_cache, v_cache), (k_rows, v_rows)) in enumerate(
        zip(kv.layers, kv.layer_rows, strict=True)
    ):
        k = torch.randn(4, KV_HEADS, HD)
        v = torch.randn(4, KV_HEADS, HD)
        k_rows.index_copy_(0, rows, k.reshape(4, -1))
        v_rows.index_copy_(0, rows, v.reshape(4, -1))
        assert torch.equal(k_cache[blocks, offsets], k) and torch.equal(v_cache[blocks, offsets], v), layer
    # nothing else was written: the other layers' K/V of those blocks are still zero
    assert int((kv.tensor != 0).sum()) == 3 * 2 * 4 * KV_HEADS * HD


def _reference(q, k_cache, v_cache, tables, lens):
    """Each decode alone, over exactly its own keys."""
    out = []
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        keys = k_cache[torch.tensor(table)].reshape(-1, KV_HEADS, HD)[:n].transpose(0, 1)
        vals = v_cache[torch.tensor(table)].reshape(-1, KV_HEADS, HD)[:n].transpose(0, 1)
        qi = q[i].view(KV_HEADS, HEADS // KV_HEADS, HD)
        out.append(F.scaled_dot_product_attention(qi, keys, vals).reshape(HEADS, HD))
    return torch.stack(out)


def _meta(groups, nd, slot_rows):
    gk = torch.empty(10_000 * BS * KV_HEADS * HD)
    return AttentionMetadata(slot_rows=slot_rows, num_decodes=nd, decode_groups=groups, gather_k=gk,
                             gather_v=torch.empty_like(gk))  # fmt: skip


def test_grouped_decodes_equal_each_decode_alone():
    torch.manual_seed(0)
    rng = random.Random(0)
    kv = _cache()
    k_cache, v_cache = kv.layers[1]
    k_cache.copy_(torch.randn_like(k_cache))
    v_cache.copy_(torch.randn_like(v_cache))
    lens = [3, 40, 38, 9, 17, 40]
    free = list(range(kv.num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lens]
    q = torch.randn(len(lens), HEADS, HD)
    nd = len(lens)
    groups = []
    for g in group_decodes(lens):
        width = max(len(tables[i]) for i in g)
        padded = torch.tensor([tables[i] + [tables[i][0]] * (width - len(tables[i])) for i in g])
        glens = torch.tensor([lens[i] for i in g])
        mask = (torch.arange(width * BS)[None] < glens[:, None])[:, None, None, :]
        groups.append(DecodeGroup(torch.tensor(g), padded, mask, max(lens[i] for i in g), glens))
    assert len(groups) > 1
    # the new tokens' K/V are written first: give them slots outside every table
    slot_rows = kv.slot_rows(torch.tensor([free[0]] * nd), torch.arange(nd) % BS)
    k_new, v_new = torch.randn(nd, KV_HEADS, HD), torch.randn(nd, KV_HEADS, HD)
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, kv.layer_rows[1], _meta(groups, nd, slot_rows),
                          HD**-0.5)  # fmt: skip
    expected = _reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out.view(nd, HEADS, HD), expected, rtol=1e-5, atol=1e-5)


def test_a_whole_prompt_attends_to_its_own_kv_as_to_the_gathered_kv():
    torch.manual_seed(1)
    kv = _cache()
    k_cache, v_cache = kv.layers[0]
    n = 10
    table = [7, 3, 11]
    q, k, v = torch.randn(n, HEADS, HD), torch.randn(n, KV_HEADS, HD), torch.randn(n, KV_HEADS, HD)
    pos = torch.arange(n)
    slot_rows = kv.slot_rows(torch.tensor(table)[pos // BS], pos % BS)
    chunk = PrefillChunk(
        query_start=0, query_len=n, context_len=n, block_table=torch.tensor(table), mask=None
    )
    meta = _meta([], 0, slot_rows)
    meta.prefills = [chunk]
    out = paged_attention(q, k, v, k_cache, v_cache, kv.layer_rows[0], meta, HD**-0.5)
    # the K/V were written to the cache, and attending to them there gives the same result
    keys = k_cache[torch.tensor(table)].reshape(-1, KV_HEADS, HD)[:n]
    assert torch.equal(keys, k)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
        v_cache[torch.tensor(table)].reshape(-1, KV_HEADS, HD)[:n].transpose(0, 1)[None],
        is_causal=True, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out.view(n, HEADS, HD), expected, rtol=0, atol=0)
