"""Fair share among a class's tenants (control/fairness.py), and what admission does with it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.control import DeadlineQueue, Dispatch
from prism_serve.control.fairness import LEVELS, FairShare
from prism_serve.control.types import InvalidKnobError, Origin, Priority
from tests.control.factories import device, engine, request

A, B, C = (Origin(name) for name in "ABC")
HALF_LIFE = 30.0


def steady(fair: FairShare, asks: dict[Origin, int], served: dict[Origin, int], seconds: int, t0=0.0):
    """Each second, each tenant asks for and is served the given tokens; returns the clock."""
    t = t0
    for _ in range(seconds):
        t += 1.0
        for o, n in asks.items():
            fair.charge(o, asked=n, served=served.get(o, 0), now=t)
        for o in asks:
            fair.level(o, t)
    return t


def test_a_tenant_alone_in_its_class_is_never_over():
    fair = FairShare(HALF_LIFE)
    t = steady(fair, {A: 100_000}, {A: 1_000}, 200)
    assert fair.level(A, t) == 0
    # another class's tenants do not count: they share their own class
    batch = Origin("B", Priority.BATCH)
    steady(fair, {batch: 10}, {batch: 10}, 5, t)
    assert fair.level(A, t + 5) == 0


def test_nobody_is_over_while_the_class_is_served_what_it_asks():
    fair = FairShare(HALF_LIFE)
    asks = {A: 9_000, B: 1_000, C: 500}  # unequal, but all of it served
    t = steady(fair, asks, asks, 200)
    assert [fair.level(o, t) for o in (A, B, C)] == [0, 0, 0]


def test_a_flooding_tenant_is_over_and_the_others_keep_what_they_ask():
    fair = FairShare(HALF_LIFE)
    # the class is served 12k tokens/s; B and C ask 2k each, A 40k: A's max-min part is 8k
    t = steady(fair, {A: 40_000, B: 2_000, C: 2_000}, {A: 8_000, B: 2_000, C: 2_000}, 200)
    assert fair.level(B, t) == fair.level(C, t) == 0
    # asking 5x its part: over SLACK (1.5) and two doublings beyond it
    assert fair.level(A, t) == 2
    assert fair.current(A) == 2 and fair.current(B) == 0
    assert fair.current(Origin("nobody")) == 0


def test_a_big_tenant_beside_a_small_one_gets_the_rest():
    """Max-min, not an equal split: B asks little, so A's part is all the service B leaves."""
    fair = FairShare(HALF_LIFE)
    t = steady(fair, {A: 20_000, B: 500}, {A: 18_000, B: 500}, 200)
    assert fair.level(A, t) == 0  # 20k asked over an 18k part: within SLACK


def test_weights_scale_the_parts():
    fair = FairShare(HALF_LIFE)
    heavy = Origin("A", weight=4.0)
    # the class is served 10k/s; both ask more: parts are 8k (A, weight 4) and 2k (B)
    t = steady(fair, {heavy: 11_000, B: 12_000}, {heavy: 8_000, B: 2_000}, 200)
    assert fair.level(heavy, t) == 0  # 11k over 8k: within SLACK
    assert fair.level(B, t) == LEVELS - 1  # 12k over 2k: 6x, past SLACK by two doublings and more


def test_a_tenant_cut_back_stays_over_until_it_asks_no_more_than_its_part():
    fair = FairShare(HALF_LIFE)
    t = steady(fair, {A: 40_000, B: 2_000}, {A: 8_000, B: 2_000}, 200)
    assert fair.level(A, t) > 0
    # A asks 1.4x its part now: within SLACK, but not back to RECOVERED, so still over
    t = steady(fair, {A: 11_200, B: 2_000}, {A: 8_000, B: 2_000}, 300, t)
    assert fair.level(A, t) == 1
    # 1.1x (a few of its requests late): recovered
    t = steady(fair, {A: 7_700, B: 2_000}, {A: 7_000, B: 2_000}, 300, t)
    assert fair.level(A, t) == 0


def test_no_tenant_is_over_in_its_class_warm_up():
    fair = FairShare(HALF_LIFE)
    t = steady(fair, {A: 40_000, B: 2_000}, {A: 8_000, B: 2_000}, int(HALF_LIFE) - 2)
    assert fair.level(A, t) == 0
    t = steady(fair, {A: 40_000, B: 2_000}, {A: 8_000, B: 2_000}, 5, t)
    assert fair.level(A, t) > 0


def test_counts_decay_and_idle_tenants_are_forgotten():
    fair = FairShare(HALF_LIFE)
    t = steady(fair, {A: 40_000, B: 2_000}, {A: 8_000, B: 2_000}, 200)
    assert fair.level(A, t) > 0
    # B goes quiet for a long time: A is alone again (and the class warms up anew)
    t = steady(fair, {A: 40_000}, {A: 8_000}, 1_000, t)
    fair.forget_idle(t)
    assert fair.level(A, t) == 0


@settings(max_examples=60, deadline=None)
@given(start=st.floats(0, 1e7), days=st.integers(1, 30))
def test_the_units_rebase_instead_of_overflowing(start, days):
    fair = FairShare(HALF_LIFE)
    steady(fair, {A: 40_000, B: 2_000}, {A: 8_000, B: 2_000}, 100, start)
    t = start + days * 86_400.0
    t = steady(fair, {A: 40_000, B: 2_000}, {A: 8_000, B: 2_000}, 200, t)
    assert fair.level(A, t) > 0 and fair.level(B, t) == 0


def test_bad_settings_are_refused():
    with pytest.raises(InvalidKnobError):
        FairShare(0.0)
    with pytest.raises(ValueError, match="weight"):
        Origin("A", weight=0.0)


# -- admission: classes, best-effort starts, re-ranking --------------------------------------------


def test_a_waiting_batch_request_starts_only_on_idle_capacity_and_holds_no_one_back():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=1000.0, best_effort_share=0.25)
    batch = replace(request("b", tokens=100, slo=86_400.0), origin=Origin("eval", Priority.BATCH))
    q.push(batch)
    # the device runs 2 of its engine's 8 slots' quarter: a batch request waits
    busy = {"a": engine("a", free_gib=50, max_seqs=8, running=2)}
    assert q.admit(0.0, device(), busy) == []
    # an interactive request behind it (a later deadline) starts all the same
    chat = Origin("chat", Priority.INTERACTIVE)
    q.push(replace(request("i", tokens=100, slo=100_000.0), origin=chat))
    out = q.admit(0.0, device(), busy)
    assert [a.request.req_id for a in out if isinstance(a, Dispatch)] == ["i"]
    # with one request running, and no prefill pending, the batch request starts
    later = 1.0  # the interactive prefill (0.1 s) is done
    idle = {"a": engine("a", free_gib=50, max_seqs=8, running=1)}
    out = q.admit(later, device(), idle)
    assert [a.request.req_id for a in out if isinstance(a, Dispatch)] == ["b"]


def test_under_overload_batch_yields_first_then_standard():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=1000.0)
    # three 600 ms prefills with a 1 s deadline: one fits
    for name, cls in (("b", Priority.BATCH), ("s", Priority.STANDARD), ("i", Priority.INTERACTIVE)):
        q.push(replace(request(name, tokens=600, slo=1.0), origin=Origin(name, cls)))
    assert [r.req_id for r in q.schedule(0.0)] == ["i"]
    assert {r.req_id for r in q.deferred(0.0)} == {"s", "b"}


def test_a_tenant_found_over_its_share_yields_with_the_requests_it_queued_before():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=1000.0)
    levels = {"A": 0, "B": 0}
    q.shares = lambda origin: levels[origin.tenant]
    # A's request came first and is the shorter: plain Algorithm 2 keeps it and drops B's
    q.push(replace(request("a", tokens=500, slo=1.0), origin=Origin("A")))
    q.push(replace(request("b", tokens=600, slo=1.0), origin=Origin("B")))
    assert [r.req_id for r in q.schedule(0.0)] == ["a"]
    # A is found over its share: its next request arrives stamped so, and the queue re-ranks
    levels["A"] = 2
    q.push(replace(request("a2", tokens=100, slo=5.0), origin=Origin("A"), share=2))
    assert [r.req_id for r in q.schedule(0.0)] == ["b", "a2"]
    assert [r.req_id for r in q.deferred(0.0)] == ["a"]
    assert q.stats["ranked"] >= 1


def test_tenants_that_ask_alike_never_all_become_over():
    """However far the service falls behind the asks (the class's start, an overload), tenants
    asking alike stay first-rank: cutting them all back would only idle the devices."""
    fair = FairShare(HALF_LIFE)
    t = steady(fair, {A: 10_000, B: 10_000, C: 9_000}, {A: 1_000, B: 1_000, C: 1_000}, 200)
    assert [fair.level(o, t) for o in (A, B, C)] == [0, 0, 0]


def test_standard_yields_to_interactive_once_interactive_requests_miss():
    fair = FairShare(HALF_LIFE)
    chat, team = Origin("chat", Priority.INTERACTIVE), Origin("team", Priority.STANDARD)
    # the two classes are served 10k tokens/s; interactive asks 6k, standard 9k: 4k is left for it
    t = steady(fair, {chat: 6_000, team: 9_000}, {chat: 6_000, team: 4_000}, 100)
    for _ in range(100):
        fair.left(chat, 100, 10, True, t)
    assert fair.level(team, t) == 0  # over what is left, but interactive is met: nothing to spare
    for _ in range(5):
        fair.left(chat, 100, 10, False, t)  # 5 of 105 late: below 99%
    assert fair.level(team, t) == 1  # 9k over a 4k part: past SLACK, under two doublings
    assert fair.current(team) == 1
    # a batch tenant is never measured against interactive
    assert fair.level(Origin("eval", Priority.BATCH), t) == 0
