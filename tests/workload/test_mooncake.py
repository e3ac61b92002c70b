"""The Mooncake trace and prompt block hashes: the reader, scaling that keeps who shares what, the
builder's mooncake source, the workload file and traffic reader carrying hashes, and the unbounded
cache's hits (the ``traces`` fixture: the full copies, else the excerpts in tests/data/traces)."""

from __future__ import annotations

import numpy as np
import pytest

from prism_serve.workload import Workload, WorkloadError, WorkloadRequest, WorkloadSpec, build_workload
from prism_serve.workload.format import read_jsonl, write_jsonl
from prism_serve.workload.mooncake import MOONCAKE_FILE, read_mooncake, scale_mooncake
from prism_serve.workload.prefix import block_keys, infinite_cache_hits
from prism_serve.workload.traffic import read_traffic


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def trace(traces):
    return read_mooncake(traces.root / MOONCAKE_FILE)


def test_the_reader_matches_the_trace_readme(trace, traces):
    assert len(trace) == traces.mooncake_requests
    assert trace.arrivals[0] == 0 and np.all(np.diff(trace.arrivals) >= 0)
    assert trace.duration == pytest.approx(1022.025 if traces.full else 58.501)  # ms in the file
    assert trace.block_tokens == 512
    for p, h in zip(trace.prompt_tokens.tolist(), trace.hash_ids, strict=True):
        assert len(h) == -(-p // 512)
    seen: set[int] = set()
    repeats = total = 0
    for h in trace.hash_ids:
        repeats += sum(x in seen for x in h)
        total += len(h)
        seen.update(h)
    assert repeats > 0  # README: 64% of blocks repeat an earlier block (the full trace)
    if traces.full:
        assert repeats / total == pytest.approx(0.64, abs=0.01)


def test_scaling_keeps_who_shares_what(trace):
    small = scale_mooncake(
        trace, block_tokens=16, time_scale=0.5, max_prompt_tokens=1792, max_output_tokens=64
    )
    assert np.array_equal(small.arrivals, trace.arrivals * 0.5)
    assert small.prompt_tokens.max() <= 1792 and small.output_tokens.max() <= 64
    for p, h in zip(small.prompt_tokens.tolist(), small.hash_ids, strict=True):
        assert len(h) == -(-p // 16)  # each block keeps its id
    n = min(len(trace), 120)
    for i in range(n):
        for j in range(i):
            before = _common(trace.hash_ids[i], trace.hash_ids[j])
            after = _common(small.hash_ids[i], small.hash_ids[j])
            kept = min(len(small.hash_ids[i]), len(small.hash_ids[j]))
            assert after == min(before, kept)
    # uncapped, an unbounded cache hits the same blocks at either scale
    plain = scale_mooncake(trace, block_tokens=16)
    big, scaled = (
        Workload(t.arrivals, np.zeros(len(t), dtype=np.int32), t.prompt_tokens, t.output_tokens, ["m"],
                 t.hash_ids, t.block_tokens)
        for t in (trace, plain)
    )  # fmt: skip
    assert np.array_equal(infinite_cache_hits(big, 512) // 512, infinite_cache_hits(scaled, 16) // 16)
    with pytest.raises(WorkloadError):
        scale_mooncake(trace, block_tokens=0)


def test_the_mooncake_source_sends_a_shared_prefix_to_one_model(traces, tmp_path):
    spec = WorkloadSpec(("a", "b", "c"), source="mooncake", block_tokens=32, max_prompt_tokens=1792,
                        duration_s=30.0, rate_scale=2.0, traces_dir=traces.root)  # fmt: skip
    w = build_workload(spec)
    assert w.block_tokens == 32 and w.timestamps.max() < 30.0
    assert len(w) == int((read_mooncake(traces.root / MOONCAKE_FILE).arrivals / 2.0 < 30.0).sum())
    model_of_root: dict[int, int] = {}
    for m, h in zip(w.model_index.tolist(), w.block_hashes, strict=True):
        assert model_of_root.setdefault(h[0], m) == m
    assert len(set(model_of_root.values())) > 1
    assert build_workload(spec).block_hashes == w.block_hashes  # seeded
    path = tmp_path / "w.jsonl"
    write_jsonl(w, path)
    for back in (read_jsonl(path, w.models), read_traffic(path, list(w.models)).workload):
        assert back.block_hashes == w.block_hashes and back.block_tokens == 32
        assert np.array_equal(back.prompt_tokens, w.prompt_tokens)


def test_hashes_follow_their_requests_through_sorting_and_selection():
    rows = [
        WorkloadRequest(2.0, "b", 40, 5, (1, 2, 3), 16),
        WorkloadRequest(1.0, "a", 20, 5),
        WorkloadRequest(0.5, "a", 33, 5, (1, 2, 4), 16),
    ]
    w = Workload.from_rows(rows)
    assert w.block_hashes == ((1, 2, 4), (), (1, 2, 3))
    assert list(w.rows())[:2] == [rows[2], rows[1]]
    assert w.only("b").block_hashes == ((1, 2, 3),)
    assert w.restrict(["a"]).block_hashes == ((1, 2, 4), ())
    assert Workload.from_rows([WorkloadRequest(0.0, "a", 5, 5)]).block_hashes is None
    with pytest.raises(WorkloadError, match="different sizes"):
        Workload.from_rows([*rows, WorkloadRequest(3.0, "a", 9, 1, (7,), 32)])


def test_a_bad_hash_line_is_named(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"timestamp": 0, "model": "a", "prompt_tokens": 3, "output_tokens": 2, "block_hashes": [1]}\n'
    )
    with pytest.raises(WorkloadError, match=r":1:.*missing keys"):
        read_jsonl(path)
    path.write_text(
        '{"timestamp": 0, "model": "a", "prompt_tokens": 3, "output_tokens": 2, "block_hashes": ["x"], '
        '"block_tokens": 16}\n'
    )
    with pytest.raises(WorkloadError, match=":1: block_hashes"):
        read_jsonl(path)


def test_an_unbounded_cache_hits_leading_runs_per_model_and_leaves_the_last_token():
    w = Workload.from_rows(
        [
            WorkloadRequest(0.0, "a", 64, 1, (1, 2, 3, 4), 16),
            WorkloadRequest(1.0, "a", 64, 1, (1, 2, 3, 4), 16),  # all 4 blocks cached: 3 usable
            WorkloadRequest(2.0, "a", 70, 1, (1, 2, 9, 4, 5), 16),  # differs at block 2
            WorkloadRequest(3.0, "b", 64, 1, (1, 2, 3, 4), 16),  # another model: its own cache
            WorkloadRequest(4.0, "a", 64, 1, (7, 2, 3, 4), 16),  # differs first: nothing
        ]
    )
    assert infinite_cache_hits(w, 16).tolist() == [0, 48, 32, 0, 0]
    assert infinite_cache_hits(w, 32).tolist() == [0, 32, 32, 0, 0]
    # engine blocks larger than the hashed ones: a key covers two hashes
    assert len(block_keys((1, 2, 3, 4), 16, 64, 32)) == 2
