"""``prism plan`` checked against live runs, end to end, on this machine's CPU devices.

For each scenario (a multi-model deployment and real-trace traffic for it):

1. ``prism serve`` the scenario's deployment with its request log on, and replay the traffic with
   ``prism bench`` (after one warm-up request per model, as a long-running server has served them;
   ``--from-traffic``: no such run, the generated traffic is planned and replayed);
2. ``prism plan`` that log (the window from the replay's start) on this machine's CPU profile:
   fitted on the spot by ``prism fit-hardware`` at the start of the run, or a profile file given;
3. ``prism serve`` the deployment the plan found (its prism.yaml), replaying the same log with
   ``prism bench``; and again with one device less (at one device: one memory budget step less).

Printed for every deployment tried: the planned attainment (the simulator, run to the end) against
the live one (``prism bench``'s, against each model's SLO from the server's /v1/models). Targets:
live attainment at the planned deployment >= the target minus 1 point; planned and live within 3
points at every deployment tried.

    python benchmarks/plan_live.py --out results/plan-live                  # every scenario (~50 min)
    python benchmarks/plan_live.py --rate-scales 0.7,1,1.3,1.5 --out results/plan-grid   # the grid
    python benchmarks/plan_live.py --scenarios three --duration 60 --out /tmp/pl   # a quick look
    python benchmarks/plan_live.py --plan-only --out /tmp/pl   # plan the generated traffic, no server

Needs two cores or more (two one-core devices). Writes, per scenario, the configs, the request
logs, each prism bench report and the plan's outputs under ``--out``, and summary.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import yaml

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process
from prism_serve.config import DeploymentConfig, load_config, parse_size
from prism_serve.sim.plan import with_expected_rates
from prism_serve.workload.builder import WorkloadSpec, build_workload
from prism_serve.workload.format import write_jsonl
from prism_serve.workload.traffic import TrafficOptions, read_traffic

PRISM = [sys.executable, "-m", "prism_serve.cli"]
REAL = "smollm2-135m-instruct"
# one warm-up request per model before each replay, as a long-running server has served them
WARMUP_PROMPT, WARMUP_TOKENS = [1000, 1001, 1002], 2


@dataclass(slots=True, frozen=True)
class Scenario:
    description: str
    models: tuple[tuple[str, str], ...]  # (name, source); fp32, the dtype the CPU profile is fitted in
    memory: str  # each device's budget
    source: str  # arrivals (workload/builder.py)
    lengths: str
    total_rate: float  # req/s of all models together
    zipf: float
    policy: str = "static-partition"  # what the first, logged run serves with
    ttft_slo: float = 3.0
    tpot_slo: float = 0.5
    knobs: dict = field(default_factory=dict)
    max_prompt: int = 256
    max_output: int = 48
    seed: int = 0


SCENARIOS = {
    "three": Scenario(
        "3 copies of SmolLM2-135M, Azure conversation arrivals and lengths, Zipf 1.0, all fit on a device",
        tuple((f"smol-{c}", REAL) for c in "abc"), "2GiB", "azure:conv", "azure:conv", 0.6, 1.0,
    ),
    "five-tight": Scenario(
        "5 copies of SmolLM2-135M, Zipf 1.5 (one hot, four cold), 1536 MiB devices: two models a device "
        "at once, so cold models swap in; idle models may go after 10 s",
        tuple((f"smol-{c}", REAL) for c in "abcde"), "1536MiB", "azure:conv", "azure:conv", 0.6, 1.5,
        policy="prism", knobs={"idle_threshold_s": 10.0},
    ),
    "shapes": Scenario(
        "4 model shapes (the real SmolLM2-135M; synthetic SmolLM2-360M, Qwen2.5-0.5B and Qwen3-0.6B "
        "weights), Azure conversation arrivals and lengths, Zipf 0.8, 2.5 GiB devices: about two models "
        "a device at once, so models swap in and out",
        (("smol-135m", REAL), ("syn-360m", "random:smollm2-360m"), ("syn-qwen2.5", "random:qwen2.5-0.5b"),
         ("syn-qwen3", "random:qwen3-0.6b")),
        "2560MiB", "azure:conv", "azure:conv", 0.15, 0.8, policy="prism", ttft_slo=6.0, tpot_slo=0.6,
        knobs={"idle_threshold_s": 10.0}, max_prompt=192, max_output=32,
    ),
    "mixed": Scenario(
        "2 copies of SmolLM2-135M and 2 synthetic-weight models (SmolLM2-360M and -135M shapes), Azure code "
        "arrivals and lengths, Zipf 0.8",
        (("smol-a", REAL), ("smol-b", REAL), ("syn-360m", "random:smollm2-360m"),
         ("syn-135m", "random:smollm2-135m")),
        "2GiB", "azure:code", "azure:code", 0.3, 0.8,
    ),
}  # fmt: skip


def config_dict(s: Scenario, devices: int, memory: str, policy: str, knobs: dict | None = None) -> dict:
    return {
        "devices": [{"name": f"cpu:{i}", "memory": memory, "cores": str(i)} for i in range(devices)],
        "models": [
            {"name": n, "source": src, "dtype": "float32", "ttft_slo": s.ttft_slo, "tpot_slo": s.tpot_slo}
            for n, src in s.models
        ],
        "policy": {"name": policy, "knobs": dict(knobs if knobs is not None else s.knobs)},
        "server": {"max_waiting_requests": 1024, "request_timeout_s": 300},
    }


def prism(*args: str, log: Path | None = None) -> str:
    """Run a prism command; its stdout (stderr to ``log`` where given). Raises on failure."""
    with open(log, "w") if log else open(os.devnull, "w") as err:
        done = subprocess.run([*PRISM, *args], stdout=subprocess.PIPE, stderr=err, text=True)
    if done.returncode != 0:
        raise SystemExit(f"prism {' '.join(args)} failed ({done.returncode}); see {log}")
    return done.stdout


def wait_idle(port: int, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        cards = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
        if all(c.get("num_running", 0) == 0 and c.get("num_queued", 0) == 0 for c in cards):
            return
        time.sleep(1)


def live(config: dict, traffic: Path, start_s: float, folder: Path, tag: str, log: bool) -> dict:
    """A fresh ``prism serve`` of ``config``: one warm-up request per model, then ``prism bench``
    replaying ``traffic`` from ``start_s``. Returns bench's summary, the wall time the replay started
    at and (``log``) the request log's path."""
    port = free_port()
    data = json.loads(json.dumps(config))
    data["server"].update(port=port, namespace=f"planlive-{uuid.uuid4().hex[:8]}")
    request_log = folder / f"requests-{tag}.log"
    if log:
        data["server"]["request_log"] = str(request_log)
    path = folder / f"serve-{tag}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = start_server_process(path, port, folder / f"server-{tag}.log")
    try:
        warm = []  # (wall clock at the send, model): the planned run serves the same warm-up first
        for m in data["models"]:
            body = {"model": m["name"], "prompt": WARMUP_PROMPT, "max_tokens": WARMUP_TOKENS}
            body["ignore_eos"] = True
            warm.append((time.time(), m["name"]))
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300).raise_for_status()
        time.sleep(1.0)
        before = activation_stats(port)  # the warm-up's activations, left out
        start = time.time()
        load = common.cpu_seconds()
        cpu_before, bench_before = process_cpu(proc.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
        prism(
            "bench", "--workload", str(traffic), "--start", f"{start_s:.3f}", "--prompt", "ids",
            "--url", f"http://127.0.0.1:{port}", "--out", str(folder / f"bench-{tag}"), "--no-progress",
            "--timeout", "300", log=folder / f"bench-{tag}.log",
        )  # fmt: skip
        wall = time.time() - start
        cpu_after, bench_after = process_cpu(proc.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
        wait_idle(port)
        activations = activation_stats(port, before)
    finally:
        stop_server_process(proc)
    server_s = cpu_after["server"] - cpu_before["server"]
    workers_s = sum(v - cpu_before.get(k, 0.0) for k, v in cpu_after.items() if k != "server")
    bench_s = sum(getattr(bench_after, f) - getattr(bench_before, f) for f in ("ru_utime", "ru_stime"))
    body = json.loads((folder / f"bench-{tag}" / "bench.json").read_text())
    return {
        # each warm-up's send, in seconds from the replay's start (so negative), and its model
        "warmup": [(round(t - body["started_unix"], 3), m) for t, m in warm],
        "overall": body["overall"],
        "models": body["models"],
        "replay_start": start,
        "wall_s": round(wall, 1),
        "other_load_cores": round(max(0.0, common.other_load_since(load, wall) - 2.0), 2),
        # cores kept busy during the replay: the server's own process (HTTP, tokenizer, controller
        # ticks), its workers (the engines), and prism bench (the client), on the same two cores
        "cores": {
            "server": round(server_s / wall, 3),
            "workers": round(workers_s / wall, 3),
            "bench": round(bench_s / wall, 3),
        },
        "request_log": str(request_log) if log else None,
        "activations": activations,
    }


def activation_stats(port: int, since: dict | None = None) -> dict[str, dict]:
    """Per model, the server's activations (prism_activation_seconds: the worker's phases from its
    memory's grant to a ready engine), their summed seconds and each phase's, less those of ``since``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "prism_activation_seconds_count":
                key = "count"
            elif sample.name == "prism_activation_seconds_sum":
                key = "sum_s"
            elif family.name == "prism_activation_phase_seconds":
                key = f"{sample.labels['phase']}_s"
            else:
                continue
            entry = out.setdefault(sample.labels["model_name"], {})
            entry[key] = entry.get(key, 0.0) + sample.value
    for m, v in (since or {}).items():
        out[m] = {k: x - v.get(k, 0.0) for k, x in out[m].items()}
    return {m: v for m, v in out.items() if v.get("count", 0) > 0}


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server process (``server``) and of each of its descendants (by pid)."""
    import psutil

    root = psutil.Process(pid)
    out = {"server": sum(root.cpu_times()[:2])}
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            out[str(child.pid)] = sum(child.cpu_times()[:2])
    return out


def planned(config: Path, traffic: Path, start_s: float, hardware: str, devices: int, policy: str,
            memory: str | None = None, warmup: Sequence[tuple[float, str]] = ()) -> dict:  # fmt: skip
    """The simulator's attainment for ``config`` on ``devices`` devices of ``hardware`` (the profile
    the plan ran on: its memory is the config's budget), run to its end; ``memory``: another budget.
    ``warmup``: the live run's warm-up requests, (seconds from the replay's start, model), served
    first and left out of the result, as the live run served them before its replay."""
    from prism_serve.sim.deployment import deployment_config, sim_deployment
    from prism_serve.sim.hardware import dump_hardware, get_hardware
    from prism_serve.sim.plan import simulate_point
    from prism_serve.workload.format import Workload, WorkloadRequest

    dep = sim_deployment(deployment_config(config), gpu=False)
    names = [m.name for m in dep.models]
    wl = read_traffic(traffic, names, TrafficOptions(start_s=start_s)).workload
    if warmup:
        first = float(wl.timestamps[0])  # the replay's start (prism bench sends its first request then)
        shift = max(0.0, -min(first + t for t, _ in warmup))
        front = [WorkloadRequest(first + t + shift, m, len(WARMUP_PROMPT), WARMUP_TOKENS) for t, m in warmup]
        rest = [dataclasses.replace(r, timestamp=r.timestamp + shift) for r in wl.rows()]
        wl = Workload.from_rows(front + rest, names)
    if memory is not None:  # a profile with this device memory, as a file the simulator reads
        hw = dataclasses.replace(get_hardware(hardware), memory_bytes=parse_size(memory))
        hardware = str(config.parent / f"hardware-{memory}.json")
        dump_hardware(hw, Path(hardware))
    return simulate_point(
        dep, wl, hardware=hardware, policy=policy, devices=devices, warmup=len(warmup), per_request=True
    )


def per_request(sim: dict, bench: Path, slos: dict[str, float], out: Path) -> dict:
    """The planned run's requests beside the live run's, in arrival order (the same traffic): each
    one's model, arrival, TTFT and (planned) cold start, written to ``out`` as JSON lines; returns
    how many met their TTFT SLO (``slos``, per model) in one run and not in the other."""
    live = sorted(json.loads(bench.read_text())["requests"], key=lambda r: r["scheduled_s"])
    rows, only = [], {"planned": 0, "live": 0}
    for p, r in zip(sim["requests"], live, strict=False):
        if p["model"] != r["model"]:
            raise SystemExit(
                f"{out}: planned and live requests differ in order ({p['model']} / {r['model']})"
            )
        met = {
            k: t is not None and t <= slos[p["model"]]
            for k, t in (("planned", p["ttft_s"]), ("live", r["ttft_s"] if r["error"] is None else None))
        }
        only["planned"] += met["planned"] and not met["live"]
        only["live"] += met["live"] and not met["planned"]
        rows.append({"model": p["model"], "arrival_s": round(r["scheduled_s"], 3),
                     "planned_ttft_s": p["ttft_s"], "planned_cold": p["cold"],
                     "live_ttft_s": r["ttft_s"]})  # fmt: skip
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"met_planned_only": only["planned"], "met_live_only": only["live"], "requests": len(rows)}


LATENCIES = ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s")  # compared per model


def points(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def cell(name: str, scale: float) -> str:
    """A scenario at a load: its folder under --out and its key in summary.json."""
    return name if scale == 1.0 else f"{name}@{scale:g}"


def run_scenario(name: str, s: Scenario, args: argparse.Namespace, hardware: str, scale: float) -> dict:
    folder = args.out / cell(name, scale)
    folder.mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec(
        models=tuple(n for n, _ in s.models), source=s.source, lengths=s.lengths, duration_s=args.duration,
        total_rate=s.total_rate * scale, zipf=s.zipf, max_prompt_tokens=s.max_prompt,
        max_output_tokens=s.max_output, seed=s.seed,
    )  # fmt: skip
    generated = folder / "traffic.jsonl"
    write_jsonl(build_workload(spec), generated)
    # what the plan is asked to deploy: the scenario's models and SLOs under prism, on this machine
    plan_config = folder / "prism.yaml"
    plan_config.write_text(yaml.safe_dump(config_dict(s, 2, s.memory, "prism"), sort_keys=False))
    keys = ("source", "lengths", "duration_s", "total_rate", "zipf")
    out: dict = {"description": s.description, "rate_scale": scale}
    out["workload"] = {k: getattr(spec, k) for k in keys}
    if args.plan_only or args.from_traffic:
        traffic, start = generated, 0.0
    else:
        print(f"[{name}] serving the deployment ({s.policy}, 2 devices) with its request log", flush=True)
        first = live(config_dict(s, 2, s.memory, s.policy), generated, 0.0, folder, "logged", log=True)
        traffic = Path(first["request_log"])
        arrivals = [json.loads(line)["arrival"] for line in traffic.read_text().splitlines()]
        start = max(0.0, first["replay_start"] - 0.5 - min(arrivals))  # the warm-up left out
        out["logged_run"] = {"policy": s.policy, "devices": 2, "live": first["overall"]["ttft_attainment"]}
    plan_dir = folder / "plan"
    printed = prism(
        "plan", "--config", str(plan_config), "--traffic", str(traffic), "--start", f"{start:.3f}",
        "--hardware", hardware, "--policies", "prism", "--target", str(args.target), "--max-devices", "2",
        "--jobs", "2", "--out", str(plan_dir), "--confidence", str(args.confidence),
        *(() if args.expected_rates else ("--no-expected-rates",)), log=folder / "plan.log",
    )  # fmt: skip
    (folder / "plan.txt").write_text(printed)
    result = json.loads((plan_dir / "results.json").read_text())
    chosen = result["policies"]["prism"]
    sure = chosen["confidence"]
    # the count the plan tells the user to deploy: with --confidence, the confident one
    answer = chosen["devices"] if sure is None else sure["devices"]
    out["plan"] = {
        "devices": answer, "on_the_traffic_given": chosen["devices"],
        "points": {n: p["ttft_attainment"] for n, p in chosen["points"].items()},
        "confidence": None if sure is None else {
            "level": sure["level"], "seeds": sure["seeds"],
            "passed": {n: f"{c['passed']} of {c['ran']}" for n, c in sure["counts"].items()},
        },
    }  # fmt: skip
    if answer is None:  # beyond this machine: compare at the most devices it has, and one less
        print(f"[{name}] no count up to 2 devices meets {args.target}; comparing at 2 and 1")
        deployed = config_dict(s, 2, s.memory, "prism")
        deployed["devices"] = [dict(d, memory=parse_size(d["memory"])) for d in deployed["devices"]]
        if args.expected_rates:  # as the plan simulated it (what its prism.yaml would have said)
            wl = read_traffic(traffic, [n for n, _ in s.models], TrafficOptions(start_s=start)).workload
            told, _ = with_expected_rates(DeploymentConfig.model_validate(deployed), wl)
            deployed = told.model_dump(mode="json")
        tries = [("most-2", 2, None), ("less-1", 1, None)]
    else:
        deployed = load_config(plan_dir / "prism.yaml").model_dump(mode="json")
        tries = [(f"plan-{answer}", answer, None)]
        if answer > 1:
            tries.append((f"less-{answer - 1}", answer - 1, None))
        else:  # one device: one memory budget step less (a quarter of the budget)
            tries.append(("less-memory", 1, f"{int(parse_size(s.memory) * 0.75) >> 20}MiB"))
    out["deployments"] = []
    served = folder / "deployed.yaml"  # what is served, and simulated as planned
    served.write_text(yaml.safe_dump(deployed, sort_keys=False))
    for tag, n, memory in tries:
        # the profile prism plan ran on (written there: the CPU profile with the config's budget)
        profile = str(plan_dir / "hardware.json")
        sim = planned(served, traffic, start, profile, n, "prism", memory)
        row = {"tag": tag, "devices": n, "memory": memory or s.memory, "planned": sim["ttft_attainment"]}
        if not args.plan_only:
            config = dict(deployed, devices=deployed["devices"][:n])
            if memory is not None:
                config["devices"] = [dict(d, memory=parse_size(memory)) for d in config["devices"]]
            print(f"[{name}] serving {tag}: {n} device(s) of {row['memory']}", flush=True)
            run = live(config, traffic, start, folder, tag, log=False)
            # what the live run served: its warm-up requests first (recently used models are not
            # idle to the policy), then the replay; the plan's own figure starts from no history
            row["planned_fresh"], row["warmup"] = row["planned"], run["warmup"]
            sim = planned(served, traffic, start, profile, n, "prism", memory, run["warmup"])
            row["planned"] = sim["ttft_attainment"]
            # request by request: which met their SLO in one run and not the other
            slos = {m["name"]: m["ttft_slo"] for m in deployed["models"]}
            bench = folder / f"bench-{tag}" / "bench.json"
            row["per_request"] = per_request(sim, bench, slos, folder / f"per-request-{tag}.jsonl")
            row.update(live=run["overall"]["ttft_attainment"], wall_s=run["wall_s"],
                       other_load_cores=run["other_load_cores"], cores=run["cores"],
                       per_model={m: v["ttft_attainment"] for m, v in run["models"].items()})  # fmt: skip
            # model by model, the simulator's latencies against the live run's
            row["latency_error"] = {
                m: {k: sim["per_model"][m][k] / v[k] - 1 for k in LATENCIES
                    if v.get(k) and sim["per_model"].get(m, {}).get(k) is not None}
                for m, v in run["models"].items()
            }  # fmt: skip
            # model by model, the simulator's activations (count, mean seconds) against the live run's
            acts = run["activations"]
            row["activations"] = {
                m: {"live": [acts[m]["count"], acts[m]["sum_s"] / acts[m]["count"]] if m in acts
                    else [0, None],
                    "planned": [v.get("activations", 0), v.get("activation_mean_s")]}
                for m, v in sorted(sim["per_model"].items()) if m in acts or v.get("activations")
            }  # fmt: skip
        out["deployments"].append(row)
        print(f"[{name}] {tag}: planned {points(row['planned'])}, live {points(row.get('live'))}, "
              f"{row.get('per_request', {})}, "
              f"cores {row.get('cores')}", flush=True)  # fmt: skip
    return out


def with_swaps(hardware: str, name: str, s: Scenario, out: Path) -> str:
    """The fitted profile with the scenario's models activated by the runtime in its device budget
    (sim/activations.py), as `prism plan --hardware fit` measures them for a config; its file."""
    from prism_serve.sim.activations import with_activations
    from prism_serve.sim.fit import FitResult
    from prism_serve.sim.hardware import dump_hardware, get_hardware
    from prism_serve.sim.shapes import shape_of

    shapes = {src: shape_of(src, src, 4) for _, src in s.models}  # fp32, as the scenarios serve them
    result = with_activations(
        FitResult(get_hardware(hardware), 0.0, [], None), shapes, memory=parse_size(s.memory)
    )
    print(f"[{name}] " + result.notes[-1], flush=True)
    path = out / f"cpu-fitted-{name}.json"
    dump_hardware(result.profile, path)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {', '.join(SCENARIOS)}")
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of traffic per scenario")
    ap.add_argument(
        "--rate-scales", "--rate-scale", default="1", type=lambda v: [float(x) for x in v.split(",") if x],
        help="times every scenario's rate, one run of every scenario per value (the grid: 0.7,1,1.3,1.5)",
    )  # fmt: skip
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--hardware", default="fit", help="a CPU profile (name or file), or fit: fit one first")
    ap.add_argument("--confidence", type=float, default=0.9, help="prism plan --confidence (0: off)")
    ap.add_argument("--plan-only", action="store_true", help="plan the generated traffic; serve nothing")
    ap.add_argument(
        "--from-traffic", action="store_true",
        help="plan the generated traffic and replay it, without the logged run first (a third less time)",
    )  # fmt: skip
    ap.add_argument(
        "--no-expected-rates", dest="expected_rates", action="store_false",
        help="prism plan --no-expected-rates: the deployment starts with no expected rate per model",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores (two one-core CPU devices)")
    args.out.mkdir(parents=True, exist_ok=True)
    info = common.machine_info()
    print(info["line"], flush=True)
    hardware = args.hardware
    if hardware == "fit":
        hardware = str(args.out / "cpu-fitted.json")
        print("fitting this machine's CPU profile (prism fit-hardware)", flush=True)
        # with the held-out steps of every model shape the scenarios serve (their errors join the
        # profile's step errors, which the plan's --confidence draws from)
        sources = dict.fromkeys(src for n in args.scenarios.split(",") for _, src in SCENARIOS[n].models)
        prism(
            "fit-hardware", "--out", hardware, "--shapes", ",".join(sources), "--no-activations",
            log=args.out / "fit.log",
        )  # fmt: skip
        # each scenario's swaps, in its own device budget, as `prism plan --hardware fit` measures them
        profiles = {n: with_swaps(hardware, n, SCENARIOS[n], args.out) for n in args.scenarios.split(",")}
    else:
        profiles = dict.fromkeys(args.scenarios.split(","), hardware)
    summary = {"machine": info["line"], "date": time.strftime("%Y-%m-%d"), "hardware": hardware,
               "target": args.target, "scenarios": {}}  # fmt: skip
    for scale in args.rate_scales:
        for name in args.scenarios.split(","):
            result = run_scenario(name, SCENARIOS[name], args, profiles[name], scale)
            summary["scenarios"][cell(name, scale)] = result
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{info['line']}; profile {hardware}; target {args.target:.0%}; confidence {args.confidence}")
    print("| scenario | load | deployment | planned | live | live - planned |")
    print("|---|---|---|---|---|---|")
    diffs = []
    for key, sc in summary["scenarios"].items():
        for row in sc.get("deployments", []):
            diff = None if row.get("live") is None else 100 * (row["live"] - row["planned"])
            diffs += [] if diff is None else [diff]
            what = f"{row['devices']} x {row['memory']}"
            what += " (the plan)" if row["tag"].startswith("plan") else ""
            print(f"| {key.split('@')[0]} | {sc['rate_scale']:g}x | {what} | {points(row['planned'])} | "
                  f"{points(row.get('live'))} | {'' if diff is None else f'{diff:+.1f}'} |")  # fmt: skip
    if diffs:
        worst = max(diffs, key=abs)
        within = sum(abs(d) <= 3.0 for d in diffs)
        bias = sum(diffs) / len(diffs)
        summary["error"] = {"bias": bias, "worst": worst, "within_3": within, "n": len(diffs)}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"live - planned, points: mean (bias) {bias:+.2f}, worst {worst:+.1f}, "
              f"within 3 points at {within} of {len(diffs)} deployments")  # fmt: skip
    errors = [
        (e, f"{key} {row['tag']} {m} {k}")
        for key, sc in summary["scenarios"].items() for row in sc.get("deployments", [])
        for m, by in row.get("latency_error", {}).items() for k, e in by.items()
    ]  # fmt: skip
    if errors:
        summary["latency_error"] = {k: [e for e, what in errors if what.endswith(k)] for k in LATENCIES}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print("simulated / live - 1, per model and deployment:")
        for k in LATENCIES:
            es = np.array(summary["latency_error"][k])
            if len(es):
                print(f"  {k}: median |error| {np.median(np.abs(es)):.1%}, mean {es.mean():+.1%}, "
                      f"within 10% at {int((np.abs(es) <= 0.10).sum())} of {len(es)}")  # fmt: skip
        e, what = max(errors, key=lambda x: abs(x[0]))
        print(f"  worst: {what} {e:+.1%}")
    print(f"written: {args.out}/summary.json")


if __name__ == "__main__":
    main()
