"""One layer's decode attention: the engine's paged kernel against gathering the blocks for SDPA.

32 decodes (or ``--seqs``) of random contexts 8-600 tokens over SmolLM2-135M's attention shape (9
query heads, 3 KV heads, head_dim 64, blocks of 16) in a cache of 30 layers; each call attends a
different layer, so K and V come from memory, as in a forward pass, not from the caches. Baseline,
in the same run: the blocks gathered with index_select and one padded, masked SDPA call (the engine
groups decodes by context length, which pads less than this one group). Prints the max difference
against per-sequence SDPA in fp32 and the time per call of each, with the ratio.

    python benchmarks/paged_decode.py
    python benchmarks/paged_decode.py --threads 1 --seqs 8
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

import common

LAYERS, BLOCK, KV_HEADS, HEAD_DIM, HEADS = 30, 16, 3, 64, 9


def timed(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def run(dtype: torch.dtype, lens: list[int], calls: int) -> str:
    from prism_serve.engine.cpu_kernels import paged_decode

    n = len(lens)
    max_blocks = -(-max(lens) // BLOCK)
    num_blocks = n * max_blocks
    tables = torch.randperm(num_blocks).view(n, max_blocks)
    lens_t = torch.tensor(lens)
    mask = (torch.arange(max_blocks * BLOCK)[None] < lens_t[:, None])[:, None, None, :]
    scale = HEAD_DIM**-0.5
    cache = torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    gather_k = torch.empty(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    gather_v = torch.empty_like(gather_k)
    layer = [0]

    def caches() -> tuple[torch.Tensor, torch.Tensor]:  # the next layer's K and V
        layer[0] = (layer[0] + 1) % LAYERS
        return cache[:, layer[0], 0], cache[:, layer[0], 1]

    def gathered() -> torch.Tensor:
        k, v = caches()
        flat = tables.flatten()
        kd = torch.index_select(k, 0, flat, out=gather_k).view(n, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
        vd = torch.index_select(v, 0, flat, out=gather_v).view(n, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
        qd = q.view(n, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)

    k0, v0 = cache[:, 0, 0], cache[:, 0, 1]
    got = paged_decode(q, k0, v0, tables, lens_t, scale).float()
    worst = 0.0
    for i, length in enumerate(lens):
        k = k0.index_select(0, tables[i]).flatten(0, 1)[:length].transpose(0, 1).float()
        v = v0.index_select(0, tables[i]).flatten(0, 1)[:length].transpose(0, 1).float()
        qi = q[i].float()[None, :, None]
        ref = F.scaled_dot_product_attention(qi, k[None], v[None], scale=scale, enable_gqa=True)[0, :, 0]
        worst = max(worst, (got[i] - ref).abs().max().item())
    base = timed(gathered, calls)
    kern = timed(lambda: paged_decode(q, *caches(), tables, lens_t, scale, out=out), calls)
    return (
        f"{dtype!s:>15}: {sum(lens)} keys ({num_blocks * BLOCK} padded); gather + SDPA {base * 1e3:.3f} ms, "
        f"kernel {kern * 1e3:.3f} ms per call ({base / kern:.2f}x); max |kernel - fp32 SDPA| {worst:.1e}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--max-context", type=int, default=600)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--calls", type=int, default=60)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(common.machine_info()["line"], f"| {args.threads} threads")
    rng = random.Random(0)
    torch.manual_seed(0)
    lens = [rng.randint(8, args.max_context) for _ in range(args.seqs)]
    for dtype in (torch.float32, torch.bfloat16):
        print(run(dtype, lens, args.calls))


if __name__ == "__main__":
    main()
