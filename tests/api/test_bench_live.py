"""`prism bench` against the real server (the load generator's own tests use a stub endpoint)."""

from __future__ import annotations

import asyncio
import json

from prism_serve.bench.replay import replay
from prism_serve.bench.settings import BenchSettings
from prism_serve.cli import main
from prism_serve.workload.format import Workload, WorkloadRequest, write_jsonl
from tests.api.conftest import API_KEY

ROWS = [
    WorkloadRequest(0.0, "smol", 40, 6),
    WorkloadRequest(0.1, "tiny", 25, 9),
    WorkloadRequest(0.3, "smol-b", 12, 3),
    WorkloadRequest(0.4, "smol", 70, 1),
    WorkloadRequest(0.6, "tiny", 5, 12),
]


def test_replay_against_prism_serve(server):
    workload = Workload.from_rows(ROWS)
    # at most 2 in flight: the test server refuses a 4th request waiting for its first token (429)
    result = asyncio.run(replay(workload, server.url, BenchSettings(max_concurrency=2), api_key=API_KEY))
    assert [r.error for r in result.records] == [None] * len(ROWS)
    for rec, row in zip(sorted(result.records, key=lambda r: r.scheduled_s), ROWS, strict=True):
        assert rec.output_tokens == row.output_tokens  # ignore_eos honoured
        assert rec.usage_prompt_tokens == row.prompt_tokens  # the token-id prompt arrived whole
        assert 0 < rec.ttft_s <= rec.e2e_s
    # SLOs come from the server's /v1/models (the test config gives every model 30 s / 2 s)
    assert {(s.ttft_s, s.tpot_s, s.source) for s in result.slos.values()} == {(30.0, 2.0, "server")}
    summary = result.summary()
    assert summary["overall"]["succeeded"] == len(ROWS) and summary["overall"]["short_outputs"] == 0


def test_bench_cli_writes_report(server, tmp_path, monkeypatch):
    path = tmp_path / "w.jsonl"
    write_jsonl(Workload.from_rows(ROWS[:2]), path)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    code = main(
        [
            "bench",
            "--workload",
            str(path),
            "--url",
            server.base_url,
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
            "--prompt",
            "text",
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["overall"]["succeeded"] == 2
    assert (tmp_path / "out" / "bench.png").stat().st_size > 0
