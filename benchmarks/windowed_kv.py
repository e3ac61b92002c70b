"""What freeing a sliding window's KV buys: Gemma 3 1B's layers under one KV budget, with the
windowed layers' old blocks freed (``windowed_kv``, the default) and without (every block holds
every layer), in one run.

The model has gemma-3-1b's attention shape (26 layers, 4 of them global, 512-token windows in the
others, 1 KV head of 256) with a narrow MLP, hidden size and vocabulary, so that attention and KV,
not weights, decide the run: SYNTHETIC random weights. ``--requests`` requests of ``--prompt``
random tokens each generate ``--tokens`` greedy tokens (ignore_eos) from a fixed pool of
``--kv-mib`` MiB, prefix caching off (random prompts share nothing). Reported for each layout:

* KV bytes a request holds at its last step (measured: the pool's used blocks x block bytes, over
  the requests running) and the most requests running at once;
* preemptions (a request that had to give its blocks back and be recomputed), and the run's
  wall time and output tokens/s.

    python benchmarks/windowed_kv.py                      # 8 requests of 3000 + 64 tokens, 256 MiB
    python benchmarks/windowed_kv.py --requests 8 --prompt 2000 --out /tmp/wkv.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import time

import common
from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.models.config import PRESETS
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.weights import random_weights

# gemma-3-1b's attention and layer pattern; the rest narrowed (SYNTHETIC)
MODEL = dataclasses.replace(PRESETS["gemma-3-1b"], hidden_size=256, intermediate_size=512, vocab_size=4096)


def run(windowed: bool, args: argparse.Namespace) -> dict:
    weights = random_weights(MODEL, seed=0)
    engine = LLMEngine(
        EngineConfig(dtype="float32", max_model_len=args.prompt + args.tokens + 16,
                     max_num_seqs=args.requests, max_num_batched_tokens=512,
                     kv_cache_bytes=args.kv_mib * 2**20, prefix_caching=False, windowed_kv=windowed),
        weights=weights,
    )  # fmt: skip
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request([rng.randrange(10, MODEL.vocab_size) for _ in range(args.prompt)], params, str(i))
    block_bytes = engine.kv_cache.tensor[0].numel() * engine.kv_cache.tensor.element_size()
    alloc = engine.allocator
    most_running, held_per_request, preempted = 0, [], 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        running = engine.scheduler.running
        most_running = max(most_running, len(running))
        # a request's last step: every running request has all its tokens but the last to compute
        if running and all(s.num_output_tokens == args.tokens - 1 for s in running):
            used = alloc.num_total_blocks - alloc.num_free_blocks
            held_per_request.append(used * block_bytes / len(running))
        preempted += sum(o.metrics.num_preemptions for o in outs if o.finished)
    wall = time.perf_counter() - t0
    out = {
        "windowed_kv": windowed,
        "kv_groups": engine.kv_groups.num_groups,
        "block_bytes": block_bytes,
        "pool_blocks": alloc.num_total_blocks,
        "kv_bytes_per_request_at_end": max(held_per_request) if held_per_request else None,
        "most_running": most_running,
        "wall_s": wall,
        "output_tok_s": args.requests * args.tokens / wall,
        "preemptions": preempted,
    }
    del engine, weights
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv-mib", type=int, default=256)
    ap.add_argument("--out", default=None, help="JSON results here")
    args = ap.parse_args()
    info = common.machine_info(dtype="float32")
    print(info["line"])
    print(
        "SYNTHETIC weights: gemma-3-1b's attention (26 layers, 4 global, window 512), narrowed MLP; "
        f"{args.requests} requests of {args.prompt} + {args.tokens} tokens, {args.kv_mib} MiB of KV"
    )
    results = {}
    for windowed in (False, True):
        common.wait_quiet(20, 0.2)
        r = results["freed" if windowed else "all layers"] = run(windowed, args)
        print(f"{'windowed blocks freed' if windowed else 'every block all layers':24s}: "
              f"{r['kv_bytes_per_request_at_end'] / 2**20:7.2f} MiB a request at its end, "
              f"up to {r['most_running']:2d} running, {r['preemptions']} preemptions, "
              f"{r['wall_s']:6.1f} s, {r['output_tok_s']:6.2f} output tok/s", flush=True)  # fmt: skip
    a, b = results["all layers"], results["freed"]
    kv = b["kv_bytes_per_request_at_end"] / a["kv_bytes_per_request_at_end"]
    print(f"ratio (freed / all layers): KV a request {kv:.3f}x, "
          f"running at once {b['most_running'] / a['most_running']:.2f}x, "
          f"output tok/s {b['output_tok_s'] / a['output_tok_s']:.2f}x")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
