"""Live evaluation: the real server on 2 CPU devices, several policies, the same bursty
multi-model workload from the real traces at several rates; TTFT/TPOT attainment per rate.

Setup (printed and stored with the results): 5 models on 2 CPU devices of one core each: the real
SmolLM2-135M-Instruct under three names and two SYNTHETIC-weight models of real shapes
(SmolLM2-360M bf16, SmolLM2-135M bf16). Arrivals: the Azure 2023 conversation trace, each model from
its own offset, thinned to a Zipf popularity (``prism workload`` builder, seeded); lengths from the
same trace, capped for a one-core CPU. Each policy gets a fresh ``prism serve`` process, one warm-up
request per model, then the rates in increasing order on it (the same requests, timestamps divided
by the rate scale), each after the previous one drained.

    python benchmarks/live_eval.py                                  # the recorded run
    python benchmarks/live_eval.py --rates 1,2 --duration 30 --policies prism   # a quick look
    python benchmarks/live_eval.py --sim                            # the same sweep, simulated

``--sim`` runs the sweep in the simulator instead (benchmarks/sim_mirror.py: the same devices,
budgets, models, SLOs and policy on the fitted ``cpu-smollm2`` profile; each rate ``--sim-gap``
seconds after the previous one, where live waits until the server is idle) in seconds, to see
what a live sweep will show and why (it prints each model's attainment per rate).

Output: ``--out`` (default docs/figures/live; with ``--sim`` results/live-eval-sim, which git
ignores) gets live.json, live.png and, with ``--requests``,
each rate's request records (requests-POLICY-xRATE.json: every request's TTFT, TPOT, error); the
last lines printed are the highest tested rate at which each policy kept >= 99% TTFT attainment and
prism's ratio to static-partition.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process
from prism_serve.bench.replay import replay
from prism_serve.bench.settings import BenchSettings
from prism_serve.engine.machine import resolve_dtype
from prism_serve.workload.builder import WorkloadSpec, build_workload
from sim_mirror import HARDWARE

MODELS = """\
  - {name: smol-a, ttft_slo: 3.0, tpot_slo: 0.5}
  - {name: smol-b, ttft_slo: 3.0, tpot_slo: 0.5}
  - {name: smol-c, ttft_slo: 3.0, tpot_slo: 0.5}
  - {name: syn-360m, source: "random:smollm2-360m", dtype: bfloat16, ttft_slo: 4.0, tpot_slo: 0.8,
     max_model_len: 1024}
  - {name: syn-135m, source: "random:smollm2-135m", dtype: bfloat16, seed: 1, ttft_slo: 3.0, tpot_slo: 0.5,
     max_model_len: 1024}
"""
CONFIG = """\
devices:
  - {{name: "cpu:0", memory: {memory}, cores: "{core0}", workers: 2}}
  - {{name: "cpu:1", memory: {memory}, cores: "{core1}", workers: 2}}
models:
{models}server: {{port: {port}, namespace: "{namespace}", max_waiting_requests: 1024, request_timeout_s: 300}}
"""
NAMES = ("smol-a", "smol-b", "smol-c", "syn-360m", "syn-135m")


def wait_idle(port: int, limit_s: float = 120) -> None:
    """Until no request runs or waits (so one rate's tail does not spill into the next)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        cards = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
        if all(c["num_running"] == 0 and c["num_queued"] == 0 for c in cards):
            return
        time.sleep(1)


def warm_up(port: int) -> None:
    """One short request per model, one at a time: every policy starts the sweep from a server that
    has served each model once (a long-running server), not from the first activations after start."""
    for name in NAMES:
        body = {"model": name, "prompt": [1000, 1001, 1002], "max_tokens": 2, "ignore_eos": True}
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300).raise_for_status()


def placement(port: int) -> dict[str, list[str]]:
    """Device -> the models resident there now (evicted models under "evicted")."""
    cards = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
    groups: dict[str, list[str]] = {}
    for c in cards:
        groups.setdefault(c["device"] or "evicted", []).append(c["id"])
    return dict(sorted(groups.items()))


def engine_seconds(port: int) -> dict[str, tuple[float, float]]:
    """Model -> (engine step seconds, worker CPU seconds) so far, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for i, name in enumerate(("prism_engine_step_seconds", "prism_engine_cpu_seconds")):
            if family.name == name:
                for s in family.samples:
                    if s.name.endswith("_total"):
                        out.setdefault(s.labels["model_name"], [0.0, 0.0])[i] = s.value
    return {m: (v[0], v[1]) for m, v in out.items()}


def place_models(port: int, groups: str) -> None:
    """Activate models on given devices through the admin API ("cpu:0=a+b,cpu:1=c"), before the
    warm-up: the policy starts from this placement instead of the one its first requests give."""
    for part in groups.split(","):
        device, _, names = part.partition("=")
        for name in names.split("+"):
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/admin/models/{name}/load", json={"device": device}, timeout=300
            )
            r.raise_for_status()


def threshold_rate(points: list[dict], key: str = "ttft_attainment", target: float = 0.99) -> float | None:
    """The highest tested rate scale at which attainment >= target and every lower rate met it."""
    best = None
    for p in sorted(points, key=lambda p: p["rate_scale"]):
        if p[key] < target:
            break
        best = p["rate_scale"]
    return best


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_attainment", "TTFT"), (axes[1], "tpot_attainment", "TPOT")):
        for policy, points in results["policies"].items():
            xs = [p["rate_per_s"] for p in points]
            ax.plot(xs, [100 * p[key] for p in points], marker="o", label=policy)
        ax.axhline(99, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("request rate (req/s, all models)")
        ax.set_ylabel(f"{title} SLO attainment (%)")
        ax.set_title(f"{title} attainment, live, 2 CPU devices")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        "prism serve, 5 models (3 real SmolLM2 names + 2 synthetic), Azure conv arrivals", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def run_policy(
    policy: str,
    config: Path,
    workload,
    rates: list[float],
    duration: float,
    out: Path,
    place: str | None = None,
    timeout: float = 60.0,
    records: Path | None = None,
    log_level: str = "warning",
) -> list:
    port = free_port()
    cfg = out / f"config-{policy.replace(':', '_')}.yaml"
    cfg.write_text(policy_config(config.read_text(), policy, port))
    log = out / f"server-{policy.replace(':', '_')}.log"
    proc = start_server_process(cfg, port, log, log_level=log_level)
    points = []
    try:
        if place:
            place_models(port, place)
        warm_up(port)
        for r in rates:
            wait_idle(port)
            groups, seconds0 = placement(port), engine_seconds(port)
            settings = BenchSettings(rate_scale=r, duration_s=duration * r, prompt="ids", timeout_s=timeout)
            start, cpu0 = time.perf_counter(), common.cpu_seconds()
            res = await replay(workload, f"http://127.0.0.1:{port}", settings, progress=True)
            if records is not None:  # every request's TTFT, TPOT and error, for a look at the misses
                res.write_json(records / f"requests-{policy.replace(':', '_')}-x{r:g}.json")
            s = res.summary()["overall"]
            wall = time.perf_counter() - start
            seconds1 = engine_seconds(port)
            used = {
                m: (seconds1[m][0] - seconds0.get(m, (0, 0))[0], seconds1[m][1] - seconds0.get(m, (0, 0))[1])
                for m in seconds1
            }
            points.append(
                {
                    "rate_scale": r,
                    "rate_per_s": s["requests"] / duration,
                    "num_requests": s["requests"],
                    "ttft_attainment": s["ttft_attainment"],
                    "tpot_attainment": s["tpot_attainment"],
                    "num_failed": s["failed"],
                    "errors": s["errors"],
                    "ttft_p50_s": s["ttft_p50_s"],
                    "ttft_p99_s": s["ttft_p99_s"],
                    "models": {
                        m: {"ttft_attainment": v["ttft_attainment"], "num_requests": v["requests"]}
                        for m, v in res.summary()["models"].items()
                    },
                    "busy_cores_besides_the_client": common.other_load_since(cpu0, wall),
                    "placement_at_start": groups,
                    "placement_at_end": placement(port),
                    # per model over the rate: engine step seconds, worker CPU seconds, and their
                    # ratio (the share of the device's core its engine got while it had work)
                    "engine_seconds": {
                        m: {
                            "step_s": round(st, 2),
                            "cpu_s": round(cp, 2),
                            "cpu_share": round(cp / st, 3) if st else None,
                        }
                        for m, (st, cp) in sorted(used.items())
                    },
                }
            )
            p = points[-1]
            print(
                f"{policy:>16} x{r:<5g} {p['rate_per_s']:.2f} req/s: TTFT {100 * p['ttft_attainment']:.1f}%  "
                f"TPOT {100 * p['tpot_attainment']:.1f}%  failed {p['num_failed']}",
                flush=True,
            )
            print(
                f"{'':>16} placement {groups}; core share while busy "
                + ", ".join(f"{m} {v['cpu_share']}" for m, v in p["engine_seconds"].items()),
                flush=True,
            )
            if p["ttft_attainment"] < 0.5:  # saturated: higher rates only take longer to drain
                print(f"{policy:>16}: below 50% TTFT attainment, higher rates skipped", flush=True)
                break
        cards = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
        for p in points:
            p["final_models"] = {
                c["id"]: {k: c[k] for k in ("device", "num_activations", "num_evictions")} for c in cards
            }
    finally:
        stop_server_process(proc)
    return points


def policy_config(config_text: str, policy: str, port: int) -> str:
    """The deployment YAML for one policy (``name:knob=value+knob=value``) on ``port``."""
    name, _, knobs = policy.partition(":")  # e.g. prism:deadline_admission=false (an ablation)
    knob_yaml = ", ".join(k.replace("=", ": ") for k in knobs.split("+") if k)
    return config_text.replace("PORT", str(port)) + f"policy: {{name: {name}, knobs: {{{knob_yaml}}}}}\n"


def simulate_policy(
    policy: str, config_text: str, workload, rates: list[float], duration: float, gap_s: float, hardware: str
):
    """The sweep of ``run_policy`` in the simulator: one point per rate, as run_policy records them
    (attainments over all models and per model), plus the run's activation counters."""
    from prism_serve.config import parse_config
    from sim_mirror import run_sweep, sim_deployment, sweep_workload

    dep = sim_deployment(parse_config(policy_config(config_text, policy, 8000)), hardware=hardware)
    combined, segments = sweep_workload(workload, rates, duration, list(NAMES), gap_s)
    per_rate, counters = run_sweep(dep, combined, segments)
    points = []
    for p in per_rate:
        stats = p["models"]
        s = stats["(all)"]
        points.append(
            {
                "rate_scale": p["rate_scale"],
                "rate_per_s": s["requests"] / duration,
                "num_requests": s["requests"],
                "ttft_attainment": s["ttft_attainment"],
                "tpot_attainment": s["tpot_attainment"],
                "models": {
                    m: {"ttft_attainment": v["ttft_attainment"], "num_requests": v["requests"],
                        "ttft_p95_s": v["ttft_p95_s"]}
                    for m, v in stats.items() if m != "(all)"
                },
            }
        )  # fmt: skip
        print(
            f"{policy:>16} x{p['rate_scale']:<5g} {s['requests'] / duration:.2f} req/s (simulated): TTFT "
            f"{100 * s['ttft_attainment']:.1f}%  TPOT {100 * s['tpot_attainment']:.1f}%  per model TTFT "
            + ", ".join(f"{m} {100 * v['ttft_attainment']:.0f}%" for m, v in points[-1]["models"].items()),
            flush=True,
        )
    print(f"{policy:>16}: {counters}", flush=True)
    return points, counters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--policies",
        default="prism,static-partition,qlm",
        help="comma-separated; knobs as name:knob=value+knob=value (e.g. prism:deadline_admission=false)",
    )
    ap.add_argument("--rates", default="2,4,6,8,10,12", help="rate scales (x the base rate)")
    ap.add_argument("--base-rate", type=float, default=0.25, help="req/s of all models together at scale 1")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per rate")
    ap.add_argument(
        "--workload-seconds",
        type=float,
        default=720.0,
        help="length of the built workload at scale 1 (fixed, so runs with other rate lists send the same "
        "requests; must be >= duration x the highest rate scale)",
    )
    ap.add_argument("--memory", default="1536MiB", help="budget of each CPU device")
    ap.add_argument("--kv-limit", help="give every model this KV limit, e.g. 96MiB (an ablation)")
    ap.add_argument("--swap-cores", action="store_true", help="cpu:0 on the last core, cpu:1 on the first")
    ap.add_argument(
        "--place",
        help='activate models on these devices before the warm-up, e.g. "cpu:0=syn-360m+smol-c,'
        'cpu:1=smol-a+smol-b+syn-135m" (an ablation: the policy starts from this placement; '
        "static-partition then sets no KV slices, it sizes them only for models it places itself)",
    )
    ap.add_argument(
        "--timeout", type=float, default=60.0, help="client timeout per request, s (counts as a miss)"
    )
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--synthetic-dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="dtype of the two synthetic models; auto: bfloat16 only with AVX512_BF16 or AMX",
    )
    ap.add_argument(
        "--real-dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="dtype of the three real SmolLM2-135M models (float32: what the CPU profiles are fitted on)",
    )
    ap.add_argument(
        "--out", type=Path,
        help="default: docs/figures/live (the recorded live figures), or results/live-eval-sim with --sim "
        "(not tracked: a simulated sweep is regenerated in seconds)",
    )  # fmt: skip
    ap.add_argument(
        "--server-log-level",
        default="warning",
        choices=["debug", "info", "warning"],
        help="info: each activation and its phases in the server log (in a temporary directory, printed)",
    )
    ap.add_argument("--requests", action="store_true", help="also write every request's record per rate")
    ap.add_argument("--sim", action="store_true", help="simulate the sweep instead (writes sim.json)")
    ap.add_argument("--sim-gap", type=float, default=30.0, help="--sim: idle seconds between two rates")
    ap.add_argument(
        "--hardware", default=HARDWARE,
        help="--sim: the devices' profile, a registered name or a profile file fit_cpu_profile.py --write "
        "fitted on this machine",
    )  # fmt: skip
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if args.duration * max(rates) > args.workload_seconds:
        ap.error("--duration x the highest rate scale exceeds --workload-seconds")
    cores = sorted(os.sched_getaffinity(0))
    if args.swap_cores:
        cores.reverse()
    spec = WorkloadSpec(
        models=NAMES,
        source="azure:conv",
        lengths="azure:conv",
        duration_s=args.workload_seconds,
        total_rate=args.base_rate,
        zipf=1.0,
        max_prompt_tokens=args.max_prompt,
        max_output_tokens=args.max_output,
        seed=args.seed,
    )
    workload = build_workload(spec)
    if args.out is None:
        root = Path(__file__).resolve().parents[1]
        args.out = root / ("results/live-eval-sim" if args.sim else "docs/figures/live")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="prism-live-"))
    print(f"configs and server logs in {tmp}")
    config = tmp / "base.yaml"
    # auto: bf16 only where the CPU has bf16 matrix instructions (6x slower without)
    dtype = resolve_dtype(args.synthetic_dtype)
    print(f"synthetic models in {dtype}")
    models = MODELS.replace("dtype: bfloat16", f"dtype: {dtype}")
    real = resolve_dtype(args.real_dtype)
    print(f"SmolLM2-135M-Instruct (real weights) in {real}")
    for name in ("smol-a", "smol-b", "smol-c"):
        models = models.replace(f"{{name: {name},", f"{{name: {name}, dtype: {real},")
    if args.kv_limit:
        models = models.replace("{name:", f"{{kv_limit: {args.kv_limit}, name:")
    config.write_text(
        CONFIG.format(
            memory=args.memory,
            core0=cores[0],
            core1=cores[-1],
            models=models,
            port="PORT",
            namespace=f"live-{uuid.uuid4().hex[:6]}",
        )
    )
    per_model = {m: int((workload.model_index == i).sum()) for i, m in enumerate(workload.models)}
    print(f"workload: {len(workload)} requests over {workload.duration:.0f} s at scale 1 ({per_model})")
    results = {
        "command": " ".join(["python benchmarks/live_eval.py", *sys.argv[1:]]),
        "machine": common.machine_info(),
        "workload": {
            "spec": {
                k: getattr(spec, k)
                for k in (
                    "source",
                    "lengths",
                    "duration_s",
                    "total_rate",
                    "zipf",
                    "max_prompt_tokens",
                    "max_output_tokens",
                    "seed",
                )
            },
            "num_requests": len(workload),
        },
        "config": config.read_text(),
        "duration_s_per_rate": args.duration,
        "place": args.place,
        "client_timeout_s": args.timeout,
        "policies": {},
    }
    if args.sim:
        results["simulated"] = {"hardware": args.hardware, "gap_s": args.sim_gap}
        for policy in args.policies.split(","):
            points, counters = simulate_policy(
                policy, config.read_text(), workload, rates, args.duration, args.sim_gap, args.hardware
            )
            results["policies"][policy] = points
            results["simulated"][policy] = counters
        thresholds = {p: threshold_rate(pts) for p, pts in results["policies"].items()}
        results["threshold_rate_scale_99_ttft"] = thresholds
        (args.out / "sim.json").write_text(json.dumps(results, indent=1) + "\n")
        for p, t in thresholds.items():
            print(f"{p:>16}: highest rate scale with >= 99% TTFT attainment (simulated): {t}")
        return
    for policy in args.policies.split(","):
        results["policies"][policy] = asyncio.run(
            run_policy(
                policy,
                config,
                workload,
                rates,
                args.duration,
                tmp,
                args.place,
                args.timeout,
                args.out if args.requests else None,
                args.server_log_level,
            )
        )
        (args.out / "live.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "live.png")
    thresholds = {p: threshold_rate(pts) for p, pts in results["policies"].items()}
    results["threshold_rate_scale_99_ttft"] = thresholds
    (args.out / "live.json").write_text(json.dumps(results, indent=1) + "\n")
    for p, t in thresholds.items():
        print(f"{p:>16}: highest rate scale with >= 99% TTFT attainment: {t}")
    if thresholds.get("prism") and thresholds.get("static-partition"):
        ratio = thresholds["prism"] / thresholds["static-partition"]
        print(f"prism / static-partition: {ratio:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()
