"""A user's traffic as a workload (workload/traffic.py): prism serve's request log, the workload
JSONL and a CSV export with its own column names; the window, the rate scale and renames; and every
kind of bad input named, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prism_serve.workload.traffic import CsvColumns, TrafficError, TrafficOptions, read_traffic


def log_line(arrival: float, model: str, prompt: int | None, output: int, **extra) -> str:
    line = {"arrival": arrival, "model": model, "prompt_tokens": prompt, "output_tokens": output,
            "max_tokens": 64, "n": 1, "stream": False, "status": 200, "ttft_s": 0.1, "tpot_s": 0.02,
            "e2e_s": 1.0, "cold": False, "device": "cpu:0", "replica": model}  # fmt: skip
    line.update(extra)
    return json.dumps(line)


def test_the_request_log_is_traffic_from_its_first_arrival(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join([
        log_line(1000.0, "a", 100, 20, tenant="team-a", priority="interactive"),
        log_line(1001.5, "b", 50, 10, n=2, output_tokens=30),  # two choices: two sequences of 15
        log_line(1002.0, "a", 80, 0, status=503, output_tokens=0),  # overloaded: demand, max_tokens long
        log_line(1003.0, "a", None, 0, status=400, output_tokens=0),  # refused as invalid: not traffic
        log_line(1004.0, "b", 70, 0, status=429, output_tokens=0, max_tokens=None),  # like b's others
        log_line(1004.5, "a", 90, 8, lane="batch", tenant="team-a"),  # the batch lane's: batch class
    ]) + "\n")  # fmt: skip
    t = read_traffic(path, ["a", "b", "idle"])
    w = t.workload
    assert t.format == "log" and t.dropped_invalid == 1 and list(w.models) == ["a", "b", "idle"]
    assert t.batch == 1
    assert w.timestamps.tolist() == [0.0, 1.5, 1.5, 2.0, 4.0, 4.5]
    assert [w.models[i] for i in w.model_index] == ["a", "b", "b", "a", "b", "a"]
    assert w.prompt_tokens.tolist() == [100, 50, 50, 80, 70, 90]
    assert w.output_tokens.tolist() == [20, 15, 15, 64, 15, 8]
    # who sent each: the tenant, its class; the batch lane's line is batch; the rest standard
    assert [w.origin_of(i) for i in range(len(w))] == [
        ("team-a", "interactive"),
        *[("", "standard")] * 4,
        ("team-a", "batch"),
    ]
    assert w.judged().tolist() == [True] * 5 + [False]


def test_a_csv_export_with_its_own_columns_and_iso_times(tmp_path: Path) -> None:
    path = tmp_path / "billing.csv"
    path.write_text(
        "ts,deployment,prompt_len,completion_len,cost\n"
        "2026-11-27T10:00:00Z,gpt-small,10,5,0.1\n"
        "2026-11-27T10:00:02Z,gpt-small-v2,20,6,0.1\n"
        "2026-11-27T10:00:01.5Z,big,30,7,0.2\n"
    )
    columns = CsvColumns("ts", "deployment", "prompt_len", "completion_len")
    opts = TrafficOptions(columns=columns, map={"gpt-small": "small", "gpt-small-v2": "small"})
    w = read_traffic(path, ["small", "big"], opts).workload
    assert w.timestamps.tolist() == [0.0, 1.5, 2.0]
    assert [w.models[i] for i in w.model_index] == ["small", "big", "small"]  # the two merged
    assert w.prompt_tokens.tolist() == [10, 30, 20]


def test_the_window_and_the_rate_scale(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    rows = [{"timestamp": float(t), "model": "a", "prompt_tokens": 8, "output_tokens": 4} for t in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = read_traffic(path, ["a"], TrafficOptions(start_s=2.0, duration_s=4.0, rate_scale=2.0))
    assert t.format == "jsonl"
    assert np.allclose(t.workload.timestamps, [0.0, 0.5, 1.0, 1.5])  # 2, 3, 4, 5 s, twice as fast
    assert t.span_s == 2.0
    with pytest.raises(TrafficError, match=r"no request in the window .* spans 9.0 s"):
        read_traffic(path, ["a"], TrafficOptions(start_s=100.0))


def test_bad_lines_are_named_or_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text(log_line(0.0, "a", 10, 2) + "\n{not json\n" + log_line(1.0, "a", "many", 2) + "\n")
    with pytest.raises(TrafficError, match=r"requests.jsonl:2: not JSON .*--skip-bad"):
        read_traffic(path, ["a"])
    t = read_traffic(path, ["a"], TrafficOptions(skip_bad=True))
    assert len(t.workload) == 1 and t.skipped_bad == 2
    csv = tmp_path / "t.csv"
    csv.write_text("timestamp,model,input_tokens,output_tokens\n0,a,10,5\n1,a,-3,5\n")
    with pytest.raises(TrafficError, match=r"t.csv:3: bad row: input_tokens must be >= 1"):
        read_traffic(csv, ["a"])
    with pytest.raises(TrafficError, match=r"no column 'time' .*--time-column"):
        read_traffic(csv, ["a"], TrafficOptions(columns=CsvColumns(time="time")))


def test_a_model_the_deployment_lacks_is_named_or_dropped(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    lines = [log_line(float(i), m, 10, 2) for i, m in enumerate(["a", "x", "x", "a"])]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TrafficError, match=r"does not serve: x \(2 requests\).*--ignore-unknown"):
        read_traffic(path, ["a"])
    t = read_traffic(path, ["a"], TrafficOptions(ignore_unknown=True))
    assert len(t.workload) == 2 and t.dropped_unknown == {"x": 2}


def test_unreadable_input_says_why(tmp_path: Path) -> None:
    with pytest.raises(TrafficError, match="no such traffic file"):
        read_traffic(tmp_path / "missing.jsonl", ["a"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TrafficError, match="empty"):
        read_traffic(empty, ["a"])
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    with pytest.raises(TrafficError, match=r"neither JSON lines nor \.csv"):
        read_traffic(text, ["a"])
    with pytest.raises(TrafficError, match="rate scale must be a positive number"):
        TrafficOptions(rate_scale=0)


def test_an_embed_or_score_lines_inputs_are_one_group_judged_once(tmp_path: Path) -> None:
    """The inputs of one embed or score request answer one client together: the log's line of n
    inputs is n requests of one group (Workload.groups), which attainment judges once. Choices of a
    chat request stand alone; the group survives selecting and restricting, and a resampled draw
    keeps each copy of a group together."""
    from prism_serve.workload.resample import resample

    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join([
        log_line(10.0, "e", 90, 1, n=3, task="embed"),
        log_line(10.5, "c", 40, 20, n=2, output_tokens=40),  # two choices: two judgements
        log_line(11.0, "r", 60, 1, n=2, task="score"),
        log_line(11.2, "e", 30, 1, n=1, task="embed"),  # one input: alone
    ]) + "\n")  # fmt: skip
    w = read_traffic(path, ["e", "c", "r"]).workload
    assert [w.models[i] for i in w.model_index] == ["e"] * 3 + ["c"] * 2 + ["r"] * 2 + ["e"]
    assert w.prompt_tokens.tolist() == [30, 30, 30, 40, 40, 30, 30, 30]
    g = w.groups.tolist()
    assert g[0] == g[1] == g[2] >= 0 and g[5] == g[6] >= 0 and g[0] != g[5]
    assert g[3] == g[4] == g[7] == -1
    assert w.judged().tolist() == [True, False, False, True, True, True, False, True]
    assert int(w.restrict(["r", "e"]).judged().sum()) == 3  # two groups and the lone input
    assert w.select(w.timestamps > 0.4).groups.tolist() == g[3:]
    for seed in range(20):
        d = resample(w, seed)
        for gid in set(d.groups.tolist()) - {-1}:  # a copy of a group: inputs of one model
            members = np.flatnonzero(d.groups == gid)
            assert len(set(d.model_index[members].tolist())) == 1
        assert int(d.judged().sum()) == (d.groups == -1).sum() + len(set(d.groups.tolist()) - {-1})
