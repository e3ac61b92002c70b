"""Each baseline's defining behaviour: dedicated, static-partition, muxserve, qlm."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.control import (
    Activate,
    Defer,
    Dispatch,
    Enqueue,
    Evict,
    FifoQueue,
    GroupQueue,
    Migrate,
    Reject,
    RejectReason,
    RoundRobinQueue,
    SetKVQuota,
    get_policy,
)
from prism_serve.control.policies.muxserve import mesh_groups
from prism_serve.control.policies.static_partition import _expected_demand
from tests.control.factories import GIB, apply, cluster, device, engine, model, request

NOW = 1000.0
MOVES = (Evict, Migrate)


# -- dedicated ---------------------------------------------------------------------------------------


def test_dedicated_gives_each_model_its_own_devices_most_demanding_first():
    models = [model("low", rate=1), model("high", rate=9), model("tp", rate=5, tp=2), model("late", rate=0.1)]
    c = cluster(models, {f"d{i}": 80 for i in range(4)})
    p = get_policy("dedicated")
    out = p.place(c, NOW)
    assert out == [Activate("high", ("d0",)), Activate("tp", ("d1", "d2")), Activate("low", ("d3",))]
    after = apply(c, out)
    assert all(len(dev.models) == 1 for dev in after.devices.values()), "no device is shared"
    (rej,) = p.on_request(request("r", "late"), after, NOW)
    assert isinstance(rej, Reject) and rej.reason is RejectReason.NO_CAPACITY
    assert p.on_request(request("r", "tp"), after, NOW) == [Enqueue(request("r", "tp"), "d1")]


def test_dedicated_defers_until_its_first_placement_and_never_evicts():
    c = cluster([model("a"), model("b")], {"d0": 80, "d1": 80})
    p = get_policy("dedicated")
    assert isinstance(p.on_request(request("r", "a"), c, NOW)[0], Defer)
    placed = apply(c, p.place(c, NOW))
    idle_and_tight = cluster([model("a", on=("d0",), last=0.0)], {"d0": 80}, mapped={"d0": 80})
    assert p.place(placed, NOW) == [] and p.place(idle_and_tight, NOW) == []


def test_dedicated_admits_in_arrival_order_not_deadline_order():
    q = get_policy("dedicated").new_queue("d0")
    assert isinstance(q, FifoQueue)
    q.push(request("first", arrival=0.0, slo=10.0))
    q.push(request("urgent", arrival=0.1, slo=0.1))
    out = q.admit(1.0, device(), {"a": engine("a", free_gib=1, max_seqs=1)})
    assert [a.request.req_id for a in out] == ["first"]


# -- static-partition --------------------------------------------------------------------------------


def test_static_partition_splits_memory_into_fixed_slices():
    models = [model("a", weight_gib=20), model("b", weight_gib=10), model("c", weight_gib=30)]
    c = cluster(models, {"d0": 80, "d1": 80})
    p = get_policy("static-partition", shares=(("a", 3.0),))
    out = p.place(c, NOW)
    acts = {a.model: a.devices for a in out if isinstance(a, Activate)}
    assert acts == {"c": ("d0",), "a": ("d1",), "b": ("d1",)}  # largest first, on the emptiest device
    quotas = {(a.model, a.device): a.quota_bytes for a in out if isinstance(a, SetKVQuota)}
    assert quotas[("c", "d0")] == 50 * GIB
    # d1 has 50 GiB after weights: each model its floor (its longest request), the rest split 3:1
    # between a and b (same KV per token, so the same need)
    floor = p.floor_bytes(c.models["a"])
    assert floor == (2048 + 256) * 128 * 1024, "the engines' default context plus the reserve"
    above = 50 * GIB - 2 * floor
    assert quotas[("a", "d1")] == floor + int(above * 0.75) and quotas[("b", "d1")] == floor + int(
        above * 0.25
    )
    assert p.place(apply(c, out), NOW) == [], "slices never change and nothing moves"


def test_static_partition_packs_again_only_when_what_it_packs_from_changes():
    # a (40 GiB) and b (50 GiB) cannot share the device: one is left out, and every request of it
    # asks place() whether a packing would take it (on_request), on snapshot after snapshot
    from dataclasses import replace

    p = get_policy("static-partition", rates=(("a", 1.0), ("b", 2.0)))
    packings = []
    compute = p._packing
    p._packing = lambda c: packings.append(c) or compute(c)
    c = apply(cluster([model("a", weight_gib=40), model("b", weight_gib=50)], {"d0": 80}), [])
    first = p.place(c, NOW)
    placed = [a.model for a in first if isinstance(a, Activate)]
    assert len(placed) == 1
    out = ({"a", "b"} - set(placed)).pop()
    c = apply(c, first)
    left_out = p.place(c, NOW)
    assert left_out == [] and len(packings) == 2
    # the same models and devices along the snapshots' chain: the last packing, not a new one,
    # though the measured rates moved (the packing reads the knobs' rates, not those)
    later = c.updated([replace(c.models["a"], rate=7.0), replace(c.models["b"], rate=0.1)])
    assert p.place(later, NOW) == left_out and p.place(later, NOW + 5) == [] and len(packings) == 2
    assert compute(later) == left_out  # what packing anew gives
    # a change it packs from (the left-out model's weights, now small enough) is packed anew
    changed = later.updated([replace(later.models[out], weight_bytes=10 * GIB)])
    now_placed = [(a.model, a.devices) for a in p.place(changed, NOW) if isinstance(a, Activate)]
    assert now_placed == [(out, ("d0",))]
    assert len(packings) == 3
    # and so is the same snapshot for a policy with other knobs
    other = get_policy("static-partition", rates=(("a", 1.0), ("b", 3.0)))
    other._packing = lambda c: packings.append(c) or compute(c)
    other.place(later, NOW)
    assert len(packings) == 4


def test_static_partition_gives_every_slice_room_for_its_longest_request():
    # d0 holds "big"'s weights with 6 GiB to spare, but its longest request needs 8 GiB of KV: a
    # slice that could never start it would block its queue for good, so it goes to d1 only
    models = [model("big", weight_gib=60, kvpt=1024 * 1024), model("small", weight_gib=30, kvpt=64 * 1024)]
    longest = (("big", 8192 - 256),)  # with the 256-token reserve: 8 GiB
    p = get_policy("static-partition", longest=longest, min_kv_fraction=0.01)
    c = cluster(models, {"d0": 66, "d1": 70})
    acts = {a.model: a.devices for a in p.place(c, NOW) if isinstance(a, Activate)}
    assert acts == {"big": ("d1",), "small": ("d0",)}
    # where it fits only beside a light model, the split follows need: floor plus KV per token
    two = [model("big", weight_gib=20, kvpt=1024 * 1024), model("small", weight_gib=20, kvpt=64 * 1024)]
    pair = cluster(two, {"d0": 80})
    out = get_policy("static-partition", longest=longest).place(pair, NOW)
    quotas = {a.model: a.quota_bytes for a in out if isinstance(a, SetKVQuota)}
    assert quotas["big"] >= 8 * GIB and quotas["big"] > 10 * quotas["small"]
    assert sum(quotas.values()) <= 40 * GIB
    # and a device that cannot hold every member's floor takes no more models
    crowded = cluster([model(f"m{i}", weight_gib=10, kvpt=1024 * 1024) for i in range(7)], {"d0": 80})
    placed = [a for a in get_policy("static-partition").place(crowded, NOW) if isinstance(a, Activate)]
    # 6 x (10 GiB + 2.25 GiB floor) fit in 80 GiB; a seventh's weights would fit too, its floor not
    assert len(placed) == 6


def test_static_partition_sized_for_the_expected_traffic_balances_compute_across_devices():
    # two hot models of 10 GiB and two cold ones of 30 GiB: by memory alone (worst fit) each device
    # takes one large and one small model, and which small one goes where is an accident of the
    # order; with the rates, the two hot models never share a device
    models = [
        model(n, weight_gib=w, rate=0.0) for n, w in (("big1", 30), ("big2", 30), ("hot1", 10), ("hot2", 10))
    ]
    c = cluster(models, {"d0": 80, "d1": 80})
    rates = (("big1", 0.01), ("big2", 0.01), ("hot1", 5.0), ("hot2", 5.0))
    p = get_policy("static-partition", rates=rates)
    out = p.place(c, NOW)
    acts = {a.model: a.devices for a in out if isinstance(a, Activate)}
    assert set(acts) == {"big1", "big2", "hot1", "hot2"}
    assert acts["hot1"] != acts["hot2"] and acts["big1"] != acts["big2"]
    assert p.place(apply(c, out), NOW) == [], "placed once"
    # three hot models on two devices: the lightest pair shares, whatever the model order
    three = [model(n, weight_gib=10, rate=0.0) for n in ("x", "y", "z")]
    for order in (("x", 0.5), ("y", 4.0), ("z", 3.0)), (("x", 4.0), ("y", 3.0), ("z", 0.5)):
        out = get_policy("static-partition", rates=order).place(cluster(three, {"d0": 80, "d1": 80}), NOW)
        acts = {a.model: a.devices for a in out if isinstance(a, Activate)}
        heaviest = max(order, key=lambda r: r[1])[0]
        assert [m for m in acts if acts[m] == acts[heaviest]] == [heaviest], order
    # memory still decides what fits: on 45 GiB devices a big model leaves room for one hot one
    tight = get_policy("static-partition", rates=rates).place(cluster(models, {"d0": 45, "d1": 45}), NOW)
    acts = {a.model: a.devices for a in tight if isinstance(a, Activate)}
    on = sorted(sorted(m for m, ds in acts.items() if d in ds) for d in ("d0", "d1"))
    assert on in (
        [["big1", "hot1"], ["big2", "hot2"]],
        [["big1", "hot2"], ["big2", "hot1"]],
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.floats(0.0, 8.0)), min_size=2, max_size=9),
    st.integers(1, 5),
    st.sampled_from(["demand", "memory"]),
)
def test_one_more_device_never_makes_the_static_packing_worse_by_its_own_measure(specs, n, packing):
    # (weights GiB, expected req/s) per model; the kept packing's key (models placed, then peak
    # demand) on n + 1 devices is at least as good as on n: the extra device may stay idle
    models = [model(f"m{i}", weight_gib=w, rate=0.0) for i, (w, _) in enumerate(specs)]
    rates = tuple((f"m{i}", r) for i, (_, r) in enumerate(specs))
    p = get_policy("static-partition", rates=rates, packing=packing, restarts=3)

    def key(devices: int):
        c = cluster(models, {f"d{i}": 80 for i in range(devices)})
        left = {d: 80 * GIB for d in c.devices}
        compute, kv = _expected_demand(c, dict(rates))
        return p._fewest_peak(c, list(c.models.values()), compute, kv, left, dict.fromkeys(c.devices, 0))[1]

    fewer, more = key(n), key(n + 1)
    assert more <= fewer, (fewer, more)


def test_the_simulator_provisions_static_partition_with_each_models_mean_rate():
    from prism_serve.control.policies import POLICIES

    assert POLICIES["static-partition"].provisioned_knobs({"a": 2.0, "b": 0.5}, {"a": 900, "b": 0}) == {
        "rates": (("a", 2.0), ("b", 0.5)),
        "longest": (("a", 900),),  # a model without requests keeps slice_tokens
    }
    assert all(POLICIES[n].provisioned_knobs({"a": 1.0}) == {} for n in POLICIES if n != "static-partition")


def test_static_partition_never_evicts_idle_models_under_pressure():
    models = [model("idle", on=("d0",), last=0.0), model("busy", on=("d0",), last=NOW, running=5)]
    c = cluster(models, {"d0": 80}, mapped={"d0": 80})
    assert get_policy("static-partition").place(c, NOW) == []


def test_static_partition_engine_cannot_borrow_beyond_its_slice():
    q = get_policy("static-partition", reserve_tokens=0).new_queue("d0")
    q.push(request("r", tokens=10_000))  # 10,001 tokens x 1 KiB ~ 9.8 MiB
    roomy_device = device(cap_gib=80)
    capped = {"a": engine("a", quota_gib=0.02, used_gib=0.015)}  # the slice holds it, once free
    assert q.admit(0.0, roomy_device, capped) == []
    out = q.admit(0.0, roomy_device, {"a": engine("a", quota_gib=0.02)})
    assert [type(a) for a in out] == [Dispatch]


def test_static_partition_refuses_a_request_its_slice_can_never_hold_and_serves_the_rest():
    # a slice never grows, so a head longer than the whole slice would block its engine for good
    q = get_policy("static-partition", reserve_tokens=256).new_queue("d0")
    q.push(request("long", tokens=9_000, arrival=0.0))  # (9,001 + 256) x 1 KiB > 9 MiB
    q.push(request("short", tokens=100, arrival=1.0))
    engines = {"a": engine("a", quota_gib=9 / 1024, used_gib=8 / 1024)}  # the slice is nearly full now
    out = q.admit(2.0, device(), engines)
    assert [(type(a), a.request.req_id) for a in out] == [(Reject, "long"), (Dispatch, "short")]
    assert out[0].reason is RejectReason.PROMPT_TOO_LONG and "slice" in out[0].detail
    # a quota that may grow (MuxServe's, prism's pools) only makes the request wait
    fifo = FifoQueue("d0", reserve_tokens=256)
    fifo.push(request("long", tokens=9_000))
    assert fifo.admit(2.0, device(), engines) == [] and len(fifo) == 1


# -- muxserve ----------------------------------------------------------------------------------------


def test_muxserve_places_by_estimated_throughput():
    # "tail" (30 req/s, 50 GiB) is placed first and leaves d0 with 30 GiB. "pop1" takes d1. Balancing
    # memory would put "pop2" on d1 too (60 GiB free against 20), but two 100 req/s models sharing
    # one pool serve less than "pop2" adds next to "tail", so the throughput estimate puts it on d0.
    models = [model("tail", rate=30, weight_gib=50), model("pop1", rate=100), model("pop2", rate=100)]
    out = get_policy("muxserve").place(cluster(models, {"d0": 80, "d1": 80}), NOW)
    where = {a.model: a.devices for a in out if isinstance(a, Activate)}
    assert where == {"tail": ("d0",), "pop2": ("d0",), "pop1": ("d1",)}
    quotas = {a.model: a.quota_bytes for a in out if isinstance(a, SetKVQuota) and a.device == "d0"}
    assert quotas["pop2"] == int(20 * GIB * 100 / 130) and quotas["tail"] == int(20 * GIB * 30 / 130), (
        "one pool per mesh, quotas proportional to rate-weighted KV need"
    )


def test_muxserve_breaks_ties_between_mesh_groups_by_capacity():
    # Before any request every rate is 0, so every group's estimated throughput is 0. Six devices cut
    # into two 2-device meshes (the first group enumerated) would leave the four single-device models
    # two devices; the group with one 2-device mesh gives them four, and more capacity.
    models = [model("big", rate=0, tp=2), *(model(f"m{i}", rate=0) for i in range(4))]
    out = get_policy("muxserve").place(cluster(models, {f"d{i}": 80 for i in range(6)}), NOW)
    where = {a.model: a.devices for a in out if isinstance(a, Activate)}
    assert len(where["big"]) == 2
    assert sorted(where[f"m{i}"] for i in range(4)) == [("d2",), ("d3",), ("d4",), ("d5",)]


def test_muxserve_adapts_quotas_from_idle_to_busy_models_and_never_moves_models():
    models = [model("idle", on=("d0",), last=0.0), model("busy", on=("d0",), last=NOW, running=8)]
    engines = [engine("idle", quota_gib=30, used_gib=1), engine("busy", quota_gib=30, used_gib=29)]
    c = cluster(models, {"d0": 80}, mapped={"d0": 80}, engines=engines)
    out = get_policy("muxserve", quota_step=0.5).place(c, NOW)
    assert not any(isinstance(a, MOVES) for a in out), "no eviction or migration, however idle"
    quotas = {a.model: a.quota_bytes for a in out}
    assert quotas["idle"] == 30 * GIB - int(0.5 * 29 * GIB)
    assert quotas["busy"] == 30 * GIB + int(0.5 * 29 * GIB)
    assert sum(quotas.values()) == 60 * GIB


def test_muxserve_admits_round_robin_across_models():
    q = get_policy("muxserve").new_queue("d0")
    assert isinstance(q, RoundRobinQueue)
    for i in range(3):
        q.push(request(f"a{i}", "a", arrival=i))
    for i in range(3):
        q.push(request(f"b{i}", "b", arrival=10 + i))
    out = q.admit(20.0, device(), {m: engine(m, free_gib=1) for m in "ab"})
    assert [a.request.req_id for a in out] == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_mesh_groups_cover_every_tp_size():
    groups = list(mesh_groups([f"d{i}" for i in range(4)], [1, 2], limit=10))
    assert groups == [[("d0", "d1"), ("d2",), ("d3",)]]  # at least one of each size, no room left
    assert len(list(mesh_groups([f"d{i}" for i in range(6)], [1, 2], limit=10))) == 2


# -- qlm ---------------------------------------------------------------------------------------------


def test_qlm_routes_new_groups_to_the_first_empty_queue_ignoring_loaded_models():
    models = [model("a", on=("d1",), last=NOW), model("b", last=0.0), model("tp", tp=2)]
    c = cluster(models, {"d0": 80, "d1": 80}, queued={"d0": ("x",)})
    p = get_policy("qlm")
    assert p.on_request(request("r", "b"), c, NOW) == [Enqueue(request("r", "b"), "d1")]
    assert p.on_request(request("r", "a"), c, NOW) == [Enqueue(request("r", "a"), "d1")]
    with_group = cluster(models, {"d0": 80, "d1": 80}, queued={"d0": ("b",)})
    assert p.on_request(request("r", "b"), with_group, NOW) == [Enqueue(request("r", "b"), "d0")]
    (rej,) = p.on_request(request("r", "tp"), c, NOW)
    assert isinstance(rej, Reject) and rej.reason is RejectReason.NO_CAPACITY


def test_qlm_swaps_whole_models_after_the_loaded_one_drains():
    p = get_policy("qlm")
    q = p.new_queue("d0")
    assert isinstance(q, GroupQueue)
    q.push(request("b1", "b"))
    loaded = device(models=("a",))
    assert p.admit(q, loaded, {"a": engine("a", running=2)}, NOW) == [], "a still has requests running"
    assert p.admit(q, loaded, {"a": engine("a", running=0)}, NOW) == [Evict("a"), Activate("b", ("d0",))]
    out = p.admit(q, device(models=("b",)), {"b": engine("b", free_gib=1)}, NOW)
    assert [a.request.req_id for a in out] == ["b1"]


def test_qlm_serves_groups_fifo_and_batches_without_a_reserve():
    p = get_policy("qlm", max_group_size=2)
    q = p.new_queue("d0")
    for rid, m in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("a4", "a")]:
        q.push(request(rid, m))
    assert [m for m in q.group_models()] == ["a", "a", "b", "a"]
    dev = device(models=("a",), cap_gib=1, mapped_gib=1)
    # exactly three requests' KV (101 tokens x 1 KiB each) and no reserve: all three start
    out = p.admit(q, dev, {"a": engine("a", free_gib=3 * 101 * 1024 / GIB)}, NOW)
    assert [a.request.req_id for a in out] == ["a1", "a2", "a3"]
    # the b group is next: a4 waits behind it although a is loaded
    assert p.admit(q, dev, {"a": engine("a", free_gib=1)}, NOW) == [Evict("a"), Activate("b", ("d0",))]
