"""Algorithm 2 of the paper (section 6.3) as a pure function, and the integer clock admission uses.

Moore-Hodgson: take the jobs in deadline order, append each to the schedule, and when the one just
appended would finish after its deadline, drop the longest job in the schedule. The kept jobs, run
in deadline order from ``t0``, meet every deadline, and no other set meets more (Moore 1968; the
paper's section 6.3 applies it with prefill time = prompt tokens / prefill speed).

``admission.DeadlineQueue`` maintains the same schedule incrementally on integer nanoseconds, so that
its sums and a fresh run's agree exactly; tests compare the two.

``ranked_moore_hodgson`` is the rule admission uses when requests differ in rank (priority class,
then fair share): a failing check drops the lowest rank first (the longest among those), and keeps
dropping until the check passes. With one rank it is Moore-Hodgson: dropping the longest job always
makes the check pass again.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = ["NS", "moore_hodgson", "prefill_ns", "ranked_moore_hodgson", "to_ns"]

NS = 1_000_000_000


def to_ns(t: float) -> int:
    return round(t * NS)


def prefill_ns(prompt_tokens: int, tokens_per_s: float) -> int:
    return math.ceil(prompt_tokens * NS / tokens_per_s)


def moore_hodgson(jobs: Sequence[tuple[float, float]], t0: float) -> list[int]:
    """Algorithm 2 on ``(deadline, prefill_time)`` pairs starting at ``t0``.

    Returns the indices of the kept schedule in the order they run (deadline, then index). Among
    equally long prefills the lower index is dropped first.
    """
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i][0], i))
    heap: list[tuple[float, int]] = []
    t = t0
    for i in order:
        deadline, p = jobs[i]
        t += p
        if t > deadline:
            t += heapq.heappushpop(heap, (-p, i))[0]
        else:
            heapq.heappush(heap, (-p, i))
    kept = {i for _, i in heap}
    return [i for i in order if i in kept]


def ranked_moore_hodgson(jobs: Sequence[tuple[int, int, int]], t0: int) -> list[int]:
    """The ranked rule on ``(deadline, prefill, rank)`` triples in integer time, from ``t0``.

    A job that cannot meet its deadline even alone is left out. Returns the indices of the kept
    schedule in run order. A higher rank is kept longer; among one rank the longest prefill is
    dropped first, then the lower index.
    """
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i][0], i))
    heap: list[tuple[int, int, int]] = []
    t = t0
    for i in order:
        deadline, p, rank = jobs[i]
        if t0 + p > deadline:
            continue
        heapq.heappush(heap, (rank, -p, i))
        t += p
        while t > deadline:
            t += heapq.heappop(heap)[1]
    kept = {i for _, _, i in heap}
    return [i for i in order if i in kept]
