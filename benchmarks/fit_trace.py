"""``fit_cpu_profile.py --trace``: the CPU profile fitted to live engine steps (``PRISM_STEP_TRACE``
of a ``prism serve`` run) instead of measured points, with the steps that overlapped another
device's steps left out and the host-wide interference estimated from them (step_overlap.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from common import machine_info
from fit_cpu_profile import print_constants
from prism_serve.sim.fit import best_fit, predict, profile_from, step_kind

__all__ = ["fit_trace"]


def fit_trace(
    train_dirs: list[Path],
    held_dirs: list[Path],
    held_share: float,
    points: Path | None,
    points_weight: float,
    base,
    compare,
    balance_kinds: bool = True,
    mem_bandwidth: float | None = None,
    keep_crossed: bool = False,
):
    """Fit the profile to live steps (``PRISM_STEP_TRACE`` of a ``prism serve`` run): each step's
    CPU seconds is its cost alone on its one core. Held out: the steps of ``held_dirs``, or else a
    random ``held_share`` of the training runs' steps. ``points``: also fit the measured points of
    an earlier run of this script (its raw file; each point's minimum), which reach the large
    batches and long contexts a light live run never steps; its training points together carry
    ``points_weight`` of the training weight, its held-out points stay held out. ``balance_kinds``:
    the live training steps of each kind (decode, prefill, mixed) carry the same total weight; a live
    run is almost all decode steps (96% in the presets of sim_vs_live.py), and unweighted they would
    let the fit trade the prefill steps, on which every TTFT hangs, for a slightly better decode.
    ``base``: the profile whose other fields the fit keeps; ``compare``: the profile whose errors are
    printed beside the fit's. ``keep_crossed``: also fit the steps that ran while another device
    stepped (by default they are left out: they carry the host-wide interference, which the
    profile's ``cross_interference`` prices, estimated from them here). Returns the fitted profile."""
    from prism_serve.sim.cost import RooflineCostModel
    from prism_serve.sim.models import model_shape
    from step_overlap import IDLE, cross_estimate, device_steps, other_device_overlap, serving_estimate

    spec = model_shape("smollm2-135m", dtype_bytes=4)
    dirs = [(d, False) for d in train_dirs] + [(d, True) for d in held_dirs]
    traced, run, from_held = [], [], []
    for i, (d, is_held) in enumerate(dirs):
        part = device_steps([d])
        traced += part
        run += [i] * len(part)
        from_held += [is_held] * len(part)
    overlap = other_device_overlap(traced, run)
    solo = overlap <= IDLE
    steps = [(r, h) for (_, r), h, ok in zip(traced, from_held, solo, strict=True) if keep_crossed or ok]
    crossed = [r for (_, r), ok in zip(traced, solo, strict=True) if not ok]
    print(
        f"{len(crossed)} of {len(traced)} live steps overlapped another device's steps (> {IDLE:.0%} of "
        f"their wall time): {'fitted too' if keep_crossed else 'left out of the fit'}"
    )
    if not steps:
        raise SystemExit("no steps in the traces")
    held = np.array([h for _, h in steps])
    if not held_dirs:
        held = np.random.default_rng(0).random(len(steps)) < held_share
    batches = [[tuple(b) for b in r.batch] for r, _ in steps]
    y = np.array([r.cpu for r, _ in steps])
    wall = np.array([r.dt for r, _ in steps])
    weights = np.ones(len(steps))
    if balance_kinds:
        live_kinds = np.array([step_kind(b) for b in batches])
        present = [k for k in ("decode", "prefill", "mixed") if (~held & (live_kinds == k)).any()]
        for k in present:  # each kind's training steps together weigh len(steps) / len(present)
            sel = live_kinds == k
            weights[sel] = (~held).sum() / len(present) / max(1, (~held & sel).sum())
    source = np.array(["live"] * len(steps), dtype=object)
    if points is not None:
        pts = json.loads(points.read_text())["points"]
        p_held = np.array([p["held_out"] for p in pts])
        batches += [[tuple(b) for b in p["batch"]] for p in pts]
        y = np.concatenate([y, [min(p["times"]) for p in pts]])
        wall = np.concatenate([wall, y[len(steps) :]])
        share = points_weight / (1.0 - points_weight)  # the points' total weight over the steps'
        per_point = share * (~held).sum() / max(1, (~p_held).sum())
        weights = np.concatenate([weights, np.full(len(pts), per_point)])
        held = np.concatenate([held, p_held])
        source = np.concatenate([source, np.array(["points"] * len(pts), dtype=object)])
        print(f"with {len(pts)} measured points from {points} ({int((~p_held).sum())} training)")
    crossover, coef, pred = best_fit(spec, batches, y, ~held, base, weights, mem_bandwidth)
    hw = profile_from(coef, base, step_seconds="cpu")
    print(machine_info()["line"])
    print(
        f"{len(steps)} live steps ({int((~held).sum())} training, {int(held.sum())} held out) from "
        + ", ".join(str(d) for d in train_dirs + held_dirs)
    )
    share = (y / np.maximum(wall, 1e-9))[source == "live"]
    print(
        "CPU / wall per step (1: the step had its core): "
        + ", ".join(f"p{q} {np.percentile(share, q):.2f}" for q in (5, 25, 50, 75, 95))
    )
    alone = np.median(share[share >= 0.8])
    print(
        f"steps with no other engine busy on the core (CPU / wall >= 0.8): median share {alone:.3f}; the "
        f"rest went to the serving path and other processes, i.e. a live step lasts {1 / alone:.3f}x its "
        "CPU seconds (sim_vs_live.py --step-scale)"
    )
    print(
        f"target: CPU seconds per step{', step kinds weighted equally' if balance_kinds else ''}; "
        f"small-batch crossover {crossover:g} rows"
    )
    print_constants(hw)
    kinds = np.array([step_kind(b) for b in batches])
    # the host-wide term, from every live step that had its own core (CPU / wall >= 0.8)
    fitted = RooflineCostModel(hw)
    own = np.array([r.cpu / max(r.dt, 1e-9) >= 0.8 for _, r in traced])
    all_cpu = np.array([r.cpu for _, r in traced])
    all_wall = np.array([r.dt for _, r in traced])
    all_pred = np.array([predict(fitted, spec, [tuple(b) for b in r.batch]) for _, r in traced])
    all_kinds = np.array([step_kind([tuple(b) for b in r.batch]) for _, r in traced])
    # (what, how a step fares, of what, the profile field, its estimate and inputs, whether it is set)
    terms = (
        ("host-wide interference", "cost", "the CPU", "cross_interference", cross_estimate,
         lambda sel: (all_cpu[sel], all_pred[sel]), not keep_crossed),
        ("serving path", "last", "the wall over CPU", "serving_share", serving_estimate,
         lambda sel: (all_wall[sel], all_cpu[sel]), True),
    )  # fmt: skip
    for kind in ("decode", "prefill", "all"):
        sel = own & ((all_kinds == kind) if kind != "all" else True)
        for what, verb, of, field, estimate, inputs, sets in terms:
            est = estimate(*inputs(sel), overlap[sel])
            if est is None:
                continue
            print(
                f"{what}, {kind} steps: with another device stepping throughout they {verb} "
                f"{1 + est[0]:.3f}x {of} of steps with it idle ({est[1]} / {est[2]} steps): "
                f"{field} {est[0]:.3f}"
            )
            if kind == "all" and sets:
                hw = dataclasses.replace(hw, **{field: round(max(0.0, est[0]), 3)})
    registered = RooflineCostModel(compare)
    reg = np.array([predict(registered, spec, b) for b in batches])
    for name, p in (("fit", pred), (f"profile {compare.name}", reg)):
        print(f"{name}:")
        for src in ("live", "points"):
            for sel_name, sel in (("training", ~held), ("held out", held)):
                for kind in ("decode", "prefill", "mixed", "all"):
                    m = sel & (source == src) & ((kinds == kind) if kind != "all" else True)
                    if not m.any():
                        continue
                    e = np.abs(p[m] / y[m] - 1)
                    total = p[m].sum() / y[m].sum() - 1
                    print(
                        f"  {src:<6} {sel_name:<9} {kind:<8} {int(m.sum()):5d}  |error| mean {e.mean():6.1%} "
                        f"p90 {np.percentile(e, 90):6.1%} max {e.max():6.1%}  sum {total:+6.1%}"
                    )
    return hw
