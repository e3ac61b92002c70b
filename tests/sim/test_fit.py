"""This machine's CPU profile (sim/fit.py): the fit recovers a known profile from step times it
prices, and ``prism fit-hardware`` measures the real engine here and writes a profile that
``prism plan`` plans this machine's CPU devices on."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from prism_serve.cli import main
from prism_serve.config import load_config
from prism_serve.sim.cost import RooflineCostModel
from prism_serve.sim.fit import CONSTANTS, FIT_MODEL, fit_points, predict, step_points
from prism_serve.sim.hardware import HARDWARE, dump_hardware, get_hardware, host_cpu_profile
from prism_serve.sim.models import model_shape
from prism_serve.sim.shapes import shape_of
from prism_serve.workload import write_jsonl

from .helpers import poisson


def batch_of(p: dict) -> list[tuple[int, int, bool]]:
    """A point's step as the engine records it: (new tokens, cached tokens before them, samples)."""
    a = p["args"]
    if p["kind"] == "decode":
        return [(1, a[1] - 1, True)] * a[0]
    if p["kind"] == "ragged":
        return [(1, c - 1, True) for c in a]
    if p["kind"] == "prefill":
        return [(a[0], a[1], True)]
    return [(1, a[3] - 1, True)] * a[2] + [(a[0], a[1], True)]  # mixed


def test_the_fit_recovers_the_profile_that_priced_the_steps() -> None:
    base = HARDWARE["cpu-smollm2-avx512bf16"]
    known = dataclasses.replace(
        base, step_overhead_s=6e-3, peak_flops=1.5e11, attn_flops=6e10, kv_bandwidth=9e9,
        seq_overhead_s=2e-5, row_bandwidth=None, mem_bandwidth=2.5e10,
    )  # fmt: skip
    cm, spec = RooflineCostModel(known), model_shape(FIT_MODEL, dtype_bytes=4)
    points = []
    for p in step_points("all"):
        b = batch_of(p)
        points.append(dict(p, batch=b, times=[predict(cm, spec, b) * f for f in (1.0, 1.3, 1.1)]))
    # a profile far from the truth in every step constant: only its other fields may survive
    start = dataclasses.replace(base, step_overhead_s=0.1, peak_flops=1e9, attn_flops=1e9, kv_bandwidth=1e8)
    raw = {"points": points, "decode_attention": "kernel"}
    result = fit_points(raw, start, mem_bandwidth=known.mem_bandwidth)
    for name in ("step_overhead_s", "peak_flops", "attn_flops", "kv_bandwidth", "mem_bandwidth"):
        assert getattr(result.profile, name) == pytest.approx(getattr(known, name), rel=1e-3), name
    assert result.profile.seq_overhead_s == pytest.approx(known.seq_overhead_s, rel=1e-2, abs=1e-7)
    assert max(abs(result.errors(True))) < 1e-3 and max(abs(result.errors(False))) < 1e-3
    # the profile carries its held-out errors, which prism plan --confidence draws from
    assert result.profile.step_errors == tuple(result.errors(True).tolist()) and result.profile.step_errors
    assert result.profile.share_interference == base.share_interference and not result.profile.synthetic
    # SDPA attention (the engine without its decode kernel) reads contexts padded by group
    assert fit_points(dict(raw, decode_attention="sdpa"), start).profile.pad_decode_context


def test_other_models_are_predicted_from_their_own_shape_and_not_fitted_to() -> None:
    """The deployment's other models: held-out points priced from their own shape, which say how
    far off the profile is on them, join the step errors, and leave the fitted constants alone."""
    base = HARDWARE["cpu-smollm2-avx512bf16"]
    known = dataclasses.replace(base, step_overhead_s=6e-3, peak_flops=1.5e11, mem_bandwidth=2.5e10)
    cm, own, big = RooflineCostModel(known), model_shape(FIT_MODEL, 4), model_shape("smollm2-360m", 4)
    points = [dict(p, batch=batch_of(p), times=[predict(cm, own, batch_of(p))]) for p in step_points("quick")]
    # this machine runs the bigger model 25% slower than the profile prices it
    held = [p for p in step_points("quick") if p["held_out"]]
    points += [
        dict(p, shape="random:smollm2-360m", batch=batch_of(p), times=[1.25 * predict(cm, big, batch_of(p))])
        for p in held
    ]
    raw = {"points": points, "decode_attention": "kernel"}
    result = fit_points(raw, base, mem_bandwidth=known.mem_bandwidth, shapes={"random:smollm2-360m": big})
    for name in ("step_overhead_s", "peak_flops"):
        assert getattr(result.profile, name) == pytest.approx(getattr(known, name), rel=1e-3), name
    assert max(abs(result.errors(True, shape=None))) < 1e-3
    assert result.errors(True, shape="random:smollm2-360m") == pytest.approx([1 / 1.25 - 1] * len(held))
    # the profile keeps them by shape: a plan of SmolLM2-135M alone does not draw from them
    assert result.profile.step_errors == pytest.approx(result.errors(True, shape=None).tolist())
    ((name, errors),) = result.profile.shape_errors
    assert name == "smollm2-360m" and errors == pytest.approx([1 / 1.25 - 1] * len(held))
    assert len(result.profile.errors_for([FIT_MODEL, "smollm2-360m"])) == 2 * len(held)
    report = result.report()
    assert "held-out points of random:smollm2-360m: mean |error| 20.0%, mean -20.0%" in report
    assert "(predicted / measured - 1; decode -20.0%, prefill -20.0%, mixed -20.0%)" in report


def test_a_shape_measured_at_its_own_rates_is_priced_at_them(tmp_path: Path) -> None:
    """A shape whose weights this core streams 30% slower, whose matmuls it runs 40% faster and whose
    attention it runs in 0.6 of the time the fitted model's rates say: its three training steps give
    the three factors, its held-out points are then priced within rounding, and the profile keeps
    them for the simulator (sim/cost.py)."""
    from prism_serve.sim.fit import SHAPE_TRAIN, shape_factors

    base = HARDWARE["cpu-smollm2-avx512bf16"]
    known = dataclasses.replace(base, step_overhead_s=6e-3, peak_flops=1.5e11, mem_bandwidth=2.5e10)
    own, big = model_shape(FIT_MODEL, 4), model_shape("qwen2.5-0.5b", 4)
    truth = dataclasses.replace(known, shape_scales=(("qwen2.5-0.5b", 1.3, 1 / 1.4, 0.6),))
    cm = RooflineCostModel(truth)
    points = [dict(p, batch=batch_of(p), times=[predict(cm, own, batch_of(p))]) for p in step_points("quick")]
    trained = [{"kind": k, "args": list(a), "held_out": False} for k, a in SHAPE_TRAIN]
    held = [p for p in step_points("quick") if p["held_out"]]
    points += [
        dict(p, shape="random:qwen2.5-0.5b", batch=batch_of(p), times=[predict(cm, big, batch_of(p))])
        for p in trained + held
    ]
    raw = {"points": points, "decode_attention": "kernel"}
    result = fit_points(raw, base, mem_bandwidth=known.mem_bandwidth, shapes={"random:qwen2.5-0.5b": big})
    ((name, *factors),) = result.profile.shape_scales
    assert name == "qwen2.5-0.5b"
    assert factors == [
        pytest.approx(1.3, rel=1e-3),
        pytest.approx(1 / 1.4, rel=1e-3),
        pytest.approx(0.6, rel=1e-3),
    ]
    assert max(abs(result.errors(True, shape="random:qwen2.5-0.5b"))) < 1e-3
    # without its training steps the same shape is priced at the fitted model's rates, and misses
    unscaled = RooflineCostModel(dataclasses.replace(result.profile, shape_scales=()))
    prefill = batch_of(held[4])
    assert predict(unscaled, big, prefill) != pytest.approx(predict(cm, big, prefill), rel=0.05)
    # a profile file keeps them; one step alone, or a GPU's roofline, gives none
    path = tmp_path / "cpu.json"
    dump_hardware(result.profile, path)
    assert get_hardware(str(path)).shape_scales == result.profile.shape_scales
    assert shape_factors(result.profile, big, [(batch_of(p), 0.2) for p in trained[:2]]) is None
    assert shape_factors(HARDWARE["h100"], big, [(batch_of(p), 0.2) for p in trained]) is None


def test_fit_hardware_measures_this_machine_and_plan_uses_it(tmp_path: Path, capsys) -> None:
    profile = tmp_path / "cpu.json"
    shapes = ["--shapes", "random:smollm2-360m"]  # a second shape, measured and predicted, not fitted
    assert main(["fit-hardware", "--rounds", "1", "--reps", "1", *shapes, "--out", str(profile)]) == 0
    err = capsys.readouterr().err
    assert "held-out points: mean |error|" in err and "weight pass fixed at the measured" in err
    assert "held-out points of random:smollm2-360m: mean |error|" in err
    hw = get_hardware(str(profile))
    base = get_hardware(host_cpu_profile())
    assert hw.name == "cpu-fitted" and not hw.synthetic and not hw.overlap
    assert all(getattr(hw, c) is None or getattr(hw, c) >= 0 for c in CONSTANTS)
    assert 1e9 < hw.mem_bandwidth < 1e12  # one thread's weight pass: GB/s, not a fitted leftover
    # compute sharing measured here, by engines in their own processes (sim/sharing.py): two on one
    # core cost each other at least time slicing's 2x and well under 4x; one core more cannot cost
    # that much either
    assert "compute sharing (real engines in their own processes): two on one core" in err
    assert 0 <= hw.share_interference < 1
    if len(os.sched_getaffinity(0)) > 1:
        assert "one on each of two cores" in err and 0 <= hw.cross_interference < 1
    # and per decode shape measured (one row and eight; a shape whose window saw no step has none),
    # the terms its decode steps take
    rows = [rows for rows, _, _ in hw.decode_interference]
    assert rows and rows == sorted(rows) and set(rows) <= {1, 8}
    assert all(0 <= share < 1 and 0 <= cross < 1 for _, share, cross in hw.decode_interference)
    # the runtime activated the shape on the fit's core (sim/activations.py): its time around the
    # copy and the copy's rate, which the simulator prices its activations at, and the medians
    # become the terms for shapes not measured
    assert "activations on core" in err and "smollm2-360m: " in err
    [(name, around, rate, evict)] = hw.shape_activations
    assert name == "smollm2-360m" and 0 < around < 30 and 1e8 < rate < 1e12 and 0 < evict < 30
    assert hw.eviction_for(name) == evict and hw.eviction_for("qwen3-0.6b") == 0.0
    assert (hw.activation_overhead_s, hw.host_bandwidth) == (around, rate)
    spec = shape_of("x", "random:smollm2-360m", 4)
    assert RooflineCostModel(hw).activation_time(spec, 1) == pytest.approx(around + spec.weight_bytes / rate)
    # what none shows (the serving path) is the registered profile's of this CPU's
    kept = ("request_overhead_s", "serving_share")
    assert [getattr(hw, k) for k in kept] == [getattr(base, k) for k in kept]

    traffic = tmp_path / "w.jsonl"
    models = ["smollm2-135m-00", "smollm2-135m-01"]
    write_jsonl(poisson(models, 0.5, 60.0, prompt=(16, 128), output=(8, 32), seed=3), traffic)
    out = tmp_path / "plan"
    # the cpu-2 preset with SLOs that any machine's one-core devices meet at this light load (the
    # preset's defaults are met on an AVX-512 host, not with fp32 on an AVX2 one): the answer is
    # then what the deployment's shape says, not how fast this machine is
    config = tmp_path / "prism.yaml"
    config.write_text(
        "devices: {count: 2, memory: 2GiB}\nmodels:\n"
        + "".join(f"  - {{name: {m}, dtype: float32, ttft_slo: 20, tpot_slo: 4}}\n" for m in models)
    )
    code = main([
        "plan", "--config", str(config), "--traffic", str(traffic), "--hardware", str(profile),
        "--policies", "prism,dedicated", "--jobs", "1", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    assert "device memory: 2048 MiB, the config's CPU devices'" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["hardware"] == "cpu-fitted" and results["policies"]["dedicated"]["devices"] == 2
    # the deployment found: one-core CPU devices, as the profile was fitted for, at the config's budget
    deployment = load_config(out / "prism.yaml")
    # the deployed count is the confident one, its draws run at the profile's measured step errors
    sure = results["policies"]["prism"]["confidence"]
    n = sure["devices"]
    assert sure["step_errors"] == len(hw.step_errors) > 0
    drawn = {d["step_error"] for c in sure["counts"].values() for d in c["draws"]}
    assert drawn <= set(hw.step_errors)
    assert [(d.name, d.cores, d.memory) for d in deployment.devices] == [
        (f"cpu:{i}", str(i), 2 << 30) for i in range(n)
    ]
    assert get_hardware(str(out / "hardware.json")).memory_bytes == 2 << 30


def test_fit_hardware_wants_a_profile_file(tmp_path: Path, capsys) -> None:
    assert main(["fit-hardware", "--out", str(tmp_path / "cpu.yaml")]) == 2
    assert "--out must name a .json file" in capsys.readouterr().err


def test_a_profile_s_step_errors_are_read_back_and_checked(tmp_path: Path) -> None:
    import dataclasses

    from prism_serve.sim.errors import SimConfigError
    from prism_serve.sim.hardware import dump_hardware

    path = tmp_path / "measured.json"
    dump_hardware(dataclasses.replace(HARDWARE["h100"], step_errors=(-0.05, 0.02)), path)
    assert get_hardware(str(path)).step_errors == (-0.05, 0.02)  # a list in the file, a tuple here
    for bad in ((-1.0,), (float("nan"),), ("fast",)):
        with pytest.raises(SimConfigError, match="step_errors"):
            dataclasses.replace(HARDWARE["h100"], step_errors=bad)
    # other shapes' errors, by shape: read back, and drawn only for a deployment that serves them
    by_shape = (("qwen3-0.6b", (0.1, 0.3)), ("smollm2-360m", (-0.2,)))
    dump_hardware(dataclasses.replace(HARDWARE["h100"], step_errors=(-0.05,), shape_errors=by_shape), path)
    hw = get_hardware(str(path))
    assert hw.shape_errors == by_shape
    assert hw.errors_for(["smollm2-135m"]) == (-0.05,)
    assert hw.errors_for(["smollm2-135m", "qwen3-0.6b"]) == (-0.05, 0.1, 0.3)
    for bad in ((("x", (-2.0,)),), (("x", 0.5),)):
        with pytest.raises(SimConfigError, match="shape_errors"):
            dataclasses.replace(HARDWARE["h100"], shape_errors=bad)


def test_a_fit_whose_sharing_measurement_fails_keeps_the_base_terms_and_says_why(monkeypatch):
    """The step fit is minutes of work: engines that cannot be started for the sharing points (no
    memory for more processes) cost only those points, named in the report. The failure is
    injected; the fit is one of measured-looking points."""
    import prism_serve.sim.sharing as sharing
    from prism_serve.sim.fit import FitResult

    def no_processes(*_a, **_k):
        raise RuntimeError("engine 0 of cpu:0 did not start")

    base = HARDWARE["cpu-smollm2-avx512bf16"]
    monkeypatch.setattr(sharing, "measure_interference", no_processes)
    result = sharing.with_sharing(FitResult(base, 0.5, [], None))
    kept = ("share_interference", "cross_interference")
    assert [getattr(result.profile, k) for k in kept] == [getattr(base, k) for k in kept]
    assert "compute sharing not measured (RuntimeError: engine 0 of cpu:0 did not start)" in result.report()
    # and what was measured replaces them, with its report line
    found = sharing.Interference(0.03, 0.01, {"decode 1 @256": 1.03}, {"decode 1 @256": 1.01})
    monkeypatch.setattr(sharing, "measure_interference", lambda *_a, **_k: found)
    result = sharing.with_sharing(FitResult(base, 0.5, [], None))
    assert (result.profile.share_interference, result.profile.cross_interference) == (0.03, 0.01)
    assert result.profile.decode_interference == found.decode_terms(0.01)
    assert found.report() in result.report()


def test_a_fit_whose_activation_probe_fails_keeps_the_base_terms_and_says_why(monkeypatch):
    """A probe that cannot run (a source the runtime cannot load, no memory for its workers) costs
    only the activation terms, named in the report; what a probe found replaces them. Failure and
    findings are injected here; the CLI test above runs the real probe."""
    import prism_serve.sim.activations as activations
    from prism_serve.sim.fit import FitResult

    def fails(*_a, **_k):
        raise RuntimeError("activation probe exited 1: no such file")

    base = HARDWARE["cpu-smollm2-avx512bf16"]
    shapes = {s: shape_of("x", s, 4) for s in ("random:qwen3-0.6b", "smollm2-135m-instruct")}
    monkeypatch.setattr(activations, "measure_activations", fails)
    result = activations.with_activations(FitResult(base, 0.5, [], None), shapes)
    kept = ("shape_activations", "activation_overhead_s", "host_bandwidth")
    assert [getattr(result.profile, k) for k in kept] == [getattr(base, k) for k in kept]
    assert "activations not measured (RuntimeError: activation probe exited 1: no such file)" in (
        result.report()
    )
    found = {
        "random:qwen3-0.6b": {"take_s": 0.01, "map_s": 0.3, "copy_s": 0.25, "ready_s": 0.02,
                              "total_s": 0.58, "weight_bytes": 2_500_000_000, "activations": 3,
                              "evict_s": 0.15},
        "smollm2-135m-instruct": {"take_s": 0.01, "map_s": 0.0, "copy_s": 0.05, "ready_s": 0.01,
                                  "total_s": 0.07, "weight_bytes": 500_000_000, "activations": 3,
                                  "evict_s": None},
    }  # fmt: skip
    monkeypatch.setattr(activations, "measure_activations", lambda *_a, **_k: found)
    hw = activations.with_activations(FitResult(base, 0.5, [], None), shapes).profile
    assert hw.activation_for("qwen3-0.6b") == pytest.approx((0.33, 1e10))
    assert hw.activation_for("smollm2-135m-instruct") == pytest.approx((0.02, 1e10))
    # a shape not measured: the medians
    assert hw.activation_for("llama-3.2-1b") == pytest.approx((0.175, 1e10))
    assert (hw.eviction_for("qwen3-0.6b"), hw.eviction_for("smollm2-135m-instruct")) == (0.15, 0.0)
    qwen = shapes["random:qwen3-0.6b"]
    assert RooflineCostModel(hw).activation_time(qwen, 1) == pytest.approx(0.33 + qwen.weight_bytes / 1e10)


BAD_ACTIVATIONS = [[["x", 0.1, 1e9]], [["x", -0.1, 1e9, 0]], [["x", 0.1, 0.0, 0]], [["x", 0.1, 1e9, -1]]]
BAD_ACTIVATIONS += [[["x", "slow", 1e9, 0]]]


@pytest.mark.parametrize("bad", BAD_ACTIVATIONS)
def test_bad_shape_activations_in_a_profile_are_a_named_error(bad, tmp_path: Path) -> None:
    from prism_serve.sim.errors import SimConfigError

    with pytest.raises(SimConfigError, match="shape_activations"):
        dataclasses.replace(HARDWARE["cpu-smollm2-avx512bf16"], shape_activations=bad)
    good = dataclasses.replace(HARDWARE["cpu-smollm2-avx512bf16"], shape_activations=[["x", 0.1, 5e9, 0.2]])
    dump_hardware(good, tmp_path / "cpu.json")
    assert get_hardware(str(tmp_path / "cpu.json")).shape_activations == (("x", 0.1, 5e9, 0.2),)


BAD_SCALES = [
    [["qwen2.5-0.5b", 1.2]], [["qwen2.5-0.5b", 0.0, 1.0]], [["x", "fast", 1.0]], [["x", 1.0, 1.0, -1.0]],
    [["x", 1.0, 1.0, 1.0, 1.0]],
]  # fmt: skip


def test_a_profile_file_without_attention_factors_runs_attention_at_the_fitted_rates(tmp_path: Path) -> None:
    """A file written when shape_scales held two factors still loads: its attention unscaled."""
    profile = HARDWARE["cpu-smollm2-avx512bf16"]
    dump_hardware(profile, tmp_path / "cpu.json")
    data = json.loads((tmp_path / "cpu.json").read_text())
    data["shape_scales"] = [["qwen2.5-0.5b", 1.2, 0.9]]
    (tmp_path / "cpu.json").write_text(json.dumps(data))
    loaded = get_hardware(str(tmp_path / "cpu.json"))
    assert loaded.scales_for("qwen2.5-0.5b") == (1.2, 0.9, 1.0)
    assert loaded.scales_for("another") == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("scales", BAD_SCALES)
def test_bad_shape_scales_in_a_profile_are_a_named_error(scales) -> None:
    from prism_serve.sim.errors import SimConfigError

    with pytest.raises(SimConfigError, match="shape_scales"):
        dataclasses.replace(HARDWARE["cpu-smollm2-avx512bf16"], shape_scales=scales)
