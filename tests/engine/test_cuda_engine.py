"""The engine on a CUDA GPU: the Triton kernels against a float64 reference, the CUDA engine against
the CPU engine, and CUDA graphs against eager steps (tests/memory/test_cuda_pools.py: the elastic
pool on a GPU).

SYNTHETIC weights of SmolLM2-135M's shape (``scaled_synthetic``): the real GGUF (98 MB) cannot
travel to the GPU machines this project is lent (64 MiB per call). Without a GPU these tests are
skipped (conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from prism_serve.engine import cuda_kernels
from prism_serve.engine.llm import LLM
from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.weights import load_weights
from tests.engine.test_paged_decode_kernel import context_kv, reference_decode

pytestmark = pytest.mark.gpu

MiB = 2**20
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def f(x):", "Once upon a time", "Hello"]


def scaled_synthetic():
    """SmolLM2-135M-shaped N(0, 0.08) weights: at the preset's 0.02 every logit is about the same
    and greedy decoding repeats one token; four times that gives varied tokens and logprobs that
    a wrong attention or position would change."""
    weights = load_weights("random:smollm2-135m", dtype=torch.float32, seed=3)
    for name, t in weights.tensors.items():
        if not name.endswith("norm.weight"):
            t.mul_(4)
    return weights


@pytest.fixture(scope="module")
def synthetic():
    return scaled_synthetic()


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (16, 16, 64)])
@pytest.mark.parametrize("splits", [1, 5])
def test_paged_decode_matches_float64(dtype, num_heads, num_kv_heads, head_dim, splits):
    gen = torch.Generator().manual_seed(num_heads * 100 + splits)
    block_size, num_blocks, n = 16, 300, 13
    cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).cuda()
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]  # strided per-layer views, as the engine's
    lens = torch.randint(1, 1500, (n,), generator=gen)
    lens[0], lens[1] = 0, 1  # graph padding, and one key
    width = math.ceil(int(lens.max()) / block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(n)])
    qkv = torch.randn(n, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).cuda()
    q = qkv[:, :num_heads]  # strided, as split from the fused projection
    out = torch.full((n, num_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    lens, tables = lens.cuda(), tables.cuda()
    cuda_kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out, splits)
    ref = reference_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert not out.isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert _relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def reference_prefill(q, k_cache, v_cache, tables, starts, qlens, ctxs, scale) -> torch.Tensor:
    """Causal prefill attention in float64, one chunk at a time: query i of a chunk of n new
    tokens sits at position context - n + i and sees keys up to there."""
    num_heads = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for c in range(len(starts)):
        start, n, ctx = int(starts[c]), int(qlens[c]), int(ctxs[c])
        k, v = context_kv(k_cache, v_cache, tables[c], ctx, num_heads)
        scores = torch.einsum("qhd,thd->hqt", q[start : start + n].double(), k) * scale
        keys, queries = torch.arange(ctx, device=q.device), torch.arange(ctx - n, ctx, device=q.device)
        visible = keys[None, :] <= queries[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + n] = torch.einsum("hqt,thd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (16, 16, 64)])
def test_paged_prefill_matches_float64(dtype, num_heads, num_kv_heads, head_dim):
    """Chunks of a whole prompt, chunks after a cached prefix (chunked prefill, a prefix-cache
    hit), one of two tokens and one longer than a program's tile, all in one launch; rows of the
    batch that are not a chunk's (decodes) are left as they were."""
    gen = torch.Generator().manual_seed(num_heads)
    block_size, num_blocks = 16, 400
    cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).cuda()
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    qlens = [37, 2, 300, 64, 5]
    ctxs = [37, 130, 300, 1000, 21]
    starts, row = [], 3  # three decode rows first
    for n in qlens:
        starts.append(row)
        row += n
    width = -(-max(ctxs) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in qlens]).cuda()
    qkv = torch.randn(row, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).cuda()
    q = qkv[:, :num_heads]
    out = torch.full((row, num_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    as_tensor = lambda xs: torch.tensor(xs, device="cuda")  # noqa: E731
    cuda_kernels.paged_prefill(q, k_cache, v_cache, tables, as_tensor(starts), as_tensor(qlens),
                               as_tensor(ctxs), max(qlens), head_dim**-0.5, out)  # fmt: skip
    ref = reference_prefill(q, k_cache, v_cache, tables, starts, qlens, ctxs, head_dim**-0.5)
    assert out[:3].isnan().all()  # not a chunk's rows: untouched
    assert not out[3:].isnan().any()
    assert _relative_error(out[3:], ref[3:]) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_store_kv_writes_each_row_and_skips_negative_slots():
    rows = torch.zeros(64, 3 * 64, device="cuda")
    v_rows = torch.zeros_like(rows)
    qkv = torch.randn(6, 9 + 6, 64, device="cuda")
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([5, -1, 17, 0, -1, 63], device="cuda")
    cuda_kernels.store_kv(k, v, rows, v_rows, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(rows[slot], k[i].reshape(-1)) and torch.equal(v_rows[slot], v[i].reshape(-1))
    assert int((rows.abs().sum(1) > 0).sum()) == 4  # the two padding rows wrote nothing


def greedy(engine: LLMEngine, n: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in LLM(engine=engine).generate(PROMPTS, params)]


def test_cuda_engine_in_float32_gives_the_cpu_engines_tokens_and_logprobs(synthetic):
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=24, ignore_eos=True, logprobs=0)
              for i in range(len(PROMPTS))]  # fmt: skip
    cpu = LLM(engine=LLMEngine(EngineConfig(dtype="float32"), weights=synthetic)).generate(PROMPTS, params)
    with LLMEngine(EngineConfig(dtype="float32", device="cuda:0"), weights=synthetic) as engine:
        assert engine.runner.cuda and engine.runner.graphs is not None
        gpu = LLM(engine=engine).generate(PROMPTS, params)
        assert engine.runner.graphs.graphs  # the decode steps replayed a graph
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    a = torch.tensor([e.logprob for o in cpu for e in o.logprobs])
    b = torch.tensor([e.logprob for o in gpu for e in o.logprobs])
    assert (a - b).abs().max() < 1e-3


def _prompt_logprobs(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    entries = LLM(engine=engine).generate([tokens], params)[0].prompt_logprobs
    return torch.tensor([e.logprob for e in entries[1:]])


def test_bf16_logprobs_stay_as_close_to_float32_as_the_cpu_engines_bf16(synthetic):
    """Teacher-forced (both score the same tokens, position by position): the GPU's bf16 engine is
    as far from the float32 reference as the CPU engine in bf16 is, which is what bf16 rounding
    costs on these weights (their logits are large: the weights are scaled up)."""
    reference = LLMEngine(EngineConfig(dtype="float32"), weights=synthetic)
    tokens = reference.tokenizer.encode(" ".join(PROMPTS))
    fp32 = _prompt_logprobs(reference, tokens)
    cpu_bf16 = _prompt_logprobs(LLMEngine(EngineConfig(dtype="bfloat16"), weights=synthetic), tokens)
    gpu = LLMEngine(EngineConfig(dtype="bfloat16", device="cuda:0"), weights=synthetic)
    gpu_bf16 = _prompt_logprobs(gpu, tokens)
    cpu_err, gpu_err = (cpu_bf16 - fp32).abs(), (gpu_bf16 - fp32).abs()
    assert gpu_err.mean() < 2 * cpu_err.mean() and gpu_err.max() < 2 * cpu_err.max()


def test_chunked_prefill_on_cuda_gives_the_cpu_engines_tokens(synthetic):
    """Prompts of 40-90 tokens prefilled 16 tokens a step beside running decodes: every step
    mixes decodes with prefill chunks that attend to a cached prefix (the prefill kernel)."""
    config = dict(dtype="float32", max_num_batched_tokens=16)
    prompts = [list(range(3 + i, 3 + i + 40 + 10 * i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    cpu = LLM(engine=LLMEngine(EngineConfig(**config), weights=synthetic)).generate(prompts, params)
    with LLMEngine(EngineConfig(**config, device="cuda:0"), weights=synthetic) as engine:
        gpu = LLM(engine=engine).generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    a = torch.tensor([e.logprob for o in cpu for e in o.logprobs])
    b = torch.tensor([e.logprob for o in gpu for e in o.logprobs])
    assert (a - b).abs().max() < 1e-3


def test_cuda_graphs_give_the_eager_steps_tokens(synthetic, monkeypatch):
    """float32, where the two differ only in how decode attention splits a context (bf16 rounds
    the difference into a different token now and then on these weights)."""
    config = EngineConfig(dtype="float32", device="cuda:0")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    with LLMEngine(config, weights=synthetic) as engine:
        graphed = LLM(engine=engine).generate(PROMPTS, params)
        assert set(engine.runner.graphs.graphs) == {8}  # five decodes padded to the bucket of 8
    monkeypatch.setenv("PRISM_CUDA_GRAPHS", "0")
    with LLMEngine(config, weights=synthetic) as engine:
        assert engine.runner.graphs is None
        eager = LLM(engine=engine).generate(PROMPTS, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    a = torch.tensor([e.logprob for o in graphed for e in o.logprobs])
    b = torch.tensor([e.logprob for o in eager for e in o.logprobs])
    assert (a - b).abs().max() < 1e-3
