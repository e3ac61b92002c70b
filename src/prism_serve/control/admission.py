"""Device-level admission: Algorithm 2 of the paper (section 6.3), kept up to date incrementally.

One queue per device holds the requests of every model on it. The schedule is Moore-Hodgson: walk
the requests in deadline order (``arrival + TTFT SLO``), append each to the schedule, and when the
one just appended would finish after its deadline, drop the request with the longest prefill from
the schedule. Prefill time is ``prompt tokens / prefill speed`` of the model on this device, counting
only the prompt tokens not expected to be cached on the request's replica (``Request.prefill_tokens``:
the control loop's prefix index, prefix_index.py); memory fits still count the whole prompt. The
kept schedule maximizes the number of requests whose prefill meets its deadline when prefills run
one after another from ``T0``.

``T0`` is ``max(now, busy_until)``: ``busy_until`` is when the prefills this queue already dispatched
are predicted to finish, so dispatched work is not scheduled twice.

Each model's deadlines are checked less a margin: how late its first tokens have come after the
schedule predicted them (``first_token``; the step that ends a prefill also carries the running
decodes, which the prefill speed does not count), at most half the TTFT SLO. Without it, under
sustained overload the schedule keeps requests that then miss by a few milliseconds each.

Dispatch walks the kept schedule in deadline order and starts each request whose engine can start
it now (see ``capacity.py``). A kept request may start before an earlier kept one that is waiting
(its engine is still loading, say) only if every earlier request still meets its deadline after
the extra prefill; a request waiting for the device's shared memory stops later ones from taking
that memory. Requests the schedule dropped are *deferred*: they stay queued and are scheduled again
at every call. A request that cannot meet its deadline even if started now is *late*: it leaves the
schedule for good and is served, oldest deadline first, only with slack no scheduled request needs
(its prefill must not push any of them past its deadline). With ``abort_on_miss`` dropped and late
requests are rejected instead, with reason ``DEADLINE_MISS``.

Incremental maintenance. Recomputing the schedule costs O(n log n) per call. The queue keeps the
last schedule and reuses it as long as it is provably what a fresh run at the current ``T0`` would
return; all times are integer nanoseconds so the fresh and the incremental sums agree exactly:
- each position records the latest ``T0`` at which its deadline check still passes; while ``T0``
  stays at or below the minimum of those, every check and so every removal is unchanged;
- a request whose deadline is the latest in the queue is folded in as one more Moore-Hodgson step;
- a request whose deadline falls mid-queue joins the schedule directly when every position has at
  least its prefill time of slack (then a fresh run would keep it and drop exactly the same ones);
  the later positions' margins shrink by its prefill in one C-level pass over a list;
- a late arrival is dropped at its own position by any run, so it is filed as late directly;
- dispatching a kept request shifts ``T0`` and the later positions' sums by the same amount, so only
  the checks before it need re-testing, which the dispatch walk does as it goes (jumping over the
  requests of models that cannot start anything with list scans);
- a dropped request removed when it was dropped at its own position changes nothing.
Anything else (a mid-queue arrival without that slack, a cancelled kept request, a speed change)
marks the schedule stale and the next call that can dispatch recomputes it: O(n) for n schedulable
requests, about 0.2 us each in CPython. ``replans`` and the other counters in ``stats`` show how
often each path ran. The pure algorithm is ``moore_hodgson.moore_hodgson``.

Classes and fair share. Each request has a rank (``_rank``): its priority class first
(``Priority``: interactive over standard over batch), then how little its tenant was over its fair
share of the class when it arrived (``Request.share``, control/fairness.py). While every request in
the queue has one rank, the schedule is Algorithm 2 exactly, kept as above. When ranks differ, a
failing check drops the request of the lowest rank (longest prefill among those, then oldest),
and keeps dropping until the check passes (dropping a short request may not be enough), so under
overload batch requests yield first, then standard ones, then a class's requests of tenants over
their share; ``moore_hodgson.ranked_moore_hodgson`` is that rule as a pure function. A queue of
mixed ranks keeps its schedule while only time passes, up to the latest T0 at which every position
still passes its check after the same drops and no dropped request turns late; anything else (an
arrival, a dispatch, a cancel, a speed, margin or rank change) recomputes it (O(n log n); counted
in ``stats["ranked"]``).
A batch request, whose deadline is its batch's window, is scheduled after everything else anyway;
it is *best-effort*, as is every request of a tenant over its fair share (its share level above
0): a best-effort request starts only while no prefill is pending on the device and the device
runs fewer requests of every class (those on its engines and those this call starts) than
``best_effort_share`` of an engine's sequence slots (its largest ``max_num_seqs``), and while it
waits it holds no one back. So best-effort work fills idle capacity and does not crowd the
engines' steps, which every running request shares. Only its start yields: once running, it runs.
"""

from __future__ import annotations

import contextlib
import heapq
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Mapping
from itertools import repeat
from operator import attrgetter, sub

from prism_serve.control.capacity import DeviceRoom, Fit
from prism_serve.control.fairness import LEVELS
from prism_serve.control.moore_hodgson import NS, moore_hodgson, prefill_ns, ranked_moore_hodgson, to_ns
from prism_serve.control.queues import RequestQueue, _reject_never
from prism_serve.control.types import (
    Action,
    DeviceSnapshot,
    Dispatch,
    EngineSnapshot,
    InvalidSnapshotError,
    Priority,
    Reject,
    RejectReason,
    Request,
)

__all__ = ["NS", "DeadlineQueue", "moore_hodgson", "prefill_ns", "ranked_moore_hodgson", "to_ns"]

_FAR = 1 << 62  # "never binds": the margin of a position whose check failed (it stays failed)
_SPEED_TOLERANCE = 0.02  # speed changes below this are noise; re-scheduling for them costs O(n)
# A model's deadline margin is this quantile of how late its last first tokens came after the
# schedule's prediction (first_token); a new margin is taken only once it moves by more than a tenth
# or a millisecond, whichever is more, since re-timing the queue costs O(n log n).
_LATENESS_WINDOW = 32
_LATENESS_QUANTILE = 0.9
_MARGIN_STEP_NS = 1_000_000
_SEQ_BITS = 40  # a queue would need 10^12 pushes before sequence numbers spill into the prefill bits
_SEQ_MASK = (1 << _SEQ_BITS) - 1


def _rank(priority: Priority, share: int) -> int:
    """Higher is kept longer under overload: the class first, then a lower share level."""
    share = min(max(share, 0), LEVELS - 1)
    return (Priority.BATCH - priority) * LEVELS + (LEVELS - 1 - share)


class _Entry:
    __slots__ = ("deadline", "due", "key", "model", "p", "rank", "request", "seq", "sort", "where")

    def __init__(self, request: Request, seq: int, p: int, margin: int) -> None:
        self.request = request
        self.model = request.model
        self.rank = _rank(request.origin.priority, request.share)
        self.seq = seq
        self.due = to_ns(request.deadline)
        self.set_margin(margin)
        self.set_p(p)
        self.where = "pending"  # pending | cand | late

    def set_margin(self, margin: int) -> None:
        """The deadline the schedule checks: the SLO's, less ``margin`` (how late the engine's first
        tokens come after the prefill the schedule predicts), at most half the TTFT SLO."""
        self.deadline = self.due - min(margin, to_ns(self.request.ttft_slo) // 2)
        self.sort = (self.deadline, self.seq)

    def set_p(self, p: int) -> None:
        self.p = p
        # One int instead of a (-p, seq) tuple: heap comparisons are the hot path of every schedule run.
        # Smallest first = longest prefill first, then oldest; key >> _SEQ_BITS == -p, key & _SEQ_MASK == seq.
        self.key = (-p << _SEQ_BITS) + self.seq


_BATCH_RANKS = frozenset(range(LEVELS))  # _rank of the batch class, at every share level
# the ranks of requests of the interactive and standard classes from tenants within their share
_FIRST_RANKS = frozenset(
    (Priority.BATCH - p) * LEVELS + LEVELS - 1 for p in (Priority.INTERACTIVE, Priority.STANDARD)
)
_BEST_EFFORT = frozenset(range(3 * LEVELS)) - _FIRST_RANKS  # batch, and tenants over their share
_SORT = attrgetter("sort")
_SEQ = attrgetter("seq")
_MODEL = attrgetter("model")


class DeadlineQueue(RequestQueue):
    """Prism's per-device queue (Algorithm 2). See the module docstring for the rules."""

    def __init__(
        self,
        device: str,
        *,
        reserve_tokens: int = 0,
        abort_on_miss: bool = False,
        default_prefill_tokens_per_s: float = 8000.0,
        best_effort_share: float = 0.125,
        learn_lateness: bool = True,
    ) -> None:
        super().__init__(device, reserve_tokens=reserve_tokens)
        if not default_prefill_tokens_per_s > 0:
            raise InvalidSnapshotError("default_prefill_tokens_per_s must be > 0")
        if not 0 < best_effort_share <= 1:
            raise InvalidSnapshotError("best_effort_share must be in (0, 1]")
        self.best_effort_share = best_effort_share
        self.learn_lateness = learn_lateness  # False: no margin (first_token learns nothing)
        self._running = 0  # requests the device's engines run, counted at admit (best_effort_share)
        self._best_effort_below = 1  # best-effort requests start only while _running is below this
        self._now_ns = 0  # the admit call's now
        self.abort_on_miss = abort_on_miss
        self.default_prefill_tokens_per_s = default_prefill_tokens_per_s
        self._entries: dict[str, _Entry] = {}
        self._pending: list[_Entry] = []
        self._cands: list[_Entry] = []  # schedulable, deadline order
        self._late: list[_Entry] = []  # cannot meet the deadline any more, deadline order
        self._late_min_p = _FAR  # a lower bound on the prefill time of every late request
        self._speed: dict[str, float] = {}
        self._seq = 0
        self._busy_until = -_FAR
        # the schedule: valid for T0 in [_t0, _limit]
        self._valid = False
        self._t0 = -_FAR
        self._limit = -_FAR
        self._heap: list[int] = []  # keys of kept requests
        self._cum = 0  # their total prefill time
        self._dropped: set[int] = set()  # seqs of deferred requests
        self._self_popped: set[int] = set()  # dropped at their own position: removing them changes nothing
        self._heap_gone: set[int] = set()  # keys of dispatched requests still in _heap (lazy deletion)
        self._min_p = 0  # a lower bound on every candidate's prefill time
        # Parallel to _cands, so scans and bulk updates run in C: _margins[i] + _moff is the latest T0
        # at which position i's deadline check passes (_FAR where it fails); _models[i] its model.
        self._margins: list[int] = []
        self._models: list[str] = []
        self._moff = 0
        self._held: list[Action] = []  # rejections found outside admit, returned by the next admit
        self._ranks: dict[int, int] = {}  # rank -> queued requests of it (more than one: a mixed queue)
        self._ranked_plan = False  # the schedule was made by _replan_ranked (no incremental paths)
        # the first token the schedule promised each dispatched request (the predicted end of the
        # prefills its walk dispatched, ns), how much later than that the last first tokens of each
        # model came, and the margin taken off that model's deadlines for it (``first_token``)
        self._promised: dict[str, tuple[str, int]] = {}
        self._lateness: dict[str, deque[int]] = {}
        self._margin: dict[str, int] = {}
        self.stats = {
            "replans": 0, "fast_appends": 0, "middle_inserts": 0, "fast_dispatches": 0, "reused": 0,
            "ranked": 0,
        }  # fmt: skip

    # -- queue contract ------------------------------------------------------------------------

    def _push(self, request: Request) -> None:
        speed = self._speed.get(request.model, self.default_prefill_tokens_per_s)
        margin = self._margin.get(request.model, 0)
        e = _Entry(request, self._seq, prefill_ns(request.prefill_tokens, speed), margin)
        self._seq += 1
        self._entries[request.req_id] = e
        self._ranks[e.rank] = self._ranks.get(e.rank, 0) + 1
        self._pending.append(e)

    def _remove(self, req_id: str) -> _Entry:
        """``req_id``'s entry leaves the queue's books (its lists are the caller's to mend)."""
        e = self._entries.pop(req_id)
        left = self._ranks[e.rank] - 1
        if left:
            self._ranks[e.rank] = left
        else:
            del self._ranks[e.rank]
        return e

    def _cancel(self, req_id: str) -> Request:
        e = self._remove(req_id)
        if e.where == "pending":
            self._pending.remove(e)
        elif e.where == "late":
            del self._late[bisect_left(self._late, e.sort, key=_SORT)]
        else:
            i = bisect_left(self._cands, e.sort, key=_SORT)
            del self._cands[i], self._margins[i], self._models[i]
            if e.seq not in self._self_popped:
                self._valid = False
            self._dropped.discard(e.seq)
            self._self_popped.discard(e.seq)
        return e.request

    def requests(self) -> list[Request]:
        """Every queued request, in the order they were pushed."""
        return [e.request for e in sorted(self._entries.values(), key=attrgetter("seq"))]

    def schedule(self, now: float) -> list[Request]:
        """The kept schedule at ``now`` in run order (brings the schedule up to date; dispatches nothing).

        With ``abort_on_miss`` the rejections this produces are returned by the next ``admit``.
        """
        self._refresh(self._t0_at(now), self._held)
        return [e.request for e in self._cands if e.seq not in self._dropped]

    def start_ns(self, now: float) -> int:
        """T0 in integer nanoseconds: when the next prefill could start (tests and tracing)."""
        return self._t0_at(now)

    def latest_starts_ns(self, now: float) -> list[tuple[str, int | None]]:
        """Per schedulable request in deadline order: the latest T0 (ns) at which its position's
        deadline check passes, None where the check fails (tests and tracing)."""
        self._refresh(self._t0_at(now), self._held)
        return [
            (e.request.req_id, None if m >= _FAR // 2 else m + self._moff)
            for e, m in zip(self._cands, self._margins, strict=True)
        ]

    def deferred(self, now: float) -> list[Request]:
        """Requests the schedule drops at ``now`` that could still meet their deadline if started now."""
        t0 = self._t0_at(now)
        self._refresh(t0, self._held)
        return [e.request for e in self._cands if e.seq in self._dropped and t0 + e.p <= e.deadline]

    def late(self, now: float) -> list[Request]:
        """Requests that cannot meet their deadline even if started at ``now``, deadline order."""
        t0 = self._t0_at(now)
        self._refresh(t0, self._held)
        late = [e for e in self._cands if e.seq in self._dropped and t0 + e.p > e.deadline]
        return [e.request for e in sorted(self._late + late, key=_SORT)]

    # -- admission ------------------------------------------------------------------------------

    def admit(
        self, now: float, device: DeviceSnapshot, engines: Mapping[str, EngineSnapshot]
    ) -> list[Action]:
        out: list[Action] = self._held
        self._held = []
        self._sync_speeds(engines)
        room = DeviceRoom(device, engines, self.reserve_tokens)
        startable = room.startable()
        if not startable and not self.abort_on_miss:
            return out  # nothing can start: leave the work for a call that can dispatch
        t = self._t0_at(now)
        self._refresh(t, out)
        self._now_ns, self._running = to_ns(now), 0
        if not _BEST_EFFORT.isdisjoint(self._ranks):  # best-effort requests are queued
            mine = [e for e in engines.values() if e.device == self.device]
            self._running = sum(e.num_running for e in mine)
            slots = max((e.max_num_seqs or 0 for e in mine), default=0)  # one engine's batch
            self._best_effort_below = max(1, int(self.best_effort_share * slots))
        if self._cands and startable:
            t = self._dispatch_schedule(t, room, startable, out)
        limit = self._limit if self._cands else _FAR
        if self._late and startable and t + self._late_min_p <= limit:
            # Late requests only use slack: every schedulable request must still meet its deadline.
            self._dispatch_late(t, limit, room, startable, out)
        return out

    def _yields(self, t: int) -> bool:
        """Whether a best-effort request (batch, or over its tenant's share) waits with the next
        prefill due at ``t``: while prefills are pending or the device is busy (module docstring)."""
        return t > self._now_ns or self._running >= self._best_effort_below

    def _t0_at(self, now: float) -> int:
        return max(to_ns(now), self._busy_until)

    def _refresh(self, t0: int, out: list[Action]) -> None:
        if len(self._ranks) > 1 and self.shares is not None and self._rerank():
            self._valid = False  # a tenant's level fell: its requests rank lower from now on
        if self._ranked_plan != (len(self._ranks) > 1):
            # ranks mixed or one again: each kind of schedule is kept by its own rules
            self._valid = False
        if self._valid and not self._t0 <= t0 <= self._limit:
            self._valid = False
        if self._pending:
            self._absorb_pending(t0, out)
        if not self._valid:
            self._replan(t0, out)
        else:
            self.stats["reused"] += 1
            self._t0 = t0

    def _rerank(self) -> bool:
        """Rank every queued request down to its tenant's level now (``shares``) if that is lower
        than the one it arrived with: a tenant found over its share yields with the requests it
        queued before. Never up: a backlog that turned first-rank at once would crowd the engines.
        Returns whether any rank changed."""
        shares, counts, changed = self.shares, {}, False
        levels: dict = {}  # one lookup per origin: a backlog's requests share a few
        for e in self._entries.values():
            origin = e.request.origin
            level = levels.get(origin)
            if level is None:
                level = levels[origin] = _rank(origin.priority, shares(origin))
            if level < e.rank:
                e.rank, changed = level, True
            counts[e.rank] = counts.get(e.rank, 0) + 1
        self._ranks = counts
        return changed

    def _sync_speeds(self, engines: Mapping[str, EngineSnapshot]) -> None:
        for model, e in engines.items():
            if e.device != self.device or e.prefill_tokens_per_s is None:
                continue
            old = self._speed.get(model, self.default_prefill_tokens_per_s)
            if abs(e.prefill_tokens_per_s - old) <= _SPEED_TOLERANCE * old:
                continue  # noise: every request of a model keeps being timed at one speed
            self._speed[model] = e.prefill_tokens_per_s
            self._valid = False
            for entry in self._entries.values():
                if entry.request.model == model:
                    entry.set_p(prefill_ns(entry.request.prefill_tokens, e.prefill_tokens_per_s))
            # a faster engine can make late requests schedulable again: let the next run re-sort them
            if self._late_rejoin(model):
                self._cands.sort(key=_SORT)
                self._realign()

    def _late_rejoin(self, model: str) -> bool:
        """``model``'s late requests rejoin the candidates (after a change that may make them
        schedulable again; the next run files whoever is still late); whether there were any."""
        back = [entry for entry in self._late if entry.model == model]
        if back:
            self._late = [entry for entry in self._late if entry.model != model]
            for entry in back:
                entry.where = "cand"
            self._cands.extend(back)
        return bool(back)

    def margin_ns(self, model: str) -> int:
        """What ``model``'s deadlines have taken off for the lateness of its first tokens (ns; each
        request's at most half its TTFT SLO; tests and tracing)."""
        return self._margin.get(model, 0)

    def first_token(self, req_id: str, at: float | None) -> None:
        """Learn how late first tokens come after the schedule's prediction: the end of the
        back-to-back prefills from T0 of the requests dispatched with it (they end together, with
        the step that carries the last of them). That step also carries every running request's
        decode, and a request joins a step only once the one in flight ends: neither is in the
        prefill speed. Under overload the schedule keeps requests with no slack to spare, so each such
        second would be a miss. A model's margin is the ``_LATENESS_QUANTILE`` of the lateness of its
        last ``_LATENESS_WINDOW`` first tokens (never below 0), and is taken off its requests'
        deadlines (at most half the TTFT SLO) in every check the schedule makes."""
        promised = self._promised.pop(req_id, None)
        if promised is None or at is None or not self.learn_lateness:
            return
        model, due = promised
        window = self._lateness.get(model)
        if window is None:
            window = self._lateness[model] = deque(maxlen=_LATENESS_WINDOW)
        window.append(to_ns(at) - due)
        ranked = sorted(window)
        margin = max(0, ranked[min(len(ranked) - 1, int(_LATENESS_QUANTILE * len(ranked)))])
        old = self._margin.get(model, 0)
        if abs(margin - old) <= max(_MARGIN_STEP_NS, old // 10):
            return
        self._margin[model] = margin
        mine = [entry for entry in self._entries.values() if entry.model == model]
        for entry in mine:
            entry.set_margin(margin)
        # re-sorted as after a speed change, late ones included: a smaller margin can make them
        # schedulable again
        if self._late_rejoin(model) or any(entry.where == "cand" for entry in mine):
            self._cands.sort(key=_SORT)
            self._realign()
            self._valid = False

    def _absorb_pending(self, t0: int, out: list[Action]) -> None:
        pending = []
        for e in self._pending:
            # a request that cannot make its deadline even alone is dropped at its own position by
            # any schedule run, leaving the schedule as it was: file it as late without a re-run
            if t0 + e.p > e.deadline:
                self._make_late(e, out)
            else:
                pending.append(e)
        self._pending = []
        if not pending:
            return
        if len(pending) > 1:
            pending.sort(key=_SORT)
        cands = self._cands
        fast = self._valid and not self._ranked_plan  # the fast paths are Algorithm 2's, one rank
        rest = pending if not fast else []
        heap, gone = self._heap, self._heap_gone
        for i, e in enumerate(pending if fast else ()):
            if cands and e.sort < cands[-1].sort:
                if self._insert_middle(e, t0):
                    continue
                rest = pending[i:]
                break
            self.stats["fast_appends"] += 1
            e.where = "cand"
            self._min_p = min(self._min_p, e.p)
            c = self._cum + e.p
            if t0 + c > e.deadline:
                # dispatched requests leave the heap lazily: only its top must be a real one here
                while heap and heap[0] in gone:
                    gone.discard(heapq.heappop(heap))
                key = heapq.heappushpop(heap, e.key)
                self._cum = c + (key >> _SEQ_BITS)
                self._dropped.add(key & _SEQ_MASK)
                self._margins.append(_FAR)
                if key == e.key:
                    self._self_popped.add(e.seq)
                    if self.abort_on_miss:
                        self._margins.pop()
                        self._reject_miss(e, out, "dropped by the deadline schedule")
                        continue
                elif self.abort_on_miss:
                    self._valid = False  # the one dropped must go; the next schedule must not count it
            else:
                heapq.heappush(heap, e.key)
                self._cum = c
                self._margins.append(e.deadline - c - self._moff)
                self._limit = min(self._limit, e.deadline - c)
            cands.append(e)
            self._models.append(e.model)
        if rest:
            for e in rest:
                e.where = "cand"
            if len(rest) <= 8:
                for e in rest:
                    i = bisect_left(cands, e.sort, key=_SORT)
                    cands.insert(i, e)
                    self._margins.insert(i, _FAR)
                    self._models.insert(i, e.model)
            else:
                cands.extend(rest)
                cands.sort(key=_SORT)
                self._realign()
            self._valid = False

    def _realign(self) -> None:
        """Rebuild the parallel lists after a bulk change; the schedule is stale then anyway."""
        self._margins = [_FAR] * len(self._cands)
        self._models = list(map(_MODEL, self._cands))

    def _insert_middle(self, e: _Entry, t0: int) -> bool:
        """Add ``e`` (its deadline is not the latest) to the schedule without a re-run when a fresh
        run provably keeps it and changes nothing else, which holds if every position's margin is at
        least ``e``'s prefill: then no later check fails because of it, and at every later drop the
        request dropped is longer than ``e`` (the position before a failing check has less slack
        than that request's prefill), so the drops are the same. The same bound makes ``e`` meet its
        own deadline after the kept requests before it. Returns False, changing nothing, otherwise.
        """
        if self._limit - e.p < t0:
            return False
        cands, margins = self._cands, self._margins
        k = bisect_left(cands, e.sort, key=_SORT)
        cum = 0
        if k:
            if margins[k - 1] >= _FAR // 2:
                return False  # the position before dropped someone: the sum there is not stored
            cum = cands[k - 1].deadline - (margins[k - 1] + self._moff)
        self.stats["middle_inserts"] += 1
        e.where = "cand"
        margin = e.deadline - cum - e.p
        cands.insert(k, e)
        self._models.insert(k, e.model)
        margins.insert(k, margin - self._moff)
        margins[k + 1 :] = map(sub, margins[k + 1 :], repeat(e.p))  # later sums grow by its prefill
        heapq.heappush(self._heap, e.key)
        self._cum += e.p
        self._min_p = min(self._min_p, e.p)
        self._limit = min(self._limit - e.p, margin)
        return True

    def _replan(self, t0: int, out: list[Action]) -> None:
        """A fresh Algorithm 2 run at ``t0`` over every schedulable request."""
        self.stats["replans"] += 1
        if len(self._ranks) > 1:
            self._replan_ranked(t0, out)
            return
        self._ranked_plan = False
        heap: list[int] = []
        push, pushpop = heapq.heappush, heapq.heappushpop
        dropped: set[int] = set()
        self_popped: set[int] = set()
        late: list[_Entry] = []
        margins: list[int] = []
        add_margin = margins.append
        cum = 0
        far = limit = min_p = _FAR
        bits, mask = _SEQ_BITS, _SEQ_MASK
        # the hot loop of admission: locals only
        for e in self._cands:
            p = e.p
            d = e.deadline - t0
            if p > d:
                late.append(e)
                continue
            if p < min_p:
                min_p = p
            c = cum + p
            if c > d:
                key = pushpop(heap, e.key)
                cum = c + (key >> bits)
                dropped.add(key & mask)
                add_margin(far)
                if key == e.key:
                    self_popped.add(key & mask)
            else:
                push(heap, e.key)
                cum = c
                m = d - c
                add_margin(m)
                if m < limit:
                    limit = m
        keep = self._cands
        if late:
            if len(late) <= 16:  # a few: cheaper to cut them out than to copy the list
                for e in late:
                    del keep[bisect_left(keep, e.sort, key=_SORT)]
            else:
                gone = {e.seq for e in late}
                keep = [e for e in keep if e.seq not in gone]
            for e in late:
                self._make_late(e, out)
        if self.abort_on_miss and dropped:
            for e in keep:
                if e.seq in dropped:
                    self._reject_miss(e, out, "dropped by the deadline schedule")
            keep = [e for e in keep if e.seq not in dropped]
            dropped, self_popped = set(), set()
            cum, limit, margins = 0, _FAR, []
            for e in keep:  # the kept set alone: no check fails, only the margins change
                cum += e.p
                margins.append(e.deadline - t0 - cum)
                limit = min(limit, margins[-1])
            heap = [e.key for e in keep]
            heapq.heapify(heap)
        self._cands = keep
        self._margins = margins
        self._models = list(map(_MODEL, keep))
        self._heap = heap
        self._heap_gone.clear()
        self._cum = cum
        self._dropped = dropped
        self._self_popped = self_popped
        self._min_p = 0 if min_p == _FAR else min_p
        # margins were computed relative to t0; store them as "latest T0" by folding t0 into the offset
        self._moff = t0
        self._t0 = t0
        self._limit = limit + t0 if limit < _FAR else _FAR
        self._valid = True

    def _replan_ranked(self, t0: int, out: list[Action]) -> None:
        """Algorithm 2 over a queue of mixed ranks (module docstring). The result holds, unchanged,
        for every T0 up to ``_limit``: at most the slack left at every position after its drops (so
        each position drops the same requests: it failed at a smaller T0 with one drop fewer) and
        the latest T0 at which no dropped request turns late (a late one leaves the walk, which
        could change a later drop). Any other change (an arrival, a dispatch, a cancel, a speed,
        margin or rank change) recomputes it: the incremental paths are Algorithm 2's."""
        self.stats["ranked"] += 1
        heap: list[tuple[int, int, int]] = []
        dropped: set[int] = set()
        late: list[_Entry] = []
        cum = 0
        slack = _FAR  # the least slack any position has after its drops
        for e in self._cands:
            d = e.deadline - t0
            if e.p > d:
                late.append(e)
                continue
            heapq.heappush(heap, (e.rank, -e.p, e.seq))
            cum += e.p
            while cum > d:
                _, neg_p, seq = heapq.heappop(heap)
                cum += neg_p
                dropped.add(seq)
            slack = min(slack, d - cum)
        if late:
            gone = {e.seq for e in late}
            self._cands = [e for e in self._cands if e.seq not in gone]
            for e in late:
                self._make_late(e, out)
        if self.abort_on_miss and dropped:
            for e in self._cands:
                if e.seq in dropped:
                    self._reject_miss(e, out, "dropped by the deadline schedule")
            self._cands = [e for e in self._cands if e.seq not in dropped]
            dropped = set()
        # each kept position's latest T0, over the kept requests before it; dropped ones never bind
        margins: list[int] = []
        cum, limit, min_p = 0, t0 + slack, _FAR
        for e in self._cands:
            min_p = min(min_p, e.p)
            if e.seq in dropped:
                margins.append(_FAR)
                limit = min(limit, e.deadline - e.p)
                continue
            cum += e.p
            margins.append(e.deadline - cum)
            limit = min(limit, e.deadline - cum)
        self._margins = margins
        self._models = list(map(_MODEL, self._cands))
        self._heap = []
        self._heap_gone.clear()
        self._cum = cum
        self._dropped = dropped
        self._self_popped = set()
        self._min_p = 0 if min_p == _FAR else min_p
        self._moff = 0
        self._t0 = t0
        self._limit = limit
        self._valid = True
        self._ranked_plan = True

    def _make_late(self, e: _Entry, out: list[Action]) -> None:
        if self.abort_on_miss:
            self._reject_miss(e, out, "cannot meet its TTFT deadline even if started now")
            return
        e.where = "late"
        insort(self._late, e, key=_SORT)
        self._late_min_p = min(self._late_min_p, e.p)

    def _reject_miss(self, e: _Entry, out: list[Action], why: str) -> None:
        self._remove(e.request.req_id)
        self._emit(
            out,
            Reject(
                e.request,
                RejectReason.DEADLINE_MISS,
                f"{why} (deadline {e.request.deadline:.3f}s, prefill {e.p / NS:.3f}s)",
            ),
        )

    def _dispatch_schedule(self, t0: int, room: DeviceRoom, startable: set[str], out: list[Action]) -> int:
        """Start kept requests in schedule order; returns the new T0.

        A request may start ahead of earlier kept ones only if they all still meet their deadlines
        (``kept_min``). If that makes an earlier *deferred* position's check fail (``all_min``), the
        rest of the schedule is still optimal but may differ from a fresh run's; it is recomputed at
        the next call. Requests of models that cannot start anything only count towards those
        minimums, so the walk jumps over them with C-level scans.
        """
        t = t0
        shift = 0  # prefill of the requests dispatched so far in this walk
        kept_min = _FAR  # latest T0 at which every kept position walked past meets its deadline
        all_min = _FAR  # the same over every position walked past
        gone: list[int] = []
        never: list[_Entry] = []
        cands, margins, models = self._cands, self._margins, self._models
        dropped = self._dropped
        effort = _BEST_EFFORT
        n = len(cands)
        if not effort.isdisjoint(self._ranks) and self._yields(t0):
            # best-effort requests wait this call: like dropped ones, they hold no one back, and
            # the walk ends after the last other position (a batch's deadline, its window, puts
            # thousands of them after everything else). The margins past it bound nothing: a
            # queue of one rank is all best-effort or none, and one of mixed ranks is recomputed
            # after any dispatch.
            waiting, n = set(dropped), 0
            for i, e in enumerate(cands):
                if e.rank in effort:
                    waiting.add(e.seq)
                else:
                    n = i + 1
            dropped = waiting
        base = self._moff
        idx = 0
        while idx < n and startable:
            nxt = n  # the next position whose model could start something
            for model in startable:
                with contextlib.suppress(ValueError):  # not in [idx, nxt)
                    nxt = models.index(model, idx, nxt)
            if nxt > idx:
                low = min(margins[idx:nxt]) + base + shift
                all_min = min(all_min, low)
                if dropped and not dropped.isdisjoint(map(_SEQ, cands[idx:nxt])):
                    low = (
                        min(
                            (
                                m
                                for m, e in zip(margins[idx:nxt], cands[idx:nxt], strict=True)
                                if e.seq not in dropped
                            ),
                            default=_FAR,
                        )
                        + base
                        + shift
                    )
                kept_min = min(kept_min, low)
            if nxt == n or kept_min < t + self._min_p:
                break  # nobody left to start, or no request is short enough to start ahead
            e = cands[nxt]
            kept = e.seq not in dropped
            if kept:
                req = e.request
                fit: Fit | None = room.fit(e.model, req.prompt_tokens)
                if fit is Fit.OK and e.rank in effort and self._yields(t):
                    fit = None  # batch fills idle capacity only (module docstring); others may start
                if fit is Fit.OK and kept_min >= t + e.p:
                    room.take(e.model, req.prompt_tokens)
                    self._remove(req.req_id)
                    self._emit(out, Dispatch(req, self.device))
                    self._running += 1
                    t += e.p
                    shift += e.p
                    gone.append(nxt)
                    if not room.can_start_any(e.model):
                        startable.discard(e.model)
                    idx = nxt + 1
                    continue
                if fit is Fit.NEVER:
                    never.append(e)
                elif fit is Fit.NO_MEMORY and room.short_of_shared(e.model, req.prompt_tokens):
                    room.shared_blocked = True
                    startable.intersection_update(room.startable())
                elif fit is not Fit.OK and fit is not None:
                    startable.discard(e.model)
            m = margins[nxt] + base + shift
            all_min = min(all_min, m)
            if kept:
                kept_min = min(kept_min, m)
            idx = nxt + 1
        if self.learn_lateness:
            # prefills dispatched together end together, with the step that carries the last of them
            for i in gone:
                self._promised[cands[i].request.req_id] = (cands[i].model, t)
        if gone and self._ranked_plan:
            self._valid = False  # what a ranked schedule keeps after a dispatch is recomputed
        if gone:
            self.stats["fast_dispatches"] += len(gone)
            # Positions after a dispatched request lose its prefill from their sums while T0 gains it:
            # their latest-T0 margins rise by it, which the offset below applies to all. Positions
            # before it keep their margins, so they give back what the offset adds.
            done, prev = 0, 0
            for i in gone:
                margins[prev:i] = map(sub, margins[prev:i], repeat(shift - done))
                done += cands[i].p
                prev = i + 1
            for i in reversed(gone):
                self._heap_gone.add(cands[i].key)
                del cands[i], margins[i], models[i]
            self._cum -= shift
            self._moff += shift
            # all_min < t (a deferred position's check now fails) leaves _limit below _t0, so the
            # next call recomputes the schedule
            self._limit = min(self._limit + shift, all_min)
            self._busy_until = self._t0 = t
        for e in never:
            self._cancel(e.request.req_id)
            self._emit(out, _reject_never(e.request))
        return t

    def _dispatch_late(
        self, t0: int, limit: int, room: DeviceRoom, startable: set[str], out: list[Action]
    ) -> None:
        t = t0
        gone: list[int] = []
        for idx, e in enumerate(self._late):
            if not startable:
                break
            model = e.request.model
            if model not in startable or t + e.p > limit:
                continue
            if e.rank in _BEST_EFFORT and self._yields(t):
                continue  # a batch request, or a tenant's over its share: idle capacity only
            fit = room.fit(model, e.request.prompt_tokens)
            if fit is Fit.OK:
                room.take(model, e.request.prompt_tokens)
                self._remove(e.request.req_id)
                self._emit(out, Dispatch(e.request, self.device))
                self._running += 1
                t += e.p
                gone.append(idx)
                if not room.can_start_any(model):
                    startable.discard(model)
            elif fit is Fit.NEVER:
                self._remove(e.request.req_id)
                self._emit(out, _reject_never(e.request))
                gone.append(idx)
            elif fit is Fit.NO_MEMORY and room.short_of_shared(model, e.request.prompt_tokens):
                room.shared_blocked = True
                startable.intersection_update(room.startable())
            else:
                startable.discard(model)
        for idx in reversed(gone):
            del self._late[idx]
        if not self._late:
            self._late_min_p = _FAR
        if t > t0:
            self._busy_until = t
            if self._valid:
                self._t0 = t
