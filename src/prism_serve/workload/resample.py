"""Another draw of the same traffic: a workload resampled from one recorded workload, so that a plan
can ask how its answer varies with the traffic it was not given (``prism plan --confidence``).

A recorded hour is one draw of a random process; the next hour will not repeat it request for
request. :func:`resample` makes another draw that keeps what the recording says about the process
(every model's rate as it moves over the hour, its bursts, each request's lengths, which prompts
share a prefix) and varies what it cannot say (how many requests exactly, and when each arrives):

- **how many**: each request appears ``Poisson(1)`` times (none, once, twice, ...), independently:
  the Poisson bootstrap. Over a window with ``k`` requests the new count has mean ``k`` and
  variance ``k``, what a Poisson process with the window's rate would give.
- **when**: each copy arrives at its request's time moved by a uniform draw in ``+-`` half the
  gap between the request's two neighbours of the same model (the first and last request use their
  one gap). In a burst the gaps are milliseconds and so are the moves; in a quiet hour they are
  minutes. So a rate that changes over the hour keeps its shape, and two copies of one request do not
  arrive at the same instant (where the recording had one request, the draw has two close together,
  as a Poisson process does at that rate). Times stay within the recording's span.
- **what**: a copy keeps its request's model and prompt and output lengths. Its prompt block hashes
  keep the blocks that two or more recorded requests share (a system prompt, an earlier turn); the
  blocks only its request had, and every block after them, get hashes of their own per copy: two
  copies of one conversation's turn are two conversations, not one whose prefix the second finds
  cached.

The draw is a function of the workload and the seed alone.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from prism_serve.workload.format import Workload

__all__ = ["resample"]


def resample(workload: Workload, seed: int) -> Workload:
    """A new draw of ``workload``'s traffic (the module's docstring), reproducible by ``seed``."""
    n = len(workload)
    if n == 0:
        return workload
    rng = np.random.default_rng(seed)
    ts = workload.timestamps
    half_gap = _half_gaps(ts, workload.model_index)
    copies = rng.poisson(1.0, n)
    source = np.repeat(np.arange(n), copies)
    moved = ts[source] + rng.uniform(-1.0, 1.0, len(source)) * half_gap[source]
    moved = np.clip(moved, float(ts[0]), float(ts[-1]))
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
    )


def _half_gaps(ts: np.ndarray, model_index: np.ndarray) -> np.ndarray:
    """Per request, half the gap between its model's requests before and after it (one side's gap
    where it has one neighbour; 0 for a model's only request)."""
    out = np.zeros(len(ts))
    order = np.lexsort((ts, model_index))  # by model, then time
    sorted_ts, sorted_model = ts[order], model_index[order]
    same = sorted_model[1:] == sorted_model[:-1]
    gap = np.where(same, np.diff(sorted_ts), np.nan)  # gap[i]: between sorted i and i + 1
    before = np.concatenate(([np.nan], gap))
    after = np.concatenate((gap, [np.nan]))
    both = np.stack((before, after))
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
