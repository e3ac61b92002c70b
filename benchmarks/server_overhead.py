"""What the HTTP server adds to time to first token (target: <= 2 ms at p99, low load).

One process runs the real server (uvicorn on loopback, the real controller and a worker with the
real SmolLM2-135M-Instruct on one CPU device) and alternates, one request at a time, between

- "engine": ``Controller.generate`` called directly on the server's own controller (tokenize,
  policy, worker IPC, prefill, first token back), and
- "http": the same prompt as a streaming POST /v1/completions over loopback with httpx (request
  parsing, validation, tokenization, SSE framing, the client's own parsing),

so both paths see the same warm model, the same machine load and the same prompt, and each HTTP
request is paired with the engine request before it. Reported: p50/p99 of each path, the p99
difference and the median of paired differences. The httpx client runs in the same event loop,
so its own cost counts as server overhead: the numbers are an upper bound.

    python benchmarks/server_overhead.py            # 300 pairs (the recorded run)
    python benchmarks/server_overhead.py --pairs 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import httpx
import uvicorn

import common
from prism_serve.api.process import free_port
from prism_serve.api.server import PrismServer
from prism_serve.config import parse_config
from prism_serve.engine.sampling_params import SamplingParams

CONFIG = """
devices: [{{name: "cpu:0", memory: 2GiB, cores: "{core}", workers: 1}}]
models: [{{name: smol}}]
server: {{port: {port}, namespace: "{namespace}"}}
"""
PROMPT = "Write one short sentence about the sea."


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure(pairs: int, warmup: int, core: int, port: int) -> dict:
    config = parse_config(CONFIG.format(core=core, port=port, namespace=f"bench-{uuid.uuid4().hex[:6]}"))
    server = PrismServer(config)
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(uv.serve())
    while not uv.started:
        await asyncio.sleep(0.05)
    c = server.controller
    params = SamplingParams(max_tokens=1, temperature=0.0)
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    engine, http = [], []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:

        async def via_engine() -> float:
            t0 = time.perf_counter()
            async for _ in c.generate("smol", PROMPT, params):
                return time.perf_counter() - t0
            raise RuntimeError("no output")

        async def via_http() -> float:
            t0 = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        return time.perf_counter() - t0
            raise RuntimeError("no output")

        for _ in range(warmup):
            await via_engine()
            await via_http()
        start, cpu0 = time.perf_counter(), common.cpu_seconds()
        for _ in range(pairs):
            engine.append(await via_engine())
            http.append(await via_http())
        wall = time.perf_counter() - start
    uv.should_exit = True
    await serving
    diffs = [h - e for e, h in zip(engine, http, strict=True)]
    ms = 1e3
    return {
        "pairs": pairs,
        "engine_ttft_ms": {"p50": pct(engine, 0.5) * ms, "p99": pct(engine, 0.99) * ms},
        "http_ttft_ms": {"p50": pct(http, 0.5) * ms, "p99": pct(http, 0.99) * ms},
        "p99_added_ms": (pct(http, 0.99) - pct(engine, 0.99)) * ms,
        "p50_added_ms": (pct(http, 0.5) - pct(engine, 0.5)) * ms,
        "paired_added_ms": {"median": statistics.median(diffs) * ms, "p90": pct(diffs, 0.9) * ms},
        "other_load_cores": common.other_load_since(cpu0, wall),
    }


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    port = free_port()
    # The worker gets the last core; this process (server + client) the others.
    cores = sorted(os.sched_getaffinity(0))
    result = asyncio.run(measure(args.pairs, args.warmup, cores[-1], port))
    result["machine"] = common.machine_info()
    e, h = result["engine_ttft_ms"], result["http_ttft_ms"]
    print(f"engine TTFT p50 {e['p50']:.2f} ms  p99 {e['p99']:.2f} ms")
    print(f"http   TTFT p50 {h['p50']:.2f} ms  p99 {h['p99']:.2f} ms")
    print(
        f"added by the server: p99 {result['p99_added_ms']:+.2f} ms, p50 {result['p50_added_ms']:+.2f} ms, "
        f"median of paired differences {result['paired_added_ms']['median']:+.2f} ms "
        f"(target p99 <= 2 ms); other load {result['other_load_cores']:.2f} cores"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
