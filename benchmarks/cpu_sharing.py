"""How much slower an engine step gets while 2 or 3 engines on one CPU device are busy at once.

Real engines in real processes: each engine (SmolLM2-135M-Instruct, real weights, fp32, as
fit_cpu_profile.py loads it) runs in its own process pinned the way a live CPU device runs its
workers (runtime/devices.py ``pin_process``): a device of ONE core (``--core``, one torch thread) and
a device of TWO cores (0-1, two torch threads each). For each device, step shape and number of busy
engines n (1, 2, 3), the first n engines of that device step in a loop from a common start time
until each has finished ``--min-steps`` steps and ``--window`` seconds passed (``--max-window`` at
most); only steps that ended before the stop time count, so every counted step ran while all n
engines had work. Engines that are not part of a point sit blocked on a pipe (no CPU). The baseline
is n = 1, the same engine alone on the same device, in the same round.

Shapes: a decode batch of 1 and of 8 at context 256 (contexts allocated, not computed, as in
fit_cpu_profile.py) and a prefill of 256 tokens. Every round measures every point (rounds wait for
quiet CPUs first, ``--quiet-wait`` at most); each point records the CPU other processes used
meanwhile ("other load", cores); with ``--retries`` the three points of a shape are measured again
when one had more than ``--max-load`` (the attempt with less load is kept). The wall ratio of a point
is the mean step time of its n engines over the alone step time of the same round; the table gives
the median over rounds, the spread (min..max) and the median over quiet rounds only.

Other processes on a shared machine take part of the device's cores too, alone or not, which pulls
the wall ratio toward 1 (or, when their load changes between points, anywhere). So each step's CPU
time is recorded as well: on one core under processor sharing a step takes n times its CPU time, and
the CPU time per step (which other load barely changes) grows only by what sharing costs beyond time
slicing (caches, switches). ``n x CPU`` is therefore the slowdown a quiet one-core device would show;
the one-core form n * (1 + a * (n - 1)) (sim/hardware.py ``share_slowdown``) is fitted to it.
The ``cross`` group puts one engine on each of two one-core devices (``--core`` and the other
core) and compares the first one's CPU time per step with its steps while the other core is idle:
the cores share the socket's memory bandwidth and last-level cache, which the simulator prices with
``cross_interference`` (sim/hardware.py ``cross_slowdown``).
Two-thread engines on two cores spin at OpenMP barriers while a thread waits for a core, so there
the CPU time itself grows and no such estimate is made: their wall ratios are printed as measured.

    python benchmarks/cpu_sharing.py                 # measure (3-5 min a round: 12-20 min) and print
    python benchmarks/cpu_sharing.py --reuse         # print the saved measurements again
    python benchmarks/cpu_sharing.py --groups cross  # only the two-device points (4 min a round)
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from common import REPO_ROOT, machine_info, wait_quiet
from prism_serve.sim.sharing import MAX_BUSY, SHAPES, Device, fit_interference

RAW = REPO_ROOT / "results" / "cpu_sharing.json"

CROSS = "cross"  # the group of points with one busy engine on each of two one-core devices
QUIET = 0.15  # other load (cores) under which a point counts as measured on a quiet machine


def _log(line: str) -> None:
    print(line, flush=True)


def measure(args) -> dict:
    ctx = mp.get_context("spawn")
    info = machine_info()
    print(info["line"], flush=True)
    devices = {}
    groups = [g.strip() for g in args.groups.split(",")]
    for label, cores in (("1 core", (args.core,)), ("2 cores", (0, 1))):
        if label in groups or (label == "1 core" and CROSS in groups):
            print(f"starting the engines of the device of {label} (cores {cores})", flush=True)
            devices[label] = Device(ctx, f"cpu:{len(devices)}", cores, log=_log)
    partner = None
    if CROSS in groups:  # one engine on the other core: a second one-core device of this host
        other = 1 - args.core if args.core in (0, 1) else 0
        print(f"starting the engine of a second one-core device (core {other})", flush=True)
        partner = Device(ctx, f"cpu:{len(devices) + 1}", (other,), slots=1, log=_log)
    rounds = []
    t_all = time.monotonic()
    for r in range(args.rounds):
        t0 = time.monotonic()
        points = []
        plan = [(label, dev, None) for label, dev in devices.items() if label in groups]
        if partner is not None:
            plan.append((CROSS, devices["1 core"], partner))
        for label, dev, other_dev in plan:
            # cross: the one-core device's first engine alone (n=1) and with the other core's engine
            # stepping the same shape (n=2); the number is the engines busy on the host
            ns = (1, 2) if other_dev else tuple(range(1, MAX_BUSY + 1))
            order = ns if r % 2 == 0 else ns[::-1]  # alternate rounds go down: drift cancels
            for name, kind, shape in SHAPES:
                min_steps = 2 if kind == "prefill" else args.min_steps
                window = 2 * args.window if kind == "prefill" else args.window
                attempts = []
                for attempt in range(args.retries + 1):
                    wait_quiet(args.quiet_wait, 0.15)
                    group = []
                    for n in order:
                        # cross: this device's one engine, with the partner stepping at n = 2
                        engines, partner_now = (1, other_dev if n == 2 else None) if other_dev else (n, None)
                        p = dev.point(kind, shape, engines, min_steps, window, args.max_window, partner_now)
                        group.append({"device": label, "shape": name, "n": n, "attempt": attempt, **p})
                        print(
                            f"  {label} {name} n={n}: step {np.mean(p['step_s']) * 1e3:.1f} ms "
                            f"(CPU {np.mean(p['cpu_s']) * 1e3:.1f} ms), {min(p['steps'])}+ steps in "
                            f"{p['window_s']:.1f} s, engines got {np.nansum(p['cores']):.2f} cores, "
                            f"other load {p['other_load']:.2f}",
                            flush=True,
                        )
                    attempts.append(group)
                    if max(p["other_load"] for p in group) <= args.max_load:
                        break
                points += min(attempts, key=lambda g: max(p["other_load"] for p in g))
        rounds.append(points)
        loads = [p["other_load"] for p in points]
        print(
            f"round {r + 1}/{args.rounds}: {time.monotonic() - t0:.0f} s, other load "
            f"{min(loads):.2f}..{max(loads):.2f} cores",
            flush=True,
        )
    for dev in [*devices.values(), *([partner] if partner else [])]:
        dev.close()
    print(f"measured in {time.monotonic() - t_all:.0f} s")
    return {"machine": info["line"], "date": time.strftime("%Y-%m-%d"), "rounds": rounds}


# -- report -----------------------------------------------------------------------------------------


def ratios(raw: dict) -> dict[tuple[str, str, int], dict[str, list[float]]]:
    """(device, shape, n) -> per round: ``wall`` (mean step of the n engines / the alone step),
    ``cpu`` (the same for CPU time per step), ``cores`` (cores the n engines got together), the
    alone step ``alone_ms``, ``other`` load (the point's and its baseline's, whichever is more) and the
    fewest ``steps`` one engine counted."""
    out: dict = {}
    for points in raw["rounds"]:
        alone = {(p["device"], p["shape"]): p for p in points if p["n"] == 1}
        for p in points:
            a = alone[(p["device"], p["shape"])]
            r = out.setdefault((p["device"], p["shape"], p["n"]), {})
            r.setdefault("wall", []).append(float(np.mean(p["step_s"])) / a["step_s"][0])
            cpu = [c for c in p["cpu_s"] if not math.isnan(c)]
            r.setdefault("cpu", []).append(float(np.mean(cpu)) / a["cpu_s"][0] if cpu else math.nan)
            r.setdefault("cores", []).append(float(np.nansum(p["cores"])))
            r.setdefault("alone_ms", []).append(a["step_s"][0] * 1e3)
            r.setdefault("other", []).append(max(p["other_load"], a["other_load"]))
            r.setdefault("steps", []).append(min(p["steps"]))
    return out


def spread(v: list[float]) -> str:
    v = [x for x in v if not math.isnan(x)]
    return f"{np.median(v):5.2f} ({min(v):.2f}..{max(v):.2f})" if v else "-"


def report(raw: dict) -> None:
    """The table, and the one-core form fitted to the quiet-machine estimates."""
    print(f"machine: {raw['machine']}; measured {raw['date']}; {len(raw['rounds'])} rounds")
    rs = ratios(raw)
    print(
        f"{'device':<8} {'shape':<14} {'n':>2} {'alone ms':>8} {'wall ratio':>18} {'quiet':>11} "
        f"{'CPU/step ratio':>17} {'n x CPU':>7} {'got':>5} {'other load':>17} {'steps':>5}"
    )
    estimate: dict[int, list[float]] = {}
    for (dev, shape, n), r in rs.items():
        est = "-"
        if dev == "1 core":
            cpu = [c for c in r["cpu"] if not math.isnan(c)]
            est = f"{n * np.median(cpu):.2f}"
            if n > 1:
                estimate.setdefault(n, []).append(n * float(np.median(cpu)))
        quiet = [w for w, o in zip(r["wall"], r["other"], strict=True) if o <= QUIET]
        print(
            f"{dev:<8} {shape:<14} {n:>2} {np.median(r['alone_ms']):>8.1f} {spread(r['wall']):>18} "
            f"{(f'{np.median(quiet):.2f} ({len(quiet)})' if quiet else '-'):>11} {spread(r['cpu']):>17} "
            f"{est:>7} {np.median(r['cores']):>5.2f} {spread(r['other']):>17} {min(r['steps']):>5}"
        )
    print(
        "wall ratio: mean step of the n engines over the engine alone on the same device in the same\n"
        f"round, median (min..max) over rounds; quiet: its median over the rounds where other load was\n"
        f"<= {QUIET} cores (how many); CPU/step ratio: the same for CPU seconds per step; n x CPU: the wall\n"
        "ratio a quiet one-core device would show under processor sharing (each of n engines gets 1/n of\n"
        "the core, so a step takes n times its CPU time); got: cores the n engines used together while\n"
        "stepping (median); other load: cores other processes used (the point's or its baseline's, the\n"
        "larger); steps: fewest counted steps of one engine in a round (0: the point hit --max-window,\n"
        "its wall ratio is a lower bound and its CPU time unknown)"
    )
    if estimate:
        per_n = {n: float(np.median(v)) for n, v in estimate.items()}
        a = fit_interference(per_n)
        print(
            "one core, quiet-machine estimate (median over shapes): "
            + ", ".join(f"n={n}: {v:.2f}" for n, v in per_n.items())
            + f"; fitted slowdown(n) = n * (1 + a * (n - 1)), a = {a:.3f} ("
            + ", ".join(f"n={n}: {n * (1 + a * (n - 1)):.2f}" for n in per_n)
            + ")"
        )
    cross = {shape: r for (dev, shape, n), r in rs.items() if dev == CROSS and n == 2}
    if cross:
        per_shape = {shape: float(np.nanmedian(r["cpu"])) for shape, r in cross.items()}
        c = float(np.median(list(per_shape.values()))) - 1.0
        print(
            f"{CROSS}: one engine on each of two one-core devices; the CPU time per step of the first, over "
            "the same engine alone (the other core idle), by shape: "
            + ", ".join(f"{shape} {v:.3f}" for shape, v in per_shape.items())
            + f"; cross_interference (median over shapes) {c:.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)), help="the one-core device")
    ap.add_argument("--min-steps", type=int, default=6, help="decode steps per engine and point (prefill: 2)")
    ap.add_argument("--window", type=float, default=1.5, help="decode point length at least, s (prefill 2x)")
    ap.add_argument("--max-window", type=float, default=10.0, help="seconds per point at most")
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="wait for quiet CPUs, s at most")
    ap.add_argument("--max-load", type=float, default=0.3, help="other load (cores) that repeats a group")
    ap.add_argument("--retries", type=int, default=0, help="repeats of a group measured under more load")
    ap.add_argument("--raw", type=Path, default=RAW, help="measurements are saved here")
    ap.add_argument("--reuse", action="store_true", help="print the saved measurements, measure nothing")
    ap.add_argument(
        "--groups", default=f"1 core,2 cores,{CROSS}",
        help="which points: '1 core' and '2 cores' (1-3 engines on that device), "
        f"'{CROSS}' (one engine on each of two one-core devices); comma-separated",
    )  # fmt: skip
    args = ap.parse_args()
    if args.reuse:
        raw = json.loads(args.raw.read_text())
    else:
        if len(os.sched_getaffinity(0)) < 2:
            raise SystemExit("needs cores 0 and 1")
        raw = measure(args)
        args.raw.parent.mkdir(parents=True, exist_ok=True)
        args.raw.write_text(json.dumps(raw))
        print(f"measurements saved to {args.raw}")
    report(raw)


if __name__ == "__main__":
    main()
