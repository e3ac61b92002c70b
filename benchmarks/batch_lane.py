"""What the batch lane costs interactive traffic, and what it gets done, on a real `prism serve`.

One CPU device serves a synthetic-weight SmolLM2-135M shape (labelled synthetic). Interactive
clients send streamed chat requests at Poisson arrivals (``--rate`` a second for ``--seconds``, the
same arrivals in every phase, ``--max-tokens`` each with ignore_eos) and time their first token.
Three phases, one after another on the same server:

- ``alone``: the interactive requests only (the baseline);
- ``lane``: the same, while a batch of ``--lines`` requests (OpenAI's Batch API, the official
  ``openai`` client) runs in the batch lane (``server.batch_concurrency`` = ``--concurrency``);
- ``clients``: the same, while the same offline requests are sent as plain requests by
  ``--concurrency`` client threads, as a user without a batch lane would.

Reported per phase: interactive TTFT p50/p95/max and the share within ``--ttft-slo``; offline
requests finished during the phase. The ratios to ``alone`` (p95 TTFT) are in the same run.

    python benchmarks/batch_lane.py
    python benchmarks/batch_lane.py --rate 1.0 --seconds 90 --concurrency 8
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process

KEY = "sk-bench"
PROMPT = "Summarise the following notes in one paragraph. " + "The meeting covered plans and budgets. " * 3


def body(text: str, max_tokens: int, stream: bool) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}  # fmt: skip


def interactive(url: str, arrivals: list[float], max_tokens: int, phase: str) -> list[float]:
    """Each request at its arrival (s from now), streamed; its time to first token. Prompts begin
    with the phase's name: no phase finds another's prompts in the prefix cache."""
    ttfts: list[float] = []
    lock = threading.Lock()
    start = time.monotonic()

    def one(i: int, at: float) -> None:
        time.sleep(max(0.0, start + at - time.monotonic()))
        sent = time.monotonic()
        auth = {"Authorization": f"Bearer {KEY}"}
        request = body(f"{phase} {i}. {PROMPT}", max_tokens, True)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=request, headers=auth, timeout=600) as s:
            s.raise_for_status()
            first = None
            for line in s.iter_lines():
                if first is None and line.startswith("data: "):
                    first = time.monotonic() - sent
        with lock:
            ttfts.append(first)

    with ThreadPoolExecutor(64) as pool:
        for f in [pool.submit(one, i, at) for i, at in enumerate(arrivals)]:
            f.result()
    return ttfts


def offline_lines(n: int, max_tokens: int, phase: str) -> list[dict]:
    return [body(f"{phase} offline item {i}: {PROMPT}", max_tokens, False) for i in range(n)]


def run_clients(url: str, lines: list[dict], concurrency: int, stop: threading.Event) -> int:
    """Plain requests, ``concurrency`` at a time, until ``stop``: how many finished."""
    done = 0
    lock = threading.Lock()
    todo = iter(lines)

    def loop() -> None:
        nonlocal done
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)
        while not stop.is_set():
            with lock:
                b = next(todo, None)
            if b is None:
                return
            c.chat.completions.create(**{k: v for k, v in b.items() if k not in ("ignore_eos", "stream")},
                                      extra_body={"ignore_eos": True})  # fmt: skip
            with lock:
                done += 1

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(loop) for _ in range(concurrency)]:
            f.result()
    return done


def summary(name: str, ttfts: list[float], slo: float, offline: int, base_p95: float | None) -> float:
    q = statistics.quantiles(ttfts, n=20)
    p95 = q[18]
    met = sum(t <= slo for t in ttfts) / len(ttfts)
    ratio = f", p95 {p95 / base_p95:.2f}x alone's" if base_p95 else ""
    print(f"{name:8s} interactive TTFT p50 {statistics.median(ttfts):.3f} s, p95 {p95:.3f} s, max "
          f"{max(ttfts):.3f} s; within {slo:g} s: {met:.1%} of {len(ttfts)}; offline requests finished "
          f"{offline}{ratio}")  # fmt: skip
    return p95


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=0.5, help="interactive requests a second")
    ap.add_argument("--seconds", type=float, default=60.0, help="each phase's interactive arrivals")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lines", type=int, default=400, help="offline requests (more than a phase finishes)")
    ap.add_argument("--concurrency", type=int, default=4, help="batch_concurrency and the offline clients")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    args = ap.parse_args()
    print(common.machine_info(dtype="float32")["line"])
    print(
        f"model: random:smollm2-135m (synthetic weights), one CPU device; interactive {args.rate}/s "
        f"for {args.seconds:g} s, {args.max_tokens} tokens each; offline concurrency {args.concurrency}"
    )
    rng = random.Random(0)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.seconds:
            break
        arrivals.append(t)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cfg = tmp / "prism.yaml"
        cfg.write_text(
            "devices: [{name: 'cpu:0', memory: 3GiB, workers: 1}]\n"
            "models: [{name: tiny, source: 'random:smollm2-135m', max_model_len: 1024, dtype: float32,\n"
            f"          ttft_slo: {args.ttft_slo}, tpot_slo: 1.0}}]\n"
            f"server: {{api_keys: [{KEY}], state_dir: '{tmp / 'state'}', max_waiting_requests: 512,\n"
            f"         batch_concurrency: {args.concurrency}}}\n"
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server_process(cfg, port, tmp / "prism.log", log_level="warning")
        try:
            interactive(url, arrivals[:3], args.max_tokens, "warm")  # the model active, its steps traced
            base = summary(
                "alone", interactive(url, arrivals, args.max_tokens, "alone"), args.ttft_slo, 0, None
            )

            c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)
            offline = offline_lines(args.lines, args.max_tokens, "lane")
            data = "\n".join(
                json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
                for i, b in enumerate(offline)
            )
            f = c.files.create(file=("lines.jsonl", io.BytesIO(data.encode())), purpose="batch")
            batch = c.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            ttfts = interactive(url, arrivals, args.max_tokens, "lane")
            done = c.batches.retrieve(batch.id).request_counts.completed
            c.batches.cancel(batch.id)
            summary("lane", ttfts, args.ttft_slo, done, base)
            while c.batches.retrieve(batch.id).status != "cancelled":
                time.sleep(0.2)

            stop = threading.Event()
            with ThreadPoolExecutor(1) as pool:
                offline = pool.submit(run_clients, url, offline_lines(args.lines, args.max_tokens, "clients"),
                                      args.concurrency, stop)  # fmt: skip
                ttfts = interactive(url, arrivals, args.max_tokens, "clients")
                stop.set()
                summary("clients", ttfts, args.ttft_slo, offline.result(), base)
        finally:
            stop_server_process(proc)


if __name__ == "__main__":
    main()
