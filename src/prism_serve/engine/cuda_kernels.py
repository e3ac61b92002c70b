"""Triton kernels for the engine on a CUDA device: the KV-cache write and paged attention for
decodes and for prefill chunks.

``store_kv`` writes each new token's K and V to its row of the paged cache (``KVCache.layer_rows``)
and skips rows whose slot is negative: a CUDA graph captured for a batch of B decodes also runs
the padding rows of a smaller batch, and those must write nothing.

``paged_decode`` attends each decode to its own context in place in the cache, as the CPU kernel
(csrc/paged_decode.cpp) does: no gather, no padding to the longest context. One program handles
one sequence, one KV head (its group of query heads together, as one small matrix product per
block) and one split of the sequence's blocks; with few sequences the blocks are split over
several programs (flash-decoding) so that the GPU has enough programs, and a second kernel merges
the splits' softmax states. A sequence of length 0 (graph padding) gets zeros.

``paged_prefill`` attends every prefill chunk of a step in one launch, each reading its cached
prefix and its own new tokens (written by ``store_kv`` just before) in place in the cache, causal
within the chunk. A program takes a tile of a chunk's (token, query head) rows that share one KV
head, so K and V are read once for the whole query group whatever its size, and walks the
chunk's keys up to the tile's last position with a running softmax (flash attention over a block
table). Tiles past a short chunk's end do nothing.

``lora_apply`` adds each row's LoRA update to a fused linear's output (engine/lora.py): a shrink
kernel (one program per row: the row's input against its slot's A, the slot's own rank of it)
into an fp32 buffer, then an expand kernel (one program per row and block of output columns: that
against B, added to the output in place). A row reads only its own adapter, so the work is the
rows' ranks, whatever the number of adapters in the batch. Tested in Triton's CPU interpreter
(``TRITON_INTERPRET=1``) against the grouped torch ops.

Triton comes with the CUDA builds of torch. ``available()`` says whether these kernels can run for
a model: a CUDA tensor, Triton importable, head_dim and block_size powers of two of at least 16.
Elsewhere the engine attends with torch's SDPA over gathered blocks (attention.py).
"""

from __future__ import annotations

import functools

import torch

try:  # the CPU-only torch build has no Triton; nothing here is used there
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None
    tl = None

_MAX_SPLITS = 32


def available(head_dim: int, block_size: int, device: torch.device) -> bool:
    """Whether the kernels serve a model of this head_dim on a cache of this block_size."""
    pow2 = all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, block_size))
    return triton is not None and device.type == "cuda" and pow2 and head_dim <= 256


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Splits per sequence so that about two programs run per multiprocessor (1 when the batch
    alone fills the GPU), never more than the blocks or ``_MAX_SPLITS``."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 1
    want = -(-2 * sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(want, max_blocks, _MAX_SPLITS))


if triton is not None:
    # The starting max score: finite, so that a split with no keys merges with weight 0, not nan.
    _NO_SCORE = tl.constexpr(-1.0e30)

    @triton.jit
    def _store_kv_kernel(
        K, V, KRows, VRows, Slots,
        stride_k, stride_v, row_stride,
        ROW: tl.constexpr, ROW_P: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        slot = tl.load(Slots + t)
        if slot >= 0:
            c = tl.arange(0, ROW_P)
            m = c < ROW
            dst = slot.to(tl.int64) * row_stride + c
            tl.store(KRows + dst, tl.load(K + t * stride_k + c, mask=m), mask=m)
            tl.store(VRows + dst, tl.load(V + t * stride_v + c, mask=m), mask=m)

    # Triton compiles a variant per value class of an integer argument (1, a multiple of 16, other);
    # these change from step to step (contexts grow), and each new variant costs a compile.
    @triton.jit(do_not_specialize=["stride_tab", "blocks_per_split", "num_splits"])
    def _paged_decode_kernel(
        Q, KC, VC, Tables, Lens, Out, MState, LState, Acc,
        scale,
        stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_tab, stride_ot, stride_oh,
        blocks_per_split, num_splits,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
        SPLIT: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(Lens + seq)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        q_ptrs = Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=gmask[:, None], other=0.0)
        m_i = tl.full([GROUP_P], _NO_SCORE, tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
        first = split * blocks_per_split
        last = tl.minimum(first + blocks_per_split, tl.cdiv(length, BLOCK))
        for b in range(first, last):
            block = tl.load(Tables + seq * stride_tab + b).to(tl.int64)
            tok = b * BLOCK + t
            valid = tok < length
            k = tl.load(
                KC + block * stride_kb + t[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            if IEEE:  # noqa: SIM108 - Triton branches on a constexpr here, at compile time
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, _NO_SCORE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                VC + block * stride_vb + t[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            if IEEE:  # noqa: SIM108
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if SPLIT:
            state = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
            tl.store(MState + state, m_i, mask=gmask)
            tl.store(LState + state, l_i, mask=gmask)
            tl.store(Acc + state[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                Out + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(Out.dtype.element_ty),
                mask=gmask[:, None],
            )

    @triton.jit
    def _prefill_keys(
        q, m_i, l_i, acc, start, hi, qpos, KC, VC, table, kvh, scale,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):  # fmt: skip
        """One step of the running softmax over keys [start, start + KEYS) below ``hi``; CAUSAL:
        also hide keys after each row's position (without it every key is seen by every row)."""
        d = tl.arange(0, HEAD_DIM)
        n = start + tl.arange(0, KEYS)
        nmask = n < hi
        block = tl.load(table + n // BLOCK, mask=nmask, other=0).to(tl.int64)
        off = n % BLOCK
        k = tl.load(
            KC + block[:, None] * stride_kb + off[:, None] * stride_kt + kvh * stride_kh + d[None, :],
            mask=nmask[:, None],
            other=0.0,
        )
        if IEEE:  # noqa: SIM108 - Triton branches on a constexpr here, at compile time
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if CAUSAL:
            seen = nmask[None, :] & (n[None, :] <= qpos[:, None])
        else:
            seen = nmask[None, :] & (qpos[:, None] >= 0)
        s = tl.where(seen, s * scale, _NO_SCORE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(seen, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            VC + block[:, None] * stride_vb + off[:, None] * stride_vt + kvh * stride_vh + d[None, :],
            mask=nmask[:, None],
            other=0.0,
        )
        if IEEE:  # noqa: SIM108
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit(do_not_specialize=["stride_tab"])
    def _paged_prefill_kernel(
        Q, KC, VC, Tables, QStarts, QLens, CtxLens, Out,
        scale,
        stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_tab, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
        ROWS: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        chunk = tl.program_id(1)
        kvh = tl.program_id(2)
        qlen = tl.load(QLens + chunk)
        ctx = tl.load(CtxLens + chunk)
        qstart = tl.load(QStarts + chunk)
        r = tile * ROWS + tl.arange(0, ROWS)  # rows: token i = r // GROUP, head kvh * GROUP + r % GROUP
        rmask = r < qlen * GROUP
        i = r // GROUP
        head = kvh * GROUP + r % GROUP
        qpos = ctx - qlen + i  # each query's position in its sequence
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            Q + (qstart + i)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=rmask[:, None],
            other=0.0,
        )
        m_i = tl.full([ROWS], _NO_SCORE, tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        table = Tables + chunk * stride_tab
        live = tile * ROWS < qlen * GROUP
        first = (tile * ROWS) // GROUP  # the tile's first token and last one
        last = tl.minimum(qlen - 1, (tile * ROWS + ROWS - 1) // GROUP)
        hi = tl.where(live, ctx - qlen + last + 1, 0)  # keys the tile's last row sees
        # Keys below the first row's position are seen by every row: whole steps of them go
        # without the causal test, the rest with it.
        lo = tl.where(live, ((ctx - qlen + first + 1) // KEYS) * KEYS, 0)
        for start in range(0, lo, KEYS):
            m_i, l_i, acc = _prefill_keys(
                q, m_i, l_i, acc, start, hi, qpos, KC, VC, table, kvh, scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HEAD_DIM, BLOCK, KEYS, IEEE, False,
            )  # fmt: skip
        for start in range(lo, hi, KEYS):
            m_i, l_i, acc = _prefill_keys(
                q, m_i, l_i, acc, start, hi, qpos, KC, VC, table, kvh, scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HEAD_DIM, BLOCK, KEYS, IEEE, True,
            )  # fmt: skip
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            Out + (qstart + i)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=rmask[:, None],
        )

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_splits_kernel(
        MState, LState, Acc, Out, num_splits, stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, SPLITS_P: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS_P)
        d = tl.arange(0, HEAD_DIM)
        smask = s < num_splits
        state = (seq * tl.num_programs(1) + head) * num_splits + s
        m = tl.load(MState + state, mask=smask, other=_NO_SCORE)
        l = tl.load(LState + state, mask=smask, other=0.0)
        m_all = tl.max(m, 0)
        w = tl.where(l > 0, tl.exp(m - m_all), 0.0)
        total = tl.sum(w * l, 0)
        acc = tl.load(Acc + state[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(Out + seq * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty))


def store_kv(
    k: torch.Tensor,  # [T, kv_heads, head_dim], each token's row contiguous
    v: torch.Tensor,
    k_rows: torch.Tensor,  # [rows, kv_heads * head_dim] (KVCache.layer_rows)
    v_rows: torch.Tensor,
    slots: torch.Tensor,  # [T] int64 row of each token; < 0: write nothing
) -> None:
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    row = k.shape[1] * k.shape[2]
    if k.stride(2) != 1 or k.stride(1) != k.shape[2] or v.stride(2) != 1 or v.stride(1) != v.shape[2]:
        raise ValueError("store_kv needs each token's K and V heads contiguous")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_rows, v_rows, slots,
        k.stride(0), v.stride(0), k_rows.stride(0),
        ROW=row, ROW_P=triton.next_power_of_2(row),
    )  # fmt: skip


def paged_decode(
    q: torch.Tensor,  # [n, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] (strided per-layer view)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [n, max_blocks] int64, padded with any valid id
    lens: torch.Tensor,  # [n] int64 keys each decode attends to (0: output zeros)
    scale: float,
    out: torch.Tensor,  # [n, num_heads, head_dim]
    splits: int = 1,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    if n == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for t in (q, k_cache, v_cache, out):
        if t.stride(-1) != 1:
            raise ValueError("paged_decode needs the head dimension contiguous")
    max_blocks = block_tables.shape[1]
    splits = max(1, min(splits, max_blocks))
    per_split = -(-max_blocks // splits)
    splits = -(-max_blocks // per_split)  # no split left without blocks to look at
    ieee = q.dtype == torch.float32
    common = dict(GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                  BLOCK=block_size, IEEE=ieee)  # fmt: skip
    grid = (n, num_kv_heads, splits)
    args = (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        per_split, splits,
    )  # fmt: skip
    if splits == 1:
        _paged_decode_kernel[grid](
            q, k_cache, v_cache, block_tables, lens, out, out, out, out, scale, *args, SPLIT=False, **common
        )
        return out
    m_state = torch.empty(n * num_heads * splits, dtype=torch.float32, device=q.device)
    l_state = torch.empty_like(m_state)
    acc = torch.empty(n * num_heads * splits * head_dim, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, lens, out, m_state, l_state, acc, scale, *args,
        SPLIT=True, **common,
    )  # fmt: skip
    _merge_splits_kernel[(n, num_heads)](
        m_state, l_state, acc, out, splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_P=max(2, triton.next_power_of_2(splits)),
    )  # fmt: skip
    return out


# Rows (token x query head) and keys a prefill program takes per step of its loop, and its warps
# (benchmarks/prefill_kernel.py compares settings).
_PREFILL_ROWS = 64
_PREFILL_KEYS = 64
_PREFILL_WARPS = 4


def paged_prefill(
    q: torch.Tensor,  # [T, num_heads, head_dim]: the step's tokens, the chunks' rows among them
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], the chunks' K/V written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [n, max_blocks] int64: each chunk's table, padded with any valid id
    query_starts: torch.Tensor,  # [n] int64: the chunk's first row of q and out
    query_lens: torch.Tensor,  # [n] int64: its new tokens (>= 1)
    context_lens: torch.Tensor,  # [n] int64: cached tokens + its new tokens
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]: only the chunks' rows are written
) -> torch.Tensor:
    """Causal attention of every prefill chunk to its cached prefix and itself, in one launch."""
    n = block_tables.shape[0]
    if n == 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for t in (q, k_cache, v_cache, out):
        if t.stride(-1) != 1:
            raise ValueError("paged_prefill needs the head dimension contiguous")
    grid = (triton.cdiv(max_query_len * group, _PREFILL_ROWS), n, num_kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK=block_size,
        ROWS=_PREFILL_ROWS, KEYS=_PREFILL_KEYS, IEEE=q.dtype == torch.float32,
        num_warps=_PREFILL_WARPS,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["fan_in", "stride_x"])
    def _lora_shrink_kernel(
        X, A, Slots, Ranks, U, fan_in, stride_x,
        RANK_P: tl.constexpr, MAX_RANK: tl.constexpr, BLOCK_IN: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        s = tl.load(Slots + t)
        if s >= 0:
            r = tl.load(Ranks + s)
            rows = tl.arange(0, RANK_P)
            rmask = rows < r
            acc = tl.zeros([RANK_P], tl.float32)
            base = A + s.to(tl.int64) * MAX_RANK * fan_in
            for k in range(0, fan_in, BLOCK_IN):
                cols = k + tl.arange(0, BLOCK_IN)
                cmask = cols < fan_in
                x = tl.load(X + t * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
                a = tl.load(base + rows[:, None] * fan_in + cols[None, :],
                            mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
                acc += tl.sum(a * x[None, :], axis=1)
            tl.store(U + t * RANK_P + rows, acc)

    @triton.jit(do_not_specialize=["fan_out", "stride_y"])
    def _lora_expand_kernel(
        U, B, Slots, Ranks, Y, fan_out, stride_y,
        RANK_P: tl.constexpr, MAX_RANK: tl.constexpr, BLOCK_OUT: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        j = tl.program_id(1)
        s = tl.load(Slots + t)
        if s >= 0:
            r = tl.load(Ranks + s)
            rows = tl.arange(0, RANK_P)
            rmask = rows < r
            cols = j * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
            cmask = cols < fan_out
            u = tl.load(U + t * RANK_P + rows, mask=rmask, other=0.0)
            b = tl.load(B + s.to(tl.int64) * MAX_RANK * fan_out + rows[:, None] * fan_out + cols[None, :],
                        mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
            update = tl.sum(u[:, None] * b, axis=0)
            y = tl.load(Y + t * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
            tl.store(Y + t * stride_y + cols, (y + update).to(Y.dtype.element_ty), mask=cmask)


_LORA_BLOCK_IN = 64
_LORA_BLOCK_OUT = 64


def lora_apply(
    x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:  # fmt: skip
    """The CPU kernel's ``lora_apply`` (cpu_kernels.py: the operands' shapes and its contract) on a
    CUDA device. Slots and ranks are not read on the host (no device sync)."""
    from prism_serve.engine.cpu_kernels import lora_operands

    slots, ranks = lora_operands(x, out, a, b, slots, ranks, check_values=False)
    rows, fan_in = x.shape
    max_rank, fan_out = b.shape[1:]
    if rows == 0:
        return
    rank_p = max(16, triton.next_power_of_2(max_rank))
    u = torch.empty(rows, rank_p, dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(rows,)](
        x, a, slots, ranks, u, fan_in, x.stride(0),
        RANK_P=rank_p, MAX_RANK=max_rank, BLOCK_IN=_LORA_BLOCK_IN,
    )  # fmt: skip
    _lora_expand_kernel[(rows, triton.cdiv(fan_out, _LORA_BLOCK_OUT))](
        u, b, slots, ranks, out, fan_out, out.stride(0),
        RANK_P=rank_p, MAX_RANK=max_rank, BLOCK_OUT=_LORA_BLOCK_OUT,
    )  # fmt: skip
