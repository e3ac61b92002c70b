"""LoRA adapters in the built-in engine: a batch mixing many adapters against the base alone, and
the cost of an adapter's first use (its copy into a slot).

SmolLM2-135M-Instruct (real weights), ``--concurrency`` requests in flight (default 32:
``max_num_seqs`` 32, every request submitted at once, ``--requests`` of them), prompts of seeded
random token ids (``--prompt-len``), greedy with ``ignore_eos`` so that every request makes exactly
``--max-tokens`` tokens. Three runs in one process, the same requests each time:

* base: no adapter;
* ``--adapters`` different rank-``--rank`` adapters, request i on adapter i mod N (every step
  mixes them all), on q_proj and v_proj (PEFT's default targets for Llama models);
* the same over all seven projections (q, k, v, o, gate, up, down).

Adapters are written in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``,
random non-zero A and B) and registered with ``LLMEngine.add_lora``; the tests check the engine's
tokens against transformers + peft. First use: the copy of a registered adapter from its host
cache file (shared memory, freshly mapped, as a worker maps it) into a free slot (``LoraSlots.load``),
median of 20.

Prints the machine line, tokens/s per run and the ratio to the base, each measured with the CPU
otherwise quiet (the other processes' load is printed). Run from the repository root::

    python benchmarks/lora_throughput.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import common
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.llm_engine import LLMEngine
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.weights import load_weights
from prism_serve.runtime.adapters import MappedAdapters
from prism_serve.runtime.weight_cache import HostWeightCache

QV = ("q_proj", "v_proj")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A rank-``rank`` LoRA of random A and B on ``targets``, as PEFT saves one."""
    g = torch.Generator().manual_seed(seed)
    shapes = config.projection_shapes()
    tensors = {}
    for layer in range(config.num_layers):
        for m in targets:
            fan_in, fan_out = shapes[m]
            part = "self_attn" if m[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
           "bias": "none"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    common.wait_quiet(30, 0.1)
    start, t0 = common.cpu_seconds(), time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, adapter=adapters[i % len(adapters)])
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.delta_token_ids)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "other_load": common.other_load_since(start, wall)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has native bf16 matmuls")
    ap.add_argument("--out", type=Path, default=Path("results/lora"))
    args = ap.parse_args()
    machine = common.machine_info()
    print(machine["line"], flush=True)

    weights = load_weights("smollm2-135m-instruct")
    cfg = weights.config
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)
    ]
    engine = LLMEngine(
        EngineConfig(dtype=args.dtype, max_num_seqs=args.concurrency, num_kv_blocks=args.concurrency * 16,
                     max_loras=args.adapters, max_lora_rank=args.rank),
        weights=weights,
    )  # fmt: skip
    print(f"dtype {engine.model.dtype}, {args.requests} requests of {args.prompt_len} + {args.max_tokens} "
          f"tokens, concurrency {args.concurrency}", flush=True)  # fmt: skip
    root = args.out / "adapters"
    names = {}
    for targets in (QV, ALL):
        tag = "qv" if targets == QV else "all"
        names[tag] = []
        for i in range(args.adapters):
            name = f"{tag}-{i}"
            engine.add_lora(write_adapter(root / name, cfg, args.rank, targets, seed=i), name)
            names[tag].append(name)

    # first use: a registered adapter copied from the host cache into a free slot (rank args.rank),
    # as a worker does it: the adapter's shared-memory file freshly mapped each time, so the copy
    # also builds the mapping's page tables
    slots = engine.adapters.slots
    first_use = {}
    with HostWeightCache(f"lorabench-{os.getpid()}") as cache:
        for tag in ("qv", "all"):
            adapter = engine.adapters.adapters[names[tag][0]]
            file = cache.write_adapter(adapter)
            times = []
            for _ in range(20):
                mapped = MappedAdapters()
                view = mapped.get(file, cfg, args.rank)
                t0 = time.perf_counter()
                slots.load(0, view)
                times.append(time.perf_counter() - t0)
                mapped.close()
            slots.clear(0)
            first_use[tag] = {"ms": statistics.median(times) * 1e3, "bytes": adapter.nbytes}
            print(f"first use, rank {args.rank} on {tag}: {first_use[tag]['ms']:.2f} ms "
                  f"({adapter.nbytes / 2**20:.1f} MiB fp32 in the host cache)", flush=True)  # fmt: skip

    run(engine, prompts[: args.concurrency], [None], 8)  # warm-up
    results = {"base": run(engine, prompts, [None], args.max_tokens)}
    for tag in ("qv", "all"):
        results[tag] = run(engine, prompts, names[tag], args.max_tokens)
    base = results["base"]["tokens_per_s"]
    for tag, r in results.items():
        r["ratio"] = r["tokens_per_s"] / base
        print(f"{tag:5s} {r['tokens_per_s']:8.1f} tok/s  {r['ratio']:.2f}x base  "
              f"(other load {r['other_load']:.2f} cores)", flush=True)  # fmt: skip
    verdict = "met" if results["qv"]["ratio"] >= 0.8 else "NOT met"
    print(f"target >= 0.8x base with {args.adapters} rank-{args.rank} adapters (q,v): {verdict}")
    print(f"target first use <= 10 ms: {'met' if first_use['qv']['ms'] <= 10 else 'NOT met'} (q,v), "
          f"{'met' if first_use['all']['ms'] <= 10 else 'NOT met'} (all modules)")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
           "first_use": first_use}  # fmt: skip
    (args.out / "lora_throughput.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
