"""Batched serving throughput of `prism serve` as `vllm bench serve` measures it (issue 17 item 1),
against the built-in engine alone on the same requests, in the same run; and against vLLM's own
OpenAI server when a Python with a full vLLM is given (``--vllm-python``).

Workload (issue 17's): 64 streamed /v1/completions requests of random token ids, prompts of 8-512
tokens, 4-128 output tokens with ignore_eos, 32 in flight; SmolLM2-135M-Instruct fp32 on one
device with every core. `vllm bench serve` (random dataset: input 260 +-97%, output 66 +-94%) runs
from .venv-vllm (scripts/client-envs.sh). The engine-only baseline replays the very lengths the
benchmark sent (from its saved result) through ``LLMEngine`` in this process, so the difference is
what serving adds: HTTP, tokenization, IPC between the API process and the worker, streaming.

    python benchmarks/serve_throughput.py
    python benchmarks/serve_throughput.py --vllm-python /path/to/venv-with-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process, wait_answering

REPO_ROOT = common.REPO_ROOT
MODEL = "smollm2-135m-instruct"
BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def export_tokenizer(out: Path) -> Path:
    """The default model's tokenizer as an HF directory (vLLM's benchmark loads one from disk)."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.clients.conftest import export_tokenizer as write

    return write(out)


def bench(url: str, tokenizer: Path, out: Path, args: argparse.Namespace, model: str | None = None) -> dict:
    vllm_py = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if not vllm_py.is_file():
        sys.exit("no .venv-vllm: run scripts/client-envs.sh")
    cmd = [str(vllm_py), "-c", BENCH, "--base-url", url, "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", "260", "--random-range-ratio", "0.96",
           "--random-output-len", "66", "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "0", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(out),
           "--result-filename", "r.json"]  # fmt: skip
    if model:
        cmd += ["--model", model]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=out, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return json.loads((out / "r.json").read_text())


def summary(name: str, r: dict) -> dict:
    return {
        "server": name,
        "wall_s": r["duration"],
        "total_tok_s": (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"],
        "output_tok_s": r["total_output_tokens"] / r["duration"],
        "ttft_p50_ms": r["median_ttft_ms"],
        "tpot_p50_ms": r["median_tpot_ms"],
        "completed": r["completed"],
        "failed": r.get("failed", 0),
    }


def run_prism(tokenizer: Path, tmp: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    cfg = tmp / "prism.yaml"
    cfg.write_text(
        "devices: [{name: 'cpu:0', memory: 6GiB, workers: 1}]\n"
        f"models: [{{name: {MODEL}, source: {MODEL}, dtype: float32, max_model_len: 2048, "
        f"max_num_seqs: {args.concurrency}, ttft_slo: 60, tpot_slo: 5}}]\n"
    )
    proc = start_server_process(cfg, port, tmp / "prism.log")
    try:
        url = f"http://127.0.0.1:{port}"
        httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=300
        )
        common.wait_quiet(30, 0.3)
        return bench(url, tokenizer, tmp / "prism", args)
    finally:
        stop_server_process(proc)


def run_vllm(python: str, tokenizer: Path, tmp: Path, args: argparse.Namespace) -> dict:
    """vLLM's own OpenAI server over the same GGUF weights' HF export is out of reach offline, so it
    serves the model directory given by --vllm-model."""
    port = free_port()
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model,
                             "--tokenizer", str(tokenizer), "--port", str(port), "--dtype", "float32",
                             "--max-num-seqs", str(args.concurrency), "--max-model-len", "2048"])  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        why = wait_answering(proc, f"{url}/v1/models", 900)
        if why is not None:
            raise RuntimeError(f"vLLM's server {why}")
        common.wait_quiet(30, 0.3)
        return bench(url, tokenizer, tmp / "vllm", args)
    finally:
        proc.terminate()
        proc.wait(120)


def run_engine(r: dict, args: argparse.Namespace) -> dict:
    """The same prompt/output lengths through LLMEngine alone, 32 at a time, as one batch stream,
    sampled at temperature 1 as the served requests are."""
    from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
    from prism_serve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=MODEL, dtype="float32", max_model_len=2048,
                                    max_num_seqs=args.concurrency, kv_cache_bytes=2 * 2**30))  # fmt: skip
    rng = random.Random(0)
    lens = list(zip(r["input_lens"], r["output_lens"], strict=True))
    for i, (n_in, n_out) in enumerate(lens):
        ids = [rng.randrange(1000, 40000) for _ in range(n_in)]
        # temperature 1, as the served requests get it (vllm bench serve sends none: the default)
        params = SamplingParams(temperature=1.0, max_tokens=n_out, ignore_eos=True, seed=i)
        engine.add_request(ids, params, f"r{i}")
    common.wait_quiet(30, 0.3)
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            first.setdefault(o.req_id, time.perf_counter() - t0)
            if o.finished:
                done[o.req_id] = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    tokens_in, tokens_out = sum(a for a, _ in lens), sum(b for _, b in lens)
    tpot = [(done[f"r{i}"] - first[f"r{i}"]) / (b - 1) for i, (_, b) in enumerate(lens) if b > 1]
    return {
        "server": "engine alone (no HTTP, no worker process; all requests queued at once)",
        "wall_s": wall, "total_tok_s": (tokens_in + tokens_out) / wall, "output_tok_s": tokens_out / wall,
        "ttft_p50_ms": 1000 * statistics.median(first.values()),
        "tpot_p50_ms": 1000 * statistics.median(tpot),
        "completed": len(done), "failed": 0,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--vllm-python", help="a Python with vLLM installed: its server is measured too")
    p.add_argument("--vllm-model", help="model directory for vLLM's server (HF layout)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    info = common.machine_info()
    print(info["line"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="prism-serve-bench-") as t:
        tmp = Path(t)
        for d in ("prism", "vllm"):
            (tmp / d).mkdir()
        tokenizer = export_tokenizer(tmp / "tokenizer")
        served = run_prism(tokenizer, tmp, args)
        rows.append(summary("prism serve (built-in engine, one device, all cores)", served))
        rows.append(run_engine(served, args))
        if args.vllm_python:
            rows.append(summary("vLLM's OpenAI server", run_vllm(args.vllm_python, tokenizer, tmp, args)))
    base = rows[0]
    print("| server | wall | total tok/s | output tok/s | TTFT p50 | TPOT p50 | completed | vs prism serve |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['server']} | {row['wall_s']:.1f} s | {row['total_tok_s']:.1f} "
              f"| {row['output_tok_s']:.1f} "
              f"| {row['ttft_p50_ms'] / 1000:.2f} s | {row['tpot_p50_ms']:.0f} ms | {row['completed']} "
              f"| {row['total_tok_s'] / base['total_tok_s']:.2f}x |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": info, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
