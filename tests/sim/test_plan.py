"""``prism plan`` (sim/plan.py): the device search where attainment is not monotone, early stops of
points that already failed, and the whole command on a preset config and a workload file: its
answers, its outputs, and the deployment it writes, which ``prism serve`` reads."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.cli import main
from prism_serve.config import load_config, parse_config
from prism_serve.engine.config import ENGINE_DEFAULTS
from prism_serve.runtime.build import model_specs
from prism_serve.sim import ModelSLO, SimConfig
from prism_serve.sim.cost import RooflineCostModel
from prism_serve.sim.deployment import SimDeployment, deployment_config, get_setup, sim_deployment
from prism_serve.sim.errors import SimConfigError
from prism_serve.sim.hardware import get_hardware
from prism_serve.sim.plan import (
    busy_window,
    exclusive_floor,
    fewest_passing,
    plan,
    simulate_point,
    with_expected_rates,
)
from prism_serve.sim.simulator import Simulator
from prism_serve.workload import Workload, WorkloadSpec, build_workload, read_jsonl, write_jsonl

from .helpers import loose, poisson, served


def counting(passing: set[int]):
    asked: list[int] = []

    def passes(counts):
        asked.extend(counts)
        return {n: n in passing for n in counts}

    return passes, asked


def test_the_search_sweeps_where_attainment_is_not_monotone() -> None:
    passes, asked = counting({5, 7, 8, 9, 10, 11, 12})  # 5 passes, 6 does not: the answer is 7
    assert fewest_passing(passes, 1, 12, confirm=2) == 7
    assert len(asked) == len(set(asked))  # each count simulated once
    passes, _ = counting(set(range(4, 13)))
    assert fewest_passing(passes, 1, 12) == 4  # monotone: the first pass
    passes, _ = counting({12})
    assert fewest_passing(passes, 1, 12) == 12  # the last count passes: nothing above to confirm
    passes, _ = counting(set())
    assert fewest_passing(passes, 1, 12) is None
    # a pass between two failures far apart (static partitioning on the 58-model hour: 19-21 pass,
    # 26 fails): found, where doubling steps from 18 to 26 would skip it
    passes, asked = counting({19, 20, 21, *range(28, 100)})
    assert fewest_passing(passes, 8, 99) == 19 and sorted(asked) == list(range(8, 22))


@settings(max_examples=300, deadline=None)
@given(
    passing=st.sets(st.integers(1, 60)),
    low=st.integers(1, 30),
    confirm=st.integers(0, 3),
    width=st.integers(1, 3),
)
def test_the_answer_is_the_fewest_count_that_passes_with_its_neighbours_above(passing, low, confirm, width):
    """Any pattern of passing counts: the answer is exactly the fewest count that passes with its
    ``confirm`` counts above it, every count below it was simulated, and no count is simulated twice."""
    high = 60

    def answers(m: int) -> bool:
        return m in passing and all(k in passing for k in range(m + 1, min(high, m + confirm) + 1))

    passes, asked = counting(passing)
    n = fewest_passing(passes, low, high, confirm=confirm, width=width)
    assert n == min((m for m in range(low, high + 1) if answers(m)), default=None)
    assert len(asked) == len(set(asked))
    if n is not None:
        assert set(range(low, n)) <= set(asked)  # every count below it was simulated


@settings(max_examples=400, deadline=None)
@given(
    passing=st.sets(st.integers(1, 60)),
    first=st.one_of(st.none(), st.integers(1, 61)),  # monotone from ``first`` on, or any pattern
    low=st.integers(1, 30),
    confirm=st.integers(0, 3),
    width=st.integers(1, 3),
    sweep=st.integers(0, 12),
    stride=st.one_of(st.none(), st.integers(1, 3)),
)
def test_past_its_sweep_the_search_steps_and_still_answers_a_count_that_passes_with_its_neighbours(
    passing, first, low, confirm, width, sweep, stride
) -> None:
    """With ``sweep`` counts swept and steps past them: the answer passes with its ``confirm``
    counts above, the count below it was asked and failed (or it is the floor), no count is asked
    twice; where attainment is monotone the answer is exactly the fewest, found in a number of
    simulations logarithmic in its distance from the sweep."""
    high = 60
    if first is not None:
        passing = set(range(first, high + 1))
    passes, asked = counting(passing)
    n = fewest_passing(passes, low, high, confirm=confirm, width=width, sweep=sweep, stride=stride)
    assert len(asked) == len(set(asked))
    # the sweep: every count up to the answer
    assert set(range(low, min(high, low + sweep - 1, high if n is None else n) + 1)) <= set(asked)
    if n is not None:
        assert n in passing and set(range(n + 1, min(high, n + confirm) + 1)) <= passing & set(asked)
        assert n == low or (n - 1 in asked and n - 1 not in passing)
    if first is not None:
        fewest = first if first <= high else None
        if fewest is not None and fewest < low:
            fewest = low
        assert n == fewest
        beyond = [k for k in asked if k >= low + sweep]
        assert len(beyond) <= 2 * (max(1, stride or width)) * (math.log2(high) + 2) + confirm


def test_stepping_spares_the_counts_far_from_the_answer() -> None:
    """500 models' shape: the floor at 13, the answer at 67. A sweep asks all 57 counts; past a
    sweep of 10 the search asks 23 (the cheap ones far below the answer among them), the same
    answer, and the count below it fails."""
    passes, asked = counting(set(range(67, 200)))
    assert fewest_passing(passes, 13, 150) == 67 and len(asked) == 57
    passes, asked = counting(set(range(67, 200)))
    assert fewest_passing(passes, 13, 150, width=2, sweep=10, stride=1) == 67
    assert set(range(13, 23)) <= set(asked) and {66, 67, 68, 69} <= set(asked) and len(asked) <= 24
    # a pass below the answer that steps went past: not found (a sweep of every count finds it)
    passes, asked = counting({40, 41, 42, *range(67, 200)})
    assert fewest_passing(passes, 13, 150, sweep=10) == 67 and 40 not in asked
    passes, asked = counting({40, 41, 42, *range(67, 200)})
    assert fewest_passing(passes, 13, 150) == 40


def test_a_narrow_bisection_asks_the_confirm_counts_with_its_last_count() -> None:
    """Two workers, a gap of 2 between the highest failure and the lowest pass: the count between
    them and the nearer confirm count above the pass go together (that one is needed whichever way
    the count between goes; where it passes, nothing is left to ask); with one worker they go one
    by one."""
    for answer in (29, 30):
        batches: list[list[int]] = []

        def passes(counts, answer=answer, batches=batches):
            batches.append(sorted(counts))
            return {n: n >= answer for n in counts}

        assert fewest_passing(passes, 13, 150, width=2, sweep=10, stride=2) == answer
        assert [29, 31] in batches  # 28 failed and 30 passed: 29 and 30's confirm count 31
        asked = [n for b in batches for n in b]
        assert len(asked) == len(set(asked))
    batches = []

    def one_by_one(counts):
        batches.append(sorted(counts))
        return {n: n >= 29 for n in counts}

    assert fewest_passing(one_by_one, 13, 150, width=2, sweep=10, stride=1) == 29
    assert all(len(b) == 1 for b in batches[5:]) and [29] in batches and [31] in batches


def screening(maybe: set[int]):
    asked: list[int] = []

    def screen(counts):
        asked.extend(counts)
        return {n: n in maybe for n in counts}

    return screen, asked


@settings(max_examples=300, deadline=None)
@given(
    passing=st.sets(st.integers(1, 60)),
    false_hopes=st.sets(st.integers(1, 60)),
    low=st.integers(1, 30),
    confirm=st.integers(0, 3),
    width=st.integers(1, 3),
)
def test_a_screen_spares_full_runs_and_keeps_the_answer(passing, false_hopes, low, confirm, width):
    """A screen that never fails a passing count (it may pass failing ones): a count it fails is
    never run in full, and the answer is the one without the screen."""
    high = 60
    plain, _ = counting(passing)
    without = fewest_passing(plain, low, high, confirm=confirm, width=width)
    screen, screened = screening(passing | false_hopes)
    passes, asked = counting(passing)
    n = fewest_passing(passes, low, high, confirm=confirm, width=width, screen=screen)
    assert n == without
    assert len(screened) == len(set(screened)) and len(asked) == len(set(asked))
    assert set(asked) <= (passing | false_hopes) & set(screened)  # run in full only after its screen


def test_a_point_stops_once_its_misses_pass_the_limit() -> None:
    ms = [served(f"m{i}", "llama-3.1-8b") for i in range(6)]
    w = poisson([m.name for m in ms], 2.0, 120.0, prompt=(512, 2048), output=(64, 256), seed=1)
    cfg = SimConfig(num_devices=1, policy="prism")
    full = Simulator(ms, w, loose(ms, ttft=0.5, tpot=0.1), cfg).run()
    stopped = Simulator(
        ms, w, loose(ms, ttft=0.5, tpot=0.1), SimConfig(num_devices=1, stop_after_ttft_misses=20)
    ).run()
    missed = sum(1 for r in full.requests if not (r.first_token is not None and r.ttft <= r.ttft_slo))
    assert missed > 20 and not full.labels["stopped_early"]
    assert stopped.labels["stopped_early"] and stopped.end_time < full.end_time


def burst_traffic(names: list[str], late: int | None = None) -> Workload:
    """Twenty minutes of light traffic with a one-minute burst in the middle (synthetic); ``late``:
    30 more requests of that model, all before the burst."""
    rng = np.random.default_rng(0)
    ts = np.concatenate([rng.uniform(0, 1200, 900), rng.uniform(600, 660, 700)])
    idx = rng.integers(0, len(names) - (late is not None), len(ts))
    if late is not None:
        ts, idx = np.concatenate([ts, np.linspace(10, 540, 30)]), np.concatenate([idx, np.full(30, late)])
    return Workload(ts, idx, rng.integers(512, 2048, len(ts)), rng.integers(32, 128, len(ts)), names)


def burst_deployment(names: list[str], slos: dict[str, ModelSLO] | None = None) -> SimDeployment:
    ms = [served(name, "llama-3.1-8b") for name in names]
    slos = {**loose(ms, ttft=0.5, tpot=0.2), **(slos or {})}
    return SimDeployment(ms, slos, sim_deployment(deployment_config("paper-8")).engine, "prism", ())


SCREEN = {"screen": True, "screen_window_s": 60.0, "screen_warmup_s": 30.0}  # the burst, and 30 s before


@pytest.fixture
def every_count(monkeypatch):
    """Dedicated swept from the hard floor, as a policy whose models share devices is: the screen's
    tests need the counts below dedicated's own floor (``exclusive_floor``) to be screened."""
    from prism_serve.control.policies import DedicatedPolicy

    monkeypatch.setattr(DedicatedPolicy, "exclusive_devices", False)


def test_a_count_whose_busy_window_misses_too_much_is_not_run_in_full(every_count) -> None:
    names = ["m0", "m1", "m2", "m3"]
    w, dep = burst_traffic(names), burst_deployment(names)
    window = busy_window(w, 60.0, 30.0)
    assert 595 < w.timestamps[window.first] and w.timestamps[window.end - 1] < 660  # noqa: SIM300
    result = plan(dep, w, hardware="h100", policies=["dedicated"], max_devices=6, jobs=1, **SCREEN)
    p = result.policies["dedicated"]
    out = sorted(n for n, pt in p.points.items() if pt["screened_out"])
    assert out == [1, 2, 3] and p.devices == 4  # one device per model: the burst's misses vanish
    for n in out:  # the window alone missed more than the whole traffic may: no full run
        screen = p.points[n]["screen"]
        assert screen["misses"] > screen["budget"] == int(0.01 * len(w)) and "per_model" not in p.points[n]
        stop = p.points[n]["stopped"]  # failed on the window alone: reported over what it saw
        assert (stop["how"], stop["requests"], stop["misses"]) == ("screen", len(w), screen["misses"])
        seen = stop["requests_seen"]  # the window's, up to where its own run stopped
        assert 0 < seen <= window.end - window.first
        assert p.points[n]["ttft_attainment"] == stop["attainment_seen"] < 0.99
        assert stop["attainment_seen"] == pytest.approx((seen - screen["misses"]) / seen)
        assert stop["attainment_at_most"] == (len(w) - screen["misses"]) / len(w)
    assert not p.answer["screened_out"] and p.answer["ttft_attainment"] >= 0.99 and "per_model" in p.answer
    assert "stopped" not in p.answer
    unscreened = plan(dep, w, hardware="h100", policies=["dedicated"], max_devices=6, jobs=1)  # the default
    assert unscreened.policies["dedicated"].devices == 4
    assert all("screened_out" not in pt for pt in unscreened.policies["dedicated"].points.values())


def test_a_count_that_passes_its_screen_is_decided_by_its_full_run(every_count) -> None:
    """Misses outside the window: a model whose TTFT SLO nothing meets, with requests only before
    the burst (more than the target allows). The screens at enough devices pass; the full runs fail."""
    names = ["m0", "m1", "m2", "m3", "late"]
    w = burst_traffic(names, late=4)
    dep = burst_deployment(names, {"late": ModelSLO(1e-4, 0.2)})
    result = plan(dep, w, hardware="h100", policies=["dedicated"], max_devices=6, jobs=1, **SCREEN)
    p = result.policies["dedicated"]
    assert p.devices is None
    hopeful = [n for n, pt in p.points.items() if not pt["screened_out"]]
    screens = [p.points[n]["screen"] for n in hopeful]
    assert hopeful and all(screen["misses"] <= screen["budget"] for screen in screens)
    assert all(p.points[n]["ttft_attainment"] < 0.99 and "per_model" in p.points[n] for n in hopeful)
    # the late model's misses pass the budget before the burst: every full run stops there and is
    # reported as failed, over the requests it saw (not as if the rest had all been missed)
    budget = int(0.01 * len(w))
    for n in hopeful:
        pt = p.points[n]
        stop = pt["stopped"]
        assert stop["how"] == "misses" and stop["requests"] == len(w) == pt["num_requests"]
        assert stop["misses"] > budget and stop["at_s"] < 600  # before the burst
        seen = stop["requests_seen"]
        assert 0 < seen < int(np.searchsorted(w.timestamps, 600.0))  # it saw none of the burst
        assert pt["ttft_attainment"] == stop["attainment_seen"]
        assert stop["attainment_seen"] == pytest.approx((seen - stop["misses"]) / seen)
        assert stop["attainment_at_most"] == pytest.approx(1 - stop["misses"] / len(w))
        # what the search used to report: as if every unseen request had missed
        assert pt["ttft_attainment"] > (seen - stop["misses"]) / len(w)


def test_presets_are_deployment_configs() -> None:
    config = deployment_config("paper-58")
    assert len(config.models) == 58 and sorted({m.tp for m in config.models}) == [1, 4, 8]
    models = get_setup("paper-58")
    assert sum(m.spec.weight_bytes for m in models) == pytest.approx(820e9, rel=0.02)
    assert [m.tp_size for m in models if m.tp_size > 1] == [4, 4, 4, 8]
    cpu = sim_deployment(deployment_config("cpu-2"), gpu=False)
    assert cpu.models[0].spec.dtype_bytes == 4 and cpu.engine.max_num_seqs == ENGINE_DEFAULTS.max_num_seqs
    # simulated GPUs run a GPU engine's batch (as prism sim does) unless the config sets one
    gpu = sim_deployment(config)
    assert (gpu.engine.max_num_seqs, gpu.engine.max_num_batched_tokens) == (256, 8192)
    text = 'devices: [{name: "cuda:0", memory: 72GiB}]\n'
    text += 'models: [{name: a, source: "random:llama-3.2-1b", max_num_seqs: 64}]\n'
    assert sim_deployment(parse_config(text)).engine.max_num_seqs == 64


@pytest.fixture(scope="module")
def traffic(tmp_path_factory, traces) -> Path:
    """Four minutes of real-trace traffic for the paper's 8 models (the full traces when present,
    else the committed excerpts)."""
    path = tmp_path_factory.mktemp("plan") / "w.jsonl"
    names = tuple(m.name for m in get_setup("paper-8"))
    spec = WorkloadSpec(names, duration_s=240.0, total_rate=6.0, seed=2, traces_dir=traces.root)
    write_jsonl(build_workload(spec), path)
    return path


def test_plan_answers_every_policy_and_writes_a_servable_deployment(
    traffic: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "plan"
    code = main([
        "plan", "--config", "paper-8", "--traffic", str(traffic), "--slo-scale", "5",
        "--price-per-device-hour", "2", "--out", str(out), "--jobs", "1", "--confidence", "0.8",
        "--seeds", "5",
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "| prism |" in printed and "| dedicated |" in printed and "[simulated: h100" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["simulated"] and set(results["policies"]) == {
        "prism",
        "static-partition",
        "dedicated",
        "muxserve",
    }
    bound = results["lower_bound"]["devices"]
    for name, p in results["policies"].items():
        n = p["devices"]
        assert n is not None and n >= bound, name
        assert p["points"][str(n)]["ttft_attainment"] >= 0.99
        assert p["monthly_cost"] == pytest.approx(n * 2 * 730)
        # the fewest: every smaller count tried failed
        assert all(pt["ttft_attainment"] < 0.99 for k, pt in p["points"].items() if int(k) < n), name
    dedicated = results["policies"]["dedicated"]["devices"]
    assert (
        results["policies"]["prism"]["saves_against"]["dedicated"]
        == dedicated - results["policies"]["prism"]["devices"]
    )
    assert (out / "plan.png").stat().st_size > 1000
    assert not (out / "progress.json").exists()  # what the running plan kept: in results.json now
    page = (out / "plan.html").read_text()
    assert "<svg" in page and "prism plan" in page
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page) and "<link" not in page  # nothing fetched
    # prism, the config's policy, is also planned with 80% confidence: the count it deploys passes on
    # 4 of 5 other draws of the traffic, and is never below the plain answer
    sure = results["policies"]["prism"]["confidence"]
    assert sure["level"] == 0.8 and sure["seeds"] == 5 and sure["need"] == 4 and sure["step_errors"] == 0
    assert sure["devices"] >= results["policies"]["prism"]["devices"]
    assert sure["counts"][str(sure["devices"])]["passed"] >= 4
    assert all(c["passed"] < 4 for n, c in sure["counts"].items() if int(n) < sure["devices"])
    assert all(p["confidence"] is None for name, p in results["policies"].items() if name != "prism")
    assert f"prism with 80% confidence: **{sure['devices']} devices**" in printed
    assert "the profile records no measured step error" in printed
    deployment = load_config(out / "prism.yaml")  # what prism serve --config reads
    assert len(deployment.devices) == sure["devices"]
    assert "on at least 4 of 5 draws" in (out / "prism.yaml").read_text()
    assert [m.name for m in deployment.models] == [m.name for m in deployment_config("paper-8").models]
    assert len(model_specs(deployment)) == 8
    # each model is told the rate the plan simulated it at: its mean rate in the traffic
    rates = read_jsonl(traffic, tuple(m.name for m in deployment.models)).mean_rates()
    assert {m.name: m.expected_rate for m in deployment.models} == pytest.approx(rates, abs=1e-6)
    assert {s.name: s.expected_rate for s in model_specs(deployment)} == pytest.approx(rates, abs=1e-6)


def test_expected_rates_fill_only_what_the_config_leaves_unset(traffic: Path) -> None:
    config = deployment_config("paper-8")
    first = config.models[0].name
    config = config.model_copy(
        update={"models": [config.models[0].model_copy(update={"expected_rate": 7.5}), *config.models[1:]]}
    )
    w = read_jsonl(traffic, tuple(m.name for m in config.models))
    filled, count = with_expected_rates(config, w)
    assert count == len(config.models) - 1
    got = {m.name: m.expected_rate for m in filled.models}
    assert got[first] == 7.5  # the user's own stays
    assert all(got[n] == pytest.approx(r, abs=1e-6) for n, r in w.mean_rates().items() if n != first)
    # the simulated deployment carries them to the simulator's rate estimator
    assert {m.name: m.expected_rate for m in sim_deployment(filled).models} == got


def test_plan_refuses_traffic_for_models_it_does_not_serve(traffic: Path, tmp_path: Path, capsys) -> None:
    config = tmp_path / "prism.yaml"
    config.write_text(
        'devices: [{name: "cuda:0", memory: 72GiB}]\n'
        'models:\n  - {name: llama-3.2-1b-00, source: "random:llama-3.2-1b"}\n'
    )
    assert main(["plan", "--config", str(config), "--traffic", str(traffic)]) == 2
    err = capsys.readouterr().err
    assert "does not serve: llama-3" in err and "--ignore-unknown" in err and "Traceback" not in err
    assert (
        main(
            [
                "plan",
                "--config",
                str(config),
                "--traffic",
                str(traffic),
                "--ignore-unknown",
                "--policies",
                "prism",
                "--jobs",
                "1",
            ]
        )
        == 0
    )
    assert "| prism | 1 |" in capsys.readouterr().out


def test_a_model_whose_shape_cannot_be_read_is_named(traffic: Path, tmp_path: Path, capsys) -> None:
    config = tmp_path / "prism.yaml"
    devices = 'devices: [{name: "cuda:0", memory: 72GiB}]\n'
    config.write_text(devices + f'models:\n  - {{name: mine, source: "{tmp_path}/none"}}\n')
    assert main(["plan", "--config", str(config), "--traffic", str(traffic)]) == 2
    assert "model mine: cannot read its shape" in capsys.readouterr().err


def test_only_the_chosen_policy_runs_with_the_expected_rates_it_will_be_deployed_with() -> None:
    """The expected rates go into the deployment written for the chosen policy; the baselines are
    what the user runs today, as configured. Dedicated places the busiest models first: told that
    only c is asked for, one device serves it; as configured (no rate known at start) it takes a
    device per model, c last."""
    ms = [served(n, "llama-3.1-8b") for n in ("a", "b", "c")]
    n = 40
    w = Workload(np.arange(n) * 3.0, np.full(n, 2), np.full(n, 300), np.full(n, 20), ["a", "b", "c"])
    dep = SimDeployment(ms, loose(ms, ttft=2.0, tpot=0.2), ENGINE_DEFAULTS, "prism", ())
    rates = {"a": 0.0, "b": 0.0, "c": n / w.duration}

    def dedicated(chosen: str, expected) -> dict:
        result = plan(
            dep, w, hardware="h100", policies=["prism", "dedicated"], jobs=1, chosen=chosen,
            expected_rates=expected, max_devices=3,
        )  # fmt: skip
        p = result.policies["dedicated"]
        return {"devices": p.devices, **{k: v["ttft_attainment"] for k, v in p.points.items()}}

    as_configured = dedicated("prism", None)
    assert as_configured["devices"] == 3 and as_configured[2] == 0.0
    assert dedicated("prism", rates) == as_configured
    assert dedicated("dedicated", rates)["devices"] == 1


def test_plan_in_process_matches_the_command(traffic: Path) -> None:
    """The library call the command makes, with a target no policy can meet on the devices allowed:
    no answer, never a wrong one."""
    dep = sim_deployment(deployment_config("paper-8"))
    w = read_jsonl(traffic, tuple(m.name for m in dep.models))
    result = plan(dep, w, hardware="h100", target=1.0, policies=["dedicated"], max_devices=3, jobs=1)
    got = result.policies["dedicated"]
    assert got.devices is None and all(n <= 3 for n in got.points)
    # no request may miss: dedicated needs a device per model, and 3 hold 3 of the 8 (none simulated)
    assert got.sweep_from == sum(m.tp_size for m in dep.models) > 3 and not got.points
    with pytest.raises(SimConfigError, match="unknown policy fifo"):
        plan(dep, w, hardware="h100", policies=["prism", "fifo"], jobs=1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 400), st.sampled_from([1, 2, 4])), min_size=1, max_size=7),
    st.integers(0, 300),
)
def test_the_exclusive_floor_skips_only_counts_every_choice_of_models_fails(items, budget) -> None:
    """Against every set of models that could hold devices at once (brute force): below the floor,
    each leaves more than ``budget`` requests unserved."""
    import itertools

    names = [f"m{i}" for i in range(len(items))]
    idx = np.concatenate([np.full(k, i) for i, (k, _) in enumerate(items)] + [np.zeros(0, int)])
    n = len(idx)
    w = Workload(np.arange(n, dtype=float), idx.astype(int), np.full(n, 8), np.full(n, 8), names)
    ms = [served(name, "llama-3.2-1b", tp) for name, (_, tp) in zip(names, items, strict=True)]
    floor = exclusive_floor(ms, w, budget)
    for devices in range(1, floor):
        for size in range(len(items) + 1):
            for chosen in itertools.combinations(range(len(items)), size):
                if sum(items[i][1] for i in chosen) <= devices:
                    assert n - sum(items[i][0] for i in chosen) > budget


def test_dedicated_sweeps_from_its_floor_and_answers_as_a_sweep_from_one() -> None:
    """Dedicated gives each model devices of its own: the counts below its floor are not simulated,
    each of them fails when it is, and the answer is the one a sweep from one device finds."""
    ms = [served(f"m{i}", "llama-3.2-1b", tp) for i, tp in enumerate([1, 1, 2, 1, 1, 1])]
    rates = [1.0, 0.6, 0.4, 0.05, 0.02, 0.01]  # a long tail (synthetic Poisson traffic)
    parts = [
        poisson([m.name], r, 300.0, prompt=64, output=8, seed=i)
        for i, (m, r) in enumerate(zip(ms, rates, strict=True))
    ]
    ts = np.concatenate([p.timestamps for p in parts])
    order = np.argsort(ts, kind="stable")
    idx = np.concatenate([np.full(len(p), i) for i, p in enumerate(parts)])[order]
    prompts = np.concatenate([p.prompt_tokens for p in parts])[order]
    outputs = np.concatenate([p.output_tokens for p in parts])[order]
    w = Workload(ts[order], idx, prompts, outputs, [m.name for m in ms])
    dep = SimDeployment(ms, loose(ms), sim_deployment(deployment_config("paper-8")).engine, "prism", ())
    budget = int(0.01 * len(w))
    floor = exclusive_floor(ms, w, budget)
    assert 1 < floor <= 7
    result = plan(dep, w, hardware="h100", policies=["dedicated"], max_devices=9, jobs=1)
    got = result.policies["dedicated"]
    assert got.sweep_from == floor and min(got.points) == floor
    attained = {
        n: simulate_point(dep, w, hardware="h100", policy="dedicated", devices=n)["ttft_attainment"]
        for n in range(1, 10)
    }
    assert all(attained[n] < 0.99 for n in range(1, floor))
    assert got.devices == fewest_passing(lambda ns: {n: attained[n] >= 0.99 for n in ns}, 1, 9)


def test_a_tensor_parallel_model_wider_than_the_devices_misses_its_requests() -> None:
    """At fewer devices than a model's TP degree that model cannot run: the point simulates the
    others and counts its requests as missed (planning and ``prism sim --sweep gpus`` alike)."""
    from prism_serve.sim.plan import _Job, _run
    from prism_serve.sim.sweep import Experiment, run_point

    ms = [served("small", "llama-3.2-1b"), served("wide", "llama-3.2-1b", 2)]
    w = poisson(["small", "wide"], 0.5, 60.0, prompt=64, output=8, seed=4)
    wide = int((w.model_index == 1).sum())
    slos = loose(ms)
    point = _run(_Job(tuple(ms), w, slos, SimConfig(num_devices=1)))
    assert point["num_requests"] == len(w) and point["ttft_attainment"] == pytest.approx(1 - wide / len(w))
    row = run_point(Experiment(ms, w, slos, SimConfig(num_devices=2), slo_scale=1.0), "prism", "gpus", 1)
    assert row["num_requests"] == len(w) and row["num_rejected"] >= wide


def test_adapters_are_their_bases_load_with_their_cost(tmp_path: Path, traces, capsys) -> None:
    """A config with LoRA adapters plans: their requests are their base's (the traffic names them),
    the base's shape holds its adapter slots and computes with an adapter's weights, and the
    deployment written keeps the adapters."""
    for name, rank, targets in (("a1", 16, ["q_proj", "v_proj"]), ("a2", 8, "all-linear-ish")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": rank, "target_modules": targets})
        )
    config = tmp_path / "prism.yaml"
    config.write_text(
        'devices: [{name: "cuda:0", memory: 72GiB}]\n'
        "models:\n"
        '  - {name: base, source: "random:llama-3.2-1b", max_loras: 4, max_lora_rank: 16}\n'
        f'  - {{name: a1, base: base, adapter: "{tmp_path / "a1"}"}}\n'
        f'  - {{name: a2, base: base, adapter: "{tmp_path / "nowhere"}"}}\n'
        '  - {name: other, source: "random:llama-3.2-1b"}\n'
    )
    d = sim_deployment(load_config(config))
    assert [m.name for m in d.models] == ["base", "other"] and d.aliases == {"a1": "base", "a2": "base"}
    base, other = d.models[0].spec, d.models[1].spec
    c = base.config
    per_rank = c.num_layers * sum(sum(s) for s in c.projection_shapes().values())
    assert base.adapter_slot_bytes == 4 * 16 * per_rank * 2  # 4 slots of rank 16, bf16
    assert base.weight_bytes == other.weight_bytes + base.adapter_slot_bytes
    # a1: rank 16 on q and v; a2 unreadable here: costed at rank 16 on every projection (the larger)
    assert base.adapter_params == 16 * per_rank and any("a2" in w for w in d.warnings)
    assert base.matmul_flops_per_token == other.matmul_flops_per_token + 2 * 16 * per_rank
    path = tmp_path / "w.jsonl"
    spec = WorkloadSpec(("base", "a1", "a2", "other"), duration_s=120.0, total_rate=2.0, seed=1,
                        traces_dir=traces.root)  # fmt: skip
    write_jsonl(build_workload(spec), path)
    out = tmp_path / "plan"
    code = main(["plan", "--config", str(config), "--traffic", str(path), "--slo-scale", "5",
                 "--policies", "prism,dedicated", "--out", str(out), "--jobs", "1"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["num_requests"] == len(build_workload(spec))  # the adapters' requests counted
    written = load_config(out / "prism.yaml")
    assert [(a.name, a.base) for a in written.adapters()] == [("a1", "base"), ("a2", "base")]


def test_a_baseline_is_answered_at_its_first_passing_count_and_prism_is_confirmed(monkeypatch) -> None:
    """Both policies pass at 3 devices, fail at 4 and pass from 5 on (the runs are stand-ins): a
    baseline may keep its 3-device assignment on 4 and leave one idle, prism must hold up itself."""
    import prism_serve.sim.plan as plan_mod
    from prism_serve.control.policies import POLICIES

    assert {n for n, p in POLICIES.items() if p.keeps_fewer_devices} == {
        "static-partition", "muxserve", "dedicated", "qlm",
    }  # fmt: skip
    names = ["m0", "m1"]
    w = burst_traffic(names)
    dep = burst_deployment(names)
    asked: dict[str, list[int]] = {}  # by policy and packing

    def stand_in(job) -> dict:
        n = job.config.num_devices
        asked.setdefault(job.config.policy + str(dict(job.config.knobs).get("packing", "")), []).append(n)
        met = 0.5 if n < 3 or n == 4 else 1.0
        if dict(job.config.knobs).get("packing") == "memory":  # static-partition's other packing
            met = 1.0 if n >= 4 else 0.5
        return {"num_devices": n, "ttft_attainment": met, "tpot_attainment": met, "num_requests": len(w)}

    monkeypatch.setattr(plan_mod, "_run", stand_in)
    result = plan(dep, w, hardware="h100", policies=["prism", "static-partition"], max_devices=9, jobs=1)
    base, prism = result.policies["static-partition"], result.policies["prism"]
    assert (base.devices, base.confirmed) == (3, 0) and max(asked["static-partitiondemand"]) == 3
    assert (prism.devices, prism.confirmed) == (5, 2) and {3, 4, 5, 6, 7} <= set(asked["prism"])
    assert result.saving("prism", "static-partition") == -2  # counted against the baseline's best
    assert result.as_dict()["policies"]["static-partition"]["confirmed"] == 0
    # both of its packings were searched; the one that needs fewer devices answers, and is written
    assert base.variant == {"packing": "demand"}
    assert base.variants == [({"packing": "demand"}, 3), ({"packing": "memory"}, 4)]
    assert result.provisioned["static-partition"]["packing"] == "demand"
    assert "rates" in result.provisioned["static-partition"] and result.provisioned["prism"] == {}


def _stand_in_runs(monkeypatch, w: Workload) -> None:
    """Plan points without simulating: counts below 3 miss half the requests, count 4 stops early,
    the others meet every one."""
    import prism_serve.sim.plan as plan_mod

    def stand_in(job) -> dict:
        n = job.config.num_devices
        met = 0.5 if n < 3 else 1.0
        point = {"num_devices": n, "ttft_attainment": met, "tpot_attainment": met, "num_requests": len(w)}
        if n == 4:
            point["stopped"] = {"after_s": 10.0}
        return {**point, "wall_s": 0.01 * n}

    monkeypatch.setattr(plan_mod, "_run", stand_in)


def test_a_running_plan_shows_and_keeps_each_count_it_has_decided(monkeypatch, tmp_path: Path) -> None:
    from prism_serve.sim.plan_report import PROGRESS_FILE, PlanProgress

    names = ["m0", "m1"]
    w = burst_traffic(names)
    dep = burst_deployment(names)
    _stand_in_runs(monkeypatch, w)
    lines: list[str] = []
    found = PlanProgress("ttft", 0.99, tmp_path / "out", lines.append)
    result = plan(dep, w, hardware="h100", policies=["prism", "static-partition"], max_devices=9, jobs=1,
                  on_point=found)  # fmt: skip
    # every sweep, each packing of static partitioning apart, with every count the plan simulated
    packings = {f"static-partition packing={p}" for p in ("demand", "memory")}
    assert set(found.points) == {"prism", *packings}
    prism, base = result.policies["prism"], result.policies["static-partition"]
    assert set(found.points["prism"]) == set(prism.points)
    assert set(found.points[f"static-partition packing={base.variant['packing']}"]) == set(base.points)
    for label, points in found.points.items():
        for n, e in points.items():
            assert e["passed"] == (n >= 3 and n != 4), (label, n)
            assert e["stopped"] == ({"after_s": 10.0} if n == 4 else None)
            assert e["wall_s"] == pytest.approx(0.01 * n)
    # prism fails at 4 (stopped), so it answers 5 once 6 and 7 pass
    assert prism.devices == 5 and found.points["prism"][5]["attainment"] == 1.0
    assert len(lines) == sum(len(p) for p in found.points.values())  # one line per point
    assert lines[-1] == found.summary() and "prism 7: 100.00%" in found.summary()
    kept = json.loads((tmp_path / "out" / PROGRESS_FILE).read_text())
    assert kept == {k: {str(n): e for n, e in v.items()} for k, v in found.points.items()}
    found.done()  # the report has it all
    assert not (tmp_path / "out" / PROGRESS_FILE).exists()
    found("qlm", 4, {"ttft_attainment": 0.97, "stopped": {"after_s": 1.0}, "wall_s": 1.0})
    assert found.summary().endswith("; qlm 4: stopped at 97.00%")


def test_a_plan_that_steps_past_its_sweep_says_which_counts_it_did_not_try(monkeypatch) -> None:
    """Both policies pass from 29 devices on (stand-in runs, the cost of a run growing with its
    count): swept one by one from the floor for 3 counts, then stepped. Each answer is the fewest
    count that passes and the one below it failed; the counts stepped over are listed in the plan,
    results.json and the report, and a sweep of every count finds the same answers."""
    import prism_serve.sim.plan as plan_mod
    from prism_serve.sim.plan_report import format_plan

    names = ["m0", "m1"]
    w = burst_traffic(names)
    dep = burst_deployment(names)
    asked: list[tuple[str, int]] = []

    def stand_in(job) -> dict:
        n = job.config.num_devices
        asked.append((job.config.policy, n))
        met = 1.0 if n >= 29 else 0.5
        return {"num_devices": n, "ttft_attainment": met, "tpot_attainment": met, "num_requests": len(w),
                "per_model": {}}  # fmt: skip

    monkeypatch.setattr(plan_mod, "_run", stand_in)
    policies = ["prism", "dedicated"]
    result = plan(dep, w, hardware="h100", policies=policies, max_devices=60, jobs=1, sweep_counts=3)
    report, out = format_plan(result, "prism"), result.as_dict()["policies"]
    for name in policies:
        got = result.policies[name]
        assert got.devices == 29 and not got.points[28]["ttft_attainment"] >= 0.99
        assert {got.sweep_from, got.sweep_from + 1, got.sweep_from + 2} <= set(got.points)
        assert got.skipped == [n for n in range(got.sweep_from, 29) if n not in got.points] != []
        assert out[name]["skipped"] == got.skipped
        assert f"{name} {len(got.skipped)}" in report
    assert len(asked) == len(set(asked)) and len(asked) < 2 * (29 - 1)
    assert {p: q.confirmed for p, q in result.policies.items()} == {"prism": 2, "dedicated": 0}
    assert {30, 31} <= set(result.policies["prism"].points)  # prism's answer confirmed above it
    asked.clear()
    every = plan(dep, w, hardware="h100", policies=policies, max_devices=60, jobs=1, sweep_counts=None)
    assert {p: q.devices for p, q in every.policies.items()} == {"prism": 29, "dedicated": 29}
    assert all(not q.skipped for q in every.policies.values()) and "stepped over" not in format_plan(
        every, "prism"
    )


def test_sweep_counts_on_the_command_line(traffic: Path, capsys) -> None:
    """``--sweep-counts``: a count, or ``all`` (every count); anything else is refused by name."""
    from prism_serve.sim.plan_cli import _sweep_counts

    assert _sweep_counts("all") is None and _sweep_counts(" ALL ") is None and _sweep_counts("3") == 3
    assert _sweep_counts("0") == 0
    for bad in ("-1", "many", "2.5"):
        with pytest.raises(SystemExit) as stop:
            main(["plan", "--config", "paper-8", "--traffic", str(traffic), "--sweep-counts", bad])
        assert stop.value.code == 2
        assert "--sweep-counts" in capsys.readouterr().err


def test_a_plan_stopped_midway_leaves_what_it_had_found(monkeypatch, tmp_path: Path) -> None:
    from prism_serve.sim.plan_report import PROGRESS_FILE, PlanProgress

    names = ["m0", "m1"]
    w = burst_traffic(names)
    dep = burst_deployment(names)
    _stand_in_runs(monkeypatch, w)
    found = PlanProgress("ttft", 0.99, tmp_path)

    def then_stop(label: str, n: int, point: dict) -> None:
        found(label, n, point)
        if sum(len(p) for p in found.points.values()) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        plan(dep, w, hardware="h100", policies=["prism"], max_devices=9, jobs=1, on_point=then_stop)
    kept = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert kept == {"prism": {"1": kept["prism"]["1"], "2": kept["prism"]["2"], "3": kept["prism"]["3"]}}
    assert [kept["prism"][k]["passed"] for k in ("1", "2", "3")] == [False, False, True]


def test_a_static_partition_answer_is_written_with_the_rates_it_was_planned_for() -> None:
    import yaml

    from prism_serve.sim.hardware import get_hardware
    from prism_serve.sim.plan import deployment_yaml

    names = ["m0", "m1"]
    w = burst_traffic(names)
    dep = burst_deployment(names)
    result = plan(dep, w, hardware="h100", policies=["static-partition"], max_devices=4, jobs=1)
    rates = dict(result.provisioned["static-partition"]["rates"])
    assert rates == pytest.approx(w.mean_rates()) and sum(rates.values()) == pytest.approx(
        len(w) / w.duration
    )
    config = deployment_config("paper-8")
    data = deployment_yaml(
        config, get_hardware("h100"), 2, "static-partition", result.provisioned["static-partition"]
    )
    served = parse_config(yaml.safe_dump(data), "plan")
    assert served.policy.name == "static-partition"
    assert [list(r) for r in served.policy.knobs["rates"]] == [
        [m, pytest.approx(r)] for m, r in sorted(rates.items())
    ]
    # and each slice is sized for the longest request its model's traffic sent
    longest = {}
    for i, m in enumerate(w.models):
        sel = w.model_index == i
        longest[m] = int((w.prompt_tokens[sel] + w.output_tokens[sel]).max())
    assert dict(result.provisioned["static-partition"]["longest"]) == longest == w.longest_requests()
    assert [list(r) for r in served.policy.knobs["longest"]] == [list(r) for r in sorted(longest.items())]


def test_with_confidence_the_count_is_the_fewest_that_enough_other_draws_pass(monkeypatch, tmp_path) -> None:
    """``confidence``: from the answer up, the first count that passes on at least ``ceil(level x
    seeds)`` draws of the traffic, each draw at one of the profile's measured step errors; a
    count's draws stop once its outcome is decided. The runs are stand-ins: the traffic given passes
    from 3 devices; a draw passes at 3 only if it has no more requests than the traffic given, at 4
    unless it is the largest draw, and always from 5."""
    import dataclasses

    import prism_serve.sim.plan as plan_mod
    from prism_serve.sim.hardware import dump_hardware, get_hardware
    from prism_serve.workload.resample import resample

    names = ["m0", "m1"]
    w = burst_traffic(names)
    dep = burst_deployment(names)
    hardware = tmp_path / "h100-measured.json"
    dump_hardware(dataclasses.replace(get_hardware("h100"), step_errors=(-0.5, 0.25)), hardware)
    sizes = [len(resample(w, s)) for s in range(1, 11)]
    assert len(set(sizes)) == 10  # the stand-in tells draws apart by their size
    scales: list[float] = []

    def stand_in(job) -> dict:
        n, k = job.config.num_devices, len(job.workload)
        if k == len(w) and np.array_equal(job.workload.timestamps, w.timestamps):
            ok = n >= 3  # the traffic given
        else:
            scales.append(job.config.step_scale)
            ok = n >= 5 or (n == 4 and k != max(sizes)) or (n == 3 and k <= len(w))
        met = 1.0 if ok else 0.9
        return {"num_devices": n, "ttft_attainment": met, "tpot_attainment": met, "num_requests": k}

    monkeypatch.setattr(plan_mod, "_run", stand_in)
    result = plan(dep, w, hardware=str(hardware), policies=["prism"], max_devices=9, jobs=1,
                  confidence=0.9, seeds=10)  # fmt: skip
    p = result.policies["prism"]
    c = p.confidence
    assert p.devices == 3 and (c.need, c.seeds, c.step_errors) == (9, 10, 2)
    at_three = [s <= len(w) for s in sizes]
    assert sum(at_three) < 9  # so three fails, its draws stopping at the second failure
    expected = 4
    ran_at_three = [i for i, ok in enumerate(at_three) if not ok][1] + 1
    assert c.devices == expected == p.headline
    assert len(c.counts[3]) == ran_at_three and c.passed(3) == ran_at_three - 2
    # at 4 every draw but the largest passes: decided after nine passes (the tenth run only if a
    # failure came first)
    assert c.passed(4) == 9 and len(c.counts[4]) == 9 + (sizes.index(max(sizes)) < 9)
    assert [d["seed"] for d in c.counts[4]] == list(range(1, len(c.counts[4]) + 1))
    # every draw's steps scaled by one measured error: predicted 50% fast runs 2x, 25% slow 0.8x
    assert set(scales) <= {2.0, 0.8} and len(set(scales)) == 2
    assert {d["step_error"] for n in c.counts for d in c.counts[n]} <= {-0.5, 0.25}
    body = result.as_dict()["policies"]["prism"]["confidence"]
    assert body["devices"] == expected and body["counts"]["4"]["passed"] == 9
    # the same draws every time
    again = plan(dep, w, hardware=str(hardware), policies=["prism"], max_devices=9, jobs=1,
                 confidence=0.9, seeds=10).policies["prism"].confidence  # fmt: skip
    assert again.counts == c.counts
    with pytest.raises(SimConfigError, match="confidence"):
        plan(dep, w, hardware="h100", policies=["prism"], jobs=1, confidence=1.5)
    with pytest.raises(SimConfigError, match="to be sure of"):
        plan(dep, w, hardware="h100", policies=["prism"], jobs=1, confidence=0.9, chosen="dedicated")


def test_a_point_with_a_warm_up_in_front_reports_the_replay_alone() -> None:
    """``simulate_point(warmup=k)``: the first k requests are served (a live run's warm-up before its
    replay) and left out of the result, whose counts and latencies are the replay's."""
    ms = [served("a"), served("b")]
    engine = sim_deployment(deployment_config("paper-8")).engine
    dep = SimDeployment(ms, loose(ms), engine, "prism", (("prewarm", False),))  # loaded on demand
    replay = poisson(["a", "b"], 0.2, 60.0, prompt=64, output=8, seed=1)
    ts = replay.timestamps + 10.0
    replay = Workload(ts, replay.model_index, replay.prompt_tokens, replay.output_tokens, ["a", "b"])
    # one warm-up request per model 3 s before the replay
    w = Workload(
        np.concatenate([[7.0, 7.5], ts]),
        np.concatenate([[0, 1], replay.model_index]),
        np.concatenate([[3, 3], replay.prompt_tokens]),
        np.concatenate([[2, 2], replay.output_tokens]),
        ["a", "b"],
    )
    fresh = simulate_point(dep, replay, hardware="h100", policy="prism", devices=1, per_request=True)
    warm = simulate_point(dep, w, hardware="h100", policy="prism", devices=1, warmup=2, per_request=True)
    assert warm["num_requests"] == fresh["num_requests"] == len(replay)
    assert 0 < warm["wall_s"] < 600  # this run's seconds, not a simulated time
    assert {m: v["requests"] for m, v in warm["per_model"].items()} == {
        m: v["requests"] for m, v in fresh["per_model"].items()
    }
    # fresh, each model's first request waits for its activation (an 8B model's copy on the h100
    # profile, 0.7 s); after the warm-up every model is resident and no request waits for one
    activation = RooflineCostModel(get_hardware("h100")).activation_time(ms[0].spec, 1)
    assert fresh["ttft_p99_s"] > activation > 0.1 > warm["ttft_p99_s"]
    # request by request (per_request): the replay's, in arrival order from its first arrival
    names = [["a", "b"][i] for i in replay.model_index]
    for got in (fresh, warm):
        assert [r["model"] for r in got["requests"]] == names
        assert [r["arrival_s"] for r in got["requests"]] == pytest.approx(ts - ts[0])
    firsts = {names.index(m) for m in ("a", "b")}
    assert {i for i, r in enumerate(fresh["requests"]) if r["cold"]} == firsts
    assert not any(r["cold"] for r in warm["requests"])
    # the warm-up's activations are left out with its requests
    assert [v["activations"] for v in fresh["per_model"].values()] == [1, 1]
    assert [v["activations"] for v in warm["per_model"].values()] == [0, 0]
    assert fresh["per_model"]["a"]["activation_mean_s"] == pytest.approx(activation, rel=0.01)
    assert max(r["ttft_s"] for r in fresh["requests"]) > activation
    # a warm-up needs every model runnable (its requests are counted by position)
    wide = [served("a"), served("c", tp=2)]
    dep2 = SimDeployment(wide, loose(wide), engine, "prism", ())
    w2 = Workload(w.timestamps, w.model_index, w.prompt_tokens, w.output_tokens, ["a", "c"])
    with pytest.raises(SimConfigError, match="warm-up"):
        simulate_point(dep2, w2, hardware="h100", policy="prism", devices=1, warmup=2)
