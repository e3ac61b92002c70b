"""How well the CPU profile prices other model shapes: each shape's held-out steps, timed on one core,
against the fitted profile's price three ways, all from the same measurements:

- at the fitted rates alone (SmolLM2-135M's: no shape factors);
- at two factors per shape, memory (weight pass and KV traffic) and compute (matmuls and attention
  FLOPs), solved from a one-row decode and a 256-token prefill (the form the fit had before);
- at the fit's three factors (``prism fit-hardware --shapes``: weight pass, matmuls, attention,
  from ``SHAPE_TRAIN``; sim/fit.py ``shape_factors``).

Held out: the fit's quick points plus decodes of 1-16 rows at 16-1,024 tokens of context and
prefills of 16-384 tokens, none of them a training step. Everything runs in this process on one
core with one torch thread, as a live CPU device does.

    python benchmarks/shape_factors.py --raw /tmp/shapes.json
    python benchmarks/shape_factors.py --reuse /tmp/shapes.json      # refit saved measurements
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

import common
from prism_serve.sim import fit
from prism_serve.sim.cost import RooflineCostModel
from prism_serve.sim.hardware import get_hardware, host_cpu_profile
from prism_serve.sim.shapes import shape_of

SHAPES = "random:smollm2-360m,random:qwen2.5-0.5b,random:qwen3-0.6b"
WIDE = [("decode", (b, c)) for b in (1, 2, 4, 8, 16) for c in (16, 256, 1024)]
WIDE += [("prefill", (p, 0)) for p in (16, 64, 384)]
TWO_TRAIN = [["decode", [1, 16]], ["prefill", [256, 0]]]  # the two-factor form's training steps


def measure(shapes: list[str], rounds: int, reps: int) -> dict:
    fit.pin_one_core(None)
    rate = fit.weight_pass_rate()
    raw = fit.measure_points(fit.step_points("quick"), rounds, reps)
    trained = [{"kind": k, "args": list(a), "held_out": False} for k, a in fit.SHAPE_TRAIN]
    quick = [p for p in fit.step_points("quick") if p["held_out"]]
    taken = {(p["kind"], tuple(p["args"])) for p in trained + quick}
    wide = [{"kind": k, "args": list(a), "held_out": True} for k, a in WIDE if (k, a) not in taken]
    for source in shapes:
        other = fit.measure_points(trained + quick + wide, rounds, reps, model=source)
        raw["points"] += [dict(p, shape=source) for p in other["points"]]
        print(f"measured {source}", flush=True)
    return {"weight_pass_rate": rate, "raw": raw}


TWO_GROUPS = ((0, 2), (1, 3))  # memory: weight pass and KV traffic; compute: matmuls and attention


def two_factor_prices(hw, spec, points: list[dict]) -> list[float]:
    """Each point's price at the two-factor form, solved from its TWO_TRAIN steps."""
    trained = [
        (p["batch"], p["measured_s"])
        for p in points
        if not p["held_out"] and [p["kind"], p["args"]] in TWO_TRAIN
    ]
    factors = fit.shape_factors(hw, spec, trained, groups=TWO_GROUPS)
    if factors is None:
        raise SystemExit(f"{spec.name}: the two-factor form's training steps do not separate its factors")
    fixed, parts = fit.step_parts(hw, spec, [p["batch"] for p in points])
    return list(
        fixed + sum(f * parts[:, list(g)].sum(axis=1) for f, g in zip(factors, TWO_GROUPS, strict=True))
    )


def summary(errors: np.ndarray) -> str:
    return f"{np.abs(errors).mean():.1%} (max {np.abs(errors).max():.1%}, mean {errors.mean():+.1%})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="model sources, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--raw", type=Path, help="save the measurements here")
    ap.add_argument("--reuse", type=Path, help="refit measurements saved with --raw instead of measuring")
    args = ap.parse_args()
    print(common.machine_info()["line"])
    if args.reuse is not None:
        data = json.loads(args.reuse.read_text())
    else:
        data = measure([s for s in args.shapes.split(",") if s], args.rounds, args.reps)
        if args.raw is not None:
            args.raw.write_text(json.dumps(data))
    raw = data["raw"]
    sources = list(dict.fromkeys(p["shape"] for p in raw["points"] if p.get("shape")))
    shapes = {s: shape_of(s, s, 4) for s in sources}
    base = dataclasses.replace(get_hardware(host_cpu_profile()), name="cpu-fitted")
    result = fit.fit_points(raw, base, mem_bandwidth=data["weight_pass_rate"], shapes=shapes)
    unscaled = RooflineCostModel(dataclasses.replace(result.profile, shape_scales=()))
    print("| shape | factors: memory / compute / attention | held-out steps | at the fitted rates "
          "| two factors | three factors | decodes at three factors |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for source, spec in shapes.items():
        points = [p for p in result.points if p.get("shape") == source]
        held = [i for i, p in enumerate(points) if p["held_out"]]
        measured = np.array([points[i]["measured_s"] for i in held])
        plain = np.array([fit.predict(unscaled, spec, points[i]["batch"]) for i in held]) / measured - 1
        two = np.array(two_factor_prices(result.profile, spec, points))[held] / measured - 1
        three = np.array([points[i]["predicted_s"] for i in held]) / measured - 1
        decodes = np.array([points[i]["kind"] == "decode" for i in held])
        factors = result.profile.scales_for(spec.name)
        print(f"| {spec.name} | {' / '.join(f'{f:.2f}' for f in factors)} | {len(held)} | {summary(plain)} "
              f"| {summary(two)} | **{summary(three)}** | {summary(three[decodes])} |")  # fmt: skip


if __name__ == "__main__":
    main()
