"""The control loop (control/loop.py) driven with a fake body: the one suite for the rules the live
controller and the simulator share. Their own suites test only how they carry the effects out."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism_serve.control import (
    Activate,
    ClusterSnapshot,
    Defer,
    DeviceSnapshot,
    EngineSnapshot,
    Enqueue,
    Evict,
    Migrate,
    ModelSnapshot,
    ModelState,
    Reject,
    RejectReason,
    Request,
    get_policy,
)
from prism_serve.control.loop import ENGINE, ControlLoop, LoopStateError

GIB = 1 << 30
KVPT = 64 * 1024


@dataclass
class FakeModel:
    name: str
    weight: int
    state: ModelState = ModelState.EVICTED
    placement: tuple[str, ...] = ()
    running: dict[str, Request] = field(default_factory=dict)


class FakeBody:
    """Devices of ``cap_gib``; activations finish only when a test says so; engines have room for
    ``max_seqs`` requests. ``restart``: an eviction restarts what ran (the simulator), else the
    body refuses to evict a busy model, as a live worker does."""

    def __init__(self, models: dict[str, float], devices: dict[str, float], *, max_seqs: int = 2,
                 restart: bool = True) -> None:  # fmt: skip
        self.models = {n: FakeModel(n, int(w * GIB)) for n, w in models.items()}
        self.caps = {d: int(c * GIB) for d, c in devices.items()}
        self.max_seqs = max_seqs
        self.restart = restart
        self.paused = False  # engines report not ready (nothing can be admitted)
        self.loop: ControlLoop | None = None
        self.log: list[tuple] = []
        self.rejected: dict[str, RejectReason] = {}
        self.keep_alive: dict[str, float] = {}  # ModelSnapshot.keep_alive_s by model

    def _on(self, device: str) -> list[FakeModel]:
        return [m for m in self.models.values() if m.placement and device in m.placement]

    # -- the Body protocol --
    def cluster(self, now: float) -> ClusterSnapshot:
        loop = self.loop
        models = [
            ModelSnapshot(m.name, loop.rates.rate(m.name, now), 1.0, 0.1, m.weight, KVPT, 1, m.placement,
                          m.state, loop.rates.last_arrival(m.name), loop.num_queued[m.name], len(m.running),
                          replica_of=m.name.split("#")[0] if "#" in m.name else None,
                          forecast_rate=loop.forecast_rate(m.name, now),
                          prewarmed=m.state is not ModelState.EVICTED and m.name in loop.prewarmed,
                          keep_alive_s=self.keep_alive.get(m.name))
            for m in self.models.values()
        ]  # fmt: skip
        devices = [self._device(d) for d in self.caps]
        engines = [self._engine(m) for m in self.models.values() if m.state is not ModelState.EVICTED]
        return ClusterSnapshot.build(models, devices, engines)

    def _device(self, d: str) -> DeviceSnapshot:
        q = self.loop.queues[d]
        on = self._on(d)
        return DeviceSnapshot(d, self.caps[d], sum(m.weight for m in on), tuple(m.name for m in on),
                              len(q), q.models())  # fmt: skip

    def _engine(self, m: FakeModel) -> EngineSnapshot:
        free = self.caps[m.placement[0]] - sum(x.weight for x in self._on(m.placement[0]))
        return EngineSnapshot(m.name, m.placement[0], KVPT, m.state is ModelState.ACTIVE and not self.paused,
                              free, 0, None,
                              free, len(m.running), self.max_seqs, 10_000.0)  # fmt: skip

    def admission_view(self, device, now):
        snap = self.cluster(now)
        return snap.devices[device], snap.engines

    def model_state(self, model):
        m = self.models[model]
        return m.state, len(m.running)

    def dispatch(self, request, device, now):
        m = self.models[request.model]
        assert m.state is ModelState.ACTIVE and m.placement[0] == device, (request, m)
        assert len(m.running) < self.max_seqs
        m.running[request.req_id] = request
        self.log.append(("dispatch", request.req_id, device))
        return True

    def reject(self, request, reason, detail, now):
        self.rejected[request.req_id] = reason
        self.log.append(("reject", request.req_id, reason))

    def activate(self, model, devices, now):
        m = self.models[model]
        assert m.state is ModelState.EVICTED, m
        m.state, m.placement = ModelState.ACTIVATING, tuple(devices)
        self.log.append(("activate", model, devices))

    def evict(self, model, now):
        m = self.models[model]
        assert m.state is not ModelState.EVICTED
        if m.running and not self.restart:
            self.log.append(("evict-refused", model))
            return []
        out = list(m.running.values())
        m.running.clear()
        m.state, m.placement = ModelState.EVICTED, ()
        self.log.append(("evict", model))
        return out

    def set_kv_quota(self, model, device, quota_bytes):
        self.log.append(("quota", model, device, quota_bytes))

    # -- what a test does as the engines --
    def finish(self, req_id: str, now: float) -> None:
        for m in self.models.values():
            if m.running.pop(req_id, None) is not None:
                self.loop.request_left(req_id)
                self.loop.capacity_freed([m.placement[0]], now)
                return
        raise KeyError(req_id)

    def activated(self, model: str, now: float) -> None:
        m = self.models[model]
        m.state = ModelState.ACTIVE
        self.loop.activation_done(model, m.placement[0], now)


class Scripted:
    """A real policy whose next place() / on_request() answers a test can replace."""

    def __init__(self, name: str, **knobs) -> None:
        self.inner = get_policy(name, **knobs)
        self.next_place: list | None = None
        self.next_request: list | None = None

    def new_queue(self, device):
        return self.inner.new_queue(device)

    @property
    def replica_slots(self):
        return self.inner.replica_slots

    @property
    def prefix_aware(self):
        return self.inner.prefix_aware

    def pick_replica(self, request, cluster, now, cached=None):
        return self.inner.pick_replica(request, cluster, now, cached=cached)

    def new_memo(self):
        return self.inner.new_memo()

    def place(self, cluster, now, memo=None):
        out, self.next_place = self.next_place, None
        return self.inner.place(cluster, now, memo) if out is None else out

    def on_request(self, request, cluster, now):
        out, self.next_request = self.next_request, None
        return self.inner.on_request(request, cluster, now) if out is None else out

    def admit(self, queue, device, engines, now):
        return self.inner.admit(queue, device, engines, now)


def make(
    policy="prism", models=None, devices=None, knobs=None, **kw
) -> tuple[ControlLoop, FakeBody, Scripted]:
    body = FakeBody(models or {"a": 1.0, "b": 1.0}, devices or {"d0": 8.0, "d1": 8.0}, **kw)
    pol = Scripted(policy, **(knobs or {}))
    body.loop = ControlLoop(pol, list(body.caps), body, body.models, 0.0)
    return body.loop, body, pol


def req(i: int, model: str = "a", t: float = 0.0) -> Request:
    return Request(f"r{i}", model, t, 16, 1.0)


def check_invariants(loop: ControlLoop, body: FakeBody) -> None:
    """Every request the loop holds is in exactly one place, and the counts agree; only requests
    on an engine have a first token promised (a restarted one's promise is forgotten)."""
    on_engine = {rid for rid, where in loop.where.items() if where == ENGINE}
    assert set(loop._dispatched_to) <= on_engine
    for q in loop.queues.values():
        assert set(getattr(q, "_promised", ())) <= on_engine
    queued = {r.req_id: d for d, q in loop.queues.items() for r in q.requests()}
    running = {rid for m in body.models.values() for rid in m.running}
    counts: dict[str, int] = {}
    for rid, where in loop.where.items():
        r = loop.requests[rid]
        if where == ENGINE:
            assert rid in running
        elif where in loop.queues:
            assert queued.get(rid) == where
        else:
            assert rid in loop.backlog, (rid, where)
        if where != ENGINE:
            counts[r.model] = counts.get(r.model, 0) + 1
    assert set(loop.where) == set(loop.requests)
    assert set(queued) <= set(loop.where) and set(loop.backlog) <= set(loop.where)
    assert running <= set(loop.where)
    assert {m: n for m, n in loop.num_queued.items() if n} == counts


def test_an_arrival_for_an_evicted_model_activates_it_and_dispatches_once_it_is_ready():
    loop, body, _ = make()
    loop.arrival(req(1), 0.0)
    assert body.models["a"].state is ModelState.ACTIVATING and ("activate", "a", ("d0",)) in body.log
    assert loop.where["r1"] == "d0" and loop.num_queued["a"] == 1  # waits in its device queue
    body.activated("a", 0.5)
    assert loop.where["r1"] == ENGINE and ("dispatch", "r1", "d0") in body.log
    assert loop.num_queued["a"] == 0
    body.finish("r1", 1.0)
    assert not loop.requests and not loop.where
    check_invariants(loop, body)


def test_a_full_engine_admits_the_next_request_when_one_leaves():
    loop, body, _ = make(max_seqs=1)
    loop.arrival(req(1), 0.0)
    body.activated("a", 0.1)
    loop.arrival(req(2, t=0.2), 0.2)
    assert loop.where["r2"] == "d0"  # no free sequence slot
    body.finish("r1", 0.3)
    assert loop.where["r2"] == ENGINE
    check_invariants(loop, body)


def test_migrate_moves_an_idle_model_with_its_queue_and_skips_a_busy_one():
    loop, body, pol = make(max_seqs=1)
    loop.arrival(req(1), 0.0)
    body.activated("a", 0.1)
    loop.arrival(req(2, t=0.2), 0.2)  # queued behind r1 on d0
    pol.next_place = [Migrate("a", ("d0",), ("d1",))]
    loop.tick(0.3)
    assert loop.counters["migrations_skipped"] == 1 and body.models["a"].placement == ("d0",)
    body.finish("r1", 0.4)  # r2 starts: still busy
    body.finish("r2", 0.5)
    loop.arrival(req(3, t=0.6), 0.6)
    body.models["a"].running.clear()  # a test's shortcut: r3 done, nothing running, nothing queued
    loop.request_left("r3")
    pol.inner = get_policy("dedicated")  # keep other ticks from moving anything
    pol.next_place = [Migrate("a", ("d0",), ("d1",))]
    loop.tick(0.7)
    assert loop.counters["migrations"] == 1
    assert body.models["a"].placement == ("d1",) and body.models["a"].state is ModelState.ACTIVATING
    assert ("evict", "a") in body.log
    check_invariants(loop, body)


def test_queued_requests_follow_a_migrating_model_to_its_new_device():
    loop, body, pol = make(max_seqs=1)
    body.models["a"].state, body.models["a"].placement = ModelState.ACTIVATING, ("d0",)
    loop.arrival(req(1), 0.0)  # queued on d0 while a loads
    body.models["a"].state = ModelState.ACTIVE  # loaded, but its engine cannot start anything yet
    body.paused = True
    pol.next_place = [Migrate("a", ("d0",), ("d1",))]
    loop.tick(0.1)
    assert loop.where["r1"] == "d1" and "r1" in loop.queues["d1"] and not len(loop.queues["d0"])
    body.paused = False
    body.activated("a", 0.2)
    assert loop.where["r1"] == ENGINE and ("dispatch", "r1", "d1") in body.log
    check_invariants(loop, body)


def test_requests_displaced_by_an_eviction_are_routed_again_after_the_action_list():
    loop, body, pol = make(knobs={"prewarm": False})  # the test scripts every activation
    loop.arrival(req(1), 0.0)
    body.activated("a", 0.1)
    assert loop.where["r1"] == ENGINE
    seen = []
    inner = pol.inner.on_request

    def on_request(request, cluster, now):
        seen.append((request.req_id, cluster.models["a"].state, cluster.models["b"].state))
        return inner(request, cluster, now)

    pol.inner.on_request = on_request
    pol.next_place = [Evict("a"), Activate("b", ("d0",))]
    loop.tick(0.2)
    # routed once, after both actions: the snapshot shows a evicted and b activating
    assert seen[0] == ("r1", ModelState.EVICTED, ModelState.ACTIVATING)
    assert loop.counters["restarts"] == 1 and loop.where["r1"] in loop.queues
    check_invariants(loop, body)


def test_a_live_style_body_that_refuses_to_evict_a_busy_model_restarts_nothing():
    loop, body, pol = make(restart=False)
    loop.arrival(req(1), 0.0)
    body.activated("a", 0.1)
    pol.next_place = [Evict("a")]
    loop.tick(0.2)
    assert loop.where["r1"] == ENGINE and loop.counters["restarts"] == 0
    assert loop.counters["evictions"] == 1  # ordered; the body decides what it could do


def test_activating_elsewhere_reroutes_the_models_requests_queued_on_other_devices():
    loop, body, pol = make()
    pol.next_request = [Defer(req(1), "test")]
    loop.arrival(req(1), 0.0)
    assert loop.num_queued["a"] == 1 and "r1" in loop.backlog  # deferred requests count as queued
    loop.queues["d1"].push(r2 := req(2))  # as if a policy queued it on d1 for a model not loaded there
    loop._set_where(r2, "d1")
    loop.requests["r2"] = r2
    pol.next_place = [Activate("a", ("d0",))]
    loop.tick(0.1)
    assert not len(loop.queues["d1"]) and loop.where["r2"] == "d0"
    assert loop.where["r1"] == "d0"  # the backlog went through on_request after place()
    check_invariants(loop, body)


def test_a_failed_activation_hands_back_every_waiting_request_of_that_model():
    loop, body, _ = make()
    loop.arrival(req(1), 0.0)
    loop.arrival(req(2, "b", 0.1), 0.1)
    out = loop.activation_failed("a", 0.2)
    assert [r.req_id for r in out] == ["r1"] and "r1" not in loop.where and loop.num_queued["a"] == 0
    assert "r2" in loop.where
    check_invariants(loop, body)


def test_a_failed_replica_activation_routes_its_requests_again():
    """A replica slot whose activation failed does not fail its requests: they go to the model's
    replica 0, which activates."""
    loop, body, _ = make(models={"a": 1.0, "a#1": 1.0})
    body.activate("a#1", ("d1",), 0.0)  # a replica coming up while replica 0 is evicted
    loop.arrival(req(1), 0.0)
    assert loop.where["r1"] == "d1" and loop.requests["r1"].model == "a#1"  # routed to the replica
    body.models["a#1"].state, body.models["a#1"].placement = ModelState.EVICTED, ()  # it failed
    assert loop.activation_failed("a#1", 0.5) == []
    assert loop.requests["r1"].model == "a" and loop.requests["r1"].arrival == 0.0
    assert body.models["a"].state is ModelState.ACTIVATING and loop.where["r1"] == "d0"
    assert not body.rejected
    check_invariants(loop, body)


def test_a_held_model_is_not_prewarmed_until_a_request_for_it_arrives():
    """An operator's unload holds the model: the forecast (busy in the last window) would prewarm it
    at the next tick; held, it stays evicted until its next arrival, which releases the hold."""

    def busy_then_unloaded(held: bool) -> tuple[ControlLoop, FakeBody]:
        loop, body, _ = make()
        for i in range(20):
            loop.arrival(req(i, t=i), float(i))
            if i == 0:
                body.activated("a", 0.5)
            body.finish(f"r{i}", i + 0.5)
        body.evict("a", 100.0)  # what the runtime's admin unload does, beside the loop
        if held:
            loop.hold("a")
        loop.tick(310.0)  # the next forecast window: window 0 saw 20 arrivals
        return loop, body

    loop, body = busy_then_unloaded(held=False)
    assert body.models["a"].state is ModelState.ACTIVATING  # prewarmed
    loop, body = busy_then_unloaded(held=True)
    assert body.models["a"].state is ModelState.EVICTED and loop.forecast_rate("a", 310.0) == 0.0
    loop.arrival(req(99, t=320.0), 320.0)  # real demand activates it and ends the hold
    assert body.models["a"].state is ModelState.ACTIVATING and "a" not in loop.held
    assert loop.forecast_rate("a", 320.0) > 0


def test_a_model_activated_for_a_request_is_not_prewarmed_after_serving_it():
    """Prewarmed memory yields first (eviction.is_idle); a model the loop activated because a request
    of it was arriving, or waited deferred, served real demand and keeps its idle threshold. Only a
    placement with no request waiting (the forecast's) is prewarmed, until its first arrival."""
    loop, body, pol = make(devices={"d0": 8.0}, knobs={"prewarm": False})  # activations scripted
    loop.arrival(req(1, "a"), 0.0)  # on_request: Evict..., Activate(a), Enqueue(r1)
    assert body.models["a"].state is ModelState.ACTIVATING and "a" not in loop.prewarmed
    body.activated("a", 0.1)
    body.finish("r1", 0.3)
    snap = body.cluster(0.4).models["a"]
    assert not snap.prewarmed and snap.idle_for(0.4) < 1.0
    # a request deferred first and activated by a later tick's place() is demand as well
    pol.next_request = [Defer(req(2, "b"), "test")]
    loop.arrival(req(2, "b"), 1.0)
    pol.next_place = [Activate("b", ("d0",))]
    loop.tick(2.0)
    assert body.models["b"].state is ModelState.ACTIVATING and "b" not in loop.prewarmed
    # an activation with nothing waiting is a prewarm: it yields first until its model gets a request
    body.activated("b", 2.1)
    body.finish("r2", 2.2)
    body.evict("a", 3.0)
    pol.next_place = [Activate("a", ("d0",))]
    loop.tick(4.0)
    assert "a" in loop.prewarmed and body.cluster(4.0).models["a"].prewarmed
    body.activated("a", 4.1)
    loop.arrival(req(3, "a", t=5.0), 5.0)
    assert "a" not in loop.prewarmed and not body.cluster(5.0).models["a"].prewarmed
    pol.next_place = [Evict("a")]
    loop.tick(6.0)
    assert "a" not in loop.prewarmed
    check_invariants(loop, body)


def test_a_replica_added_to_a_model_with_one_resident_is_not_prewarmed():
    """Replica 0 re-activated by replica scaling while replica 1 serves the model's requests: it
    serves that demand, so its memory does not yield first (it did, and prism activated and evicted
    it every tick). Replica 0 activated with no replica resident and nothing waiting is a prewarm."""
    loop, body, pol = make(models={"a": 1.0, "a#1": 1.0})
    body.activate("a#1", ("d1",), 0.0)
    body.activated("a#1", 0.1)
    pol.next_place = [Activate("a", ("d0",))]
    loop.tick(1.0)
    assert body.models["a"].state is ModelState.ACTIVATING and "a" not in loop.prewarmed
    body.activated("a", 1.1)
    pol.next_place = [Evict("a"), Evict("a#1")]
    loop.tick(2.0)
    pol.next_place = [Activate("a", ("d0",))]
    loop.tick(3.0)
    assert "a" in loop.prewarmed
    check_invariants(loop, body)


def test_abort_and_reject_leave_nothing_behind():
    loop, body, pol = make()
    loop.arrival(req(1), 0.0)
    assert loop.abort("r1") and not loop.abort("r1")
    pol.next_request = [Reject(req(2), RejectReason.PROMPT_TOO_LONG, "too long")]
    loop.arrival(req(2), 0.1)
    assert body.rejected == {"r2": RejectReason.PROMPT_TOO_LONG} and loop.counters["rejections"] == 1
    assert not loop.where and not loop.requests and not +loop.num_queued
    with pytest.raises(LoopStateError):
        loop.arrival(req(3), 0.2)
        loop.arrival(req(3), 0.2)


def test_a_dead_worker_sends_its_models_queued_requests_through_the_policy_again():
    loop, body, _ = make(max_seqs=1)
    loop.arrival(req(1), 0.0)
    body.activated("a", 0.1)
    loop.arrival(req(2, t=0.2), 0.2)
    assert loop.where["r2"] == "d0"
    m = body.models["a"]  # the worker died: its request failed, the model is gone
    m.running.clear()
    loop.request_left("r1")
    m.state, m.placement = ModelState.EVICTED, ()
    loop.worker_died("a", 0.3)
    assert m.state is ModelState.ACTIVATING and loop.where["r2"] in loop.queues
    check_invariants(loop, body)


def test_a_lost_device_routes_its_queue_again_and_a_joined_device_takes_work():
    loop, body, pol = make(max_seqs=1, models={"a": 1.0, "b": 7.5})  # b fits no device beside a
    loop.arrival(req(1), 0.0)
    body.activated("a", 0.1)
    loop.arrival(req(2, t=0.2), 0.2)
    assert loop.where["r2"] == "d0"
    # d0's node left: the body drops the device and its model, r1 failed with it
    m = body.models["a"]
    m.running.clear()
    loop.request_left("r1")
    m.state, m.placement = ModelState.EVICTED, ()
    del body.caps["d0"]
    loop.remove_device("d0", 0.3)
    assert "d0" not in loop.queues
    assert m.state is ModelState.ACTIVATING and m.placement == ("d1",)
    assert loop.where["r2"] == "d1"
    loop.capacity_freed(["d0"], 0.35)  # a late event for the gone device is ignored
    body.activated("a", 0.4)
    assert loop.where["r2"] == ENGINE
    check_invariants(loop, body)
    # a device joins: it is in the snapshots, and a request can queue and run there
    body.caps["d2"] = 8 * GIB
    loop.add_device("d2")
    assert "d2" in body.cluster(0.5).devices
    r3 = req(3, "b", 0.5)
    assert body.models["b"].state is ModelState.EVICTED
    pol.next_request = [Activate("b", ("d2",)), Enqueue(r3, "d2")]
    loop.arrival(r3, 0.5)
    assert loop.where["r3"] == "d2"
    body.activated("b", 0.6)
    assert loop.where["r3"] == ENGINE and ("dispatch", "r3", "d2") in body.log
    check_invariants(loop, body)


def test_a_policy_failure_leaves_a_state_that_abort_cleans():
    loop, body, pol = make()

    def boom(*a):
        raise RuntimeError("policy bug")

    pol.inner.admit = boom
    body.models["a"].state, body.models["a"].placement = ModelState.ACTIVE, ("d0",)
    with pytest.raises(RuntimeError):
        loop.arrival(req(1), 0.0)
    assert loop.abort("r1")  # what the runtime does for a failed submit
    assert not loop.where and not +loop.num_queued and not len(loop.queues["d0"])
    pol.inner = get_policy("prism")
    loop.arrival(req(2, t=0.1), 0.1)
    assert loop.where["r2"] == ENGINE


KINDS = st.sampled_from(["arrive", "tick", "ready", "finish", "abort", "died"])
EVENTS = st.lists(st.tuples(KINDS, st.integers(0, 2), st.integers(0, 50)), max_size=60)


@pytest.mark.parametrize("policy", ["prism", "dedicated", "static-partition", "qlm", "muxserve"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS)
def test_random_event_sequences_keep_every_request_in_exactly_one_place(policy, events):
    models = {"a": 3.0, "b": 3.0, "c": 3.0}
    loop, body, _ = make(policy, models, {"d0": 8.0, "d1": 8.0}, max_seqs=2)
    names = list(models)
    now, i = 0.0, 0
    for kind, k, pick in events:
        now += 0.25
        model = names[k]
        if kind == "arrive":
            i += 1
            # prompts of 3 blocks, some sharing their first blocks (the prefix index's paths)
            keys = (pick % 3, 10 + pick % 5, 100 + i)
            loop.arrival(Request(f"r{i}", model, now, 200, 1.0, keys), now)
        elif kind == "tick":
            loop.tick(now)
        elif kind == "ready":
            activating = [m for m in body.models.values() if m.state is ModelState.ACTIVATING]
            if activating:
                body.activated(activating[pick % len(activating)].name, now)
        elif kind == "finish":
            running = [rid for m in body.models.values() for rid in m.running]
            if running:
                body.finish(running[pick % len(running)], now)
        elif kind == "abort":
            waiting = [rid for rid, w in loop.where.items() if w != ENGINE]
            if waiting:
                assert loop.abort(waiting[pick % len(waiting)])
        elif kind == "died":
            m = body.models[model]
            if m.state is ModelState.ACTIVE:
                for rid in list(m.running):
                    m.running.pop(rid)
                    loop.request_left(rid)
                m.state, m.placement = ModelState.EVICTED, ()
                loop.worker_died(model, now)
        check_invariants(loop, body)
        # a hit never covers the prompt's last token (199 tokens: 3 full blocks at most)
        assert all(r.cached_tokens <= 3 * 64 for r in loop.requests.values())
    # and everything drains: activations finish, requests finish
    for _ in range(200):
        now += 0.25
        for m in list(body.models.values()):
            if m.state is ModelState.ACTIVATING:
                body.activated(m.name, now)
        for rid in [rid for m in body.models.values() for rid in m.running]:
            body.finish(rid, now)
        loop.tick(now)
        check_invariants(loop, body)
        if not loop.requests:
            break
    assert not loop.requests


def test_a_policy_failure_in_a_tick_keeps_the_unrouted_backlog_deferred():
    loop, body, pol = make()
    for i in (1, 2, 3):
        pol.next_request = [Defer(req(i), "test")]
        loop.arrival(req(i), 0.0)
    calls = []

    def flaky(request, cluster, now):
        calls.append(request.req_id)
        raise RuntimeError("policy bug")

    pol.inner.on_request = flaky
    with pytest.raises(RuntimeError):
        loop.tick(1.0)
    assert calls == ["r1"] and list(loop.backlog) == ["r2", "r3"]
    assert loop.abort("r1") and loop.abort("r2")  # r1 was being routed, r2 is still deferred
    assert list(loop.backlog) == ["r3"] and loop.num_queued["a"] == 1
    check_invariants(loop, body)


def test_a_keep_alive_eviction_holds_the_model_until_its_next_request():
    """prism fills free memory with models that have no forecast yet; a model its own keep-alive
    evicted must not come back at the next tick (it would be loaded and evicted again every tick)."""
    loop, body, _ = make()
    body.keep_alive["a"] = 1.0
    loop.arrival(req(1, t=0.0), 0.0)
    body.activated("a", 0.1)
    body.finish("r1", 0.2)
    loop.tick(5.0)  # idle 4.8 s > 1 s: evicted, and held
    assert body.models["a"].state is ModelState.EVICTED and "a" in loop.held
    loop.tick(6.0)
    assert body.models["a"].state is ModelState.EVICTED, "prewarmed back after its keep-alive"
    loop.arrival(req(2, t=7.0), 7.0)
    assert body.models["a"].state is ModelState.ACTIVATING and "a" not in loop.held
    check_invariants(loop, body)


def test_a_tick_logs_each_move_with_the_busy_fractions_it_read(caplog):
    loop, body, pol = make(max_seqs=1)
    loop.arrival(req(1), 0.0)
    body.activated("a", 0.1)
    pol.next_place = [Migrate("a", ("d0",), ("d1",))]
    with caplog.at_level(logging.INFO, logger="prism_serve.control.loop"):
        loop.tick(0.3)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("moving")]
    # each device's models with their busy fraction / request rate: a has had one request within
    # the rate estimator's shortest span (1 req/s; busy 1 by its profile here), b on d1 none
    assert line == "moving a ('d0',) -> ('d1',) (busy/rate d0: a 1.00/1.000 | d1: b 0.00/0.000)"


def test_a_tick_marks_stale_only_what_time_moved():
    """A tick marks the models whose rate has arrivals in its window (an empty window reads 0.0
    at any time), and every model once a new forecast window began: what the simulator rebuilds."""
    loop, _, pol = make(models={"a": 1.0, "b": 1.0, "c": 1.0})
    loop.arrival(req(0, "a", 0.0), 0.0)
    for t in (1.0, 2.0, 200.0, 201.0, 300.0):
        loop.stale_models.clear()
        pol.next_place = []
        loop.tick(t)
        marked = set(loop.stale_models)
        if t == 1.0:  # the first tick: the forecast window is new
            assert marked == {"a", "b", "c"}
        elif t in (2.0, 200.0):  # a's arrival is still counted (at 200 s its read drops it)
            assert marked == {"a"}
        elif t == 201.0:
            assert marked == set()
        else:  # 300 s: the next forecast window
            assert marked == {"a", "b", "c"}


# ---- a tick decided off the body's loop (begin_tick, decide, end_tick) ----------------------------


def test_a_placement_decided_apart_applies_when_nothing_it_acts_on_moved():
    loop, body, pol = make(devices={"d0": 8.0, "d1": 8.0})
    run = loop.begin_tick(0.0)
    pol.next_place = [Activate("a", ("d0",))]
    actions = loop.decide(run)
    r = req(1, "b")
    pol.next_request = [Activate("b", ("d1",)), Enqueue(r, "d1")]
    loop.arrival(r, 0.1)  # b activates on demand on d1, a device the plan does not name
    assert body.models["b"].placement == ("d1",)
    assert loop.end_tick(run, actions, 0.2)
    assert body.models["a"].state is ModelState.ACTIVATING and body.models["a"].placement == ("d0",)
    assert loop.counters["placements_redone"] == 0


def test_a_placement_is_not_applied_when_its_device_took_an_activation_meanwhile():
    """The plan counted d0's memory as it was; an activation there since may have taken it."""
    loop, body, pol = make(models={"a": 6.0, "b": 6.0}, devices={"d0": 8.0})
    run = loop.begin_tick(0.0)
    pol.next_place = [Activate("a", ("d0",))]
    actions = loop.decide(run)
    loop.arrival(req(1, "b"), 0.1)
    assert body.models["b"].placement == ("d0",)
    assert not loop.end_tick(run, actions, 0.2)
    assert body.models["a"].state is ModelState.EVICTED  # nothing applied
    assert loop.counters["placements_redone"] == 1
    assert loop.end_tick(loop.begin_tick(0.3), [], 0.3)  # decided again on what is there now


def test_a_placement_does_not_evict_a_model_that_got_work_while_it_was_decided():
    loop, body, _ = make()
    loop.arrival(req(1, "a"), 0.0)
    body.activated("a", 0.5)
    body.finish("r1", 1.0)
    run = loop.begin_tick(2.0)
    assert run.cluster.models["a"].num_running == 0 and run.cluster.models["a"].num_queued == 0
    actions = [Evict("a")]
    loop.arrival(req(2, "a", 2.1), 2.1)  # idle when the plan saw it; running now
    assert not loop.end_tick(run, actions, 2.2)
    assert body.models["a"].state is ModelState.ACTIVE and "r2" in body.models["a"].running


def test_a_place_later_body_gets_the_placement_after_an_activation():
    calls = []
    body = FakeBody({"a": 1.0}, {"d0": 8.0})
    pol = Scripted("prism")
    body.loop = loop = ControlLoop(pol, ["d0"], body, body.models, 0.0, place_later=lambda: calls.append(1))
    loop.arrival(req(1, "a"), 0.0)
    pol.next_place = [Evict("a")]  # would be applied were the loop to place there and then
    body.activated("a", 0.5)
    assert calls == [1]
    assert pol.next_place is not None  # place() was not called
    assert body.log[-1] == ("dispatch", "r1", "d0")  # and admission ran
