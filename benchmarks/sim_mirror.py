"""The simulated side of benchmarks/sim_vs_live.py (pure): a live deployment config mirrored in the
simulator (``sim_deployment``: the same devices, budgets, models, SLOs, policy and engine settings
on the ``cpu-smollm2`` profile), the live warm-up prepended to the workload, the simulated run, and
the per-model numbers both sides report. See sim_vs_live.py for how the mirror works."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:  # `common` when imported from a test
    sys.path.insert(0, str(BENCH_DIR))

from prism_serve.config import DeploymentConfig  # noqa: E402
from prism_serve.control.policies import POLICIES, knobs_for  # noqa: E402
from prism_serve.engine.config import DEFAULT_MODEL  # noqa: E402
from prism_serve.engine.models.config import PRESETS  # noqa: E402
from prism_serve.memory.vmm import DEFAULT_PAGE_SIZE  # noqa: E402
from prism_serve.runtime.build import device_specs  # noqa: E402
from prism_serve.sim.config import ModelSLO, SimConfig  # noqa: E402
from prism_serve.sim.deployment import sim_deployment as deployment_of  # noqa: E402
from prism_serve.sim.hardware import host_cpu_profile  # noqa: E402
from prism_serve.sim.models import ModelShape, ServedModel  # noqa: E402
from prism_serve.workload.format import Workload  # noqa: E402

HARDWARE = host_cpu_profile()
REAL_SOURCE = DEFAULT_MODEL  # the default model's real weights: the SmolLM2-135M shape
WARMUP_PROMPT = [1000, 1001, 1002]  # token ids of each warm-up request
WARMUP_OUTPUT = 2
LATENCIES = ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s")
ATTAINMENTS = ("ttft_attainment", "tpot_attainment", "slo_attainment")
COUNTS = ("activations", "evictions")
BUSY = "engine_busy_s"  # seconds the model's engine had a step in flight (live: /metrics step seconds)
SIM_COUNTERS = ("preemptions", "restarts", "migrations", "migrations_skipped", "num_rejected",
                "num_unfinished", "simulated_s")  # fmt: skip
PREFIX_RATES = ("prefix_hit_rate", "prefix_hit_rate_infinite")


# ---- the deployment in the simulator (pure) ------------------------------------------------------


class MirrorError(ValueError):
    """The config cannot be mirrored in the simulator (the message says why)."""


@dataclass(slots=True, frozen=True)
class SimDeployment:
    """What ``simulate`` needs to mirror a live config, plus the live device budgets."""

    models: list[ServedModel]
    slos: dict[str, ModelSLO]
    config: SimConfig
    budgets: tuple[int, ...]  # bytes, one per device, in the config's device order
    device_names: tuple[str, ...]  # the live names (the simulator's are gpu00, gpu01, ...)
    warnings: tuple[str, ...] = ()


def sim_deployment(
    cfg: DeploymentConfig,
    *,
    warmup_s: float = 0.0,
    compute_sharing: bool | None = None,
    step_scale: float = 1.0,
    profiles: str = "live",
    hardware: str = HARDWARE,
) -> SimDeployment:
    """The simulated deployment that mirrors ``cfg`` on the ``hardware`` profile (default
    ``cpu-smollm2``; a profile file that fit_cpu_profile.py --write fitted on this machine is better)
    (``compute_sharing``: None leaves the simulator's default; ``profiles``: SimConfig.profiles, by
    default what the live controller knows of each model's demand). The models, SLOs, engine knobs
    and policy are what ``prism plan`` reads of a config (sim/deployment.py); this adds the live
    devices and the checks a mirror of a live run needs."""
    warnings: list[str] = []
    devices = device_specs(cfg)
    for d in devices:
        if len(d.cores) != 1:
            warnings.append(
                f"{d.name} has {len(d.cores) or 'all'} cores; the {hardware} profile is fitted for one core "
                "with one torch thread"
            )
    dep = deployment_of(cfg, gpu=False)  # dtype auto: what the live server on this machine runs
    fitted = ModelShape("smollm2-135m", PRESETS["smollm2-135m"], 4)
    for m, entry in zip(dep.models, cfg.models, strict=True):
        shape = m.spec
        if (shape.num_params, shape.kv_bytes_per_token, shape.dtype_bytes) != (
            fitted.num_params, fitted.kv_bytes_per_token, 4,
        ):  # fmt: skip
            warnings.append(
                f"{m.name}: {shape.name} at {shape.dtype_bytes} bytes per weight is not what {hardware} is "
                "fitted for (SmolLM2-135M fp32); docs/results.md (The CPU profiles) gives its errors"
            )
        if entry.kv_limit is not None or entry.pinned or entry.keep_alive is not None:
            warnings.append(f"{m.name}: kv_limit, pinned and keep_alive are not simulated")
    for knob in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        values = {getattr(m.engine_config(), knob) for m in cfg.models}
        if len(values) != 1:
            raise MirrorError(f"models differ in {knob} ({sorted(values)}); the simulator has one value")
    # the live config's knobs exactly: what the simulator would provision from the traffic
    # (Policy.provisioned_knobs) is at the live default unless the config sets it
    defaults = knobs_for(dep.policy)()
    given = dict(dep.knobs)
    provisioned = POLICIES[dep.policy].provisioned_knobs({})
    knobs = dep.knobs + tuple((k, getattr(defaults, k)) for k in sorted(provisioned) if k not in given)
    config = SimConfig(
        num_devices=len(devices),
        hardware=hardware,
        policy=dep.policy,
        knobs=knobs,
        tick_s=cfg.policy.tick_interval_s,
        placement_coalesce_s=cfg.policy.placement_coalesce_s,
        page_size=DEFAULT_PAGE_SIZE,  # the live ledger's page
        warmup_s=warmup_s,  # rate_window_s: the control loop's default, as in the live controller
        step_scale=step_scale,
        profiles=profiles,
        engine=dep.engine,  # the live engine's knobs: the simulator reads the same
        kept_prefix_bytes=dep.kept_prefix_bytes,  # the live host budget for evicted models' prefixes
        **({} if compute_sharing is None else {"compute_sharing": compute_sharing}),
    )
    return SimDeployment(
        dep.models, dep.slos, config, tuple(d.memory_bytes for d in devices), tuple(d.name for d in devices),
        tuple(warnings),
    )  # fmt: skip


def with_warmup(workload: Workload, warmup: list[tuple[float, str]], replay_start: float) -> Workload:
    """``workload`` preceded by the warm-up requests: ``warmup`` is (send time, model) and
    ``replay_start`` the replay's start, both on one clock; the first warm-up request is at 0."""
    if not warmup:
        return workload
    t0 = warmup[0][0]
    times = [t for t, _ in warmup]
    if times[-1] > replay_start or any(b < a for a, b in itertools.pairwise(times)):
        raise MirrorError("warm-up requests must be in order and before the replay")
    names = list(workload.models)
    index = {m: i for i, m in enumerate(names)}
    for _, m in warmup:
        if m not in index:
            index[m] = len(names)
            names.append(m)
    k = len(warmup)
    hashes = None if workload.block_hashes is None else [()] * k + list(workload.block_hashes)
    return Workload(
        np.concatenate([[t - t0 for t, _ in warmup], workload.timestamps + (replay_start - t0)]),
        np.concatenate([[index[m] for _, m in warmup], workload.model_index]),
        np.concatenate([np.full(k, len(WARMUP_PROMPT)), workload.prompt_tokens]),
        np.concatenate([np.full(k, WARMUP_OUTPUT), workload.output_tokens]),
        names,
        hashes,  # the warm-up's prompts share nothing
        workload.block_tokens,
    )


# ---- numbers (pure) -----------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def sim_model_stats(requests, slos: dict[str, ModelSLO]) -> dict[str, dict]:
    """Per model (and "(all)"), the live report's numbers from simulated requests (SimRequest-like:
    model, arrival, first_token, finish, output_tokens). Percentiles over the requests that got a
    first token (TTFT) or finished with more than one output token (TPOT); attainment over all, as
    bench/report.py and sim/metrics.py count them."""
    by: dict[str, list] = {m: [] for m in slos}
    for r in requests:
        by.setdefault(r.model, []).append(r)
    out = {}
    for name, rs in [*sorted(by.items()), ("(all)", list(requests))]:
        ttfts = [r.first_token - r.arrival for r in rs if r.first_token is not None]
        tpots = [
            (r.finish - r.first_token) / (r.output_tokens - 1)
            for r in rs
            if r.finish is not None and r.first_token is not None and r.output_tokens > 1
        ]
        ttft_ok = tpot_ok = both = 0
        for r in rs:
            slo = slos[r.model]
            t = r.first_token is not None and r.first_token - r.arrival <= slo.ttft_s
            p = r.finish is not None and (
                r.output_tokens <= 1 or (r.finish - r.first_token) / (r.output_tokens - 1) <= slo.tpot_s
            )
            ttft_ok += t
            tpot_ok += p
            both += t and p
        n = len(rs)
        out[name] = {
            "requests": n,
            "failed": sum(1 for r in rs if r.finish is None),
            "ttft_p50_s": _pct(ttfts, 50),
            "ttft_p95_s": _pct(ttfts, 95),
            "tpot_p50_s": _pct(tpots, 50),
            "ttft_attainment": ttft_ok / n if n else 1.0,
            "tpot_attainment": tpot_ok / n if n else 1.0,
            "slo_attainment": both / n if n else 1.0,
        }
    return out


def offered_load(dep: SimDeployment, workload: Workload, span_s: float | None = None) -> dict[str, float]:
    """Per model, the cores its requests would keep busy if each ran alone (prefill, then one decode
    step per further token; the cost model's times): an upper bound on the work, since batching
    shares the weight pass. Above about 1 for the models of one device, it is saturated."""
    from prism_serve.sim.cost import COST_MODELS
    from prism_serve.sim.hardware import get_hardware

    cost = COST_MODELS[dep.config.cost_model](get_hardware(dep.config.hardware))
    spec = {m.name: m.spec for m in dep.models}
    span = span_s or max(workload.duration, 1e-9)
    out = dict.fromkeys(workload.models, 0.0)
    for r in workload.rows():
        t = cost.prefill_time(spec[r.model], 1, r.prompt_tokens)
        if r.output_tokens > 1:
            t += float(cost.decode_steps(spec[r.model], 1, 1, r.prompt_tokens, r.output_tokens - 1).sum())
        out[r.model] += t / span
    return out


def sim_variants() -> list[tuple[str, bool | None]]:
    """("sim", None): the simulator as it is; plus ("sim, no sharing", False) where SimConfig has
    ``compute_sharing`` (each engine steps as if alone on its device: the simulator before it)."""
    if "compute_sharing" in {f.name for f in dataclasses.fields(SimConfig)}:
        return [("sim", None), ("sim, no sharing", False)]
    return [("sim", None)]


# ---- the simulated run --------------------------------------------------------------------------


def run_sim(dep: SimDeployment, workload: Workload, num_warmup: int) -> dict:
    """Simulate ``workload`` (its first ``num_warmup`` requests are the warm-up) on ``dep``; per-model
    numbers over the other requests, activations/evictions from the first of them on."""
    from prism_serve.control import ModelState
    from prism_serve.sim.simulator import Simulator

    class MirrorSimulator(Simulator):
        """The simulator with the live budgets and per-model activation/eviction counts (the
        simulator's own counters are totals)."""

        def __init__(self, *args) -> None:
            super().__init__(*args)
            for dev, budget in zip(self.devices.values(), dep.budgets, strict=True):
                dev.capacity_bytes = budget
            self.counts: dict[str, Counter] = {m: Counter() for m in self.models}
            self.at_replay: dict[str, Counter] | None = None
            self.placement_at_replay: dict[str, list[str]] = {}
            self.live_name = dict(zip(self.devices, dep.device_names, strict=True))

        def placement(self) -> dict[str, list[str]]:
            """Live device name -> models placed there (activating ones included)."""
            out: dict[str, list[str]] = {}
            for name, m in self.models.items():
                if m.placement:
                    out.setdefault(self.live_name[m.placement[0]], []).append(name)
            return dict(sorted(out.items()))

        def on_arrival(self, i: int, now: float) -> None:
            if i == num_warmup:
                for name, m in self.models.items():
                    self.counts[name][BUSY] = m.step_seconds  # engine busy (wall) seconds so far
                self.at_replay = {m: Counter(c) for m, c in self.counts.items()}
                self.placement_at_replay = self.placement()
            super().on_arrival(i, now)

        def on_activation_done(self, model: str, version: int, now: float) -> None:
            m = self.models[model]
            if m.activation_version == version and m.state is ModelState.ACTIVATING:
                self.counts[model]["activations"] += 1
            super().on_activation_done(model, version, now)

        # the effect is ``evict`` since the simulator runs control.loop (``_evict`` before it)
        def evict(self, model: str, now: float):
            self._count_eviction(model)
            return super().evict(model, now)

        def _evict(self, model: str, now: float):
            self._count_eviction(model)
            return super()._evict(model, now)

        def _count_eviction(self, model: str) -> None:
            if self.models[model].state is not ModelState.EVICTED:
                self.counts[model]["evictions"] += 1

    start = time.perf_counter()
    sim = MirrorSimulator(dep.models, workload, dep.slos, dep.config)
    result = sim.run()
    wall = time.perf_counter() - start
    for name, m in sim.models.items():
        sim.counts[name][BUSY] = m.step_seconds
    replay = [r for r in result.requests if int(r.req_id) >= num_warmup]
    stats = sim_model_stats(replay, dep.slos)
    before = sim.at_replay or {m: Counter() for m in sim.counts}
    for name in dep.slos:
        for key in (*COUNTS, BUSY):
            stats[name][key] = sim.counts[name][key] - before[name][key]
            stats[name][f"warmup_{key}"] = before[name][key]
    for key in (*COUNTS, BUSY):
        stats["(all)"][key] = sum(stats[n][key] for n in dep.slos)
    summary = result.summary()
    return {
        "models": stats,
        # prefix hit rates where the workload had block hashes (the warm-up's few tokens included)
        "summary": {k: summary[k] for k in (*SIM_COUNTERS, *PREFIX_RATES) if k in summary},
        "placement_after_warmup": sim.placement_at_replay,
        "placement_at_end": sim.placement(),
        "wall_s": round(wall, 2),
        "simulated": True,
        "hardware": result.labels.get("hardware"),
    }


# ---- a rate sweep (benchmarks/live_eval.py --sim) -----------------------------------------------


def sweep_workload(
    workload: Workload, rates: list[float], duration_s: float, warmup: list[str], gap_s: float
) -> tuple[Workload, list[tuple[float, int, int]]]:
    """live_eval's sweep as one simulated workload: one warm-up request per model in ``warmup``
    (1 s apart, as the live warm-up sends them one after another), then for each rate scale ``r``
    the requests of the first ``duration_s * r`` seconds with their times divided by ``r``, each
    segment ``gap_s`` after the previous one's last second (live waits until the server is idle).
    Returns the workload and, per rate, (rate, index of its first request, number of requests)."""
    names = list(workload.models)
    for m in warmup:
        if m not in names:
            names.append(m)
    times, models, prompts, outputs = [], [], [], []
    for i, m in enumerate(warmup):
        times.append(float(i))
        models.append(names.index(m))
        prompts.append(len(WARMUP_PROMPT))
        outputs.append(WARMUP_OUTPUT)
    t = float(len(warmup)) + 5.0
    segments = []
    for r in rates:
        h = workload.head(duration_s * r)
        segments.append((r, len(times), len(h)))
        times.extend((t + h.timestamps / r).tolist())
        models.extend(h.model_index.tolist())
        prompts.extend(h.prompt_tokens.tolist())
        outputs.extend(h.output_tokens.tolist())
        t += duration_s + gap_s
    return Workload(np.array(times), np.array(models), np.array(prompts), np.array(outputs), names), segments


def run_sweep(
    dep: SimDeployment, workload: Workload, segments: list[tuple[float, int, int]]
) -> tuple[list[dict], dict]:
    """Simulate a ``sweep_workload`` on ``dep``: per segment, its rate scale and per-model numbers
    (``sim_model_stats``); and the run's summary counters (activations, evictions, ...)."""
    from prism_serve.sim.simulator import Simulator

    sim = Simulator(dep.models, workload, dep.slos, dep.config)
    for dev, budget in zip(sim.devices.values(), dep.budgets, strict=True):
        dev.capacity_bytes = budget  # the live budgets (the hardware profile's is a GPU's or a core's)
    result = sim.run()
    by_id = {int(r.req_id): r for r in result.requests}
    out = []
    for r, first, n in segments:
        stats = sim_model_stats([by_id[i] for i in range(first, first + n) if i in by_id], dep.slos)
        out.append({"rate_scale": r, "models": stats})
    summary = result.summary()
    return out, {k: summary[k] for k in ("activations", "replica_activations", "evictions", "migrations")}
