"""Report math on hand-made records (no endpoint): attainment, TPOT, percentiles, errors, throughput;
and the settings: model map, token range, SLO sources and scales."""

from __future__ import annotations

import numpy as np
import pytest

from prism_serve.bench import BenchError, BenchSettings, RequestError, RequestRecord, SLOTarget, summarize
from prism_serve.bench.replay import normalize_url
from prism_serve.bench.report import format_table
from prism_serve.bench.settings import parse_model_map, parse_token_range, resolve_slos
from prism_serve.sim.config import ModelSLO


def _rec(model, ttft=None, e2e=None, out=0, *, max_tokens=None, error=None, sched=0.0, sent=0.0):
    return RequestRecord(
        index=0,
        model=model,
        served_model=model,
        scheduled_s=sched,
        prompt_tokens=10,
        max_tokens=out if max_tokens is None else max_tokens,
        sent_s=sent,
        ttft_s=ttft,
        e2e_s=e2e,
        output_tokens=out,
        error=error,
    )


SLOS = {"a": SLOTarget(0.3, 0.25, "file"), "b": SLOTarget(1.0, 0.05, "default")}


def test_tpot_is_decode_time_per_token_after_the_first():
    assert _rec("a", 0.25, 2.25, 11).tpot_s == pytest.approx(0.2)
    assert _rec("a", 0.25, 0.25, 1).tpot_s is None
    assert _rec("a", 0.25, None, 5, error=RequestError("timeout")).tpot_s is None


def test_attainment_counts_failures_as_misses_and_one_token_outputs_as_tpot_hits():
    records = [
        _rec("a", 0.1, 2.1, 11),  # TTFT 0.1 <= 0.3, TPOT 0.2 <= 0.25: both
        _rec("a", 0.5, 0.5, 1),  # TTFT missed; one token: TPOT attained
        _rec("a", 0.2, 6.2, 11),  # TTFT hit, TPOT 0.6 missed
        _rec("a", error=RequestError("http_429", status=429)),
        _rec("a", 0.1, None, 3, error=RequestError("timeout")),  # had a first token, then timed out
        _rec("b", 0.9, 1.9, 11),  # TPOT 0.1 > 0.05
    ]
    s = summarize(records, SLOS, duration_s=10.0)
    a = s["models"]["a"]
    assert (a["requests"], a["succeeded"], a["failed"]) == (5, 3, 2)
    assert a["ttft_attainment"] == pytest.approx(2 / 5)
    assert a["tpot_attainment"] == pytest.approx(2 / 5)
    assert a["slo_attainment"] == pytest.approx(1 / 5)
    assert a["errors"] == {"http_429": 1, "timeout": 1}
    assert (a["ttft_slo_s"], a["tpot_slo_s"], a["slo_source"]) == (0.3, 0.25, "file")
    b = s["models"]["b"]
    assert (b["ttft_attainment"], b["tpot_attainment"]) == (1.0, 0.0)
    overall = s["overall"]
    assert overall["requests"] == 6
    # each request against its own model's SLO: a's 2 + b's 1 TTFT hits, a's 2 TPOT hits
    assert overall["ttft_attainment"] == pytest.approx(3 / 6)
    assert overall["tpot_attainment"] == pytest.approx(2 / 6)


def test_percentiles_and_means_are_over_succeeded_requests_only():
    ttfts = [0.1, 0.2, 0.3, 0.4]
    records = [_rec("a", t, t + 1.0, 11) for t in ttfts]
    records.append(_rec("a", 9.0, None, 2, error=RequestError("timeout")))
    s = summarize(records, SLOS, duration_s=4.0)["models"]["a"]
    for q in (50, 95, 99):
        assert s[f"ttft_p{q}_s"] == pytest.approx(np.percentile(ttfts, q))
        assert s[f"e2e_p{q}_s"] == pytest.approx(np.percentile(ttfts, q) + 1.0)
        assert s[f"tpot_p{q}_s"] == pytest.approx(0.1)
    assert s["ttft_mean_s"] == pytest.approx(0.25)
    assert s["ttft_p50_s"] == pytest.approx(0.25)


def test_throughput_short_outputs_and_send_lag():
    records = [
        _rec("a", 0.1, 1.1, 11, sched=0.0, sent=0.001),
        _rec("a", 0.1, 1.1, 5, max_tokens=20, sched=1.0, sent=1.5),  # the endpoint stopped early
        _rec("b", error=RequestError("connect"), sched=2.0, sent=2.0),
    ]
    s = summarize(records, SLOS, duration_s=8.0)["overall"]
    assert s["output_tokens"] == 16
    assert s["throughput_output_tokens_per_s"] == pytest.approx(2.0)
    assert s["throughput_requests_per_s"] == pytest.approx(2 / 8)
    assert s["short_outputs"] == 1
    assert s["send_lag_max_s"] == pytest.approx(0.5)


def test_no_records_attains_everything_and_has_no_latency():
    s = summarize([], {}, duration_s=0.0)["overall"]
    assert (s["ttft_attainment"], s["ttft_p99_s"], s["throughput_requests_per_s"]) == (1.0, None, 0.0)


def test_table_has_a_row_per_model_and_the_errors():
    records = [_rec("a", 0.1, 1.1, 11), _rec("b", error=RequestError("http_404", status=404))]
    text = format_table(summarize(records, SLOS, duration_s=2.0))
    lines = text.splitlines()
    assert lines[2].startswith("a ") and lines[3].startswith("b ") and lines[4].startswith("(all)")
    assert lines[-1] == "errors: http_404 1"
    assert " 100.0% " in lines[2] and "100/" in lines[2]  # attainment, TTFT p50 in ms


def test_model_map_and_token_range_parsing():
    assert parse_model_map(["a=b", "c=d, e=f"]) == (("a", "b"), ("c", "d"), ("e", "f"))
    with pytest.raises(BenchError, match="WORKLOAD_NAME=SERVED_NAME"):
        parse_model_map(["a"])
    assert parse_token_range("1000:8000") == (1000, 8000)
    with pytest.raises(BenchError, match="LO:HI"):
        parse_token_range("1000")
    with pytest.raises(BenchError, match="mapped twice"):
        BenchSettings(model_map=(("a", "b"), ("a", "c")))


@pytest.mark.parametrize(
    "kw",
    [
        {"rate_scale": 0},
        {"duration_s": -1},
        {"max_concurrency": 0},
        {"timeout_s": 0},
        {"prompt": "chat"},
        {"token_range": (5, 5)},
        {"slo_scale": 0},
        {"tpot_slo_s": 0},
    ],
)
def test_bad_settings_are_named_errors(kw):
    with pytest.raises(BenchError):
        BenchSettings(**kw)


def test_slo_sources_and_scales():
    file_slos = {"a": ModelSLO(0.2, 0.02), "b": ModelSLO(0.4, 0.04)}
    # an SLO file holds unscaled measurements: scaled by 5 unless told, as in `prism sim`
    got = resolve_slos(["a", "b"], BenchSettings(), file_slos=file_slos)
    assert got["a"] == SLOTarget(pytest.approx(1.0), pytest.approx(0.1), "file")
    got = resolve_slos(["a"], BenchSettings(slo_scale=2, tpot_scale=10), file_slos=file_slos)
    assert (got["a"].ttft_s, got["a"].tpot_s) == pytest.approx((0.4, 0.2))
    with pytest.raises(BenchError, match="no SLO for"):
        resolve_slos(["a", "c"], BenchSettings(), file_slos=file_slos)
    # the server's SLOs are targets: scale 1 unless told; the served name is looked up
    settings = BenchSettings(model_map=(("x", "served-x"),), ttft_slo_s=3.0, tpot_slo_s=0.3)
    got = resolve_slos(["x", "y"], settings, server_slos={"served-x": (0.5, 0.05)})
    assert got["x"] == SLOTarget(0.5, 0.05, "server")
    assert got["y"] == SLOTarget(3.0, 0.3, "default")


def test_url_normalization():
    assert normalize_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_url(" https://h/ ") == "https://h"
    with pytest.raises(BenchError):
        normalize_url("h:8000")
