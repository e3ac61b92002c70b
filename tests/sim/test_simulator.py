"""The simulator's behaviour: latency at low load, Little's law, determinism, every policy, memory."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prism_serve.control import POLICIES
from prism_serve.engine.kv_cache import KVGroups
from prism_serve.engine.models.config import PRESETS, ArchConfig
from prism_serve.sim import HARDWARE, ModelSLO, RooflineCostModel, SimConfig, SimConfigError, simulate
from prism_serve.sim.engine import SimEngine, SimRequest
from prism_serve.sim.memory import SimDevice
from prism_serve.sim.models import ModelShape, ServedModel
from prism_serve.workload import Workload

from .helpers import loose, poisson, served


def test_low_load_ttft_is_the_prefill_time():
    m = served()
    w = poisson([m.name], rate=0.2, duration=200, prompt=1024, output=16, seed=1)
    res = simulate([m], w, loose([m]), SimConfig(num_devices=1, policy="dedicated"))
    prefill = RooflineCostModel(HARDWARE["h100"]).prefill_time(m.spec, 1, 1024)
    ttfts = np.array([r.ttft for r in res.requests])
    assert len(ttfts) == len(w) > 20
    # requests rarely overlap at 0.2 req/s; the median waits for nobody
    assert np.median(ttfts) == pytest.approx(prefill, rel=0.02)
    assert ttfts.min() >= prefill * 0.999


def test_the_serving_path_overhead_delays_every_first_token_and_finish_and_nothing_else(tmp_path):
    """HardwareProfile.request_overhead_s (the serving path outside the engine, measured live on
    the CPU profiles) shifts each request's first token and finish by exactly that much: TPOT, the
    schedule and every other request stay as they were."""
    import dataclasses

    from prism_serve.sim.hardware import dump_hardware

    slow_path = tmp_path / "h100-path.json"
    dump_hardware(dataclasses.replace(HARDWARE["h100"], request_overhead_s=0.25), slow_path)
    m = served()
    w = poisson([m.name], rate=2.0, duration=120, prompt=(64, 1024), output=(8, 64), seed=4)
    runs = [
        simulate([m], w, loose([m]), SimConfig(num_devices=1, policy="dedicated", hardware=hw)).requests
        for hw in ("h100", str(slow_path))
    ]
    assert len(runs[0]) == len(runs[1]) == len(w) > 100
    for a, b in zip(*runs, strict=True):
        assert b.ttft == pytest.approx(a.ttft + 0.25, abs=1e-9)
        assert b.finish == pytest.approx(a.finish + 0.25, abs=1e-9)
        assert b.tpot == pytest.approx(a.tpot, abs=1e-9)


def test_an_activation_waits_for_the_eviction_that_makes_its_room(tmp_path):
    """A fitted CPU profile's measured eviction time (HardwareProfile.eviction_for: the engine
    stopped, its pages unmapped) comes before the activation it makes room for, as the live
    activator waits for the evictions its decision ordered: one device that holds one of two models,
    the second model's first request waits exactly that much longer."""
    from prism_serve.sim.hardware import dump_hardware

    a, b = served("a"), served("b")
    room = int(a.spec.weight_bytes * 1.5)  # one model's weights and its KV, not two
    one = dataclasses.replace(HARDWARE["h100"], memory_bytes=room, usable_fraction=1.0)
    slow = dataclasses.replace(one, shape_activations=((a.spec.name, *one.activation_for(a.spec.name), 2.0),))
    w = Workload(np.array([0.0, 10.0]), np.array([0, 1]), np.array([256, 256]), np.array([8, 8]), ["a", "b"])
    runs = []
    for name, hw in (("one", one), ("slow", slow)):
        path = tmp_path / f"{name}.json"
        dump_hardware(dataclasses.replace(hw, name=name), path)
        cfg = SimConfig(num_devices=1, policy="prism", hardware=str(path), knobs=(("prewarm", False),))
        runs.append({r.model: r for r in simulate([a, b], w, loose([a, b], ttft=100.0), cfg).requests})
    assert runs[0]["a"].ttft == pytest.approx(runs[1]["a"].ttft)  # nothing to wait for
    assert runs[1]["b"].ttft == pytest.approx(runs[0]["b"].ttft + 2.0)


def test_littles_law_on_a_steady_run():
    m = served(shape="llama-3.2-3b")
    w = poisson([m.name], rate=4.0, duration=600, prompt=(64, 2048), output=(16, 512), seed=2)
    res = simulate([m], w, loose([m]), SimConfig(num_devices=1, policy="prism", warmup_s=0.0))
    done = [r for r in res.requests if r.finish is not None]
    assert len(done) == len(w)
    lam = len(w) / res.end_time
    mean_sojourn = np.mean([r.finish - r.arrival for r in done])
    # L is integrated from the simulator's own in-system count, W from per-request timestamps
    assert res.mean_in_system == pytest.approx(lam * mean_sojourn, rel=0.02)


def test_same_seed_same_result():
    ms = [served("a", "llama-3.2-1b"), served("b", "llama-3.2-3b"), served("c")]
    w = poisson([m.name for m in ms], rate=2.0, duration=120, prompt=(32, 4096), output=(8, 400), seed=5)
    slos = {m.name: ModelSLO(0.2, 0.03) for m in ms}
    cfg = SimConfig(num_devices=2, policy="prism")
    a, b = simulate(ms, w, slos, cfg), simulate(ms, w, slos, cfg)
    assert a.summary() == b.summary()
    assert [(r.first_token, r.finish) for r in a.requests] == [(r.first_token, r.finish) for r in b.requests]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_registered_policy_runs(policy):
    ms = [served("a", "llama-3.2-1b"), served("b", "llama-3.2-3b"), served("c"), served("d", "llama-3.2-1b")]
    w = poisson([m.name for m in ms], rate=1.0, duration=60, prompt=(32, 2048), output=(8, 256), seed=3)
    res = simulate(ms, w, loose(ms), SimConfig(num_devices=2, policy=policy))
    s = res.summary()
    assert s["num_requests"] == len(w)
    assert s["num_finished"] + s["num_rejected"] + s["num_unfinished"] == len(w)
    assert s["num_finished"] > 0 and s["activations"] >= 1
    for r in res.requests:
        if r.finish is not None:
            assert r.arrival <= r.first_token <= r.finish


def test_tensor_parallel_model_runs_on_its_group():
    ms = [served("big", "llama-3.1-70b", tp=4), served("small", "llama-3.2-1b")]
    w = poisson(["big", "small"], rate=0.5, duration=60, seed=4)
    res = simulate(ms, w, loose(ms), SimConfig(num_devices=4, policy="prism"))
    assert res.summary()["num_finished"] == len(w)
    with pytest.raises(SimConfigError):
        simulate(ms, w, loose(ms), SimConfig(num_devices=2, policy="prism"))


def test_sharing_beats_static_slices_when_one_model_bursts():
    # two 8B models on one GPU; only one is busy: elastic KV lets it use the idle model's share
    ms = [served("busy"), served("idle")]
    w = poisson(["busy"], rate=12.0, duration=60, prompt=2048, output=512, seed=6)
    w = Workload(w.timestamps, w.model_index, w.prompt_tokens, w.output_tokens, ["busy", "idle"])
    slos = {m.name: ModelSLO(0.5, 0.1) for m in ms}
    shared = simulate(ms, w, slos, SimConfig(num_devices=1, policy="muxserve")).summary()
    static = simulate(ms, w, slos, SimConfig(num_devices=1, policy="static-partition")).summary()
    assert static["preemptions"] > 0 or static["ttft_p95_s"] > shared["ttft_p95_s"]


def _req(i: int, prompt: int, output: int) -> SimRequest:
    return SimRequest(str(i), "m", 0.0, prompt, output, 1.0, 1.0, control=None)


def _engine(pages: int, shape: str = "llama-3.2-1b", **kw) -> tuple[SimEngine, SimDevice]:
    m = served("m", shape)  # llama-3.2-1b: 32 KiB of KV per token, one 16-token block is 512 KiB
    dev = SimDevice("d", pages * (2 << 20), 2 << 20)
    args = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_run_steps=32)
    args.update(kw)
    return SimEngine(m, [dev], RooflineCostModel(HARDWARE["h100"]), **args), dev


def _drain(e: SimEngine, dev: SimDevice) -> tuple[int, int]:
    """Run ``e`` until idle: (most requests running at once, most pages used)."""
    t, most, peak = 0.0, 0, 0
    while (end := e.start_step(t)) is not None:
        most, peak = max(most, len(e.running)), max(peak, dev.used_pages)
        e.finish_step(end)
        t = end
    assert not e.waiting and e.used_blocks == 0 and dev.used_pages == 0
    return most, peak


def test_a_windowed_models_engine_holds_its_window_not_its_length_in_windowed_layers():
    """Gemma 3 1B (4 global layers of 26, window 512): 8 requests of 3000 + 64 tokens on 256 MiB of
    KV (benchmarks/windowed_kv.py's case on the live engine). Split into KV groups as the live
    engine splits them, a request's windowed groups hold about a window, so more run at once than
    with every layer holding every token, with fewer preemptions; the engine reports the split as
    the live one does (EngineSnapshot.kv_window)."""
    groups = KVGroups.of(PRESETS["gemma-3-1b"], 8192)
    runs = {}
    for split in (True, False):
        e, dev = _engine(128, "gemma-3-1b", max_num_batched_tokens=512, kv_groups=groups if split else None)
        for i in range(8):
            e.add(_req(i, prompt=3000, output=64))
        runs[split] = (*_drain(e, dev), e.num_preemptions, e.kv_window)
    (most, peak, preempted, window), (most_all, peak_all, preempted_all, no_window) = runs[True], runs[False]
    assert window == (512 - 1 + 512 + 2 * 16, 6 * 4 * 1024) and no_window is None
    assert most > most_all and preempted < preempted_all
    assert peak <= 128 and peak_all <= 128


def test_an_encoders_engine_holds_no_kv_and_reads_each_input_whole():
    """An encoder (BERT's shape) keeps no KV, and an input is never cut into chunks: one that does
    not fit the step's budget left waits for the next step (the live scheduler's whole inputs)."""
    bert = ModelShape("bert", ArchConfig("bert", 30522, 384, 1536, 12, 12, 12, 32, 512), 4)
    e = SimEngine(
        ServedModel("m", bert), [SimDevice("d", 2 << 20, 2 << 20)], RooflineCostModel(HARDWARE["h100"]),
        block_size=16, max_num_seqs=8, max_num_batched_tokens=512, max_run_steps=32, prefix_caching=True,
    )  # fmt: skip
    assert e.kv_bytes_per_token == 0 and e.cache is None
    for i, n in enumerate((300, 300, 200)):
        e.add(_req(i, prompt=n, output=1))
    steps = []
    t = 0.0
    while (end := e.start_step(t)) is not None:
        steps.append([(s.req.req_id, n) for s, n in e._scheduled])
        e.finish_step(end)
        t = end
    assert steps == [[("0", 300)], [("1", 300), ("2", 200)]]
    assert not e.running and not e.waiting and e.used_blocks == 0


def test_engine_chunks_long_prompts_and_coalesces_decode_runs():
    e, dev = _engine(pages=64)
    e.add(_req(0, prompt=600, output=40))
    ends = []
    t = 0.0
    while True:
        end = e.start_step(t)
        if end is None:
            break
        ends.append(end)
        e.finish_step(end)
        t = end
    # 600 prompt tokens in 256-token chunks: 3 prefill steps, then 39 decodes in runs of <= 32 steps
    assert len(ends) == 3 + 2
    assert e.num_steps == 3 + 39
    assert dev.used_pages == 0 and e.used_blocks == 0


def test_engine_preempts_the_newest_request_when_blocks_run_out():
    e, dev = _engine(pages=4, max_num_batched_tokens=4096, max_run_steps=1)  # 16 blocks = 256 tokens
    a, b = _req(0, prompt=60, output=100), _req(1, prompt=60, output=100)  # 10 blocks each at the end
    e.add(a)
    e.add(b)
    t = 0.0
    for _ in range(2000):
        end = e.start_step(t)
        if end is None:
            break
        e.finish_step(end)
        t = end
        assert dev.used_pages <= dev.total_pages
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.finish is not None and b.finish is not None and a.finish < b.finish


def test_cut_returns_the_blocks_of_steps_not_taken():
    e, _ = _engine(pages=64)
    e.add(_req(0, prompt=16, output=100))
    end = e.start_step(0.0)
    e.finish_step(end)  # prefill done, first token out
    run_end = e.start_step(end)
    held = e.used_blocks
    new_end = e.cut(end + 1e-9)
    assert new_end is not None and end < new_end < run_end
    assert e.used_blocks < held
    e.finish_step(new_end)
    assert e.running[0].generated == 2  # one decode step happened


def test_a_prefill_ending_in_a_one_token_chunk_still_records_its_first_token():
    e, _ = _engine(pages=64, max_num_batched_tokens=256)
    r = _req(0, prompt=257, output=20)  # chunks of 256 and 1
    e.add(r)
    t = 0.0
    while (end := e.start_step(t)) is not None:
        e.finish_step(end)
        t = end
    assert r.first_token is not None and r.finish is not None and r.first_token < r.finish


def _step(sim) -> None:
    t, event = sim.events.pop()
    sim._advance(t)
    event.apply(sim, t)


def test_migrate_moves_only_an_idle_model_like_the_live_controller():
    # the rule lives in control/loop.py (tests/control/test_loop.py); here: its effects on simulated engines
    from prism_serve.control import Migrate, ModelState
    from prism_serve.sim import Simulator
    from prism_serve.sim.events import Arrival, Tick

    m = served()
    w = poisson([m.name], rate=0.5, duration=20, prompt=256, output=400, seed=3)
    sim = Simulator([m], w, loose([m]), SimConfig(num_devices=2, policy="dedicated"))
    state = sim.models[m.name]
    sim.events.push(sim._arrival_time(0), Arrival(0))  # what run() starts with
    sim.events.push(0.0, Tick())
    while sim.events.peek_time() < sim._arrival_time(0):  # dedicated loads it at the first tick
        _step(sim)
    assert state.state is ModelState.ACTIVE and state.placement == ("gpu00",)
    sim.loop._apply([Migrate(m.name, ("gpu00",), ("gpu01",))], sim.now)
    assert state.placement == ("gpu01",) and state.state is ModelState.ACTIVATING
    assert not sim.devices["gpu00"].weight_pages and sim.devices["gpu01"].weight_pages
    assert sim.loop.counters["migrations"] == 1
    # once it runs, a migration is skipped: no reload, no restart; the next tick may try again
    while state.num_running == 0:
        _step(sim)
    sim.loop._apply([Migrate(m.name, ("gpu01",), ("gpu00",))], sim.now)
    assert state.placement == ("gpu01",) and state.state is ModelState.ACTIVE
    assert sim.loop.counters["migrations"] == 1 and sim.loop.counters["migrations_skipped"] == 1
    while sim.in_system or sim._next_arrival < len(w):
        _step(sim)
    assert len(sim.requests) == len(w) and all(r.ttft is not None for r in sim.requests)
    assert all(r.num_restarts == 0 for r in sim.requests)


def test_misses_split_into_cold_and_warm():
    """A request that arrives while its model is evicted or activating waits for the activation
    (cold); the summary counts those misses apart from the ones that waited behind other work."""
    m = served()
    w = poisson([m.name], rate=0.5, duration=120, prompt=256, output=16, seed=3)
    tight = {m.name: ModelSLO(ttft_s=1e-4, tpot_s=1.0)}  # every request misses its TTFT
    res = simulate([m], w, tight, SimConfig(num_devices=1, policy="prism", warmup_s=0.0))
    out = res.summary()
    cold = [r for r in res.requests if r.cold]
    # prism starts with the model evicted: the first request waits for its activation, later ones do not
    assert res.requests[0].cold and 1 <= len(cold) < len(res.requests)
    assert out["ttft_misses_cold"] == len(cold)
    assert out["ttft_misses_cold"] + out["ttft_misses_warm"] == len(res.requests)
    relaxed = simulate([m], w, loose([m]), SimConfig(num_devices=1, policy="prism", warmup_s=0.0)).summary()
    assert relaxed["ttft_misses_cold"] == relaxed["ttft_misses_warm"] == 0


def test_under_sustained_overload_deadlines_less_the_engines_lateness_serve_more_in_time():
    """One 8B model at 90 req/s on one H100 that serves about 62 within its SLO: the paper's check
    alone keeps requests whose first token, as the engine steps, comes just past the deadline; with
    each model's learned lateness taken off its deadlines the schedule sheds those instead."""
    m = served("m")
    w = poisson(["m"], 90, 60, seed=1)
    slos = {"m": ModelSLO(1.0, 0.1)}
    got = {
        margin: simulate(
            [m], w, slos, SimConfig(num_devices=1, policy="prism", knobs={"lateness_margin": margin})
        ).summary()["ttft_attainment"]
        for margin in (True, False)
    }
    assert got[True] > got[False] + 0.1


def test_a_model_hotter_than_one_device_gets_a_second_replica():
    """One 8B model at 90 req/s where one H100 serves about 62 within its SLO (cost model): prism
    activates replica 1 on the other device and both serve; with replicas off the one engine serves
    what it can."""
    m = served("m")
    w = poisson(["m"], 90, 60, seed=1)
    slos = {"m": ModelSLO(1.0, 0.1)}
    runs = {
        slots: simulate([m], w, slos, SimConfig(num_devices=2, policy="prism", knobs={"max_replicas": slots}))
        for slots in (2, 1)
    }
    replicated, single = runs[2], runs[1]
    by_replica = {r.replica for r in replicated.requests}
    assert by_replica == {"m", "m#1"}
    assert replicated.counters["replica_activations"] == 1
    assert {r.replica for r in single.requests} == {"m"} and single.counters["replica_activations"] == 0
    assert all(r.model == "m" for r in replicated.requests)  # reports keep the served model's name
    # one engine serves about 62 of the 90 req/s in time, and admission sheds the rest (about 69%)
    assert replicated.summary()["ttft_attainment"] >= 0.99 > 0.8 > single.summary()["ttft_attainment"]
    out = replicated.summary()
    assert out["replica_activations"] == 1
    assert out["requests_on_replicas"] == sum(r.replica == "m#1" for r in replicated.requests) > 0
    assert single.summary()["requests_on_replicas"] == 0
    per = replicated.per_model()["m"]
    on_replica = out["requests_on_replicas"]
    assert per["by_replica"] == {"m": len(w) - on_replica, "m#1": on_replica}
    assert per["ttft_misses"] == round((1 - out["ttft_attainment"]) * len(w))


def test_slos_measured_in_worker_processes_are_those_measured_here():
    from prism_serve.sim.slo import measure_slos

    ms = [served("a", "llama-3.2-1b"), served("b", "llama-3.2-3b"), served("c", "llama-3.2-1b")]
    # "c" has no request: it is measured on a probe drawn from the whole workload
    w = poisson(["a", "b"], 1.0, 60.0, prompt=(64, 512), output=(8, 64), seed=1)
    here = measure_slos(ms, w, SimConfig(num_devices=1), min_requests=20)
    assert measure_slos(ms, w, SimConfig(num_devices=1), min_requests=20, jobs=2) == here
    assert list(here) == ["a", "b", "c"]


def _placements_after_activations(coalesce: float) -> tuple[list[float], list[float], list[float], float]:
    """Six 8B models taking turns on one device (four fit): when their activations finished, when
    prism placed (ticks included), when its ticks ran, and when the run ended."""
    from prism_serve.control import ModelState
    from prism_serve.sim import Simulator

    ms = [served(f"m{i}") for i in range(6)]
    w = poisson([m.name for m in ms], rate=0.05, duration=300, prompt=256, output=16, seed=4)
    config = SimConfig(num_devices=1, policy="prism", placement_coalesce_s=coalesce, tick_s=5.0)
    sim = Simulator(ms, w, loose(ms), config)
    finished: list[float] = []
    placed: list[float] = []
    ticks: list[float] = []
    done, place, tick = sim.on_activation_done, sim.loop.policy.place, sim.on_tick

    def on_activation_done(model: str, version: int, now: float) -> None:
        was = sim.models[model].state
        done(model, version, now)
        if was is ModelState.ACTIVATING and sim.models[model].state is ModelState.ACTIVE:
            finished.append(now)

    def recorded_place(cluster, now, memo=None):
        placed.append(now)
        return place(cluster, now, memo)

    def on_tick(now: float) -> None:
        ticks.append(now)
        tick(now)

    sim.on_activation_done, sim.loop.policy.place, sim.on_tick = on_activation_done, recorded_place, on_tick
    res = sim.run()
    assert len(res.requests) == len(w) and all(r.ttft is not None for r in res.requests)
    return finished, placed, ticks, sim.now


def test_placements_after_activations_are_coalesced():
    """The placement after a finished activation (the policy contract's) waits
    ``placement_coalesce_s`` and serves every activation that finishes meanwhile; a tick in between
    makes it unneeded. At 0 each activation is followed by its own placement at once."""
    finished, placed, ticks, _ = _placements_after_activations(0.0)
    assert len(finished) > 20  # the models take turns
    extra = sorted(set(placed) - set(ticks))
    assert extra == sorted(set(finished) - set(ticks))  # one placement at every finish, right then
    w = 2.0  # two fifths of a tick, so that both ways a placement comes are seen
    finished, placed, ticks, end = _placements_after_activations(w)
    extra = [t for t in placed if t not in ticks]
    assert 0 < len(extra) < len(finished) - 5
    for a in finished:  # every finished activation is placed after, within the window (the run
        # ends when its last request does, with the placement after the last activation due)
        assert any(a <= p <= a + w for p in placed) or a + w > end, a
    for p in extra:  # a coalesced placement comes the window after a finish no tick has seen yet
        first = min(a for a in finished if a >= p - w - 1e-9)
        assert first == pytest.approx(p - w)
        assert not any(first <= t < p for t in ticks)


def test_a_groups_inputs_are_judged_once_met_only_if_every_one_is():
    """An embed request's inputs (one group, Workload.groups) answer the client together: the run
    judges the group once, and a miss of any input misses it. Eight inputs arriving while the
    model activates all miss: one miss, not eight, for attainment and for the early stop."""
    m = served()
    n_alone = 40
    times = np.r_[np.zeros(8), 30.0 + np.arange(n_alone)]
    groups = np.r_[np.full(8, 0), np.full(n_alone, -1)]
    w = Workload(times, np.zeros(len(times), dtype=np.int32), np.full(len(times), 128), np.ones(len(times)),
                 [m.name], groups=groups)  # fmt: skip
    alone = Workload(w.timestamps, w.model_index, w.prompt_tokens, w.output_tokens, w.models)
    slo = {m.name: ModelSLO(ttft_s=0.5, tpot_s=1.0)}  # the activation at the start takes longer
    cfg = SimConfig(num_devices=1, policy="prism", warmup_s=0.0)
    grouped, each = simulate([m], w, slo, cfg), simulate([m], alone, slo, cfg)
    assert [r.group for r in grouped.requests[:9]] == [0] * 8 + [-1]
    assert all(r.ttft > 0.5 for r in each.requests[:8]) and all(r.ttft <= 0.5 for r in each.requests[8:])
    g, e = grouped.summary(), each.summary()
    assert (g["num_judged"], e["num_judged"]) == (n_alone + 1, n_alone + 8)
    assert g["ttft_attainment"] == pytest.approx(n_alone / (n_alone + 1))
    assert e["ttft_attainment"] == pytest.approx(n_alone / (n_alone + 8))
    assert (
        g["ttft_misses_cold"] + g["ttft_misses_warm"] == 1 and grouped.per_model()[m.name]["ttft_misses"] == 1
    )
    # stopping once more than one judgement missed: the group is one miss, eight lone inputs eight
    stop = dataclasses.replace(cfg, stop_after_ttft_misses=1)
    assert not simulate([m], w, slo, stop).labels.get("stopped_early")
    assert simulate([m], alone, slo, stop).labels.get("stopped_early")
