"""The elastic KV pool on a CUDA GPU under the real engine (SYNTHETIC SmolLM2-135M-shaped weights):
the same tokens as a fixed pool, every page back on close, and two engines sharing one ledger.
Skipped without a GPU (conftest.py)."""

from __future__ import annotations

import pytest

from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.memory.kv_pool import PoolConfig
from prism_serve.memory.ledger import DeviceLedger
from tests.engine.test_cuda_engine import greedy, scaled_synthetic

pytestmark = pytest.mark.gpu

MiB = 2**20


@pytest.fixture(scope="module")
def synthetic():
    return scaled_synthetic()


def test_elastic_pool_on_the_gpu_gives_the_fixed_pools_tokens_and_returns_every_page(synthetic, namespace):
    fixed = greedy(LLMEngine(EngineConfig(dtype="bfloat16", device="cuda:0"), weights=synthetic))
    pool = PoolConfig(device="cuda:0", device_budget_bytes=256 * MiB)
    engine = LLMEngine(EngineConfig(dtype="bfloat16", device="cuda:0", elastic_kv=pool), weights=synthetic)
    assert engine.kv_cache.tensor.device.type == "cuda"
    assert greedy(engine) == fixed
    ledger = DeviceLedger("cuda:0")
    assert ledger.snapshot().used_bytes > 0
    engine.close()
    assert ledger.snapshot().entries == ()
    ledger.close()


def test_two_engines_on_one_gpu_share_the_ledger_and_never_exceed_it(synthetic, namespace):
    """A's KV grows, A finishes and gives its pages back, B grows into them; at no sample does the
    ledger grant more than the budget, and the pages the driver holds are the ledger's grants."""
    budget = 48 * MiB
    ledger = DeviceLedger("cuda:0", budget_bytes=budget)
    pool = PoolConfig(device="cuda:0", buffer_min_pages=0, buffer_max_pages=1)
    config = EngineConfig(dtype="bfloat16", device="cuda:0", elastic_kv=pool, kv_cache_bytes=budget)
    a, b = LLMEngine(config, weights=synthetic), LLMEngine(config, weights=synthetic)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    peaks = []

    def run(engine: LLMEngine, n: int) -> None:
        for i in range(n):
            engine.add_request([1 + i] * 64, long)
        while engine.has_unfinished_requests():
            engine.step()
            snap = ledger.snapshot()
            mapped = a.allocator.vrange.physical_bytes() + b.allocator.vrange.physical_bytes()
            assert snap.used_bytes <= budget and mapped <= snap.used_bytes
            peaks.append(snap.used_bytes)

    run(a, 12)
    a_slot = a.allocator.account.slot
    peak = {e.slot: e.peak_bytes for e in ledger.snapshot().entries}
    assert peak[a_slot] > budget // 2  # A really held most of the device
    run(b, 12)  # B needs the memory A gave back
    peak = {e.slot: e.peak_bytes for e in ledger.snapshot().entries}
    assert peak[b.allocator.account.slot] > budget // 2
    assert peak[a_slot] + peak[b.allocator.account.slot] > budget  # B grew into what A released
    a.close()
    b.close()
    assert ledger.snapshot().used_bytes == 0
    ledger.close()
