"""The CPU kernels' library (engine/cpu_kernels.py): the PRISM_CPU_KERNELS switch, the fallback to
torch ops where no compiler exists, the build cache; and the layer ops (csrc/layer_ops.cpp) against
the torch ops they replace: bit for bit in fp32 and in bf16 for RoPE and the residual add, within a
rounding for RMSNorm (its sum of squares is summed in another order)."""

from __future__ import annotations

import pytest
import torch

from prism_serve.engine import cpu_kernels
from prism_serve.engine.cpu_kernels import KernelBuildError, add_rms_norm, kernels_enabled, rope
from prism_serve.engine.models.llama import apply_rope, rms_norm
from prism_serve.engine.sampling_params import SamplingParams
from tests.conftest import run_to_completion


def _forget_library() -> None:
    cpu_kernels._library.cache_clear()
    cpu_kernels._build_error.cache_clear()


def test_mode_from_environment(monkeypatch):
    monkeypatch.setenv("PRISM_CPU_KERNELS", "off")
    assert kernels_enabled() is False
    monkeypatch.setenv("PRISM_CPU_KERNELS", "on")
    assert kernels_enabled() is True  # builds here: the project's machines have a compiler
    monkeypatch.delenv("PRISM_CPU_KERNELS")
    assert kernels_enabled() is True
    monkeypatch.setenv("PRISM_CPU_KERNELS", "fastest")
    with pytest.raises(ValueError, match="PRISM_CPU_KERNELS"):
        kernels_enabled()


def test_no_compiler_falls_back_to_torch_ops_or_fails_when_asked(monkeypatch, tmp_path, caplog, make_engine):
    monkeypatch.setenv("PRISM_KERNEL_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    _forget_library()
    try:
        monkeypatch.setenv("PRISM_CPU_KERNELS", "auto")
        with caplog.at_level("WARNING", logger="prism_serve.engine.cpu_kernels"):
            assert kernels_enabled() is False
            assert kernels_enabled() is False
        assert caplog.text.count("engine uses torch ops") == 1  # tried and told once per process
        engine = make_engine(num_kv_blocks=32)  # and the engine still serves, on torch ops
        assert engine.runner.kernels is False
        req = engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=3))
        assert len(run_to_completion(engine)[req].token_ids) == 3
        monkeypatch.setenv("PRISM_CPU_KERNELS", "on")
        with pytest.raises(KernelBuildError, match="no-such-compiler"):
            kernels_enabled()
    finally:
        _forget_library()
    assert list(tmp_path.iterdir()) == []  # no half-built library left behind


def test_unwritable_cache_falls_back_to_torch_ops(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PRISM_KERNEL_CACHE", str(blocker / "kernels"))  # cannot be made
    monkeypatch.setenv("PRISM_CPU_KERNELS", "auto")
    _forget_library()
    try:
        assert kernels_enabled() is False
        monkeypatch.setenv("PRISM_CPU_KERNELS", "on")
        with pytest.raises(KernelBuildError, match="cannot build into"):
            kernels_enabled()
    finally:
        _forget_library()


def test_build_lands_in_the_cache_and_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("PRISM_KERNEL_CACHE", str(tmp_path))
    _forget_library()
    try:
        first = cpu_kernels._library()
        built = sorted(p.name for p in tmp_path.iterdir())
        assert len(built) == 1 and built[0].startswith("prism_cpu-") and built[0].endswith(".so")
        stamp = (tmp_path / built[0]).stat().st_mtime_ns
        cpu_kernels._library.cache_clear()
        second = cpu_kernels._library()
        assert (tmp_path / built[0]).stat().st_mtime_ns == stamp  # loaded, not rebuilt
        assert first._name == second._name
    finally:
        _forget_library()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576: split over threads
def test_add_rms_norm_matches_torch(dtype, rows):
    torch.manual_seed(rows)
    hidden = 576
    x = torch.randn(rows, hidden).to(dtype) * 3
    y = torch.randn(rows, hidden).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    want_x = x + y
    want = rms_norm(want_x, w, 1e-5)

    got_x = x.clone()
    got = add_rms_norm(got_x, y, w, 1e-5)

    assert torch.equal(got_x, want_x)  # the residual add is rounded exactly as torch's
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # one rounding of the norm's scale
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # y None: the norm alone, x untouched
    before = x.clone()
    torch.testing.assert_close(add_rms_norm(x, None, w, 1e-5), rms_norm(before, w, 1e-5), atol=tol, rtol=tol)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_equals_torch_bit_for_bit(dtype):
    torch.manual_seed(0)
    tokens, q_heads, kv_heads, head_dim = 37, 9, 3, 64
    fused = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim).to(dtype)  # [Q | K | V] rows
    qk = fused[:, : (q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), torch.rand(head_dim // 2))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    positions = torch.randint(0, 4096, (tokens,))
    want = apply_rope(qk.clone(), cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    v_before = fused[:, (q_heads + kv_heads) * head_dim :].clone()

    out = rope(qk, cos, sin, positions)

    assert out.data_ptr() == qk.data_ptr()
    assert torch.equal(qk, want)
    assert torch.equal(fused[:, (q_heads + kv_heads) * head_dim :], v_before)  # V untouched


def test_layer_ops_reject_bad_arguments():
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(TypeError, match="one dtype"):
        add_rms_norm(x, None, w.to(torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(x.t().contiguous().t(), None, w, 1e-5)
    with pytest.raises(ValueError, match="shaped like x"):
        add_rms_norm(x, torch.randn(4, 7), w, 1e-5)
    qk, cos = torch.randn(3, 2, 8), torch.randn(16, 4)
    with pytest.raises(ValueError, match="outside"):
        rope(qk, cos, cos.clone(), torch.tensor([0, 1, 16]))
    with pytest.raises(ValueError, match="one position per token"):
        rope(qk, cos, cos.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="cos and sin"):
        rope(qk, torch.randn(16, 3), torch.randn(16, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="contiguous heads"):
        rope(torch.randn(3, 8, 2).transpose(1, 2), cos, cos.clone(), torch.tensor([0, 1, 2]))
