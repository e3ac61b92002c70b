"""The real engine on the elastic pool: same tokens as on the fixed pool, memory back on close."""

from __future__ import annotations

import pytest

from prism_serve.engine.llm import LLM
from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.errors import InvalidRequestError
from prism_serve.memory.kv_pool import ElasticKVPool, PoolConfig
from prism_serve.memory.ledger import DeviceLedger

MiB = 2**20
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "1, 2, 3, 4, 5,",
    "Explain what a GPU is in one sentence.",
    "def fibonacci(n):",
    "Name three colors:",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def fixed_outputs(smollm):
    engine = LLMEngine(EngineConfig(dtype="float32"), weights=smollm)
    return [o.token_ids for o in LLM(engine=engine).generate(PROMPTS, GREEDY)]


def test_greedy_outputs_match_the_fixed_pool(smollm, fixed_outputs, namespace):
    config = EngineConfig(dtype="float32", elastic_kv=PoolConfig(device_budget_bytes=2**30))
    engine = LLMEngine(config, weights=smollm)
    assert isinstance(engine.allocator, ElasticKVPool)
    outs = LLM(engine=engine).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == fixed_outputs
    assert engine.num_cached_blocks > 0  # the prompts' blocks stay cached, reclaimable
    engine.drop_cached()
    st = engine.allocator.stats()
    assert st.blocks_allocated > 0 and st.used_blocks == 0
    ledger = DeviceLedger("cpu:0")
    [entry] = ledger.snapshot().entries
    assert entry.name == "smollm2-135m-instruct" and entry.peak_bytes > 0
    engine.close()
    assert ledger.snapshot().entries == ()  # every page unmapped, the entry gone
    ledger.close()


def test_a_tight_device_budget_preempts_but_changes_no_token(smollm, fixed_outputs, namespace):
    ledger = DeviceLedger("cpu:0", budget_bytes=16 * MiB)  # ~22 blocks of 737 KB for six sequences
    squatter = ledger.account("another-model")
    assert squatter.try_reserve(6 * MiB)  # another model holds part of the device
    config = EngineConfig(dtype="float32", elastic_kv=PoolConfig(buffer_min_pages=1, buffer_max_pages=1))
    with LLMEngine(config, weights=smollm) as engine:
        outs = LLM(engine=engine).generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == fixed_outputs
        assert sum(o.metrics.num_preemptions for o in outs) > 0  # the budget really bit
        assert ledger.snapshot().used_bytes <= 16 * MiB
        peak = next(e for e in ledger.snapshot().entries if e.name != "another-model").peak_bytes
        assert peak <= 10 * MiB  # never more than what the other model left
    squatter.close()
    assert ledger.snapshot().used_bytes == 0
    ledger.close()


def test_an_outside_pool_with_the_wrong_block_size_is_refused(smollm, namespace):
    pool = ElasticKVPool.create(
        1000, 64 * MiB, "wrong", PoolConfig(device_budget_bytes=MiB * 64, prefetch=False)
    )
    try:
        with pytest.raises(InvalidRequestError, match="KV pool blocks are 1000 bytes"):
            LLMEngine(EngineConfig(dtype="float32"), weights=smollm, allocator=pool)
    finally:
        pool.close()
