"""Decode speed of the built-in engine's newer architectures against a Llama of the same size, in
one run (SYNTHETIC random weights: only the shapes, and so the work per token, are real).

Pairs, each an architecture and its Llama twin of the same parameter count:

* ``qwen3-0.6b`` against its shape without the per-head q/k norms (a Llama);
* ``gemma-3-1b`` (GeGLU, four norms a layer, 512-token windows in 5 of 6 layers, two RoPE bases)
  against its shape as a Llama (SwiGLU, two norms, every layer global);
* a mixture of experts with 1B active parameters (``llama-3.2-1b``'s layers, each MLP 8 experts of
  2048, 4 per token: the dense model's work per token, 2x its MLP weights) against ``llama-3.2-1b``.

Each model serves ``--batch`` requests of ``--prompt`` random tokens, ``--tokens`` greedy tokens
each (ignore_eos), fp32 on the CPU path with its kernels. Decode tokens/s counts the tokens after
each request's first, over the time from the step that finished the last prefill to the end.
Engines alternate (architecture, twin, architecture, ...; each serves every batch size in turn) so
drift on a shared machine hits both; the median of ``--repeats`` is reported, with the CPU time
other processes used meanwhile.

    python benchmarks/arch_decode.py                    # all pairs, batch 1 and 8
    python benchmarks/arch_decode.py --pairs gemma --batch 8 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import time

import common
from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.models.config import PRESETS, ArchConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.weights import random_weights


def llama_twin(config: ArchConfig) -> ArchConfig:
    """The same shape as a plain Llama: no head norms, SwiGLU, every layer global, one RoPE base."""
    return dataclasses.replace(
        config, architecture="llama", sliding_window=None, global_layers=(), rope_local_theta=None,
        rope_linear_factor=1.0, query_pre_attn_scalar=None, attn_softcap=None, final_softcap=None,
    )  # fmt: skip


MOE_1B_ACTIVE = dataclasses.replace(
    PRESETS["llama-3.2-1b"], architecture="qwen3_moe", num_experts=8, experts_per_token=4,
    moe_intermediate_size=2048, norm_topk_prob=True,
)  # fmt: skip

PAIRS = {
    "qwen3": ("qwen3-0.6b", PRESETS["qwen3-0.6b"], "llama twin", llama_twin(PRESETS["qwen3-0.6b"])),
    "gemma": ("gemma-3-1b", PRESETS["gemma-3-1b"], "llama twin", llama_twin(PRESETS["gemma-3-1b"])),
    "moe": ("moe 1B active (8x2048, top 4)", MOE_1B_ACTIVE, "llama-3.2-1b", PRESETS["llama-3.2-1b"]),
}


def decode_rates(config: ArchConfig, batches: list[int], prompt: int, tokens: int, seed: int = 0) -> dict:
    """One engine of ``config``; for each batch size, its decode tok/s and the other load meanwhile."""
    weights = random_weights(config, seed=seed)
    engine = LLMEngine(
        EngineConfig(dtype="float32", max_model_len=prompt + tokens + 16, max_num_seqs=max(batches),
                     max_num_batched_tokens=max(512, prompt), kv_cache_bytes=2**30),
        weights=weights,
    )  # fmt: skip
    del weights
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out = {}
    for batch in batches:
        for i in range(batch):
            engine.add_request(
                [rng.randrange(10, config.vocab_size) for _ in range(prompt)], params, f"{batch}-{i}"
            )
        common.wait_quiet(20, 0.2)
        started, decoding_since = set(), None
        load0 = common.cpu_seconds()
        t_start = time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                started.add(o.req_id)
            if decoding_since is None and len(started) == batch:
                decoding_since = time.perf_counter()
        end = time.perf_counter()
        out[batch] = {"decode_tok_s": batch * (tokens - 1) / (end - decoding_since),
                      "other_load": common.other_load_since(load0, end - t_start)}  # fmt: skip
    del engine
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="qwen3,gemma,moe")
    ap.add_argument("--batch", default="1,8", help="concurrent requests, comma-separated")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (past Gemma 3's 512 window)")
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON results here")
    args = ap.parse_args()
    info = common.machine_info(dtype="float32")
    print(info["line"])
    print("SYNTHETIC weights (random); decode tok/s, median of", args.repeats)
    results = []
    batches = [int(b) for b in args.batch.split(",")]
    for key in args.pairs.split(","):
        name, config, twin_name, twin = PAIRS[key]
        runs: dict[str, list[dict]] = {name: [], twin_name: []}
        for _ in range(args.repeats):  # alternating, one engine of each at a time
            for n, c in ((name, config), (twin_name, twin)):
                runs[n].append(decode_rates(c, batches, args.prompt, args.tokens))
        for batch in batches:
            med = {n: statistics.median(r[batch]["decode_tok_s"] for r in rs) for n, rs in runs.items()}
            load = max(r[batch]["other_load"] for rs in runs.values() for r in rs)
            ratio = med[name] / med[twin_name]
            print(f"{name:30s} batch {batch:2d}: {med[name]:7.2f} tok/s   {twin_name:12s} "
                  f"{med[twin_name]:7.2f} tok/s   ratio {ratio:.3f}x   (other load up to {load:.2f} cores)",
                  flush=True)  # fmt: skip
            results.append({"pair": key, "model": name, "twin": twin_name, "batch": batch,
                            "tok_s": med[name], "twin_tok_s": med[twin_name], "ratio": ratio,
                            "params": config.num_params, "twin_params": twin.num_params,
                            "max_other_load": load})  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
