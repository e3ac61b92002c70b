"""Embedding throughput of `prism serve` (a ``task: embed`` model, built-in engine) against vLLM's
own OpenAI server with its pooling runner, on the same weights and requests, in one run.

Model: SmolLM2-135M-Instruct fp32, written as an HF directory with sentence-transformers' files
(mean pooling, then normalisation); vLLM serves it with ``--runner pooling --convert embed`` and the
same pooling. ``--encoder``: instead a BERT encoder of bge-base's shape (768 wide, 12 layers, 12
heads, 512 positions; SYNTHETIC random weights, a small WordPiece vocabulary), pooling its [CLS]
state, which vLLM serves with ``--runner pooling`` and CLS pooling.

Workload: ``--inputs`` token-id inputs of 16-``--max-len`` tokens (seeded), sent as
``/v1/embeddings`` requests of ``--batch`` inputs each, ``--concurrency`` requests in flight;
every server gets the same requests, after a warm-up. Reported: inputs/s and prompt tokens/s
(median of ``--repeats``), and the cosine between the two servers' vectors for the same inputs
(both must compute the same thing for the comparison to mean anything). vLLM's start-up is not
timed.

    python benchmarks/embeddings_serve.py --vllm
    python benchmarks/embeddings_serve.py --vllm --batch 1 --concurrency 8
    python benchmarks/embeddings_serve.py --vllm --encoder
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process
from serve_throughput import MODEL, export_tokenizer, vllm_server


def model_dir(tmp: Path, encoder: bool = False) -> Path:
    """The default model as an HF directory with sentence-transformers' files: mean pooling, then
    normalisation; or (``encoder``) a synthetic BERT of bge-base's shape pooling its [CLS] state."""
    from prism_serve.engine.sources import write_embedding_files
    from prism_serve.engine.weights import load_weights, save_hf_dir

    if encoder:
        from prism_serve.engine.hf_reference import write_synthetic_encoder

        return write_synthetic_encoder(tmp / "bert-base", "bert", pooling="cls", hidden=768, layers=12,
                                       heads=12, max_positions=512)  # fmt: skip
    path = tmp / "smol-embed"
    weights = load_weights(MODEL)
    save_hf_dir(weights, path)
    write_embedding_files(path, "mean", True, weights.config.hidden_size)
    return path


def workload(n: int, max_len: int, batch: int, vocab: int, seed: int = 0) -> list[list[list[int]]]:
    rng = random.Random(seed)
    inputs = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, max_len))] for _ in range(n)]
    return [inputs[i : i + batch] for i in range(0, n, batch)]


def measure(url: str, requests: list[list[list[int]]], concurrency: int) -> tuple[float, list[np.ndarray]]:
    """Seconds to answer every request, ``concurrency`` at a time, and the vectors in input order."""

    def one(batch: list[list[int]]) -> list[np.ndarray]:
        body = {"model": MODEL, "input": batch, "encoding_format": "float"}
        r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:400]}")
        return [
            np.asarray(d["embedding"], dtype=np.float32)
            for d in sorted(r.json()["data"], key=lambda d: d["index"])
        ]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, requests))
    return time.perf_counter() - t0, [v for batch in out for v in batch]


def run(name: str, url: str, requests, args) -> dict:
    measure(url, requests[:2], 1)  # warm-up
    times, vectors = [], []
    for _ in range(args.repeats):
        common.wait_quiet(20, 0.2)
        seconds, vectors = measure(url, requests, args.concurrency)
        times.append(seconds)
    n = sum(len(b) for b in requests)
    tokens = sum(len(x) for b in requests for x in b)
    s = statistics.median(times)
    runs = ", ".join(f"{t:.1f}" for t in times)
    print(f"{name:34s} {n / s:8.1f} inputs/s {tokens / s:9.0f} tokens/s   (runs: {runs} s)", flush=True)
    return {
        "name": name,
        "inputs_per_s": n / s,
        "tokens_per_s": tokens / s,
        "seconds": times,
        "vectors": vectors,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32, help="inputs per request")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm", action="store_true", help="also vLLM's server (.venv-vllm-server)")
    ap.add_argument("--encoder", action="store_true", help="a BERT of bge-base's shape (synthetic)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.vllm_model = None
    info = common.machine_info(dtype="float32")
    print(info["line"])
    shape = f"{args.batch} a request, {args.concurrency} requests in flight"
    print(f"{args.inputs} inputs of 16-{args.max_len} tokens, {shape}")
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        src = model_dir(tmp, args.encoder)
        vocab = json.loads((src / "config.json").read_text())["vocab_size"]
        requests = workload(args.inputs, args.max_len, args.batch, min(vocab, 49000))
        context = 512 if args.encoder else 2048
        print(f"model: {'BERT of bge-base shape, SYNTHETIC weights, [CLS]' if args.encoder else MODEL}")
        port = free_port()
        cfg = tmp / "prism.yaml"
        cfg.write_text(
            "devices: [{name: 'cpu:0', memory: 6GiB, workers: 1}]\n"
            f"models: [{{name: {MODEL}, source: '{src}', task: embed, dtype: float32, "
            f"max_model_len: {context}, max_num_seqs: 32, ttft_slo: 60, tpot_slo: 5}}]\n"
        )
        proc = start_server_process(cfg, port, tmp / "prism.log")
        try:
            results.append(run("prism serve (built-in engine)", f"http://127.0.0.1:{port}", requests, args))
        finally:
            stop_server_process(proc)
        python = args.vllm_python or (str(common.vllm_server_python()) if args.vllm else None)
        if python:
            tokenizer = src if args.encoder else export_tokenizer(tmp / "tokenizer")
            args.vllm_model = str(src)
            pooling = "CLS" if args.encoder else "MEAN"
            extra = ["--runner", "pooling", *([] if args.encoder else ["--convert", "embed"]),
                     "--pooler-config", json.dumps({"pooling_type": pooling})]  # fmt: skip
            with vllm_server(python, tokenizer, tmp, args, context, extra) as (url, startup):
                results.append(run("vLLM's server (pooling runner)", url, requests, args))
                results[-1]["startup_s"] = startup
    if len(results) == 2:
        ours, theirs = results
        cos = [
            float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
            for a, b in zip(ours["vectors"], theirs["vectors"], strict=True)
        ]
        ratio = ours["inputs_per_s"] / theirs["inputs_per_s"]
        print(f"prism / vLLM: {ratio:.2f}x inputs/s; cosine of their vectors: min {min(cos):.5f}, "
              f"median {statistics.median(cos):.5f}")  # fmt: skip
    if args.out:
        for r in results:
            r.pop("vectors")
        Path(args.out).write_text(
            json.dumps({"machine": info, "args": vars(args), "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
