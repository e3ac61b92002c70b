"""Another draw of the same traffic: a workload resampled from one recorded workload, so that a plan
can ask how its answer varies with the traffic it was not given (``prism plan --confidence``).

A recorded hour is one draw of a random process; the next hour will not repeat it request for
request, nor will the same models be busy at the same moments. :func:`resample` makes another draw
that keeps what the recording says about each model's traffic and varies what it cannot say, by a
local block bootstrap, model by model:

- each model's traffic is cut into blocks of ``block_s`` seconds (60: the control loop's rate
  window) on one grid from the log's first arrival;
- block ``j`` of the draw is, for each model independently, a ``block_s``-second stretch of that
  model's recorded traffic starting anywhere within ``reach_s`` seconds (600) of block ``j``'s own
  start, shifted into place (stretches start within the log, so none runs off its end);
- then, request by request (the Poisson bootstrap), each request of those stretches is kept
  ``Poisson(1)`` times (none, once, twice, ...), each copy moved uniformly within half the gap
  between its model's neighbouring requests: a Poisson process at the stretch's rate would send
  about as many, not exactly as many, and never two at one instant.

So a burst keeps its shape (arrivals within a block keep their gaps, up to those moves), each
model's rate keeps its shape over the log at the scale of ``reach_s`` (a day's peak stays at its
hour), each request keeps its lengths, and what varies is how many requests each model sends in each
minute and which models are busy at the same time, the coincidences that decide whether models fit on
a device together. A log shorter than two blocks has no stretches to choose between: it is drawn
request by request alone.

Prompt block hashes: a copy keeps the blocks that two or more recorded requests share (a system
prompt, an earlier turn of its conversation); the blocks only its request had, and every block after
them, get hashes of the copy's own, so two copies of one turn are two conversations, not one whose
prefix the second finds cached.

The draw is a function of the workload and the seed alone.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from prism_serve.workload.format import Workload

__all__ = ["BLOCK_S", "REACH_S", "resample"]

BLOCK_S = 60.0
REACH_S = 600.0


def resample(workload: Workload, seed: int, block_s: float = BLOCK_S, reach_s: float = REACH_S) -> Workload:
    """A new draw of ``workload``'s traffic (the module's docstring), reproducible by ``seed``."""
    n = len(workload)
    if n == 0:
        return workload
    if not (block_s > 0 and reach_s >= 0):
        raise ValueError(f"block_s must be > 0 and reach_s >= 0, got {block_s} and {reach_s}")
    rng = np.random.default_rng(seed)
    ts = workload.timestamps
    start, span = float(ts[0]), float(ts[-1] - ts[0])
    source = np.arange(n)
    if span >= 2 * block_s:
        blocks = (start, span, block_s, reach_s)
        source, ts = _blocks(ts, workload.model_index, len(workload.models), *blocks, rng)
        order = np.argsort(ts, kind="stable")
        source, ts = source[order], ts[order]
    # then request by request: each kept a Poisson number of times, moved within its gaps
    again, moved = _poisson(ts, workload.model_index[source], rng)
    source = source[again]
    hashes = None
    if workload.block_hashes is not None:
        hashes = _copy_hashes(workload.block_hashes, source)
    return Workload(
        moved,
        workload.model_index[source],
        workload.prompt_tokens[source],
        workload.output_tokens[source],
        workload.models,
        hashes,
        workload.block_tokens,
        workload.origins_at(source),
        _copied_groups(workload.groups_at(source), source),
    )


def _copied_groups(groups: np.ndarray | None, source: np.ndarray) -> np.ndarray | None:
    """The group ids of a draw whose requests are copies of ``source``'s: the k-th copy of each
    of a group's inputs (in arrival order) joins the group's k-th copy, judged on its own."""
    if groups is None:
        return None
    order = np.argsort(source, kind="stable")
    starts = np.r_[0, np.flatnonzero(np.diff(source[order])) + 1]
    rank = np.empty(len(source), dtype=np.int64)
    rank[order] = np.arange(len(source)) - np.repeat(starts, np.diff(np.r_[starts, len(source)]))
    copies = int(rank.max()) + 1 if len(rank) else 1
    return np.where(groups >= 0, groups * copies + rank, -1)


def _blocks(
    ts: np.ndarray,
    model_index: np.ndarray,
    num_models: int,
    start: float,
    span: float,
    block_s: float,
    reach_s: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """The local block bootstrap: (the recorded request each copy is of, its arrival time)."""
    nblocks = int(np.ceil(span / block_s)) or 1
    targets = start + block_s * np.arange(nblocks)
    last = start + span - block_s  # the latest a stretch may start and still end within the log
    # where each block's stretch may start: within reach of the block, within the log (every model)
    lo_reach = np.maximum(start, targets - reach_s)
    hi_reach = np.maximum(np.minimum(last, targets + reach_s), lo_reach)
    sources, times = [], []
    for model in range(num_models):
        mine = np.flatnonzero(model_index == model)  # in arrival order
        if not len(mine):
            continue
        t = ts[mine]
        begin = lo_reach + rng.random(nblocks) * (hi_reach - lo_reach)
        lo = np.searchsorted(t, begin, side="left")
        hi = np.searchsorted(t, begin + block_s, side="left")
        counts = hi - lo
        total = int(counts.sum())
        if not total:
            continue
        # the ranges lo[j]..hi[j] - 1 one after the other, and each copy's shift into block j
        offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
        picked = np.repeat(lo - offsets, counts) + np.arange(total)
        sources.append(mine[picked])
        times.append(t[picked] + np.repeat(targets - begin, counts))
    if not sources:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    source, moved = np.concatenate(sources), np.concatenate(times)
    keep = moved <= start + span  # the last block may reach past the log's end
    return source[keep], moved[keep]


def _poisson(
    ts: np.ndarray, model_index: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The Poisson bootstrap with local moves: (the request each copy is of, its time)."""
    n = len(ts)
    if not n:
        return np.zeros(0, dtype=np.int64), ts
    half_gap = _half_gaps(ts, model_index)
    source = np.repeat(np.arange(n), rng.poisson(1.0, n))
    moved = ts[source] + rng.uniform(-1.0, 1.0, len(source)) * half_gap[source]
    return source, np.clip(moved, float(ts[0]), float(ts[-1]))


def _half_gaps(ts: np.ndarray, model_index: np.ndarray) -> np.ndarray:
    """Per request, half the gap between its model's requests before and after it (one side's gap
    where it has one neighbour; 0 for a model's only request)."""
    out = np.zeros(len(ts))
    order = np.lexsort((ts, model_index))  # by model, then time
    sorted_ts, sorted_model = ts[order], model_index[order]
    same = sorted_model[1:] == sorted_model[:-1]
    gap = np.where(same, np.diff(sorted_ts), np.nan)  # gap[i]: between sorted i and i + 1
    both = np.stack((np.concatenate(([np.nan], gap)), np.concatenate((gap, [np.nan]))))
    # the mean of the two gaps where both exist, else the one there is; 0 with neither
    count = np.sum(~np.isnan(both), axis=0)
    total = np.nansum(both, axis=0)
    out[order] = np.where(count > 0, total / np.maximum(count, 1), 0.0) / 2
    return out


def _copy_hashes(hashes: tuple[tuple[int, ...], ...], source: np.ndarray) -> list[tuple[int, ...]]:
    """Each copy's prompt block hashes: the blocks recorded in two or more requests kept, from the
    first block only its own request had on, hashes of the copy's own (fresh integers above every
    recorded one, so they meet no recorded block and no other copy's)."""
    seen = Counter(h for hs in hashes for h in set(hs))
    fresh = max((max(hs) for hs in hashes if hs), default=0) + 1
    out = []
    for i in source.tolist():
        hs = hashes[i]
        shared = 0
        while shared < len(hs) and seen[hs[shared]] > 1:
            shared += 1
        own = len(hs) - shared
        out.append(hs[:shared] + tuple(range(fresh, fresh + own)))
        fresh += own
    return out
