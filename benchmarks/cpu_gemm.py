"""fp32 matmul kernels on this CPU at the shapes of SmolLM2-135M's projections: torch's BLAS path
(``x @ W`` on the engine's transposed [in, out] weight; MKL) against oneDNN's linear on a
transposed view of the same buffer (what the engine runs unless ``PRISM_CPU_GEMM=blas``), and
oneDNN on the usual [out, in] layout and on a prepacked copy (for reference: the engine keeps one
copy of the weights, in the device's pages, so it does not prepack). Rows are tokens in the step.

    python benchmarks/cpu_gemm.py
"""

from __future__ import annotations

import time

import torch

import common

SHAPES = {  # name -> (in, out)
    "qkv": (576, 960),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}


def timed(f, budget_s: float = 0.3) -> float:
    f()
    f()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s or n < 3:
        f()
        n += 1
    return (time.perf_counter() - t0) / n


def main() -> None:
    print(common.machine_info()["line"])
    lp = torch.ops.mkldnn._linear_pointwise
    torch.manual_seed(0)
    print("| shape | rows | BLAS x @ W (engine before) | oneDNN, transposed view (engine) | oneDNN [out, in] "
          "| oneDNN prepacked | engine / before | max abs diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k)
        wt = w.t().contiguous()
        for m in (1, 8, 32, 256):
            x = torch.randn(m, k)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            common.wait_quiet(10, 0.3)
            blas = timed(lambda: x @ wt)  # noqa: B023 - timed now, in this iteration
            view = timed(lambda: lp(x, wt.t(), None, "none", [], ""))  # noqa: B023
            plain = timed(lambda: lp(x, w, None, "none", [], ""))  # noqa: B023
            pre = timed(lambda: lp(x, packed, None, "none", [], ""))  # noqa: B023
            diff = (lp(x, wt.t(), None, "none", [], "") - x @ wt).abs().max().item()
            print(f"| {name} {k}x{n} | {m} | {blas * 1e6:.0f} us | {view * 1e6:.0f} us "
                  f"| {plain * 1e6:.0f} us "
                  f"| {pre * 1e6:.0f} us | {blas / view:.2f}x | {diff:.1e} |")  # fmt: skip
    # what one step's weight pass streams at on a one-core device (fit_cpu_profile.py --mem-bandwidth):
    # one thread, 1-4 rows through a weight far larger than the caches, as a decode step reads its model
    torch.set_num_threads(1)
    k, n = SHAPES["lm_head"]
    wt = torch.randn(8 * n, k).t().contiguous()  # 906 MB
    for m in (1, 4):
        x = torch.randn(m, k)
        common.wait_quiet(10, 0.3)
        t = timed(lambda: lp(x, wt.t(), None, "none", [], ""), 1.0)  # noqa: B023
        print(f"one thread, oneDNN, {m} row(s) x {wt.numel() * 4 / 1e6:.0f} MB of fp32 weights: "
              f"{t * 1e3:.1f} ms, {wt.numel() * 4 / t / 1e9:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
