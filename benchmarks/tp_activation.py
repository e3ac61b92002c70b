"""Activation of a tensor parallel model against the copy of its largest rank alone.

A ``tp: 2`` model activates on two CPU devices (one core each): a pooled worker per device copies
its own rank's shard from the host cache, in parallel with the other, then the two form their
gloo group and agree that both made it (runtime/builtin_slot.py). The baseline is the same bytes on
one device: rank 0's shard (the larger one) saved as a model of its own and activated as an
ordinary ``tp: 1`` model on the same kind of worker. Both are ``Controller.load`` wall times
(decision -> engine ready) over prepared workers, alternating, each unloaded before the next; the
medians of ``--repeats`` and their ratio are printed with the phases of each (rank 0's for TP 2).

    python benchmarks/tp_activation.py                              # the real SmolLM2-135M, fp32
    python benchmarks/tp_activation.py --model random:llama-3.2-1b  # a larger shape (synthetic)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

import common
from prism_serve.config import PolicyConfig
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.llm_engine import DTYPES
from prism_serve.engine.tensor_parallel import shard_plan, shard_weights
from prism_serve.engine.weights import load_weights, save_hf_dir
from prism_serve.memory.ledger import ledger_dir
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec

GiB = 2**30


async def measure(model: str, dtype: str, repeats: int, budget: int, shard_dir: Path) -> dict:
    ns = f"bench{uuid.uuid4().hex[:8]}"
    devices = [DeviceSpec("cpu:0", budget, (0,), 1), DeviceSpec("cpu:1", budget, (1,), 1)]
    engine = EngineConfig(dtype=dtype, max_model_len=512)
    specs = [
        ModelSpec("tp2", source=model, engine=engine, tp=2),
        ModelSpec("rank0-alone", source=str(shard_dir), engine=engine),
    ]
    c = Controller(devices, specs, PolicyConfig(tick_interval_s=3600), namespace=ns)
    runs: dict[str, list[dict]] = {"tp2": [], "rank0-alone": []}
    try:
        await c.start()
        await asyncio.sleep(2.0)  # the idle workers open the cache files (Prepare), as in a server
        for i in range(repeats + 1):
            for name, device in (("tp2", None), ("rank0-alone", "cpu:0")):
                common.wait_quiet(30, 0.3)
                t0 = time.monotonic()
                phases = await c.load(name, device)
                wall = time.monotonic() - t0
                await c.unload(name)
                await asyncio.sleep(0.5)  # the pool's replacement workers settle
                if i > 0:  # the first of each: warming up
                    runs[name].append({"wall_s": wall, **msgspec.structs.asdict(phases)})
        ranks = c.cache.get("tp2").ranks
        return {
            "runs": runs,
            "rank_bytes": [r.weight_bytes for r in ranks],
            "alone_bytes": c.cache.get("rank0-alone").weight_bytes,
        }
    finally:
        await c.stop()
        for p in ledger_dir().glob(f"prism-ledger-{ns}-*"):
            p.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--budget", default="6GiB", help="each device's memory")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    print(common.machine_info()["line"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        weights = load_weights(args.model, dtype=DTYPES[args.dtype])
        shard = shard_weights(weights, shard_plan(weights.config, 2)[0])
        save_hf_dir(shard, Path(tmp) / "rank0")
        del weights, shard
        budget = int(args.budget.removesuffix("GiB")) * GiB
        res = asyncio.run(measure(args.model, args.dtype, args.repeats, budget, Path(tmp) / "rank0"))
    print(f"{args.model} ({args.dtype}), tp 2 shards {[round(b / 2**20, 1) for b in res['rank_bytes']]} MiB; "
          f"rank 0 alone {res['alone_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    med = {}
    for name, runs in res["runs"].items():
        keys = ("wall_s", "take_s", "map_s", "copy_s", "ready_s")
        med[name] = {k: statistics.median(r[k] for r in runs) for k in keys}
        m = med[name]
        print(f"{name:12} activation {m['wall_s'] * 1e3:7.1f} ms  (take {m['take_s'] * 1e3:.1f}, map "
              f"{m['map_s'] * 1e3:.1f}, copy {m['copy_s'] * 1e3:.1f}, ready {m['ready_s'] * 1e3:.1f} ms; "
              f"median of {len(runs)})")  # fmt: skip
    ratio = med["tp2"]["wall_s"] / med["rank0-alone"]["wall_s"]
    print(f"tp 2 activation / its largest rank's alone: {ratio:.2f}x (target <= 1.2x)")
    if args.out:
        args.out.write_text(json.dumps({"machine": common.machine_info(), **res, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
