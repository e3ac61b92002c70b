"""Classes and fair share under overload: does interactive traffic keep its SLO with standard and
batch traffic beside it, and does one tenant's flood leave the others alone? Simulated (synthetic
H100 profile, the control loop the live server runs), on real arrival patterns: each tenant's
stream is its own window of ServeGen's per-client trace with Azure conversation lengths, its
arrivals Poisson at the stream's rate (``--arrivals trace``: the trace's own, bursty).

First the capacity C: the highest total rate (on a grid, ``--grid`` steps of ``--step`` req/s) at
which the three streams together, all ``standard`` from one tenant, meet ``--target`` TTFT
attainment. Then:

- **mixed**: interactive at 0.4 C, standard at 0.5 C, batch at 0.6 C (1.5 C in all). Prints each
  class's TTFT attainment, standard's alone at the same rate, and how many batch requests finished
  by the end of the window and after the drain; and the same requests with no classes (all
  standard, one tenant) for comparison.
- **flood**: tenants A, B and C at C/4 each over both models; from half-way A also sends nine
  times that to one model (ten times its share). Prints B's and C's attainment over the second
  half, with and without the flood, and the flood with no tenant names (nobody's share known).

    python benchmarks/tenant_share.py              # 2 Llama-3.1-8B on one H100, 600 s windows
    python benchmarks/tenant_share.py --window 300  # quicker
    python benchmarks/tenant_share.py --capacity 18.5 --only mixed  # one part, C given
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import common
from prism_serve.sim import ModelSLO, ServedModel, SimConfig, model_shape, simulate
from prism_serve.workload import Workload
from prism_serve.workload.builder import WorkloadSpec, build_workload

MODELS = ("m0", "m1")


def stream(args, rate: float, origin: tuple[str, str], seed: int, *, start: float = 0.0, model=None):
    """``rate`` req/s from ``start`` to the window's end: a window of the trace of its own (seed)."""
    span = args.window - start
    spec = WorkloadSpec(MODELS, source=args.source, duration_s=span, start_s=args.trace_start + 3600.0 * seed,
                        total_rate=rate, seed=seed)  # fmt: skip
    w = build_workload(spec)
    times, index = w.timestamps, w.model_index
    if args.arrivals == "poisson":  # the trace's lengths, Poisson arrivals spread over both models
        rng = np.random.default_rng(seed)
        n = rng.poisson(rate * span)
        times, pick = np.sort(rng.uniform(0, span, n)), rng.integers(0, len(w), n)
        models = rng.integers(0, len(MODELS), n)
        w = Workload(times, models, w.prompt_tokens[pick], w.output_tokens[pick], MODELS)
        index = w.model_index
    if model is not None:
        index = np.full(len(w), model, dtype=np.int32)
    return w.timestamps + start, index, w.prompt_tokens, w.output_tokens, [origin] * len(w)


def merged(*parts) -> Workload:
    cols = [np.concatenate([p[i] for p in parts]) for i in range(4)]
    return Workload(*cols, list(MODELS), origins=[o for p in parts for o in p[4]])


def flattened(*parts):
    """The same requests, all standard from no tenant."""
    return [(*p[:4], [("", "standard")] * len(p[0])) for p in parts]


WARMUP_S = SimConfig(num_devices=1).warmup_s  # the simulator starts the workload this late


def per_stream(res, parts, names: str, since: float = 0.0) -> dict[str, float]:
    """TTFT attainment of each stream's requests arriving after ``since`` (stream i is named
    ``names[i]``; streams of one name count together), told apart by the order ``merged`` gives
    them, so runs without tenant names are split the same way."""
    order = np.argsort(np.concatenate([p[0] for p in parts]), kind="stable")
    tags = np.array([n for n, p in zip(names, parts, strict=True) for _ in p[0]])[order]
    met: dict[str, list[bool]] = {}
    for r in res.requests:
        if r.arrival >= since + WARMUP_S:
            ok = r.first_token is not None and r.first_token - r.arrival <= r.ttft_slo
            met.setdefault(str(tags[int(r.req_id)]), []).append(ok)
    return {t: round(sum(v) / len(v), 4) for t, v in sorted(met.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=600.0, help="seconds of traffic per run")
    ap.add_argument("--source", default="servegen:m-large")
    ap.add_argument("--arrivals", choices=("poisson", "trace"), default="poisson",
                    help="Poisson arrivals with the trace's lengths (a capacity that means one rate), or "
                    "the trace's own bursty arrivals")  # fmt: skip
    ap.add_argument("--trace-start", type=float, default=86400.0 + 10 * 3600.0)
    ap.add_argument("--step", type=float, default=0.5, help="capacity grid step, req/s")
    ap.add_argument("--grid", type=int, default=40)
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--ttft", type=float, default=1.0, help="TTFT SLO, s")
    ap.add_argument("--tpot", type=float, default=0.2, help="TPOT SLO, s")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--capacity", type=float, default=None, help="C in req/s (default: measured)")
    ap.add_argument("--only", choices=("mixed", "flood"), default=None, help="run one of the two")
    args = ap.parse_args()
    print(common.machine_info()["line"])
    arrivals = f"{args.source} arrivals"
    if args.arrivals == "poisson":
        arrivals = f"Poisson arrivals, {args.source} lengths"
    print(f"simulated: synthetic H100 profile, 2 x Llama-3.1-8B, one device; {arrivals}, "
          f"{args.window:.0f} s windows; TTFT SLO {args.ttft} s")  # fmt: skip
    start = time.monotonic()
    models = [ServedModel(m, model_shape("llama-3.1-8b"), 1) for m in MODELS]
    slos = {m: ModelSLO(args.ttft, args.tpot) for m in MODELS}
    cfg = SimConfig(num_devices=1, drain_s=3600.0)

    def run(*parts):
        return simulate(models, merged(*parts), slos, cfg)

    def three(total: float):
        return [stream(args, total / 3, ("", "standard"), seed) for seed in range(3)]

    capacity = args.capacity or 0.0
    for k in range(1, args.grid + 1) if not args.capacity else ():
        rate = k * args.step
        got = run(*three(rate)).summary()["ttft_attainment"]
        if got < args.target:
            break
        capacity = rate
    print(f"capacity C = {capacity:.1f} req/s (the three streams, all standard, meet {args.target:.0%})")
    if capacity == 0:
        raise SystemExit("no rate on the grid meets the target: lower --step")
    out: dict = {"capacity_req_s": capacity, "machine": common.machine_info()["line"]}
    if args.only != "flood":
        mixed_part(args, capacity, run, out)
    if args.only != "mixed":
        flood_part(args, capacity, run, out)
    print(f"\n{time.monotonic() - start:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


def mixed_part(args, capacity: float, run, out: dict) -> None:

    chat = stream(args, 0.4 * capacity, ("chat", "interactive"), 0)
    team = stream(args, 0.5 * capacity, ("team", "standard"), 1)
    bulk = stream(args, 0.6 * capacity, ("eval", "batch"), 2)
    cpu = time.process_time()
    mixed = run(chat, team, bulk)
    cpu = time.process_time() - cpu  # a mixed-rank queue with a batch backlog: admission's worst case
    summary = mixed.summary()
    alone = run(team).summary()["ttft_attainment"]
    flat = per_stream(run(*flattened(chat, team, bulk)), (chat, team, bulk), ("chat", "team", "eval"))
    in_window = sum(1 for r in mixed.requests if r.control.origin.priority == 2 and r.finish is not None
                    and r.finish <= args.window + WARMUP_S)  # fmt: skip
    classes = {c: round(v["ttft_attainment"], 4) for c, v in summary["by_class"].items()}
    out["mixed"] = {
        "classes": classes, "standard_alone": alone, "batch": summary["batch"],
        "batch_finished_in_window": in_window, "no_classes": flat, "cpu_s": cpu,
    }  # fmt: skip
    print(f"\nmixed at 1.5 C (interactive 0.4 C, standard 0.5 C, batch 0.6 C): TTFT attainment {classes}")
    print(f"  simulated in {cpu:.1f} CPU-s")
    print(f"  standard alone at 0.5 C: {alone:.4f} (in the mix: {classes['standard'] - alone:+.4f})")
    print(f"  batch: {summary['batch']['requests']} requests, {in_window} finished within the window, "
          f"{summary['batch']['finished']} after the drain")  # fmt: skip
    print(f"  the same requests with no classes (all standard, one tenant): {flat}")


def flood_part(args, capacity: float, run, out: dict) -> None:
    share = capacity / 4
    calm_parts = [stream(args, share, (name, "standard"), seed) for seed, name in enumerate("ABC")]
    flood = stream(args, 9 * share, ("A", "standard"), 3, start=args.window / 2, model=0)
    half = args.window / 2
    calm = per_stream(run(*calm_parts), calm_parts, "ABC", since=half)
    flooded = per_stream(run(*calm_parts, flood), (*calm_parts, flood), "ABCA", since=half)
    nameless = run(*flattened(*calm_parts, flood))
    flat_flood = per_stream(nameless, (*calm_parts, flood), "ABCA", since=half)
    out["flood"] = {"calm": calm, "flood": flooded, "flood_no_tenants": flat_flood}
    print(f"\nflood: A sends 10x its share to m0 from {half:.0f} s; attainment over the second half")
    print(f"  calm:                {calm}")
    print(f"  A floods:            {flooded}")
    print(f"  A floods, no names:  {flat_flood}")
    for t in "BC":
        with_names, without = flooded[t] - calm[t], flat_flood[t] - calm[t]
        print(f"  {t}: {with_names:+.4f} with the flood ({without:+.4f} without names)")


if __name__ == "__main__":
    main()
