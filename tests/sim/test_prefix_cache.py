"""The simulated prefix cache: LRU order, exact leading runs, the capacity rule (free cached blocks
live in memory no engine has mapped and never hold up a grant), shared blocks, and the hit rates a
simulation reports against an unbounded cache on the Mooncake trace."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.engine.kv_cache import KVGroups
from prism_serve.engine.models.config import PRESETS
from prism_serve.sim import (
    HARDWARE,
    ModelSLO,
    RooflineCostModel,
    ServedModel,
    SimConfig,
    model_shape,
    simulate,
)
from prism_serve.sim.engine import SimEngine, SimRequest
from prism_serve.sim.memory import SimDevice
from prism_serve.sim.models import ModelShape
from prism_serve.sim.prefix_cache import PrefixCache
from prism_serve.workload import Workload, WorkloadSpec, build_workload
from prism_serve.workload.prefix import block_keys, infinite_cache_hits

from .helpers import served

BS = 16  # engine block size; llama-3.2-1b: a 16-token block is 512 KiB, four to a 2 MiB page


# -- the cache on its own -------------------------------------------------------------------------


def test_free_blocks_are_evicted_least_recently_freed_first_and_a_prefix_tail_first():
    c = PrefixCache()
    for k in (1, 2, 3):
        assert c.register(k)
    assert c.release([1, 2, 3]) == 3
    assert c.free_keys() == [3, 2, 1]  # the tail goes first, the shared head last
    c.acquire([1])  # reused: no longer free
    c.register(4)
    c.release([1, 4])
    assert c.free_keys() == [3, 2, 4, 1]
    c.evict(2)
    assert c.free_keys() == [4, 1] and c.num_evicted == 2
    assert c.match([1], 5) == (1, 1) and c.match([3], 5) == (0, 0)


def test_a_hit_is_the_exact_leading_run_of_keys():
    c = PrefixCache()
    for k in (10, 11, 13):
        c.register(k)
    c.release([13])
    assert c.match([10, 11, 12, 13], 9) == (2, 0)  # 13 is cached but follows a miss
    assert c.match([11, 10], 9) == (2, 0)
    assert c.match([99, 10, 11], 9) == (0, 0)
    assert c.match([10, 11, 13], 9) == (3, 1)  # 13 is free: reusable all the same
    assert c.match([10, 11, 13], 2) == (2, 0)


def test_a_block_computed_twice_at_once_is_cached_once():
    c = PrefixCache()
    assert c.register(7)
    assert not c.register(7)  # a second copy stays its request's own, uncached
    assert c.num_in_use == 1
    assert c.release([7]) == 1 and c.free_keys() == [7]
    assert not c.register(7)  # cached (free) already: a new copy stays private too
    c.acquire([7])
    c.acquire([7])
    assert c.release([7]) == 0 and c.release([7]) == 1


def test_what_an_eviction_keeps_is_the_live_engines_choice():
    """engine/prefix_cache.py's rule: the blocks requests found cached, most hits first, then in
    use, then most recently freed, with their counts; then those not hit, all of them until a
    return shows that none it was given is asked for again, then only the latest release's."""
    c = PrefixCache()
    for k in (1, 2, 3, 4, 5):
        c.register(k)
    c.release([1, 2, 3, 4, 5])
    assert c.keeps_unhit and c.hottest(10) == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    c.acquire([1, 2])
    c.acquire([1, 2])
    c.release([1, 2])
    c.release([1, 2])
    c.acquire([4])
    c.release([4])
    c.acquire([5])  # in use at the eviction
    assert c.hottest(10) == [(1, 2), (2, 2), (5, 1), (4, 1), (3, 0)]
    assert c.hottest(3) == [(1, 2), (2, 2), (5, 1)]
    back = PrefixCache()
    assert back.adopt(c.hottest(10)) == 5 and back.adopted_unhit == 1
    assert back.keeps_unhit  # no request looked anything up yet: no evidence
    assert back.match([6], 9) == (0, 0)
    for k in (6, 7, 8, 9):  # prompts seen once: the one unhit block it was given is not asked for
        back.register(k)
    back.release([6, 7])
    back.release([8, 9])
    assert not back.keeps_unhit
    assert back.hottest(10) == [(1, 2), (2, 2), (5, 1), (4, 1), (8, 0)]  # 3, 6, 7, 9 go
    again = PrefixCache()
    again.adopt(back.hottest(10))
    again.acquire([8])  # the next turn of the latest request: all unhit blocks are kept again
    for k in (9, 10):
        again.register(k)
    again.release([8, 9, 10])
    assert again.keeps_unhit and again.adopted_unhit_hit == 1
    assert again.hottest(10) == [(1, 2), (2, 2), (8, 1), (5, 1), (4, 1), (9, 0), (10, 0)]  # recent first
    again.evict(7)  # what is evicted goes with its count
    assert again.hottest(10) == [] and again.num_evicted == 7


def test_keys_differ_from_the_first_differing_hashed_block_on():
    a = block_keys((1, 2, 3, 4), 32, 128, BS)  # 8 engine blocks from 4 hashed ones
    b = block_keys((1, 2, 9, 4), 32, 128, BS)
    assert len(a) == len(b) == 8
    assert a[:4] == b[:4] and all(x != y for x, y in zip(a[4:], b[4:], strict=True))
    assert block_keys((5, 2, 3, 4), 32, 128, BS)[1:] != a[1:]  # chained: a later equal hash is no hit
    assert len(block_keys((1, 2, 3, 4), 32, 127, BS)) == 7  # only blocks wholly inside the prompt
    assert block_keys((1, 2), 16, 64, 32) == block_keys((1, 2, 7), 16, 64, 32)


# -- an engine with a cache -----------------------------------------------------------------------


def _keys(tag: int, n: int) -> tuple[int, ...]:
    return block_keys(tuple(range(tag * 1000, tag * 1000 + n)), BS, n * BS, BS)


def _req(i: int, prompt: int, output: int, keys: tuple[int, ...] = ()) -> SimRequest:
    return SimRequest(str(i), "m", 0.0, prompt, output, 1.0, 1.0, control=None, block_keys=keys)


def _engine(
    pages: int, dev: SimDevice | None = None, name: str = "m", shape: ModelShape | None = None, **kw
) -> tuple[SimEngine, SimDevice]:
    dev = dev or SimDevice("d", pages * (2 << 20), 2 << 20)
    args = dict(block_size=BS, max_num_seqs=8, max_num_batched_tokens=4096, max_run_steps=32)
    args.update(kw)
    m = ServedModel(name, shape) if shape else served(name, "llama-3.2-1b")
    groups = KVGroups.of(m.spec.config, m.spec.config.max_position_embeddings)
    cost = RooflineCostModel(HARDWARE["h100"])
    return SimEngine(m, [dev], cost, prefix_caching=True, kv_groups=groups, **args), dev


def _check(e: SimEngine) -> None:
    """Running requests' blocks counted once (a cached block's full-context groups shared, its
    windowed groups each request's own); free cached blocks within the memory left."""
    shared = e.cached_block_bytes // e.block_bytes
    private = sum(e.held_blocks(s) - len(s.cached) * shared for s in e.running)
    assert e.used_blocks == private + e.cache.num_in_use * shared
    assert e.cache.num_free <= e.cache_room()
    for d in e.devices:
        assert d.used_pages <= d.total_pages


def _run(e: SimEngine, t: float = 0.0, steps: list | None = None) -> float:
    while (end := e.start_step(t)) is not None:
        if steps is not None:
            steps.append([(s.req.req_id, n) for s, n in e._scheduled])
        _check(e)
        e.finish_step(end)
        _check(e)
        t = end
    return t


def test_a_cached_prefix_is_not_prefilled_and_the_last_token_always_is():
    e, dev = _engine(pages=64)
    keys = _keys(1, 6)
    first = _req(0, 100, 4, keys)  # 6 full blocks and 4 tokens
    e.add(first)
    steps: list = []
    t = _run(e, steps=steps)
    assert steps[0] == [("0", 100)] and first.cached_tokens == 0
    assert e.cache.num_free == 6 and e.used_blocks == 0 and dev.used_pages == 0
    again, partial, whole = (
        _req(1, 100, 4, keys),
        _req(2, 80, 4, keys[:3] + _keys(2, 2)),
        _req(3, 96, 4, keys),
    )
    e.add(again)
    e.start_step(t)
    # the step computes the 4 uncached tokens, attending over the 96 cached ones too
    cost, spec = RooflineCostModel(HARDWARE["h100"]), served("m", "llama-3.2-1b").spec
    assert e.work_alone == cost.step_time(spec, 1, 4, 4 * (96 + 2.5), 96, 1)
    t = _run(e, e.finish_step(e.end) and e.end)
    for r in (partial, whole):
        e.add(r)
        steps = []
        t = _run(e, t, steps)
        assert steps[0] == [(r.req_id, r.prompt_tokens - r.cached_tokens)]
    assert again.cached_tokens == 96
    assert partial.cached_tokens == 48  # the first three blocks; its fourth differs
    assert whole.cached_tokens == 80  # 96 tokens cached, but its last token is computed: 5 blocks


def test_running_requests_share_their_common_blocks():
    e, dev = _engine(pages=64)
    keys = _keys(1, 8)
    a = _req(0, 128, 50, keys)
    e.add(a)
    end = e.start_step(0.0)
    e.finish_step(end)  # a's prompt computed: its 8 blocks are cached and in use
    b = _req(1, 130, 50, keys)
    e.add(b)
    end = e.start_step(end)
    assert b.cached_tokens == 128
    assert e.used_blocks == 8 + 1 + 1  # the shared 8, a's decode block, b's last block
    assert e.cache.num_in_use == 8
    _check(e)
    e.finish_step(end)
    _run(e, end)
    assert e.used_blocks == 0 and dev.used_pages == 0 and e.cache.num_free == 8 + 0  # b's 9th is partial


def test_requests_computing_one_prefix_at_once_keep_the_second_copy_private():
    e, dev = _engine(pages=64)
    keys = _keys(1, 4)
    a, b = _req(0, 70, 3, keys), _req(1, 70, 3, keys)
    e.add(a)
    e.add(b)
    end = e.start_step(0.0)  # both admitted in one step: neither finds the other's blocks
    assert a.cached_tokens == b.cached_tokens == 0
    e.finish_step(end)
    assert e.cache.num_in_use == 4 and e.used_blocks == 2 * 5
    _run(e, end)
    assert e.cache.free_keys() == list(reversed(keys)) and e.used_blocks == 0 and dev.used_pages == 0


def test_the_cache_never_takes_blocks_from_running_requests():
    e, _ = _engine(pages=4)  # 16 blocks in all
    a_keys, b_keys = _keys(1, 10), _keys(2, 10)
    a = _req(0, 160, 1, a_keys)
    e.add(a)
    t = _run(e)
    assert e.cache.free_keys() == list(reversed(a_keys))
    b = _req(1, 160, 1, b_keys)  # needs 10 of the 16 blocks: 4 of a's cached ones must go
    e.add(b)
    steps: list = []
    t = _run(e, t, steps)
    assert b.num_preemptions == 0 and b.finish is not None and steps[0] == [("1", 160)]
    # a's tail went first: its first 6 blocks are still cached, behind b's 10 (freed later)
    assert e.cache.free_keys() == list(reversed(a_keys[:6])) + list(reversed(b_keys))
    again = _req(2, 170, 1, a_keys)
    e.add(again)
    _run(e, t)
    assert again.cached_tokens == 6 * BS


def test_preempted_requests_leave_their_blocks_cached():
    e, dev = _engine(pages=4, max_run_steps=1)  # 16 blocks
    a, b = _req(0, 64, 100, _keys(1, 4)), _req(1, 64, 100, _keys(2, 4))  # 11 blocks each at the end
    e.add(a)
    e.add(b)
    _run(e)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.finish is not None and b.finish is not None and a.finish < b.finish
    assert b.cached_tokens == 0  # the hit of its first scheduling, not of its recomputation
    assert dev.used_pages == 0 and e.used_blocks == 0


def test_memory_another_engine_takes_evicts_the_cache_and_an_eviction_empties_it():
    e, dev = _engine(pages=8)  # 32 blocks
    e.add(_req(0, 320, 1, _keys(1, 20)))
    _run(e)
    assert e.cache.num_free == 20
    other, _ = _engine(0, dev, name="other")
    other.add(_req(1, 256, 1))  # maps 4 of the 8 pages for 16 blocks: 16 remain
    other.start_step(0.0)
    assert e.cache.num_free == 16 and e.cache_room() == 16
    dev.map_weights("w", 3 * (2 << 20))  # 12 of the 16 free blocks' memory
    assert e.cache.num_free == 4
    e.set_quota(2 * 512 * 1024)
    assert e.cache.num_free == 2
    e.drop_all()
    assert e.cache.num_free == 0 and e.name not in dev.shrink_watchers


@pytest.mark.parametrize("windowed", [False, True], ids=["one-group", "windowed"])
@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(1, 120), st.integers(1, 40)),
        min_size=1,
        max_size=12,
    ),
    st.integers(4, 12),  # a request holds at most 16 blocks: 4 pages
)
def test_random_shared_prefixes_keep_the_accounting_exact(windowed, reqs, pages):
    """Requests sharing 0-6 leading blocks of one of 4 prefixes, on little memory: every step keeps
    the counts exact, everything finishes, and every block goes back. Windowed: Gemma 3 1B's
    layers with a window of 40 tokens (SYNTHETIC), so requests pass it. Its blocks are one group's
    layers, and a request holds at most 16 full-context blocks and 6 x 8 windowed ones (the window,
    a chunk, a block each side): 16 blocks to a page keep the same 4 pages a request."""
    if windowed:
        shape = ModelShape("w", dataclasses.replace(PRESETS["gemma-3-1b"], sliding_window=40), 2)
        block = shape.kv_bytes_per_token * 4 // 26 * BS  # groups of 4 layers
        dev = SimDevice("d", pages * 16 * block, 16 * block)
        e, _ = _engine(0, dev, shape=shape, max_num_batched_tokens=64)
        assert e.block_bytes == block and e.cached_block_bytes == block  # one full-context group
    else:
        e, dev = _engine(pages=pages, max_num_batched_tokens=64)
    for i, (family, shared, extra, output) in enumerate(reqs):
        prompt = shared * BS + extra
        hashes = tuple(range(family * 100, family * 100 + shared)) + tuple(
            range(10_000 * (i + 1), 10_000 * (i + 1) + 8)
        )
        r = _req(i, prompt, output, block_keys(hashes, BS, prompt, BS))
        e.add(r)
    _run(e)
    assert not e.running and not e.waiting
    assert e.used_blocks == 0 and dev.used_pages == 0


# -- a simulation on the Mooncake trace --------------------------------------------------------------


# two SmolLM2-135M fp32 models on two one-core CPU devices: the cpu-2 setup, on its fitted profile
_MODELS = [ServedModel(f"smollm2-135m-0{i}", model_shape("smollm2-135m", 4), 1) for i in range(2)]


@pytest.fixture(scope="module")
def mooncake(traces) -> Workload:
    names = tuple(m.name for m in _MODELS)
    return build_workload(
        WorkloadSpec(names, source="mooncake", block_tokens=16, max_prompt_tokens=1792, max_output_tokens=32,
                     duration_s=60.0, traces_dir=traces.root)
    )  # fmt: skip


def test_simulated_hit_rate_is_between_zero_and_an_unbounded_caches(mooncake):
    models = _MODELS
    slos = {m.name: ModelSLO(30.0, 3.0) for m in models}
    config = SimConfig(num_devices=2, hardware="cpu-smollm2")
    res = simulate(models, mooncake, slos, config)
    s = res.summary()
    infinite = infinite_cache_hits(mooncake, 16).sum() / mooncake.prompt_tokens.sum()
    assert s["prefix_hit_rate_infinite"] == pytest.approx(infinite)
    assert 0 < s["prefix_hit_rate"] <= s["prefix_hit_rate_infinite"] < 1
    cached = sum(r.cached_tokens or 0 for r in res.requests)
    assert s["prefix_cached_tokens"] == cached
    per_model = res.per_model()
    assert sum(m["prefix_cached_tokens"] for m in per_model.values()) == cached
    for m in per_model.values():
        assert 0 <= m["prefix_hit_rate"] <= m["prefix_hit_rate_infinite"]
    no_cache = msgspec.structs.replace(config.engine, prefix_caching=False)
    off = simulate(models, mooncake, slos, SimConfig(num_devices=2, hardware="cpu-smollm2", engine=no_cache))
    assert "prefix_hit_rate" not in off.summary()
    assert all(r.cached_tokens is None for r in off.requests)
    # the same requests, less prefill: the first tokens come no later on average
    ttft = np.mean([r.ttft for r in res.requests])
    assert ttft <= np.mean([r.ttft for r in off.requests])


# -- prefix-aware routing across replicas -----------------------------------------------------------


def _conversations(n_conv: int, rate: float, duration: float, seed: int = 0) -> tuple[Workload, np.ndarray]:
    """Synthetic: ``n_conv`` conversations, each with its own 4,096-token system prompt, asked at
    ``rate`` req/s in all (each request a random conversation's, 64-256 tokens of its own after
    the system prompt, 32 out); 64-token hashed blocks, as the request log's. Returns the workload
    and each request's conversation."""
    rng = np.random.default_rng(seed)
    n = int(rate * duration)
    times = np.sort(rng.uniform(0, duration, n))
    conv = rng.integers(0, n_conv, n)
    own = rng.integers(64, 257, n)
    system = 64  # blocks
    hashes = [
        tuple(range(c * 1000, c * 1000 + system))
        + tuple(range(10**6 + 10 * i, 10**6 + 10 * i + -(-int(u) // 64)))
        for i, (c, u) in enumerate(zip(conv.tolist(), own.tolist(), strict=True))
    ]
    w = Workload(
        times, np.zeros(n, dtype=np.int64), system * 64 + own, np.full(n, 32), ("m",),
        block_hashes=hashes, block_tokens=64,
    )  # fmt: skip
    return w, conv


def test_prefix_aware_routing_keeps_each_conversation_on_one_replica_and_hits_more():
    """One 8B model on two H100s at 20 req/s of 4,200-token prompts (more than one replica serves
    within its SLO by the cost model, so prism runs two): routed by predicted TTFT alone, every
    conversation's requests spread over both replicas and each replica computes every system
    prompt; routed by cached prefix, each conversation stays where its system prompt is."""
    w, conv = _conversations(30, rate=20.0, duration=30.0)
    m = served("m")
    slos = {"m": ModelSLO(1.0, 0.1)}
    runs = {
        aware: simulate(
            [m], w, slos, SimConfig(num_devices=2, knobs={"max_replicas": 2, "prefix_aware": aware})
        )
        for aware in (True, False)
    }
    split = {}
    for aware, res in runs.items():
        replicas: dict[int, set[str]] = {}
        for r in res.requests:
            replicas.setdefault(int(conv[int(r.req_id)]), set()).add(r.replica)
        split[aware] = sum(len(v) > 1 for v in replicas.values())
        assert {r.replica for r in res.requests} == {"m", "m#1"}  # both replicas serve in both runs
    aware, blind = runs[True].summary(), runs[False].summary()
    print(f"hit rate by predicted TTFT {blind['prefix_hit_rate']:.1%}, by cached prefix "
          f"{aware['prefix_hit_rate']:.1%}, unbounded {aware['prefix_hit_rate_infinite']:.1%}; conversations "
          f"on both replicas {split[False]} and {split[True]}")  # fmt: skip
    assert split[True] <= 5 and split[False] >= 25
    assert blind["prefix_hit_rate"] + 0.03 < aware["prefix_hit_rate"] <= aware["prefix_hit_rate_infinite"]
    assert aware["ttft_attainment"] >= blind["ttft_attainment"]


# -- prefixes kept across evictions (memory/kept.py) ------------------------------------------------


def test_kept_prefixes_make_a_returning_models_system_prompt_a_hit(tmp_path):
    """Two models on one device that holds one of them at a time, asked in turns (each turn's
    requests share its model's 1,024-token system prompt): each return is an eviction of the other
    and an activation. With a kept-prefix budget the returning model's system prompt is restored
    (the activation takes longer by its copy) and its first requests hit; without, they miss."""
    from prism_serve.sim.hardware import dump_hardware, get_hardware

    hw = tmp_path / "hw.json"
    dump_hardware(dataclasses.replace(get_hardware("cpu-smollm2"), memory_bytes=800 * 2**20), hw)
    models = [ServedModel(f"m{i}", model_shape("smollm2-135m", 4), 1) for i in range(2)]
    rng = np.random.default_rng(0)
    times, which, prompts, hashes = [], [], [], []
    for turn in range(6):  # 10 s of one model's requests, then the other's
        for k in range(8):
            m = turn % 2
            own = int(rng.integers(64, 257))
            times.append(turn * 10.0 + k)
            which.append(m)
            prompts.append(1024 + own)
            n = len(times)
            hashes.append(
                tuple(range(m * 100, m * 100 + 16))
                + tuple(range(10**6 + 10 * n, 10**6 + 10 * n + -(-own // 64)))
            )
    w = Workload(
        np.array(times), np.array(which), np.array(prompts), np.full(len(times), 16), ("m0", "m1"),
        block_hashes=hashes, block_tokens=64,
    )  # fmt: skip
    slos = {m.name: ModelSLO(30.0, 3.0) for m in models}
    knobs = (("idle_threshold_s", 2.0),)  # an idle model makes room for the other at once
    runs = {
        kept: simulate(
            models, w, slos, SimConfig(num_devices=1, hardware=str(hw), kept_prefix_bytes=kept, knobs=knobs)
        )
        for kept in (0, 2**30)
    }
    none, kept = runs[0].summary(), runs[2**30].summary()
    print(f"hit rate without kept prefixes {none['prefix_hit_rate']:.1%}, "
          f"with {kept['prefix_hit_rate']:.1%}, "
          f"unbounded {kept['prefix_hit_rate_infinite']:.1%}")  # fmt: skip
    assert none["evictions"] >= 2 and kept["evictions"] >= 4
    assert none["restored_prefix_blocks"] == 0 < kept["restored_prefix_blocks"]
    assert none["prefix_hit_rate"] < kept["prefix_hit_rate"] <= kept["prefix_hit_rate_infinite"]
    # the first request of each return finds its system prompt: every full block of it
    first = [r for r in runs[2**30].requests if r.arrival % 10.0 == 0 and r.arrival >= 20.0]
    assert first and all(r.cached_tokens == 1024 for r in first)
