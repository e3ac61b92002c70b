"""The fp32 linear's kernel choice (engine/models/llama.py): oneDNN on the transposed weight view
by default, BLAS with PRISM_CPU_GEMM=blas, and both give the same product."""

from __future__ import annotations

import pytest
import torch

from prism_serve.engine.models import llama
from prism_serve.engine.models.llama import Linear


def test_default_is_onednn_where_torch_has_it(monkeypatch):
    monkeypatch.delenv("PRISM_CPU_GEMM", raising=False)
    op = llama._onednn_linear()
    if torch.backends.mkldnn.is_available():
        assert op is torch.ops.mkldnn._linear_pointwise
    else:
        assert op is None


def test_blas_choice_and_bad_value(monkeypatch):
    monkeypatch.setenv("PRISM_CPU_GEMM", "blas")
    assert llama._onednn_linear() is None
    monkeypatch.setenv("PRISM_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="PRISM_CPU_GEMM"):
        llama._onednn_linear()


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_and_blas_agree(monkeypatch, rows, bias):
    torch.manual_seed(rows)
    w = torch.randn(96, 40)
    b = torch.randn(96) if bias else None
    lin = Linear(w, b, torch.float32)
    assert lin.transposed and lin.weight.shape == (40, 96)
    x = torch.randn(rows, 40)
    expected = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float()
    monkeypatch.setattr(llama, "_ONEDNN_LINEAR", None)
    blas = lin(x)
    monkeypatch.setattr(llama, "_ONEDNN_LINEAR", llama._onednn_linear())
    fast = lin(x)
    assert fast.shape == blas.shape == (rows, 96)
    torch.testing.assert_close(blas, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)
