"""How much slower an engine step gets while other engines on the same machine step too: measured on
real engines in real processes, for ``prism fit-hardware`` (the profile's ``share_interference`` and
``cross_interference``, sim/hardware.py) and ``benchmarks/cpu_sharing.py`` (the full table).

Each engine (the fitted model, ``fit.StepBench``, fp32, a KV pool of 256 MiB) runs in its own process
pinned the way a live CPU device runs its workers (runtime/devices.py ``pin_process``): ``Device`` is
one such device of one or more cores with up to three engine processes. A *point* starts n of them
stepping one shape (a decode batch at a context, or a prefill) at one instant, optionally with one
engine of a partner device on other cores, and stops them when each has ``min_steps`` steps and the
window has passed; only steps that ended before the stop count, so every counted step ran while all
of them had work. Engines outside a point sit blocked on a pipe (no CPU).

Other processes on a shared machine take part of the cores too, which moves wall times between
points. So each step's CPU time is recorded: on one core under processor sharing a step takes n times
its CPU time, and the CPU time per step (which other load barely changes) grows only by what sharing
costs beyond time slicing (caches, context switches). ``n x`` the CPU ratio is the slowdown a quiet
one-core device shows, to which the simulator's form n * (1 + a * (n - 1)) is fitted; one engine on
each of two cores gives the cross-core term (one memory system and last-level cache) the same way.

``measure_interference``: the quick version ``prism fit-hardware`` runs (about 40 s): each shape
alone, two engines on the fit's core, and one engine there with one on another core, each twice in
mirrored order.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field

import numpy as np

from prism_serve.engine.machine import cpu_seconds, pin_to_cores
from prism_serve.sim.fit import FitResult

__all__ = ["SHAPES", "Device", "Interference", "fit_interference", "measure_interference", "with_sharing"]

# (name, kind, args): decode (batch, context), prefill (tokens,)
SHAPES = [("decode 1 @256", "decode", (1, 256)), ("decode 8 @256", "decode", (8, 256))]
SHAPES += [("prefill 256", "prefill", (256,))]
DECODE_CHUNK = 8  # decode steps per set of requests; then they are aborted and added again
MAX_BUSY = 3
KV_BYTES = 256 << 20  # per engine: six processes with StepBench's default would not fit in memory


def _engine_process(name: str, cores: tuple[int, ...], conn, stop, counts, slot: int) -> None:
    """Pin like a live worker, load the engine, then run the points the parent sends."""
    import torch

    from prism_serve.sim.fit import StepBench

    pin_to_cores(cores)  # as a live CPU device's worker runs: its cores, a thread each
    bench = StepBench(1, kv_cache_bytes=KV_BYTES)
    for _, kind, args in SHAPES:  # warm-up, alone
        _run_steps(bench, kind, args, lambda: False, 2)
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
            _run_steps(bench, kind, args, stopped, DECODE_CHUNK, steps, counts, slot)
        conn.send((steps, time.process_time() - cpu0))
    bench.close()


def _run_steps(bench, kind, args, is_stopped, num_steps, steps=None, counts=None, slot=0) -> None:
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
        t0, c0 = time.perf_counter(), time.process_time()
        bench.engine.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if steps is not None:
            steps.append((wall, cpu, time.monotonic()))
            counts[slot] += 1
    bench.engine.abort_all()


class Device:
    """``slots`` engine processes pinned to ``cores`` (one torch thread per core)."""

    def __init__(self, ctx, name: str, cores: tuple[int, ...], slots: int = MAX_BUSY, log=None) -> None:
        self.name, self.cores = name, cores
        self.stop = ctx.Value("d", math.inf, lock=False)
        self.counts = ctx.Array("i", MAX_BUSY, lock=False)
        self.conns, self.procs = [], []
        try:
            for slot in range(slots):  # one at a time: loading is not what is measured
                parent, child = ctx.Pipe()
                args = (name, cores, child, self.stop, self.counts, slot)
                p = ctx.Process(target=_engine_process, args=args, daemon=True)
                p.start()
                self.procs.append(p)
                if not parent.poll(300):
                    raise RuntimeError(f"engine {slot} of {name} did not start")
                _, threads, affinity = parent.recv()
                if log is not None:
                    log(f"  {name} engine {slot}: pid {p.pid}, cores {affinity}, {threads} torch threads")
                self.conns.append(parent)
        except BaseException:
            self.close()
            raise

    def point(
        self, kind: str, args: tuple, n: int, min_steps: int, window: float, max_window: float,
        partner: Device | None = None,
    ) -> dict:  # fmt: skip
        """n engines step at once (and, with ``partner``, that device's first engine too, on its own
        cores). Per engine of this device, over the steps that ended in time: the mean wall and CPU
        time of a step (``step_s``, ``cpu_s``), the cores it got while stepping, its counted steps;
        the window, and the cores other processes used meanwhile (``other_load``)."""
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
            with contextlib.suppress(OSError):
                c.send(("exit",))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def fit_interference(values: dict[int, float]) -> float:
    """``a`` of slowdown(n) = n * (1 + a * (n - 1)), least squares over n -> slowdown."""
    x = np.array([n * (n - 1) for n in values], dtype=float)
    y = np.array([v - n for n, v in values.items()])
    return float(x @ y / (x @ x))


@dataclass(slots=True, frozen=True)
class Interference:
    """What ``measure_interference`` found: ``share`` (``share_interference``: two engines on one
    core: slowdown(2) = 2 * (1 + share) is 2 x their CPU time per step over the alone one's),
    ``cross`` (``cross_interference``), each None where it was not measured; and per shape the CPU
    time per step over the same engine's alone (``shared``: the two engines' mean)."""

    share: float | None
    cross: float | None
    shared: dict[str, float] = field(default_factory=dict)
    crossed: dict[str, float] = field(default_factory=dict)
    other_load: float = 0.0  # the most other processes used during a point, cores

    def decode_terms(self, cross: float) -> tuple[tuple[int, float, float], ...]:
        """The profile's ``decode_interference``: per decode shape measured, (its sequences, its
        share term, its cross term), each term its CPU ratio's excess over 1 (at least 0); a cross
        term not measured (no other core) is ``cross``. Empty where no decode shape was measured
        on one core with two engines."""
        out = []
        for name, kind, args in SHAPES:
            shared = self.shared.get(name, math.nan)
            if kind != "decode" or not math.isfinite(shared):
                continue
            crossed = self.crossed.get(name, math.nan)
            crossed = max(0.0, crossed - 1) if math.isfinite(crossed) else cross
            out.append((args[0], max(0.0, shared - 1), crossed))
        return tuple(sorted(out))

    def report(self) -> str:
        line = "compute sharing (real engines in their own processes): "
        if self.share is not None:
            line += (
                f"two on one core {2 * (1 + self.share):.2f}x a step alone (share_interference "
                f"{self.share:.3f}; CPU/step "
                + ", ".join(f"{s} {v:.3f}" for s, v in self.shared.items())
                + ")"
            )
        if self.cross is not None:
            line += (
                f"; one on each of two cores {1 + self.cross:.3f}x (cross_interference {self.cross:.3f}; "
                + ", ".join(f"{s} {v:.3f}" for s, v in self.crossed.items())
                + ")"
            )
        return line + f"; other load up to {self.other_load:.2f} cores"


def measure_interference(
    core: int, other_core: int | None, window_s: float = 1.0, min_steps: int = 4, log=None
) -> Interference:
    """Each shape alone on ``core``, two engines there at once, and (with ``other_core``) one there
    with one on ``other_core``, in the order alone, two, cross, cross, two, alone (a drift of the
    machine's speed during a shape cancels in the means); the CPU time per step against the alone
    one's, the median over shapes (negative medians, noise below processor sharing, read as 0)."""
    ctx = mp.get_context("spawn")
    dev = partner = None
    shared: dict[str, float] = {}
    crossed: dict[str, float] = {}
    load = 0.0
    try:
        dev = Device(ctx, "cpu:0", (core,), slots=2, log=log)
        if other_core is not None:
            partner = Device(ctx, "cpu:1", (other_core,), slots=1, log=log)
        for name, kind, shape in SHAPES:
            steps = 2 if kind == "prefill" else min_steps
            window = 2 * window_s if kind == "prefill" else window_s
            order = [(1, None), (2, None)] + ([(1, partner)] if partner is not None else [])
            cpu: dict[tuple[int, bool], list[float]] = {}
            for n, other in order + order[::-1]:
                p = dev.point(kind, shape, n, steps, window, 10 * window, partner=other)
                cpu.setdefault((n, other is not None), []).append(float(np.nanmean(p["cpu_s"])))
                load = max(load, p["other_load"])
            alone = float(np.mean(cpu[1, False]))
            shared[name] = float(np.mean(cpu[2, False])) / alone
            if partner is not None:
                crossed[name] = float(np.mean(cpu[1, True])) / alone
    finally:
        for d in (dev, partner):
            if d is not None:
                d.close()
    return Interference(_median_excess(shared), _median_excess(crossed), shared, crossed, load)


def _median_excess(ratios: dict[str, float]) -> float | None:
    """The median ratio's excess over 1 (at least 0), over the shapes measured (a point with no step
    in its window has none); None where none was."""
    v = [r for r in ratios.values() if math.isfinite(r)]
    return max(0.0, float(np.median(v)) - 1) if v else None


def with_sharing(result: FitResult, core: int | None = None) -> FitResult:
    """``result`` (``fit.fit_this_machine``'s, fitted on ``core``: default the last one this process
    may use, as there) with compute sharing measured on this machine (``measure_interference`` on
    that core and another one): its profile's ``share_interference`` and ``cross_interference``
    replaced by what was measured (the median over the shapes; the decode shapes' own terms in
    ``decode_interference``), and a report line saying what. Engines that cannot be started
    (no memory for more processes) or that die keep the base terms, and the report says why: the
    minutes of step fit before it are not lost."""
    import dataclasses

    affinity = os.sched_getaffinity(0)
    core = max(affinity) if core is None else core
    hw = result.profile
    try:
        found = measure_interference(core, min(affinity - {core}, default=None))
    except (OSError, RuntimeError, EOFError) as e:
        note = (
            f"compute sharing not measured ({type(e).__name__}: {e}): share_interference "
            f"{hw.share_interference:.3f} and cross_interference {hw.cross_interference:.3f} kept"
        )
        return dataclasses.replace(result, notes=(*result.notes, note))
    if found.share is not None:
        hw = dataclasses.replace(hw, share_interference=found.share)
    if found.cross is not None:
        hw = dataclasses.replace(hw, cross_interference=found.cross)
    if terms := found.decode_terms(hw.cross_interference):
        hw = dataclasses.replace(hw, decode_interference=terms)
    return dataclasses.replace(result, profile=hw, notes=(*result.notes, found.report()))
