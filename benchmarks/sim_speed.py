"""How fast the simulator runs: one hour of the 58-model workload on 32 simulated H100s.

Target: <= 60 s of wall time per policy on this machine (with compute sharing on). Prints the
workload size, the wall time of building it, of measuring SLOs, and of each policy's simulation,
with the other load (cores other processes kept busy meanwhile; see common.py). Nothing is asserted.

    python benchmarks/sim_speed.py [--duration 3600] [--total-rate 20] [--policies prism,muxserve]
"""

from __future__ import annotations

import argparse
import time

from common import cpu_seconds, machine_info, other_load_since, wait_quiet
from prism_serve.sim.deployment import get_setup
from prism_serve.sim.simulator import SimConfig, simulate
from prism_serve.sim.slo import measure_slos, scale_slos
from prism_serve.workload.builder import WorkloadSpec, build_workload

TARGET_S = 60.0


def timed(fn):
    wait_quiet(30.0, 0.15)
    start = cpu_seconds()
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    return out, wall, other_load_since(start, wall)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--total-rate", type=float, default=20.0)
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--policies", default="prism,muxserve,static-partition,qlm")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(machine_info()["line"])
    models = get_setup("paper-58")
    spec = WorkloadSpec(
        tuple(m.name for m in models), duration_s=args.duration, total_rate=args.total_rate, seed=args.seed
    )
    w, wall, load = timed(lambda: build_workload(spec))
    print(
        f"workload: {len(w)} requests, {len(w.models)} models, {args.duration:.0f} s  (built in {wall:.1f} s)"
    )
    config = SimConfig(num_devices=args.gpus)
    slos, wall, load = timed(lambda: measure_slos(models, w, config))
    print(f"SLO measurement (58 dedicated runs): {wall:.1f} s wall, other load {load:.2f} cores")
    rows = []
    for p in args.policies.split(","):
        cfg = SimConfig(num_devices=args.gpus, policy=p)
        res, wall, load = timed(lambda cfg=cfg: simulate(models, w, scale_slos(slos, 5.0), cfg))
        s = res.summary()
        verdict = "PASS" if wall <= TARGET_S else "MISS"
        print(
            f"{p:>18}: {wall:6.1f} s wall for {s['simulated_s']:.0f} simulated s "
            f"({s['simulated_s'] / wall:5.1f}x real time), {len(w) / wall:7.0f} req/s simulated, "
            f"other load {load:.2f} cores  [{verdict} <= {TARGET_S:.0f} s]  "
            f"TTFT att {s['ttft_attainment']:.3f}"
        )
        rows.append({"policy": p, "wall_s": wall, "other_load": load, **s})


if __name__ == "__main__":
    main()
