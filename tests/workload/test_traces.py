"""Readers and the multi-model builder on the real traces: the full copies in ../shared/traces when
present, else the excerpts in tests/data/traces (the ``traces`` fixture, conftest.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.workload import WorkloadError, WorkloadSpec, build_workload, format_stats, model_stats
from prism_serve.workload.traces import (
    read_azure,
    read_lengths,
    read_servegen_client,
    sample_window,
    servegen_clients,
    weibull_shape_for_cv,
)


def test_azure_readers_match_the_trace_readme(traces):
    code = read_azure(traces.root / "azure2023_code.csv")
    conv = read_azure(traces.root / "azure2023_conv.csv")
    assert (len(code.arrivals), len(conv.arrivals)) == traces.azure_requests
    for t, (lo, hi) in zip((code, conv), traces.azure_span_s, strict=True):
        assert t.arrivals[0] == 0 and np.all(np.diff(t.arrivals) >= 0)
        assert lo < t.duration < hi  # full: "57-58 min"
        assert t.prompt_tokens.min() >= 1 and t.output_tokens.min() >= 0


def test_sharegpt_lengths(traces):
    p, o = read_lengths(traces.root / "lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
    assert len(p) == len(o) >= traces.min_sharegpt_rows and p.min() >= 1 and o.min() >= 1


def test_servegen_client_windows(traces):
    # the excerpts keep every client file, so the counts are the full set's
    paths = servegen_clients(traces.root / "servegen/m-mid")
    assert len(paths) == 109 and paths[0].name == "chunk-0-trace.csv"
    c = read_servegen_client(paths[0])
    assert len(c.ts) == (2016 if traces.full else 3)  # 14 days of 600 s windows, or 30 minutes
    assert np.all(np.diff(c.ts) == 600) and set(c.pattern) <= {"", "Gamma", "Weibull"}
    assert np.all(c.rate[[not p for p in c.pattern]] == 0)


@settings(max_examples=30, deadline=None)
@given(st.floats(0.3, 8.0))
def test_weibull_shape_gives_the_requested_cv(cv):
    k = weibull_shape_for_cv(cv)
    var = math.exp(math.lgamma(1 + 2 / k) - 2 * math.lgamma(1 + 1 / k)) - 1
    assert math.sqrt(var) == pytest.approx(cv, rel=1e-6)


@pytest.mark.parametrize("pattern, cv", [("Gamma", 0.5), ("Gamma", 2.0), ("Weibull", 0.7), ("Weibull", 1.5)])
def test_window_sampling_has_the_window_rate_and_cv(pattern, cv):
    rng = np.random.default_rng(1)
    t = sample_window(pattern, 50.0, cv, 600.0, rng)
    assert t.min() >= 0 and t.max() < 600 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert len(t) / 600.0 == pytest.approx(50.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_builder_servegen_is_seeded_long_tailed_and_scaled(traces):
    names = tuple(f"m{i}" for i in range(20))
    spec = WorkloadSpec(names, duration_s=1200, total_rate=10.0, seed=3, traces_dir=traces.root)
    a, b = build_workload(spec), build_workload(spec)
    assert np.array_equal(a.timestamps, b.timestamps) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert a.models == names and a.timestamps.max() < 1200
    assert len(a) / 1200 == pytest.approx(10.0, rel=0.35)  # expected total, not exact: windows are random
    stats = sorted(model_stats(a, span_s=1200), key=lambda s: -s.num_requests)
    top = sum(s.share for s in stats[:8])
    assert top > 0.6  # the 40% most popular models send most requests (Figure 2a's long tail)
    doubled = build_workload(dataclasses.replace(spec, rate_scale=2.0))
    assert len(doubled) / len(a) == pytest.approx(2.0, rel=0.2)
    assert "least popular 60%" in format_stats(stats)


def test_builder_azure_slices_and_lengths(traces):
    names = ("a", "b", "c", "d")
    spec = WorkloadSpec(
        names, source="azure:code", lengths="sharegpt", duration_s=600, seed=1, traces_dir=traces.root
    )
    w = build_workload(spec)
    counts = np.bincount(w.model_index, minlength=4)
    assert sorted(counts)[-1] > 2 * sorted(counts)[0]  # Zipf weights 1, 1/2, 1/3, 1/4
    assert w.timestamps.min() >= 0 and w.timestamps.max() < 600
    p, _ = read_lengths(traces.root / "lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
    assert set(w.prompt_tokens.tolist()) <= set(p.tolist())


def test_builder_rejects_bad_specs(traces):
    with pytest.raises(WorkloadError):
        WorkloadSpec(("a", "a"))
    with pytest.raises(WorkloadError):
        WorkloadSpec(("a",), source="nope")
    with pytest.raises(WorkloadError):
        WorkloadSpec(("a",), rate_scale=0)
    names = tuple(f"m{i}" for i in range(500))
    with pytest.raises(WorkloadError, match="active client"):
        build_workload(WorkloadSpec(names, source="servegen:m-small", traces_dir=traces.root))


def test_stats_match_hand_computed_values():
    from prism_serve.workload import Workload, WorkloadRequest

    times = [0.0, 1.0, 2.0, 30.0, 90.0]
    w = Workload.from_rows([WorkloadRequest(t, "a", 10, 20) for t in times], ["a", "b"])
    a, b = model_stats(w, span_s=120.0)
    assert a.num_requests == 5 and a.share == 1.0 and a.rate == pytest.approx(5 / 120)
    assert a.median_gap_s == pytest.approx(np.median([1, 1, 28, 60]))
    assert a.idle_per_hour == pytest.approx(3 * 30)  # gaps 28, 60 and the 30 s tail exceed 10 s
    assert a.cv_per_minute == pytest.approx(np.std([4, 1]) / 2.5)
    assert b.num_requests == 0 and math.isnan(b.median_gap_s)
