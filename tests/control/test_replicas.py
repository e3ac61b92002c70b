"""Replicas of hot models (control/replicas.py and prism's scaling): the routing rule, the replica
count prism asks for as demand rises and falls, and the rules every placement keeps for replicas."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prism_serve.control import (
    Activate,
    ClusterSnapshot,
    DeviceBudget,
    EngineSnapshot,
    Evict,
    InvalidSnapshotError,
    ModelProfile,
    ModelState,
    Part,
    Request,
    get_policy,
    place_parts,
)
from prism_serve.control.eviction import is_idle
from prism_serve.control.replicas import (
    backlogged,
    misplaced,
    pick_replica,
    predicted_ttft,
    settled,
    surplus,
    wanted_replicas,
)
from prism_serve.control.types import replica_name

from .factories import GIB, cluster, model

CAPACITY = 10.0  # requests/s one replica serves (ModelProfile.max_rate)
DEVICES = {"d0": 40.0, "d1": 40.0, "d2": 40.0}


def hot(name: str = "m", *, k: int = 0, rate: float = 0.0, on=(), running: int = 0, queued: int = 0, **kw):
    """Replica ``k`` of served model ``name`` with a known capacity."""
    m = model(replica_name(name, k), rate=rate, on=on, running=running, queued=queued, **kw)
    profile = ModelProfile(busy_s_per_request=0.05, max_rate=CAPACITY)
    return replace(m, profile=profile, replica_of=name if k else None)


def request(model_name: str = "m", i: int = 0) -> Request:
    return Request(f"r{i}", model_name, 0.0, 100, 1.0)


def test_a_replica_slot_must_name_a_served_model_and_carry_its_name() -> None:
    with pytest.raises(InvalidSnapshotError, match="replica slots of"):
        replace(model("x#1"), replica_of="m")
    with pytest.raises(InvalidSnapshotError, match="not a served model here"):
        cluster([hot(k=1)], DEVICES)
    c = cluster([hot(), hot(k=1), hot(k=2)], DEVICES)
    assert c.replicas("m") == ("m", "m#1", "m#2")
    assert c.replicas("other") == ("other",)


def test_requests_go_to_the_replica_with_the_lowest_predicted_ttft() -> None:
    # both active; replica 0 has a long queue on its device, replica 1 none
    c = cluster(
        [hot(rate=5, on=("d0",), running=40), hot(k=1, rate=5, on=("d1",))],
        DEVICES,
        queued={"d0": ("m",) * 6},
    )
    assert predicted_ttft(c.models["m#1"], c) < predicted_ttft(c.models["m"], c)
    assert pick_replica(request("m"), c).model == "m#1"
    # a request already addressed to a replica is routed again by the same rule
    assert pick_replica(request("m#1"), c).model == "m#1"


def test_ties_go_to_the_lowest_slot_and_an_activating_replica_comes_last() -> None:
    c = cluster([hot(on=("d0",)), hot(k=1, on=("d1",))], DEVICES)
    assert pick_replica(request("m"), c).model == "m"
    loading = cluster(
        [hot(on=("d0",), running=200), hot(k=1, on=("d1",), state=ModelState.ACTIVATING)],
        DEVICES,
        queued={"d0": ("m",) * 50},
    )
    assert pick_replica(request("m"), loading).model == "m"


def test_without_a_resident_replica_requests_go_to_replica_0() -> None:
    c = cluster([hot(), hot(k=1)], DEVICES)
    assert pick_replica(request("m#1"), c).model == "m"
    assert pick_replica(request("unknown"), c).model == "unknown"


def test_the_replica_count_follows_demand_with_hysteresis() -> None:
    one = cluster([hot(rate=7, on=("d0",)), hot(k=1), hot(k=2)], DEVICES)
    assert wanted_replicas(one, "m", 0.8, 3) == 1  # 7 < 0.8 * 10
    hotter = cluster([hot(rate=9, on=("d0",)), hot(k=1), hot(k=2)], DEVICES)
    assert wanted_replicas(hotter, "m", 0.8, 3) == 2
    assert wanted_replicas(hotter, "m", 0.8, 1) == 1  # never more than the slots
    # two replicas at 6 req/s in all: one alone would run at 0.6 >= low 0.5, so both stay
    two = cluster([hot(rate=3, on=("d0",)), hot(k=1, rate=3, on=("d1",)), hot(k=2)], DEVICES)
    assert surplus(two, "m", 0.5) is None
    # at 4 req/s one replica would run at 0.4 < 0.5: the highest slot is surplus
    cooled = cluster([hot(rate=2, on=("d0",)), hot(k=1, rate=2, on=("d1",)), hot(k=2)], DEVICES)
    assert surplus(cooled, "m", 0.5).model == "m#1"
    # the surplus replica gets no new requests while another is resident
    assert get_policy("prism").pick_replica(request("m"), cooled, 0.0).model == "m"


def test_a_settled_model_is_one_resident_replica_with_nothing_to_scale() -> None:
    assert settled(cluster([hot(rate=7, on=("d0",)), hot(k=1), hot(k=2)], DEVICES), "m", 0.8)
    assert not settled(cluster([hot(rate=9, on=("d0",)), hot(k=1), hot(k=2)], DEVICES), "m", 0.8)
    assert not settled(cluster([hot(rate=1, on=("d0",), queued=1), hot(k=1), hot(k=2)], DEVICES), "m", 0.8)
    two = cluster([hot(rate=1, on=("d0",)), hot(k=1, rate=1, on=("d1",)), hot(k=2)], DEVICES)
    assert not settled(two, "m", 0.8)


@settings(max_examples=200, deadline=None)
@given(
    rates=st.lists(st.floats(0, 30), min_size=3, max_size=3),
    resident=st.lists(st.booleans(), min_size=3, max_size=3),
    queued=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    known=st.booleans(),
)
def test_settled_means_no_copy_more_and_none_fewer(rates, resident, queued, known) -> None:
    """What replica scaling skips on ``settled``: wanted_replicas says one and surplus says none."""
    models = [
        hot(k=k, rate=rates[k], on=(f"d{k}",) if resident[k] else (), queued=queued[k] if resident[k] else 0)
        for k in range(3)
    ]
    if not known:
        models = [replace(m, profile=ModelProfile()) for m in models]
    c = cluster(models, DEVICES)
    if settled(c, "m", 0.8):
        assert wanted_replicas(c, "m", 0.8, 3) == 1
        assert surplus(c, "m", 0.5) is None


@settings(max_examples=300, deadline=None)
@given(
    rates=st.lists(st.floats(0, 30), min_size=3, max_size=3),
    resident=st.lists(st.booleans(), min_size=3, max_size=3),
    queued=st.lists(st.sampled_from([0, 0, 0, 1]), min_size=3, max_size=3),  # mostly none
    known=st.lists(st.booleans(), min_size=3, max_size=3),
    waiting=st.lists(st.sampled_from([0, 0, 1, 2]), min_size=3, max_size=3),
)
@example(rates=[1.0, 0.0, 0.0], resident=[True, False, False], queued=[0, 0, 0], known=[True] * 3,
         waiting=[1, 0, 0])  # fmt: skip
def test_settled_read_from_the_entries_is_the_group_s_answer(rates, resident, queued, known, waiting) -> None:
    """``settled`` answers from the replicas' entries where no group is built yet; with the group
    built first (``replicas._group``, as another call of the same placement may) it answers from
    the group: both the same, whichever replicas are resident, queued, waiting in their engines, or
    know their capacity."""
    from prism_serve.control.replicas import _group

    models = [
        hot(k=k, rate=rates[k], on=(f"d{k}",) if resident[k] else (), queued=queued[k], running=waiting[k])
        for k in range(3)
    ]
    models = [m if known[k] else replace(m, profile=ModelProfile()) for k, m in enumerate(models)]
    engines = [
        EngineSnapshot(m.model, m.placement[0], 1024, num_running=waiting[k], num_waiting=waiting[k])
        for k, m in enumerate(models)
        if m.placement
    ]
    for high in (0.5, 0.8, 1.0):
        fresh, grouped = cluster(models, DEVICES, engines=engines), cluster(models, DEVICES, engines=engines)
        _group(grouped, "m")
        assert settled(fresh, "m", high) == settled(grouped, "m", high)
        assert ("group", "m") not in fresh.derived  # answered without building it


def test_prism_adds_a_replica_on_another_device_when_demand_exceeds_one() -> None:
    pol = get_policy("prism", prewarm=False)
    c = cluster([hot(rate=20, on=("d0",), running=8), hot(k=1), hot(k=2)], DEVICES)
    actions = pol.place(c, 100.0)
    adds = [a for a in actions if isinstance(a, Activate)]
    assert adds == [Activate("m#1", adds[0].devices)] and adds[0].devices[0] != "d0"
    # one per tick: with m#1 still activating nothing more happens
    c2 = cluster(
        [
            hot(rate=20, on=("d0",), running=8),
            hot(k=1, on=adds[0].devices, state=ModelState.ACTIVATING),
            hot(k=2),
        ],
        DEVICES,
    )
    assert not [a for a in pol.place(c2, 101.0) if isinstance(a, Activate)]
    # once it is active and demand still wants three, the third goes to the device left
    c3 = cluster(
        [hot(rate=12, on=("d0",), running=8), hot(k=1, rate=12, on=("d1",), running=8), hot(k=2)], DEVICES
    )
    assert [a for a in pol.place(c3, 102.0) if isinstance(a, Activate)] == [Activate("m#2", ("d2",))]


def test_prism_never_replicates_a_model_whose_capacity_is_unknown_or_that_is_evicted() -> None:
    pol = get_policy("prism", prewarm=False)
    unknown = [replace(m, profile=ModelProfile()) for m in (hot(rate=50, on=("d0",)), hot(k=1))]
    assert not [a for a in pol.place(cluster(unknown, DEVICES), 0.0) if isinstance(a, Activate)]
    evicted = cluster([hot(rate=50), hot(k=1)], DEVICES)
    assert not [a for a in pol.place(evicted, 0.0) if isinstance(a, Activate)]
    off = get_policy("prism", prewarm=False, max_replicas=1)
    assert off.replica_slots == 1


def test_prism_drops_a_surplus_replica_only_once_it_has_drained() -> None:
    pol = get_policy("prism", prewarm=False)
    busy = cluster([hot(rate=1, on=("d0",)), hot(k=1, rate=1, on=("d1",), running=2)], DEVICES)
    assert Evict("m#1") not in pol.place(busy, 100.0)
    drained = cluster([hot(rate=1, on=("d0",)), hot(k=1, rate=1, on=("d1",))], DEVICES)
    assert Evict("m#1") in pol.place(drained, 100.0)
    assert Evict("m") not in pol.place(drained, 100.0)


def test_algorithm_1_never_puts_two_replicas_of_a_model_on_one_device() -> None:
    budgets = [DeviceBudget("d0", 40 * GIB), DeviceBudget("d1", 40 * GIB)]
    parts = [
        Part("m", 0, 5.0, 10 * GIB, group="m"),
        Part("m#1", 0, 5.0, 10 * GIB, group="m"),
        Part("other", 0, 0.1, 10 * GIB),
    ]
    result = place_parts(parts, budgets, 0.05)
    assert result.placement("m", 1) != result.placement("m#1", 1)
    # with one device only one replica fits; the other is left out
    single = place_parts(parts, budgets[:1], 0.05)
    assert [single.placement(n, 1) for n in ("m", "m#1")].count(None) == 1


def test_snapshots_without_replicas_have_no_index() -> None:
    c = ClusterSnapshot.build([model("a")], [])
    assert c.extra_replicas == {} and c.replicas("a") == ("a",)


def test_prewarmed_memory_yields_first_and_other_idle_memory_after_the_threshold():
    prewarmed = replace(hot(on=("d0",)), prewarmed=True)
    assert is_idle(prewarmed, 1.0, 30.0)
    busy_prewarmed = replace(prewarmed, num_queued=1)
    assert not is_idle(busy_prewarmed, 1.0, 30.0)
    replica = hot(k=1, on=("d1",))
    assert not is_idle(replica, 1.0, 30.0) and is_idle(replica, 100.0, 30.0)


def _starving(replica_running: int = 0, waiting: int = 1) -> ClusterSnapshot:
    """Two full devices: m on d0 next to busy c, its second replica m#1 on d1 next to busy b, and w
    evicted with ``waiting`` requests queued; nothing is idle at t = 10, and d0 has a queue."""
    devices = {"d0": 25.0, "d1": 25.0}
    return cluster(
        [
            hot(rate=6, on=("d0",), running=2, last=9.0),  # 12 req/s of capacity 10 each: two wanted
            hot(k=1, rate=6, on=("d1",), running=replica_running, last=9.0),
            model("c", on=("d0",), running=1, last=9.0),
            model("b", on=("d1",), running=1, last=9.0),
            model("w", queued=waiting, last=9.0),
        ],
        devices,
        queued={"d0": ("r90", "r91")},  # requests queued at d0: m#1 is the one to predict a faster start
    )


def test_a_second_copy_of_a_model_yields_its_memory_to_a_model_with_none() -> None:
    pol = get_policy("prism", prewarm=False)
    c = _starving()
    assert c.starved == ("w",)
    actions = pol.place(c, 10.0)
    assert Evict("m#1") in actions and Activate("w", ("d1",)) in actions
    assert Evict("m") not in actions and Evict("b") not in actions and Evict("c") not in actions
    first = pol.on_request(request("w", 7), c, 10.0)
    assert first[:2] == [Evict("m#1"), Activate("w", ("d1",))]
    # with nothing waiting, both replicas stay and m#1, the less loaded, gets the next request
    calm = _starving(waiting=0)
    assert calm.starved == ()
    assert not [a for a in pol.place(calm, 10.0) if isinstance(a, Evict)]
    assert pol.pick_replica(request("m"), calm, 10.0).model == "m#1"


def test_a_busy_second_copy_drains_while_a_model_waits_with_none() -> None:
    pol = get_policy("prism", prewarm=False)
    c = _starving(replica_running=1)
    actions = pol.place(c, 10.0)
    assert not [a for a in actions if isinstance(a, Evict | Activate)]  # nothing evicted under a request
    assert pol.on_request(request("w", 7), c, 10.0)[0].__class__.__name__ == "Defer"
    # the router sends m#1 nothing new, so it drains and the next tick can take its memory
    assert pol.pick_replica(request("m"), c, 10.0).model == "m"
    assert pol.pick_replica(request("m"), _starving(replica_running=1, waiting=0), 10.0).model == "m#1"


def test_a_model_with_a_copy_resident_is_not_starved() -> None:
    """Requests queued on an evicted replica slot while another replica is resident are that
    replica's to serve: nothing yields for them."""
    c = cluster([hot(rate=2, on=("d0",)), hot(k=1, queued=1)], DEVICES)
    assert c.starved == ()


def test_a_replica_does_not_take_the_memory_of_a_model_the_forecast_expects() -> None:
    """Replica scaling evicts idle models for a second copy, but not one whose forecast expects a
    request within the prewarm horizon: its next request would wait for the second copy to drain."""
    pol = get_policy("prism", prewarm=False)
    devices = {"d0": 40.0, "d1": 20.0}

    def with_idle(forecast: float | None, rate: float = 0.0) -> ClusterSnapshot:
        idle = replace(model("x", rate=rate, on=("d1",), last=0.0), forecast_rate=forecast)
        return cluster([hot(rate=20, on=("d0",), running=8, last=99.0), hot(k=1), idle], devices)

    unexpected = pol.place(with_idle(None), 100.0)
    assert Evict("x") in unexpected and Activate("m#1", ("d1",)) in unexpected
    assert pol.place(with_idle(0.001), 100.0) == pol.place(with_idle(None), 100.0)  # 0.06 expected
    expected = pol.place(with_idle(0.1), 100.0)  # 6 requests expected in the next 60 s
    assert not [a for a in expected if isinstance(a, Evict | Activate)]
    # before its forecast has a complete window, a model's rate so far says it (8 a minute)
    assert pol.place(with_idle(None, rate=0.133), 100.0) == expected


def _burst(waiting: int, *, replica_waiting: int | None = None):
    """Replica 0 of ``m`` (60 s rate 1 req/s, far below its capacity) holding ``waiting`` requests
    its engine has not started; with ``replica_waiting`` a second replica is active on d1."""
    models = [hot(rate=1.0, on=("d0",), running=waiting), hot(k=1), hot(k=2)]
    engines = [EngineSnapshot("m", "d0", 1024, num_running=waiting, num_waiting=waiting)]
    if replica_waiting is not None:
        models[1] = hot(k=1, on=("d1",), running=replica_waiting)
        engines.append(
            EngineSnapshot("m#1", "d1", 1024, num_running=replica_waiting, num_waiting=replica_waiting)
        )
    return cluster(models, DEVICES, engines=engines)


def test_a_burst_its_replicas_cannot_absorb_wants_another_replica_whatever_the_rate() -> None:
    """The 60 s rate lags a burst; requests waiting in the engine make the predicted TTFT pass the
    SLO on every replica, and the model wants one replica more (prism activates it)."""
    calm, burst = _burst(0), _burst(40)
    assert predicted_ttft(burst.models["m"], burst) > 1.0 > predicted_ttft(calm.models["m"], calm)
    assert not backlogged(calm, "m") and wanted_replicas(calm, "m", 0.8, 3) == 1
    assert backlogged(burst, "m") and wanted_replicas(burst, "m", 0.8, 3) == 2
    actions = get_policy("prism", prewarm=False).place(burst, 100.0)
    assert [a for a in actions if isinstance(a, Activate)] == [Activate("m#1", ("d1",))]
    assert get_policy("prism", prewarm=False, max_replicas=1).place(burst, 100.0) == []
    # the new replica starts empty: the model is not backlogged on it, yet it is no surplus while
    # replica 0 still works the burst off, and new requests go to it
    both = _burst(40, replica_waiting=0)
    assert not backlogged(both, "m") and surplus(both, "m", 0.5) is None
    assert pick_replica(request("m"), both).model == "m#1"
    # once the burst is worked off the rate decides again: the second replica is surplus
    assert surplus(_burst(0, replica_waiting=0), "m", 0.5).model == "m#1"
    # backlogged on both: a third
    assert wanted_replicas(_burst(40, replica_waiting=40), "m", 0.8, 3) == 3


def _neighbour(name: str, on: tuple[str, ...], busy: float):
    """A model with requests running whose predicted busy fraction is ``busy``."""
    m = model(name, rate=1.0, on=on, running=2)
    return replace(m, profile=ModelProfile(busy_s_per_request=busy))


def test_a_busy_model_slowed_by_its_neighbours_moves_make_before_break() -> None:
    pol = get_policy("prism", prewarm=False)
    # m runs requests (Algorithm 1 cannot move it) next to a neighbour busy 0.8 of the time
    # (contention 5); d1 and d2 are free: a replica goes there, the old copy stays for now
    slowed = [hot(rate=2, on=("d0",), running=3), hot(k=1), _neighbour("n", ("d0",), 0.8)]
    actions = pol.place(cluster(slowed, DEVICES), 100.0)
    assert actions == [Activate("m#1", ("d1",))]
    off = get_policy("prism", prewarm=False, relocate_busy=False)
    assert off.place(cluster(slowed, DEVICES), 100.0) == []
    # once the new replica is active the old one is misplaced: it gets no requests, is evicted
    # once empty, and the new one is never the one to go
    moved = [hot(rate=2, on=("d0",), running=3), hot(k=1, on=("d1",)), _neighbour("n", ("d0",), 0.8)]
    c = cluster(moved, DEVICES)
    assert misplaced(c, "m", 2.0).model == "m"
    assert surplus(c, "m", 0.5).model == "m"
    assert pol.pick_replica(request("m"), c, 101.0).model == "m#1"
    assert not [a for a in pol.place(c, 101.0) if isinstance(a, Evict)]
    drained = cluster([replace(moved[0], num_running=0), *moved[1:]], DEVICES)
    assert [a for a in pol.place(drained, 102.0) if isinstance(a, Evict)] == [Evict("m")]


def test_a_busy_model_does_not_move_for_a_small_gain_or_when_two_copies_are_needed() -> None:
    pol = get_policy("prism", prewarm=False)
    # a neighbour busy 0.3 of the time slows it by 1.4x only
    light = [hot(rate=2, on=("d0",), running=3), hot(k=1), _neighbour("n", ("d0",), 0.3)]
    assert pol.place(cluster(light, DEVICES), 100.0) == []
    # every other device is as slow: the move would gain nothing
    everywhere = [
        hot(rate=2, on=("d0",), running=3),
        hot(k=1),
        *(_neighbour(f"n{i}", (d,), 0.8) for i, d in enumerate(DEVICES)),
    ]
    assert pol.place(cluster(everywhere, DEVICES), 100.0) == []
    # at 6 req/s of a capacity of 10 the pair would not be surplus: the replica scaling decides it
    needed = [hot(rate=6, on=("d0",), running=3), hot(k=1), _neighbour("n", ("d0",), 0.8)]
    assert pol.place(cluster(needed, DEVICES), 100.0) == []
    # within its migration cooldown it stays
    recent = [replace(light[0], placed_at=90.0), hot(k=1), _neighbour("n", ("d0",), 0.8)]
    assert pol.place(cluster(recent, DEVICES), 100.0) == []
    # ... a cooldown no longer than the history its placement was made on: placed 10 s ago with
    # 30 s of rate history, it stays; placed blind (right after start-up: a warm-up, the start-up
    # fill), it moves as soon as the rates say its neighbour slows it
    for history, moves in ((30.0, False), (5.0, True), (0.0, True), (None, False)):
        placed = [replace(recent[0], placed_history_s=history), *recent[1:]]
        assert (pol.place(cluster(placed, DEVICES), 100.0) == [Activate("m#1", ("d1",))]) is moves, history
    # two active replicas equally slowed: neither is misplaced, the highest slot is surplus as before
    both = [
        hot(rate=1, on=("d0",)),
        hot(k=1, rate=1, on=("d1",)),
        _neighbour("n0", ("d0",), 0.8),
        _neighbour("n1", ("d1",), 0.8),
    ]
    c = cluster(both, DEVICES)
    assert misplaced(c, "m", 2.0) is None
    assert surplus(c, "m", 0.5).model == "m#1"


def test_no_copy_for_a_burst_while_the_models_costs_are_unknown() -> None:
    """Live, a model's first requests queue behind its own activation with the default profile: the
    burst the predicted TTFT sees is the defaults', and a copy made then sat beside the busiest
    model. A cost known either way (measured busy seconds, or a capacity) lets the burst rule act."""
    unknown = _burst(40)
    unknown = replace(unknown.models["m"], profile=ModelProfile())
    c = cluster(
        [unknown, hot(k=1), hot(k=2)],
        DEVICES,
        engines=[EngineSnapshot("m", "d0", 1024, num_running=40, num_waiting=40)],
    )
    assert predicted_ttft(c.models["m"], c) > 1.0
    assert not backlogged(c, "m") and wanted_replicas(c, "m", 0.8, 3) == 1
    assert not [a for a in get_policy("prism", prewarm=False).place(c, 100.0) if isinstance(a, Activate)]
    for known in (ModelProfile(busy_s_per_request=0.05), ModelProfile(max_rate=CAPACITY)):
        c = cluster([replace(unknown, profile=known), hot(k=1), hot(k=2)], DEVICES,
                    engines=[EngineSnapshot("m", "d0", 1024, num_running=40, num_waiting=40)])  # fmt: skip
        assert backlogged(c, "m"), known


def test_a_copy_for_a_burst_goes_only_where_there_is_spare_compute_and_memory_now() -> None:
    pol = get_policy("prism", prewarm=False)

    def burst_with(neighbours, mapped=None):
        c = _burst(40)
        models = [*c.models.values(), *neighbours]
        engines = list(c.engines.values())
        return cluster(models, DEVICES, engines=engines, mapped=mapped)

    def added(c):
        return [a for a in pol.place(c, 100.0) if isinstance(a, Activate)]

    # d1 and d2 are busy 0.6 of the time: a copy there would run at under half speed, and the
    # burst is over before it pays; none is added
    busy = [_neighbour("n1", ("d1",), 0.6), _neighbour("n2", ("d2",), 0.6)]
    assert added(burst_with(busy)) == []
    # d2 quiet: the copy goes there
    assert added(burst_with(busy[:1])) == [Activate("m#1", ("d2",))]

    # a burst so heavy that half of it alone keeps a copy busy 0.6 of the time (the model's rate
    # still wants one replica): the copy still goes to the quiet d2, where only its own work slows
    # it; the spare-compute test is about the neighbours it would run beside, which are none there
    def heavy(c):
        m = c.models["m"]
        heavy_m = replace(m, profile=replace(m.profile, busy_s_per_request=1.2))
        return cluster([heavy_m, *(v for v in c.models.values() if v.model != "m")], DEVICES,
                       engines=list(c.engines.values()))  # fmt: skip

    assert added(heavy(burst_with(busy[:1]))) == [Activate("m#1", ("d2",))]
    assert added(heavy(burst_with(busy))) == []
    # beside light neighbours (busy 0.2) it goes too; but not beside the ranks of a TP model with
    # work: that model steps at its slowest rank's pace, and the copy would take the device past
    # half busy (0.2 + 0.6)
    light = [_neighbour("n1", ("d1",), 0.2), _neighbour("n2", ("d2",), 0.2)]
    assert added(heavy(burst_with(light))) == [Activate("m#1", ("d1",))]
    tp = replace(model("t", rate=1.0, tp=2, on=("d1", "d2"), running=2),
                 profile=ModelProfile(busy_s_per_request=0.2))  # fmt: skip
    assert added(heavy(burst_with([tp]))) == []

    # a model whose rate needs a second replica (busy 1.0 now, 0.5 per copy) gets one next to a
    # busy model only if that copy runs less contended than the model does now: not beside 0.6
    # (1.1 with it), but beside 0.3 (0.8)
    def with_rate(neighbours):
        return cluster(
            [replace(m, rate=20.0) if m.model == "m" else m for m in burst_with(neighbours).models.values()],
            DEVICES,
        )

    assert added(with_rate(busy)) == []
    assert added(with_rate([busy[0], _neighbour("n2", ("d2",), 0.3)])) == [Activate("m#1", ("d2",))]
    # d1 holds the weights on paper but its memory is full of KV now: not there (the activation
    # would wait for that KV to drain while its claim stops admission on d1)
    assert added(burst_with([], mapped={"d1": 39.5})) == [Activate("m#1", ("d2",))]


def test_a_busy_model_does_not_move_where_it_would_make_the_device_busier_than_it_leaves() -> None:
    pol = get_policy("prism", prewarm=False)
    heavy = replace(
        hot(rate=2, on=("d0",), running=3), profile=ModelProfile(busy_s_per_request=0.45, max_rate=CAPACITY)
    )
    # m (busy 0.9) next to a neighbour busy 0.8; d1's neighbours are busy 0.45 and d2's too: with m
    # there a device would be busy 1.35, against 1.7 now, not half the contention; it stays
    models = [heavy, hot(k=1), _neighbour("n", ("d0",), 0.8)]
    models += [_neighbour("n1", ("d1",), 0.45), _neighbour("n2", ("d2",), 0.45)]
    assert pol.place(cluster(models, DEVICES), 100.0) == []
    # with d2 quiet it moves there
    quiet = [*models[:4], _neighbour("n2", ("d2",), 0.05)]
    assert pol.place(cluster(quiet, DEVICES), 100.0) == [Activate("m#1", ("d2",))]


def test_a_busy_model_moves_before_its_capacity_is_known_and_the_old_copy_then_drains() -> None:
    """Live, a replica's capacity is unknown until its engine has batched enough to fit it; a model
    placed blind at start (the startup fill) must still be able to leave a contended device."""
    pol = get_policy("prism", prewarm=False)

    def unknown(m):
        return replace(m, profile=ModelProfile(busy_s_per_request=0.05))

    slowed = [unknown(hot(rate=2, on=("d0",), running=3)), unknown(hot(k=1)), _neighbour("n", ("d0",), 0.8)]
    assert pol.place(cluster(slowed, DEVICES), 100.0) == [Activate("m#1", ("d1",))]
    moved = [unknown(hot(rate=2, on=("d0",))), unknown(hot(k=1, on=("d1",))), _neighbour("n", ("d0",), 0.8)]
    c = cluster(moved, DEVICES)
    assert surplus(c, "m", 0.5).model == "m"
    assert Evict("m") in pol.place(c, 101.0)
    # without a misplaced copy nothing is surplus while the capacity is unknown (as before)
    even = [*moved[:2], _neighbour("n", ("d0",), 0.8), _neighbour("n1", ("d1",), 0.8)]
    assert surplus(cluster(even, DEVICES), "m", 0.5) is None


def test_a_light_busy_model_does_not_move_beside_an_engine_near_its_limit() -> None:
    """The live decode-heavy sweep: a model with a few requests a minute, slowed by four light
    neighbours, was moved beside the one engine near its limit and back, over and over."""
    pol = get_policy("prism", prewarm=False)
    light = hot(rate=2, on=("d0",), running=3)  # busy 2 x 0.05 = 0.1
    crowd = [_neighbour(f"n{i}", ("d0",), 0.3) for i in range(4)]  # 1.3 in sum: contention 50
    # d1 and d2 each hold one engine busy 0.7: with m there it would have work 0.7 x 1.1 = 0.77 of
    # the time, more than any engine on d0 now (0.3 x 2.0 = 0.6); contention alone (5 there against
    # 50) would move it
    models = [light, hot(k=1), *crowd, _neighbour("h1", ("d1",), 0.7), _neighbour("h2", ("d2",), 0.7)]
    assert pol.place(cluster(models, DEVICES), 100.0) == []
    # d2's engine busy 0.3: the move leaves every engine there below SAFE_LOAD, and it goes
    quiet = [*models[:-1], _neighbour("h2", ("d2",), 0.3)]
    assert pol.place(cluster(quiet, DEVICES), 100.0) == [Activate("m#1", ("d2",))]


def test_derived_values_are_per_snapshot_and_a_group_carries_only_while_its_replicas_are_the_same() -> None:
    from prism_serve.control.replicas import device_busy, group_rate, replica_capacity, resident_replicas

    c = cluster([hot(rate=4.0, on=("d0",)), hot(k=1, rate=2.0, on=("d1",)), hot(k=2)], DEVICES)
    first = resident_replicas(c, "m")
    assert [m.model for m in first] == ["m", "m#1"]
    first.clear()  # a caller's list is its own
    assert [m.model for m in resident_replicas(c, "m")] == ["m", "m#1"]
    assert group_rate(c, "m") == 6.0 and replica_capacity(c, "m") == CAPACITY
    busy = device_busy(c, "d0")
    assert busy == c.models["m"].busy > 0
    # the same snapshot with m#1 evicted and m's rate changed: derived afresh
    after = c.updated([hot(k=1), hot(rate=1.0, on=("d0",))], [replace(c.devices["d1"], models=())])
    assert after.derived == {}
    assert [m.model for m in resident_replicas(after, "m")] == ["m"]
    assert group_rate(after, "m") == 1.0 and device_busy(after, "d0") == after.models["m"].busy < busy
    assert group_rate(c, "m") == 6.0  # the first snapshot's stay as they were
    # a snapshot updated from another derives its own figures, but a replica group made of the very
    # same replica entries is the one the snapshot before it made (ClusterSnapshot.carried)
    d2 = after.devices["d2"]
    same = after.updated([], [replace(d2, mapped_bytes=d2.mapped_bytes + 1)])
    assert same.devices["d2"].mapped_bytes == d2.mapped_bytes + 1
    assert same.derived == {} and not hasattr(same, "kept")
    assert group_rate(same, "m") == 1.0 and same.derived[("group", "m")] is after.derived[("group", "m")]
    # one replica's entry changed (its queue): the group is made again
    queued = same.updated([replace(same.models["m"], num_queued=1)])
    assert group_rate(queued, "m") == 1.0
    assert queued.derived[("group", "m")] is not same.derived[("group", "m")]
    # a snapshot built afresh carries nothing
    fresh = ClusterSnapshot(same.models, same.devices, same.engines)
    assert fresh.carried == {} and group_rate(fresh, "m") == 1.0


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["a", "a#1", "b", "b#1", "c"]),
            st.sampled_from([(), ("d0",), ("d1",), ("d2",)]),
            st.sampled_from([0.0, 1.0, 7.0]),
            st.integers(0, 2),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_carried_replica_groups_equal_those_of_a_fresh_snapshot(steps) -> None:
    """Along a chain of updates (replicas moving, evicted, their rates and queues changing), every
    replica function of the chained snapshot answers as on a snapshot built afresh."""
    from prism_serve.control.replicas import (
        active_replicas,
        group_rate,
        replica_capacity,
        resident_replicas,
        yielding_replica,
    )

    def slot(name: str, on=(), rate: float = 0.0, queued: int = 0):
        base, _, k = name.partition("#")
        return hot(base, k=int(k or 0), rate=rate, on=on, queued=queued)

    models = {n: slot(n) for n in ("a", "a#1", "b", "b#1", "c")}
    snap = cluster(list(models.values()), DEVICES)
    for i, (name, on, rate, queued) in enumerate(steps):
        models[name] = slot(name, on, rate, queued if not on else 0)
        devices = [
            replace(snap.devices[d], models=tuple(n for n, m in models.items() if d in m.placement))
            for d in DEVICES
        ]
        for served in ("a", "b", "c"):  # read some groups before the change, so that some carry
            if (i + ord(served)) % 2:
                group_rate(snap, served)
        snap = snap.updated([models[name]], devices)
        fresh = ClusterSnapshot(snap.models, snap.devices, snap.engines)
        for served in ("a", "b", "c"):
            assert resident_replicas(snap, served) == resident_replicas(fresh, served)
            assert active_replicas(snap, served) == active_replicas(fresh, served)
            assert group_rate(snap, served) == group_rate(fresh, served)
            assert replica_capacity(snap, served) == replica_capacity(fresh, served)
            assert yielding_replica(snap, served) == yielding_replica(fresh, served)


# -- prefix-aware routing ---------------------------------------------------------------------------


def _long(arrival: float = 0.0) -> Request:
    """A 1,000-token prompt with a 1 s TTFT SLO (its prefix keys are the loop's business: routing
    reads only what each replica holds cached, ``cached``)."""
    return Request("p", "m", arrival, 1000, 1.0)


def _two(
    queued_d0: int = 2, queued_d1: int = 0, *, state1: ModelState = ModelState.ACTIVE
) -> ClusterSnapshot:
    """Replica 0 busier (a higher rate, ``queued_d0`` requests ahead on d0) than replica 1."""
    queued = {"d0": ("m",) * queued_d0, "d1": ("m",) * queued_d1}
    return cluster(
        [hot(rate=5, on=("d0",), running=4), hot(k=1, rate=1, on=("d1",), state=state1)],
        DEVICES,
        queued={d: q for d, q in queued.items() if q},
    )


def test_a_request_goes_to_the_replica_holding_its_longest_cached_prefix() -> None:
    c = _two()
    assert pick_replica(_long(), c).model == "m#1"  # no prefix known: the lowest predicted TTFT
    assert pick_replica(_long(), c, cached={"m": 960, "m#1": 0}, now=0.0).model == "m"
    assert pick_replica(_long(), c, cached={"m": 320, "m#1": 640}, now=0.0).model == "m#1"
    # nothing cached anywhere: the rule without prefixes
    assert pick_replica(_long(), c, cached={"m": 0, "m#1": 0}, now=0.0).model == "m#1"
    # the prediction prices only the uncached part of the prompt
    m = c.models["m"]
    assert predicted_ttft(m, c, 40) < predicted_ttft(m, c, 1000)
    assert predicted_ttft(m, c) == pytest.approx(predicted_ttft(m, c, m.profile.mean_prompt_tokens))
    # equal hits: the lower predicted TTFT, then the lower slot
    assert pick_replica(_long(), c, cached={"m": 640, "m#1": 640}, now=0.0).model == "m#1"
    even = cluster([hot(on=("d0",)), hot(k=1, on=("d1",))], DEVICES)
    assert pick_replica(_long(), even, cached={"m": 640, "m#1": 640}, now=0.0).model == "m"


def test_a_prefix_holder_that_would_miss_the_slo_loses_the_request_to_one_that_meets_it() -> None:
    swamped = _two(queued_d0=20)  # 20 prefills ahead of it on d0: over 1 s even with the hit
    hit = {"m": 960, "m#1": 0}
    assert predicted_ttft(swamped.models["m"], swamped, 40) > 1.0
    assert predicted_ttft(swamped.models["m#1"], swamped, 1000) < 1.0
    assert pick_replica(_long(), swamped, cached=hit, now=0.0).model == "m#1"
    # when no replica would meet it, the hit is worth the most: the holder keeps it
    both = _two(queued_d0=20, queued_d1=30)
    assert pick_replica(_long(), both, cached=hit, now=0.0).model == "m"
    # what is left of the SLO counts: routed again 0.8 s after its arrival, 0.2 s are left, which
    # the holder (about 0.21 s) misses and replica 1 (about 0.16 s) meets
    c = _two()
    assert predicted_ttft(c.models["m"], c, 40) > 0.2 > predicted_ttft(c.models["m#1"], c, 1000)
    assert pick_replica(_long(), c, cached=hit, now=0.0).model == "m"
    assert pick_replica(_long(), c, cached=hit, now=0.8).model == "m#1"


def test_a_prefix_holder_still_activating_comes_after_an_active_replica() -> None:
    c = _two(queued_d0=0, state1=ModelState.ACTIVATING)
    assert pick_replica(_long(), c, cached={"m": 0, "m#1": 960}, now=0.0).model == "m"


def test_a_surplus_replica_drains_whatever_prefixes_it_holds() -> None:
    cooled = cluster([hot(rate=2, on=("d0",)), hot(k=1, rate=2, on=("d1",)), hot(k=2)], DEVICES)
    assert surplus(cooled, "m", 0.5).model == "m#1"
    hit = {"m": 0, "m#1": 960, "m#2": 0}
    pol = get_policy("prism")
    assert pol.prefix_aware
    assert pol.pick_replica(_long(), cooled, 0.0, cached=hit).model == "m"
    # not surplus: the holder gets it; and with prefix awareness off the hit is ignored
    warm = cluster([hot(rate=4, on=("d0",)), hot(k=1, rate=4, on=("d1",)), hot(k=2)], DEVICES)
    assert surplus(warm, "m", 0.5) is None
    assert pol.pick_replica(_long(), warm, 0.0, cached=hit).model == "m#1"
    off = get_policy("prism", prefix_aware=False)
    assert not off.prefix_aware
    assert off.pick_replica(_long(), warm, 0.0, cached=hit).model == "m"
