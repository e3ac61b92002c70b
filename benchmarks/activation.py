"""Model activation latency: a pooled worker activating from the host weight cache vs a
cold start (new process, weights read from disk, engine built), in the same run, for the real
SmolLM2-135M-Instruct (fp32) and a SYNTHETIC-weights Llama-3.2-1B shape (bf16, ~2.5 GB, written to
disk as safetensors first so both paths read a real file).

Pooled = ``Controller.load`` wall time (decision -> engine ready), with its phases (take, map,
copy, ready); the worker and the host cache already exist, as they do in a running server. Cold =
``subprocess`` start -> the child printed READY after ``LLMEngine(...)`` over weights it loaded
from disk. The weight copy's bytes/s is compared with this machine's memcpy bandwidth, measured
here with one ``memmove`` of 512 MiB between pre-faulted buffers.

    python benchmarks/activation.py             # the recorded run
    python benchmarks/activation.py --quick     # SmolLM2 only, fewer repeats
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import torch

import common
from prism_serve.config import PolicyConfig
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.weights import load_weights, save_hf_dir
from prism_serve.memory.ledger import ledger_dir
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec

GiB = 2**30

_COLD_CHILD = """
import sys, time
from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype=sys.argv[2], max_model_len=2048,
                                kv_cache_bytes=64 * 2**20))
print("READY", flush=True)
"""


def memcpy_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), num_bytes)
        best = max(best, num_bytes / (time.perf_counter() - t0))
    return best


def cold_start(source: str, dtype: str) -> float:
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", _COLD_CHILD, source, dtype], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    elapsed = time.monotonic() - t0
    proc.wait()
    if line.strip() != "READY":
        raise RuntimeError(f"cold start of {source} failed")
    return elapsed


async def pooled(spec: ModelSpec, repeats: int, budget: int, spare_pages: bool) -> dict:
    """Activations that alternate between two model names over the same weights (two engines, one
    host cache file), each unloaded before the next: with ``spare_pages`` the next activation
    takes the pages the last one left (or that were made ahead of time); without, it creates them."""
    ns = f"bench{uuid.uuid4().hex[:8]}"
    device = DeviceSpec("cpu:0", budget, (), 1)  # every core: the loader threads may use them all
    specs = [spec, dataclasses.replace(spec, name=spec.name + "-b")]
    c = Controller(
        [device], specs, PolicyConfig(tick_interval_s=3600, spare_pages=spare_pages), namespace=ns
    )
    try:
        await c.start()
        await asyncio.sleep(1.0)  # the idle worker makes its spare pages now, as in a running server
        runs = []
        for i in range(repeats + 1):
            name = specs[i % 2].name
            common.wait_quiet(30, 0.3)
            start = common.cpu_seconds()
            t0 = time.monotonic()
            phases = await c.load(name, "cpu:0")
            wall = time.monotonic() - t0
            other = common.other_load_since(start, wall)
            await c.unload(name)
            runs.append(
                {"wall_s": wall, "phases": json.loads(_dump(phases)), "other_load": other, "first": i == 0}
            )
        return {"runs": runs, "cache_load_s": c.cache.get(spec.name).load_s}
    finally:
        await c.stop()
        for p in ledger_dir().glob(f"prism-ledger-{ns}-*"):
            p.unlink(missing_ok=True)


def _dump(phases) -> str:

    d = msgspec.structs.asdict(phases)
    d["total_s"] = phases.total_s
    return json.dumps(d)


def _warm(pool: dict) -> tuple[float, dict]:
    warm = [r for r in pool["runs"] if not r["first"]]
    phases = {
        k: statistics.median(r["phases"][k] for r in warm)
        for k in ("take_s", "map_s", "copy_s", "ready_s", "created_pages", "reused_pages")
    }
    return statistics.median(r["wall_s"] for r in warm), phases


def measure(name: str, source: str, dtype: str, repeats: int, budget: int, bw: float) -> dict:
    spec = ModelSpec(name, source=source, engine=EngineConfig(dtype=dtype, max_model_len=2048))
    fresh = asyncio.run(pooled(spec, repeats, budget, spare_pages=False))
    pool = asyncio.run(pooled(spec, repeats, budget, spare_pages=True))
    colds = []
    for _ in range(max(2, repeats // 2)):
        common.wait_quiet(30, 0.3)
        colds.append(cold_start(source, dtype))
    warm = [r for r in pool["runs"] if not r["first"]]
    wall = statistics.median(r["wall_s"] for r in warm)
    copy_bw = statistics.median(r["phases"]["copy_bytes"] / r["phases"]["copy_s"] for r in warm)
    cold = statistics.median(colds)
    fresh_wall, fresh_phases = _warm(fresh)
    _, spare_phases = _warm(pool)
    out = {
        "model": name,
        "source": source,
        "dtype": dtype,
        "weight_bytes": warm[0]["phases"]["copy_bytes"],
        "pooled_s": wall,
        "pooled_first_in_worker_s": pool["runs"][0]["wall_s"],
        "phases_median": spare_phases,
        "without_spare_pages": {
            "pooled_s": fresh_wall,
            "first_in_worker_s": fresh["runs"][0]["wall_s"],
            "phases_median": fresh_phases,
        },
        "spare_vs_fresh": wall / fresh_wall,
        "activation_vs_copy": wall / spare_phases["copy_s"],
        "cold_s": cold,
        "cold_runs": colds,
        "speedup": cold / wall,
        "copy_GBps": copy_bw / 1e9,
        "copy_vs_memcpy": copy_bw / bw,
        "host_cache_load_s": pool["cache_load_s"],
        "max_other_load": max(r["other_load"] for r in pool["runs"]),
    }

    def phases(p: dict) -> str:
        return ", ".join(
            f"{k[:-2]} {p[k] * 1000:.0f} ms" for k in ("take_s", "map_s", "copy_s", "ready_s")
        ) + (f", pages created {p['created_pages']:.0f} / reused {p['reused_pages']:.0f}")

    print(
        f"{name:>26} ({out['weight_bytes'] / GiB:.2f} GiB {dtype})\n"
        f"    pages created per activation (spare_pages off): pooled {fresh_wall:.3f} s "
        f"(first in a fresh worker {fresh['runs'][0]['wall_s']:.3f} s; {phases(fresh_phases)})\n"
        f"    spare pages reused (default): pooled {wall:.3f} s "
        f"(first in a fresh worker {out['pooled_first_in_worker_s']:.3f} s; {phases(spare_phases)})\n"
        f"    spare / fresh {out['spare_vs_fresh']:.2f}x | activation / copy alone "
        f"{out['activation_vs_copy']:.2f}x"
        f" | cold {cold:.2f} s | speedup {out['speedup']:.1f}x (target >= 5x) | copy "
        f"{out['copy_GBps']:.1f} GB/s = {out['copy_vs_memcpy']:.0%} of memcpy (target >= 50%)"
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    info = common.machine_info()
    print(json.dumps(info))
    bw = memcpy_bandwidth()
    print(f"memcpy bandwidth (one memmove, 512 MiB): {bw / 1e9:.1f} GB/s")
    repeats = 2 if args.quick else args.repeats
    results = [measure("smollm2-135m-instruct", "smollm2-135m-instruct", "float32", repeats, 4 * GiB, bw)]
    if not args.quick:
        with tempfile.TemporaryDirectory(prefix="prism-bench-1b-") as tmp:
            path = Path(tmp) / "llama-3.2-1b-synthetic"
            save_hf_dir(load_weights("random:llama-3.2-1b", dtype=torch.bfloat16), path)
            results.append(measure("llama-3.2-1b (synthetic)", str(path), "bfloat16", repeats, 6 * GiB, bw))
    if args.out:
        Path(args.out).write_text(
            json.dumps({"machine": info, "memcpy_Bps": bw, "results": results}, indent=2)
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
