"""The LoRA kernels the engine runs on a CUDA device (engine/cuda_kernels.py ``lora_apply``), run in
Triton's CPU interpreter (``TRITON_INTERPRET=1``, in a subprocess: Triton reads it at import)
against the grouped torch ops (engine/lora.py ``_apply_grouped``): rows of several slots with
different ranks, rows without an adapter, a slot of rank 0, and input and output rows taken from
wider tensors (a fused linear's column range), in fp32 and fp16."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import torch
from prism_serve.engine import cuda_kernels
from prism_serve.engine.lora import _apply_grouped
assert cuda_kernels.triton is not None
g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
    slots_n, max_rank, fan_in, fan_out, rows = 4, 16, 72, 100, 9
    a = torch.randn(slots_n, max_rank, fan_in, generator=g).to(dtype)
    b = torch.randn(slots_n, max_rank, fan_out, generator=g).to(dtype)
    ranks = torch.tensor([16, 5, 0, 12])
    slots = torch.tensor([0, -1, 1, 3, 2, 0, 3, -1, 1])
    x_wide = torch.randn(rows, fan_in + 8, generator=g).to(dtype)
    x = x_wide[:, 3 : 3 + fan_in]  # rows further apart than their width
    y_wide = torch.randn(rows, fan_out + 30, generator=g).to(dtype)
    want = y_wide.clone()
    _apply_grouped(x, want.narrow(1, 20, fan_out), a, b, slots, ranks)
    got = y_wide.clone()
    cuda_kernels.lora_apply(x, got.narrow(1, 20, fan_out), a, b, slots, ranks)
    outside = [slice(0, 20), slice(20 + fan_out, None)]  # the rest of the fused output: untouched
    assert all(torch.equal(got[:, c], y_wide[:, c]) for c in outside)
    assert torch.equal(got[1], y_wide[1]) and torch.equal(got[4], y_wide[4])  # no adapter; rank 0
    scale = want.float().abs().max()
    err = (got.float() - want.float()).abs().max() / scale
    assert err < tol, (dtype, float(err))
    assert not torch.equal(got, y_wide)
print("ok")
"""


def test_the_triton_lora_kernels_equal_the_grouped_torch_ops_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
