"""The CUDA paged prefill kernel alone (engine/cuda_kernels.py) against torch's SDPA, on one
layer's attention, for tile settings of the kernel. Needs a CUDA GPU.

Workloads (bf16): 4 prompts of 1,024 tokens attended whole (SDPA: one causal call per prompt over
its own K/V, the flash path), and 2 chunks of 1,024 tokens after a cached prefix of 3,072 (SDPA:
the prefix's blocks gathered, then a masked call). Times are CUDA-event medians of 20 runs.

    python benchmarks/prefill_kernel.py                      # SmolLM2-135M and Llama-3.1-8B head shapes
"""

from __future__ import annotations

import itertools
import statistics

import torch
import torch.nn.functional as F

from prism_serve.engine import cuda_kernels as ck

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128)}
BLOCK = 16


def timed(fn, runs: int = 20) -> float:
    fn()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def workload(heads: int, kv_heads: int, dim: int, qlen: int, ctx: int, n: int):
    blocks = n * (-(-ctx // BLOCK)) + 8
    k_cache = torch.randn(blocks, BLOCK, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device="cuda")[: n * (-(-ctx // BLOCK))].view(n, -1)
    q = torch.randn(n * qlen, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    starts = torch.arange(n, device="cuda") * qlen
    qlens = torch.full((n,), qlen, device="cuda")
    ctxs = torch.full((n,), ctx, device="cuda")

    def kernel() -> None:
        ck.paged_prefill(q, k_cache, v_cache, tables, starts, qlens, ctxs, qlen, dim**-0.5, out)

    def sdpa() -> None:
        for i in range(n):
            qi = q[i * qlen : (i + 1) * qlen].transpose(0, 1)[None]
            kv = [c.index_select(0, tables[i]).view(-1, kv_heads, dim)[:ctx].transpose(0, 1)[None]
                  for c in (k_cache, v_cache)]  # fmt: skip
            mask = None
            if ctx != qlen:
                pos = torch.arange(ctx - qlen, ctx, device="cuda")[:, None]
                mask = torch.arange(ctx, device="cuda")[None, :] <= pos
            F.scaled_dot_product_attention(qi, kv[0], kv[1], attn_mask=mask, is_causal=mask is None,
                                           scale=dim**-0.5, enable_gqa=True)  # fmt: skip

    return kernel, sdpa


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, (heads, kv_heads, dim) in SHAPES.items():
        cases = (("4 x 1024 whole", 1024, 1024, 4), ("2 x 1024 after 3072", 1024, 4096, 2))
        for label, qlen, ctx, n in cases:
            kernel, sdpa = workload(heads, kv_heads, dim, qlen, ctx, n)
            base = timed(sdpa)
            print(f"{name} {label}: SDPA {base:.0f} us")
            for rows, keys, warps in itertools.product((64, 128), (32, 64), (4, 8)):
                ck._PREFILL_ROWS, ck._PREFILL_KEYS, ck._PREFILL_WARPS = rows, keys, warps
                try:
                    t = timed(kernel)
                except Exception as e:  # a setting this GPU cannot run (shared memory)
                    print(f"  rows {rows:3d} keys {keys:3d} warps {warps}: {type(e).__name__}")
                    continue
                setting = f"rows {rows:3d} keys {keys:3d} warps {warps}"
                print(f"  {setting}: {t:7.0f} us, SDPA / kernel {base / t:.2f}x")


if __name__ == "__main__":
    main()
