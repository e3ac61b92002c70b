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
from prism_serve.workload.resample import resample


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


def test_counts_vary_as_a_poisson_process_would_and_the_rate_keeps_its_shape() -> None:
    w = traffic()
    n = len(w)
    draws = [resample(w, s) for s in range(200)]
    sizes = np.array([len(d) for d in draws])
    # Poisson(1) copies per request: mean n, variance n (within sampling error over 200 draws)
    assert abs(sizes.mean() - n) < 4 * np.sqrt(n / 200)
    assert 0.6 * n < sizes.var() < 1.5 * n
    for d in draws[:20]:
        assert d.models == w.models and d.timestamps.min() >= w.timestamps[0]
        assert d.timestamps.max() <= w.timestamps[-1]
        b = d.timestamps[d.model_index == 1]
        # the burst stays a burst: its copies move by fractions of the burst's own gaps
        in_burst = np.sum((b >= 299.9) & (b <= 301.1))
        assert in_burst > 120, in_burst
        # a's rate stays steady: each half of the span holds about half of a's requests
        a = d.timestamps[d.model_index == 0]
        assert 0.3 < np.mean(a < 300) < 0.7


def test_copies_keep_their_request_and_move_within_its_gap() -> None:
    w = traffic()
    d = resample(w, 5)

    def requests(x: Workload) -> set[tuple[int, int, int]]:
        columns = (x.model_index, x.prompt_tokens, x.output_tokens)
        return set(zip(*(c.tolist() for c in columns), strict=True))

    assert requests(d) <= requests(w)  # no request the recording lacks
    # a request of a's (0.5 req/s) moves by at most about its neighbours' gap, never minutes away
    for model in (0, 1):
        ts = np.sort(w.timestamps[w.model_index == model])
        gaps = np.diff(ts)
        for t in d.timestamps[d.model_index == model][:50]:
            nearest = np.min(np.abs(ts - t))
            assert nearest <= gaps.max(), (model, t)


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
