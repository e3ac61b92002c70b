"""Fit the simulator's ``cpu-smollm2`` hardware profile to this project's engine on this machine.

Times real engine steps (``LLMEngine.step``: schedule, model, sampling, postprocess) of SmolLM2-135M
(fp32, real weights) on ONE core with ONE torch thread -- what a live CPU device of one core runs
(runtime/devices.py: ``cpu_devices`` splits the cores and ``pin_process`` gives a device one thread
per core; the default config puts two devices on this 2-core machine). Points: prefills alone,
prefill chunks after a cached prefix, decode batches of 1-32 requests at contexts 16-2048, and
(held out only) mixed prefill+decode steps and decode batches with unequal contexts.

Contexts are *allocated, not computed*: a request is given its KV blocks and marked as having
computed its prefix, so its next step attends over that many cached tokens. KV contents do not change
the step time, and prefilling a 32 x 1024 batch would take minutes at one thread per repetition;
``--check`` compares one such point against a really prefilled batch.

Each point is measured in every round (rounds wait for quiet CPUs and record the other load, see
common.py) and summarized by its minimum: other processes only ever add time. The fit is a
non-negative least squares on relative error (numpy; an active-set solver below) of the cost model's
summed CPU form (sim/cost.py, ``overlap=False``), with the small-batch kernel crossover chosen by
grid search. Points are split into training and held-out sets up front; the errors printed are
those of ``RooflineCostModel`` with the fitted profile, i.e. what the simulator will compute.

    python benchmarks/fit_cpu_profile.py                      # measure (about 15 min) and fit
    python benchmarks/fit_cpu_profile.py --reuse              # refit the saved measurements
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from common import REPO_ROOT, cpu_seconds, machine_info, other_load_since, wait_quiet
from prism_serve.sim.fit import (
    StepBench,
    counts,
    fit_points,
    format_constants,
    label,
    pin_one_core,
    predict,
    step_points,
)

RAW = REPO_ROOT / "results" / "cpu_profile_fit.json"


class Bench(StepBench):
    def check(self) -> None:
        """One decode point with really prefilled contexts against the same with allocated ones."""
        from prism_serve.engine.sampling_params import SamplingParams

        b, c = 8, 512
        # many tokens to go: the batch must not shrink while it is timed
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for _ in range(b):
            self.engine.add_request(self.rng.integers(17, 49152, c).tolist(), params)
        while any(s.num_computed_tokens < c for s in self.engine._requests.values()):
            self.engine.step()  # prefill (the first requests start decoding meanwhile)
        real = [self.step() for _ in range(self.reps)]
        self.engine.abort_all()
        ctxs = [bt for _, bt, _ in real[0][1]]
        ctx = round(np.mean(ctxs))
        fake = self.measure({"kind": "decode", "args": [b, ctx + 1]})
        print(
            f"check: decode b={b}: prefilled contexts {min(ctxs)}..{max(ctxs)} "
            f"{min(t for t, _ in real) * 1e3:.1f} ms, allocated contexts {ctx} "
            f"{min(t for t, _ in fake) * 1e3:.1f} ms"
        )


# Held-out model shapes (random weights: the step time does not depend on their values) and dtypes,
# to see how far the fit carries beyond the model it was fitted on. Not used by the fit.
OTHER_SHAPES = [("smollm2-360m", "float32"), ("smollm2-135m", "bfloat16"), ("smollm2-360m", "bfloat16")]
SHAPE_POINTS = [("decode", [1, 256]), ("decode", [4, 256]), ("decode", [16, 256]), ("prefill", [64, 0])]
SHAPE_POINTS += [("prefill", [256, 0]), ("prefill", [512, 512])]


def measure_shapes(rounds: int, reps: int) -> list[dict]:
    out = []
    for shape, dtype in OTHER_SHAPES:
        bench = Bench(reps, f"random:{shape}", dtype)
        bench.measure({"kind": "decode", "args": [4, 64]})  # warm-up
        pts = [{"kind": k, "args": a, "shape": shape, "dtype": dtype, "times": []} for k, a in SHAPE_POINTS]
        for _ in range(rounds):
            wait_quiet(60.0, 0.15)
            for p in pts:
                steps = bench.measure(p)
                p["times"] += [t for t, _ in steps]
                p.setdefault("batch", steps[0][1])
        bench.engine.close()
        out += pts
        print(f"measured {shape} {dtype}", flush=True)
    return out


def pin(core: int) -> dict:
    """Run on one core with one torch thread, as a live CPU device of one core does."""
    pin_one_core(core)
    return machine_info(pinned=f"core {core}")


def measure(rounds: int, reps: int, core: int, check: bool, shapes: bool) -> dict:
    info = pin(core)
    print(info["line"])
    bench = Bench(reps)
    bench.measure({"kind": "decode", "args": [4, 64]})  # warm-up
    if check:
        bench.check()
    pts = step_points()
    times: list[list[float]] = [[] for _ in pts]
    batches: list[list | None] = [None] * len(pts)
    loads = []
    for r in range(rounds):
        wait_quiet(120.0, 0.15)
        start, t0 = cpu_seconds(), time.perf_counter()
        for i, p in enumerate(pts):
            for t, batch in bench.measure(p):
                times[i].append(t)
                if batches[i] is None:
                    batches[i] = batch  # the first step: the smallest context of the point
        loads.append(other_load_since(start, time.perf_counter() - t0))
        print(
            f"round {r + 1}/{rounds}: {time.perf_counter() - t0:.0f} s, other load {loads[-1]:.2f} cores",
            flush=True,
        )
    attention = "kernel" if bench.engine.runner.kernels else "sdpa"
    bench.engine.close()
    for p, ts, b in zip(pts, times, batches, strict=True):
        p["times"], p["batch"] = ts, b
    raw = {"machine": info["line"], "other_load": loads, "date": time.strftime("%Y-%m-%d"), "points": pts,
           "decode_attention": attention}  # fmt: skip
    if shapes:
        add_shapes(raw, rounds, reps)
    return raw


def add_shapes(raw: dict, rounds: int, reps: int) -> None:
    start, t0 = cpu_seconds(), time.perf_counter()
    raw["shapes"] = measure_shapes(max(1, rounds // 2), reps)
    raw["shapes_other_load"] = other_load_since(start, time.perf_counter() - t0)


# -- fit --------------------------------------------------------------------------------------------


def print_constants(hw) -> None:
    print(format_constants(hw))


def fit(raw: dict, quantile: float, base, compare, mem_bandwidth: float | None = None):
    """Fit the measured points; ``base`` and ``compare`` as in ``fit_trace``. Returns the profile."""
    from prism_serve.sim.cost import RooflineCostModel
    from prism_serve.sim.models import model_shape

    spec = model_shape("smollm2-135m", dtype_bytes=4)
    attention = "sdpa" if base.pad_decode_context else "kernel"  # as main() chose it
    result = fit_points(dict(raw, decode_attention=attention), base, mem_bandwidth, quantile)
    hw, crossover, pts = result.profile, result.crossover, result.points
    y = np.array([p["measured_s"] for p in pts])
    pred = np.array([p["predicted_s"] for p in pts])
    train = np.array([not p["held_out"] for p in pts])
    cm = RooflineCostModel(hw)
    print(
        f"machine: {raw['machine']}; measured {raw['date']}; other load per round: "
        + ", ".join(f"{v:.2f}" for v in raw["other_load"])
        + " cores"
    )
    n = len(pts[0]["times"])
    print(f"step time = quantile {quantile} of {n} steps per point; small-batch crossover {crossover:g} rows")
    print_constants(hw)
    rel = pred / y - 1
    for held in (False, True):
        print("held-out points:" if held else "training points:")
        for p, m, f, e in zip(pts, y, pred, rel, strict=True):
            if p["held_out"] == held:
                print(f"  {label(p):<42} measured {m * 1e3:8.1f} ms  predicted {f * 1e3:8.1f} ms  ({e:+.1%})")
    for name, sel in (
        ("training", train),
        ("held-out decode", np.array([p["held_out"] and p["kind"] == "decode" for p in pts])),
        ("held-out prefill", np.array([p["held_out"] and p["kind"] == "prefill" for p in pts])),
        ("held-out mixed", np.array([p["kind"] == "mixed" for p in pts])),
        ("held-out unequal contexts", np.array([p["kind"] == "ragged" for p in pts])),
    ):
        e = np.abs(rel[sel])
        print(f"{name:<26} mean |error| {e.mean():6.1%}  max {e.max():6.1%}  ({sel.sum()} points)")
    registered = RooflineCostModel(compare)
    rel_reg = np.array([predict(registered, spec, p["batch"]) for p in pts]) / y - 1
    print(
        f"profile {compare.name} on these points: training max |error| "
        f"{np.abs(rel_reg[train]).max():.1%}, held-out max {np.abs(rel_reg[~train]).max():.1%}"
    )
    if raw.get("shapes"):
        print(f"other shapes and dtypes, not fitted (other load {raw['shapes_other_load']:.2f} cores):")
        for p in raw["shapes"]:
            other = model_shape(p["shape"], dtype_bytes=4 if p["dtype"] == "float32" else 2)
            m, f = min(p["times"]), predict(cm, other, p["batch"])
            name = f"{p['shape']} {p['dtype']} {label(p)}"
            print(f"  {name:<48} measured {m * 1e3:8.1f} ms  predicted {f * 1e3:8.1f} ms  ({f / m - 1:+.1%})")
    return hw


def refit_kv(raw: dict, quantile: float, compare, pad: bool):
    """``compare`` with only its KV term refitted: every other constant kept, ``pad_decode_context``
    set to ``pad``, and ``kv_bandwidth`` chosen by least squares on the relative error of the
    training decode points (closed form: one coefficient). For an engine change that moves only
    decode attention, where the live traces behind the other constants still hold."""
    from prism_serve.sim.cost import RooflineCostModel
    from prism_serve.sim.models import model_shape

    spec = model_shape("smollm2-135m", dtype_bytes=4)
    pts = raw["points"]
    y = np.array([np.quantile(p["times"], quantile) for p in pts])
    without = RooflineCostModel(dataclasses.replace(compare, pad_decode_context=pad, kv_bandwidth=1e30))
    rest = np.array([predict(without, spec, p["batch"]) for p in pts])
    x = np.array([spec.kv_bytes_per_token * (c[3] + c[0]) for c in (counts(p["batch"], pad) for p in pts)])
    sel = np.array([not p["held_out"] and p["kind"] == "decode" for p in pts])
    inv = np.sum((y - rest)[sel] * x[sel] / y[sel] ** 2) / np.sum(x[sel] ** 2 / y[sel] ** 2)
    if not inv > 0:
        raise SystemExit(f"the decode points leave no time for KV reads (coefficient {inv:.3e})")
    hw = dataclasses.replace(compare, pad_decode_context=pad, kv_bandwidth=float(1 / inv))
    print(f"machine: {raw['machine']}; measured {raw['date']}; decode attention "
          f"{raw.get('decode_attention', 'sdpa')}")  # fmt: skip
    print(f"{compare.name}: kv_bandwidth {compare.kv_bandwidth:.3e} (pad {compare.pad_decode_context}) -> "
          f"{hw.kv_bandwidth:.3e} (pad {pad}); every other constant kept")  # fmt: skip
    old, new = RooflineCostModel(compare), RooflineCostModel(hw)
    rel_old = np.array([predict(old, spec, p["batch"]) for p in pts]) / y - 1
    rel_new = np.array([predict(new, spec, p["batch"]) for p in pts]) / y - 1
    for p, m, a, b in zip(pts, y, rel_old, rel_new, strict=True):
        tag = " (held out)" if p["held_out"] else ""
        print(f"  {label(p) + tag:<54} measured {m * 1e3:8.1f} ms  before {a:+7.1%}  refitted {b:+7.1%}")
    for kind in ("decode", "prefill", "mixed", "ragged"):
        k = np.array([p["kind"] == kind for p in pts])
        print(f"{kind:<8} mean |error| before {np.abs(rel_old[k]).mean():6.1%}  refitted "
              f"{np.abs(rel_new[k]).mean():6.1%}  ({k.sum()} points)")  # fmt: skip
    return hw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="steps per point and round")
    ap.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)), help="the one core to run on")
    ap.add_argument("--quantile", type=float, default=0.0, help="of each point's steps (0: the minimum)")
    ap.add_argument("--raw", type=Path, default=RAW, help="measurements are saved here")
    ap.add_argument("--reuse", action="store_true", help="fit the saved measurements, measure nothing")
    ap.add_argument("--check", action="store_true", help="compare allocated with prefilled contexts once")
    ap.add_argument("--shapes", action="store_true", help="also time other shapes and dtypes (not fitted)")
    ap.add_argument("--trace", type=Path, nargs="+", help="fit live steps (PRISM_STEP_TRACE dirs) instead")
    ap.add_argument("--held-out", type=Path, nargs="*", default=[], help="trace dirs kept out of the fit")
    ap.add_argument("--held-share", type=float, default=0.25, help="random share held out without --held-out")
    ap.add_argument("--points", type=Path, help="with --trace: also fit the points of this raw file (--raw)")
    ap.add_argument("--points-weight", type=float, default=0.25, help="their share of the training weight")
    ap.add_argument(
        "--by-step", action="store_true",
        help="with --trace: weigh every live step alike (default: each step kind, decode / prefill / mixed, "
        "carries the same total weight)",
    )  # fmt: skip
    ap.add_argument(
        "--keep-crossed", action="store_true",
        help="with --trace: also fit the steps that overlapped another device's steps (default: leave them "
        "out and set cross_interference from them)",
    )  # fmt: skip
    ap.add_argument(
        "--base", default="cpu-smollm2",
        help="the profile (registered name or file) whose other fields the fit keeps: memory, "
        "activation, compute sharing (benchmarks/cpu_sharing.py measures share_interference)",
    )  # fmt: skip
    ap.add_argument("--compare", help="print this profile's errors beside the fit's (default: the one "
                    "sim_mirror.py picks for this machine)")  # fmt: skip
    ap.add_argument("--name", help="the fitted profile's name (default: cpu-smollm2-<vector class>)")
    ap.add_argument(
        "--mem-bandwidth", type=float, metavar="BYTES_PER_S",
        help="fix the weight pass at this rate (one read of the weights per step) instead of fitting it; "
        "benchmarks/cpu_gemm.py prints one thread's rate through a weight larger than the caches",
    )  # fmt: skip
    ap.add_argument(
        "--decode-attention", choices=["kernel", "sdpa"],
        help="the engine's decode attention the fitted steps ran with (default: what the measurements "
        "record, else what this machine's engine uses now); sdpa reads contexts padded by group",
    )  # fmt: skip
    ap.add_argument(
        "--refit-kv", action="store_true",
        help="keep --compare's constants and refit only its KV term on the decode points (an engine "
        "change that moves only decode attention)",
    )  # fmt: skip
    ap.add_argument(
        "--write", type=Path, metavar="FILE.json",
        help="save the fitted profile; `prism sim --hardware FILE.json` and the --hardware option of "
        "sim_vs_live.py and live_eval.py use it",
    )  # fmt: skip
    args = ap.parse_args()
    from prism_serve.engine.cpu_kernels import kernels_enabled
    from prism_serve.sim.hardware import dump_hardware, get_hardware, vector_class_profile
    from sim_mirror import HARDWARE

    compare = get_hardware(args.compare or HARDWARE)
    base = dataclasses.replace(get_hardware(args.base), name=args.name or vector_class_profile())
    now = "kernel" if kernels_enabled() else "sdpa"
    if args.trace:
        from fit_trace import fit_trace

        base = dataclasses.replace(base, pad_decode_context=(args.decode_attention or now) == "sdpa")
        hw = fit_trace(
            args.trace, args.held_out, args.held_share, args.points, args.points_weight, base, compare,
            not args.by_step, args.mem_bandwidth, args.keep_crossed,
        )  # fmt: skip
    else:
        if args.reuse:
            raw = json.loads(args.raw.read_text())
            if args.shapes and "shapes" not in raw:  # time only the other shapes, keep the rest
                pin(args.core)
                add_shapes(raw, args.rounds, args.reps)
                args.raw.write_text(json.dumps(raw))
        else:
            raw = measure(args.rounds, args.reps, args.core, args.check, args.shapes)
            args.raw.parent.mkdir(parents=True, exist_ok=True)
            args.raw.write_text(json.dumps(raw))
            print(f"measurements saved to {args.raw}")
        pad = (args.decode_attention or raw.get("decode_attention", "sdpa")) == "sdpa"
        if args.refit_kv:
            hw = refit_kv(raw, args.quantile, compare, pad)
        else:
            hw = fit(raw, args.quantile, dataclasses.replace(base, pad_decode_context=pad), compare,
                     args.mem_bandwidth)  # fmt: skip
    if args.write:
        dump_hardware(hw, args.write)
        print(f"profile {hw.name} written to {args.write} (prism sim --hardware {args.write})")


if __name__ == "__main__":
    main()
