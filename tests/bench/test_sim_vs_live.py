"""The pure parts of benchmarks/sim_vs_live.py: config -> simulated deployment, the warm-up prefix,
per-model numbers, errors and the comparison (no server is started)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from prism_serve.config import parse_config
from prism_serve.sim.hardware import vector_class_profile
from prism_serve.sim.shapes import ShapeError
from prism_serve.workload.format import Workload

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def svl():
    return load_benchmark("sim_vs_live")


CONFIG = """\
devices:
  - {name: "cpu:0", memory: 1200MiB, cores: "0"}
  - {name: "cpu:1", memory: 1000MiB, cores: "1"}
models:
  - {name: a, ttft_slo: 3.0, tpot_slo: 0.5, max_num_seqs: 16, max_num_batched_tokens: 256, block_size: 32,
     dtype: float32}
  - {name: b, ttft_slo: 2.0, tpot_slo: 0.25, max_num_seqs: 16, max_num_batched_tokens: 256, block_size: 32,
     dtype: float32}
policy: {name: prism, knobs: {idle_threshold_s: 10.0}, tick_interval_s: 0.25}
"""


def test_sim_deployment_mirrors_the_config(svl):
    assert svl.sim_deployment(parse_config(CONFIG), compute_sharing=False).config.compute_sharing is False
    assert [label for label, _ in svl.sim_variants()] == ["sim", "sim, no sharing"]
    dep = svl.sim_deployment(parse_config(CONFIG), warmup_s=1.5)
    c = dep.config
    # the registered CPU fit of this machine's vector class (cpu-smollm2 where none is registered)
    assert (c.num_devices, c.hardware, c.policy) == (2, svl.HARDWARE, "prism")
    assert svl.HARDWARE in {"cpu-smollm2", vector_class_profile()}
    assert svl.sim_deployment(parse_config(CONFIG), hardware="cpu-smollm2").config.hardware == "cpu-smollm2"
    assert dep.budgets == (1200 * 2**20, 1000 * 2**20)
    assert dep.device_names == ("cpu:0", "cpu:1")
    assert dict(c.knobs) == {"idle_threshold_s": 10.0}
    assert (c.tick_s, c.warmup_s, c.page_size) == (0.25, 1.5, 2 * 2**20)
    e = c.engine  # the live models' EngineConfig, as the config built it
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.block_size) == (16, 256, 32)
    assert [m.name for m in dep.models] == ["a", "b"]
    # the real SmolLM2-135M-Instruct in fp32: the fitted shape at 4 bytes per weight
    assert {(m.spec.num_params, m.spec.dtype_bytes) for m in dep.models} == {(134_515_008, 4)}
    assert dep.models[0].spec.weight_bytes == 538060032
    assert (dep.slos["b"].ttft_s, dep.slos["b"].tpot_s) == (2.0, 0.25)
    assert dep.warnings == ()


def test_sim_deployment_warns_and_refuses(svl):
    text = CONFIG.replace('cores: "0"', 'cores: "0-1"').replace(
        "{name: b,", '{name: b, source: "random:smollm2-360m",'
    )
    head, _, tail = text.rpartition("dtype: float32")  # b's
    text = head + "dtype: bfloat16" + tail
    warnings = svl.sim_deployment(parse_config(text)).warnings
    assert any("cpu:0 has 2 cores" in w for w in warnings)
    assert any("b: smollm2-360m at 2 bytes per weight is not what" in w for w in warnings)
    with pytest.raises(svl.MirrorError, match="max_num_seqs"):
        svl.sim_deployment(parse_config(CONFIG.replace("max_num_seqs: 16,", "", 1)))
    with pytest.raises(ShapeError, match="model b: cannot read its shape"):  # prism plan's reader names it
        svl.sim_deployment(parse_config(CONFIG.replace("{name: b,", '{name: b, source: "/models/x.gguf",')))


def test_presets_are_valid_configs(svl):
    for name, p in svl.PRESETS.items():
        cfg = parse_config(svl.preset_config_text(p, (0, 1)), name)
        dep = svl.sim_deployment(cfg)
        assert dep.warnings == ()
        assert [m.name for m in cfg.models] == list(p.models)
        assert cfg.policy.name == p.policy
        assert dep.budgets[0] == dep.budgets[1]


def test_with_warmup_puts_the_warmup_first_on_the_replay_clock(svl):
    wl = Workload(np.array([0.0, 2.0]), np.array([1, 0]), np.array([50, 60]), np.array([5, 6]), ["a", "b"])
    out = svl.with_warmup(wl, [(-3.0, "a"), (-1.5, "b")], 0.25)
    np.testing.assert_allclose(out.timestamps, [0.0, 1.5, 3.25, 5.25])
    assert [out.models[i] for i in out.model_index] == ["a", "b", "b", "a"]
    assert out.prompt_tokens.tolist() == [3, 3, 50, 60]
    assert out.output_tokens.tolist() == [2, 2, 5, 6]
    with pytest.raises(svl.MirrorError):
        svl.with_warmup(wl, [(-1.0, "a"), (-2.0, "b")], 0.0)
    assert svl.with_warmup(wl, [], 0.0) is wl


def _req(model, arrival, first, finish, out):
    return SimpleNamespace(model=model, arrival=arrival, first_token=first, finish=finish, output_tokens=out)


def test_sim_model_stats_counts_like_the_live_report(svl):
    from prism_serve.sim.config import ModelSLO

    slos = {"a": ModelSLO(1.0, 0.1), "b": ModelSLO(1.0, 0.1)}
    reqs = [
        _req("a", 0.0, 0.5, 1.4, 10),  # TTFT 0.5, TPOT 0.1: both met
        _req("a", 1.0, 2.5, 2.55, 2),  # TTFT 1.5 (miss), TPOT 0.05
        _req("a", 2.0, 2.2, 2.2, 1),  # one token: TPOT met once finished
        _req("b", 0.0, None, None, 4),  # never started: misses both
    ]
    s = svl.sim_model_stats(reqs, slos)
    a = s["a"]
    assert a["requests"] == 3 and a["failed"] == 0
    assert a["ttft_p50_s"] == pytest.approx(0.5)
    assert a["tpot_p50_s"] == pytest.approx(0.075)
    assert (a["ttft_attainment"], a["tpot_attainment"], a["slo_attainment"]) == pytest.approx(
        (2 / 3, 1, 2 / 3)
    )
    assert s["b"]["failed"] == 1 and s["b"]["ttft_p50_s"] is None and s["b"]["slo_attainment"] == 0
    assert s["(all)"]["requests"] == 4 and s["(all)"]["ttft_attainment"] == pytest.approx(0.5)


def test_errors_and_comparison(svl):
    assert svl.rel_error(1.1, 1.0) == pytest.approx(0.1)
    assert svl.rel_error(None, 1.0) is None and svl.rel_error(1.0, 0.0) is None
    assert svl.points(0.97, 1.0) == pytest.approx(-3.0)

    def stats(p50, att, act):
        row = {"requests": 10, "ttft_p50_s": p50, "ttft_p95_s": 2 * p50, "tpot_p50_s": 0.05,
               "ttft_attainment": att, "tpot_attainment": 1.0, "slo_attainment": att,
               "activations": act, "evictions": 0}  # fmt: skip
        return {"m": row, "(all)": row}

    live = [stats(0.4, 1.0, 2), stats(0.6, 0.9, 4)]
    rows = svl.compare(live, stats(0.55, 0.97, 2))
    m = rows["m"]["metrics"]
    assert m["ttft_p50_s"]["live"] == pytest.approx(0.5)
    assert (m["ttft_p50_s"]["live_min"], m["ttft_p50_s"]["live_max"]) == (0.4, 0.6)
    assert m["ttft_p50_s"]["error"] == pytest.approx(0.1) and m["ttft_p50_s"]["within"]
    assert m["ttft_attainment"]["error"] == pytest.approx(2.0) and m["ttft_attainment"]["within"]
    assert m["activations"]["error"] == -1 and "within" not in m["activations"]
    rows = svl.compare(live, stats(0.7, 0.9, 3))
    assert rows["m"]["metrics"]["ttft_p50_s"]["within"] is False  # +40%
    assert rows["m"]["metrics"]["ttft_attainment"]["within"] is False  # -5 points
    assert svl.target_summary(rows)["ttft_p50_s"] == "0/1"
    text = svl.format_comparison({"sim": rows, "other": svl.compare(live, stats(0.5, 1.0, 2))}, repeats=2)
    assert "MISS" in text and "ok" in text and "[400..600]" in text
    assert "other" in text.splitlines()[1]


def _pair_workload(gap_s: float) -> Workload:
    # a, b, a, b ... each gap_s apart: two models taking turns
    n = 6
    return Workload(np.arange(n) * gap_s, np.arange(n) % 2, np.full(n, 32), np.full(n, 4), ["a", "b"])


def _one_device(memory: str, policy: str) -> str:
    return (
        f'devices: [{{name: "cpu:0", memory: {memory}, cores: "0"}}]\n'
        "models: [{name: a, ttft_slo: 5.0, dtype: float32}, {name: b, ttft_slo: 5.0, dtype: float32}]\n"
        f"policy: {{name: {policy}}}\n"
    )


def test_run_sim_uses_the_live_budget_and_counts_per_model(svl):
    wl = _pair_workload(40.0)  # longer than prism's 30 s idle threshold
    # both models fit in 1200 MiB: each is activated once, nothing is evicted; in 600 MiB only one
    # fits, so every turn evicts the other (the profile's own 8 GiB would hold both)
    for memory in ("1200MiB", "600MiB"):
        dep = svl.sim_deployment(parse_config(_one_device(memory, "prism")))
        out = svl.run_sim(dep, wl, num_warmup=0)
        acts = [out["models"][m]["activations"] for m in ("a", "b")]
        evictions = sum(out["models"][m]["evictions"] for m in ("a", "b"))
        assert out["models"]["(all)"]["evictions"] == evictions
        assert out["models"]["(all)"]["requests"] == 6
        if memory == "1200MiB":
            assert (acts, evictions) == ([1, 1], 0)
        else:
            assert acts == [3, 3] and evictions >= 5


def test_run_sim_leaves_the_warmup_out(svl):
    dep = svl.sim_deployment(parse_config(_one_device("1200MiB", "qlm")))
    wl = svl.with_warmup(_pair_workload(5.0), [(-4.0, "a"), (-2.0, "b")], 0.0)
    out = svl.run_sim(dep, wl, num_warmup=2)
    a, b = out["models"]["a"], out["models"]["b"]
    assert a["requests"] + b["requests"] == 6
    assert (a["warmup_activations"], b["warmup_activations"], a["warmup_evictions"]) == (1, 1, 1)
    # qlm holds one model per device: every later turn is a swap
    assert a["activations"] + b["activations"] >= 5
    assert a["evictions"] + b["evictions"] >= a["activations"] + b["activations"] - 1


def test_a_sweep_is_one_workload_of_warm_up_and_rate_segments(svl):
    from sim_mirror import WARMUP_OUTPUT, sweep_workload

    w = Workload(
        np.array([0.0, 10.0, 20.0, 50.0]), np.array([0, 1, 0, 1]), np.full(4, 8), np.full(4, 4), ["a", "b"]
    )
    combined, segments = sweep_workload(w, [1.0, 2.0], 30.0, ["a", "b", "c"], 40.0)
    assert combined.models == ("a", "b", "c")
    # warm-up: one short request per model, 1 s apart; x1 from t = 8 (its first 30 s: 3 requests),
    # x2 70 s later (30 s of traffic + the gap) with the first 60 s at twice the speed (4 requests)
    assert segments == [(1.0, 3, 3), (2.0, 6, 4)]
    assert combined.timestamps.tolist() == [0.0, 1.0, 2.0, 8.0, 18.0, 28.0, 78.0, 83.0, 88.0, 103.0]
    assert combined.output_tokens[:3].tolist() == [WARMUP_OUTPUT] * 3
    assert [combined.models[i] for i in combined.model_index[3:]] == ["a", "b", "a", "a", "b", "a", "b"]


def test_the_simulated_sweep_reports_each_rate_and_every_request(svl):
    from sim_mirror import run_sweep, sim_deployment, sweep_workload

    dep = sim_deployment(parse_config(CONFIG))
    rng = np.random.default_rng(0)
    n = 40
    w = Workload(
        np.sort(rng.uniform(0, 60, n)), rng.integers(0, 2, n), np.full(n, 32), np.full(n, 16), ["a", "b"]
    )
    combined, segments = sweep_workload(w, [1.0, 2.0], 30.0, ["a", "b"], 20.0)
    points, counters = run_sweep(dep, combined, segments)
    assert [p["rate_scale"] for p in points] == [1.0, 2.0]
    for p, (_, _, count) in zip(points, segments, strict=True):
        assert p["models"]["(all)"]["requests"] == count
        assert p["models"]["(all)"]["failed"] == 0
    assert counters["activations"] >= 2  # both models served


def test_the_speed_sensitivity_flags_a_model_whose_path_flips(svl):
    def stats(acts: int, p95: float) -> dict:
        return {"activations": acts, "ttft_p50_s": 0.4, "ttft_p95_s": p95}

    sim = {"models": {"a": stats(3, 0.45), "b": stats(15, 1.5), "(all)": stats(18, 1.4)}}
    speeds = {"x0.92": {"a": stats(12, 1.7), "b": stats(16, 1.4), "(all)": stats(28, 1.6)},
              "x1.08": {"a": stats(3, 0.46), "b": stats(15, 1.6), "(all)": stats(18, 1.5)}}  # fmt: skip
    assert svl.bistable_models(speeds, sim) == ["a", "(all)"]  # b: 16 vs 15 is within a quarter
    live = [{"models": {"a": {"activations": 12}, "b": {"activations": 18}}}]
    text = svl.format_sensitivity(speeds, sim, live)
    assert "12 / 3 / 3" in text and "1700 / 450 / 460" in text and "live 12" in text
    assert "BISTABLE: a:" in text
    steady = {k: {**v, "a": stats(3, 0.45)} for k, v in speeds.items()}
    assert "BISTABLE" not in svl.format_sensitivity(steady, sim, live)
