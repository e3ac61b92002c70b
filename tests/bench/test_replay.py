"""The load generator against a STUB endpoint (tests/bench/stub_server.py; no model runs). What the
generator sends, what it records, and how it reports errors; never how fast anything was."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from prism_serve.bench import BenchError, BenchSettings, replay
from prism_serve.bench.report import format_table
from prism_serve.workload.format import Workload, WorkloadRequest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def _workload(*rows: tuple[float, str, int, int]) -> Workload:
    return Workload.from_rows([WorkloadRequest(*r) for r in rows])


def _run(workload: Workload, url: str, **kw):
    settings = kw.pop("settings", None) or BenchSettings(timeout_s=kw.pop("timeout_s", 30.0))
    return asyncio.run(replay(workload, url, settings, **kw))


def test_sends_the_workloads_lengths_and_records_the_streamed_output(fresh_stub):
    w = _workload((0.0, "m1", 5, 4), (0.0, "m2", 17, 1), (0.01, "m1", 3, 7))
    res = _run(w, fresh_stub.url, settings=BenchSettings(token_range=(1000, 1010), seed=3))
    by_model_len = sorted((b["model"], len(b["prompt"]), b["max_tokens"]) for b in fresh_stub.bodies)
    assert by_model_len == [("m1", 3, 7), ("m1", 5, 4), ("m2", 17, 1)]
    for body in fresh_stub.bodies:
        assert all(1000 <= t < 1010 for t in body["prompt"])
        assert body["ignore_eos"] is True and body["stream"] is True and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True}
    for rec in res.records:
        assert rec.ok and rec.usage_reported
        assert rec.output_tokens == rec.max_tokens
        assert rec.usage_prompt_tokens == rec.prompt_tokens  # the stub counts the ids it got
        # the empty-text chunk before the first token counts neither as TTFT nor as a token
        assert len(rec.token_times_s) == rec.output_tokens
        assert rec.ttft_s == rec.token_times_s[0] and rec.ttft_s <= rec.e2e_s
        assert rec.finish_reason == "length"
    one_token = next(r for r in res.records if r.output_tokens == 1)
    assert one_token.tpot_s is None
    seven = next(r for r in res.records if r.output_tokens == 7)
    assert seven.tpot_s == pytest.approx((seven.e2e_s - seven.ttft_s) / 6)
    # m1's SLOs come from the stub's /v1/models; m2 has none there and takes the defaults
    assert (res.slos["m1"].ttft_s, res.slos["m1"].tpot_s, res.slos["m1"].source) == (0.5, 0.05, "server")
    assert res.slos["m2"].source == "default" and res.slos["m2"].ttft_s == BenchSettings().ttft_slo_s
    s = res.summary()
    assert s["overall"]["succeeded"] == 3 and s["overall"]["errors"] == {}
    assert s["overall"]["output_tokens"] == 12 and s["models"]["m1"]["requests"] == 2


def test_the_same_seed_sends_the_same_prompts(fresh_stub):
    w = _workload((0.0, "m1", 8, 1), (0.0, "m2", 8, 1))
    _run(w, fresh_stub.url, settings=BenchSettings(seed=7))
    first = [b["prompt"] for b in fresh_stub.bodies]
    fresh_stub.reset()
    _run(w, fresh_stub.url, settings=BenchSettings(seed=7))
    assert sorted(first) == sorted(b["prompt"] for b in fresh_stub.bodies)
    assert first[0] != first[1]  # different requests, different prompts (no prefix sharing)


def test_text_prompts_have_one_word_per_requested_token(fresh_stub):
    w = _workload((0.0, "m1", 40, 2))
    res = _run(w, fresh_stub.url, settings=BenchSettings(prompt="text"))
    (body,) = fresh_stub.bodies
    assert isinstance(body["prompt"], str) and len(body["prompt"].split()) == 40
    assert res.records[0].ok


def test_errors_are_recorded_by_kind_and_miss_both_slos(fresh_stub):
    w = _workload(
        (0.0, "nope", 4, 2),
        (0.0, "busy", 4, 2),
        (0.0, "hang", 4, 2),
        (0.0, "cut", 4, 2),
        (0.0, "fail-mid", 4, 2),
        (0.0, "garbage", 4, 2),
        (0.0, "m1", 4, 2),
    )
    res = _run(w, fresh_stub.url, timeout_s=0.5)
    s = res.summary()
    assert s["overall"]["errors"] == {
        "http_404": 1,
        "http_429": 1,
        "protocol": 2,
        "stream_error": 1,
        "timeout": 1,
    }
    recs = {r.model: r for r in res.records}
    assert recs["nope"].error.status == 404 and "`nope` does not exist" in recs["nope"].error.message
    assert recs["nope"].error.type == "NotFoundError"
    busy = recs["busy"].error
    assert (busy.status, busy.type, busy.retry_after) == (429, "rate_limit_error", "3")
    assert recs["hang"].ttft_s is not None and recs["hang"].e2e_s is None  # a token came, then nothing
    assert "[DONE]" in recs["cut"].error.message
    assert recs["garbage"].error.kind == "protocol" and "bad SSE event" in recs["garbage"].error.message
    assert recs["fail-mid"].error.message == "engine died"
    for m in ("nope", "busy", "hang", "cut", "fail-mid", "garbage"):
        assert s["models"][m]["ttft_attainment"] == 0 and s["models"][m]["tpot_attainment"] == 0
        assert s["models"][m]["ttft_p50_s"] is None  # failures have no latency
    assert s["overall"]["succeeded"] == 1 and s["overall"]["failed"] == 6


def test_without_a_usage_chunk_output_tokens_are_counted_from_chunks(fresh_stub):
    res = _run(_workload((0.0, "no-usage", 3, 5)), fresh_stub.url)
    (rec,) = res.records
    assert rec.ok and not rec.usage_reported and rec.output_tokens == 5


def test_tokens_without_text_still_count_when_usage_reports_them(fresh_stub):
    res = _run(_workload((0.0, "silent", 3, 4), (0.0, "empty", 3, 4)), fresh_stub.url)
    silent, empty = res.records
    assert silent.ok and silent.output_tokens == 4 and len(silent.token_times_s) == 4
    assert silent.ttft_s == silent.token_times_s[0] and silent.tpot_s is not None
    assert empty.error.kind == "no_output"


def test_rate_scale_compresses_send_times_in_order(fresh_stub):
    ts = [0.0, 0.04, 0.08, 0.2]
    w = _workload(*((t, "m1", 2, 1) for t in ts))
    res = _run(w, fresh_stub.url, settings=BenchSettings(rate_scale=4.0))
    assert [r.scheduled_s for r in res.records] == pytest.approx([t / 4 for t in ts])
    sent = [r.sent_s for r in res.records]
    assert sent == sorted(sent)
    # never sent before its (scaled) time; the spacing between sends keeps the workload's order
    assert all(r.sent_s >= r.scheduled_s for r in res.records)
    lags = [r.sent_s - r.scheduled_s for r in res.records]
    assert res.summary()["overall"]["send_lag_max_s"] == pytest.approx(max(lags))


def test_duration_keeps_the_workloads_first_seconds(fresh_stub):
    w = _workload((0.0, "m1", 2, 1), (0.05, "m2", 2, 1), (5.0, "m1", 2, 1))
    res = _run(w, fresh_stub.url, settings=BenchSettings(duration_s=1.0, rate_scale=2.0))
    assert [r.scheduled_s for r in res.records] == pytest.approx([0.0, 0.025])
    with pytest.raises(BenchError, match="no requests"):
        _run(w.select(w.timestamps > 1), fresh_stub.url, settings=BenchSettings(duration_s=1.0))


def test_max_concurrency_caps_requests_in_flight(fresh_stub):
    w = _workload(*((0.0, "slow", 2, 3) for _ in range(4)))
    res = _run(w, fresh_stub.url, settings=BenchSettings(max_concurrency=1))
    assert all(r.ok for r in res.records)
    assert res.peak_in_flight == 1 and fresh_stub.peak_in_flight == 1
    assert [r.index for r in sorted(res.records, key=lambda r: r.sent_s)] == [0, 1, 2, 3]


def test_model_map_renames_what_is_sent_but_reports_the_workload_name(fresh_stub):
    w = _workload((0.0, "llama-a", 2, 1), (0.0, "llama-b", 2, 1))
    settings = BenchSettings(model_map=(("llama-a", "m1"), ("llama-b", "m2")))
    res = _run(w, fresh_stub.url + "/v1/", settings=settings, api_key="sk-test")
    assert sorted(b["model"] for b in fresh_stub.bodies) == ["m1", "m2"]
    assert fresh_stub.auth == ["Bearer sk-test"] * 2
    assert set(res.summary()["models"]) == {"llama-a", "llama-b"}
    assert res.slos["llama-a"].source == "server"  # looked up under the served name
    with pytest.raises(BenchError, match="does not have"):
        _run(w, fresh_stub.url, settings=BenchSettings(model_map=(("typo", "m1"),)))


def test_an_unreachable_endpoint_is_a_connect_error_per_request():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    res = _run(_workload((0.0, "m1", 2, 1), (0.0, "m1", 2, 1)), url)
    assert res.summary()["overall"]["errors"] == {"connect": 2}
    assert res.slos["m1"].source == "default"  # /v1/models was unreachable too


def test_cli_writes_a_json_and_png_report(fresh_stub, tmp_path, capsys):
    from prism_serve.cli import main
    from prism_serve.sim.config import ModelSLO
    from prism_serve.sim.slo import save_slos
    from prism_serve.workload.format import write_jsonl

    wpath = tmp_path / "w.jsonl"
    write_jsonl(_workload((0.0, "a", 4, 3), (0.01, "b", 4, 2), (0.02, "busy", 4, 2)), wpath)
    slos = tmp_path / "slos.json"
    save_slos({"a": ModelSLO(1.0, 0.5), "b": ModelSLO(2.0, 0.25), "busy": ModelSLO(1.0, 1.0)}, slos)
    out = tmp_path / "report"
    argv = ["bench", "--workload", str(wpath), "--url", fresh_stub.url, "--out", str(out), "--no-progress"]
    argv += ["--model-map", "a=m1,b=m2", "--slos", str(slos), "--slo-scale", "2", "--tpot-scale", "3"]
    argv += ["--prompt", "text", "--token-times"]
    assert main(argv) == 0
    body = json.loads((out / "bench.json").read_text())
    assert body["slos"]["a"] == {"ttft_s": 2.0, "tpot_s": 1.5, "source": "file"}
    assert body["settings"]["prompt"] == "text" and body["settings"]["model_map"] == [
        ["a", "m1"],
        ["b", "m2"],
    ]
    assert body["overall"]["requests"] == 3 and body["overall"]["errors"] == {"http_429": 1}
    assert set(body["models"]) == {"a", "b", "busy"}
    assert [r["served_model"] for r in body["requests"]] == ["m1", "m2", "busy"]
    assert len(body["requests"][0]["token_times_s"]) == 3
    assert body["machine"]["cpu_count"] >= 1 and body["started_at"]
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(out / "bench.png").ndim == 3
    printed = capsys.readouterr().out
    assert "(all)" in printed and "http_429 1" in printed


def test_cli_fails_when_nothing_succeeds(fresh_stub, tmp_path, capsys):
    from prism_serve.cli import main
    from prism_serve.workload.format import write_jsonl

    wpath = tmp_path / "w.jsonl"
    write_jsonl(_workload((0.0, "nope", 4, 3)), wpath)
    assert main(["bench", "--workload", str(wpath), "--url", fresh_stub.url, "--no-progress"]) == 1
    assert "http_404 1" in capsys.readouterr().out


def test_token_ids_are_reproducible_from_the_seed():
    from prism_serve.bench.replay import build_prompt

    a = build_prompt(50, BenchSettings(seed=1), np.random.default_rng(1))
    b = build_prompt(50, BenchSettings(seed=1), np.random.default_rng(1))
    assert a == b and len(a) == 50 and min(a) >= 1000 and max(a) < 8000


def test_cli_replays_a_request_log_from_a_start(fresh_stub, tmp_path, capsys):
    """prism serve's request log is a workload for prism bench as it is for prism plan: the requests
    from --start on, with the lengths the server counted; a request refused as invalid is not sent."""
    from prism_serve.cli import main

    t0 = 1_790_000_000.0
    lines = [
        {"arrival": t0, "model": "m1", "prompt_tokens": 3, "output_tokens": 2, "status": 200},  # warm-up
        {"arrival": t0 + 5.0, "model": "m1", "prompt_tokens": 7, "output_tokens": 3, "status": 200},
        {"arrival": t0 + 5.1, "model": "m2", "prompt_tokens": 9, "output_tokens": 0, "status": 400},
        {"arrival": t0 + 5.2, "model": "m2", "prompt_tokens": 4, "output_tokens": 0, "status": 503,
         "max_tokens": 5},
    ]  # fmt: skip
    log = tmp_path / "requests.log"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "report"
    argv = ["bench", "--workload", str(log), "--start", "4", "--url", fresh_stub.url, "--out", str(out)]
    assert main([*argv, "--no-progress", "--prompt", "ids"]) == 0
    body = json.loads((out / "bench.json").read_text())
    sent = [(r["model"], r["prompt_tokens"], r["output_tokens"]) for r in body["requests"]]
    assert sorted(sent) == [("m1", 7, 3), ("m2", 4, 5)]
    assert main(["bench", "--workload", str(log), "--start", "60", "--url", fresh_stub.url]) == 2
    assert "no request in the window" in capsys.readouterr().err


def test_hashed_prompts_share_exactly_the_blocks_their_hashes_share(fresh_stub):
    from prism_serve.bench.replay import hashed_prompt

    settings = BenchSettings(token_range=(1000, 40000), seed=5)
    rng = np.random.default_rng(0)
    a = hashed_prompt(40, (11, 12, 13), 16, settings, rng)  # 2 blocks and 8 tokens of the third
    b = hashed_prompt(48, (11, 12, 99), 16, settings, rng)
    assert len(a) == 40 and len(b) == 48 and all(1000 <= t < 40000 for t in a + b)
    assert a[:32] == b[:32] and a[32:40] != b[32:40]
    assert a[:16] != a[16:32]  # each hash its own block
    assert hashed_prompt(40, (11, 12, 13), 16, settings, rng) == a  # a function of the hashes alone
    assert hashed_prompt(20, (11,), 16, settings, rng)[:16] == a[:16]  # past the hashes: random
    assert hashed_prompt(16, (11,), 16, BenchSettings(token_range=(1000, 40000), seed=6), rng) != a[:16]
    w = Workload.from_rows(
        [
            WorkloadRequest(0.0, "m1", 40, 1, (1, 2, 3), 16),
            WorkloadRequest(0.01, "m1", 40, 1, (1, 2, 4), 16),
            WorkloadRequest(0.02, "m1", 40, 1),
        ]
    )
    _run(w, fresh_stub.url, settings=settings)
    prompts = [b["prompt"] for b in fresh_stub.bodies]
    assert len(prompts) == 3
    for hashes in ((1, 2, 3), (1, 2, 4)):
        assert hashed_prompt(40, hashes, 16, settings, rng) in prompts
    sharing = [(p, q) for i, p in enumerate(prompts) for q in prompts[i + 1 :] if p[:32] == q[:32]]
    assert len(sharing) == 1 and sharing[0][0][32:] != sharing[0][1][32:]  # the plain one shares nothing


def test_cached_prompt_tokens_are_recorded_and_summed_into_a_hit_rate(fresh_stub):
    # the stub's ``cached`` model reports the leading ids it saw before, in whole 8-id blocks: the
    # second request shares two of its three 16-token hashed blocks with the first
    w = Workload.from_rows(
        [
            WorkloadRequest(0.0, "cached", 40, 1, (1, 2, 3), 16),
            WorkloadRequest(0.2, "cached", 40, 1, (1, 2, 4), 16),
            WorkloadRequest(0.4, "m1", 40, 1, (1, 2, 4), 16),
        ]
    )
    res = _run(w, fresh_stub.url, settings=BenchSettings(token_range=(1000, 40000), seed=5))
    first, second, plain = res.records
    assert (first.usage_cached_tokens, second.usage_cached_tokens) == (0, 32)
    assert plain.usage_cached_tokens is None and plain.usage_reported  # the endpoint did not say
    s = res.summary()
    assert s["models"]["cached"]["prefix_hit_rate"] == pytest.approx(32 / 80)
    assert s["models"]["m1"]["prefix_hit_rate"] is None
    assert s["overall"]["prefix_hit_rate"] == pytest.approx(32 / 80)  # over the requests that said
    assert "40.0% of prompt tokens" in format_table(s)
