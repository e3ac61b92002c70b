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

from common import REPO_ROOT, cpu_seconds, machine_info, wait_quiet

RAW = REPO_ROOT / "results" / "cpu_sharing.json"

# (name, kind, args): decode (batch, context), prefill (tokens,)
SHAPES = [("decode 1 @256", "decode", (1, 256)), ("decode 8 @256", "decode", (8, 256))]
SHAPES += [("prefill 256", "prefill", (256,))]
DECODE_CHUNK = 8  # decode steps per set of requests; then they are aborted and added again
MAX_BUSY = 3
CROSS = "cross"  # the group of points with one busy engine on each of two one-core devices
QUIET = 0.15  # other load (cores) under which a point counts as measured on a quiet machine


# -- one engine process -----------------------------------------------------------------------------


class Engine:
    """The real engine as fit_cpu_profile.py's Bench sets it up, with a KV pool of 256 MiB (six
    processes with Bench's 4 GiB would not fit in this machine's memory; the pool size does not
    change the step time)."""

    def __init__(self) -> None:
        from prism_serve.engine.llm_engine import EngineConfig, LLMEngine

        config = EngineConfig(
            model="smollm2-135m-instruct", dtype="float32", max_num_seqs=64, kv_cache_bytes=256 << 20
        )
        self.engine = LLMEngine(config)
        self.rng = np.random.default_rng(0)

    def add(self, prompt: int, cached: int, max_tokens: int) -> None:
        """A request of ``prompt`` tokens whose first ``cached`` are allocated, not computed."""
        from prism_serve.engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = self.engine.add_request(self.rng.integers(17, 49152, prompt).tolist(), params)
        if cached:
            seq = self.engine._requests[req]
            if not self.engine.scheduler._grow(seq, cached):
                raise RuntimeError("KV cache too small for the point")
            seq.num_computed_tokens = cached

    def step(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process: every torch thread) of one engine step."""
        t0, c0 = time.perf_counter(), time.process_time()
        self.engine.step()
        return time.perf_counter() - t0, time.process_time() - c0


def engine_process(name: str, cores: tuple[int, ...], conn, stop, counts, slot: int) -> None:
    """Pin like a live worker, load the engine, then run the points the parent sends."""
    import torch

    from prism_serve.runtime.devices import DeviceSpec, pin_process

    pin_process(DeviceSpec(name, 1 << 30, cores, 1))
    bench = Engine()
    for _, kind, args in SHAPES:  # warm-up, alone
        run_steps(bench, kind, args, lambda: False, 2)
    conn.send(("ready", torch.get_num_threads(), sorted(os.sched_getaffinity(0))))
    parent = os.getppid()
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent:  # the parent was killed: do not linger
                return
        msg = conn.recv()
        if msg[0] == "exit":
            break
        _, kind, args, start_at = msg
        while time.monotonic() < start_at:
            time.sleep(max(0.0, min(0.01, start_at - time.monotonic())))
        cpu0 = time.process_time()
        steps: list[tuple[float, float, float]] = []  # (wall s, CPU s, monotonic end) of each step

        def stopped() -> bool:
            return time.monotonic() >= stop.value or os.getppid() != parent

        while not stopped():
            run_steps(bench, kind, args, stopped, DECODE_CHUNK, steps, counts, slot)
        conn.send((steps, time.process_time() - cpu0))
    bench.engine.close()


def run_steps(bench, kind, args, is_stopped, num_steps, steps=None, counts=None, slot=0) -> None:
    """Up to ``num_steps`` steps of one shape (a decode set of requests; one prefill); each step's
    (wall, CPU, end) goes to ``steps``, and ``counts[slot]`` counts them for the parent."""
    if kind == "prefill":
        bench.add(args[0], 0, 1)
        num_steps = 1
    else:
        batch, context = args
        for _ in range(batch):  # the last prompt token is the first step's decode input
            bench.add(context, context - 1, num_steps + 1)
    for _ in range(num_steps):
        if is_stopped():
            break
        wall, cpu = bench.step()
        if steps is not None:
            steps.append((wall, cpu, time.monotonic()))
            counts[slot] += 1
    bench.engine.abort_all()


# -- the parent: points and rounds ------------------------------------------------------------------


class Device:
    """MAX_BUSY engine processes pinned to ``cores``."""

    def __init__(self, ctx, name: str, cores: tuple[int, ...], slots: int = MAX_BUSY) -> None:
        self.name, self.cores = name, cores
        self.stop = ctx.Value("d", math.inf, lock=False)
        self.counts = ctx.Array("i", MAX_BUSY, lock=False)
        self.conns, self.procs = [], []
        for slot in range(slots):  # one at a time: loading is not what is measured
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=engine_process, args=(name, cores, child, self.stop, self.counts, slot), daemon=True
            )
            p.start()
            _, threads, affinity = parent.recv()
            print(
                f"  {name} engine {slot}: pid {p.pid}, cores {affinity}, {threads} torch threads", flush=True
            )
            self.conns.append(parent)
            self.procs.append(p)

    def point(
        self, kind: str, args: tuple, n: int, min_steps: int, window: float, max_window: float,
        partner: Device | None = None,
    ) -> dict:  # fmt: skip
        """n engines step at once (and, with ``partner``, that device's first engine too, on its own
        cores). Per engine of this device, over the steps that ended in time: the mean wall and CPU
        time of a step, and the cores it got while stepping (CPU / wall)."""
        both = [self] + ([partner] if partner else [])
        for dev in both:
            dev.stop.value = math.inf
            for i in range(MAX_BUSY):
                dev.counts[i] = 0
        start, t0 = cpu_seconds(), time.monotonic()
        start_at = t0 + 0.1
        conns = self.conns[:n] + (partner.conns[:1] if partner else [])
        for c in conns:
            c.send(("run", kind, args, start_at))
        while True:
            time.sleep(0.05)
            elapsed = time.monotonic() - start_at
            done = min(self.counts[:n]) >= min_steps and (partner is None or partner.counts[0] >= min_steps)
            if elapsed >= max_window or (elapsed >= window and done):
                stop_at = time.monotonic()
                for dev in both:
                    dev.stop.value = stop_at
                break
        everything = [c.recv() for c in conns]
        results = everything[:n]
        wall = time.monotonic() - t0
        busy, own = cpu_seconds()
        engines_cpu = sum(cpu for _, cpu in everything)
        other = max(0.0, (busy - start[0] - (own - start[1]) - engines_cpu) / wall)
        out: dict = {"step_s": [], "cpu_s": [], "cores": [], "steps": []}
        for steps, _ in results:
            counted = np.array([(w, c) for w, c, end in steps if end <= stop_at]).reshape(-1, 2)
            if len(counted):
                wall, cpu = counted.mean(axis=0)
            else:  # no step ended in the window: the step took at least the window (a lower bound)
                wall, cpu = stop_at - start_at, math.nan
            out["step_s"].append(float(wall))
            out["cpu_s"].append(float(cpu))
            out["cores"].append(
                float(counted[:, 1].sum() / counted[:, 0].sum()) if len(counted) else math.nan
            )
            out["steps"].append(len(counted))
        return {**out, "window_s": stop_at - start_at, "other_load": other}

    def close(self) -> None:
        for c in self.conns:
            c.send(("exit",))
        for p in self.procs:
            p.join(30)


def measure(args) -> dict:
    ctx = mp.get_context("spawn")
    info = machine_info()
    print(info["line"], flush=True)
    devices = {}
    groups = [g.strip() for g in args.groups.split(",")]
    for label, cores in (("1 core", (args.core,)), ("2 cores", (0, 1))):
        if label in groups or (label == "1 core" and CROSS in groups):
            print(f"starting the engines of the device of {label} (cores {cores})", flush=True)
            devices[label] = Device(ctx, f"cpu:{len(devices)}", cores)
    partner = None
    if CROSS in groups:  # one engine on the other core: a second one-core device of this host
        other = 1 - args.core if args.core in (0, 1) else 0
        print(f"starting the engine of a second one-core device (core {other})", flush=True)
        partner = Device(ctx, f"cpu:{len(devices) + 1}", (other,), slots=1)
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


def fit_interference(values: dict[int, float]) -> float:
    """``a`` of slowdown(n) = n * (1 + a * (n - 1)), least squares over n -> slowdown."""
    x = np.array([n * (n - 1) for n in values], dtype=float)
    y = np.array([v - n for n, v in values.items()])
    return float(x @ y / (x @ x))


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
