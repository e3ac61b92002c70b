"""What coalescing the placements after finished activations saves in a simulation, and what it
changes: one count of a large deployment simulated with ``placement_coalesce_s`` 0 (a placement
after every finished activation, the default) and at ``--coalesce`` (0.1 s), in one process, one
after the other.

Deployments as benchmarks/plan_scale.py makes them (paper-58's mix repeated and renamed, ServeGen
m-large traffic, SLOs 5x each model's P95 alone on a simulated H100). Prints each run's CPU seconds,
placements (at ticks and after activations), finished activations and TTFT/TPOT attainment, and the
ratio of the CPU seconds.

    python benchmarks/placement_coalesce.py                       # 500 models, 28 devices, 600 s
    python benchmarks/placement_coalesce.py --models 58 --devices 17 --duration 3600
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import common
from plan_scale import config_of, traffic_of
from prism_serve.sim.deployment import deployment_config, sim_deployment
from prism_serve.sim.plan_cli import _measured_slos
from prism_serve.sim.simulator import Simulator
from prism_serve.workload.traffic import TrafficOptions, read_traffic


def run(dep, workload, devices: int, coalesce: float) -> dict:
    config = dataclasses.replace(dep.sim_config(devices, "h100", "prism"), placement_coalesce_s=coalesce)
    sim = Simulator(dep.models, workload, dep.slos, config)
    calls = {"tick": 0, "after activations": 0}
    place, tick = sim.loop.place, sim.loop.tick

    def counted_place(now: float) -> None:
        calls["after activations"] += 1
        place(now)

    def counted_tick(now: float) -> None:
        calls["tick"] += 1
        tick(now)

    # without coalescing the loop places from activation_done itself (its own place())
    sim.loop.place, sim.loop.tick = counted_place, counted_tick
    start = time.process_time()
    summary = sim.run().summary()
    cpu = time.process_time() - start
    return {
        "placement_coalesce_s": coalesce, "cpu_s": round(cpu, 1), "placements": calls,
        "activations": int(sim.counters["activations"]),
        "ttft_attainment": summary["ttft_attainment"], "tpot_attainment": summary["tpot_attainment"],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=500)
    ap.add_argument("--devices", type=int, default=28)
    ap.add_argument("--rate", type=float, default=20.0, help="total req/s")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--coalesce", type=float, default=0.1, help="placement_coalesce_s against 0")
    ap.add_argument("--out", type=Path, default=Path("results/placement-coalesce"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    info = common.machine_info()
    print(info["line"], flush=True)
    config = config_of(args.models, args.out)
    path, requests = traffic_of(config, args.rate, args.duration, args.seed, args.out)
    dep = sim_deployment(deployment_config(config))
    workload = read_traffic(path, [m.name for m in dep.models], TrafficOptions()).workload
    dep = _measured_slos(dep, workload, "h100", 5.0, None)
    print(f"{args.models} models, {requests} requests over {args.duration:g} s, {args.devices} devices")
    rows = [run(dep, workload, args.devices, c) for c in (0.0, args.coalesce)]
    for r in rows:
        print(json.dumps(r), flush=True)
    before, after = rows
    ratio = after["cpu_s"] / before["cpu_s"]
    ttft = f"{100 * after['ttft_attainment']:.2f}% against {100 * before['ttft_attainment']:.2f}%"
    print(f"CPU seconds, coalesced / at once: {ratio:.2f}x; TTFT attainment {ttft}")
    body = {"machine": info["line"], "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    (args.out / "coalesce.json").write_text(json.dumps(body, indent=1))


if __name__ == "__main__":
    main()
