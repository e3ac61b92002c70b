"""Serving throughput of `prism serve` as `vllm bench serve` measures it, against the
built-in engine alone on the same requests and against vLLM's own OpenAI server, in one run.

Workloads, each sent to every server by `vllm bench serve` (from .venv-vllm-server,
scripts/vllm-server-env.sh) with the same seeds, so every server gets the same requests:
- ``c32``: 64 streamed /v1/completions requests of random token ids, prompts of 8-512 tokens (random
  dataset: input 260 +-97%), 4-128 output tokens (66 +-94%) with ignore_eos, 32 in flight;
- ``c8``: requests of the same lengths distribution (another seed), 8 in flight;
- ``single``: one stream, 8 requests of a 32-token prompt and 128 output tokens;
- ``prefix`` (prefix_repetition dataset): 64 requests over 4 shared 1,024-token prefixes, each with
  its own 128-token suffix, 64 output tokens, 8 in flight: both servers' prefix caches on (defaults);
- ``long``: 32 requests of 1,050-1,950 distinct random tokens, 16 output tokens, 4 in flight:
  prefill with nothing either cache could hit.
SmolLM2-135M-Instruct fp32; `prism serve` has one device with every core. The engine-only line
replays the lengths the c32 run sent through ``LLMEngine`` in this process (all queued at once), so
its difference to `prism serve` is what serving adds: HTTP, tokenization, IPC, streaming.

``--vllm`` installs the vLLM CPU build in its own venv (scripts/vllm-server-env.sh, .venv-vllm-server,
about 3.5 GiB, once) and serves the same weights with `python -m vllm.entrypoints.openai.api_server`
from an HF directory that ``prism_serve.engine.weights.save_hf_dir`` writes from the GGUF. vLLM runs
with its defaults (torch.compile; on CPU it binds its engine to all cores but one, which it leaves to
its API server); ``--vllm-bind`` sets VLLM_CPU_OMP_THREADS_BIND (for example ``0-1``: every core).
vLLM's start-up (compiling) is timed apart and is not in any figure below.

    python benchmarks/serve_throughput.py --vllm
    python benchmarks/serve_throughput.py --vllm-python /path/to/venv-with-vllm/bin/python --workloads c32
    python benchmarks/serve_throughput.py --vllm --workloads prefix,long
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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


# name -> (vllm bench serve's dataset arguments, requests, in flight). Each workload has its
# own seed (its place in this table): vLLM caches prefixes by default, so a workload repeating an
# earlier one's prompts on the same server would skip their prefill there.
MIXED = ["--dataset-name", "random", "--random-input-len", "260", "--random-output-len", "66",
         "--random-range-ratio", "0.96"]  # fmt: skip
# fmt: off
WORKLOADS = {
    "c32": (MIXED, 64, 32),
    "c8": (MIXED, 64, 8),
    "single": (["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "128",
                "--random-range-ratio", "0"], 8, 1),
    # 4 shared 1,024-token prefixes, 16 requests each, each with its own 128-token suffix: what the
    # prefix caches (on by default in both) are for
    "prefix": (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
                "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
                "--prefix-repetition-output-len", "64"], 64, 8),
    # long prompts of distinct random tokens (1,050-1,950), 16 output tokens, 4 in flight: prefill
    # with nothing to hit in either cache
    "long": (["--dataset-name", "random", "--random-input-len", "1500", "--random-output-len", "16",
              "--random-range-ratio", "0.3"], 32, 4),
}
# fmt: on


def bench(url: str, tokenizer: Path, out: Path, workload: str) -> dict:
    vllm_py = REPO_ROOT / ".venv-vllm-server" / "bin" / "python"
    if not vllm_py.is_file():
        sys.exit("no .venv-vllm-server: run scripts/vllm-server-env.sh")
    lengths, n, flight = WORKLOADS[workload]
    seed = list(WORKLOADS).index(workload)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(vllm_py), "-c", BENCH, "--base-url", url, "--tokenizer", str(tokenizer), "--model", MODEL,
           *lengths, "--num-prompts", str(n),
           "--max-concurrency", str(flight), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(out),
           "--result-filename", f"{workload}.json"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1"}
    # a pooled worker's build (a vLLM worker compiles for tens of seconds) ends before the run starts
    common.wait_quiet(120, 0.3)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=out, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return json.loads((out / f"{workload}.json").read_text())


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


GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


def greedy(url: str) -> list[str]:
    """Greedy completions of a few prompts: vLLM and prism serve the same weights in fp32."""
    texts = []
    for prompt in GREEDY_PROMPTS:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24,
                                                       "temperature": 0}, timeout=300)  # fmt: skip
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    return texts


def serve_all(name: str, url: str, tokenizer: Path, out: Path, args: argparse.Namespace) -> dict:
    """Every workload of ``args.workloads`` against one running server, in order, after a warm-up."""
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=300)
    res = {"greedy": greedy(url), "raw": {}, "rows": {}}
    for w in args.workloads:
        res["raw"][w] = bench(url, tokenizer, out, w)
        res["rows"][w] = summary(name, res["raw"][w])
    return res


def run_prism(tokenizer: Path, tmp: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    cfg = tmp / "prism.yaml"
    cfg.write_text(
        "devices: [{name: 'cpu:0', memory: 6GiB, workers: 1}]\n"
        f"models: [{{name: {MODEL}, source: {MODEL}, dtype: float32, max_model_len: 2048, "
        f"max_num_seqs: 32, ttft_slo: 60, tpot_slo: 5}}]\n"
    )
    proc = start_server_process(cfg, port, tmp / "prism.log")
    try:
        return serve_all("prism serve (built-in engine, one device, all cores)", f"http://127.0.0.1:{port}",
                         tokenizer, tmp / "prism", args)  # fmt: skip
    finally:
        stop_server_process(proc)


def vllm_python(args: argparse.Namespace) -> str | None:
    if args.vllm_python:
        return args.vllm_python
    if not args.vllm:
        return None
    return str(common.vllm_server_python())


def hf_model_dir(tmp: Path) -> Path:
    """The default model's GGUF weights written as an HF directory (safetensors, fp32), for vLLM."""
    from prism_serve.engine.weights import load_weights, save_hf_dir

    path = tmp / "hf-model"
    save_hf_dir(load_weights(MODEL), path)
    return path


@contextlib.contextmanager
def vllm_server(
    python: str, tokenizer: Path, tmp: Path, args: argparse.Namespace, max_model_len: int = 2048,
    extra: list[str] | tuple[str, ...] = (),
) -> Iterator[tuple[str, float]]:  # fmt: skip
    """vLLM's OpenAI server over the default model's weights (or ``args.vllm_model``), fp32, with
    ``extra`` arguments: its URL and start-up seconds; stopped on exit."""
    port = free_port()
    model = args.vllm_model or str(hf_model_dir(tmp))
    # vLLM sizes its CPU KV cache from the machine's free memory unless told; 4 GiB holds 32 requests
    # of 2,048 tokens of this model 16 times over, and does not depend on what else is resident
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    if args.vllm_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    log = (tmp / "vllm.log").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                             "--served-model-name", MODEL, "--tokenizer", str(tokenizer), "--port", str(port),
                             "--dtype", "float32", "--max-num-seqs", "32",
                             "--max-model-len", str(max_model_len), *extra],
                            env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        why = wait_answering(proc, f"{url}/v1/models", 900)
        if why is not None:
            log.flush()
            raise RuntimeError(
                f"vLLM's server {why}; the end of its log:\n{(tmp / 'vllm.log').read_text()[-4000:]}"
            )
        yield url, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(120)
        log.close()


def run_vllm(python: str, tokenizer: Path, tmp: Path, args: argparse.Namespace) -> dict:
    with vllm_server(python, tokenizer, tmp, args) as (url, startup):
        name = "vLLM's OpenAI server"
        if args.vllm_bind:
            name += f" (VLLM_CPU_OMP_THREADS_BIND={args.vllm_bind})"
        res = serve_all(name, url, tokenizer, tmp / "vllm", args)
        res["startup_s"] = startup
        return res


def run_engine(r: dict) -> dict:
    """The same prompt/output lengths through LLMEngine alone, 32 at a time, as one batch stream,
    sampled at temperature 1 as the served requests are."""
    from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
    from prism_serve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=MODEL, dtype="float32", max_model_len=2048,
                                    max_num_seqs=32, kv_cache_bytes=2 * 2**30))  # fmt: skip
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
    p.add_argument("--workloads", default="c32,c8,single", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--vllm", action="store_true", help="install vLLM's CPU build (once), measure its server")
    p.add_argument("--vllm-python", help="a Python with vLLM installed instead of --vllm's venv")
    p.add_argument("--vllm-model", help="model directory for vLLM's server (default: the GGUF written as HF)")
    p.add_argument("--vllm-bind", help="VLLM_CPU_OMP_THREADS_BIND for vLLM's server (default: vLLM's own)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine-alone line")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    info = common.machine_info()
    print(info["line"])
    python = vllm_python(args)
    servers = []
    with tempfile.TemporaryDirectory(prefix="prism-serve-bench-") as t:
        tmp = Path(t)
        tokenizer = export_tokenizer(tmp / "tokenizer")
        servers.append(run_prism(tokenizer, tmp, args))
        if "c32" in args.workloads and not args.no_engine:
            servers[0]["rows"]["engine"] = run_engine(servers[0]["raw"]["c32"])
        if python:
            servers.append(run_vllm(python, tokenizer, tmp, args))
    for w in args.workloads:
        lens = WORKLOADS[w]
        print(f"\n{w}: {lens[1]} requests, {lens[2]} in flight")
        rows = [s["rows"][w] for s in servers]
        if w == "c32" and "engine" in servers[0]["rows"]:
            rows.insert(1, servers[0]["rows"]["engine"])
        base = rows[-1]
        print("| server | wall | total tok/s | output tok/s | TTFT p50 | TPOT p50 | completed | / last |")
        print("|---|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['server']} | {row['wall_s']:.1f} s | {row['total_tok_s']:.1f} "
                  f"| {row['output_tok_s']:.1f} "
                  f"| {row['ttft_p50_ms'] / 1000:.2f} s | {row['tpot_p50_ms']:.0f} ms | {row['completed']} "
                  f"| {row['total_tok_s'] / base['total_tok_s']:.2f}x |")  # fmt: skip
    if len(servers) > 1:
        print(f"\nvLLM's server start-up (not in the figures): {servers[1]['startup_s']:.0f} s")
        same = sum(a == b for a, b in zip(servers[0]["greedy"], servers[1]["greedy"], strict=True))
        print(f"greedy completions (24 tokens, fp32) equal, prism and vLLM: {same} of {len(GREEDY_PROMPTS)}")
        for prompt, a, b in zip(GREEDY_PROMPTS, servers[0]["greedy"], servers[1]["greedy"], strict=True):
            if a != b:
                print(f"  {prompt!r}: prism {a!r} / vLLM {b!r}")
    if args.out:
        keep = [{k: v for k, v in s.items() if k != "raw"} for s in servers]
        args.out.write_text(json.dumps({"machine": info, "servers": keep}, indent=2))


if __name__ == "__main__":
    main()
