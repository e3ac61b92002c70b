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
fitted for that model, dtype and one thread per device; docs/results.md, "The CPU profiles").

How the simulated run mirrors the live one (``sim_deployment`` in sim_mirror.py; the live run is
live_run.py's ``run_live``; the differences the mirror cannot remove are listed in
``KNOWN_DIFFERENCES`` and printed):

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

Output: per model and for all models, live | sim | error | sim without compute sharing | error |
sim at the live runs' measured host speed | error (the runs' step traces: step_overlap.host_speed),
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
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:  # `common`, `sim_mirror`, `live_run` when imported from a test
    sys.path.insert(0, str(BENCH_DIR))

from live_run import reused_live_runs, run_live, wait_for_file, wait_quiet_window  # noqa: E402
from prism_serve.config import load_config, parse_config  # noqa: E402
from prism_serve.memory.vmm import format_size  # noqa: E402
from prism_serve.sim.hardware import dump_hardware, get_hardware  # noqa: E402
from prism_serve.workload.format import Workload, read_jsonl, write_jsonl  # noqa: E402
from sim_mirror import (  # noqa: E402, F401  (re-exported: tests/bench/test_sim_vs_live.py)
    ATTAINMENTS,
    BUSY,
    COUNTS,
    HARDWARE,
    LATENCIES,
    REAL_SOURCE,
    MirrorError,
    SimDeployment,
    offered_load,
    run_sim,
    sim_deployment,
    sim_model_stats,
    sim_variants,
    with_warmup,
)
from step_overlap import host_speed_profile, host_speeds  # noqa: E402

TARGETS = {"ttft_p50_s": 0.15, "ttft_p95_s": 0.15, "tpot_p50_s": 0.10, "ttft_attainment": 3.0,
           "slo_attainment": 3.0}  # fmt: skip
OTHER_LOAD_WARN = 0.2  # cores other processes may use during a live run before the output warns
# The sensitivity check simulates again with every step this much slower and faster: twice the
# fitted profile's mean error on held-out live steps (4%), about what VMs of one type differed by on
# different days (7-15%, docs/results.md).
SPEED_SPREAD = 0.08
BISTABLE = 0.25  # a model whose activations change by more than this fraction between the speeds
KNOWN_DIFFERENCES = (
    "compute sharing: modelled as processor sharing with a fitted interference term "
    "(HardwareProfile.share_slowdown) among engines with a step in flight; live, the server process, "
    "activations and this client also take CPU from the devices' cores, which the simulator does not "
    "count (the 'sim, no sharing' column is the simulator with compute_sharing=False); devices of one "
    "host slow each other by the profile's cross_interference while several have a step in flight "
    "(cores share the socket's memory bandwidth); both terms by the step's shape where the profile "
    "measured them per decode width (HardwareProfile.decode_interference)",
    "host speed: the profile is one fixed speed; live, this machine's uncontended decode steps cost "
    "several percent more or less CPU from one run to the next (the host's memory and its other tenants). "
    "Each live run prints its speed against the profile, in the seconds the profile was fitted to "
    "(wall for prism fit-hardware's, CPU for those fitted to live steps; on a VM a busy core gives "
    "its thread about 95% of the wall time), its memory and compute speeds apart (from "
    "its decode and prefill steps), and the 'sim, host speed' column is the simulator with the "
    "profile's memory and compute rates at the runs' mean speeds: what is left there is the "
    "simulator's error, not the host's",
    "activation cost: simulated from the profile's activation constants (activation_overhead_s + "
    "weights at host_bandwidth: a copy into spare pages), the copy counting as activation_threads busy "
    "engines on the device's core while it runs (processor sharing by thread); live it is a copy (pages "
    "created only when no spare ones are left; the next activation's spare pages are made at nice 19) "
    "by the worker's loader threads, on the device's core, while the colocated engine runs",
    "worker processes: live, the pool starts a spare engine process when a device's last idle one is "
    "taken (seconds of CPU on that core); the presets start 3 per device (at most 2 models fit on one) "
    "so that none is started during the replay",
    "prefill speed in admission: the live engine reports its measured prefill tokens/s, the simulator "
    "the cost model's (for a mean prompt of the model's requests)",
    "decode runs: the simulator grants up to 32 steps of KV blocks up front in a decode run (live maps "
    "them step by step), which matters only when KV memory is nearly full",
    "latency origin: live TTFT is from the client's send (HTTP, routing, IPC to the worker, the first "
    "token back through the server's SSE), simulated TTFT from the arrival plus the profile's "
    "request_overhead_s, the median of that path measured live (each live run prints it: TTFT minus "
    "its own prefill step's wall time in the step trace); its spread (p90 a few ms above) is not "
    "simulated",
    "serving path: the profile is fitted on live worker steps' CPU seconds (and measured points); live, "
    "the server process (not pinned) and this client share the devices' two cores with the workers "
    "(--step-scale 1.04 is their measured share while a step runs). A worker starts its next step "
    "0.2 ms (median) after the last one ends, and a live client's TPOT equals the sum of its steps' "
    "wall times, so the serving path adds nothing else to TPOT",
    "per-model engine knobs: the simulator has one engine config, so the config's models must agree on "
    "max_num_seqs, max_num_batched_tokens and block_size; kv_limit, pinned and max_model_len are not "
    "simulated",
)


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


def sensitivity(cfg, sim_wl, num_warmup: int, warmup_s: float, mirror: dict) -> dict[str, dict]:
    """The simulation again with every step ``SPEED_SPREAD`` slower and faster: per model, its
    activations and TTFT p50 / p95 at each speed. A policy's decisions can hinge on whether a queue
    is empty at an arrival, and then a few percent of speed (the fit's error, or a VM that runs
    slower today) sends a run down another path; this says whether this workload is such a case."""
    out = {}
    for f in (1 - SPEED_SPREAD, 1 + SPEED_SPREAD):
        dep = sim_deployment(cfg, warmup_s=warmup_s, **{**mirror, "step_scale": mirror["step_scale"] * f})
        r = run_sim(dep, sim_wl, num_warmup)
        out[f"x{f:g}"] = {
            m: {k: v[k] for k in ("activations", "ttft_p50_s", "ttft_p95_s")} for m, v in r["models"].items()
        }
    return out


def bistable_models(speeds: dict[str, dict], sim: dict) -> list[str]:
    """Models whose activations at another speed differ from the simulation's by more than BISTABLE."""
    out = []
    for m, v in sim["models"].items():
        base = v["activations"]
        if any(abs(s[m]["activations"] - base) > BISTABLE * max(base, 1) for s in speeds.values()):
            out.append(m)
    return out


def format_sensitivity(speeds: dict[str, dict], sim: dict, live_runs: list[dict]) -> str:
    slower, faster = speeds
    labels = [slower, "x1", faster]
    rows = {**speeds, "x1": sim["models"]}
    lines = [
        f"speed sensitivity (the simulation with every step {' / '.join(labels)} as long): activations, "
        "TTFT p50 / p95 ms per model" + ("; live runs' activations" if live_runs else "")
    ]
    for m in sim["models"]:
        acts = " / ".join(str(rows[k][m]["activations"]) for k in labels)
        p50 = " / ".join(_fmt("ttft_p50_s", rows[k][m]["ttft_p50_s"]) for k in labels)
        p95 = " / ".join(_fmt("ttft_p95_s", rows[k][m]["ttft_p95_s"]) for k in labels)
        live = " / ".join(str(r["models"][m]["activations"]) for r in live_runs if m in r["models"])
        line = f"  {m:<14} {acts:>14}   p50 {p50:>20}   p95 {p95:>20}"
        lines.append(line + (f"   live {live}" if live else ""))
    flip = [m for m in bistable_models(speeds, sim) if m != "(all)"]
    if flip:
        lines.append(
            f"  BISTABLE: {', '.join(flip)}: {SPEED_SPREAD:.0%} of step speed changes the activations by "
            f"more than {BISTABLE:.0%}; a live run may follow either path, so compare it with the "
            "simulation at the speed whose activations it matches"
        )
    return "\n".join(lines)


HOST_SPEED_LABEL = "sim, host speed"  # the profile at the live runs' measured speeds (host_speed_profile)


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


# ---- main ---------------------------------------------------------------------------------------


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
    ap.add_argument(
        "--hardware", default=HARDWARE,
        help="the simulated devices' profile: a registered name or a profile file that "
        "fit_cpu_profile.py --write fitted on this machine (the registered one was fitted on another)",
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
    # every simulated variant
    mirror = {"step_scale": args.step_scale, "profiles": args.profiles, "hardware": args.hardware}
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
        f"offered work, each request alone ({args.hardware} cost model): "
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
        wait_for_file(args.wait_for, args.wait_limit)

        for i in range(args.repeat):
            load = wait_quiet_window(args.quiet_limit, args.quiet)
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
            path = r["serving_path"]
            if path["requests"]:
                print(
                    f"  serving path (TTFT minus its own prefill step, {path['requests']} requests whose "
                    f"prefill ran alone): median {1e3 * path['median_s']:.1f} ms, "
                    f"p90 {1e3 * path['p90_s']:.1f} ms (HardwareProfile.request_overhead_s)",
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
    variants = [(label, sharing, args.hardware) for label, sharing in sim_variants()]
    speeds_of_runs = host_speeds(live_runs, {m.name: m.spec for m in dep.models}, args.hardware)
    if speeds_of_runs:

        def speed(s: dict) -> str:
            split = f", memory {s['memory']:.3f} / compute {s['compute']:.3f}" if "memory" in s else ""
            return f"decode {s['ratio']:.3f} ({s['steps']} steps){split}"

        hw = get_hardware(args.hardware)
        print(
            "host speed in each live run (steps with their core and the other devices idle, their "
            f"{hw.step_seconds} seconds over the profile's, HardwareProfile.step_seconds): "
            + "; ".join(f"run {i + 1} {speed(s)}" for i, s in speeds_of_runs.items())
        )
        at_speed = host_speed_profile(hw, speeds_of_runs)
        path = args.out / "host-speed-profile.json"
        args.out.mkdir(parents=True, exist_ok=True)
        dump_hardware(at_speed, path)
        variants.append((HOST_SPEED_LABEL, None, str(path)))
    sims, rows = {}, {}
    for label, sharing, hardware in variants:
        dep = sim_deployment(
            cfg, warmup_s=warmup_s, compute_sharing=sharing, **{**mirror, "hardware": hardware}
        )
        sims[label] = run_sim(dep, sim_wl, len(warm))
        rows[label] = compare([r["models"] for r in live_runs], sims[label]["models"])
    sim = sims["sim"]
    speeds = sensitivity(cfg, sim_wl, len(warm), warmup_s, mirror)

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
    print(format_sensitivity(speeds, sim, live_runs))
    loads = [r["other_load_cores"] for r in live_runs]
    if loads and max(loads) > OTHER_LOAD_WARN:
        print(
            f"WARNING: other processes kept {max(loads):.2f} cores busy during a live run (of "
            f"{machine['cores']}): the live numbers are distorted, run again on a quiet machine"
        )
    print(f"simulated: the {args.hardware} profile; differences the mirror cannot remove:")
    for d in KNOWN_DIFFERENCES:
        print(f"  - {d}")
    result = {
        "command": " ".join(["python benchmarks/sim_vs_live.py", *sys.argv[1:]]),
        "machine": machine,
        **info,
        "deployment": cfg.model_dump(mode="json"),
        "sim_config": dataclasses.asdict(sim_deployment(cfg, warmup_s=warmup_s, **mirror).config),
        "device_budgets": dict(zip(dep.device_names, dep.budgets, strict=True)),
        "warnings": list(dep.warnings),
        "known_differences": list(KNOWN_DIFFERENCES),
        "num_requests": len(workload),
        "requests_per_model": per_model,
        "offered_load_cores": load,
        "targets": TARGETS,
        "host_speed_per_run": speeds_of_runs,
        "comparison": rows if live_runs else None,
        "within_target": {k: target_summary(r) for k, r in rows.items()} if live_runs else None,
        "sim": sims,
        "speed_sensitivity": speeds,
        "live": live_runs,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out / 'result.json'}")


if __name__ == "__main__":
    main()
