"""``prism plan``: the fewest devices that serve a deployment's models and traffic within their SLOs,
per policy, with what that costs and what prism saves. Simulated (sim/): the hardware profile is a
cost model, not a measurement of the user's devices.

The search, per policy, over the device count ``n`` (every point one full simulation of the
traffic at ``n`` devices, ``SimConfig.num_devices``):

1. the lower bound any policy needs (sim/bound.py) first. Its memory count is a guess, not a
   floor: it assumes every model with a request in a 10 s window is resident at once, and a policy
   that swaps models in tens of milliseconds (CPU devices, small models) meets SLOs below it. So
   if the bound passes, the counts below it are tried downward to the first failure, down to the
   hard floor (the compute and tensor-parallel counts); if it fails, doubling steps go up from it
   to the first count that meets the target;
2. a sweep of every count between the last failure and it, upward: attainment need not be
   monotone in the device count (a placement that fits at ``n`` may not at ``n + 1``), so the first
   that passes is the candidate;
3. the ``confirm`` counts above the candidate must pass too; where one fails, the search goes on
   above it.

A point that has already missed more requests than the target allows stops early (its attainment is
known to be short, and a count far below the answer costs little). The policies are searched at
once, their points sharing a pool of worker processes, one per core.

The answer's deployment is written as a prism.yaml: the user's config with the devices found and the
policy, which ``prism serve --config`` reads.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field

from prism_serve.config import DeploymentConfig
from prism_serve.sim.bound import DeviceBound, lower_bound
from prism_serve.sim.config import ModelSLO, SimConfig
from prism_serve.sim.cost import COST_MODELS
from prism_serve.sim.deployment import SimDeployment
from prism_serve.sim.errors import SimConfigError
from prism_serve.sim.hardware import HardwareProfile, get_hardware
from prism_serve.sim.models import ServedModel
from prism_serve.sim.simulator import simulate
from prism_serve.workload.format import Workload

__all__ = ["HOURS_PER_MONTH", "POLICIES", "Plan", "PolicyPlan", "fewest_passing", "plan", "simulate_point"]

POLICIES = ("prism", "static-partition", "dedicated", "muxserve")
HOURS_PER_MONTH = 730.0
METRICS = {"ttft": "ttft_attainment", "tpot": "tpot_attainment"}


def fewest_passing(
    passes: Callable[[Sequence[int]], Mapping[int, bool]],
    low: int,
    high: int,
    confirm: int = 2,
    width: int = 1,
    start: int | None = None,
) -> int | None:
    """The fewest count in ``low..high`` that passes and whose next ``confirm`` counts (up to
    ``high``) pass too; None when there is none. ``passes`` evaluates a batch of counts (in
    parallel, if it can: ``width`` at a time) and is asked each count at most once.

    ``start``: a first guess (the lower bound's estimate). If it passes, counts below it are tried
    downward, ``width`` at a time, to the first failure; the lowest count of the passing run above
    it is the answer (with its ``confirm`` counts). If it fails, the search goes on above it.

    Doubling steps find a passing count; then every count between the last failure and it is
    swept upward, because attainment need not be monotone in the device count (and a failing
    count costs little: its simulation stops early); the first that passes is the answer if the
    ``confirm`` counts above it pass too, else the search goes on above the one that failed."""
    known: dict[int, bool] = {}

    def ask(counts: Iterable[int]) -> None:
        todo = sorted({n for n in counts if n not in known and low <= n <= high})
        if todo:
            known.update(passes(todo))

    def failed_above(answer: int) -> int | None:
        """The highest of the ``confirm`` counts above ``answer`` that fails, if one does."""
        above = range(answer + 1, min(high, answer + confirm) + 1)
        ask(above)
        return max((k for k in above if not known[k]), default=None)

    floor = low - 1  # every answer is above this (a failure found above an earlier answer)
    if start is not None and low <= start <= high:
        ask([start])
        floor = start
        if known[start]:
            m = start  # the lowest of the passing run that reaches down from start
            while m > low:
                ask(range(max(low, m - max(1, width)), m))
                while m > low and known.get(m - 1):
                    m -= 1
                if m > low and (m - 1) in known:
                    break  # m - 1 failed
            failed = failed_above(m)
            if failed is None:
                return m
            floor = failed
    while floor < high:
        n, step, fail = floor + 1, 1, floor
        while True:  # doubling steps up to a pass
            ask([n])
            if known[n]:
                break
            fail = n
            if n >= high:
                return None
            n, step = min(high, n + step), step * 2
        answer = n
        m = fail + 1
        while m < n:  # the sweep up from the last failure, ``width`` counts at a time
            batch = range(m, min(n, m + max(1, width)))
            ask(batch)
            passing = [k for k in batch if known[k]]
            if passing:
                answer = passing[0]
                break
            m += max(1, width)
        failed = failed_above(answer)
        if failed is None:
            return answer
        floor = failed
    return None


@dataclass(slots=True)
class PolicyPlan:
    policy: str
    devices: int | None  # the fewest that meet the target; None: more than max_devices
    points: dict[int, dict] = field(default_factory=dict)  # every simulated count's summary

    @property
    def answer(self) -> dict | None:
        return None if self.devices is None else self.points[self.devices]


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
                "points": {str(n): pt for n, pt in sorted(p.points.items())},
            }
        return out


@dataclass(slots=True, frozen=True)
class _Job:
    """One simulation of the search (picklable: it runs in a worker process)."""

    models: tuple[ServedModel, ...]
    workload: Workload
    slos: Mapping[str, ModelSLO]
    config: SimConfig


def _run(job: _Job) -> dict:
    start = time.monotonic()
    cfg = job.config
    models = [m for m in job.models if m.tp_size <= cfg.num_devices]
    workload = job.workload
    if len(models) < len(job.models):  # a TP model wider than the cluster cannot run: its requests miss
        workload = workload.restrict([m.name for m in models])
    res = simulate(models, workload, job.slos, cfg)
    out = res.summary()
    out["per_model"] = res.per_model()
    total = len(job.workload)
    lost = total - len(workload)
    if lost or res.labels.get("stopped_early"):
        # unserved models' requests miss; a run stopped early missed more than the target allows,
        # and what it did not reach counts as missed (its attainment is at most this)
        met_ttft = out["ttft_attainment"] * out["num_requests"]
        met_tpot = out["tpot_attainment"] * out["num_requests"]
        out.update(ttft_attainment=met_ttft / total, tpot_attainment=met_tpot / total, num_requests=total)
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
) -> Plan:
    """The fewest devices per policy for ``deployment`` serving ``workload`` on ``hardware``."""
    if not 0 < target <= 1:
        raise SimConfigError(f"the target must be in (0, 1], got {target}")
    if metric not in METRICS:
        raise SimConfigError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if len(workload) == 0:
        raise SimConfigError("the traffic has no request")
    from prism_serve.control.policies import POLICIES as REGISTERED

    if unknown := [p for p in policies if p not in REGISTERED]:
        raise SimConfigError(
            f"unknown policy {', '.join(unknown)}; choose from {', '.join(sorted(REGISTERED))}"
        )
    hw = get_hardware(hardware)
    names = {m.name for m in deployment.models}
    if missing := [m for m in workload.models if m not in names]:
        raise SimConfigError(f"the traffic names models the deployment lacks: {', '.join(missing[:5])}")
    base = SimConfig(num_devices=1, hardware=hardware, engine=deployment.engine, knobs=deployment.knobs)
    bound = lower_bound(
        deployment.models, workload, hw, COST_MODELS[base.cost_model](hw),
        max_num_seqs=deployment.engine.max_num_seqs, slos=deployment.slos,
    )  # fmt: skip
    widest = max(m.tp_size for m in deployment.models)
    low = max(bound.compute_devices, bound.tp_devices, widest, 1)
    guess = max(low, bound.devices)  # the first count tried: the bound with its memory count
    # dedicated devices for every model, twice over, always suffice for a policy that can use them
    high = max_devices or max(low, 2 * sum(m.tp_size for m in deployment.models))
    budget = math.floor((1 - target) * len(workload) + 1e-9)
    models = tuple(deployment.models)
    workers = max(1, min(jobs or os.cpu_count() or 1, 8))
    out = {policy: PolicyPlan(policy, None) for policy in policies}
    with ProcessPoolExecutor(workers) if workers > 1 else _InProcess() as pool:

        def search(pp: PolicyPlan) -> None:
            config = dataclasses.replace(
                base,
                policy=pp.policy,
                knobs=deployment.knobs if pp.policy == deployment.policy else (),
                stop_after_ttft_misses=budget if metric == "ttft" else None,
            )

            def passes(counts: Sequence[int]) -> dict[int, bool]:
                batch = [
                    _Job(models, workload, deployment.slos, dataclasses.replace(config, num_devices=n))
                    for n in counts
                ]
                for n, point in zip(counts, pool.map(_run, batch), strict=True):
                    pp.points[n] = point
                    if progress is not None:
                        progress(1)
                return {n: pp.points[n][METRICS[metric]] >= target for n in counts}

            pp.devices = fewest_passing(passes, low, high, confirm, width=workers, start=guess)

        # every policy's search at once: each waits for its own points, the pool keeps the cores busy
        with ThreadPoolExecutor(len(out) if workers > 1 else 1) as searches:
            list(searches.map(search, out.values()))
    return Plan(
        hw, target, metric, bound, out, high, len(workload),
        span_s if span_s is not None else float(workload.timestamps[-1]), price_per_device_hour,
    )  # fmt: skip


def simulate_point(
    deployment: SimDeployment, workload: Workload, *, hardware: str, policy: str, devices: int
) -> dict:
    """One point of a plan run to its end (the search stops a point once it has missed more than the
    target allows; this never does): ``policy`` on ``devices`` devices of ``hardware``, what
    ``PolicyPlan.points`` holds for a count."""
    config = SimConfig(
        num_devices=devices, hardware=hardware, engine=deployment.engine, policy=policy,
        knobs=deployment.knobs if policy == deployment.policy else (),
    )  # fmt: skip
    return _run(_Job(tuple(deployment.models), workload, deployment.slos, config))


class _InProcess:
    """A pool of no processes (one core, or jobs=1): the same interface, run here."""

    def __enter__(self) -> _InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @staticmethod
    def map(fn, items):
        return [fn(x) for x in items]


def deployment_yaml(config: DeploymentConfig, hw: HardwareProfile, devices: int, policy: str) -> dict:
    """``config`` as a prism.yaml with ``devices`` devices of ``hw`` and ``policy``: what
    ``prism serve --config`` reads (a GPU profile gives cuda:0..N-1, each with the memory models may
    use; a CPU profile, fitted for devices of one core, cpu:0..N-1 on cores 0..N-1)."""
    data = config.model_dump(mode="json", exclude_defaults=True)
    memory = int(hw.capacity_bytes)
    if hw.overlap:  # a GPU profile
        data["devices"] = [{"name": f"cuda:{i}", "memory": memory} for i in range(devices)]
    else:
        data["devices"] = [{"name": f"cpu:{i}", "memory": memory, "cores": str(i)} for i in range(devices)]
    data.setdefault("policy", {})["name"] = policy
    if policy != config.policy.name:
        data["policy"].pop("knobs", None)
    return data
