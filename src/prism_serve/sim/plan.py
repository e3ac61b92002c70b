"""``prism plan``: the fewest devices that serve a deployment's models and traffic within their SLOs,
per policy, with what that costs and what prism saves. Simulated (sim/): the hardware profile is a
cost model, not a measurement of the user's devices.

The search, per policy, over the device count ``n`` (every point a simulation of the traffic at
``n`` devices, ``SimConfig.num_devices``; with ``screen``, first on its busiest window: below):

a sweep upward from the hard floor (the lower bound's compute and tensor-parallel counts: no
policy passes below them, sim/bound.py), ``width`` counts at a time; the first count that passes,
with its ``confirm`` counts above it passing too, is the answer (where a confirm count fails, the
sweep goes on). Every count the sweep covers below the answer is simulated and fails: attainment
need not be monotone in the device count (a placement that fits at ``n`` may not at ``n + 1``),
so a search that skips counts can answer far above the fewest. The sweep covers the first
``sweep`` counts (``SWEEP_COUNTS``, 10; ``--sweep-counts``); an answer further up, as for hundreds
of models whose answer lies tens of counts above the floor, is found by growing steps and then
halving the gap (``fewest_passing``), one count at a time per policy where the policies share the
workers: each count just below an answer runs nearly to the end before it fails, so sweeping 50
of them costs 50 near-full runs, where stepping costs about ten. The counts stepped over are
listed (``PolicyPlan.skipped``, results.json's ``skipped``, a line of the report): the count below
such an answer fails, but these were not tried. A baseline that may keep its assignment for
fewer devices and leave the rest idle (``Policy.keeps_fewer_devices``: static-partition, muxserve,
dedicated, qlm) is answered at its first passing count, with no confirmation: on any count above it
could do as well, so prism's saving is counted against its best packing, not its unluckiest; prism
is confirmed, because its own placement must hold up with more devices. The bound's memory count
is not a floor: it assumes every model with a request in a 10 s window is resident at once, and a
policy that swaps models in tens of milliseconds (CPU devices, small models) meets SLOs below it.

**The busy-window screen** (``screen=True``, ``--screen``). Before a count is simulated over the
whole traffic, it is simulated on the traffic's busiest window (the ``screen_window_s`` seconds with
the most arrivals), after a warm-up of the ``screen_warmup_s`` seconds of traffic before it whose
requests are served but not counted. If the window's requests alone miss more than the whole
traffic's budget (``(1 - target)`` x requests), the count fails without its full run: the full run's
misses include the window's, and the rest of the traffic can only add to them. One approximation
makes this a screen rather than a proof: the devices enter the window as the warm-up left them, not
as the traffic before it would have (resident models, rate estimates, queues). Minutes of warm-up
reach the state the policies keep (60 s rate windows, residency driven by recent arrivals); the
queues of an overloaded count are shorter than in the full run, which only lets a failing count
through to its full run. A count that passes its screen is run in full, which decides it; the search
asks the same counts in the same order, so a screen that fails no passing count leaves every answer
as it was. A traffic whose window and warm-up hold over half its requests is not screened. It is off
by default because it pays only where failing counts miss in bursts: a count that misses steadily
(1-5% of the requests of every window) passes a 10-minute screen and then pays a full run as well,
and a count that misses heavily already stops within minutes of its full run.

A policy whose models hold devices of their own (``Policy.exclusive_devices``: dedicated) starts
its sweep at ``exclusive_floor``, the fewest count at which the models that fit could serve all but
the target's budget of the requests; every count below it fails whatever models it picks
(``PolicyPlan.sweep_from``).

A point that has already missed more requests than the target allows stops early (its attainment is
known to be short, and a count far below the answer costs little), in a screen or a full run alike.
Such a point fails and says so: its ``stopped`` entry gives how far it got (requests seen of all,
the simulated second), its attainment over the requests it saw (which is also its attainment
figure) and the most the whole traffic could attain with the misses it had; plots draw it apart
from the points run to the end.
The policies are searched at once, their points sharing a pool of worker processes, one per core.

**How sure** (``confidence``, ``prism plan --confidence 0.9``, on by default in the command). The
answer above passes on the traffic given, which is one draw of the traffic to come. For the chosen
policy the plan then runs ``seeds`` other draws of it (workload/resample.py: each model's minutes
drawn from its own minutes nearby, independently per model, then request by request, so bursts keep
their shape and which models are busy together varies), each with every engine step scaled by one
of the hardware profile's measured step errors on the deployment's models (``HardwareProfile.
errors_for``: the fitted model's and its other shapes', drawn with the
seed: a profile that predicted a step 5% fast runs that draw 1/0.95 times slower; a datasheet
profile has none, and only the traffic varies). The count it answers is the fewest from the answer
up that passes in at least ``ceil(confidence x seeds)`` draws; each draw's attainment at each count
it ran is reported, so the plan gives a range, not a point. A count's draws run in batches of the
worker pool and stop once the count's outcome is decided (enough draws passed, or too many failed),
and each draw stops early as a count of the search does.

The answer's deployment is written as a prism.yaml: the user's config with the devices found (the
confident count where there is one) and the policy, which ``prism serve --config`` reads. Each
model's ``expected_rate`` is its mean rate in the traffic (``with_expected_rates``) where the config
leaves it unset, and every simulation of the chosen policy runs with it (the baselines run the
config as given, the practice they stand for): the control plane counts it for the part of its rate
window not yet watched, so the deployment places by the load the plan saw from its first second, as
it was simulated (a server that starts blind pairs models by whichever asked first, which no
simulation of the traffic can foresee).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from prism_serve.config import DeploymentConfig
from prism_serve.sim.bound import DeviceBound, lower_bound
from prism_serve.sim.config import ModelSLO, SimConfig
from prism_serve.sim.cost import COST_MODELS
from prism_serve.sim.deployment import SimDeployment
from prism_serve.sim.errors import SimConfigError
from prism_serve.sim.hardware import HardwareProfile, get_hardware
from prism_serve.sim.metrics import attainment, judged_units
from prism_serve.sim.models import ServedModel
from prism_serve.sim.simulator import simulate
from prism_serve.workload.format import Workload
from prism_serve.workload.resample import resample

__all__ = [
    "HOURS_PER_MONTH", "POLICIES", "BusyWindow", "Confidence", "Plan", "PolicyPlan", "busy_window",
    "exclusive_floor", "fewest_passing", "plan", "simulate_point",
]  # fmt: skip

POLICIES = ("prism", "static-partition", "dedicated", "muxserve")
HOURS_PER_MONTH = 730.0
METRICS = {"ttft": "ttft_attainment", "tpot": "tpot_attainment"}
SCREEN_WINDOW_S = 600.0  # the busiest window a count is screened on
SCREEN_WARMUP_S = 180.0  # the traffic before it that is served, not counted
SWEEP_COUNTS = 10  # counts each search asks one by one from its floor before it steps (fewest_passing)


@dataclass(slots=True, frozen=True)
class BusyWindow:
    """Requests ``first..end - 1`` of a workload (indices in arrival order) arrive in its busiest
    window; ``warmup..first - 1`` in the warm-up before it."""

    warmup: int
    first: int
    end: int

    def as_dict(self, workload: Workload) -> dict:
        ts = workload.timestamps
        return {
            "warmup_from_s": float(ts[self.warmup]),
            "from_s": float(ts[self.first]),
            "to_s": float(ts[self.end - 1]),
            "requests": self.end - self.first,
        }


def busy_window(workload: Workload, window_s: float, warmup_s: float) -> BusyWindow:
    """The ``window_s`` seconds of ``workload`` with the most arrivals (the earliest such, starting
    at an arrival), and the ``warmup_s`` seconds before it."""
    ts = workload.timestamps
    ends = np.searchsorted(ts, ts + window_s, side="left")
    first = int(np.argmax(ends - np.arange(len(ts))))
    warmup = int(np.searchsorted(ts, ts[first] - warmup_s, side="left"))
    return BusyWindow(warmup, first, int(ends[first]))


def fewest_passing(
    passes: Callable[[Sequence[int]], Mapping[int, bool]],
    low: int,
    high: int,
    confirm: int = 2,
    width: int = 1,
    screen: Callable[[Sequence[int]], Mapping[int, bool]] | None = None,
    sweep: int | None = None,
    stride: int | Callable[[], int] | None = None,
) -> int | None:
    """The fewest count in ``low..high`` that passes and whose next ``confirm`` counts (up to
    ``high``) pass too; None when there is none. ``passes`` evaluates a batch of counts (in
    parallel, if it can: ``width`` at a time) and is asked each count at most once.

    A sweep: counts are asked upward from ``low``, ``width`` at a time, so every count below the
    answer has been simulated and failed. Attainment need not be monotone in the device count (a
    policy's placement changes with it: static partitioning and MuxServe pass at 19 devices and
    fail at 26 on the 58-model hour), so a search that skips counts (doubling steps, a bisection)
    can answer a count far above the fewest. A failing count costs little: its simulation stops
    once its misses pass the target's budget, the sooner the farther it is below the answer.

    ``sweep``: the counts asked one by one from ``low`` (None: all of them) before the search
    steps: past them it asks counts at growing distances (1, 2, 4, ... above the last count that
    failed) until one passes, then halves the gap between the highest count that failed and the
    lowest that passed until they are neighbours, and asks the ``confirm`` counts above; where one
    of those fails, it steps on from it. The answer then passes with its ``confirm`` counts above
    and the count below it fails, but counts between the sweep and the answer may not have been
    asked: if attainment is not monotone one of them could pass. Near a far floor (hundreds of
    models, whose answer is tens of counts above it) a sweep costs a simulation per count, and the
    counts just below the answer nearly a full run each. ``stride``: the counts asked at once past
    the sweep (default ``width``; fewer spend less where other searches share the workers), or a
    function asked before each batch for it (a search that finishes leaves its workers to the
    others); where the halving has fewer counts left to ask than that, the rest of the batch asks
    the counts confirming the lowest pass.

    ``screen``: a cheaper test asked first, each count at most once: False says the count fails,
    and ``passes`` is not asked; True, that it may pass, and ``passes`` decides. A screen that never
    fails a count that passes leaves the answer as it is without one: the same counts are decided
    in the same order, with the same outcomes."""
    known: dict[int, bool] = {}

    def ask(counts: Iterable[int]) -> None:
        todo = sorted({n for n in counts if n not in known and low <= n <= high})
        if todo and screen is not None:
            known.update((n, False) for n, ok in screen(todo).items() if not ok)
            todo = [n for n in todo if n not in known]
        if todo:
            known.update(passes(todo))

    def above(m: int) -> range:
        """The counts that must pass too for ``m`` to be the answer."""
        return range(m + 1, min(high, m + confirm) + 1)

    def confirmed(m: int) -> bool:
        ask(above(m))
        return all(known[k] for k in above(m))

    step = max(1, width)
    at_once = (lambda: step) if stride is None else stride if callable(stride) else (lambda: stride)
    last = high if sweep is None else min(high, low + max(0, sweep) - 1)
    for first in range(low, last + 1, step):
        batch = range(first, min(last, first + step - 1) + 1)
        ask(batch)
        for m in batch:
            if known[m] and confirmed(m):
                return m
    failed = last  # every count up to it was asked, and none is the answer
    while failed < high:
        # up from the highest failure until a count passes, at distances 1, 2, 4, ...
        passing = min((n for n, ok in known.items() if ok and n > failed), default=None)
        base, gap = failed, 1
        while passing is None:
            batch, wide = [], max(1, at_once())
            while len(batch) < wide and (not batch or batch[-1] < high):
                batch.append(min(high, base + gap))
                gap *= 2
            ask(batch)
            passing = min((n for n in batch if known[n]), default=None)
            if passing is None and batch[-1] >= high:
                return None
        # then close the gap: the highest failure below the lowest pass, until they are neighbours
        while True:
            failed = max((n for n, ok in known.items() if not ok and n < passing), default=low - 1)
            if passing - failed <= 1:
                break
            gap, wide = passing - failed, max(1, at_once())
            batch = {failed + max(1, gap * i // (wide + 1)) for i in range(1, wide + 1)}  # below passing
            # a narrow gap leaves workers over: they ask the counts confirming ``passing``, nearest
            # first, which the answer needs unless it lies two or more below ``passing`` (with a gap
            # of 2 and two confirm counts, the nearest always). The batch then lasts a passing run;
            # so close to the answer a failing count nearly does too.
            unknown = (n for n in above(passing) if n not in known)
            batch.update(itertools.islice(unknown, max(0, wide - len(batch))))
            ask(batch)
            passing = min(n for n, ok in known.items() if ok and n > failed)
        if confirmed(passing):
            return passing
        failed = max(n for n in above(passing) if not known[n])
    return None


@dataclass(slots=True)
class Confidence:
    """How the chosen policy's answer holds up on other draws of the traffic (the module's
    docstring): ``devices``, the fewest count from the answer up that passed in at least ``need`` of
    ``seeds`` draws (None: none up to the search's limit); ``counts``, per count tried, each draw's
    outcome in seed order (those not run because the count was decided without them left out)."""

    level: float
    seeds: int
    need: int
    step_errors: int  # the profile's measured errors drawn from (0: the traffic alone varies)
    devices: int | None = None
    counts: dict[int, list[dict]] = field(default_factory=dict)

    def passed(self, n: int) -> int:
        return sum(d["passed"] for d in self.counts.get(n, ()))

    def attainments(self, n: int) -> list[float]:
        """The attainments of count ``n``'s draws run to their end (a stopped draw failed)."""
        return sorted(d["attainment"] for d in self.counts.get(n, ()) if not d["stopped"])

    def as_dict(self) -> dict:
        return {
            "level": self.level,
            "seeds": self.seeds,
            "need": self.need,
            "step_errors": self.step_errors,
            "devices": self.devices,
            "counts": {
                str(n): {"passed": self.passed(n), "ran": len(draws), "draws": draws}
                for n, draws in sorted(self.counts.items())
            },
        }


@dataclass(slots=True)
class PolicyPlan:
    policy: str
    devices: int | None  # the fewest that meet the target; None: more than max_devices
    points: dict[int, dict] = field(default_factory=dict)  # every simulated count's summary
    sweep_from: int = 1  # the count its sweep began at: every count below fails without a run
    # counts above the answer that had to pass too: the plan's ``confirm``, or 0 for a baseline that
    # may keep its assignment for fewer devices on more (Policy.keeps_fewer_devices)
    confirmed: int = 0
    # the knobs of the policy's own variant that gave the answer (Policy.plan_variants), and every
    # variant tried with its answer when there were several
    variant: dict = field(default_factory=dict)
    variants: list[tuple[dict, int | None]] = field(default_factory=list)
    confidence: Confidence | None = None  # the chosen policy's, with ``plan(confidence=...)``

    @property
    def answer(self) -> dict | None:
        return None if self.devices is None else self.points[self.devices]

    @property
    def skipped(self) -> list[int]:
        """The counts between the sweep's start and the answer that the search stepped over
        (``fewest_passing``'s ``sweep``): not simulated, so not known to fail."""
        if self.devices is None:
            return []
        return [n for n in range(self.sweep_from, self.devices) if n not in self.points]

    @property
    def headline(self) -> int | None:
        """The count to deploy: the confident one where it was asked for, else the answer."""
        return self.devices if self.confidence is None else self.confidence.devices


@dataclass(slots=True)
class Plan:
    hardware: HardwareProfile
    target: float
    metric: str
    bound: DeviceBound
    policies: dict[str, PolicyPlan]
    max_devices: int
    num_requests: int
    span_s: float
    price_per_device_hour: float | None = None
    # per policy, the knobs its runs were provisioned with from the traffic (Policy.provisioned_knobs):
    # the written deployment carries them
    provisioned: Mapping[str, dict] = field(default_factory=dict)

    def monthly_cost(self, devices: int | None) -> float | None:
        if devices is None or self.price_per_device_hour is None:
            return None
        return devices * self.price_per_device_hour * HOURS_PER_MONTH

    def saving(self, policy: str, against: str) -> int | None:
        """Devices ``policy`` saves against ``against`` (None when either has no answer)."""
        a, b = self.policies.get(policy), self.policies.get(against)
        if a is None or b is None or a.devices is None or b.devices is None:
            return None
        return b.devices - a.devices

    def as_dict(self) -> dict:
        out: dict = {
            "simulated": True,
            "hardware": self.hardware.name,
            "hardware_synthetic": self.hardware.synthetic,
            "target": self.target,
            "metric": self.metric,
            "num_requests": self.num_requests,
            "span_s": self.span_s,
            "max_devices": self.max_devices,
            "lower_bound": self.bound.as_dict(),
            "price_per_device_hour": self.price_per_device_hour,
            "policies": {},
        }
        for name, p in self.policies.items():
            out["policies"][name] = {
                "devices": p.devices,
                "ratio_to_bound": self.bound.ratio(p.devices),
                "monthly_cost": self.monthly_cost(p.devices),
                "saves_against": {
                    other: self.saving(name, other)
                    for other in ("dedicated", "static-partition")
                    if other != name
                },
                "sweep_from": p.sweep_from,
                "skipped": p.skipped,
                "confirmed": p.confirmed,
                "variant": p.variant,
                "variants": [{"knobs": v, "devices": n} for v, n in p.variants],
                "points": {str(n): pt for n, pt in sorted(p.points.items())},
                "confidence": None if p.confidence is None else p.confidence.as_dict(),
            }
        return out


def exclusive_floor(models: Sequence[ServedModel], workload: Workload, budget: int) -> int:
    """The fewest devices at which a policy whose served models hold devices of their own
    (``Policy.exclusive_devices``: dedicated) can meet a target that allows ``budget`` misses.

    On ``n`` devices such a policy serves a set of models whose tp sizes sum to at most ``n``
    for the whole run (the simulator has no keep-alive evictions), and every request of the
    other models is refused: a miss under either metric. The requests ``n`` devices can serve
    are at most the fractional knapsack's (models by requests per device, the last one split),
    so a count whose remaining requests exceed ``budget`` fails for certain, whichever models the
    policy picks. Sound for any traffic; it skips only counts a run would fail."""
    judged = workload.judged()  # batch requests miss nothing (sim/metrics.py)
    per_model = np.bincount(workload.model_index[judged], minlength=len(workload.models))
    requests = {name: int(k) for name, k in zip(workload.models, per_model, strict=True)}
    items = sorted(
        ((requests.get(m.name, 0), m.tp_size) for m in models), key=lambda it: it[0] / it[1], reverse=True
    )
    total = int(judged.sum())
    for n in range(1, sum(tp for _, tp in items) + 1):
        room, served = n, 0.0
        for k, tp in items:
            if room <= 0:
                break
            served += k * min(tp, room) / tp
            room -= tp
        if total - served <= budget + 1e-6:  # may pass: the bound cannot rule it out
            return n
    return max(1, sum(tp for _, tp in items))


@dataclass(slots=True, frozen=True)
class _Job:
    """One simulation of the search (picklable: it runs in a worker process)."""

    models: tuple[ServedModel, ...]
    workload: Workload
    slos: Mapping[str, ModelSLO]
    config: SimConfig


@dataclass(slots=True, frozen=True)
class _Screen:
    """A count's busy-window screen (picklable): fails when the window's misses pass ``budget``."""

    job: _Job
    window: BusyWindow
    budget: int
    metric: str


def _runnable(job: _Job) -> tuple[list[ServedModel], Workload]:
    """The models that fit the cluster and the workload of their requests: a TP model wider than
    the cluster cannot run, and its requests miss."""
    models = [m for m in job.models if m.tp_size <= job.config.num_devices]
    workload = job.workload
    if len(models) < len(job.models):
        workload = workload.restrict([m.name for m in models])
    return models, workload


def _screen(screen: _Screen) -> dict:
    """Simulate the warm-up and the busy window at the job's count and count the window's misses.

    Sound up to the warm-up: every request of the window is a request of the whole traffic, so the
    full run misses at least the window's misses (as the full run would have served them) plus
    whatever the rest adds; more than ``budget`` of them alone fail the count. The approximation is
    the state the window starts in: the warm-up's, not the whole traffic's up to it."""
    start = time.monotonic()
    job, w = screen.job, screen.window
    models, served = _runnable(job)
    names = {m.name for m in models}
    runnable = np.array([m in names for m in job.workload.models])[job.workload.model_index]
    # the span's indices among the requests simulated; the window's requests that cannot be miss
    first, warmup, end = (int(runnable[:i].sum()) for i in (w.first, w.warmup, w.end))
    judged = job.workload.judged()  # the requests attainment counts (batch ones do not)
    lost = int((judged[w.first : w.end] & ~runnable[w.first : w.end]).sum())
    misses, stopped, seen = lost, False, lost
    if lost <= screen.budget:
        cfg = dataclasses.replace(job.config, span=(warmup, end), count_from=first)
        if screen.metric == "ttft":  # a TTFT outcome is known once the longest TTFT SLO has passed
            longest = max((job.slos[m.name].ttft_s for m in models), default=0.0)
            cfg = dataclasses.replace(
                cfg, stop_after_ttft_misses=screen.budget - lost, drain_s=longest + 2 * cfg.tick_s
            )
        res = simulate(models, served, job.slos, cfg)
        # unarrived ones (a run stopped early): "at least"
        counted = res.requests[first - warmup :]
        ttft, tpot = attainment(counted)
        met = ttft if screen.metric == "ttft" else tpot
        units = judged_units(counted)  # a group of inputs once
        misses += units - round(met * units)
        stopped = bool(res.labels.get("stopped_early"))
        seen += units
    wl = job.workload
    out = {
        "num_devices": job.config.num_devices,
        "screened_out": misses > screen.budget,
        "screen": {
            **w.as_dict(wl), "misses": misses, "misses_at_least": stopped, "budget": screen.budget,
            "wall_s": time.monotonic() - start,
        },
        "ttft_attainment": None,
        "tpot_attainment": None,
        "num_requests": int(judged.sum()),
    }  # fmt: skip
    if out["screened_out"]:  # failed on the window's requests alone
        out["stopped"] = _stopped("screen", screen.metric, seen, out["num_requests"], misses)
        out[METRICS[screen.metric]] = out["stopped"]["attainment_seen"]
    out["wall_s"] = out["screen"]["wall_s"]
    return out


def _stopped(how: str, metric: str, seen: int, total: int, misses: int, at_s: float | None = None) -> dict:
    """What a point not run to the end reports: how far it got (``requests_seen`` of
    ``requests``; ``at_s``: the simulated second it stopped at), its attainment over the requests
    it saw, and the most the whole traffic could attain with the misses it already had. Such a
    point fails: it stopped because its misses passed the target's budget."""
    return {
        "how": how,  # "screen": its busy window alone; "misses": its full run, cut short
        "metric": metric,
        "requests_seen": seen,
        "requests": total,
        "at_s": at_s,
        "misses": misses,
        "attainment_seen": (seen - misses) / seen if seen else 0.0,
        "attainment_at_most": (total - misses) / total if total else 0.0,
    }


def _budget(target: float, requests: int) -> int:
    """The misses ``target`` attainment allows over ``requests`` requests."""
    return math.floor((1 - target) * requests + 1e-9)


def passed(point: dict, metric: str, target: float) -> bool:
    """Whether a plan point meets ``target``: run to the end and its attainment there at least the
    target (a stopped point fails, whatever it had attained when it stopped)."""
    return "stopped" not in point and point[METRICS[metric]] >= target


def _run(job: _Job, per_request: bool = False) -> dict:
    start = time.monotonic()
    cfg = job.config
    models, workload = _runnable(job)
    res = simulate(models, workload, job.slos, cfg)
    # counts of the requests attainment judges (sim/metrics.py: batch ones are not)
    judged, runnable = job.workload.judged(), workload.judged()
    if cfg.span is None and cfg.count_from:
        # the first requests are a warm-up (simulate_point's): served, left out of what is reported
        if len(workload) != len(job.workload):
            raise SimConfigError("a warm-up in front of the traffic needs every model runnable")
        kept = res.requests[cfg.count_from :]
        first = kept[0].arrival if kept else math.inf  # and the activations decided before the replay
        acts = {m: [a for a in v if a[0] >= first] for m, v in res.activation_s.items()}
        res = dataclasses.replace(res, requests=kept, activation_s=acts)
        judged = runnable = np.concatenate([np.zeros(cfg.count_from, bool), judged[cfg.count_from :]])
    out = res.summary()
    out["per_model"] = res.per_model()
    if per_request:  # in arrival order, from the first reported request's arrival
        t0 = res.requests[0].arrival if res.requests else 0.0
        out["requests"] = [
            {"model": r.model, "arrival_s": r.arrival - t0, "ttft_s": r.ttft, "cold": r.cold}
            for r in res.requests
        ]
    total = int(judged.sum())
    lost = total - int(runnable.sum())
    arrived = out["num_judged"]  # all of the workload's, or those before a stop
    seen = total
    if res.labels.get("stopped_early"):
        # the requests (of every model) up to the last one that arrived; the rest were never seen
        last = float(workload.timestamps[out["num_requests"] - 1]) if out["num_requests"] else -math.inf
        seen = int(judged[: int(np.searchsorted(job.workload.timestamps, last, side="right"))].sum())
    if lost or seen < total:
        # unserved models' requests miss; a run stopped early reports over the requests it saw
        met_ttft = out["ttft_attainment"] * arrived
        met_tpot = out["tpot_attainment"] * arrived
        out.update(ttft_attainment=met_ttft / seen, tpot_attainment=met_tpot / seen, num_requests=total)
    if seen < total:  # only TTFT misses stop a run (SimConfig.stop_after_ttft_misses)
        met = out["ttft_attainment"] * seen
        out["stopped"] = _stopped("misses", "ttft", seen, total, seen - round(met), res.end_time)
    out["num_devices"] = cfg.num_devices
    out["wall_s"] = time.monotonic() - start
    return out


def plan(
    deployment: SimDeployment,
    workload: Workload,
    *,
    hardware: str,
    target: float = 0.99,
    metric: str = "ttft",
    policies: Sequence[str] = POLICIES,
    max_devices: int | None = None,
    confirm: int = 2,
    price_per_device_hour: float | None = None,
    span_s: float | None = None,
    jobs: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_point: Callable[[str, int, dict], None] | None = None,
    screen: bool = False,
    screen_window_s: float = SCREEN_WINDOW_S,
    screen_warmup_s: float = SCREEN_WARMUP_S,
    config: SimConfig | None = None,
    memory_window_s: float = 10.0,
    compute_window_s: float = 60.0,
    confidence: float | None = None,
    seeds: int = 10,
    chosen: str | None = None,
    expected_rates: Mapping[str, float] | None = None,
    sweep_counts: int | None = SWEEP_COUNTS,
) -> Plan:
    """The fewest devices per policy for ``deployment`` serving ``workload`` on ``hardware``;
    ``screen``: simulate each count on the busiest window first (the module's docstring).
    ``confidence``: also the fewest count at which ``chosen`` (default: the first policy) passes on
    that fraction of ``seeds`` other draws of the traffic (the module's docstring, "How sure").

    ``config``: the simulation settings every point starts from (tick, compute sharing, engine, cost
    model), its knobs given to every policy, as ``prism sim`` sets them; by default the deployment's
    engine, and its knobs to its own policy only. ``memory_window_s`` and ``compute_window_s``: the
    lower bound's windows (sim/bound.py).

    ``expected_rates``: each model's expected rate in the deployment written for ``chosen``
    (``with_expected_rates``), which its runs simulate; the other policies run the deployment as
    given, the practice they stand for.

    ``progress(1)`` once per simulation; ``on_point(label, count, point)`` as each count's point
    comes back (``label``: the policy, with the knobs of its variant, or ``"<policy> draw <seed>"``
    for a draw of ``confidence``), from the searches' threads, so a long plan can be followed and
    what it has found kept if it is stopped.

    ``sweep_counts``: the counts each search asks one by one from its floor before it steps
    (``fewest_passing``; None: every count, so that every count below an answer is known to
    fail)."""
    if not 0 < target <= 1:
        raise SimConfigError(f"the target must be in (0, 1], got {target}")
    if metric not in METRICS:
        raise SimConfigError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if len(workload) == 0:
        raise SimConfigError("the traffic has no request")
    if confidence is not None and not 0 < confidence <= 1:
        raise SimConfigError(f"the confidence must be in (0, 1], got {confidence}")
    if seeds < 1:
        raise SimConfigError(f"seeds must be >= 1, got {seeds}")
    chosen = chosen if chosen is not None else (policies[0] if policies else None)
    if confidence is not None and policies and chosen not in policies:
        raise SimConfigError(f"the policy to be sure of, {chosen!r}, is not among those planned")
    from prism_serve.control.policies import POLICIES as REGISTERED

    if unknown := [p for p in policies if p not in REGISTERED]:
        raise SimConfigError(
            f"unknown policy {', '.join(unknown)}; choose from {', '.join(sorted(REGISTERED))}"
        )
    hw = get_hardware(hardware)
    names = {m.name for m in deployment.models}
    if missing := [m for m in workload.models if m not in names]:
        raise SimConfigError(f"the traffic names models the deployment lacks: {', '.join(missing[:5])}")
    if config is None:
        base = deployment.sim_config(1, hardware)
    else:
        base = dataclasses.replace(config, num_devices=1, hardware=hardware)
    if base.step_scale != 1.0:
        hw = hw.slowed(base.step_scale)
    bound = lower_bound(
        deployment.models, workload, hw, COST_MODELS[base.cost_model](hw),
        max_num_seqs=base.engine.max_num_seqs, slos=deployment.slos,
        memory_window_s=memory_window_s, compute_window_s=compute_window_s,
        prefix_block_size=base.engine.block_size if base.engine.prefix_caching else None,
    )  # fmt: skip
    widest = max(m.tp_size for m in deployment.models)
    low = max(bound.compute_devices, bound.tp_devices, widest, 1)
    # dedicated devices for every model, twice over, always suffice for a policy that can use them
    high = max_devices or max(low, 2 * sum(m.tp_size for m in deployment.models))
    budget = _budget(target, int(workload.judged().sum()))
    models = tuple(deployment.models)
    told = models
    if expected_rates:
        told = tuple(
            dataclasses.replace(m, expected_rate=expected_rates[m.name]) if m.name in expected_rates else m
            for m in models
        )

    def models_of(policy: str) -> tuple[ServedModel, ...]:
        return told if policy == chosen else models

    workers = max(1, min(jobs or os.cpu_count() or 1, 8))
    window = busy_window(workload, screen_window_s, screen_warmup_s) if screen else None
    if window is not None and 2 * (window.end - window.warmup) > len(workload):
        window = None  # the screen would cost about as much as the run
    out = {
        policy: PolicyPlan(
            policy, None, sweep_from=max(low, exclusive_floor(models, workload, budget))
            if REGISTERED[policy].exclusive_devices else low,
        )
        for policy in policies
    }  # fmt: skip
    # past its sweep a search asks as many counts at once as it has workers to itself: counts near an
    # answer cost nearly a full run each, and the other searches fill the pool until they finish
    searching, counted = [len(out)], threading.Lock()

    def stride() -> int:
        return max(1, workers // max(1, searching[0]))

    def search_then_leave(pp: PolicyPlan) -> None:
        try:
            search(pp)
        finally:
            with counted:
                searching[0] -= 1

    with ProcessPoolExecutor(workers) if workers > 1 else _InProcess() as pool:

        def search(pp: PolicyPlan) -> None:
            given = base.knobs if config is not None or pp.policy == deployment.policy else ()
            set_by_user = {k for k, _ in given}
            # the policy's own ways of placing that an operator would try (a baseline's packings);
            # one the user's knobs fix is not tried
            variants = [v for v in REGISTERED[pp.policy].plan_variants() if not set_by_user & set(v)] or [{}]
            tried = []
            for variant in variants:
                trial = PolicyPlan(pp.policy, None, sweep_from=pp.sweep_from, variant=dict(variant))
                sweep(trial, given + tuple(sorted(variant.items())))
                tried.append(trial)
            at = min(range(len(tried)), key=lambda i: (tried[i].devices is None, tried[i].devices or 0))
            best = tried[at]  # the first of a tie
            pp.devices, pp.points, pp.confirmed, pp.variant = (
                best.devices,
                best.points,
                best.confirmed,
                best.variant,
            )
            if len(tried) > 1:
                pp.variants = [(t.variant, t.devices) for t in tried]
            if confidence is not None and pp.policy == chosen and pp.devices is not None:
                pp.confidence = sure(pp, given + tuple(sorted(variants[at].items())))

        def sure(pp: PolicyPlan, knobs: tuple) -> Confidence:
            """The fewest count from ``pp``'s answer up that passes on enough draws of the traffic."""
            assert confidence is not None and pp.devices is not None
            need = math.ceil(confidence * seeds - 1e-9)
            measured = hw.errors_for(m.spec.name for m in models)  # on this deployment's shapes
            out = Confidence(confidence, seeds, need, len(measured))
            searched = dataclasses.replace(base, policy=pp.policy, knobs=knobs)

            def draw_job(n: int, drawn: Workload, error: float) -> _Job:
                # a step the profile predicts ``error`` off runs 1 / (1 + error) times as long; the
                # draw's own budget of misses stops it early, as a count of the search
                budget = _budget(target, int(drawn.judged().sum()))
                cfg = dataclasses.replace(
                    searched,
                    num_devices=n,
                    step_scale=searched.step_scale / (1 + error),
                    stop_after_ttft_misses=budget if metric == "ttft" else None,
                )
                return _Job(models_of(pp.policy), drawn, deployment.slos, cfg)

            draws = []
            for seed in range(1, seeds + 1):
                drawn = resample(workload, seed)
                rng = np.random.default_rng((seed, 1))
                error = float(rng.choice(measured)) if measured else 0.0
                draws.append((seed, drawn, error))
            for n in range(pp.devices, high + 1):
                record = out.counts[n] = []
                ok = bad = 0
                for first in range(0, seeds, workers):
                    if ok >= need or bad > seeds - need:
                        break  # decided without the rest
                    chunk = draws[first : first + workers]
                    jobs = [draw_job(n, drawn, error) for _, drawn, error in chunk if len(drawn)]
                    points = iter(pool.map(_run, jobs))
                    for seed, drawn, error in chunk:
                        # a draw with no request (a log of a few) misses nothing
                        point = next(points) if len(drawn) else {METRICS[metric]: 1.0}
                        good = passed(point, metric, target)
                        ok, bad = ok + good, bad + (not good)
                        record.append({
                            "seed": seed, "requests": len(drawn), "step_error": error, "passed": good,
                            "attainment": point[METRICS[metric]], "stopped": "stopped" in point,
                        })  # fmt: skip
                        if progress is not None:
                            progress(1)
                        if on_point is not None:
                            on_point(f"{pp.policy} draw {seed}", n, point)
                if ok >= need:
                    out.devices = n
                    break
            return out

        def sweep(pp: PolicyPlan, knobs: tuple) -> None:
            searched = dataclasses.replace(
                base,
                policy=pp.policy,
                knobs=knobs,
                stop_after_ttft_misses=budget if metric == "ttft" else None,
            )

            def job(n: int) -> _Job:
                cfg = dataclasses.replace(searched, num_devices=n)
                return _Job(models_of(pp.policy), workload, deployment.slos, cfg)

            label = " ".join([pp.policy, *(f"{k}={v}" for k, v in sorted(pp.variant.items()))])

            def decided(n: int) -> None:
                if progress is not None:
                    progress(1)
                if on_point is not None:
                    on_point(label, n, pp.points[n])

            def passes(counts: Sequence[int]) -> dict[int, bool]:
                for n, point in zip(counts, pool.map(_run, [job(n) for n in counts]), strict=True):
                    if n in pp.points:  # its screen, passed
                        point.update(screened_out=False, screen=pp.points[n]["screen"])
                        point["wall_s"] += pp.points[n]["wall_s"]
                    pp.points[n] = point
                    decided(n)
                return {n: passed(pp.points[n], metric, target) for n in counts}

            def screened(counts: Sequence[int]) -> dict[int, bool]:
                batch = [_Screen(job(n), window, budget, metric) for n in counts]
                for n, point in zip(counts, pool.map(_screen, batch), strict=True):
                    pp.points[n] = point
                    decided(n)
                return {n: not pp.points[n]["screened_out"] for n in counts}

            # a baseline that may leave spare devices idle passes wherever a count below passed
            pp.confirmed = 0 if REGISTERED[pp.policy].keeps_fewer_devices else confirm
            pp.devices = fewest_passing(
                passes, pp.sweep_from, high, pp.confirmed, width=workers,
                screen=screened if window is not None else None, sweep=sweep_counts, stride=stride,
            )  # fmt: skip

        # every policy's search at once: each waits for its own points, the pool keeps the cores busy
        with ThreadPoolExecutor(len(out) if workers > 1 else 1) as searches:
            list(searches.map(search_then_leave, out.values()))
    rates, longest = workload.mean_rates(), workload.longest_requests()
    return Plan(
        hw, target, metric, bound, out, high, len(workload),
        span_s if span_s is not None else float(workload.timestamps[-1]), price_per_device_hour,
        {p: {**REGISTERED[p].provisioned_knobs(rates, longest), **out[p].variant} for p in policies},
    )  # fmt: skip


def simulate_point(
    deployment: SimDeployment,
    workload: Workload,
    *,
    hardware: str,
    policy: str,
    devices: int,
    warmup: int = 0,
    per_request: bool = False,
) -> dict:
    """One point of a plan run to its end (the search stops a point once it has missed more than the
    target allows; this never does): ``policy`` on ``devices`` devices of ``hardware``, what
    ``PolicyPlan.points`` holds for a count. ``warmup``: the workload's first requests are served
    and left out of the result (a live run's warm-up requests before its replay). ``per_request``:
    the result's ``requests`` lists each request's model, arrival, TTFT (None: no first token) and
    whether its model was cold, in arrival order."""
    config = dataclasses.replace(deployment.sim_config(devices, hardware, policy), count_from=warmup)
    return _run(_Job(tuple(deployment.models), workload, deployment.slos, config), per_request)


class _InProcess:
    """A pool of no processes (one core, or jobs=1): the same interface, run here."""

    def __enter__(self) -> _InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @staticmethod
    def map(fn, items):
        return [fn(x) for x in items]


def with_expected_rates(config: DeploymentConfig, workload: Workload) -> tuple[DeploymentConfig, int]:
    """``config`` with each served model's ``expected_rate`` set to its mean rate in ``workload``
    (requests/s over its span) where the config leaves it unset; and how many were set."""
    rates = workload.mean_rates()
    models, count = [], 0
    for m in config.models:
        if m.expected_rate is None and m.base is None and m.name in rates:
            m = m.model_copy(update={"expected_rate": round(rates[m.name], 6)})
            count += 1
        models.append(m)
    return config.model_copy(update={"models": models}), count


def deployment_yaml(
    config: DeploymentConfig,
    hw: HardwareProfile,
    devices: int,
    policy: str,
    provisioned: Mapping | None = None,
) -> dict:
    """``config`` as a prism.yaml with ``devices`` devices of ``hw`` and ``policy``: what
    ``prism serve --config`` reads (a GPU profile gives cuda:0..N-1, each with the memory models may
    use; a CPU profile, fitted for devices of one core, cpu:0..N-1 on cores 0..N-1), with the knobs
    the plan provisioned ``policy`` with where the config leaves them unset."""
    data = config.model_dump(mode="json", exclude_defaults=True)
    memory = int(hw.capacity_bytes)
    if hw.overlap:  # a GPU profile
        data["devices"] = [{"name": f"cuda:{i}", "memory": memory} for i in range(devices)]
    else:
        data["devices"] = [{"name": f"cpu:{i}", "memory": memory, "cores": str(i)} for i in range(devices)]
    data.setdefault("policy", {})["name"] = policy
    if policy != config.policy.name:
        data["policy"].pop("knobs", None)
    for key, value in (provisioned or {}).items():
        data["policy"].setdefault("knobs", {}).setdefault(key, _plain(value))
    return data


def _plain(value):
    """Tuples as lists, for YAML."""
    return [_plain(v) for v in value] if isinstance(value, tuple | list) else value
