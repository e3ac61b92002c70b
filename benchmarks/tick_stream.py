"""Token streams while the control plane ticks over 10,000 registered models.

A real `prism serve` process (uvicorn, the controller, one worker with the real SmolLM2-135M-Instruct)
registers ``--models`` models over the same weights (one host copy, one tokenizer): a deployment of
many fine-tunes is this to the control plane, which walks every model at each tick (prewarming
ranks every evicted model). The server's main thread, and the placement thread it starts, have the
first CPU core; the worker and this client share the last. The client streams ``--streams``
completions of ``--tokens`` tokens each from the pinned model, one after another, and records the
gap between consecutive tokens as it receives them. Three servers, one after another, in one run:

- ``paused``: ticks every hour (none during the streams): the baseline;
- ``thread``: ticks every ``--tick`` s, each placement decided on the placement thread (default);
- ``loop``: the same ticks decided on the event loop (``placement_thread: false``), as before.

Prints each setting's gap p50/p99/max and its p99 over the paused one (target <= 1.2x). Nothing is
asserted.

With the default ``--settle`` the streams run during the start-up fill: prewarming activates
fine-tunes into the device's free memory, each in a worker of its own that starts on the device's
core, beside the streaming engine, in every setting (``paused`` too: a finished activation asks
for the next placement at once). ``--settle 90`` lets the fill finish first (about 30 s here), so
what is left between the settings is the ticks alone.

    python benchmarks/tick_stream.py                    # the recorded run
    python benchmarks/tick_stream.py --settle 90        # after the start-up fill
    python benchmarks/tick_stream.py --models 2000 --streams 2 --tokens 64   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from openai import OpenAI

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def config_text(models: int, tick: float, on_thread: bool, core: int) -> str:
    names = "\n".join(f"  - {{name: ft{i:05d}, source: smollm2-135m-instruct}}" for i in range(models - 1))
    return (
        f'devices: [{{name: "cpu:0", memory: 4GiB, cores: "{core}", workers: 1}}]\n'
        f"models:\n  - {{name: smol, pinned: true}}\n{names}\n"
        f"policy: {{tick_interval_s: {tick}, placement_thread: {str(on_thread).lower()}}}\n"
        f'server: {{namespace: "tick-{uuid.uuid4().hex[:6]}"}}\n'
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def stream_gaps(port: int, streams: int, tokens: int) -> list[float]:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
    client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0)  # warm
    gaps: list[float] = []
    for _ in range(streams):
        last = None
        stream = client.completions.create(
            model="smol", prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if not chunk.choices or not chunk.choices[0].text:
                continue
            t = time.perf_counter()
            if last is not None:
                gaps.append(t - last)
            last = t
    return gaps


def run(setting: str, args: argparse.Namespace, core: int, server_core: int, work: Path) -> dict:
    tick = 3600.0 if setting == "paused" else args.tick
    config = work / f"{setting}.yaml"
    config.write_text(config_text(args.models, tick, setting != "loop", core))
    port = free_port()
    t0 = time.perf_counter()
    proc = start_server_process(config, port, work / f"{setting}.log", timeout_s=900)
    started = time.perf_counter() - t0
    # the server's main thread (and the placement thread it starts later) has the first core to
    # itself; this client shares the last with the worker
    os.sched_setaffinity(proc.pid, {server_core})
    try:
        time.sleep(args.settle)  # the first ticks (prewarming decisions) before the streams
        cpu0, w0 = common.cpu_seconds(), time.perf_counter()
        gaps = stream_gaps(port, args.streams, args.tokens)
        load = common.other_load_since(cpu0, time.perf_counter() - w0)
    finally:
        stop_server_process(proc)
    ms = 1e3
    return {
        "setting": setting,
        "start_s": started,
        "gaps": len(gaps),
        "gap_ms": {
            "p50": statistics.median(gaps) * ms,
            "p99": pct(gaps, 0.99) * ms,
            "max": max(gaps) * ms,
        },
        "server_and_worker_cores": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=10_000)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--tick", type=float, default=0.5, help="tick interval of the ticking settings (s)")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between start-up and the streams")
    ap.add_argument("--settings", default="paused,thread,loop")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    machine = common.machine_info()
    os.sched_setaffinity(0, {cores[-1]})  # this client beside the worker (and what the server forks)
    print(machine["line"])
    print(f"{args.models} models, {args.streams} streams x {args.tokens} tokens, ticks every {args.tick} s")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.settings.split(","):
            r = run(setting, args, cores[-1], cores[0], Path(tmp))
            results.append(r)
            g = r["gap_ms"]
            print(
                f"{setting:7s} start {r['start_s']:5.1f} s  gaps {r['gaps']}  p50 {g['p50']:6.1f} ms  "
                f"p99 {g['p99']:6.1f} ms  max {g['max']:6.1f} ms"
            )
    base = next((r for r in results if r["setting"] == "paused"), None)
    if base is not None:
        for r in results:
            if r is not base:
                ratio = r["gap_ms"]["p99"] / base["gap_ms"]["p99"]
                r["p99_vs_paused"] = ratio
                print(f"{r['setting']}: p99 gap {ratio:.2f}x paused (target <= 1.2x)")
    print(json.dumps({"machine": machine, "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
