"""Algorithm 2: optimality of the pure schedule, and the incremental queue against a fresh run."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prism_serve.control import DeadlineQueue, Dispatch, Reject, RejectReason, moore_hodgson
from prism_serve.control.admission import NS, prefill_ns, ranked_moore_hodgson, to_ns
from prism_serve.control.types import Origin, Priority
from prism_serve.errors import DuplicateRequestError
from tests.control.factories import GIB, device, engine, request


def on_time_count(jobs: list[tuple[int, int]], subset: tuple[int, ...], t0: int) -> bool:
    t = t0
    for i in sorted(subset, key=lambda i: (jobs[i][0], i)):
        t += jobs[i][1]
        if t > jobs[i][0]:
            return False
    return True


def brute_force_best(jobs: list[tuple[int, int]], t0: int) -> int:
    for size in range(len(jobs), -1, -1):
        if any(on_time_count(jobs, s, t0) for s in itertools.combinations(range(len(jobs)), size)):
            return size
    return 0


job_lists = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 25)), min_size=0, max_size=8)


@settings(max_examples=200, deadline=None)
@given(jobs=job_lists, t0=st.integers(-5, 10))
def test_moore_hodgson_matches_brute_force_optimum(jobs, t0):
    kept = moore_hodgson(jobs, t0)
    assert on_time_count(jobs, tuple(kept), t0), "the kept schedule must meet every deadline"
    assert len(kept) == brute_force_best(jobs, t0)
    assert kept == sorted(kept, key=lambda i: (jobs[i][0], i)), "the schedule runs in deadline order"


def test_moore_hodgson_drops_the_longest_prefill():
    # three jobs share a deadline at 10; only two fit, and the 6-long one is the one to drop
    assert moore_hodgson([(10, 4), (10, 6), (10, 5)], 0) == [0, 2]


ranked_jobs = st.lists(
    st.tuples(st.integers(0, 60), st.integers(0, 25), st.integers(0, 3)), min_size=0, max_size=9
)


@settings(max_examples=200, deadline=None)
@given(jobs=job_lists, t0=st.integers(-5, 10), rank=st.integers(0, 3))
def test_the_ranked_rule_with_one_rank_is_moore_hodgson(jobs, t0, rank):
    schedulable = [j for j in jobs if t0 + j[1] <= j[0]]  # the ranked rule leaves out the late
    kept = ranked_moore_hodgson([(d, p, rank) for d, p in schedulable], t0)
    assert kept == moore_hodgson(schedulable, t0)


@settings(max_examples=300, deadline=None)
@given(jobs=ranked_jobs, t0=st.integers(-5, 10))
def test_the_ranked_rule_keeps_for_each_rank_and_above_what_they_would_keep_alone(jobs, t0):
    """Lower ranks never cost a higher one a request: for every rank r, the kept jobs of rank r or
    above are exactly what the rule keeps of those jobs alone (for the top rank: Moore-Hodgson's
    optimum), and the whole kept schedule meets every deadline."""
    kept = ranked_moore_hodgson(jobs, t0)
    assert on_time_count([(d, p) for d, p, _ in jobs], tuple(kept), t0)
    for r in range(4):
        mine = [i for i, j in enumerate(jobs) if j[2] >= r]
        alone = ranked_moore_hodgson([jobs[i] for i in mine], t0)
        assert [i for i in kept if jobs[i][2] >= r] == [mine[k] for k in alone]
    top = [i for i, j in enumerate(jobs) if j[2] == 3 and t0 + j[1] <= j[0]]
    assert sum(jobs[i][2] == 3 for i in kept) == brute_force_best([jobs[i][:2] for i in top], t0)


def test_the_ranked_rule_drops_the_lower_rank_even_when_shorter():
    # one slot of 10: the long interactive job stays, the short batch job goes
    assert ranked_moore_hodgson([(10, 4, 0), (10, 8, 1)], 0) == [1]
    # several lower-rank drops may be needed to make room for one higher-rank job
    assert ranked_moore_hodgson([(10, 3, 0), (10, 3, 0), (10, 3, 0), (10, 9, 1)], 0) == [3]


# -- the incremental queue -------------------------------------------------------------------------

SPEED = 1000.0  # tokens/s: a prompt of n tokens takes n ms to prefill


def fresh_run(q: DeadlineQueue, now: float, speeds: dict[str, float]) -> tuple[list[str], set[str], set[str]]:
    """Algorithm 2 from scratch over everything queued: (schedule, deferred, late).

    ``requests()`` lists them in push order, so equal prefills drop the older first, as the queue does.
    """
    reqs = q.requests()
    t0 = q.start_ns(now)
    jobs = [(checked_deadline(q, r), prefill_ns(r.prompt_tokens, speeds.get(r.model, SPEED))) for r in reqs]
    if len({rank(r) for r in reqs}) > 1:
        kept = ranked_moore_hodgson([(d, p, rank(r)) for (d, p), r in zip(jobs, reqs, strict=True)], t0)
    else:
        kept = moore_hodgson(jobs, t0)
    late = {r.req_id for r, (d, p) in zip(reqs, jobs, strict=True) if t0 + p > d}
    deferred = {r.req_id for r in reqs} - {reqs[i].req_id for i in kept} - late
    return [reqs[i].req_id for i in kept], deferred, late


def checked_deadline(q: DeadlineQueue, r) -> int:
    """The deadline the schedule checks: the SLO's less the model's learned margin, at most half the SLO."""
    return to_ns(r.deadline) - min(q.margin_ns(r.model), to_ns(r.ttft_slo) // 2)


def rank(r) -> tuple[int, int]:
    """The order admission keeps requests in under overload: class first, then a lower share."""
    return (-r.origin.priority, -r.share)


def fresh_latest_starts(
    q: DeadlineQueue, now: float, speeds: dict[str, float]
) -> list[tuple[str, int | None]]:
    """What a fresh run records per schedulable position: d - (sum so far), None where it drops."""
    t0 = q.start_ns(now)
    out, heap, cum = [], [], 0
    for r in sorted(q.requests(), key=lambda r: checked_deadline(q, r)):
        d, p = checked_deadline(q, r), prefill_ns(r.prompt_tokens, speeds.get(r.model, SPEED))
        if t0 + p > d:
            continue  # late: not a schedulable position
        cum += p
        heapq.heappush(heap, -p)
        if t0 + cum > d:
            cum += heapq.heappop(heap)
            out.append((r.req_id, None))
        else:
            out.append((r.req_id, d - cum))
    return out


def fresh_schedule(q: DeadlineQueue, now: float, speeds: dict[str, float]) -> list[str]:
    return fresh_run(q, now, speeds)[0]


def roomy_engines(slots: dict[str, int], ready: dict[str, bool], speeds: dict[str, float]):
    return {
        m: engine(m, free_gib=50, max_seqs=n, ready=ready.get(m, True), speed=speeds.get(m))
        for m, n in slots.items()
    }


op = st.one_of(
    st.tuples(
        st.just("push"), st.sampled_from("ab"), st.integers(0, 400), st.sampled_from([0.2, 0.5, 1.0, 3.0]),
        st.sampled_from(list(Priority)), st.integers(0, 3),
    ),
    st.tuples(st.just("advance"), st.floats(0, 0.6)),
    st.tuples(st.just("admit"), st.integers(0, 3), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("speed"), st.sampled_from([500.0, 1000.0, 1010.0, 2000.0])),
    # a dispatched request's first token, this late after now: the queue learns a margin
    st.tuples(st.just("first"), st.integers(0, 50), st.sampled_from([0.0, 0.05, 0.2, 0.6, 2.0])),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, max_size=60), abort=st.booleans(), ranked=st.booleans())
@example(
    ops=[
        ("push", "a", 251, 0.5, Priority.STANDARD, 0), ("speed", 500.0),
        ("push", "a", 250, 0.5, Priority.STANDARD, 0), ("admit", 2, 0, False),
    ],
    abort=False, ranked=False,
)
def test_incremental_queue_equals_a_fresh_algorithm_2_run(ops, abort, ranked):
    """``ranked``: requests differ in class and fair-share level, and the queue follows the ranked
    rule while they do (and plain Algorithm 2 again once the queue holds one rank)."""
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED, abort_on_miss=abort)
    now = 0.0
    speeds: dict[str, float] = {}
    reported: dict[str, float] = {}
    n = 0
    dev = device(cap_gib=80)
    dispatched: list[str] = []
    for o in ops:
        if o[0] == "push":
            r = request(f"r{n}", o[1], arrival=now, tokens=o[2], slo=o[3])
            q.push(replace(r, origin=Origin(priority=o[4]), share=o[5]) if ranked else r)
            n += 1
        elif o[0] == "advance":
            now += o[1]
        elif o[0] == "cancel":
            reqs = q.requests()
            if reqs:
                assert q.cancel(reqs[o[1] % len(reqs)].req_id)
        elif o[0] == "speed":
            reported["a"] = o[1]
        elif o[0] == "first":
            if dispatched:
                q.first_token(dispatched.pop(o[1] % len(dispatched)), now + o[2])
        else:
            for m, v in reported.items():  # the queue adopts a reported speed at admit unless within 2%
                if abs(v - speeds.get(m, SPEED)) > 0.02 * speeds.get(m, SPEED):
                    speeds[m] = v
            # what a fresh run decides at the speeds this admit decides with (a new speed can make
            # a request late that was deferred before it)
            before, _, late_before = fresh_run(q, now, speeds)
            before = set(before)
            engines = roomy_engines({"a": o[1], "b": o[2]}, {"b": o[3]}, reported)
            out = q.admit(now, dev, engines)
            for a in out:
                if isinstance(a, Dispatch):
                    assert a.request.req_id in before | late_before
                    dispatched.append(a.request.req_id)
                else:
                    assert abort and a.reason is RejectReason.DEADLINE_MISS
        if o[0] == "speed":
            continue
        if abort:
            # rejections produced outside admit are handed out by the next admit
            q.schedule(now)
            held = q.admit(now, dev, {})
            assert all(isinstance(a, Reject) for a in held)
            assert not q.deferred(now) and not q.late(now)
        schedule, deferred, late = fresh_run(q, now, speeds)
        assert [r.req_id for r in q.schedule(now)] == schedule
        assert {r.req_id for r in q.deferred(now)} == deferred
        assert {r.req_id for r in q.late(now)} == late


calm_op = st.one_of(
    st.tuples(
        st.just("push"), st.sampled_from("ab"), st.integers(0, 300), st.sampled_from([2.0, 5.0, 10.0, 20.0])
    ),
    st.tuples(st.just("advance"), st.floats(0, 0.3)),
    st.tuples(st.just("admit"), st.integers(0, 2), st.integers(0, 2), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(calm_op, min_size=10, max_size=80), pressure=st.sampled_from([1.0, 0.5, 0.3, 0.2]))
def test_incremental_queue_equals_a_fresh_run_when_requests_join_mid_queue(ops, pressure):
    """Interleaved SLOs put most arrivals mid-queue; a lower ``pressure`` shrinks the SLOs so that
    slack gets tight and the schedule drops requests. It must equal a fresh run after every step."""
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    now, n = 0.0, 0
    for o in ops:
        if o[0] == "push":
            q.push(request(f"r{n}", o[1], arrival=now, tokens=o[2], slo=o[3] * pressure))
            n += 1
        elif o[0] == "advance":
            now += o[1]
        else:
            before, _, late_before = fresh_run(q, now, {})
            out = q.admit(now, device(), roomy_engines({"a": o[1], "b": o[2]}, {"b": o[3]}, {}))
            assert all(isinstance(a, Dispatch) and a.request.req_id in set(before) | late_before for a in out)
        schedule, deferred, late = fresh_run(q, now, {})
        assert [r.req_id for r in q.schedule(now)] == schedule
        assert {r.req_id for r in q.deferred(now)} == deferred
        assert {r.req_id for r in q.late(now)} == late
        # every position whose check passes carries its exact margin (positions that drop someone,
        # late ones included, are compared through the schedule above)
        passing = [x for x in q.latest_starts_ns(now) if x[1] is not None]
        assert passing == [x for x in fresh_latest_starts(q, now, {}) if x[1] is not None]


def test_mid_queue_arrivals_join_without_a_rerun():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    for i, slo in enumerate([20.0, 5.0, 10.0, 2.0, 15.0, 1.0]):
        q.push(request(f"r{i}", arrival=0.0, tokens=100, slo=slo))
        q.schedule(0.0)
    assert q.stats["middle_inserts"] == 5 and q.stats["replans"] == 1  # only the first push re-ran
    assert [r.req_id for r in q.schedule(0.0)] == ["r5", "r3", "r1", "r2", "r4", "r0"]


def test_margins_stay_exact_after_arrivals_that_skipped_a_rerun():
    # "x" (model b, loading) arrives mid-queue right after a position that dropped a request ("p2"),
    # then "y" (b) arrives mid-queue without a re-run, and "z" (a, 0.7 s) arrives last. Starting z
    # ahead of x and y would make them late; a stale margin would let it start.
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    for rid, model, tokens, slo in [("p1", "a", 500, 1.0), ("p2", "a", 600, 1.05), ("p3", "a", 50, 5.0)]:
        q.push(request(rid, model, arrival=0.0, tokens=tokens, slo=slo))
        q.schedule(0.0)
    q.push(request("x", "b", arrival=0.0, tokens=100, slo=1.2))
    q.schedule(0.0)
    q.push(request("y", "b", arrival=0.0, tokens=100, slo=1.5))
    q.schedule(0.0)
    q.push(request("z", "a", arrival=0.0, tokens=700, slo=9.0))
    engines = {"a": engine("a", free_gib=1), "b": engine("b", free_gib=1, ready=False)}
    out = q.admit(0.0, device(), engines)
    assert [a.request.req_id for a in out] == ["p1", "p3"], "z would make x and y miss their deadlines"
    assert q.stats["middle_inserts"] >= 1
    assert [r.req_id for r in q.schedule(0.0)] == fresh_schedule(q, 0.0, {})


def test_tail_arrival_after_a_mid_queue_one_gets_its_exact_margin():
    # e1 joins mid-queue (before p0) without a re-run; then y (b, loading) and z (a, 10 s) arrive
    # last. Once e1 and p0 start, y still has 10.4 - 0.3 = 10.1 s of slack, so z may go ahead of it.
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    for rid, model, tokens, slo in [("p0", "a", 100, 10.0), ("e1", "a", 200, 5.0), ("y", "b", 100, 10.5)]:
        q.push(request(rid, model, arrival=0.0, tokens=tokens, slo=slo))
        q.schedule(0.0)
    q.push(request("z", "a", arrival=0.0, tokens=10_000, slo=30.0))
    assert q.stats["middle_inserts"] == 1
    engines = {"a": engine("a", free_gib=1), "b": engine("b", free_gib=1, ready=False)}
    assert [a.request.req_id for a in q.admit(0.0, device(), engines)] == ["e1", "p0", "z"]


def test_walk_counts_the_prefill_of_requests_that_joined_mid_queue():
    # E and X join ahead of A without re-runs. Once E and A start, X (loading) must still start by
    # 2.8 s; Z (2.5 s) would end at 3.1 s, so it must wait.
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    for rid, model, tokens, slo in [("A", "a", 100, 10.0), ("E", "a", 500, 2.0), ("X", "b", 200, 3.0)]:
        q.push(request(rid, model, arrival=0.0, tokens=tokens, slo=slo))
        q.schedule(0.0)
    q.push(request("Z", "a", arrival=0.0, tokens=2500, slo=20.0))
    assert q.stats["middle_inserts"] == 2
    engines = {"a": engine("a", free_gib=1), "b": engine("b", free_gib=1, ready=False)}
    assert [a.request.req_id for a in q.admit(0.0, device(), engines)] == ["E", "A"]


def test_time_can_pass_only_as_far_as_the_tightest_margin_after_a_mid_queue_arrival():
    # X joins between A and B without a re-run and takes 0.3 s of B's slack: B now fails once the
    # start time passes 0.79 s (not 0.89 s, the limit before X counted)
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    for rid, tokens, slo in [("A", 10, 1.0), ("B", 500, 1.6), ("X", 300, 1.2)]:
        q.push(request(rid, arrival=0.0, tokens=tokens, slo=slo))
        q.schedule(0.0)
    assert q.stats["middle_inserts"] == 1
    assert [r.req_id for r in q.schedule(0.85)] == ["A", "X"]
    assert [r.req_id for r in q.deferred(0.85)] == ["B"]


def test_deferred_requests_do_not_hold_back_others():
    # A (model c, no engine) is dropped when B arrives; B stays on time even if X starts first, so
    # A's small margin must not stop X
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    for rid, model, tokens, slo in [("A", "c", 800, 1.0), ("B", "c", 400, 1.1), ("X", "a", 500, 10.0)]:
        q.push(request(rid, model, arrival=0.0, tokens=tokens, slo=slo))
    assert [r.req_id for r in q.deferred(0.0)] == ["A"]
    assert [a.request.req_id for a in q.admit(0.0, device(), {"a": engine("a", free_gib=1)})] == ["X"]


def test_fast_paths_are_used_on_a_steady_stream():
    # two arrivals per admit, one dispatch per admit: the queue grows to 150 and every request is
    # on time, so the schedule should be extended and consumed without recomputing it
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    now = 0.0
    dev = device()
    one_slot = {"a": engine("a", free_gib=50, max_seqs=1)}
    for i in range(150):
        for j in range(2):
            q.push(request(f"r{i}.{j}", arrival=now, tokens=1 + (i * 37 + j) % 5, slo=2.0))
        now += 0.005
        assert len(q.admit(now, dev, one_slot)) == 1
    assert len(q) == 150 and not q.deferred(now) and not q.late(now)
    assert q.stats["fast_appends"] == 298  # the first two go through the initial full run
    assert q.stats["fast_dispatches"] == 150
    assert q.stats["replans"] == 1


def test_dispatch_follows_deadlines_across_models():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    q.push(request("loose", "a", arrival=0.0, tokens=10, slo=5.0))
    q.push(request("tight", "b", arrival=0.0, tokens=10, slo=0.5))
    out = q.admit(0.0, device(), {m: engine(m, free_gib=10) for m in "ab"})
    assert [a.request.req_id for a in out] == ["tight", "loose"]
    assert all(isinstance(a, Dispatch) and a.device == "d0" for a in out)


def test_dispatches_only_what_the_engine_can_start_now():
    q = DeadlineQueue("d0", reserve_tokens=100)
    for i in range(5):
        q.push(request(f"r{i}", arrival=0.0, tokens=999, slo=10.0))
    # 1 KiB/token: each request needs 1000 tokens of KV plus the 100-token reserve must stay free
    room = 3 * 1000 * 1024 + 100 * 1024
    dev = device(cap_gib=1, mapped_gib=1)  # no shared memory: only the engine's own free KV counts
    out = q.admit(0.0, dev, {"a": engine("a", free_gib=room / GIB)})
    assert len(out) == 3 and len(q) == 2
    out = q.admit(0.0, dev, {"a": engine("a", free_gib=room / GIB, max_seqs=1, running=1)})
    assert out == []
    out = q.admit(0.0, dev, {"a": engine("a", free_gib=room / GIB, ready=False)})
    assert out == []


def test_shared_memory_goes_to_the_earliest_deadline_first():
    q = DeadlineQueue("d0")
    q.push(request("big", "a", arrival=0.0, tokens=2000, slo=1.0))
    q.push(request("small", "b", arrival=0.0, tokens=10, slo=2.0))
    dev = device(cap_gib=1, mapped_gib=1 - 1024 * 1024 / GIB)  # 1 MiB shared: "big" needs ~2 MiB
    out = q.admit(0.0, dev, {m: engine(m) for m in "ab"})
    assert out == [], "'small' must not take the memory 'big' is waiting for"
    # with its own free KV, 'small' does not touch the shared pool and may start
    out = q.admit(0.0, dev, {"a": engine("a"), "b": engine("b", free_gib=0.01)})
    assert [a.request.req_id for a in out] == ["small"]


def test_waiting_engine_does_not_block_others_unless_its_deadline_would_slip():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    q.push(request("first", "a", arrival=0.0, tokens=100, slo=0.5))  # deadline 0.5, prefill 0.1
    q.push(request("second", "b", arrival=0.0, tokens=300, slo=1.0))  # prefill 0.3: first still ends by 0.4
    q.push(request("third", "b", arrival=0.0, tokens=200, slo=1.0))  # another 0.2 would end first at 0.6
    engines = {"a": engine("a", free_gib=1, ready=False), "b": engine("b", free_gib=1)}
    out = q.admit(0.0, device(), engines)
    assert [a.request.req_id for a in out] == ["second"]
    out = q.admit(0.0, device(), {"a": engine("a", free_gib=1), "b": engine("b", free_gib=1)})
    assert [a.request.req_id for a in out] == ["first", "third"]


def test_a_request_started_early_never_makes_a_waiting_one_late():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    q.push(request("x", "b", arrival=0.0, tokens=100, slo=0.5))  # must start by 0.4
    q.push(request("y", "a", arrival=0.0, tokens=200, slo=1.0))
    q.push(request("z", "a", arrival=0.0, tokens=300, slo=1.0))
    engines = {"a": engine("a", free_gib=1, max_seqs=1), "b": engine("b", free_gib=1, ready=False)}
    assert [a.request.req_id for a in q.admit(0.0, device(), engines)] == ["y"]  # x can still start at 0.2
    assert q.admit(0.0, device(), engines) == [], "z (0.3 s) would push x's start past 0.4"
    assert [r.req_id for r in q.schedule(0.0)] == ["x", "z"]


def test_dropped_requests_are_deferred_not_lost():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    q.push(request("long", arrival=0.0, tokens=800, slo=1.0))
    q.push(request("s1", arrival=0.0, tokens=300, slo=1.0))
    q.push(request("s2", arrival=0.0, tokens=300, slo=1.0))
    assert [r.req_id for r in q.schedule(0.0)] == ["s1", "s2"]
    assert [r.req_id for r in q.deferred(0.0)] == ["long"]
    one_slot = {"a": engine("a", free_gib=1, max_seqs=1)}
    assert [a.request.req_id for a in q.admit(0.0, device(), one_slot)] == ["s1"]
    assert [a.request.req_id for a in q.admit(0.0, device(), one_slot)] == ["s2"]
    # 'long' cannot finish by 1.0 after both (0.6 + 0.8): it is now late, and served on the slack
    assert [r.req_id for r in q.late(0.0)] == ["long"]
    assert [a.request.req_id for a in q.admit(0.0, device(), one_slot)] == ["long"]
    assert len(q) == 0


def test_abort_on_miss_rejects_with_a_clear_reason():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED, abort_on_miss=True)
    q.push(request("long", arrival=0.0, tokens=800, slo=1.0))
    q.push(request("s1", arrival=0.0, tokens=300, slo=1.0))
    q.push(request("s2", arrival=0.0, tokens=300, slo=1.0))
    q.push(request("hopeless", arrival=0.0, tokens=3000, slo=1.0))
    out = q.admit(0.0, device(), {"a": engine("a", free_gib=1, max_seqs=0)})
    rejected = {a.request.req_id: a for a in out if isinstance(a, Reject)}
    assert set(rejected) == {"long", "hopeless"}
    assert all(a.reason is RejectReason.DEADLINE_MISS and "deadline" in a.detail for a in rejected.values())
    assert {r.req_id for r in q.requests()} == {"s1", "s2"}


def test_prompt_that_can_never_fit_is_rejected():
    q = DeadlineQueue("d0")
    q.push(request("huge", tokens=10_000))
    out = q.admit(0.0, device(), {"a": engine("a", free_gib=1, max_kv=1000 * 1024)})
    assert len(out) == 1 and out[0].reason is RejectReason.PROMPT_TOO_LONG
    assert len(q) == 0


def test_reported_speed_changes_prefill_times():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=1000.0)
    q.push(request("x", arrival=0.0, tokens=1500, slo=1.0))  # 1.5 s at the default speed: late
    assert q.schedule(0.0) == []
    q.admit(0.0, device(), {"a": engine("a", max_seqs=0, speed=3000.0)})  # 0.5 s at the engine's speed
    assert [r.req_id for r in q.schedule(0.0)] == ["x"]


def test_busy_until_counts_dispatched_prefills():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    q.push(request("x", arrival=0.0, tokens=400, slo=1.0))
    q.admit(0.0, device(), {"a": engine("a", free_gib=1)})
    assert q.start_ns(0.0) == 400 * NS // 1000
    assert q.start_ns(1.0) == NS


def test_queue_bookkeeping():
    q = DeadlineQueue("d0")
    q.push(request("x", "a"))
    q.push(request("y", "b"))
    with pytest.raises(DuplicateRequestError):
        q.push(request("x", "a"))
    assert "x" in q and len(q) == 2 and set(q.models()) == {"a", "b"}
    assert q.cancel("x") and not q.cancel("x")
    assert q.models() == ("b",) and len(q) == 1


def test_a_cached_prefix_shortens_the_prefill_the_schedule_counts_but_not_the_memory_it_needs():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    # 1,500 tokens take 1.5 s: past a 1 s deadline, so the whole prompt is late...
    q.push(request("whole", arrival=0.0, tokens=1500, slo=1.0))
    assert q.schedule(0.0) == [] and [r.req_id for r in q.late(0.0)] == ["whole"]
    # ...while the same prompt with 1,024 tokens cached on its replica prefills 476 of them: on time
    hit = replace(request("hit", arrival=0.0, tokens=1500, slo=1.0), cached_tokens=1024)
    assert hit.prefill_tokens == 476
    q.push(hit)
    assert [r.req_id for r in q.schedule(0.0)] == ["hit"] and [r.req_id for r in q.late(0.0)] == ["whole"]
    one_slot = {"a": engine("a", free_gib=1, max_seqs=1)}
    assert [a.request.req_id for a in q.admit(0.0, device(), one_slot)] == ["hit"]
    assert q.start_ns(0.0) == 476 * NS // 1000  # the queue is busy for the uncached part only
    # memory is still counted on the whole prompt (cached blocks may be gone by the time it runs):
    # room for 1,000 tokens of KV holds its 476 uncached tokens but not the prompt
    q2 = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    q2.push(replace(hit, req_id="hit2"))
    tight = {"a": engine("a", free_gib=1000 * 1024 / GIB)}
    assert q2.admit(0.0, device(cap_gib=1, mapped_gib=1), tight) == []
    assert [a.request.req_id for a in q2.admit(0.0, device(), {"a": engine("a", free_gib=1)})] == ["hit2"]


def dispatch_one(q: DeadlineQueue, req_id: str, tokens: int, now: float = 0.0) -> None:
    q.push(request(req_id, arrival=now, tokens=tokens, slo=1.0))
    out = q.admit(now, device(), {"a": engine("a", free_gib=1, speed=SPEED)})
    assert [a.request.req_id for a in out if isinstance(a, Dispatch)] == [req_id]


def test_first_tokens_later_than_predicted_tighten_the_deadlines_the_schedule_checks():
    """The schedule predicted x's first token at 0.1 s (100 tokens at 1000/s); it came at 0.4 s. A
    request the plain check keeps (0.8 s of prefill from 0.4 s, due at 1.4 s) is now late: its
    checked deadline is 0.3 s earlier."""
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    dispatch_one(q, "x", 100)
    q.push(request("y", arrival=0.4, tokens=800, slo=1.0))
    assert [r.req_id for r in q.schedule(0.4)] == ["y"]
    q.first_token("x", 0.4)
    assert q.margin_ns("a") == to_ns(0.3)
    assert q.schedule(0.4) == [] and [r.req_id for r in q.late(0.4)] == ["y"]
    q.first_token("x", 9.0)  # reported twice (by the body, then at leave): counted once
    assert q.margin_ns("a") == to_ns(0.3)


def test_the_margin_is_a_high_quantile_of_recent_lateness_never_negative_and_at_most_half_the_slo():
    q = DeadlineQueue("d0", default_prefill_tokens_per_s=SPEED)
    dispatch_one(q, "early", 100)
    q.first_token("early", 0.05)  # before the prediction: no margin
    assert q.margin_ns("a") == 0
    dispatch_one(q, "slow", 100, now=1.0)
    q.first_token("slow", 1.0 + 0.1 + 5.0)  # 5 s late
    assert q.margin_ns("a") == to_ns(5.0)
    q.push(request("z", arrival=1.2, tokens=100, slo=1.0))
    # the margin takes at most half of z's 1 s SLO: 0.1 s of prefill from 1.2 s meets 1.7 s
    assert [r.req_id for r in q.schedule(1.2)] == ["z"]
    assert q.cancel("z")
    # the window forgets: after enough punctual first tokens the 5 s is out of its top tenth
    for i in range(9):
        dispatch_one(q, f"p{i}", 10, now=2.0 + i)
        q.first_token(f"p{i}", 2.0 + i + 0.01)  # 10 tokens: predicted at 10 ms
    assert q.margin_ns("a") == 0
    q.first_token("never", 3.0)  # not dispatched here: ignored
    dispatch_one(q, "gone", 10, now=20.0)
    q.first_token("gone", None)  # left without a first token: forgotten, nothing learned
    assert q.margin_ns("a") == 0 and not q._promised
