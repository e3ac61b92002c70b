"""Two models sharing one CPU device's budget (synthetic SmolLM2-135M-shaped weights, labelled as
such): one model's KV grows into memory the other freed, first its KV, then its weights by eviction;
a model's prefix cache gives way to another model's weights; and a model larger than every device
is refused when the runtime loads it."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from prism_serve.config import PolicyConfig
from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec, ModelTooLargeError
from prism_serve.runtime.weight_cache import HostWeightCache

from .conftest import collect, start_runtime, stop_runtime, wait_until

MiB = 2**20
SLACK = 40 * MiB  # memory beyond both models' weights
SOURCE = "random:smollm2-135m"  # SYNTHETIC weights: realistic sizes, meaningless text
FP32 = "float32"  # the sizes below are fp32's (dtype auto is bf16 on a CPU with native bf16)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


async def _run_all(c, model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    async def one(p):
        return [t for d in [d async for d in c.generate(model, p, params)] for t in d.token_ids]

    return await asyncio.gather(*(one(p) for p in prompts))


def _kv_peak(ledger, model: str) -> int:
    return max(e.peak_bytes for e in ledger.snapshot().entries if e.name == f"{model} kv")


@pytest.fixture(scope="module")
def weight_bytes(tmp_path_factory: pytest.TempPathFactory) -> int:
    """One model's weight bytes in the host cache (a and b have the same shape), measured once for
    the module's tests: making the synthetic weights takes seconds."""
    with HostWeightCache(namespace="colo", directory=tmp_path_factory.mktemp("probe")) as probe:
        return probe.load(ModelSpec("x", source=SOURCE, engine=EngineConfig(seed=1, dtype=FP32))).weight_bytes


def _two_models_one_device(weight_bytes: int):
    """Models a and b (synthetic weights, seeds 1 and 2) on one device whose budget holds both
    models' weights and SLACK more; the runtime, one model's weight bytes and the budget."""
    budget = 2 * weight_bytes + SLACK
    models = [
        ModelSpec(n, source=SOURCE, engine=EngineConfig(seed=s, max_model_len=1024, dtype=FP32))
        for n, s in (("a", 1), ("b", 2))
    ]
    rt = start_runtime(
        [DeviceSpec("cpu:0", budget, (0,), 1)], models, policy=PolicyConfig(tick_interval_s=0.2)
    )
    return rt, weight_bytes, budget


def test_kv_grows_into_memory_the_other_model_freed(weight_bytes: int) -> None:
    rt, _, budget = _two_models_one_device(weight_bytes)
    try:
        c = rt.c
        ledger = c.nodes.ledger("cpu:0")
        rt.run(c.load("a", "cpu:0"))
        rt.run(c.load("b", "cpu:0"))  # both resident: SLACK is all that is left for KV
        rt.run(_run_all(c, "a", _prompts(3, 250, 0), 8))
        a_peak = _kv_peak(ledger, "a")
        rt.run(_run_all(c, "b", _prompts(3, 250, 1), 8))
        b_peak = _kv_peak(ledger, "b")
        # Together they mapped more KV than was ever free at once: b used pages a had released.
        assert a_peak > 16 * MiB and b_peak > SLACK - a_peak
        assert ledger.snapshot().used_bytes <= budget

        # Evicting a frees its weights and KV; b's KV then grows far beyond SLACK.
        rt.run(c.unload("a", force=False))  # (the policy may already have evicted idle a itself)
        assert next(m for m in c.status() if m.model == "a").state == "evicted"
        assert all(not e.name.startswith("a ") for e in ledger.snapshot().entries)
        prompts = _prompts(4, 500, 2)
        got = rt.run(_run_all(c, "b", prompts, 4))
        assert _kv_peak(ledger, "b") > SLACK  # only possible in memory a's weights had
    finally:
        stop_runtime(rt)
    # Under that pressure b's outputs are exactly what one engine with ample memory produces.
    with LLMEngine(EngineConfig(model=SOURCE, seed=2, max_model_len=1024, dtype=FP32)) as ref:
        ids = [ref.add_request(p, SamplingParams(temperature=0.0, max_tokens=4)) for p in prompts]
        final = {}
        while ref.has_unfinished_requests():
            for out in ref.step():
                if out.finished:
                    final[out.req_id] = out.token_ids
    assert got == [final[i] for i in ids]


def test_a_model_larger_than_every_device_is_refused_at_load_time() -> None:
    models = [
        ModelSpec("fits", source=SOURCE, engine=EngineConfig(dtype=FP32)),
        ModelSpec("huge", source="random:smollm2-360m", engine=EngineConfig(dtype=FP32)),
    ]
    with pytest.raises(ModelTooLargeError, match=r"model huge: its weights take .* more than any device"):
        start_runtime([DeviceSpec("cpu:0", 1024 * MiB, (), 1), DeviceSpec("cpu:1", 768 * MiB, (), 1)], models)


def test_a_models_cached_prefixes_give_way_to_another_models_weights(weight_bytes: int) -> None:
    """A device that fits model b only once a's prefix cache is dropped: a's cached KV (no request
    holds it) counts as reclaimable, b's weights are granted after a's worker gives that memory
    back, and a stays resident and serving. A cache never makes a device refuse what it would
    have taken without one."""
    rt, weight_bytes, budget = _two_models_one_device(weight_bytes)
    try:
        c = rt.c
        ledger = c.nodes.ledger("cpu:0")
        rt.run(c.load("a", "cpu:0"))
        c.pin("a")  # the policy may not evict it to make room: only its cache can give way
        prompts = _prompts(3, 450, 3)  # distinct: nothing shared, all of it cached once done
        first = rt.run(_run_all(c, "a", prompts, 4))

        def a_kv():
            return next(e for e in ledger.snapshot().entries if e.name == "a kv")

        wait_until(lambda: a_kv().reclaimable_bytes > SLACK, 10.0)  # the idle worker reports it
        held = a_kv()
        # a's KV alone leaves less than b's weights free: only its cache makes the difference
        assert held.reclaimable_bytes > SLACK
        assert budget - ledger.snapshot().used_bytes < weight_bytes
        assert ledger.snapshot().engine_bytes <= budget - weight_bytes  # placement sees room
        rt.run(c.load("b", "cpu:0"))
        status = {s.model: s for s in c.status()}
        assert status["a"].state == "active" and status["b"].state == "active"
        snap = ledger.snapshot()
        assert snap.used_bytes <= budget
        assert a_kv().mapped_bytes < held.mapped_bytes  # a gave cached pages back
        # a still serves, with the same greedy tokens, whatever is left of its cache
        assert rt.run(_run_all(c, "a", prompts[:1], 4)) == first[:1]
    finally:
        stop_runtime(rt)


def test_an_evicted_models_cached_prefixes_come_back_with_it(tmp_path: Path) -> None:
    """Evicting a model keeps its hottest cached prefixes in host memory; its next activation
    restores them before it serves, so a request sharing the earlier prompt's prefix is a hit at
    once, with the greedy tokens of the same request computed in full (a budget of 0 keeps none)."""
    model = ModelSpec("a", source=SOURCE, engine=EngineConfig(seed=1, max_model_len=1024, dtype=FP32))
    rt = start_runtime(
        [DeviceSpec("cpu:0", 1024 * MiB, (0,), 1)], [model], policy=PolicyConfig(tick_interval_s=0.2)
    )
    try:
        c = rt.c
        shared = _prompts(1, 400, 5)[0]
        first, second = [*shared, 7, 8, 9], [*shared, 10, 11]

        def generate(prompt: list[int]) -> tuple[list[int], int]:
            deltas = rt.run(collect(c, "a", prompt, SamplingParams(temperature=0.0, max_tokens=4)))[1]
            return [t for d in deltas for t in d.token_ids], max(d.num_cached_tokens for d in deltas)

        generate(first)
        assert rt.run(c.unload("a", force=False))
        kept = c.cache.kept_prefixes("a")
        assert kept is not None and Path(kept).stat().st_size == c.cache.kept_bytes > 0
        tokens, cached = generate(second)
        phases = {s.model: s for s in c.status()}["a"].last_activation
        assert phases.restored_blocks > 0 and phases.restore_s > 0
        assert cached == len(shared) // 16 * 16  # every full block of the shared prefix, at once
        assert c.cache.kept_prefixes("a") is None and not Path(kept).exists()  # restored: freed

        c.cache.kept_prefix_bytes = 0  # keep nothing: the same request is computed in full
        assert rt.run(c.unload("a", force=False))
        assert c.cache.kept_prefixes("a") is None
        assert generate(second) == (tokens, 0)
    finally:
        stop_runtime(rt)
