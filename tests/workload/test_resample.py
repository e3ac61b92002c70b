"""Other draws of one recorded traffic (workload/resample.py), as ``prism plan --confidence`` makes
them: reproducible, the counts a Poisson process would give, the rate's shape over time and its
bursts kept, each request's lengths kept, and shared prompt prefixes shared while a request's own
blocks are its copy's own."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.workload import Workload
from prism_serve.workload.prefix import infinite_cache_hits
from prism_serve.workload.resample import BLOCK_S, REACH_S, resample


def traffic(seed: int = 0) -> Workload:
    """Two models over 600 s: ``a`` steady at 0.5 req/s, ``b`` quiet but for a burst of 200
    requests in one second at t=300."""
    rng = np.random.default_rng(seed)
    a = np.sort(rng.uniform(0, 600, 300))
    b = np.concatenate((rng.uniform(0, 600, 20), 300 + np.sort(rng.uniform(0, 1, 200))))
    ts = np.concatenate((a, b))
    models = np.array([0] * len(a) + [1] * len(b))
    prompt = rng.integers(1, 4000, len(ts))
    output = rng.integers(1, 500, len(ts))
    return Workload(ts, models, prompt, output, ["a", "b"])


def test_a_draw_is_reproducible_and_seeds_differ() -> None:
    w = traffic()
    one, again, other = resample(w, 1), resample(w, 1), resample(w, 2)
    assert np.array_equal(one.timestamps, again.timestamps)
    assert np.array_equal(one.model_index, again.model_index)
    assert len(one) != len(other) or not np.array_equal(one.timestamps, other.timestamps)


def test_counts_vary_around_the_recorded_ones_and_the_rate_keeps_its_shape() -> None:
    w = traffic()
    n = len(w)
    sizes = np.array([len(resample(w, s)) for s in range(100)])
    assert abs(sizes.mean() - n) < 0.1 * n and sizes.std() > 0  # about as many, not always as many
    for s in range(20):
        d = resample(w, s)
        assert d.models == w.models and d.timestamps.min() >= w.timestamps[0]
        assert d.timestamps.max() <= w.timestamps[-1]
        # a's rate stays steady: each half of the span holds about half of a's requests
        a = d.timestamps[d.model_index == 0]
        assert 0.3 < np.mean(a < 300) < 0.7


def _densest(ts: np.ndarray, seconds: float) -> np.ndarray:
    """The arrivals of the densest ``seconds`` of ``ts`` (sorted)."""
    ts = np.sort(ts)
    if not len(ts):
        return ts
    ends = np.searchsorted(ts, ts + seconds, side="right")
    i = int(np.argmax(ends - np.arange(len(ts))))
    return ts[i : ends[i]]


def test_a_burst_keeps_its_shape_near_where_it_was() -> None:
    """b's 200 requests in one second: where a draw has them, they come as tight as recorded (gaps
    of the same size, up to the request-by-request moves), within ``REACH_S`` and a block of the
    recorded time; some draws have the burst, others not."""
    w = traffic()
    b = w.timestamps[w.model_index == 1]
    recorded = np.sort(b[(b >= 300) & (b <= 301)])  # the burst
    typical = np.median(np.diff(recorded))
    found = 0
    for s in range(60):
        d = resample(w, s)
        dense = _densest(d.timestamps[d.model_index == 1], 1.0)
        if len(dense) < 120:
            continue
        found += 1
        assert 0.25 * typical < np.median(np.diff(dense)) < 4 * typical, s
        assert abs(dense[0] - recorded[0]) <= REACH_S + BLOCK_S + 1
    assert 10 < found < 60


def test_the_rate_keeps_its_shape_at_the_scale_of_minutes() -> None:
    """A model busy for the first half hour and silent for the second: no draw moves its traffic
    more than ``REACH_S`` plus a block into the silence, and the first twenty minutes stay busy."""
    rng = np.random.default_rng(1)
    a = np.sort(rng.uniform(0, 1800, 1800))
    b = np.sort(rng.uniform(0, 3600, 360))
    w = Workload(np.concatenate((a, b)), np.array([0] * 1800 + [1] * 360), np.full(2160, 100),
                 np.full(2160, 10), ["a", "b"])  # fmt: skip
    for s in range(10):
        d = resample(w, s)
        ta = d.timestamps[d.model_index == 0]
        assert ta.max() < 1800 + REACH_S + BLOCK_S
        assert np.sum(ta < 1200) > 0.8 * 1200


def test_which_models_are_busy_together_varies_between_draws() -> None:
    """Two models, each with one burst, ten minutes apart in the recording: some draws bring the
    bursts within a minute of each other, others keep them apart."""
    rng = np.random.default_rng(2)
    quiet = np.sort(rng.uniform(0, 3600, 120))
    bursts = [at + np.sort(rng.uniform(0, 2, 100)) for at in (1500, 2100)]
    ts = np.concatenate((quiet, *bursts))
    idx = np.array([i % 2 for i in range(120)] + [0] * 100 + [1] * 100)
    w = Workload(ts, idx, np.full(len(ts), 100), np.full(len(ts), 10), ["a", "b"])
    together = apart = 0
    for s in range(100):
        d = resample(w, s)
        a, b = (_densest(d.timestamps[d.model_index == k], 2.5) for k in (0, 1))
        if len(a) >= 60 and len(b) >= 60:
            near = abs(a[0] - b[0]) < 60
            together, apart = together + near, apart + (not near)
    assert together > 0 and apart > 0


def test_copies_keep_their_request() -> None:
    w = traffic()
    d = resample(w, 5)

    def requests(x: Workload) -> set[tuple[int, int, int]]:
        columns = (x.model_index, x.prompt_tokens, x.output_tokens)
        return set(zip(*(c.tolist() for c in columns), strict=True))

    assert requests(d) <= requests(w)  # no request the recording lacks


def test_a_log_shorter_than_two_blocks_is_drawn_request_by_request() -> None:
    """Under two blocks: each request kept a Poisson(1) number of times (the count's mean and
    variance both the recorded count), each copy within half a gap of its request."""
    n = 300
    w = Workload(np.linspace(0, 90, n), np.zeros(n, dtype=np.int32), np.full(n, 100), np.full(n, 10), ["m"])
    sizes = np.array([len(resample(w, s)) for s in range(200)])
    assert abs(sizes.mean() - n) < 4 * np.sqrt(n / 200) and 0.6 * n < sizes.var() < 1.5 * n
    gap = 90 / (n - 1)
    for t in resample(w, 3).timestamps:
        assert np.min(np.abs(w.timestamps - t)) <= gap / 2 + 1e-9


@settings(max_examples=40, deadline=None)
@given(
    turns=st.lists(st.integers(1, 4), min_size=1, max_size=12),
    system=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_shared_prefixes_stay_shared_and_a_request_s_own_blocks_become_its_copies_own(turns, system, seed):
    """Conversations that share ``system`` blocks of system prompt, each turn resending the turns
    before it: every block two recorded requests share is kept in every copy, and a copy's other
    blocks are met in no other request or copy."""
    rows_ts, rows_hashes = [], []
    next_hash = 1000
    for c, n in enumerate(turns):
        history = list(range(1, system + 1))
        for t in range(n):
            history = [*history, next_hash]
            next_hash += 1
            rows_ts.append(c * 10.0 + t)
            rows_hashes.append(tuple(history))
    k = len(rows_ts)
    w = Workload(
        np.array(rows_ts), np.zeros(k, dtype=np.int32), np.array([64 * len(h) for h in rows_hashes]),
        np.full(k, 8), ["m"], rows_hashes, 64,
    )  # fmt: skip
    recorded = Counter(h for hs in w.block_hashes for h in set(hs))
    d = resample(w, seed)
    if len(d) == 0:
        return
    owners: dict[int, int] = {}
    for i, hs in enumerate(d.block_hashes or [()] * len(d)):
        kept = [h for h in hs if recorded.get(h, 0) > 1]
        assert list(hs[: len(kept)]) == kept  # shared blocks first, as recorded
        for h in hs[len(kept) :]:
            assert h not in recorded and owners.setdefault(h, i) == i  # a copy's own block is its own
    # a copy still finds the recorded prefixes it shares cached, and nothing more
    hits = infinite_cache_hits(d, 64)
    for i, hs in enumerate(d.block_hashes or [()] * len(d)):
        assert hits[i] <= sum(1 for h in hs if recorded.get(h, 0) > 1) * 64


def test_an_empty_traffic_draws_empty() -> None:
    w = Workload(np.array([]), np.array([], dtype=np.int32), np.array([]), np.array([]), ["m"])
    assert len(resample(w, 3)) == 0
