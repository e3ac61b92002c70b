"""Tenant limits held by a real `prism serve` against real clients, and a keys-file reload under
open streams.

One CPU device serves a synthetic-weight SmolLM2-135M shape (labelled synthetic). The keys file
(``server.keys_file``) has a tenant limited in requests per minute and one in tokens per minute;
``--clients`` threads per tenant send chat requests with the official ``openai`` client as fast as
the server lets them for ``--seconds`` (at least 60: the limits hold over any sliding minute).
Reported: the most requests (and tokens, prompt plus output) admitted in any 60 s, from the
server's request log (its ``arrival``, the moment a request is admitted, and its ``tenant``),
against the limit; the same counted by the time the clients got their answers (queueing moves
answers between windows, so that view may pass the limit by a little); and how many 429s came
back with ``Retry-After`` and ``x-ratelimit-*`` headers. Then ``--streams`` streams are opened at once and
the keys file is rewritten (a change, a file that does not parse, then SIGHUP) while they run:
every stream must end with its finish reason and ``[DONE]``.

    python benchmarks/tenant_limits.py
    python benchmarks/tenant_limits.py --seconds 90 --rpm 120 --tpm 6000 --streams 100
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import yaml

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process
from prism_serve.api.tenants import hash_key

KEYS = {"rpm": "sk-bench-rpm", "tpm": "sk-bench-tpm", "plain": "sk-bench-plain"}


def keys_file(path: Path, rpm: int, tpm: int, extra: list[dict] | None = None) -> None:
    tenants = [
        {"name": "rpm", "keys": [hash_key(KEYS["rpm"])], "limits": {"requests_per_minute": rpm}},
        {"name": "tpm", "keys": [hash_key(KEYS["tpm"])], "limits": {"tokens_per_minute": tpm}},
        *(extra or []),
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"tenants": tenants}))
    tmp.replace(path)


def hammer(url: str, tenant: str, seconds: float, max_tokens: int, clients: int) -> dict:
    """Requests as fast as allowed: (time answered, tokens) of each 200, and the 429s' headers."""
    ok: list[tuple[float, int]] = []
    refused: list[dict[str, str]] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop() -> None:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)
        while time.monotonic() < end:
            try:
                r = c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
                )
                with lock:
                    ok.append((time.monotonic(), r.usage.total_tokens))
            except openai.RateLimitError as e:
                with lock:
                    refused.append(dict(e.response.headers))
                wait = float(e.response.headers.get("retry-after", "1"))
                time.sleep(min(wait, max(0.0, end - time.monotonic()), 0.5))  # eager: probe the limit

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(loop) for _ in range(clients)]:
            f.result()
    return {"ok": ok, "refused": refused}


def worst_window(events: list[tuple[float, int]], weight: bool) -> int:
    """The most requests (or tokens) answered within any 60 s."""
    events = sorted(events)
    best, j, total = 0, 0, 0
    for t, n in events:
        total += n if weight else 1
        while events[j][0] <= t - 60.0:
            total -= events[j][1] if weight else 1
            j += 1
        best = max(best, total)
    return best


def streams_through_reloads(url: str, server, keys: Path, args) -> tuple[int, int]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 48,
            "stream": True, "ignore_eos": True}  # fmt: skip
    opened = threading.Barrier(args.streams + 1)

    def one() -> bool:
        auth = {"Authorization": f"Bearer {KEYS['plain']}"}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth, timeout=600) as s:
            lines = s.iter_lines()
            first = next(lines)
            opened.wait(600)
            rest = [line for line in lines if line]
        return (
            first.startswith("data: ")
            and rest[-1] == "data: [DONE]"
            and '"finish_reason":"length"' in rest[-2]
        )

    with ThreadPoolExecutor(args.streams) as pool:
        futures = [pool.submit(one) for _ in range(args.streams)]
        opened.wait(600)  # every stream has its first chunk: all in flight
        keys_file(keys, args.rpm, args.tpm, [{"name": "new", "keys": [hash_key("sk-new")]}])
        time.sleep(1.1)
        httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEYS['plain']}"}, timeout=60)
        keys.write_text("tenants: [not closed")
        time.sleep(1.1)
        httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEYS['plain']}"}, timeout=60)
        keys_file(keys, args.rpm, args.tpm)
        server.send_signal(signal.SIGHUP)
        done = sum(f.result() for f in futures)
    return done, args.streams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=75.0, help="how long each tenant is hammered (>= 60)")
    ap.add_argument("--clients", type=int, default=6, help="client threads per tenant")
    ap.add_argument("--rpm", type=int, default=60)
    ap.add_argument("--tpm", type=int, default=1500)
    ap.add_argument("--streams", type=int, default=100)
    args = ap.parse_args()
    print(common.machine_info(dtype="float32")["line"])
    print("model: random:smollm2-135m (synthetic weights), one CPU device")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        keys = tmp / "keys.yaml"
        keys_file(keys, args.rpm, args.tpm)
        cfg = tmp / "prism.yaml"
        cfg.write_text(
            "devices: [{name: 'cpu:0', memory: 3GiB, workers: 1}]\n"
            "models: [{name: tiny, source: 'random:smollm2-135m', max_model_len: 512, max_num_seqs: 128,\n"
            "          ttft_slo: 60, tpot_slo: 5}]\n"
            f"server: {{api_keys: [{KEYS['plain']}], keys_file: '{keys}', max_waiting_requests: 512,\n"
            f"         request_log: '{tmp / 'requests.jsonl'}'}}\n"
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server_process(cfg, port, tmp / "prism.log", log_level="info")
        try:
            results = {}
            with ThreadPoolExecutor(2) as pool:
                rpm = pool.submit(hammer, url, "rpm", args.seconds, 4, args.clients)
                tpm = pool.submit(hammer, url, "tpm", args.seconds, 32, args.clients)
                results = {"rpm": rpm.result(), "tpm": tpm.result()}
            lines = [json.loads(x) for x in (tmp / "requests.jsonl").read_text().splitlines()]
            for tenant, limit, weight, unit in (("rpm", args.rpm, False, "requests"),
                                                ("tpm", args.tpm, True, "tokens")):  # fmt: skip
                r = results[tenant]
                admitted = [(x["arrival"], x["prompt_tokens"] + x["output_tokens"]) for x in lines
                            if x.get("tenant") == tenant and x["status"] == 200]  # fmt: skip
                server_view = worst_window(admitted, weight)
                client_view = worst_window(r["ok"], weight)
                headed = sum(
                    "retry-after" in h and f"x-ratelimit-remaining-{unit}" in h for h in r["refused"]
                )
                print(
                    f"{unit:8s} limit {limit:6d}/min: most admitted in any 60 s {server_view:6d} = "
                    f"{server_view / limit:.3f}x the limit (by the clients' answer times {client_view}, "
                    f"{client_view / limit:.3f}x); {len(r['ok'])} answered, {len(r['refused'])} refused "
                    f"(429), {headed} of them with Retry-After and x-ratelimit-* headers"
                )
            done, total = streams_through_reloads(url, proc, keys, args)
            log = (tmp / "prism.log").read_text()
            print(
                f"streams through a reload, a bad file and SIGHUP: {done} of {total} ended whole; "
                f"reloads logged: {log.count('keys file reloaded')}, bad file kept out: "
                f"{'keys file not reloaded' in log}"
            )
        finally:
            stop_server_process(proc)


if __name__ == "__main__":
    main()
