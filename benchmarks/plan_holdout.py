"""Does a plan hold on the traffic that comes next? ``prism plan`` on one window of a real trace, then
the count it answered simulated on the next window of the same trace (traffic it never saw), for
the plain answer and for the ``--confidence`` answer (simulated, synthetic H100 profile).

Each split ``i`` takes two adjacent windows of ``--window`` seconds from ServeGen's per-client
trace (each model one client, ``prism workload``'s builder; the splits' window pairs do not overlap,
``--gap`` seconds apart): the plan sees the first (``prism plan``'s search for prism, SLOs 5x each
model's P95 alone measured on that window, then ``--confidence`` over ``--seeds`` draws of it), and
both counts are then simulated on the second, with the same SLOs, run to the end. Both windows are
scaled to ``--rate`` req/s in all, so what differs is the trace itself: which models are asked for,
their bursts, their lengths, not a trend in the total load that no plan could know.

Prints per split the two counts and their attainment on the next window, then how many splits each
count met the target on (the point of ``--confidence``: at 0.9, about 9 in 10), and the devices
each costs on average.

    python benchmarks/plan_holdout.py                              # 8 splits of 30 minutes, paper-8
    python benchmarks/plan_holdout.py --splits 3 --window 600      # a quick look
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import common
from prism_serve.sim.deployment import deployment_config, sim_deployment
from prism_serve.sim.plan import passed, plan, simulate_point
from prism_serve.sim.plan_cli import _measured_slos
from prism_serve.workload.builder import WorkloadSpec, build_workload

DAY_S = 86400.0


def window(names: tuple[str, ...], start: float, args: argparse.Namespace, seed: int):
    spec = WorkloadSpec(names, source=args.source, duration_s=args.window, start_s=start,
                        total_rate=args.rate, seed=seed)  # fmt: skip
    return build_workload(spec)


def _at(row: dict, n: int | None) -> str:
    """A count and its attainment on the next window."""
    got = row["next"].get(n)
    if got is None:
        return "-"
    return f"{n} ({100 * got['ttft_attainment']:.2f}%{'' if got['met'] else ', missed'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", default="paper-8", help="a preset or a prism.yaml")
    ap.add_argument("--source", default="servegen:m-large", help="a ServeGen pool (per-client windows)")
    ap.add_argument("--splits", type=int, default=8)
    ap.add_argument("--window", type=float, default=1800.0, help="seconds planned, and seconds tested")
    ap.add_argument("--gap", type=float, default=3600.0, help="seconds from one split's start to the next's")
    ap.add_argument("--start", type=float, default=DAY_S + 8 * 3600.0, help="the first split's trace second")
    ap.add_argument("--rate", type=float, default=8.0, help="total req/s of every window")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--confidence", type=float, default=0.9)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/plan-holdout"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    info = common.machine_info()
    print(info["line"], flush=True)
    base = sim_deployment(deployment_config(args.setup))
    names = tuple(m.name for m in base.models)
    rows = []
    for i in range(args.splits):
        start = args.start + i * args.gap
        seen = window(names, start, args, seed=2 * i)
        coming = window(names, start + args.window, args, seed=2 * i + 1)
        dep = _measured_slos(base, seen, args.hardware, 5.0, args.jobs)
        t0 = time.monotonic()
        result = plan(dep, seen, hardware=args.hardware, target=args.target, policies=["prism"],
                      confidence=args.confidence, seeds=args.seeds, jobs=args.jobs)  # fmt: skip
        wall = time.monotonic() - t0
        p = result.policies["prism"]
        sure = p.confidence.devices if p.confidence is not None else None
        row = {"split": i, "start_s": start, "requests_seen": len(seen), "requests_next": len(coming),
               "answer": p.devices, "confident": sure, "plan_wall_s": round(wall, 1), "next": {}}  # fmt: skip
        for n in sorted({n for n in (p.devices, sure) if n is not None}):
            point = simulate_point(dep, coming, hardware=args.hardware, policy="prism", devices=n)
            row["next"][n] = {"ttft_attainment": point["ttft_attainment"],
                              "met": passed(point, "ttft", args.target)}  # fmt: skip
        rows.append(row)

        print(f"split {i}: {len(seen)} requests seen, {len(coming)} next; answer {_at(row, p.devices)}, "
              f"{args.confidence:.0%} confident {_at(row, sure)}; plan {wall:.0f} s", flush=True)  # fmt: skip
    done = [r for r in rows if r["answer"] is not None and r["confident"] is not None]
    met_point = sum(r["next"][r["answer"]]["met"] for r in done)
    met_sure = sum(r["next"][r["confident"]]["met"] for r in done)
    mean_point = sum(r["answer"] for r in done) / max(1, len(done))
    mean_sure = sum(r["confident"] for r in done) / max(1, len(done))
    print(f"\n{info['line']}")
    print(f"{args.setup}, {args.source} at {args.rate:g} req/s, windows of {args.window:g} s, "
          f"{args.hardware} (simulated), target {args.target:.0%}")  # fmt: skip
    print(f"the answer on the window seen met the target on the next window in {met_point} of {len(done)} "
          f"splits ({mean_point:.2f} devices on average)")  # fmt: skip
    print(f"the {args.confidence:.0%}-confident answer: {met_sure} of {len(done)} ({mean_sure:.2f} devices)")
    body = {"machine": info["line"], "date": time.strftime("%Y-%m-%d"),
            "args": {k: str(v) for k, v in vars(args).items()}, "splits": rows,
            "met": {"answer": met_point, "confident": met_sure, "of": len(done)}}  # fmt: skip
    (args.out / "holdout.json").write_text(json.dumps(body, indent=1, default=str))
    print(f"written: {args.out}/holdout.json")


if __name__ == "__main__":
    main()
