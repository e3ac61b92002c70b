"""How long ``prism plan`` takes, against the number of models and against the number of requests.

Deployments of N models made by repeating the Prism paper's 58-model mix (preset ``paper-58``: 43
models of 1-3B, 8 of 4-8B, 3 of 9-30B, 4 of 31-70B at TP 4 and 8; synthetic H100s), each model
renamed; traffic from ServeGen's m-large clients (``prism workload``'s builder, one client slice per
model) over ``--duration`` seconds. Every point runs the whole command as a user would
(``prism plan --config C --traffic T --slo-scale 5``: SLO measurement, every policy's search,
reports) in a fresh process and times it.

    python benchmarks/plan_scale.py                                  # the recorded run
    python benchmarks/plan_scale.py --models 58,500 --rates 20       # two points

Two series: models at a fixed total rate (``--rates``' first), and requests (rates) at 58 models.
Prints each point's wall seconds, simulations and CPU seconds per simulation, and the exponents
of time against models and against requests (least squares on the logs).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

import common
from prism_serve.sim.deployment import deployment_config
from prism_serve.workload.builder import WorkloadSpec, build_workload
from prism_serve.workload.format import write_jsonl


def config_of(n: int, folder: Path) -> Path:
    """N models cycling through paper-58's entries (shapes, dtypes, TP), renamed m000, m001, ..."""
    base = deployment_config("paper-58").model_dump(mode="json", exclude_defaults=True)
    models = []
    for i in range(n):
        m = dict(base["models"][i % len(base["models"])])
        m["name"] = f"m{i:03d}-{m['name']}"
        models.append(m)
    path = folder / f"models-{n}.yaml"
    path.write_text(yaml.safe_dump({"devices": base["devices"], "models": models}, sort_keys=False))
    return path


def traffic_of(config: Path, rate: float, duration: float, seed: int, folder: Path) -> tuple[Path, int]:
    names = tuple(m.name for m in deployment_config(config).models)
    spec = WorkloadSpec(names, source="servegen:m-large", duration_s=duration, total_rate=rate, seed=seed)
    workload = build_workload(spec)
    path = folder / f"traffic-{len(names)}-{rate:g}.jsonl"
    write_jsonl(workload, path)
    return path, len(workload)


def plan_point(config: Path, traffic: Path, out: Path, jobs: int | None, confidence: float = 0.9) -> dict:
    cmd = [sys.executable, "-m", "prism_serve.cli", "plan", "--config", str(config), "--traffic",
           str(traffic), "--slo-scale", "5", "--out", str(out), "--confidence", str(confidence)]  # fmt: skip
    cmd += ["--jobs", str(jobs)] if jobs else []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    result = json.loads((out / "results.json").read_text())
    sims = sum(len(p["points"]) for p in result["policies"].values())
    # and the draws of the traffic --confidence ran for the chosen policy
    sure = [p["confidence"] for p in result["policies"].values() if p.get("confidence")]
    draws = sum(c["ran"] for s in sure for c in s["counts"].values())
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "simulations": sims + draws,
            "devices": {k: p["devices"] for k, p in result["policies"].items()},
            "confident_devices": sure[0]["devices"] if sure else None}  # fmt: skip


def exponent(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="58,125,250,500", help="model counts at the first rate")
    ap.add_argument("--rates", default="20,10,40", help="total req/s; the first is the models series'")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--confidence", type=float, default=0.9, help="prism plan --confidence (0: off)")
    ap.add_argument("--out", type=Path, default=Path("results/plan-scale"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    info = common.machine_info()
    print(info["line"], flush=True)
    counts = [int(x) for x in args.models.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    rows = []
    points = [(n, rates[0]) for n in counts] + [(58, r) for r in rates[1:]]
    for n, rate in points:
        config = config_of(n, args.out)
        traffic, requests = traffic_of(config, rate, args.duration, args.seed, args.out)
        r = plan_point(config, traffic, args.out / f"plan-{n}-{rate:g}", args.jobs, args.confidence)
        r.update(models=n, rate=rate, requests=requests)
        rows.append(r)
        print(f"{n} models, {requests} requests ({rate:g} req/s): {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} "
              f"CPU-s, {r['simulations']} simulations, devices {r['devices']}", flush=True)  # fmt: skip
    by_models = [r for r in rows if r["rate"] == rates[0]]
    by_requests = [r for r in rows if r["models"] == 58]
    a = exponent([r["models"] for r in by_models], [r["wall_s"] for r in by_models])
    b = exponent([r["requests"] for r in by_requests], [r["wall_s"] for r in by_requests])
    print("\n| models | requests | wall | CPU seconds | simulations | prism's devices |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['models']} | {r['requests']:,} | {r['wall_s'] / 60:.1f} min | {r['cpu_s']:.0f} | "
              f"{r['simulations']} | {r['devices'].get('prism')} |")  # fmt: skip
    print(f"time ~ models^{a:.2f} at {rates[0]:g} req/s" if a is not None else "")
    print(f"time ~ requests^{b:.2f} at 58 models" if b is not None else "")
    body = {"machine": info["line"], "rows": rows, "models_exponent": a, "requests_exponent": b}
    (args.out / "scale.json").write_text(json.dumps(body, indent=1))


if __name__ == "__main__":
    main()
