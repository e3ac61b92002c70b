"""The baselines' queue orders: FIFO per engine, round-robin across models, FIFO request groups."""

from __future__ import annotations

from prism_serve.control import Dispatch, FifoQueue, GroupQueue, RejectReason, RoundRobinQueue
from tests.control.factories import GIB, device, engine, request


def ids(actions):
    return [a.request.req_id for a in actions]


def test_fifo_engines_do_not_block_each_other():
    q = FifoQueue("d0")
    q.push(request("a1", "a", arrival=0))
    q.push(request("b1", "b", arrival=1))
    q.push(request("a2", "a", arrival=2))
    out = q.admit(5.0, device(), {"a": engine("a", ready=False), "b": engine("b", free_gib=1)})
    assert ids(out) == ["b1"] and all(isinstance(a, Dispatch) for a in out)
    out = q.admit(5.0, device(), {"a": engine("a", free_gib=1), "b": engine("b", free_gib=1)})
    assert ids(out) == ["a1", "a2"] and len(q) == 0


def test_fifo_head_waiting_for_shared_memory_holds_it():
    q = FifoQueue("d0")
    q.push(request("big", "a", arrival=0, tokens=4000))
    q.push(request("small", "b", arrival=1, tokens=10))
    dev = device(cap_gib=1, mapped_gib=1 - 1 / 1024)  # 1 MiB shared; "big" needs ~4 MiB
    assert q.admit(5.0, dev, {"a": engine("a"), "b": engine("b")}) == []
    out = q.admit(5.0, dev, {"a": engine("a"), "b": engine("b", free_gib=1 / 1024)})
    assert ids(out) == ["small"], "its own free KV is not the memory 'big' waits for"


def test_fifo_rejects_prompts_that_can_never_fit_and_supports_cancel():
    q = FifoQueue("d0")
    q.push(request("huge", tokens=10_000))
    q.push(request("ok", tokens=10))
    q.push(request("gone", tokens=10))
    assert q.cancel("gone") and not q.cancel("gone")
    out = q.admit(0.0, device(), {"a": engine("a", free_gib=1, max_kv=1000 * 1024)})
    assert out[0].reason is RejectReason.PROMPT_TOO_LONG and ids(out) == ["huge", "ok"]


def test_round_robin_pointer_carries_across_calls():
    q = RoundRobinQueue("d0")
    for m in "abc":
        for i in range(2):
            q.push(request(f"{m}{i}", m, arrival=i))
    one_slot = {m: engine(m, free_gib=1, max_seqs=1) for m in "abc"}
    assert ids(q.admit(0.0, device(), one_slot)) == ["a0", "b0", "c0"]
    only_b_and_c = {"a": engine("a", ready=False), **{m: engine(m, free_gib=1) for m in "bc"}}
    assert ids(q.admit(0.0, device(), only_b_and_c)) == ["b1", "c1"]
    assert ids(q.admit(0.0, device(), one_slot)) == ["a1"]


def test_group_queue_groups_consecutive_requests_and_seals_a_group_in_service():
    q = GroupQueue("d0", max_group_size=3)
    for rid, m in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("b2", "b"), ("b3", "b"), ("b4", "b")]:
        q.push(request(rid, m))
    assert list(q.group_models()) == ["a", "b", "b"] and q.head_model() == "a"
    two = 2 * 101 * 1024 / GIB
    dev = device(cap_gib=1, mapped_gib=1)
    assert ids(q.admit(0.0, dev, {"a": engine("a", free_gib=two)})) == ["a1", "a2"]
    assert q.head_model() == "b"
    assert ids(q.admit(0.0, dev, {"b": engine("b", free_gib=two)})) == ["b1", "b2"]
    q.push(request("b5", "b"))  # joins the open tail group [b4], not the head group [b3]
    assert list(q.group_models()) == ["b", "b"] and [r.req_id for r in q.requests()] == ["b3", "b4", "b5"]
    assert q.cancel("b3") and ids(q.admit(0.0, dev, {"b": engine("b", free_gib=1)})) == ["b4", "b5"]


def test_a_group_in_service_takes_no_newcomers():
    q = GroupQueue("d0", max_group_size=8)
    q.push(request("a1"))
    q.push(request("a2"))
    one = 101 * 1024 / GIB
    assert ids(q.admit(0.0, device(cap_gib=1, mapped_gib=1), {"a": engine("a", free_gib=one)})) == ["a1"]
    q.push(request("a3"))  # [a2] is being served: a3 starts the next group, so other models get a turn
    q.push(request("b1", "b"))
    assert list(q.group_models()) == ["a", "a", "b"]
