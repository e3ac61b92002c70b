"""How long this machine's runtime takes to activate each of a deployment's models on a one-core
device: the activation cost ``prism fit-hardware --shapes`` measures for the simulator.

A real controller with one CPU device on ``core`` (its pooled workers, host weight cache and spare
pages, as ``prism serve`` runs them, with the deployment's device budget) activates the models in
turn for ``rounds`` rounds, each beside the one before where both fit and after it otherwise, as a
serving device swaps; the first round (every worker's first pages, the host cache being filled)
is left out. Each activation's phases are the worker's own (``ActivationPhases``: take, map, copy,
ready), so the copy's rate on one core and the time around it are measured apart, per model.

    python -m prism_serve.runtime.activation_probe --core 1 random:smollm2-360m smollm2-135m-instruct

prints one JSON object: per source, its weight bytes and the medians of its activations' phases
(or why it could not be activated).
The simulator may not import the runtime, so sim/activations.py runs this module as a process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid

from prism_serve.config import PolicyConfig
from prism_serve.engine.config import EngineConfig
from prism_serve.errors import PrismError
from prism_serve.memory.ledger import ledger_dir
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec

PHASES = ("take_s", "map_s", "copy_s", "ready_s")
ROOM = 0.8  # two models' weights stay under this share of the budget to be resident together


async def probe(sources: list[str], core: int, rounds: int, budget: int, dtype: str) -> dict[str, dict]:
    """Per source: ``weight_bytes`` and the median seconds of each of ``PHASES`` over its
    activations after the first round, their sum (``total_s``) and its unloads' (``evict_s``); or
    ``error``, why the runtime could not activate it (the others are measured still)."""
    ns = f"probe{uuid.uuid4().hex[:8]}"
    device = DeviceSpec("cpu:0", budget, (core,), 2)
    # one source alone rotates with a twin of itself, so that it too activates beside a resident model
    names = sources if len(sources) > 1 else sources * 2
    specs = [
        ModelSpec(f"m{i}", source=s, engine=EngineConfig(dtype=dtype, max_model_len=2048))
        for i, s in enumerate(names)
    ]
    c = Controller([device], specs, PolicyConfig(tick_interval_s=3600), namespace=ns)
    runs: dict[str, list] = {s: [] for s in sources}
    failed: dict[str, str] = {}  # a source the runtime could not activate, and why
    weights: dict[str, int] = {}  # each model's weight bytes, from its first activation
    evictions: dict[str, list[float]] = {s: [] for s in sources}  # seconds to unload, per source
    resident: str | None = None
    source_of = {spec.name: spec.source for spec in specs}

    async def evict(name: str, r: int) -> None:
        t0 = time.monotonic()
        await c.unload(name)
        if r > 0:
            evictions[source_of[name]].append(time.monotonic() - t0)

    try:
        await c.start()
        for r in range(rounds + 1):
            for spec in specs:
                if spec.source in failed:
                    continue
                try:
                    # as a serving device swaps: the model before stays resident while this one
                    # activates (on another worker, in that worker's spare pages and new ones)
                    # where both fit the budget with room for KV; else it goes first
                    both = weights.get(spec.name, budget) + weights.get(resident or "", budget)
                    if resident is not None and both > ROOM * budget:
                        await evict(resident, r)
                        resident = None
                    phases = await c.load(spec.name, "cpu:0")
                    if resident is not None:
                        await evict(resident, r)
                    resident = spec.name
                except PrismError as e:
                    failed[spec.source] = f"{type(e).__name__}: {e}"
                    continue
                if phases is not None:
                    weights[spec.name] = phases.copy_bytes
                    if r > 0:
                        runs[spec.source].append(phases)
                await asyncio.sleep(0.2)  # the idle workers' spare pages, made between activations
    finally:
        await c.stop()
        for p in ledger_dir().glob(f"prism-ledger-{ns}-*"):
            p.unlink(missing_ok=True)
    out: dict[str, dict] = {source: {"error": why} for source, why in failed.items()}
    for source, ps in runs.items():
        if not ps:
            continue
        row = {k: statistics.median(getattr(p, k) for p in ps) for k in PHASES}
        row["total_s"] = statistics.median(p.total_s for p in ps)
        # its unloads: the engine stopped and its pages unmapped, which an activation that the same
        # decision ordered after them waits for
        row["evict_s"] = statistics.median(evictions[source]) if evictions[source] else None
        row["weight_bytes"] = ps[0].copy_bytes
        row["activations"] = len(ps)
        out[source] = row
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", help="model sources, as a deployment names them")
    p.add_argument("--core", type=int, default=None, help="the device's one core (default: the last)")
    p.add_argument("--rounds", type=int, default=3, help="rounds measured after the first")
    p.add_argument("--memory", type=int, default=6 << 30, help="the device's budget in bytes")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    sources = list(dict.fromkeys(args.sources))
    result = asyncio.run(probe(sources, core, args.rounds, args.memory, args.dtype))
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
