"""The JSONL workload format: round trip, validation with line numbers, ordering."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.workload import Workload, WorkloadError, WorkloadRequest, read_jsonl, write_jsonl
from prism_serve.workload.format import NO_ORIGIN, PRIORITIES
from prism_serve.workload.resample import resample

rows = st.lists(
    st.builds(
        WorkloadRequest,
        st.floats(0, 1e5, allow_nan=False).map(lambda t: round(t, 6)),
        st.sampled_from(["a", "b", "model-c", 'q"uote']),
        st.integers(1, 20000),
        st.integers(1, 4000),
        tenant=st.sampled_from(["", "team-a", 'te"am']),
        priority=st.sampled_from(PRIORITIES),
    ),
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(rows)
def test_round_trip_keeps_every_request_in_arrival_order(tmp_path_factory, reqs):
    path = tmp_path_factory.mktemp("w") / "w.jsonl"
    w = Workload.from_rows(reqs)
    write_jsonl(w, path)
    back = read_jsonl(path, w.models)
    assert list(back.rows()) == sorted(reqs, key=lambda r: r.timestamp) == list(w.rows())
    assert np.all(np.diff(back.timestamps) >= 0)


def test_models_without_requests_are_kept(tmp_path):
    path = tmp_path / "w.jsonl"
    write_jsonl(Workload.from_rows([WorkloadRequest(1.0, "a", 5, 6)], ["a", "idle"]), path)
    assert read_jsonl(path, ["a", "idle"]).models == ("a", "idle")
    assert read_jsonl(path).models == ("a",)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"timestamp": 1, "model": "a", "prompt_tokens": 3}', "missing keys"),
        ('{"timestamp": 1, "model": "a", "prompt_tokens": 3, "output_tokens": 2, "x": 1}', "unknown keys"),
        ('{"timestamp": -1, "model": "a", "prompt_tokens": 3, "output_tokens": 2}', "timestamp"),
        ('{"timestamp": 1, "model": "", "prompt_tokens": 3, "output_tokens": 2}', "model"),
        ('{"timestamp": 1, "model": "a", "prompt_tokens": 0, "output_tokens": 2}', "prompt_tokens"),
        ('{"timestamp": 1, "model": "a", "prompt_tokens": 3, "output_tokens": 2.5}', "output_tokens"),
        ('{"timestamp": 1, "model": "a", "prompt_tokens": 3, "output_tokens": 2, "priority": 1}', "priority"),
        ('{"timestamp": 1, "model": "a", "prompt_tokens": 3, "output_tokens": 2, "tenant": 7}', "tenant"),
        ("[1, 2]", "object"),
        ("{not json", "not JSON"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"timestamp": 0, "model": "a", "prompt_tokens": 1, "output_tokens": 1}\n\n' + line + "\n"
    )
    with pytest.raises(WorkloadError, match=message) as err:
        read_jsonl(path)
    assert ":3:" in str(err.value)


def test_only_and_head_select_requests():
    w = Workload.from_rows([WorkloadRequest(float(t), "ab"[t % 2], 10, 10) for t in range(10)])
    assert len(w.only("a")) == 5 and w.only("a").models == ("a",)
    assert len(w.head(4.0)) == 4


def test_restrict_keeps_the_named_models_requests_reindexed():
    w = Workload(np.array([0.0, 1.0, 2.0, 3.0]), np.array([0, 1, 2, 1]), np.array([5, 6, 7, 8]),
                 np.array([1, 2, 3, 4]), ["a", "b", "c"])  # fmt: skip
    r = w.restrict(["c", "b"])
    assert list(r.models) == ["c", "b"] and r.timestamps.tolist() == [1.0, 2.0, 3.0]
    assert [r.models[i] for i in r.model_index] == ["b", "c", "b"] and r.prompt_tokens.tolist() == [6, 7, 8]
    assert len(w.only("a")) == 1


def test_origins_follow_their_requests_through_selections_and_draws():
    rows = [
        WorkloadRequest(float(i), "ab"[i % 2], 10 + i, 5, tenant=f"t{i % 3}", priority=PRIORITIES[i % 3])
        for i in range(30)
    ]
    w = Workload.from_rows(rows)
    assert set(w.origins) == {r.origin for r in rows}
    only_a = w.only("a")
    assert [only_a.origin_of(i) for i in range(len(only_a))] == [r.origin for r in rows if r.model == "a"]
    head = w.head(10.0)
    assert [r.origin for r in head.rows()] == [r.origin for r in rows[:10]]
    # a draw copies requests with their origins: each (prompt length, origin) pair is one of the log's
    drawn = resample(w, seed=3)
    known = {(r.prompt_tokens, r.origin) for r in rows}
    assert {(r.prompt_tokens, r.origin) for r in drawn.rows()} <= known
    # without any, the workload carries none
    plain = Workload.from_rows([WorkloadRequest(0.0, "a", 1, 1)])
    assert plain.origins is None and plain.origin_of(0) == NO_ORIGIN
