"""Simulator vs live, end to end: one workload on one deployment, run for real (``prism serve`` +
the ``prism bench`` replay) and in the simulator (``cpu-smollm2`` profile, the same devices, memory
budgets, models, SLOs, policy and engine settings); per model, side by side: TTFT p50 / p95, TPOT
p50, SLO attainment, activations and evictions, and the simulator's error against the live run.

    python benchmarks/sim_vs_live.py --preset heavy-prism --out results/sim-vs-live/heavy-prism
    python benchmarks/sim_vs_live.py --config deploy.yaml --workload w.jsonl --out results/x [--repeat 3]
    python benchmarks/sim_vs_live.py --preset light-prism --duration 30 --out /tmp/smoke   # a smoke run
    python benchmarks/sim_vs_live.py --preset heavy-prism --reuse-live results/x/result.json --out results/y
        # simulate again (e.g. after a simulator change) against the live runs recorded earlier

Presets (``--preset``) build the deployment and the workload themselves (Azure 2023 conversation
arrivals and lengths from the real traces, ``prism workload``'s builder, seeded) and write both to
``--out`` (deployment.yaml, workload.jsonl), so ``--config`` / ``--workload`` replay the same run.
Every preset: 2 CPU devices of one core each ("cpu:0" on the first core of this process's affinity,
"cpu:1" on the last), the real SmolLM2-135M-Instruct in **fp32** under several names (the profile is
fitted for that model, dtype and one thread per device; docs/evaluation.md, "The CPU profile").

How the simulated run mirrors the live one (``sim_deployment``; the differences it cannot remove
are listed in ``KNOWN_DIFFERENCES`` and printed):

- devices: as many as the config has, each with exactly the live device's memory budget (the
  profile's nominal 8 GiB is replaced), pages of 2 MiB (the live ledger's page size);
- models: every config model becomes the shape of its source (SmolLM2-135M for the real weights) at
  its dtype; its SLOs come from the config, and both runs judge against the same numbers;
- engine: max_num_seqs, max_num_batched_tokens and block_size from the config (one value for all
  models: the simulator has one engine config);
- policy: name and knobs from the config; the simulator's tick is the live ``tick_interval_s``;
- warm-up: the live run sends one short request per model (3 prompt tokens, 2 output tokens) one at
  a time before the replay, as benchmarks/live_eval.py does, so the replay starts from the models the
  policy activated for them. The simulated workload starts with the same requests at the times the
  live run sent them (relative to the replay's start), so the simulator reaches the same placement
  the same way; warm-up requests are left out of every number, and activations/evictions are counted
  from the replay's first request on (the warm-up's own are reported separately).

Output: per model and for all models, live | sim | error | sim without compute sharing | error,
plus each engine's busy seconds (a step in flight; live from /metrics) next to the live engines' CPU
seconds, the offered work (each request alone, in cores) before the run, the machine line (CPU, its
vector flags) and the other load in cores while the live run ran; result.json in ``--out`` has both
runs' per-model numbers, every live repeat and its request records, and the configuration. Numbers
from the simulator are simulated (a cost model fitted on this machine); live numbers are measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:  # `common` when imported from a test
    sys.path.insert(0, str(BENCH_DIR))

from prism_serve.config import DeploymentConfig, load_config, parse_config  # noqa: E402
from prism_serve.engine.machine import resolve_dtype  # noqa: E402
from prism_serve.memory.vmm import DEFAULT_PAGE_SIZE, format_size  # noqa: E402
from prism_serve.runtime.build import device_specs  # noqa: E402
from prism_serve.sim.config import ModelSLO, SimConfig  # noqa: E402
from prism_serve.sim.models import ServedModel, model_shape  # noqa: E402
from prism_serve.workload.format import Workload, read_jsonl, write_jsonl  # noqa: E402

HARDWARE = "cpu-smollm2"
REAL_SOURCE = "smollm2-135m-instruct"  # the default model's real weights: the SmolLM2-135M shape
WARMUP_PROMPT = [1000, 1001, 1002]  # token ids of each warm-up request
WARMUP_OUTPUT = 2
# Targets of the issue (measured, not asserted): relative error for latencies, points for attainment.
TARGETS = {"ttft_p50_s": 0.15, "ttft_p95_s": 0.15, "tpot_p50_s": 0.10, "ttft_attainment": 3.0,
           "slo_attainment": 3.0}  # fmt: skip
LATENCIES = ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s")
ATTAINMENTS = ("ttft_attainment", "tpot_attainment", "slo_attainment")
COUNTS = ("activations", "evictions")
BUSY = "engine_busy_s"  # seconds the model's engine had a step in flight (live: /metrics step seconds)
OTHER_LOAD_WARN = 0.2  # cores other processes may use during a live run before the output warns
SIM_COUNTERS = ("preemptions", "restarts", "migrations", "migrations_skipped", "num_rejected",
                "num_unfinished", "simulated_s")  # fmt: skip

KNOWN_DIFFERENCES = (
    "compute sharing: modelled as processor sharing with a fitted interference term "
    "(HardwareProfile.share_slowdown) among engines with a step in flight; live, the server process, "
    "activations and this client also take CPU from the devices' cores, which the simulator does not "
    "count (the 'sim, no sharing' column is the simulator with compute_sharing=False)",
    "activation cost: simulated from the profile's activation constants (0.01 s + weights at 7 GB/s, "
    "about 0.087 s for SmolLM2-135M fp32: a copy into spare pages) and free for the device's core; live "
    "it is a copy (pages created only when no spare ones are left) in the worker, on the device's core, "
    "while the colocated engine runs",
    "worker processes: live, the pool starts a spare engine process when a device's last idle one is "
    "taken (seconds of CPU on that core); the presets start 3 per device (at most 2 models fit on one) "
    "so that none is started during the replay",
    "prefill speed in admission: the live engine reports its measured prefill tokens/s, the simulator "
    "the cost model's (for a mean prompt of the model's requests)",
    "decode runs: the simulator grants up to 32 steps of KV blocks up front in a decode run (live maps "
    "them step by step), which matters only when KV memory is nearly full",
    "latency origin: live TTFT is from the client's send (HTTP, tokenization and SSE included), "
    "simulated TTFT from the arrival",
    "serving path: the profile is fitted on live worker steps' CPU seconds (and measured points); live, "
    "the server process (not pinned) and this client share the devices' two cores with the workers "
    "(--step-scale 1.04 is their measured share), and every token also crosses the worker -> "
    "controller IPC and the server's SSE, which the simulated TTFT and TPOT do not include",
    "per-model engine knobs: the simulator has one engine config, so the config's models must agree on "
    "max_num_seqs, max_num_batched_tokens and block_size; kv_limit, pinned and max_model_len are not "
    "simulated",
)


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


def shape_of(source: str) -> str:
    """The simulator's model shape for a config ``source``."""
    if source == REAL_SOURCE:
        return "smollm2-135m"
    if source.startswith("random:"):
        return source.split(":", 1)[1]
    raise MirrorError(f"source {source!r}: only {REAL_SOURCE} and random:<preset> have a simulated shape")


def sim_deployment(
    cfg: DeploymentConfig, *, warmup_s: float = 0.0, compute_sharing: bool | None = None,
    step_scale: float = 1.0, profiles: str = "live",
) -> SimDeployment:
    """The simulated deployment that mirrors ``cfg`` on the ``cpu-smollm2`` profile
    (``compute_sharing``: None leaves the simulator's default; ``profiles``: SimConfig.profiles, by
    default what the live controller knows of each model's demand)."""
    warnings: list[str] = []
    devices = device_specs(cfg)
    for d in devices:
        if len(d.cores) != 1:
            warnings.append(
                f"{d.name} has {len(d.cores) or 'all'} cores; the {HARDWARE} profile is fitted for one core "
                "with one torch thread"
            )
    models, slos = [], {}
    for m in cfg.models:
        shape = shape_of(m.source)
        dtype = resolve_dtype(m.dtype)  # auto: what the live server on this machine runs
        dtype_bytes = {"float32": 4, "bfloat16": 2}[dtype]
        if (shape, dtype) != ("smollm2-135m", "float32"):
            warnings.append(
                f"{m.name}: {shape} in {dtype} is not what {HARDWARE} is fitted for (SmolLM2-135M fp32); "
                "docs/evaluation.md gives its errors"
            )
        if m.kv_limit is not None or m.pinned or m.keep_alive is not None:
            warnings.append(f"{m.name}: kv_limit, pinned and keep_alive are not simulated")
        models.append(ServedModel(m.name, model_shape(shape, dtype_bytes)))
        slos[m.name] = ModelSLO(m.ttft_slo, m.tpot_slo)
    engine = {}
    for knob in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        values = {getattr(m, knob) for m in cfg.models}
        if len(values) != 1:
            raise MirrorError(f"models differ in {knob} ({sorted(values)}); the simulator has one value")
        engine[knob] = values.pop()
    config = SimConfig(
        num_devices=len(devices),
        hardware=HARDWARE,
        policy=cfg.policy.name,
        knobs=tuple(sorted((k, _hashable(v)) for k, v in cfg.policy.knobs.items())),
        tick_s=cfg.policy.tick_interval_s,
        page_size=DEFAULT_PAGE_SIZE,  # the live ledger's page (runtime/controller.py default)
        rate_window_s=60.0,  # the live controller's default
        warmup_s=warmup_s,
        step_scale=step_scale,
        profiles=profiles,
        **engine,
        **({} if compute_sharing is None else {"compute_sharing": compute_sharing}),
    )
    return SimDeployment(
        models, slos, config, tuple(d.memory_bytes for d in devices), tuple(d.name for d in devices),
        tuple(warnings),
    )  # fmt: skip


def _hashable(v):
    if isinstance(v, list | tuple):
        return tuple(_hashable(x) for x in v)
    return v


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
    return Workload(
        np.concatenate([[t - t0 for t, _ in warmup], workload.timestamps + (replay_start - t0)]),
        np.concatenate([[index[m] for _, m in warmup], workload.model_index]),
        np.concatenate([np.full(k, len(WARMUP_PROMPT)), workload.prompt_tokens]),
        np.concatenate([np.full(k, WARMUP_OUTPUT), workload.output_tokens]),
        names,
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


def live_model_stats(summary: dict) -> dict[str, dict]:
    """Per model (and "(all)") from a bench summary (bench/report.py ``summarize``)."""
    keys = ("requests", "failed", *LATENCIES, *ATTAINMENTS)
    rows = {m: {k: s[k] for k in keys} for m, s in summary["models"].items()}
    rows["(all)"] = {k: summary["overall"][k] for k in keys}
    return rows


def rel_error(sim: float | None, live: float | None) -> float | None:
    """(sim - live) / live; None when either is missing or live is 0."""
    if sim is None or live is None or live == 0:
        return None
    return (sim - live) / live


def points(sim: float | None, live: float | None) -> float | None:
    """Attainment difference in percentage points (sim - live)."""
    if sim is None or live is None:
        return None
    return 100.0 * (sim - live)


def compare(live_runs: list[dict[str, dict]], sim: dict[str, dict]) -> dict[str, dict]:
    """Per model: every metric's live mean over the repeats, its spread (min, max), the simulated
    value and the error (relative for latencies, points for attainment, a difference for counts);
    ``within`` says which targets (``TARGETS``) the error meets."""
    out = {}
    names = [m for m in sim if m != "(all)"] + ["(all)"]
    for name in names:
        row: dict = {"requests": sim[name]["requests"], "metrics": {}}
        for key in (*LATENCIES, *ATTAINMENTS, *COUNTS, BUSY):
            values = [r[name].get(key) for r in live_runs if name in r]
            values = [v for v in values if v is not None]
            live = float(np.mean(values)) if values else None
            s = sim[name].get(key)
            if key in LATENCIES or key == BUSY:
                err = rel_error(s, live)
            elif key in ATTAINMENTS:
                err = points(s, live)
            else:
                err = None if s is None or live is None else s - live
            m = {
                "live": live,
                "live_min": min(values) if values else None,
                "live_max": max(values) if values else None,
                "sim": s,
                "error": err,
            }
            if key in TARGETS:
                m["within"] = None if err is None else abs(err) <= TARGETS[key]
            row["metrics"][key] = m
        out[name] = row
    return out


def _fmt(key: str, v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if key in LATENCIES:
        return f"{1000 * v:.0f}"
    if key in ATTAINMENTS:
        return f"{100 * v:.1f}"
    if key == BUSY:
        return f"{v:.1f}"
    return f"{v:g}"


def _fmt_err(key: str, e: float | None) -> str:
    if e is None:
        return "-"
    if key in LATENCIES or key == BUSY:
        return f"{100 * e:+.1f}%"
    if key in ATTAINMENTS:
        return f"{e:+.1f}pt"
    return f"{e:+g}"


def _spread(key: str, m: dict) -> str:
    lo, hi = m["live_min"], m["live_max"]
    return "" if lo is None or lo == hi else f" [{_fmt(key, lo)}..{_fmt(key, hi)}]"


COLUMNS = (
    ("ttft_p50_s", "TTFT p50 ms"),
    ("ttft_p95_s", "TTFT p95 ms"),
    ("tpot_p50_s", "TPOT p50 ms"),
    ("ttft_attainment", "TTFT att %"),
    ("slo_attainment", "TTFT+TPOT att %"),
    ("activations", "activations"),
    ("evictions", "evictions"),
    (BUSY, "engine busy s"),
)


def format_comparison(variants: dict[str, dict[str, dict]], repeats: int = 1) -> str:
    """One block per model: each metric live | per simulated variant: value, error (| live min..max
    over the repeats). ``variants``: label -> ``compare`` rows."""
    lines = []
    spread = repeats > 1
    first = next(iter(variants.values()))
    head = f"  {'':<16} {'live':>9}" + "".join(f" {label[:16]:>16} {'error':>8}     " for label in variants)
    head += f"live min..max ({repeats} runs)" if spread else ""
    for name, row in first.items():
        lines.append(f"{name} ({row['requests']} requests)")
        lines.append(head.rstrip())
        for key, label in COLUMNS:
            line = f"  {label:<16} {_fmt(key, row['metrics'][key]['live']):>9}"
            for rows in variants.values():
                m = rows[name]["metrics"][key]
                mark = "" if m.get("within") is None else ("ok" if m["within"] else "MISS")
                line += f" {_fmt(key, m['sim']):>16} {_fmt_err(key, m['error']):>8} {mark:<4}"
            line += _spread(key, row["metrics"][key]) if spread else ""
            lines.append(line.rstrip())
    return "\n".join(lines)


def target_summary(rows: dict[str, dict]) -> dict[str, str]:
    """Per target metric: how many models (not "(all)") are within the target, e.g. "3/5"."""
    out = {}
    for key in TARGETS:
        judged = [r["metrics"][key]["within"] for n, r in rows.items() if n != "(all)"]
        judged = [w for w in judged if w is not None]
        out[key] = f"{sum(judged)}/{len(judged)}"
    return out


# ---- presets ------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Preset:
    description: str
    policy: str
    models: tuple[str, ...]
    memory: str  # budget of each device
    total_rate: float  # req/s of all models together (the builder's expected mean)
    zipf: float
    ttft_slo: float = 3.0
    tpot_slo: float = 0.5
    knobs: dict = field(default_factory=dict)
    duration_s: float = 180.0
    max_prompt_tokens: int = 128
    max_output_tokens: int = 32
    seed: int = 0


PRESETS = {
    "light-prism": Preset(
        "low load, 3 models that all fit (no eviction needed), prism",
        "prism", ("smol-a", "smol-b", "smol-c"), "1536MiB", total_rate=0.3, zipf=1.0,
    ),
    "heavy-prism": Preset(
        "about one device's capacity in all (0.5 req/s; the hot model alone about 0.7 of a core, each "
        "request alone), Zipf 1.5 (one hot model, four cold), 1200 MiB "
        "devices: two models per device, so only 4 of the 5 fit at once; idle models may be evicted after "
        "10 s (default 30 s), so activations and evictions happen during the run; prism",
        "prism", ("smol-a", "smol-b", "smol-c", "smol-d", "smol-e"), "1200MiB", total_rate=0.5, zipf=1.5,
        knobs={"idle_threshold_s": 10.0},
    ),
    "static": Preset(
        "moderate load, 4 models that all fit, fixed KV slices, static-partition",
        "static-partition", ("smol-a", "smol-b", "smol-c", "smol-d"), "1300MiB", total_rate=0.6, zipf=1.0,
    ),
    "qlm": Preset(
        "low-moderate load, 3 models, one model per device at a time (swaps), qlm",
        "qlm", ("smol-a", "smol-b", "smol-c"), "1300MiB", total_rate=0.4, zipf=1.0,
    ),
}  # fmt: skip


def preset_config_text(p: Preset, cores: tuple[int, int]) -> str:
    """The deployment YAML of a preset (``prism serve --config`` format)."""
    models = "".join(
        f"  - {{name: {n}, source: {REAL_SOURCE}, dtype: float32, ttft_slo: {p.ttft_slo}, "
        f"tpot_slo: {p.tpot_slo}}}\n"
        for n in p.models
    )
    knobs = ", ".join(f"{k}: {json.dumps(v)}" for k, v in sorted(p.knobs.items()))
    return (
        "devices:\n"
        f'  - {{name: "cpu:0", memory: {p.memory}, cores: "{cores[0]}", workers: 3}}\n'
        f'  - {{name: "cpu:1", memory: {p.memory}, cores: "{cores[1]}", workers: 3}}\n'
        f"models:\n{models}"
        f"policy: {{name: {p.policy}, knobs: {{{knobs}}}}}\n"
        "server: {max_waiting_requests: 1024, request_timeout_s: 300}\n"
    )


def preset_workload(p: Preset, duration_s: float | None = None) -> tuple[Workload, dict]:
    from prism_serve.workload.builder import WorkloadSpec, build_workload

    spec = WorkloadSpec(
        models=p.models,
        source="azure:conv",
        lengths="azure:conv",
        duration_s=duration_s or p.duration_s,
        total_rate=p.total_rate,
        zipf=p.zipf,
        max_prompt_tokens=p.max_prompt_tokens,
        max_output_tokens=p.max_output_tokens,
        seed=p.seed,
    )
    keys = ("source", "lengths", "duration_s", "total_rate", "zipf", "max_prompt_tokens",
            "max_output_tokens", "seed")  # fmt: skip
    return build_workload(spec), {k: getattr(spec, k) for k in keys}


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
        "summary": {k: summary[k] for k in SIM_COUNTERS},
        "placement_after_warmup": sim.placement_at_replay,
        "placement_at_end": sim.placement(),
        "wall_s": round(wall, 2),
        "simulated": True,
        "hardware": result.labels.get("hardware"),
    }


# ---- the live run -------------------------------------------------------------------------------


def _proc_tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants (the waited-for exited ones included), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    times: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            text = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = text.rsplit(")", 1)[1].split()
        parent[int(d)] = int(f[1])
        times[int(d)] = (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in parent.items():
            if pp == p and c not in tree:
                tree.add(c)
                frontier.append(c)
    return sum(times.get(p, 0.0) for p in tree)


def _models(port: int) -> list[dict]:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]


def _counts(port: int) -> dict[str, dict]:
    """Model -> activations, evictions (the server's counters, as /metrics' prism_model_activations
    and prism_model_evictions), device."""
    return {
        c["id"]: {"activations": c["num_activations"], "evictions": c["num_evictions"], "device": c["device"]}
        for c in _models(port)
    }


def _placement(counts: dict[str, dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, c in counts.items():
        if c["device"]:
            out.setdefault(c["device"], []).append(name)
    return dict(sorted(out.items()))


def _wait_idle(port: int, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all(c["num_running"] == 0 and c["num_queued"] == 0 for c in _models(port)):
            return
        time.sleep(0.5)


def _scrape(port: int) -> dict[str, dict[str, float]]:
    """From /metrics: device -> mapped bytes, and model -> engine step (wall) and worker CPU seconds
    so far (their ratio over the replay is the share of its core an engine got while it had work)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {"mapped": {}, "step": {}, "cpu": {}, "act_s": {}, "act_n": {}}
    names = {"prism_device_mapped_bytes": "mapped", "prism_engine_step_seconds_total": "step",
             "prism_engine_cpu_seconds_total": "cpu", "prism_activation_seconds_sum": "act_s",
             "prism_activation_seconds_count": "act_n"}  # fmt: skip
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = names.get(s.name)
            if key is None:
                continue
            where = s.labels.get("device") if key == "mapped" else s.labels.get("model_name")
            out[key][where] = out[key].get(where, 0.0) + s.value  # activations: every device
    return out


def _activation_means(before: dict, after: dict) -> dict[str, float | None]:
    """Mean activation seconds (decision to ready) per model over the replay."""
    out: dict[str, float | None] = {}
    for m, n in after["act_n"].items():
        k = n - before["act_n"].get(m, 0.0)
        out[m] = round((after["act_s"][m] - before["act_s"].get(m, 0.0)) / k, 4) if k else None
    return out


def _core_shares(before: dict, after: dict) -> dict[str, dict]:
    shares = {}
    for m, step in sorted(after["step"].items()):
        st = step - before["step"].get(m, 0.0)
        cpu = after["cpu"].get(m, 0.0) - before["cpu"].get(m, 0.0)
        shares[m] = {
            "step_s": round(st, 2),
            "cpu_s": round(cpu, 2),
            "cpu_share": round(cpu / st, 3) if st else None,
        }
    return shares


async def run_live(cfg: DeploymentConfig, workload: Workload, out: Path, tag: str, timeout_s: float) -> dict:
    """One fresh ``prism serve`` with ``cfg``: warm-up (one request per model, one at a time), the
    replay of ``workload``, the server's activation/eviction counters before and after."""
    import httpx

    import common
    from prism_serve.api.process import free_port, start_server_process, stop_server_process
    from prism_serve.bench.replay import replay
    from prism_serve.bench.settings import BenchSettings
    from prism_serve.engine.step_trace import ENV_VAR as STEP_TRACE_ENV

    port = free_port()
    data = cfg.model_dump(mode="json")
    data["server"].update(port=port, namespace=f"simvslive-{uuid.uuid4().hex[:8]}")
    path = out / f"serve-{tag}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    slos = {m.name: ModelSLO(m.ttft_slo, m.tpot_slo) for m in cfg.models}
    # every engine step's shape and seconds, for fit_cpu_profile.py --trace
    trace = {STEP_TRACE_ENV: str(out / f"steps-{tag}")}
    proc = start_server_process(path, port, out / f"server-{tag}.log", env=trace)
    try:
        healthy = time.perf_counter()
        warmup: list[tuple[float, str]] = []
        for m in cfg.models:  # in the config's order, as benchmarks/live_eval.py
            body = {"model": m.name, "prompt": WARMUP_PROMPT, "max_tokens": WARMUP_OUTPUT, "ignore_eos": True}
            warmup.append((time.perf_counter(), m.name))
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300).raise_for_status()
        warm = _counts(port)
        scraped = _scrape(port)
        settings = BenchSettings(prompt="ids", timeout_s=timeout_s, slo_scale=1.0)
        cpu0, server0 = common.cpu_seconds(), _proc_tree_cpu(proc.pid)
        replay_start = time.perf_counter()
        res = await replay(workload, f"http://127.0.0.1:{port}", settings, slos=slos, progress=True)
        wall = time.perf_counter() - replay_start
        busy, own = common.cpu_seconds()
        server_cores = (_proc_tree_cpu(proc.pid) - server0) / wall
        other = max(0.0, (busy - cpu0[0] - (own - cpu0[1])) / wall - server_cores)
        _wait_idle(port)
        end = _counts(port)
        final = _scrape(port)
        shares, activation_s = _core_shares(scraped, final), _activation_means(scraped, final)
    finally:
        stop_server_process(proc)
    stats = live_model_stats(res.summary())
    for name in slos:
        for key in COUNTS:
            stats[name][key] = end[name][key] - warm[name][key]
            stats[name][f"warmup_{key}"] = warm[name][key]
        stats[name][BUSY] = shares.get(name, {}).get("step_s", 0.0)
    for key in (*COUNTS, BUSY):
        stats["(all)"][key] = sum(stats[n][key] for n in slos)
    return {
        "models": stats,
        "warmup": [(round(t - replay_start, 4), m) for t, m in warmup],
        "warmup_start_after_healthy_s": round(warmup[0][0] - healthy, 4),
        "placement_after_warmup": _placement(warm),
        "placement_at_end": _placement(end),
        "mapped_bytes_after_warmup": {d: int(b) for d, b in scraped["mapped"].items()},
        "engine_seconds": shares,
        "activation_mean_s": activation_s,
        "wall_s": round(wall, 1),
        "server_cores_busy": round(server_cores, 3),
        "other_load_cores": round(other, 3),
        "errors": res.summary()["overall"]["errors"],
        "send_lag_p99_s": res.summary()["overall"]["send_lag_p99_s"],
        "requests": [r.to_json() for r in res.records],
    }


# ---- main ---------------------------------------------------------------------------------------


def _wait_quiet(limit_s: float, threshold: float, window_s: float = 10.0) -> float:
    """Wait (up to ``limit_s``) for ``window_s`` seconds in which other processes used fewer than
    ``threshold`` cores (a longer window than common.wait_quiet's half second: a live run lasts
    minutes); returns the last window's load."""
    import common

    deadline = time.monotonic() + limit_s
    while True:
        start = common.cpu_seconds()
        time.sleep(window_s)
        load = common.other_load_since(start, window_s)
        if load < threshold or time.monotonic() > deadline:
            return load


def _wait_quiet_file(path: str | None, limit_s: float) -> None:
    if not path:
        return
    deadline = time.monotonic() + limit_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            sys.exit(f"{path} did not appear within {limit_s:.0f} s; not running")
        print(f"waiting for {path} ...", flush=True)
        time.sleep(30)


def reused_live_runs(path: Path, cfg: DeploymentConfig, workload: Workload) -> list[dict]:
    """The live runs of an earlier result.json, if it ran this deployment and these requests."""
    old = json.loads(path.read_text())
    if old.get("deployment") != cfg.model_dump(mode="json"):
        sys.exit(f"{path} ran another deployment")
    sent = [
        (r["model"], r["scheduled_s"], r["prompt_tokens"], r["max_tokens"])
        for r in old["live"][0]["requests"]
    ]
    here = [(r.model, r.timestamp, r.prompt_tokens, r.output_tokens) for r in workload.rows()]
    if len(sent) != len(here) or any(
        a[0] != b[0] or a[2:] != b[2:] or abs(a[1] - b[1]) > 1e-5 for a, b in zip(sent, here, strict=True)
    ):
        sys.exit(f"{path} replayed another workload")
    for run in old["live"]:  # runs recorded before the engine busy row: from their engine seconds
        for name, stats in run["models"].items():
            if name != "(all)" and BUSY not in stats:
                stats[BUSY] = run.get("engine_seconds", {}).get(name, {}).get("step_s")
        busy = [s.get(BUSY) for n, s in run["models"].items() if n != "(all)"]
        run["models"]["(all)"].setdefault(BUSY, sum(busy) if None not in busy else None)
    return old["live"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=list(PRESETS), help="build the deployment and workload")
    src.add_argument("--config", type=Path, help="deployment YAML (prism serve --config format)")
    ap.add_argument("--workload", type=Path, help="workload JSONL (prism workload format); with --config")
    ap.add_argument("--duration", type=float, help="seconds of traffic (presets: build this long; "
                    "files: only requests before this time)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1, help="live runs (a fresh server each); sim runs once")
    ap.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, s (a miss)")
    ap.add_argument(
        "--sim-only",
        action="store_true",
        help="skip the live run (the simulated warm-up then sends one request per model 2 s apart)",
    )
    ap.add_argument(
        "--reuse-live",
        type=Path,
        nargs="+",
        metavar="RESULT_JSON",
        help="take the live runs from earlier result.json files of the same deployment and workload and "
        "simulate again (e.g. after a simulator change); several files: all their runs, for the spread",
    )
    ap.add_argument("--wait-for", help="a file to wait for (polled every 30 s) before the live run")
    ap.add_argument("--wait-limit", type=float, default=2400.0)
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.3,
        metavar="CORES",
        help="before each live run wait (up to --quiet-limit s) for 10 s in which other processes used "
        "fewer cores than this; the load measured during the run is reported either way",
    )
    ap.add_argument("--quiet-limit", type=float, default=300.0)
    ap.add_argument(
        "--step-scale", type=float, default=1.0,
        help="simulate every engine step this many times as long as the profile says (SimConfig.step_scale): "
        "a correction measured on another run, e.g. its live engine busy seconds over the simulated ones",
    )  # fmt: skip
    ap.add_argument(
        "--profiles", choices=("live", "cost-model"), default="live",
        help="what the simulated policies know of each model's demand (SimConfig.profiles): live, as the "
        "live controller (measured engine seconds per request); cost-model, the simulator's default",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.config is not None and args.workload is None:
        ap.error("--config needs --workload")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)

    info: dict = {}
    if args.preset:
        p = PRESETS[args.preset]
        affinity = sorted(os.sched_getaffinity(0))
        text = preset_config_text(p, (affinity[0], affinity[-1]))
        cfg = parse_config(text, f"preset {args.preset}")
        workload, spec = preset_workload(p, args.duration)
        (args.out / "deployment.yaml").write_text(text)
        write_jsonl(workload, args.out / "workload.jsonl")
        info = {"preset": args.preset, "description": p.description, "workload_spec": spec}
    else:
        cfg = load_config(args.config)
        workload = read_jsonl(args.workload, [m.name for m in cfg.models])
        if args.duration:
            workload = workload.head(args.duration)
        info = {"config": str(args.config), "workload_file": str(args.workload)}
    missing = set(workload.models) - {m.name for m in cfg.models}
    if missing:
        sys.exit(f"the workload names models the config lacks: {sorted(missing)}")
    mirror = {"step_scale": args.step_scale, "profiles": args.profiles}  # every simulated variant
    dep = sim_deployment(cfg, **mirror)
    per_model = {m: int((workload.model_index == i).sum()) for i, m in enumerate(workload.models)}
    import common

    machine = common.machine_info()
    print(f"machine: {machine['line']}")
    budgets = ", ".join(f"{n} {format_size(b)}" for n, b in zip(dep.device_names, dep.budgets, strict=True))
    print(
        f"deployment: {len(dep.budgets)} devices ({budgets}), "
        f"policy {cfg.policy.name} {dict(cfg.policy.knobs) or ''}, {len(cfg.models)} models"
    )
    print(f"workload: {len(workload)} requests over {workload.duration:.0f} s ({per_model})")
    load = offered_load(dep, workload)
    print(
        f"offered work, each request alone ({HARDWARE} cost model): "
        + ", ".join(f"{m} {v:.2f}" for m, v in load.items())
        + f" cores ({sum(load.values()):.2f} of {len(dep.budgets)})"
    )
    for w in dep.warnings:
        print(f"warning: {w}")

    live_runs: list[dict] = []
    if args.reuse_live is not None:
        live_runs = [run for p in args.reuse_live for run in reused_live_runs(p, cfg, workload)]
        info["live_from"] = [str(p) for p in args.reuse_live]
        print(f"live runs from {', '.join(map(str, args.reuse_live))} ({len(live_runs)})")
    elif not args.sim_only:
        _wait_quiet_file(args.wait_for, args.wait_limit)

        for i in range(args.repeat):
            load = _wait_quiet(args.quiet_limit, args.quiet)
            print(f"live run {i + 1}/{args.repeat}; other load before it: {load:.2f} cores", flush=True)
            live_runs.append(asyncio.run(run_live(cfg, workload, args.out, str(i), args.timeout)))
            r = live_runs[-1]
            print(
                f"  {r['wall_s']} s; server {r['server_cores_busy']} cores busy, other load "
                f"{r['other_load_cores']} cores; errors {r['errors'] or 'none'}; placement after warm-up "
                f"{r['placement_after_warmup']}",
                flush=True,
            )
            print(
                "  engines, CPU / step seconds (core share while busy): "
                + ", ".join(
                    f"{m} {v['cpu_s']:.1f}/{v['step_s']:.1f} ({v['cpu_share']})"
                    for m, v in r["engine_seconds"].items()
                ),
                flush=True,
            )
    # the simulator replays the first live run's warm-up times (a default spacing without one)
    if live_runs:
        warm = [(t, m) for t, m in live_runs[0]["warmup"]]
        warmup_s = live_runs[0]["warmup_start_after_healthy_s"]
    else:
        warm = [(-2.0 * (len(cfg.models) - i), m.name) for i, m in enumerate(cfg.models)]
        warmup_s = 0.5
    sim_wl = with_warmup(workload, warm, 0.0)
    sims, rows = {}, {}
    for label, sharing in sim_variants():
        dep = sim_deployment(cfg, warmup_s=warmup_s, compute_sharing=sharing, **mirror)
        sims[label] = run_sim(dep, sim_wl, len(warm))
        rows[label] = compare([r["models"] for r in live_runs], sims[label]["models"])
    sim = sims["sim"]

    print()
    print(format_comparison(rows, len(live_runs)))
    if live_runs:
        for label, r in rows.items():
            met = target_summary(r)
            print(
                f"models within target ({label}): "
                + ", ".join(f"{k} (±{_fmt_err(k, TARGETS[k]).lstrip('+')}) {v}" for k, v in met.items())
            )
    for when in ("placement_after_warmup", "placement_at_end"):
        print(f"{when}: live {live_runs[0][when] if live_runs else '-'}, sim {sim[when]}")
    loads = [r["other_load_cores"] for r in live_runs]
    if loads and max(loads) > OTHER_LOAD_WARN:
        print(
            f"WARNING: other processes kept {max(loads):.2f} cores busy during a live run (of "
            f"{machine['cores']}): the live numbers are distorted, run again on a quiet machine"
        )
    print("simulated: cpu-smollm2 profile (fitted on this machine); differences the mirror cannot remove:")
    for d in KNOWN_DIFFERENCES:
        print(f"  - {d}")
    result = {
        "command": " ".join(["python benchmarks/sim_vs_live.py", *sys.argv[1:]]),
        "machine": machine,
        **info,
        "deployment": cfg.model_dump(mode="json"),
        "sim_config": dataclasses.asdict(
            sim_deployment(cfg, warmup_s=warmup_s, **mirror).config
        ),
        "device_budgets": dict(zip(dep.device_names, dep.budgets, strict=True)),
        "warnings": list(dep.warnings),
        "known_differences": list(KNOWN_DIFFERENCES),
        "num_requests": len(workload),
        "requests_per_model": per_model,
        "offered_load_cores": load,
        "targets": TARGETS,
        "comparison": rows if live_runs else None,
        "within_target": {k: target_summary(r) for k, r in rows.items()} if live_runs else None,
        "sim": sims,
        "live": live_runs,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out / 'result.json'}")


if __name__ == "__main__":
    main()
