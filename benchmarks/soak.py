"""Soak: a real `prism serve` under mixed traffic for a long time, with an operator's
churn and failures, checking that every request gets exactly one well-formed outcome and that
nothing grows or stays behind.

Setup: 2 CPU devices of one core each; the real SmolLM2-135M-Instruct under two names and two
SYNTHETIC-weight models (SmolLM2-135M shape, two seeds); API and admin keys. Arrivals and lengths
come from the Azure 2023 conversation trace (``prism workload`` builder, Zipf popularity over the
four models, lengths capped for one CPU core). Each request is at random a stream, a non-stream,
or a stream the client drops after its first chunk. Every ``--churn-every`` s an admin call
unloads, loads (on a random device), pins or unpins a random model; every ``--kill-every`` s one
worker process gets SIGKILL.

Outcomes: ``ok`` (complete body, or a stream ending in a finish reason and [DONE]), ``http_<code>``
(an error status with OpenAI's error JSON), ``stream_error`` (an error event, then [DONE]),
``disconnected`` (the client's own choice) and ``lost`` (anything else: a broken or unparsable
answer, a connection error, no answer within ``--timeout``). Target: 0 lost.

Every ``--sample-every`` s it records the RSS and PSS of the server and each of its workers, the
bytes of the namespace's /dev/shm files and the ledger's mapped bytes. At the end it waits for the
server to go idle, unloads every model and compares the ledger and /dev/shm with their state
before the first request.

    python benchmarks/soak.py                          # the recorded run: 30 minutes
    python benchmarks/soak.py --duration 120 --kill-every 40 --churn-every 15   # a quick look

Writes ``--out``/soak.json (every sample and outcome count).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process
from prism_serve.workload.builder import WorkloadSpec, build_workload

API_KEY, ADMIN_KEY = "sk-soak", "admin-soak"
MODELS = ("smol", "smol-b", "syn-a", "syn-b")
CONFIG = """\
devices:
  - {{name: "cpu:0", memory: 2GiB, cores: "{core0}", workers: 2}}
  - {{name: "cpu:1", memory: 2GiB, cores: "{core1}", workers: 2}}
models:
  - {{name: smol, ttft_slo: 5.0, tpot_slo: 1.0}}
  - {{name: smol-b, ttft_slo: 5.0, tpot_slo: 1.0}}
  - {{name: syn-a, source: "random:smollm2-135m", max_model_len: 1024, ttft_slo: 5.0, tpot_slo: 1.0}}
  - {{name: syn-b, source: "random:smollm2-135m", seed: 1, max_model_len: 1024, ttft_slo: 5.0, tpot_slo: 1.0}}
server: {{api_keys: [{api}], admin_key: {admin}, namespace: "{ns}", max_waiting_requests: 64,
         request_timeout_s: 120}}
"""


# ---- one request ---------------------------------------------------------------------------------


def _error_json(text: str) -> bool:
    try:
        e = json.loads(text)["error"]
        return isinstance(e["message"], str) and isinstance(e["type"], str) and isinstance(e["code"], int)
    except (ValueError, KeyError, TypeError):
        return False


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, kind: str
) -> str:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": kind != "whole",
    }
    try:
        if kind == "whole":
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return f"http_{r.status_code}" if _error_json(r.text) else "lost"
            data = r.json()
            ok = (
                data["choices"][0]["finish_reason"] in ("length", "stop")
                and data["usage"]["completion_tokens"]
            )
            return "ok" if ok else "lost"
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}" if _error_json((await r.aread()).decode()) else "lost"
            finish, error, done = None, False, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if kind == "drop":
                    return "disconnected"  # leaving the block closes the connection mid-stream
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    error = _error_json(payload)
                elif obj["choices"] and obj["choices"][0]["finish_reason"]:
                    finish = obj["choices"][0]["finish_reason"]
            if done and error:
                return "stream_error"
            return "ok" if done and finish else "lost"
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "lost"


# ---- the operator: churn and kills ---------------------------------------------------------------


def worker_pids(server_pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == server_pid and b"prism_serve.runtime.worker" in (p / "cmdline").read_bytes():
                out.append(int(p.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB; PSS splits shared pages (weights in /dev/shm) between their mappers."""
    vals = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            k, v = line.split(":", 1)
            vals[k] = int(v.split()[0])
    except OSError:
        return 0, 0
    return vals.get("Rss", 0), vals.get("Pss", 0)


def shm_bytes(ns: str) -> int:
    total = 0
    for f in Path("/dev/shm").iterdir():
        if ns in f.name:
            with contextlib.suppress(OSError):
                total += f.stat().st_blocks * 512
    return total


def metric_sum(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


async def operator(client: httpx.AsyncClient, server_pid: int, args, stop: asyncio.Event, log: list) -> None:
    rng = random.Random(args.seed + 1)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    start = time.monotonic()
    next_churn, next_kill = args.churn_every, args.kill_every
    while not stop.is_set():
        await asyncio.sleep(0.5)
        t = time.monotonic() - start
        if t >= next_churn:
            next_churn += args.churn_every
            model, action = rng.choice(MODELS), rng.choice(("unload", "load", "load", "pin", "unpin"))
            body = {"device": rng.choice(("cpu:0", "cpu:1"))} if action == "load" else None
            if action == "unload":
                body = {"force": rng.random() < 0.3}
            try:
                r = await client.post(
                    f"/v1/admin/models/{model}/{action}", json=body, headers=admin, timeout=180
                )
                log.append(
                    {"t": round(t, 1), "admin": f"{action} {model} {body or ''}", "status": r.status_code}
                )
            except httpx.HTTPError as e:
                log.append({"t": round(t, 1), "admin": f"{action} {model}", "status": f"error {e!r}"})
        if t >= next_kill:
            next_kill += args.kill_every
            pids = worker_pids(server_pid)
            if pids:
                victim = rng.choice(pids)
                os.kill(victim, signal.SIGKILL)
                log.append({"t": round(t, 1), "kill": victim})


async def sampler(
    client: httpx.AsyncClient,
    server_pid: int,
    ns: str,
    every: float,
    stop: asyncio.Event,
    samples: list,
    outcomes: Counter,
) -> None:
    start = time.monotonic()
    while not stop.is_set():
        workers = worker_pids(server_pid)
        server_rss, server_pss = memory_kib(server_pid)
        per_worker = [memory_kib(p) for p in workers]
        try:
            text = (await client.get("/metrics", timeout=30)).text
            mapped, running = (
                metric_sum(text, "prism_device_mapped_bytes"),
                metric_sum(text, "vllm:num_requests_running"),
            )
        except httpx.HTTPError:
            mapped = running = -1
        samples.append(
            {
                "t": round(time.monotonic() - start, 1),
                "server_rss_kib": server_rss,
                "server_pss_kib": server_pss,
                "workers": len(workers),
                "workers_rss_kib": sum(r for r, _ in per_worker),
                "workers_pss_kib": sum(p for _, p in per_worker),
                "shm_bytes": shm_bytes(ns),
                "ledger_mapped_bytes": mapped,
                "running": running,
                "outcomes": dict(outcomes),
            }
        )
        s = samples[-1]
        print(
            f"t={s['t']:>6}s server RSS {server_rss / 1024:.0f} MiB PSS {server_pss / 1024:.0f} MiB; "
            f"{len(workers)} workers PSS {s['workers_pss_kib'] / 1024:.0f} MiB; "
            f"shm {s['shm_bytes'] / 2**20:.0f} MiB; "
            f"ledger {mapped / 2**20:.0f} MiB; running {running:.0f}; {dict(outcomes)}",
            flush=True,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def idle_state(client: httpx.AsyncClient, ns: str) -> dict:
    text = (await client.get("/metrics", timeout=30)).text
    return {
        "ledger_mapped_bytes": metric_sum(text, "prism_device_mapped_bytes"),
        "shm_bytes": shm_bytes(ns),
        "running": metric_sum(text, "vllm:num_requests_running"),
        "waiting": metric_sum(text, "vllm:num_requests_waiting"),
    }


async def soak(args, port: int, server_pid: int, ns: str) -> dict:
    wl = build_workload(
        WorkloadSpec(
            models=MODELS,
            source="azure:conv",
            lengths="azure:conv",
            duration_s=args.duration,
            total_rate=args.rate,
            zipf=1.0,
            max_prompt_tokens=256,
            max_output_tokens=32,
            seed=args.seed,
        )
    )
    rng = random.Random(args.seed)
    outcomes: Counter = Counter()
    samples: list = []
    log: list = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", headers=headers, limits=limits, timeout=args.timeout
    ) as client:
        before = await idle_state(client, ns)
        stop = asyncio.Event()
        side = [
            asyncio.create_task(operator(client, server_pid, args, stop, log)),
            asyncio.create_task(sampler(client, server_pid, ns, args.sample_every, stop, samples, outcomes)),
        ]
        tasks = []

        async def run(model: str, prompt: list[int], max_tokens: int, kind: str) -> None:
            outcomes[await one_request(client, model, prompt, max_tokens, kind)] += 1

        start = time.monotonic()
        for rec in wl.rows():
            delay = rec.timestamp - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            kind = rng.choices(("stream", "whole", "drop"), (0.5, 0.4, 0.1))[0]
            prompt = [rng.randrange(10, 250) for _ in range(max(1, rec.prompt_tokens))]
            tasks.append(asyncio.create_task(run(rec.model, prompt, max(1, rec.output_tokens), kind)))
        await asyncio.gather(*tasks)
        stop.set()
        await asyncio.gather(*side)
        sent = len(tasks)
        # Idle: nothing running or waiting; then every model unloaded, as before the first request.
        for _ in range(120):
            st = await idle_state(client, ns)
            if st["running"] == 0 and st["waiting"] == 0:
                break
            await asyncio.sleep(1)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        for m in MODELS:
            await client.post(f"/v1/admin/models/{m}/unpin", headers=admin)
            await client.post(
                f"/v1/admin/models/{m}/unload", json={"force": True}, headers=admin, timeout=120
            )
        await asyncio.sleep(2)
        after = await idle_state(client, ns)
    return {
        "sent": sent,
        "outcomes": dict(outcomes),
        "before": before,
        "after": after,
        "samples": samples,
        "operator": log,
    }


def growth(samples: list, key: str, t0: float, t1: float) -> float | None:
    a = [s[key] for s in samples if s["t"] >= t0]
    b = [s[key] for s in samples if s["t"] >= t1]
    return (b[0] / a[0] - 1.0) if a and b and a[0] else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second over all models")
    ap.add_argument("--churn-every", type=float, default=60.0)
    ap.add_argument("--kill-every", type=float, default=240.0)
    ap.add_argument("--sample-every", type=float, default=30.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="client timeout per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "prism-soak")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    machine = common.machine_info()
    print("machine:", machine["line"], flush=True)
    cores = sorted(os.sched_getaffinity(0))
    ns = f"soak-{uuid.uuid4().hex[:8]}"
    cfg = args.out / "soak.yaml"
    cfg.write_text(CONFIG.format(core0=cores[0], core1=cores[-1], api=API_KEY, admin=ADMIN_KEY, ns=ns))
    port = free_port()
    proc = start_server_process(cfg, port, args.out / "server.log")
    try:
        res = asyncio.run(soak(args, port, proc.pid, ns))
    finally:
        code = stop_server_process(proc)
    res.update(
        machine=machine,
        args={k: str(v) for k, v in vars(args).items()},
        exit_code=code,
        shm_after_exit=shm_bytes(ns),
    )
    t5, t_end = 300.0, args.duration - args.sample_every
    res["server_rss_growth_5min_to_end"] = growth(res["samples"], "server_rss_kib", min(t5, t_end / 2), t_end)
    res["total_pss_growth_5min_to_end"] = None
    for s in res["samples"]:
        s["total_pss_kib"] = s["server_pss_kib"] + s["workers_pss_kib"]
    res["total_pss_growth_5min_to_end"] = growth(res["samples"], "total_pss_kib", min(t5, t_end / 2), t_end)
    (args.out / "soak.json").write_text(json.dumps(res, indent=1))
    o = res["outcomes"]
    print(f"sent {res['sent']}; outcomes {o}; lost {o.get('lost', 0)}")
    print(
        "server RSS growth from minute 5 to the end: "
        f"{100 * (res['server_rss_growth_5min_to_end'] or 0):+.1f}%; "
        f"all processes' PSS: {100 * (res['total_pss_growth_5min_to_end'] or 0):+.1f}%"
    )
    print(
        f"idle before: {res['before']}\nidle after:  {res['after']}\n"
        f"/dev/shm after exit: {res['shm_after_exit']} "
        f"bytes; server exit code {code}; operator actions {len(res['operator'])}"
    )


if __name__ == "__main__":
    main()
