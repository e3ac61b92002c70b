"""The live side of benchmarks/sim_vs_live.py: one fresh ``prism serve`` of a deployment config, its
warm-up, the ``prism bench`` replay of a workload (every worker step traced, see
engine/step_trace.py), the server's counters and /metrics before and after, and the load other
processes put on the machine meanwhile; plus reading the live runs of an earlier result.json."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import yaml

from prism_serve.config import DeploymentConfig
from prism_serve.sim.config import ModelSLO
from prism_serve.workload.format import Workload
from sim_mirror import ATTAINMENTS, BUSY, COUNTS, LATENCIES, WARMUP_OUTPUT, WARMUP_PROMPT


def live_model_stats(summary: dict) -> dict[str, dict]:
    """Per model (and "(all)") from a bench summary (bench/report.py ``summarize``)."""
    keys = ("requests", "failed", *LATENCIES, *ATTAINMENTS)
    rows = {m: {k: s[k] for k in keys} for m, s in summary["models"].items()}
    rows["(all)"] = {k: summary["overall"][k] for k in keys}
    return rows


# ---- the live run -------------------------------------------------------------------------------


def _proc_tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants (the waited-for exited ones included), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    times: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            text = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = text.rsplit(")", 1)[1].split()
        parent[int(d)] = int(f[1])
        times[int(d)] = (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in parent.items():
            if pp == p and c not in tree:
                tree.add(c)
                frontier.append(c)
    return sum(times.get(p, 0.0) for p in tree)


def _models(port: int) -> list[dict]:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]


def _counts(port: int) -> dict[str, dict]:
    """Model -> activations, evictions (the server's counters, as /metrics' prism_model_activations
    and prism_model_evictions), device."""
    return {
        c["id"]: {"activations": c["num_activations"], "evictions": c["num_evictions"], "device": c["device"]}
        for c in _models(port)
    }


def _placement(counts: dict[str, dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, c in counts.items():
        if c["device"]:
            out.setdefault(c["device"], []).append(name)
    return dict(sorted(out.items()))


def _wait_idle(port: int, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all(c["num_running"] == 0 and c["num_queued"] == 0 for c in _models(port)):
            return
        time.sleep(0.5)


def _scrape(port: int) -> dict[str, dict[str, float]]:
    """From /metrics: device -> mapped bytes, and model -> engine step (wall) and worker CPU seconds
    so far (their ratio over the replay is the share of its core an engine got while it had work)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {"mapped": {}, "step": {}, "cpu": {}, "act_s": {}, "act_n": {}}
    names = {"prism_device_mapped_bytes": "mapped", "prism_engine_step_seconds_total": "step",
             "prism_engine_cpu_seconds_total": "cpu", "prism_activation_seconds_sum": "act_s",
             "prism_activation_seconds_count": "act_n"}  # fmt: skip
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = names.get(s.name)
            if key is None:
                continue
            where = s.labels.get("device") if key == "mapped" else s.labels.get("model_name")
            out[key][where] = out[key].get(where, 0.0) + s.value  # activations: every device
    return out


def _activation_means(before: dict, after: dict) -> dict[str, float | None]:
    """Mean activation seconds (decision to ready) per model over the replay."""
    out: dict[str, float | None] = {}
    for m, n in after["act_n"].items():
        k = n - before["act_n"].get(m, 0.0)
        out[m] = round((after["act_s"][m] - before["act_s"].get(m, 0.0)) / k, 4) if k else None
    return out


def _core_shares(before: dict, after: dict) -> dict[str, dict]:
    shares = {}
    for m, step in sorted(after["step"].items()):
        st = step - before["step"].get(m, 0.0)
        cpu = after["cpu"].get(m, 0.0) - before["cpu"].get(m, 0.0)
        shares[m] = {
            "step_s": round(st, 2),
            "cpu_s": round(cpu, 2),
            "cpu_share": round(cpu / st, 3) if st else None,
        }
    return shares


async def run_live(cfg: DeploymentConfig, workload: Workload, out: Path, tag: str, timeout_s: float) -> dict:
    """One fresh ``prism serve`` with ``cfg``: warm-up (one request per model, one at a time), the
    replay of ``workload``, the server's activation/eviction counters before and after."""
    import httpx

    import common
    from prism_serve.api.process import free_port, start_server_process, stop_server_process
    from prism_serve.bench.replay import replay
    from prism_serve.bench.settings import BenchSettings
    from prism_serve.engine.step_trace import ENV_VAR as STEP_TRACE_ENV

    port = free_port()
    data = cfg.model_dump(mode="json")
    data["server"].update(port=port, namespace=f"simvslive-{uuid.uuid4().hex[:8]}")
    path = out / f"serve-{tag}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    slos = {m.name: ModelSLO(m.ttft_slo, m.tpot_slo) for m in cfg.models}
    # every engine step's shape and seconds, for fit_cpu_profile.py --trace
    steps_dir = out / f"steps-{tag}"
    trace = {STEP_TRACE_ENV: str(steps_dir)}
    proc = start_server_process(path, port, out / f"server-{tag}.log", env=trace)
    try:
        healthy = time.perf_counter()
        warmup: list[tuple[float, str]] = []
        for m in cfg.models:  # in the config's order, as benchmarks/live_eval.py
            body = {"model": m.name, "prompt": WARMUP_PROMPT, "max_tokens": WARMUP_OUTPUT, "ignore_eos": True}
            warmup.append((time.perf_counter(), m.name))
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300).raise_for_status()
        warm = _counts(port)
        scraped = _scrape(port)
        settings = BenchSettings(prompt="ids", timeout_s=timeout_s, slo_scale=1.0)
        cpu0, server0 = common.cpu_seconds(), _proc_tree_cpu(proc.pid)
        replay_start = time.perf_counter()
        res = await replay(workload, f"http://127.0.0.1:{port}", settings, slos=slos, progress=True)
        wall = time.perf_counter() - replay_start
        busy, own = common.cpu_seconds()
        server_cores = (_proc_tree_cpu(proc.pid) - server0) / wall
        other = max(0.0, (busy - cpu0[0] - (own - cpu0[1])) / wall - server_cores)
        _wait_idle(port)
        end = _counts(port)
        final = _scrape(port)
        shares, activation_s = _core_shares(scraped, final), _activation_means(scraped, final)
    finally:
        stop_server_process(proc)
    stats = live_model_stats(res.summary())
    records = [r.to_json() for r in res.records]
    for name in slos:
        for key in COUNTS:
            stats[name][key] = end[name][key] - warm[name][key]
            stats[name][f"warmup_{key}"] = warm[name][key]
        stats[name][BUSY] = shares.get(name, {}).get("step_s", 0.0)
    for key in (*COUNTS, BUSY):
        stats["(all)"][key] = sum(stats[n][key] for n in slos)
    return {
        "models": stats,
        "warmup": [(round(t - replay_start, 4), m) for t, m in warmup],
        "warmup_start_after_healthy_s": round(warmup[0][0] - healthy, 4),
        "placement_after_warmup": _placement(warm),
        "placement_at_end": _placement(end),
        "mapped_bytes_after_warmup": {d: int(b) for d, b in scraped["mapped"].items()},
        "engine_seconds": shares,
        "activation_mean_s": activation_s,
        "wall_s": round(wall, 1),
        "server_cores_busy": round(server_cores, 3),
        "other_load_cores": round(other, 3),
        "errors": res.summary()["overall"]["errors"],
        "send_lag_p99_s": res.summary()["overall"]["send_lag_p99_s"],
        "requests": records,
        "steps_dir": str(steps_dir),
        "serving_path": serving_path_s(records, steps_dir),
    }


def serving_path_s(requests: list[dict], steps_dir: Path) -> dict[str, float | int]:
    """What the serving path (HTTP, tokenization, the controller-worker hop, SSE) adds to a time to
    first token: each request's TTFT minus the wall seconds of its own prefill step, over the
    requests whose prefill step held no other request (nothing else of that model ran). Requests
    are matched to their model's fresh prefill steps (no cached tokens, more than the warm-up's
    tokens) in order; a model whose counts differ is left out. HardwareProfile.request_overhead_s
    is this median."""
    from collections import defaultdict

    from prism_serve.engine.step_trace import read_step_traces

    prefills: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for step in sorted(read_step_traces([steps_dir]), key=lambda s: s.t):
        for new, cached, _ in step.batch:
            if cached == 0 and new > len(WARMUP_PROMPT):
                prefills[step.model].append((step.dt, len(step.batch)))
    by_model: dict[str, list[dict]] = defaultdict(list)
    for r in sorted(requests, key=lambda r: r["sent_s"]):
        if r.get("error") is None:
            by_model[r["served_model"]].append(r)
    diffs = []
    for model, reqs in by_model.items():
        steps = prefills.get(model, [])
        if len(steps) != len(reqs):
            continue
        diffs += [r["ttft_s"] - dt for r, (dt, width) in zip(reqs, steps, strict=True) if width == 1]
    if not diffs:
        return {"requests": 0}
    q = np.percentile(diffs, [50, 90])
    return {"requests": len(diffs), "median_s": round(float(q[0]), 5), "p90_s": round(float(q[1]), 5)}


def wait_quiet_window(limit_s: float, threshold: float, window_s: float = 10.0) -> float:
    """Wait (up to ``limit_s``) for ``window_s`` seconds in which other processes used fewer than
    ``threshold`` cores (a longer window than common.wait_quiet's half second: a live run lasts
    minutes); returns the last window's load."""
    import common

    deadline = time.monotonic() + limit_s
    while True:
        start = common.cpu_seconds()
        time.sleep(window_s)
        load = common.other_load_since(start, window_s)
        if load < threshold or time.monotonic() > deadline:
            return load


def wait_for_file(path: str | None, limit_s: float) -> None:
    if not path:
        return
    deadline = time.monotonic() + limit_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            sys.exit(f"{path} did not appear within {limit_s:.0f} s; not running")
        print(f"waiting for {path} ...", flush=True)
        time.sleep(30)


def reused_live_runs(path: Path, cfg: DeploymentConfig, workload: Workload) -> list[dict]:
    """The live runs of an earlier result.json, if it ran this deployment and these requests."""
    old = json.loads(path.read_text())
    if old.get("deployment") != cfg.model_dump(mode="json"):
        sys.exit(f"{path} ran another deployment")
    sent = [
        (r["model"], r["scheduled_s"], r["prompt_tokens"], r["max_tokens"])
        for r in old["live"][0]["requests"]
    ]
    here = [(r.model, r.timestamp, r.prompt_tokens, r.output_tokens) for r in workload.rows()]
    if len(sent) != len(here) or any(
        a[0] != b[0] or a[2:] != b[2:] or abs(a[1] - b[1]) > 1e-5 for a, b in zip(sent, here, strict=True)
    ):
        sys.exit(f"{path} replayed another workload")
    for i, run in enumerate(old["live"]):  # runs before the engine busy row: from their engine seconds
        run.setdefault("steps_dir", str(path.parent / f"steps-{i}"))
        for name, stats in run["models"].items():
            if name != "(all)" and BUSY not in stats:
                stats[BUSY] = run.get("engine_seconds", {}).get(name, {}).get("step_s")
        busy = [s.get(BUSY) for n, s in run["models"].items() if n != "(all)"]
        run["models"]["(all)"].setdefault(BUSY, sum(busy) if None not in busy else None)
    return old["live"]
