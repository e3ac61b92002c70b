"""vLLM's engine inside prism: activation and serving throughput, against the built-in
engine and against vLLM's own OpenAI server, in one run.

For the real SmolLM2-135M-Instruct in fp32 (the GGUF written as an HF directory), three servers,
one after another, each alone on the machine:
- `prism serve` with the model on the built-in engine;
- `prism serve` with the model on vLLM's engine (``engine: vllm``: vLLM in a pooled prism worker,
  compiled ahead under the default ``vllm_compile``, its KV pages on demand);
- vLLM's own server (``python -m vllm.entrypoints.openai.api_server``), eager by default, with
  torch.compile under ``--compiled``; its start (process start to answering) is its activation.
In each prism server the model is unloaded and loaded ``--activations`` times through the admin
API (the time of each load call). On vLLM's engine a load after an unload on the same worker swaps
the kept weights back in. That server also serves a second model of the same shape (the same files
from another directory, as a fine-tune of the base would be), and the two take turns
``--activations`` times: each loads its weights over the other's kept ones (their pages taken
over, no page made, the linears repacked). A fourth server with ``PRISM_VLLM_KEEP=0`` times the
path with nothing kept (pages made, weights loaded): activations only. Then ``vllm bench serve``
sends the c32 workload of benchmarks/serve_throughput.py (64 streamed requests, 32 in flight, the
same seed) to each, and the greedy completions of four prompts are compared. Before all that, two
servers time the first activation after start, with and without the Prepare that builds vLLM's
engine in the pooled worker's idle time (``--first-only``: just these). No server prewarms.

    python benchmarks/vllm_engine.py [--activations 5] [--compiled] [--first-only] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process, wait_answering
from serve_throughput import MODEL, bench, export_tokenizer, greedy, hf_model_dir, summary


def warm_up(url: str) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


def prism_server(
    tmp: Path, engine: str, hf: Path, vllm_python: Path, args: argparse.Namespace, keep: bool = True
) -> dict:
    port = free_port()
    cfg = tmp / f"prism-{engine}.yaml"
    entry = (
        f"{{name: {MODEL}, dtype: float32, max_model_len: 2048, max_num_seqs: 32, ttft_slo: 60, "
        f"tpot_slo: 5, engine: {engine}" + (f", source: '{hf}'" if engine == "vllm" else "") + "}"
    )
    switch = engine == "vllm" and keep
    if switch:  # a second model of the shape (the same files from another directory: its own cache file)
        hf_b = tmp / "hf-model-b"
        if not hf_b.exists():
            hf_b.mkdir()
            for f in hf.iterdir():
                (hf_b / f.name).symlink_to(f)
        entry += ", " + entry.replace(f"name: {MODEL},", f"name: {MODEL}-b,").replace(f"'{hf}'", f"'{hf_b}'")
    cfg.write_text(
        "devices: [{name: 'cpu:0', memory: 6GiB, workers: 1}]\n"
        f"models: [{entry}]\n"
        f"vllm_python: '{vllm_python}'\n"
        # no prewarming: the policy would activate the second model into free memory on its own
        "policy: {activation_timeout_s: 600, knobs: {prewarm: false}}\n"
    )
    os.environ["PRISM_VLLM_KEEP"] = "1" if keep else "0"  # read by the vLLM worker
    proc = start_server_process(cfg, port, tmp / f"prism-{engine}.log", timeout_s=600)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        warm_up(url)
        first = time.perf_counter() - t0  # the policy may have activated it at start already
        cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        card = next(c for c in cards if c["id"] == MODEL)
        first_how = f"{card['weights_loaded_by']}, {'compiled' if card['engine_compiled'] else 'eager'}"
        loads, how = [], []
        for _ in range(args.activations):
            r = httpx.post(f"{url}/v1/admin/models/{MODEL}/unload", timeout=120)
            r.raise_for_status()
            common.wait_quiet(120, 0.3)  # a pooled worker's build (tens of s) ends first
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/v1/admin/models/{MODEL}/load", timeout=600)
            loads.append(time.perf_counter() - t0)
            r.raise_for_status()
            how.append(r.json()["weights_loaded_by"])
        switches, switch_how = [], []
        for i in range(args.activations if switch else 0):  # each over the other's kept weights
            new, old = (f"{MODEL}-b", MODEL) if i % 2 == 0 else (MODEL, f"{MODEL}-b")
            httpx.post(f"{url}/v1/admin/models/{old}/unload", timeout=120).raise_for_status()
            common.wait_quiet(120, 0.3)  # a pooled worker's build (tens of s) ends first
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/v1/admin/models/{new}/load", timeout=600)
            switches.append(time.perf_counter() - t0)
            r.raise_for_status()
            j = r.json()
            switch_how.append(f"{j['weights_loaded_by']}, {j['weight_pages']['created']} pages made")
        if switches and len(switches) % 2:  # MODEL-b is active: MODEL back for the throughput run
            httpx.post(f"{url}/v1/admin/models/{MODEL}-b/unload", timeout=120).raise_for_status()
            httpx.post(f"{url}/v1/admin/models/{MODEL}/load", timeout=600).raise_for_status()
        name = f"prism serve, {engine} engine" + ("" if keep else ", no kept weights")
        out = {"name": name, "first_request_s": first, "first_how": first_how, "activations_s": loads,
               "how": how, "switches_s": switches, "switch_how": switch_how}  # fmt: skip
        if not keep:
            return out
        raw = bench(url, tokenizer_dir, tmp / f"bench-{engine}", "c32")
        return {**out, "c32": summary(name, raw), "greedy": greedy(url)}
    finally:
        stop_server_process(proc)


def first_activation(tmp: Path, hf: Path, vllm_python: Path, prepare: bool) -> dict:
    """The first activation of the vLLM model after the server starts (no prewarming): with
    Prepare, the pooled vLLM worker built vLLM's engine while idle; without, the activation builds
    it. The load is sent once the machine is quiet (the build, if any, done)."""
    port = free_port()
    cfg = tmp / f"prism-first-{prepare}.yaml"
    cfg.write_text(
        "devices: [{name: 'cpu:0', memory: 6GiB, workers: 1}]\n"
        f"models: [{{name: {MODEL}, dtype: float32, max_model_len: 2048, max_num_seqs: 32, "
        f"ttft_slo: 60, tpot_slo: 5, engine: vllm, source: '{hf}'}}]\n"
        f"vllm_python: '{vllm_python}'\n"
        f"policy: {{activation_timeout_s: 600, prepare_workers: {str(prepare).lower()}, "
        "knobs: {prewarm: false}}\n"
    )
    proc = start_server_process(cfg, port, tmp / f"prism-first-{prepare}.log", timeout_s=600)
    url = f"http://127.0.0.1:{port}"
    try:
        common.wait_quiet(120, 0.3)
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/admin/models/{MODEL}/load", timeout=600)
        took = time.perf_counter() - t0
        r.raise_for_status()
        phases = r.json()["activation_s"]
        warm_up(url)
        return {"name": "prepared (Prepare builds the engine)" if prepare else "not prepared",
                "load_s": took, "phases_s": phases}  # fmt: skip
    finally:
        stop_server_process(proc)


def vllm_server(tmp: Path, hf: Path, python: Path, compiled: bool, bind: str | None) -> dict:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    flags = [] if compiled else ["--enforce-eager"]
    log = (tmp / "vllm.log").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
                             "--served-model-name", MODEL, "--tokenizer", str(tokenizer_dir),
                             "--port", str(port),
                             "--dtype", "float32", "--max-num-seqs", "32", "--max-model-len", "2048", *flags],
                            env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        why = wait_answering(proc, f"{url}/v1/models", 900)
        if why is not None:
            raise RuntimeError(f"vLLM's server {why}: {(tmp / 'vllm.log').read_text()[-3000:]}")
        start = time.perf_counter() - t0
        name = "vLLM's own server" + (" (torch.compile" if compiled else " (eager")
        name += f", VLLM_CPU_OMP_THREADS_BIND={bind})" if bind else ")"
        warm_up(url)
        raw = bench(url, tokenizer_dir, tmp / "bench-vllm", "c32")
        return {"name": name, "start_s": start, "c32": summary(name, raw), "greedy": greedy(url)}
    finally:
        proc.terminate()
        proc.wait(120)
        log.close()


tokenizer_dir: Path


def main() -> None:
    global tokenizer_dir
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--activations", type=int, default=5, help="unload/load cycles per prism server")
    ap.add_argument("--compiled", action="store_true", help="vLLM's own server compiling")
    ap.add_argument(
        "--bind",
        help="VLLM_CPU_OMP_THREADS_BIND for vLLM's own server (default: its own, "
        "all cores but one); 0-1 gives it both cores of this machine",
    )
    ap.add_argument("--first-only", action="store_true", help="only the first activation after start")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    info = common.machine_info()
    print(info["line"], flush=True)
    python = common.vllm_server_python()
    with tempfile.TemporaryDirectory(prefix="prism-vllm-engine-") as t:
        tmp = Path(t)
        tokenizer_dir = export_tokenizer(tmp / "tokenizer")
        hf = hf_model_dir(tmp)
        firsts = [first_activation(tmp, hf, python, prepare) for prepare in (False, True)]
        print("\nfirst activation of the vLLM model after the server starts (admin load, machine quiet):")
        for f in firsts:
            ph = f["phases_s"]
            print(f"  {f['name']}: {f['load_s'] * 1e3:.0f} ms (phases: ready {ph['ready'] * 1e3:.0f} ms, "
                  f"map+load {(ph['map'] + ph['copy']) * 1e3:.0f} ms)")  # fmt: skip
        print(f"  not prepared / prepared: {firsts[0]['load_s'] / firsts[1]['load_s']:.1f}x", flush=True)
        if args.first_only:
            if args.out:
                args.out.write_text(json.dumps({"machine": info, "first": firsts}, indent=1))
            return
        runs = [prism_server(tmp, e, hf, python, args) for e in ("builtin", "vllm")]
        runs.append(vllm_server(tmp, hf, python, args.compiled, args.bind))
        reload = prism_server(tmp, "vllm", hf, python, args, keep=False)
    builtin, ours, theirs = runs
    b_act = statistics.median(builtin["activations_s"])
    v_act = statistics.median(ours["activations_s"])
    print("\nactivation (admin load of an unloaded model; median of the later ones, all in brackets):")
    for r in [*runs[:2], reload]:
        print(f"  {r['name']}: {statistics.median(r['activations_s']) * 1e3:.0f} ms "
              f"({', '.join(f'{s * 1e3:.0f}' for s in r['activations_s'])} ms; weights by "
              f"{', '.join(sorted(set(r['how'])))}; first activation: {r['first_how']})")  # fmt: skip
    s_act = statistics.median(ours["switches_s"])
    print(f"  prism serve, vllm engine, another model of the shape over the kept one: {s_act * 1e3:.0f} ms "
          f"({', '.join(f'{s * 1e3:.0f}' for s in ours['switches_s'])} ms; "
          f"{', '.join(sorted(set(ours['switch_how'])))})")  # fmt: skip
    print(f"  {theirs['name']}: its start, {theirs['start_s']:.1f} s")
    r_act = statistics.median(reload["activations_s"])
    print(f"vLLM engine activation / built-in activation: {v_act / b_act:.1f}x kept weights, "
          f"{s_act / b_act:.1f}x another model of the shape, {r_act / b_act:.1f}x no kept weights "
          "(target <= 2x)")  # fmt: skip
    print(f"vLLM's own start / vLLM engine activation: {theirs['start_s'] / v_act:.0f}x kept weights, "
          f"{theirs['start_s'] / s_act:.0f}x another model, {theirs['start_s'] / r_act:.0f}x no kept weights "
          "(target >= 20x)")  # fmt: skip
    print("\nc32 (64 streamed requests, 32 in flight, `vllm bench serve`):")
    print("| server | wall | total tok/s | TTFT p50 | TPOT p50 | completed | / vLLM's own |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        row = r["c32"]
        print(f"| {row['server']} | {row['wall_s']:.1f} s | {row['total_tok_s']:.1f} | "
              f"{row['ttft_p50_ms'] / 1000:.2f} s | {row['tpot_p50_ms']:.0f} ms | {row['completed']} | "
              f"{row['total_tok_s'] / theirs['c32']['total_tok_s']:.2f}x |")  # fmt: skip
    same = sum(a == b for a, b in zip(ours["greedy"], builtin["greedy"], strict=True))
    same_v = sum(a == b for a, b in zip(ours["greedy"], theirs["greedy"], strict=True))
    print(f"\ngreedy completions (24 tokens) of the vLLM engine in prism equal to: the built-in engine's "
          f"{same}/4, vLLM's own server's {same_v}/4")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": info, "first": firsts, "runs": [*runs, reload]}, indent=1))


if __name__ == "__main__":
    main()
