"""The control plane's prefix index (control/prefix_index.py): the longest leading run, the bound
per replica (least recently routed first, a prompt's tail before its head), forgetting a replica's
keys when its engine goes, and the control loop recording what it routes and pricing it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prism_serve.control import (
    PREFIX_BLOCK_TOKENS,
    EngineSnapshot,
    Evict,
    InvalidSnapshotError,
    ModelState,
    PrefixIndex,
    RejectReason,
    Request,
)
from prism_serve.control.loop import ENGINE
from prism_serve.control.prefix_index import capacity_blocks

from .factories import GIB, cluster, model
from .test_loop import make

BT = PREFIX_BLOCK_TOKENS


def keys(tag: int, n: int) -> tuple[int, ...]:
    """``n`` chained keys of prompt family ``tag`` (distinct families share none)."""
    return tuple(tag * 1000 + i for i in range(n))


def test_a_match_is_the_longest_leading_run_recorded_on_that_replica():
    index = PrefixIndex()
    index.record("a", keys(1, 4))
    assert index.match("a", keys(1, 4)) == 4 * BT
    assert index.match("a", keys(1, 6)) == 4 * BT  # its last two blocks were never sent there
    assert index.match("a", keys(1, 2) + keys(2, 2)) == 2 * BT  # the prompts part after two blocks
    assert index.match("a", keys(2, 4)) == 0
    assert index.match("b", keys(1, 4)) == 0  # another replica holds nothing
    assert index.match("a", ()) == 0
    # a recorded key that follows a miss is no hit: the run ends at the first key not held
    assert index.match("a", keys(5, 1) + keys(1, 3)) == 0


def test_a_hit_leaves_at_least_the_last_prompt_token_to_compute():
    index = PrefixIndex()
    index.record("a", keys(1, 4))
    assert index.cached_tokens("a", keys(1, 4), 4 * BT) == 3 * BT  # the whole prompt is cached
    assert index.cached_tokens("a", keys(1, 4), 4 * BT + 1) == 4 * BT
    assert index.cached_tokens("a", keys(1, 4), 1) == 0


def test_each_replica_keeps_at_most_its_capacity_dropping_old_tails_first():
    index = PrefixIndex()
    index.record("a", keys(1, 4), capacity=6)
    index.record("a", keys(2, 4))  # the capacity it was last told: two of family 1 must go
    assert index.blocks("a") == 6
    # family 1's tail went, its head stayed: its first two blocks still match
    assert index.match("a", keys(1, 4)) == 2 * BT and index.match("a", keys(2, 4)) == 4 * BT
    index.record("a", keys(1, 2))  # family 1's head is routed again: the most recent now
    index.record("a", keys(3, 3))
    assert index.match("a", keys(1, 2)) == 2 * BT
    assert index.match("a", keys(2, 4)) == 1 * BT  # family 2 lost its last three blocks
    assert index.match("a", keys(3, 3)) == 3 * BT
    # a prompt longer than the whole cache keeps its head
    index.record("a", keys(4, 10), capacity=3)
    assert index.blocks("a") == 3 and index.match("a", keys(4, 10)) == 3 * BT
    assert len(index) == 3
    # replicas are bounded apart; one with no room holds nothing
    index.record("b", keys(1, 4), capacity=0)
    assert index.blocks("b") == 0 and index.match("b", keys(1, 1)) == 0
    # never told: the default bound
    small = PrefixIndex(default_blocks=2)
    small.record("c", keys(1, 5))
    assert small.blocks("c") == 2 and small.match("c", keys(1, 5)) == 2 * BT
    with pytest.raises(InvalidSnapshotError):
        PrefixIndex(block_tokens=0)


def test_a_replica_placed_anew_or_evicted_holds_nothing_but_what_waited_for_it_stays():
    index = PrefixIndex()
    index.sync("a", True, 10.0)
    index.record("a", keys(1, 3))
    index.sync("a", True, 10.0)  # the same placement: kept
    assert index.match("a", keys(1, 3)) == 3 * BT
    index.sync("a", True, 20.0)  # evicted and activated again between two looks (an operator)
    assert index.blocks("a") == 0
    index.record("a", keys(1, 3))
    index.sync("a", False, None)  # evicted
    assert index.blocks("a") == 0
    # a request routed to it while it is evicted waits for its activation: its keys carry over
    index.record("a", keys(2, 2))
    index.sync("a", True, 30.0)
    assert index.match("a", keys(2, 2)) == 2 * BT
    index.forget("a")
    assert index.blocks("a") == 0


def test_the_bound_is_what_the_replicas_engine_or_device_can_hold():
    m = model("a", on=("d0",), weight_gib=10.0, kvpt=128 * 1024)
    on_device = cluster([m, model("b")], {"d0": 20.0})
    # no engine reported yet: the device's capacity less the weights, over the KV per token
    assert capacity_blocks(on_device, "a", BT) == 10 * GIB // (128 * 1024) // BT
    engine = EngineSnapshot("a", "d0", 128 * 1024, max_kv_bytes=GIB)
    with_engine = cluster([m, model("b")], {"d0": 20.0}, engines=[engine])
    assert capacity_blocks(with_engine, "a", BT) == GIB // (128 * 1024) // BT
    assert capacity_blocks(on_device, "b", BT) is None  # evicted
    assert capacity_blocks(on_device, "nobody", BT) is None


# -- the control loop ---------------------------------------------------------------------------


def prompt(i: int, family: int, model: str = "a", t: float = 0.0, blocks: int = 8) -> Request:
    """A request whose prompt is ``blocks`` full blocks of ``family`` and 10 more tokens."""
    return Request(f"r{i}", model, t, blocks * BT + 10, 1.0, keys(family, blocks))


def test_the_loop_prices_a_routed_prefix_and_forgets_it_when_the_model_is_evicted():
    loop, body, pol = make(max_seqs=4)
    assert loop.prefix_aware
    loop.arrival(prompt(1, family=1), 0.0)
    assert loop.requests["r1"].cached_tokens == 0 and loop.prefixes.blocks("a") == 8
    body.activated("a", 0.5)
    loop.arrival(prompt(2, family=1, t=1.0), 1.0)
    assert loop.requests["r2"].cached_tokens == 8 * BT and loop.requests["r2"].prefill_tokens == 10
    loop.arrival(replace(prompt(3, family=1, t=1.0), prefix_keys=keys(1, 3) + keys(2, 5)), 1.0)
    assert loop.requests["r3"].cached_tokens == 3 * BT
    assert loop.where["r2"] == loop.where["r3"] == ENGINE
    for rid in ("r1", "r2", "r3"):
        body.finish(rid, 2.0)
    pol.next_place = [Evict("a")]
    loop.tick(3.0)
    assert body.models["a"].state is ModelState.EVICTED and loop.prefixes.blocks("a") == 0
    loop.arrival(prompt(4, family=1, t=4.0), 4.0)  # a new engine: nothing cached
    assert loop.requests["r4"].cached_tokens == 0


def test_without_prefix_awareness_the_loop_keeps_no_index():
    loop, body, _ = make(knobs={"prefix_aware": False})
    assert not loop.prefix_aware
    loop.arrival(prompt(1, family=1), 0.0)
    body.activated("a", 0.5)
    loop.arrival(prompt(2, family=1, t=1.0), 1.0)
    assert loop.requests["r2"].cached_tokens == 0 and len(loop.prefixes) == 0


def test_the_loop_routes_each_prefix_to_the_replica_it_went_to_before():
    """Two active replicas of ``a``: family 1 goes to replica 0 (the tie's lower slot); family 2
    then finds replica 0 busier and goes to replica 1; from then on each family's requests follow
    their prefix, priced by what is cached there."""
    loop, body, _ = make(models={"a": 1.0, "a#1": 1.0}, max_seqs=8)
    for name, d in (("a", "d0"), ("a#1", "d1")):
        body.models[name].state, body.models[name].placement = ModelState.ACTIVE, (d,)
    loop.arrival(prompt(1, family=1), 0.0)
    loop.arrival(prompt(2, family=2), 0.0)
    first = {rid: r for m in body.models.values() for rid, r in m.running.items()}
    assert first["r1"].model == "a" and first["r2"].model == "a#1"
    for i in range(3, 9):
        family = 1 + i % 2
        loop.arrival(prompt(i, family=family, t=0.1 * i), 0.1 * i)
        r = body.models["a" if family == 1 else "a#1"].running[f"r{i}"]
        assert r.cached_tokens == 8 * BT
    assert loop.prefixes.match("a", keys(1, 8)) == 8 * BT and loop.prefixes.match("a", keys(2, 8)) == 0


def test_admission_starts_a_request_whose_uncached_part_meets_the_deadline_its_prompt_would_miss():
    """The engines prefill 10,000 tokens/s and the SLO is 1 s: a 12,000-token prompt misses it
    (rejected under abort_on_miss) unless most of it is cached on its replica."""
    loop, body, _ = make(knobs={"abort_on_miss": True})
    loop.arrival(prompt(0, family=9, blocks=2), 0.0)  # activates the model
    body.activated("a", 0.5)
    body.finish("r0", 0.6)
    # 11,978 tokens, nothing cached: 1.2 s, within a 2 s SLO; it runs, and its prefix is cached
    loop.arrival(replace(prompt(1, family=1, t=1.0, blocks=187), ttft_slo=2.0), 1.0)
    assert loop.where["r1"] == ENGINE
    body.finish("r1", 3.0)
    loop.arrival(prompt(2, family=1, t=4.0, blocks=187), 4.0)  # the same prompt: 10 tokens to compute
    assert loop.where["r2"] == ENGINE and not body.rejected
    loop.arrival(prompt(3, family=2, t=4.0, blocks=187), 4.0)  # another one of that length
    assert body.rejected == {"r3": RejectReason.DEADLINE_MISS}
