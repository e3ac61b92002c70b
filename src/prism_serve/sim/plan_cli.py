"""``prism plan``: argument parsing and the handler (sim/plan.py plans, sim/plan_report.py reports).

    prism plan --config prism.yaml --traffic requests.jsonl --hardware h100 --target 0.99
    prism plan --config paper-58 --traffic w.jsonl --price-per-device-hour 2.5 --out plan/
    prism plan --config prism.yaml --traffic export.csv --time-column ts --model-column deployment \\
        --input-column prompt_len --output-column completion_len --map gpt-small=llama-1b
    prism plan --config prism.yaml --traffic requests.log --hardware fit   # this machine's CPU devices
    prism fit-hardware --out cpu.json     # fit once, then: prism plan ... --hardware cpu.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["add_fit_parser", "add_plan_parser"]

FIT = "fit"  # --hardware: fit this machine's CPU profile first (sim/fit.py)


def _mapping(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old.strip() or not new.strip():
        raise argparse.ArgumentTypeError(f"expected OLD=NEW, got {text!r}")
    return old.strip(), new.strip()


def _sweep_counts(text: str) -> int | None:
    if text.strip().lower() == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or 'all', got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0 or 'all', got {n}")
    return n


def add_plan_parser(sub) -> None:
    from prism_serve.sim.deployment import PRESETS
    from prism_serve.sim.hardware import HARDWARE
    from prism_serve.sim.plan import POLICIES, SWEEP_COUNTS
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
        help=f"a registered profile ({', '.join(HARDWARE)}), a profile file (*.json), or {FIT}: fit this "
        "machine's one-core CPU devices first (about a minute; prism fit-hardware saves one to reuse)",
    )  # fmt: skip
    p.add_argument(
        "--device-memory", metavar="SIZE",
        help="each device's memory, e.g. 80GiB or 1200MiB (default: the profile's; for a CPU profile, "
        "the config's CPU devices' budget where they all have one)",
    )  # fmt: skip
    p.add_argument("--fit-rounds", type=int, default=2, help=f"with --hardware {FIT}: rounds of measurement")
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
    p.add_argument(
        "--sweep-counts", type=_sweep_counts, default=SWEEP_COUNTS, metavar="N|all",
        help=f"counts each policy's search tries one by one from its floor before it takes growing steps "
        f"and halves the gap (default {SWEEP_COUNTS}; all: every count, so every count below an answer "
        "is known to fail, at a simulation per count)",
    )  # fmt: skip
    p.add_argument(
        "--screen", action=argparse.BooleanOptionalAction, default=False,
        help="simulate each count on the traffic's busiest 10 minutes (after 3 minutes of warm-up) before "
        "the whole traffic: a count whose window alone misses more than the target allows fails there. "
        "Pays where failing counts miss in bursts (default: off)",
    )  # fmt: skip
    p.add_argument(
        "--confidence", type=float, default=0.9, metavar="P",
        help="the policy written to prism.yaml gets the fewest devices that meet the target on at least "
        "this fraction of --seeds other draws of the traffic, each with the hardware profile's measured "
        "step error; its range of attainment is printed (default 0.9; 0: the answer on the traffic given)",
    )  # fmt: skip
    p.add_argument("--seeds", type=int, default=10, help="draws of the traffic for --confidence (default 10)")
    p.add_argument("--price-per-device-hour", type=float, default=None, metavar="USD")
    p.add_argument("--jobs", type=int, default=None, help="simulations at once (default: the cores)")
    p.add_argument(
        "--no-expected-rates", dest="expected_rates", action="store_false",
        help="leave the models' expected_rate as the config has it (default: each model's mean rate in "
        "the traffic where unset, simulated and written to prism.yaml; the control plane's rates "
        "start from it)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="directory for results.json, plan.png, plan.html, prism.yaml")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prism_serve.sim.deployment import deployment_config, sim_deployment
    from prism_serve.sim.hardware import get_hardware
    from prism_serve.sim.plan import plan, with_expected_rates
    from prism_serve.sim.plan_report import PlanProgress, format_plan, write_plan
    from prism_serve.workload.traffic import CsvColumns, TrafficOptions, read_traffic

    config = deployment_config(args.config)
    hardware = _hardware(args, config)
    hw = get_hardware(hardware)
    deployment = sim_deployment(config, gpu=hw.overlap)
    for w in deployment.warnings:
        print(f"warning: {w}", file=sys.stderr)
    options = TrafficOptions(
        format=args.traffic_format,
        columns=CsvColumns(args.time_column, args.model_column, args.input_column, args.output_column),
        start_s=args.start,
        duration_s=args.duration,
        rate_scale=args.rate_scale,
        map={**deployment.aliases, **dict(args.map)},  # an adapter's requests are its base's load
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
    if traffic.batch:
        notes.append(
            f"{traffic.batch} batch requests run in the batch class on what the others leave; "
            "the target judges the others"
        )
    print(
        f"traffic: {len(traffic.workload)} requests over {traffic.span_s:.0f} s from {traffic.source} "
        f"({traffic.format}){'; ' + '; '.join(notes) if notes else ''}",
        file=sys.stderr,
    )
    expected = None
    if args.expected_rates:  # what the deployment written is told to expect, simulated as it will run
        config, count = with_expected_rates(config, traffic.workload)
        expected = {m.name: m.expected_rate for m in config.models if m.expected_rate is not None}
        if count:
            print(f"expected_rate: {count} models' mean rates in the traffic", file=sys.stderr)
    if args.slo_scale is not None:
        deployment = _measured_slos(deployment, traffic.workload, hardware, args.slo_scale, args.jobs)
    policies = [p for p in args.policies.split(",") if p]
    chosen = deployment.policy if deployment.policy in policies else (policies or [None])[0]
    with tqdm(desc="plan", unit="sim", file=sys.stderr) as bar:
        # each sweep's last count beside the bar, and in --out/progress.json until the report
        found = PlanProgress(args.metric, args.target, args.out, bar.set_postfix_str)
        result = plan(
            deployment, traffic.workload, hardware=hardware, target=args.target, metric=args.metric,
            policies=policies, max_devices=args.max_devices, confirm=args.confirm,
            price_per_device_hour=args.price_per_device_hour, span_s=traffic.span_s, jobs=args.jobs,
            progress=bar.update, on_point=found, screen=args.screen, confidence=args.confidence or None,
            seeds=args.seeds, chosen=chosen, expected_rates=expected, sweep_counts=args.sweep_counts,
        )  # fmt: skip
    print(format_plan(result, chosen))
    if args.out is not None:
        written = write_plan(result, config, chosen, args.out, sys.argv[1:])
        found.done()
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


def _hardware(args: argparse.Namespace, config) -> str:
    """The profile to plan on, as a name the simulator's processes resolve: a registered name, or a
    file (written to --out, else a temporary directory) where it was fitted here or its memory
    changed."""
    import dataclasses
    import tempfile

    from prism_serve.config import DeviceGroup, parse_size
    from prism_serve.sim.hardware import dump_hardware, get_hardware

    fitted = args.hardware == FIT
    memory = parse_size(args.device_memory) if args.device_memory else None
    devices = [config.devices] if isinstance(config.devices, DeviceGroup) else config.devices
    budgets = {d.memory for d in devices if getattr(d, "name", "cpu").startswith("cpu")}
    cpu_memory = memory if memory is not None or len(budgets) != 1 else next(iter(budgets))
    if fitted:  # on the deployment's own models too: their held-out errors and swaps (sim/fit.py)
        hw = _fit(args.fit_rounds, shapes=[m.source for m in config.served_models()], memory=cpu_memory)
    else:
        hw = get_hardware(args.hardware)
    if memory is None and not hw.overlap and cpu_memory is not None:  # a CPU profile: the config's
        memory = cpu_memory
        print(f"device memory: {memory / 2**20:.0f} MiB, the config's CPU devices'", file=sys.stderr)
    resized = memory is not None and memory != hw.memory_bytes
    if resized:
        hw = dataclasses.replace(hw, memory_bytes=memory)
    if not fitted and not resized:
        return args.hardware  # as registered or as its file says
    folder = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="prism-plan-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "hardware.json"
    dump_hardware(hw, path)
    print(f"hardware profile {hw.name}: {path}", file=sys.stderr)
    return str(path)


def _fit(
    rounds: int,
    name: str = "cpu-fitted",
    core: int | None = None,
    reps: int = 3,
    shapes: Sequence[str] = (),
    sharing: bool = True,
    activations: bool = True,
    memory: int | None = None,
):
    """This machine's one-core CPU profile, measured now with a progress bar (sim/fit.py);
    ``shapes``: model sources whose held-out points are measured too (the fitted model's own, and
    repeats, left out); ``sharing``: compute sharing between engines measured too (sim/sharing.py);
    ``activations``: the runtime's activation of each of ``shapes`` (the default model where none
    is given) timed too (sim/activations.py), on a device of ``memory`` bytes (None: the profile's)."""
    from tqdm import tqdm

    from prism_serve.engine.config import DEFAULT_MODEL
    from prism_serve.engine.machine import cpu_model, vector_flags
    from prism_serve.sim.activations import with_activations
    from prism_serve.sim.fit import FIT_MODEL, SHAPE_TRAIN, fit_source, fit_this_machine, step_points
    from prism_serve.sim.shapes import RANDOM_PREFIX, shape_of
    from prism_serve.sim.sharing import with_sharing

    own = {fit_source(), f"{RANDOM_PREFIX}{FIT_MODEL}", DEFAULT_MODEL, "default"}
    others = {s: shape_of(s, s, 4) for s in dict.fromkeys(shapes) if s not in own}  # fp32, as fitted
    activated = {s: shape_of(s, s, 4) for s in dict.fromkeys(shapes or [DEFAULT_MODEL])}
    print(
        f"fitting a CPU profile on this machine: {cpu_model()} ({vector_flags()}), one core"
        + (f"; held-out points of {', '.join(others)} too" if others else ""),
        file=sys.stderr,
    )
    per_shape = sum(p["held_out"] for p in step_points("quick")) + len(SHAPE_TRAIN)
    total = 1 + rounds * len(step_points("quick")) + per_shape * len(others) + sharing + activations
    with tqdm(total=total, desc="fit", unit="point", file=sys.stderr) as bar:
        result = fit_this_machine(
            name=name, rounds=rounds, reps=reps, core=core, progress=bar.update, shapes=others
        )  # fmt: skip
        if sharing:
            result = with_sharing(result, core)
            bar.update(1)
        if activations:
            result = with_activations(result, activated, core, memory)
            bar.update(1)
    print(result.report(), file=sys.stderr)
    return result.profile


def add_fit_parser(sub) -> None:
    p = sub.add_parser(
        "fit-hardware",
        help="fit this machine's one-core CPU profile for prism sim and prism plan",
        description="Times this project's engine on one core with one torch thread (SmolLM2-135M in "
        "fp32: prefills, prefill chunks after a cached prefix, decode batches at several contexts) "
        "and one thread's weight pass, and fits the simulator's CPU cost model to them; then times "
        "engines in their own processes alone, two on one core and one on each of two cores (compute "
        "sharing), and the runtime activating each model on one core. The fields it does not measure "
        "(the serving path) come from the registered profile of this CPU's vector class. Writes the "
        "profile as a file for --hardware.",
    )
    p.add_argument("--out", type=Path, required=True, help="the profile file to write (*.json)")
    p.add_argument("--name", default="cpu-fitted", help="the profile's name")
    p.add_argument("--rounds", type=int, default=2, help="measurements of every point (the minimum counts)")
    p.add_argument("--reps", type=int, default=3, help="steps per point and round")
    p.add_argument("--core", type=int, default=None, help="the core to run on (default: the last one)")
    p.add_argument(
        "--shapes", default="", metavar="SOURCES",
        help="other models' weights (random:<preset>, a .gguf, an HF directory), comma-separated: three "
        "steps of each set its own weight-pass, matmul and attention rates, and its held-out steps, "
        "predicted at them, give its errors, which join the profile's step errors",
    )  # fmt: skip
    p.add_argument(
        "--device-memory", metavar="SIZE",
        help="the profile's device memory, and the budget the models are activated in (default: the base's)",
    )  # fmt: skip
    p.add_argument(
        "--no-sharing", dest="sharing", action="store_false",
        help="do not measure compute sharing between engines (keep the registered profile's)",
    )  # fmt: skip
    p.add_argument(
        "--no-activations", dest="activations", action="store_false",
        help="do not time the runtime's activation of each model (keep the registered profile's terms)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_fit)


def _cmd_fit(args: argparse.Namespace) -> int:
    import dataclasses

    from prism_serve.config import parse_size
    from prism_serve.sim.errors import SimConfigError
    from prism_serve.sim.hardware import dump_hardware

    if args.out.suffix != ".json":
        raise SimConfigError(f"--out must name a .json file (what --hardware reads), got {str(args.out)!r}")
    shapes = [x for x in args.shapes.split(",") if x]
    memory = parse_size(args.device_memory) if args.device_memory else None
    hw = _fit(args.rounds, args.name, args.core, args.reps, shapes, args.sharing, args.activations, memory)
    if memory is not None:
        hw = dataclasses.replace(hw, memory_bytes=memory)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    dump_hardware(hw, args.out)
    print(f"wrote {args.out}: prism plan ... --hardware {args.out}")
    return 0


def _measured_slos(deployment, workload, hardware: str, scale: float, jobs: int | None):
    """``deployment`` with the paper's SLOs: ``scale`` times each model's P95 alone."""
    import dataclasses

    from prism_serve.sim.config import SimConfig
    from prism_serve.sim.slo import measure_slos, scale_slos

    print(
        f"measuring SLOs: {len(deployment.models)} models alone on dedicated {hardware} devices",
        file=sys.stderr,
    )
    base = SimConfig(num_devices=1, hardware=hardware, engine=deployment.engine)
    slos = scale_slos(measure_slos(deployment.models, workload, base, jobs=jobs), scale)
    return dataclasses.replace(deployment, slos=slos)
