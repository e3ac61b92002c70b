"""LoRA adapters served by `prism serve`: many registered, and against vLLM's server.

SmolLM2-135M-Instruct (real weights), rank-``--rank`` adapters on q_proj and v_proj (PEFT's default
targets for Llama), random non-zero A and B written in PEFT's layout. Two parts (``--part``):

* **scale**: one server, the same requests twice (Poisson arrivals at ``--rate`` for
  ``--duration`` s, prompts of 64-192 tokens, ``--max-tokens`` out, replayed by `prism bench`):
  first with ``--few`` adapters registered (from the config) and the requests spread over all of
  them; then, after the rest of ``--registered`` adapters are registered at run time
  (``POST /v1/load_lora_adapter``), spread over ``--in-use`` of them; then both again, in the
  same order (the first two follow the server's start and the registrations, which the machine
  takes a while to settle from; the last two are the pair to compare). Printed for each run: SLO
  attainment (``--ttft-slo``, ``--tpot-slo``), the adapter files in the host cache and the private
  memory of the server and its workers after the run (anonymous pages, /proc/PID/smaps_rollup);
  then the growth by the registrations (after the first run against just after registering)
  against the added adapters' own bytes (float32 A and B, as the host cache holds them).
* **vllm**: `prism serve` and vLLM's OpenAI server (``--enable-lora``, the same adapters, the same
  max rank and slots) measured by `vllm bench serve` (the random dataset: ``--prompts`` requests of
  260 prompt / 66 output tokens, ``--concurrency`` in flight, each request on the next adapter in
  turn, ``--lora-modules``), and the base alone on each; fp32 on both. Prints output tokens/s and
  the ratio prism/vLLM. vLLM runs with its defaults (on 2 cores its engine gets one), or with
  ``--vllm-bind 0-1`` on every core.

Each part prints the machine line. Run from the repository root::

    python benchmarks/lora_serving.py --part scale
    python benchmarks/lora_serving.py --part vllm      # needs .venv-vllm-server and .venv-vllm
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

import common
from lora_throughput import QV, write_adapter
from prism_serve.api.process import free_port, start_server_process, stop_server_process, wait_answering
from prism_serve.engine.weights import load_weights

MODEL = "smollm2-135m-instruct"


def adapters(root: Path, n: int, rank: int, config) -> list[Path]:
    """``n`` adapters (made once per root: the scale part's 1,000 take about a minute)."""
    out = []
    for i in range(n):
        p = root / f"a{i:04d}"
        if not (p / "adapter_config.json").is_file():
            write_adapter(p, config, rank, QV, seed=1000 + i)
        out.append(p)
    return out


def adapter_bytes(config, rank: int) -> int:
    """One adapter's float32 A and B (what the host cache holds of it, before alignment)."""
    shapes = config.projection_shapes()
    return config.num_layers * sum(rank * sum(shapes[m]) for m in QV) * 4


def private_bytes(pid: int) -> tuple[int, int]:
    """Anonymous (private) memory of ``pid`` and of its descendants (the heap, not mapped files)."""

    def anonymous(p: int) -> int:
        try:
            text = Path(f"/proc/{p}/smaps_rollup").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return 0
        return sum(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("Anonymous:"))

    children = psutil.Process(pid).children(recursive=True)
    return anonymous(pid), sum(anonymous(c.pid) for c in children)


def workload(path: Path, names: list[str], rate: float, duration: float, max_tokens: int, seed: int) -> int:
    """Poisson arrivals, each on one of ``names`` drawn uniformly; the times and lengths depend on
    the seed only, so runs over different names send the same requests otherwise."""
    rng = np.random.default_rng(seed)
    t, rows = 0.0, []
    while True:
        t += rng.exponential(1 / rate)
        if t >= duration:
            break
        pick, prompt = rng.random(), int(rng.integers(64, 193))
        rows.append({"timestamp": round(t, 6), "model": names[int(pick * len(names))],
                     "prompt_tokens": prompt, "output_tokens": max_tokens})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


ADMIN_KEY = "lora-bench-admin"


def replay(url: str, tmp: Path, tag: str, names: list[str], args) -> dict:
    """The scale part's requests over ``names``, replayed by `prism bench`: its overall figures."""
    work = tmp / f"{tag}.jsonl"
    n = workload(work, names, args.rate, args.duration, args.max_tokens, args.seed)
    out = tmp / f"{tag}-bench"
    common.wait_quiet(60, 0.3)
    subprocess.run([sys.executable, "-m", "prism_serve.cli", "bench", "--workload", str(work), "--url", url,
                    "--out", str(out), "--no-progress"], check=True, capture_output=True)  # fmt: skip
    res = json.loads((out / "bench.json").read_text())["overall"]
    keys = ("slo_attainment", "ttft_attainment", "tpot_attainment", "failed", "ttft_p50_s", "tpot_p50_s")
    return {"requests": n, **{k: res[k] for k in keys}}


def memory(pid: int, namespace: str) -> dict:
    files = [f for f in os.listdir("/dev/shm") if namespace in f and f.endswith(".lora")]
    server, workers = private_bytes(pid)
    return {"adapter_files": len(files), "private_bytes": server + workers, "server_private_bytes": server,
            "workers_private_bytes": workers,
            "adapter_shm_bytes": sum(os.path.getsize(f"/dev/shm/{f}") for f in files)}  # fmt: skip


def part_scale(tmp: Path, args) -> dict:
    """One server: ``--few`` adapters from its config and the requests over them; then the rest
    of ``--registered`` registered at run time and the same requests over ``--in-use`` of them.
    Memory is compared within the one process (after each run), so that what differs between two
    server processes anyway (allocator arenas, tens of MiB) does not count."""
    config = load_weights(MODEL).config
    paths = adapters(Path(args.adapter_dir or tmp / "adapters"), args.registered, args.rank, config)
    port, namespace = free_port(), f"lorabench-{os.getpid()}"
    cfg = tmp / "scale.yaml"
    lines = [
        "devices: [{name: 'cpu:0', memory: 4GiB, workers: 1}]",
        "models:",
        f"  - {{name: smol, source: {MODEL}, max_loras: {args.slots}, max_lora_rank: {args.rank}, "
        f"max_num_seqs: 32, ttft_slo: {args.ttft_slo}, tpot_slo: {args.tpot_slo}, pinned: true}}",
    ]
    lines += [f"  - {{name: {p.name}, base: smol, adapter: '{p}'}}" for p in paths[: args.few]]
    lines.append(f"server: {{namespace: {namespace}, admin_key: {ADMIN_KEY}}}")
    cfg.write_text("\n".join(lines) + "\n")
    proc = start_server_process(cfg, port, tmp / "scale.log", timeout_s=600)
    url = f"http://127.0.0.1:{port}"
    try:
        # warm-up: the engine's first steps of each shape, on the base
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json={
                "model": "smol", "prompt": "warm up " * 60, "max_tokens": 16, "ignore_eos": True},
                timeout=300).raise_for_status(), range(16)))  # fmt: skip
        few = replay(url, tmp, "few", [p.name for p in paths[: args.few]], args)
        few.update(memory(proc.pid, namespace), registered=args.few, in_use=args.few)
        t0 = time.perf_counter()
        with httpx.Client(headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as client:
            for p in paths[args.few :]:
                body = {"lora_name": p.name, "lora_path": str(p)}
                client.post(f"{url}/v1/load_lora_adapter", json=body).raise_for_status()
        register_s = time.perf_counter() - t0
        time.sleep(5)  # the workers take the registrations after the routes answered
        registered = memory(proc.pid, namespace)
        many = replay(url, tmp, "many", [p.name for p in paths[: args.in_use]], args)
        many.update(memory(proc.pid, namespace), registered=len(paths), in_use=args.in_use)
        # the first run's requests again, now with every adapter registered: how much two runs of
        # the same requests differ here, against what the number in use changes
        again = replay(url, tmp, "again", [p.name for p in paths[: args.few]], args)
        again.update(memory(proc.pid, namespace), registered=len(paths), in_use=args.few)
        # and the second run's again: the first two runs follow the server's start and the
        # registrations (gigabytes written to shared memory), which the machine takes a while to
        # settle from; the last two are the pair to compare
        many2 = replay(url, tmp, "many-again", [p.name for p in paths[: args.in_use]], args)
        many2.update(memory(proc.pid, namespace), registered=len(paths), in_use=args.in_use)
    finally:
        stop_server_process(proc)
    own = (len(paths) - args.few) * adapter_bytes(config, args.rank)
    grown = sum(registered[k] - few[k] for k in ("private_bytes", "adapter_shm_bytes"))
    for r in (few, many, again, many2):
        print(f"{r['registered']:>5} registered, {r['in_use']:>4} in use: {r['requests']} requests, "
              f"SLO attainment {r['slo_attainment']:.1%} (TTFT {r['ttft_attainment']:.1%}, TPOT "
              f"{r['tpot_attainment']:.1%}), failed {r['failed']}, TTFT p50 {r['ttft_p50_s']:.3f} s, "
              f"TPOT p50 {r['tpot_p50_s'] * 1e3:.1f} ms; host cache {r['adapter_files']} adapter files, "
              f"{r['adapter_shm_bytes'] / 2**20:.1f} MiB; private memory: server "
              f"{r['server_private_bytes'] / 2**20:.1f} MiB, workers "
              f"{r['workers_private_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    print(f"registered {len(paths) - args.few} adapters at run time in {register_s:.1f} s "
          f"({register_s / max(1, len(paths) - args.few) * 1e3:.1f} ms each)")
    print(f"memory growth by the registrations (after the first run, and after registering, before "
          f"the second): {grown / 2**20:.1f} MiB for {len(paths) - args.few} more adapters of "
          f"{own / 2**20:.1f} MiB own bytes: {grown / own:.3f}x (server "
          f"{(registered['server_private_bytes'] - few['server_private_bytes']) / 2**20:+.1f} MiB, workers "
          f"{(registered['workers_private_bytes'] - few['workers_private_bytes']) / 2**20:+.1f} MiB private)")
    print(f"attainment, {args.in_use} in use against {args.few}: "
          f"{(many['slo_attainment'] - few['slo_attainment']) * 100:+.1f} points (second run against the "
          f"first), {(many2['slo_attainment'] - again['slo_attainment']) * 100:+.1f} (fourth against third)")
    return {"few": few, "registered": registered, "many": many, "again": again, "many_again": many2,
            "register_s": register_s, "growth_bytes": grown, "own_bytes": own,
            "growth_ratio": grown / own}  # fmt: skip


# ---- against vLLM ----------------------------------------------------------------------------------

BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def vllm_bench(url: str, tokenizer: Path, out: Path, tag: str, loras: list[str], args) -> dict:
    py = common.REPO_ROOT / ".venv-vllm-server" / "bin" / "python"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(py), "-c", BENCH, "--base-url", url, "--tokenizer", str(tokenizer), "--model", MODEL,
           "--dataset-name", "random", "--random-input-len", "260", "--random-output-len", "66",
           "--random-range-ratio", "0.96", "--num-prompts", str(args.prompts),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "7", "--disable-tqdm",
           "--save-result", "--result-dir", str(out), "--result-filename", f"{tag}.json"]  # fmt: skip
    if loras:
        cmd += ["--lora-modules", *loras, "--lora-assignment", "round-robin"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1"}
    common.wait_quiet(120, 0.3)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=out, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    r = json.loads((out / f"{tag}.json").read_text())
    return {"output_tok_s": r["total_output_tokens"] / r["duration"], "completed": r["completed"],
            "failed": r.get("failed", 0), "ttft_p50_ms": r["median_ttft_ms"],
            "tpot_p50_ms": r["median_tpot_ms"]}  # fmt: skip


def part_vllm(tmp: Path, args) -> dict:
    sys.path.insert(0, str(common.REPO_ROOT))
    from tests.clients.conftest import export_tokenizer

    from prism_serve.engine.weights import save_hf_dir

    weights = load_weights(MODEL)
    paths = adapters(Path(args.adapter_dir or tmp / "adapters"), args.adapters, args.rank, weights.config)
    names = [p.name for p in paths]
    tokenizer = export_tokenizer(tmp / "tokenizer")
    hf = tmp / "hf-model"
    save_hf_dir(weights, hf)
    res: dict = {}

    port = free_port()
    cfg = tmp / "prism.yaml"
    cfg.write_text(
        "devices: [{name: 'cpu:0', memory: 6GiB, workers: 1}]\nmodels:\n"
        f"  - {{name: {MODEL}, source: {MODEL}, dtype: float32, max_model_len: 2048, max_num_seqs: "
        f"{args.concurrency}, max_loras: {args.adapters}, max_lora_rank: {args.rank}, ttft_slo: 60, "
        f"tpot_slo: 5}}\n"
        + "".join(f"  - {{name: {p.name}, base: {MODEL}, adapter: '{p}'}}\n" for p in paths)
    )
    proc = start_server_process(cfg, port, tmp / "prism.log", timeout_s=600)
    try:
        url = f"http://127.0.0.1:{port}"
        res["prism_base"] = vllm_bench(url, tokenizer, tmp / "prism", "base", [], args)
        res["prism_lora"] = vllm_bench(url, tokenizer, tmp / "prism", "lora", names, args)
    finally:
        stop_server_process(proc)

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    if args.vllm_bind:  # vLLM's default binds its engine to all cores but one (its API server's)
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    log = (tmp / "vllm.log").open("w")
    vproc = subprocess.Popen(
        [str(common.vllm_server_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
         "--served-model-name", MODEL, "--tokenizer", str(tokenizer), "--port", str(port),
         "--dtype", "float32",
         "--max-num-seqs", str(args.concurrency), "--max-model-len", "2048", "--enable-lora",
         "--max-loras", str(args.adapters), "--max-cpu-loras", str(args.adapters),
         "--max-lora-rank", str(args.rank), "--lora-modules", *[f"{p.name}={p}" for p in paths]],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        why = wait_answering(vproc, f"{url}/v1/models", 900)
        if why is not None:
            log.flush()
            raise RuntimeError(f"vLLM's server {why}:\n{(tmp / 'vllm.log').read_text()[-4000:]}")
        res["vllm_base"] = vllm_bench(url, tokenizer, tmp / "vllm", "base", [], args)
        res["vllm_lora"] = vllm_bench(url, tokenizer, tmp / "vllm", "lora", names, args)
    finally:
        vproc.terminate()
        vproc.wait(120)
        log.close()
    for k, r in res.items():
        print(f"{k:<12} {r['output_tok_s']:8.1f} output tok/s  completed {r['completed']}  failed "
              f"{r['failed']}  TTFT p50 {r['ttft_p50_ms']:.0f} ms  TPOT p50 {r['tpot_p50_ms']:.1f} ms")
    res["ratio_lora"] = res["prism_lora"]["output_tok_s"] / res["vllm_lora"]["output_tok_s"]
    res["ratio_base"] = res["prism_base"]["output_tok_s"] / res["vllm_base"]["output_tok_s"]
    print(f"prism/vLLM with {args.adapters} rank-{args.rank} adapters: {res['ratio_lora']:.2f}x "
          f"(base alone: {res['ratio_base']:.2f}x)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["scale", "vllm", "all"], default="all")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapter-dir", help="where adapters are written (kept; default: a temporary directory)")
    ap.add_argument("--registered", type=int, default=1000)
    ap.add_argument("--in-use", type=int, default=100)
    ap.add_argument("--few", type=int, default=10)
    ap.add_argument("--slots", type=int, default=32, help="the base's max_loras in the scale part")
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s in the scale part")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ttft-slo", type=float, default=1.0)
    ap.add_argument("--tpot-slo", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adapters", type=int, default=32, help="adapters in the vllm part")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--vllm-bind", help="VLLM_CPU_OMP_THREADS_BIND for vLLM's server, e.g. 0-1 (all cores)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    print(json.dumps(common.machine_info()))
    with tempfile.TemporaryDirectory(prefix="prism-lora-serving-") as t:
        tmp = Path(t)
        res = {}
        if args.part in ("scale", "all"):
            res["scale"] = part_scale(tmp, args)
        if args.part in ("vllm", "all"):
            res["vllm"] = part_vllm(tmp, args)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
