"""``prism sim`` and ``prism workload``: argument parsing and handlers (cli.py only registers them).

    prism workload --setup paper-8 --total-rate 5 --duration 1800 --out w.jsonl   # build + statistics
    prism sim --setup paper-8 --gpus 2 --sweep rate --values 0.5,1,2,4 --out results/sim-8
    prism sim --setup paper-58 --gpus 32 --find-gpus 0.99 --policies prism,muxserve,static-partition
    prism sim --setup cpu-2 --hardware cpu-smollm2 --source mooncake --block-tokens 16 \
        --max-prompt-tokens 1792 --max-output-tokens 256 --max-num-seqs 32 --policies prism

A workload with prompt block hashes (``--source mooncake``, or a file that carries them) is simulated
with a prefix cache per engine (sim/engine.py); each point then prints the share of prompt tokens
found cached, next to what an unbounded cache per model would give on the same requests.

With ``--find-gpus``, a lower bound on the devices any policy needs (sim/bound.py) is printed first
and every policy's answer is also given as a ratio to it. The search is ``prism plan``'s
(sim/plan.py): a sweep upward from the bound's hard floor, each answer confirmed by the counts
above it, every point stopped once it has missed more than the target allows.

Outputs of ``prism sim --out DIR``: results.json (every point's summary, the SLOs, the command line),
slos.json (the unscaled SLOs, reusable with ``--slos``), and PNG plots (sweep.png, gpus_needed.png).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_sim_parser", "add_workload_parser"]

_COMMON_POLICIES = "prism,muxserve,static-partition,qlm"


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    from prism_serve.sim.deployment import PRESETS
    from prism_serve.workload.builder import LENGTH_FILES

    p.add_argument("--setup", default="paper-8", choices=PRESETS, help="the served models (sim/presets/)")
    p.add_argument("--workload", type=Path, help="read this JSONL workload instead of building one")
    p.add_argument(
        "--source", default="servegen:m-large",
        help="servegen:<pool>, azure:conv|code, or mooncake (the Mooncake trace's own requests, lengths "
        "and prompt block hashes; workload/builder.py)",
    )  # fmt: skip
    p.add_argument("--lengths", default="azure:conv", choices=list(LENGTH_FILES))
    p.add_argument(
        "--block-tokens", type=int, default=None, metavar="N",
        help="mooncake: its 512-token hashed blocks become N-token blocks, prompts scaled alike (16 or 32 "
        "fit a 2048-token context with --max-prompt-tokens)",
    )  # fmt: skip
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="cap every prompt (its hashes too)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap every output")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of workload")
    p.add_argument("--start", type=float, default=None, help="ServeGen start time, s (default day 2 10:00)")
    p.add_argument("--total-rate", type=float, default=None, help="mean total req/s at rate scale 1")
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces", type=Path, default=None, help="trace directory (default $PRISM_TRACES)")


def _workload(args: argparse.Namespace, models: list):
    from prism_serve.workload.builder import WorkloadSpec, build_workload
    from prism_serve.workload.format import read_jsonl

    names = tuple(m.name for m in models)
    if args.workload is not None:
        return read_jsonl(args.workload, names), None
    extra = {} if args.start is None else {"start_s": args.start}
    spec = WorkloadSpec(
        names,
        source=args.source,
        lengths=args.lengths,
        duration_s=args.duration,
        rate_scale=args.rate_scale,
        total_rate=args.total_rate,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        block_tokens=args.block_tokens,
        seed=args.seed,
        traces_dir=args.traces,
        **extra,
    )
    return build_workload(spec), spec


def _unbounded_line(workload, block_size: int) -> str | None:
    """What an unbounded prefix cache per model would hold, for a workload with block hashes."""
    from prism_serve.workload.prefix import infinite_cache_hits

    if workload.block_hashes is None:
        return None
    hits = infinite_cache_hits(workload, block_size)
    rate = float(hits.sum() / workload.prompt_tokens.sum())
    return (
        f"prefix sharing: an unbounded cache per model would hold {rate:.1%} of prompt tokens "
        f"({block_size}-token blocks; hashes of {workload.block_tokens}-token blocks)"
    )


def _cmd_workload(args: argparse.Namespace) -> int:
    from prism_serve.engine.config import GPU_ENGINE_DEFAULTS
    from prism_serve.sim.deployment import get_setup
    from prism_serve.workload.format import write_jsonl
    from prism_serve.workload.stats import format_stats, model_stats

    w, spec = _workload(args, get_setup(args.setup))
    if args.out is not None:
        write_jsonl(w, args.out)
        print(f"wrote {len(w)} requests to {args.out}", file=sys.stderr)
    span = spec.duration_s if spec is not None else None
    print(format_stats(model_stats(w, span_s=span)))
    if (line := _unbounded_line(w, GPU_ENGINE_DEFAULTS.block_size)) is not None:
        print(line)
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    import msgspec
    from tqdm import tqdm

    from prism_serve.engine.config import GPU_ENGINE_DEFAULTS
    from prism_serve.sim.deployment import get_setup
    from prism_serve.sim.plot import plot_gpus_needed, plot_sweep
    from prism_serve.sim.simulator import SimConfig
    from prism_serve.sim.slo import load_slos, measure_slos, save_slos, scale_slos
    from prism_serve.sim.sweep import Experiment, run_point, sweep

    _check_sim(args)
    models = get_setup(args.setup)
    workload, spec = _workload(args, models)
    knobs = tuple((k, v) for k, v in (kv.split("=", 1) for kv in args.knob or ()))
    engine = {
        k: v
        for k, v in (
            ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("prefix_caching", False if args.no_prefix_caching else None),
        )
        if v is not None
    }
    config = SimConfig(
        num_devices=args.gpus, hardware=args.hardware, knobs=_typed(knobs), tick_s=args.tick,
        compute_sharing=not args.no_compute_sharing,
        engine=msgspec.structs.replace(GPU_ENGINE_DEFAULTS, **engine),
        **({} if args.placement_coalesce is None else {"placement_coalesce_s": args.placement_coalesce}),
    )  # fmt: skip
    if (
        config.engine.prefix_caching
        and (line := _unbounded_line(workload, config.engine.block_size)) is not None
    ):
        print(line, file=sys.stderr)
    if args.slos is not None and args.slos.exists():
        slos = load_slos(args.slos)
    else:
        print(
            f"measuring SLOs: {len(models)} models alone on dedicated {args.hardware} devices",
            file=sys.stderr,
        )
        slos = measure_slos(models, workload, config)
        if args.slos is not None:
            save_slos(slos, args.slos, hardware=args.hardware, setup=args.setup)
    exp = Experiment(models, workload, slos, config, args.slo_scale, args.tpot_scale, spec)
    policies = [p for p in args.policies.split(",") if p]
    title = f"{args.setup} on {args.hardware}, {len(workload)} requests"
    out: dict = {
        "argv": sys.argv[1:],
        "simulated": True,
        "hardware": config.hardware,
        "setup": args.setup,
        "num_requests": len(workload),
        "slos": {m: {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s} for m, s in slos.items()},
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        save_slos(slos, args.out / "slos.json", hardware=args.hardware, setup=args.setup)
    if args.find_gpus is not None:
        from prism_serve.sim.deployment import SimDeployment
        from prism_serve.sim.plan import plan

        scaled = scale_slos(slos, args.slo_scale, args.tpot_scale)
        deployment = SimDeployment(models, scaled, config.engine, policies[0], config.knobs)
        with tqdm(desc="find-gpus", unit="sim", file=sys.stderr) as bar:
            found = plan(
                deployment, workload, hardware=args.hardware, target=args.find_gpus,
                metric=args.metric.removesuffix("_attainment"), policies=policies, max_devices=args.gpus,
                config=config, memory_window_s=args.bound_window,
                compute_window_s=args.bound_compute_window, progress=bar.update,
            )  # fmt: skip
        bound = found.bound
        print(_bound_line(bound))
        needed = {p: pp.devices for p, pp in found.policies.items()}
        points = [{**pt, "policy": p} for p, pp in found.policies.items() for pt in pp.points.values()]
        ratios = {p: bound.ratio(n) for p, n in needed.items()}
        out.update(
            find_gpus=args.find_gpus, metric=args.metric, lower_bound=bound.as_dict(), gpus_needed=needed,
            ratio_to_bound=ratios, points=points,
            variants={
                p: [{"knobs": v, "devices": n} for v, n in pp.variants] for p, pp in found.policies.items()
            },
        )  # fmt: skip
        for p, n in needed.items():
            # no answer within --gpus: the policy needs more than that, so its ratio is above this one
            ratio = f"{ratios[p]:.2f}x" if n is not None else f"more than {bound.ratio(args.gpus):.2f}x"
            print(
                f"{p:>18}: {n if n is not None else str(args.gpus) + '+'} GPUs "
                f"for {args.metric} >= {args.find_gpus} ({ratio} the lower bound)"
            )
        if args.out is not None:
            plot_gpus_needed(needed, args.gpus, args.out / "gpus_needed.png", title=title)
    else:
        values = args.values if args.sweep else [None]
        with tqdm(
            total=len(policies) * len(values),
            desc=f"sweep {args.sweep or 'point'}",
            unit="sim",
            file=sys.stderr,
        ) as bar:
            if args.sweep:
                rows = sweep(exp, args.sweep, values, policies, progress=bar.update, metric=args.metric)
            else:
                rows = []
                for p in policies:
                    rows.append(run_point(exp, p))
                    bar.update()
        out["points"] = rows
        for r in rows:
            print(
                f"{r['policy']:>18} {r['axis'] or '':>5} {r['value'] if r['value'] is not None else '':>6}  "
                f"TTFT {r['ttft_attainment']:7.2%}  TPOT {r['tpot_attainment']:7.2%}  "
                f"{r['throughput_tokens_per_s']:9.1f} tok/s  "
                f"act {r['activations']:5d}  ev {r['evictions']:5d}  "
                f"misses cold {r['ttft_misses_cold']:5d} warm {r['ttft_misses_warm']:5d}  "
                f"replicas {r['replica_activations']:4d} ({r['requests_on_replicas']} requests)"
                + _prefix_cells(r)
                + _kept_cell(r)
            )
        if args.out is not None and args.sweep:
            plot_sweep(rows, args.out / "sweep.png", title=title)
    if args.out is not None:
        (args.out / "results.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"results in {args.out}/ [simulated: {config.hardware} profile]", file=sys.stderr)
    return 0


def _kept_cell(point: dict) -> str:
    """Where a baseline keeps a smaller count's assignment (sim/sweep.py ``keep_fewer``)."""
    kept = point.get("kept")
    if kept is None:
        return ""
    return f"  keeps {kept['from_devices']}'s assignment: TTFT {kept['ttft_attainment']:7.2%}"


def _prefix_cells(point: dict) -> str:
    """A point's prefix hit rate and an unbounded cache's, where the workload had block hashes."""
    if "prefix_hit_rate" not in point:
        return ""
    return (
        f"  prefix hits {point['prefix_hit_rate']:6.2%} (unbounded {point['prefix_hit_rate_infinite']:6.2%})"
    )


def _bound_line(b) -> str:
    return (
        f"lower bound: {b.devices} devices (memory {b.memory_devices} in the {b.memory_window_s:g} s "
        f"window at t={b.memory_peak_start_s:g}, compute {b.compute_devices} in the "
        f"{b.compute_window_s:g} s window at t={b.compute_peak_start_s:g}, tp {b.tp_devices})"
    )


def _typed(knobs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, object], ...]:
    out = []
    for k, v in knobs:
        low = v.lower()
        val: object = v
        if low in ("true", "false"):
            val = low == "true"
        else:
            for cast in (int, float):
                try:
                    val = cast(v)
                    break
                except ValueError:
                    continue
        out.append((k, val))
    return tuple(out)


def add_workload_parser(sub) -> None:
    w = sub.add_parser(
        "workload",
        help="build a multi-model workload from the real traces; print per-model statistics",
        description="Each model takes one trace source's arrivals (a ServeGen client or an Azure slice). "
        "Writes JSONL (timestamp, model, prompt_tokens, output_tokens) with --out.",
    )
    _add_workload_args(w)
    w.add_argument("--out", type=Path, help="write the workload here (JSONL)")
    w.set_defaults(func=_cmd_workload)


def _hardware_name(value: str) -> str:
    """--hardware: checked here (a clear usage error), passed on as given."""
    from prism_serve.sim.errors import SimConfigError
    from prism_serve.sim.hardware import get_hardware

    try:
        get_hardware(value)
    except SimConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_sim_parser(sub) -> None:
    from prism_serve.sim.hardware import HARDWARE
    from prism_serve.sim.sweep import AXES

    s = sub.add_parser(
        "sim",
        help="simulate policies on a cluster (results are simulated, from a cost model)",
        description="Discrete-event simulation of the control/ policies on simulated devices. Sweep the "
        "rate scale, SLO scale or number of GPUs, or search the fewest GPUs for a target attainment.",
    )
    _add_workload_args(s)
    s.add_argument(
        "--hardware",
        default="h100",
        type=_hardware_name,
        help=f"a registered profile ({', '.join(HARDWARE)}) or a profile file (*.json, e.g. one "
        "prism fit-hardware fitted on your machine)",
    )
    s.add_argument("--gpus", type=int, default=2, help="devices (the maximum for --find-gpus)")
    s.add_argument("--policies", default=_COMMON_POLICIES, help="comma-separated registry names")
    s.add_argument("--knob", action="append", metavar="NAME=VALUE", help="policy knob (repeatable)")
    s.add_argument("--slo-scale", type=float, default=5.0)
    s.add_argument("--tpot-scale", type=float, default=None, help="default: the SLO scale")
    s.add_argument("--slos", type=Path, help="SLO file: read if it exists, else measured and written")
    s.add_argument("--tick", type=float, default=1.0, help="placement tick period, s")
    s.add_argument(
        "--placement-coalesce",
        type=float,
        default=None,
        help="seconds the placement after an activation waits for others to share (default 0: at once)",
    )
    s.add_argument("--max-num-seqs", type=int, help="requests per engine batch (default 256, a GPU engine's)")
    s.add_argument(
        "--max-num-batched-tokens", type=int, help="tokens per engine step (default 8192, a GPU engine's)"
    )
    s.add_argument(
        "--no-compute-sharing", action="store_true",
        help="each engine steps as if alone on its device (the simulator before compute sharing)",
    )  # fmt: skip
    s.add_argument(
        "--no-prefix-caching", action="store_true",
        help="compute every prompt in full even where the workload has block hashes (to compare)",
    )  # fmt: skip
    s.add_argument("--sweep", choices=AXES, help="axis to sweep over --values")
    s.add_argument("--values", type=_floats, default=None, help="comma-separated axis values")
    s.add_argument("--find-gpus", type=float, default=None, metavar="TARGET", help="e.g. 0.99")
    s.add_argument("--metric", default="ttft_attainment", choices=["ttft_attainment", "tpot_attainment"])
    s.add_argument(
        "--bound-window", type=float, default=10.0, metavar="S",
        help="--find-gpus lower bound: memory window, s (models with requests in one window are "
        "counted resident together; sim/bound.py)",
    )  # fmt: skip
    s.add_argument(
        "--bound-compute-window", type=float, default=60.0, metavar="S",
        help="--find-gpus lower bound: compute window, s (a window's arrivals' device-seconds must fit "
        "in it)",
    )  # fmt: skip
    s.add_argument("--out", type=Path, help="directory for results.json, slos.json and plots")
    s.set_defaults(func=_cmd_sim)


def _check_sim(args: argparse.Namespace) -> None:
    from prism_serve.sim.errors import SimConfigError

    if args.sweep and not args.values:
        raise SimConfigError("--sweep needs --values")
    if args.sweep and args.find_gpus is not None:
        raise SimConfigError("choose --sweep or --find-gpus, not both")
