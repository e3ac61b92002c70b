"""``prism plan``: argument parsing and the handler (sim/plan.py plans, sim/plan_report.py reports).

    prism plan --config prism.yaml --traffic requests.jsonl --hardware h100 --target 0.99
    prism plan --config paper-58 --traffic w.jsonl --price-per-device-hour 2.5 --out plan/
    prism plan --config prism.yaml --traffic export.csv --time-column ts --model-column deployment \\
        --input-column prompt_len --output-column completion_len --map gpt-small=llama-1b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_plan_parser"]


def _mapping(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old.strip() or not new.strip():
        raise argparse.ArgumentTypeError(f"expected OLD=NEW, got {text!r}")
    return old.strip(), new.strip()


def add_plan_parser(sub) -> None:
    from prism_serve.sim.deployment import PRESETS
    from prism_serve.sim.hardware import HARDWARE
    from prism_serve.sim.plan import POLICIES
    from prism_serve.workload.traffic import FORMATS

    p = sub.add_parser(
        "plan",
        help="the fewest devices for your models and traffic, per policy (simulated)",
        description="Simulates the deployment's models serving the traffic on N devices of a hardware "
        "profile, for every policy, and searches the fewest N that meet the target attainment. Prints "
        "the answers against the lower bound and each other, with the cost per month; --out writes "
        "results.json, plan.png, plan.html and the deployment found as a prism.yaml.",
    )
    p.add_argument("--config", required=True, help=f"a prism.yaml, or a preset: {', '.join(PRESETS)}")
    p.add_argument(
        "--traffic", required=True, type=Path,
        help="prism serve's request log, a workload JSONL (prism workload), or a CSV (--*-column)",
    )  # fmt: skip
    p.add_argument("--traffic-format", default="auto", choices=FORMATS)
    p.add_argument("--time-column", default="timestamp", help="CSV: arrival time (seconds or ISO-8601)")
    p.add_argument("--model-column", default="model", help="CSV: the model a request is for")
    p.add_argument("--input-column", default="input_tokens", help="CSV: prompt tokens")
    p.add_argument("--output-column", default="output_tokens", help="CSV: output tokens")
    p.add_argument("--start", type=float, default=0.0, help="seconds after the first arrival")
    p.add_argument("--duration", type=float, default=None, help="seconds of traffic (default: all)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="2: the same requests twice as fast")
    p.add_argument(
        "--map", action="append", type=_mapping, default=[], metavar="OLD=NEW",
        help="rename a model of the traffic (several onto one merges them); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--skip-bad", action="store_true", help="skip malformed lines (counted) instead of stopping"
    )
    p.add_argument("--ignore-unknown", action="store_true", help="drop requests for models not in the config")
    p.add_argument(
        "--hardware", default="h100",
        help=f"a registered profile ({', '.join(HARDWARE)}) or a profile file (*.json)",
    )  # fmt: skip
    p.add_argument("--target", type=float, default=0.99, help="attainment to meet (default 0.99)")
    p.add_argument("--metric", default="ttft", choices=["ttft", "tpot"])
    p.add_argument(
        "--slo-scale", type=float, default=None, metavar="K",
        help="SLOs as the Prism paper sets them instead of the config's: K times each model's P95 TTFT "
        "and TPOT alone on dedicated devices of the hardware (measured in the simulator)",
    )  # fmt: skip
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    p.add_argument("--max-devices", type=int, default=None, help="search no further (default: 2 per TP rank)")
    p.add_argument("--confirm", type=int, default=2, help="counts above the answer that must pass too")
    p.add_argument("--price-per-device-hour", type=float, default=None, metavar="USD")
    p.add_argument("--jobs", type=int, default=None, help="simulations at once (default: the cores)")
    p.add_argument("--out", type=Path, help="directory for results.json, plan.png, plan.html, prism.yaml")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prism_serve.sim.deployment import deployment_config, sim_deployment
    from prism_serve.sim.hardware import get_hardware
    from prism_serve.sim.plan import plan
    from prism_serve.sim.plan_report import format_plan, write_plan
    from prism_serve.workload.traffic import CsvColumns, TrafficOptions, read_traffic

    hw = get_hardware(args.hardware)
    config = deployment_config(args.config)
    deployment = sim_deployment(config, gpu=hw.overlap)
    for w in deployment.warnings:
        print(f"warning: {w}", file=sys.stderr)
    options = TrafficOptions(
        format=args.traffic_format,
        columns=CsvColumns(args.time_column, args.model_column, args.input_column, args.output_column),
        start_s=args.start,
        duration_s=args.duration,
        rate_scale=args.rate_scale,
        map=dict(args.map),
        skip_bad=args.skip_bad,
        ignore_unknown=args.ignore_unknown,
    )
    traffic = read_traffic(args.traffic, [m.name for m in deployment.models], options)
    notes = []
    if traffic.skipped_bad:
        notes.append(f"{traffic.skipped_bad} malformed lines skipped")
    if traffic.dropped_unknown:
        notes.append(f"{sum(traffic.dropped_unknown.values())} requests for models not served dropped")
    if traffic.dropped_invalid:
        notes.append(f"{traffic.dropped_invalid} requests the server refused as invalid left out")
    print(
        f"traffic: {len(traffic.workload)} requests over {traffic.span_s:.0f} s from {traffic.source} "
        f"({traffic.format}){'; ' + '; '.join(notes) if notes else ''}",
        file=sys.stderr,
    )
    if args.slo_scale is not None:
        deployment = _measured_slos(deployment, traffic.workload, args.hardware, args.slo_scale)
    policies = [p for p in args.policies.split(",") if p]
    with tqdm(desc="plan", unit="sim", file=sys.stderr) as bar:
        result = plan(
            deployment, traffic.workload, hardware=args.hardware, target=args.target, metric=args.metric,
            policies=policies, max_devices=args.max_devices, confirm=args.confirm,
            price_per_device_hour=args.price_per_device_hour, span_s=traffic.span_s, jobs=args.jobs,
            progress=bar.update,
        )  # fmt: skip
    chosen = deployment.policy if deployment.policy in result.policies else policies[0]
    print(format_plan(result, chosen))
    if args.out is not None:
        written = write_plan(result, config, chosen, args.out, sys.argv[1:])
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


def _measured_slos(deployment, workload, hardware: str, scale: float):
    """``deployment`` with the paper's SLOs: ``scale`` times each model's P95 alone."""
    import dataclasses

    from prism_serve.sim.config import SimConfig
    from prism_serve.sim.slo import measure_slos, scale_slos

    print(
        f"measuring SLOs: {len(deployment.models)} models alone on dedicated {hardware} devices",
        file=sys.stderr,
    )
    base = SimConfig(num_devices=1, hardware=hardware, engine=deployment.engine)
    slos = scale_slos(measure_slos(deployment.models, workload, base), scale)
    return dataclasses.replace(deployment, slos=slos)
