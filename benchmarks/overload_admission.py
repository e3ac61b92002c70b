"""Admission under overload: how many requests still meet their TTFT SLO when a device is asked for
more than it can serve? Simulated (synthetic H100 profile, the control loop the live server runs):
2 x Llama-3.1-8B on one device, ServeGen m-large lengths, three streams of Poisson arrivals
(``--arrivals trace``: the trace's own, bursty), all of the standard class.

First the capacity C: the highest total rate on a grid (``--step``) at which prism meets
``--target`` TTFT attainment. Then each load in ``--loads`` (multiples of C), twice in the same run:
prism as it is, and with ``lateness_margin=false`` (the deadline schedule checks the prefill it
predicts, not how late first tokens have come after it: the paper's Algorithm 2 alone). Prints each
one's TTFT attainment, the requests asked and served in time per second, and the ratio of the two
attainments.

    python benchmarks/overload_admission.py
    python benchmarks/overload_admission.py --arrivals trace --window 600
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import common
from prism_serve.sim import ModelSLO, ServedModel, SimConfig, model_shape, simulate
from tenant_share import MODELS, merged, stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=300.0, help="seconds of traffic per run")
    ap.add_argument("--source", default="servegen:m-large")
    ap.add_argument("--arrivals", choices=("poisson", "trace"), default="poisson")
    ap.add_argument("--trace-start", type=float, default=86400.0 + 10 * 3600.0)
    ap.add_argument("--step", type=float, default=0.5, help="capacity grid step, req/s")
    ap.add_argument("--grid", type=int, default=60)
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--loads", default="1,1.5,2,3", help="multiples of the capacity")
    ap.add_argument("--ttft", type=float, default=1.0, help="TTFT SLO, s")
    ap.add_argument("--tpot", type=float, default=0.2, help="TPOT SLO, s")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    print(common.machine_info()["line"])
    print(f"simulated: synthetic H100 profile, 2 x Llama-3.1-8B, one device; {args.source} lengths, "
          f"{args.arrivals} arrivals, {args.window:.0f} s windows; "
          f"SLOs {args.ttft} s TTFT, {args.tpot} s TPOT")  # fmt: skip
    start = time.monotonic()
    models = [ServedModel(m, model_shape("llama-3.1-8b"), 1) for m in MODELS]
    slos = {m: ModelSLO(args.ttft, args.tpot) for m in MODELS}

    def run(rate: float, margin: bool = True) -> dict:
        parts = [stream(args, rate / 3, ("", "standard"), seed) for seed in range(3)]
        knobs = {} if margin else {"lateness_margin": False}
        cfg = SimConfig(num_devices=1, drain_s=3600.0, knobs=knobs)
        s = simulate(models, merged(*parts), slos, cfg).summary()
        in_time = s["ttft_attainment"] * s["num_judged"]
        return {
            "ttft": s["ttft_attainment"],
            "offered_per_s": s["num_judged"] / args.window,  # the streams' own rate (trace arrivals
            "in_time_per_s": in_time / args.window,  # keep their windows' counts, not the nominal)
        }

    capacity = 0.0
    for k in range(1, args.grid + 1):
        if run(k * args.step)["ttft"] < args.target:
            break
        capacity = k * args.step
    if capacity == 0:
        raise SystemExit("no rate on the grid meets the target: lower --step")
    print(f"capacity C = {capacity:.1f} req/s (prism meets {args.target:.0%} TTFT attainment)\n")
    print(f"{'load':>6} {'asked/s':>7} | {'prism':>8} {'in time/s':>9} | "
          f"{'no margin':>9} {'in time/s':>9} | ratio")  # fmt: skip
    out: dict = {"machine": common.machine_info()["line"], "capacity_req_s": capacity, "loads": {}}
    for x in (float(v) for v in args.loads.split(",")):
        rate = x * capacity
        with_margin, without = run(rate), run(rate, margin=False)
        ratio = with_margin["ttft"] / without["ttft"] if without["ttft"] else float("inf")
        out["loads"][f"{x:g}"] = {"rate": rate, "prism": with_margin, "no_margin": without, "ratio": ratio}
        a, b = with_margin, without
        print(f"{x:>5g}x {a['offered_per_s']:>7.1f} | {a['ttft']:>8.2%} {a['in_time_per_s']:>9.1f} | "
              f"{b['ttft']:>9.2%} {b['in_time_per_s']:>9.1f} | {ratio:.2f}x")  # fmt: skip
    print(f"\n{time.monotonic() - start:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
