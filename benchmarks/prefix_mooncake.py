"""The Mooncake trace's prefix sharing, live against the simulator and an unbounded cache.

The real trace (``mooncake_synthetic.jsonl``: 3,993 requests over 1,022 s, each with the hashes of
its 512-token prompt blocks) scaled to this machine: every hashed block becomes ``--block-tokens``
tokens (prompts scaled alike, so who shares what is unchanged), times compressed to
``--total-rate`` requests per second, outputs capped at ``--max-output-tokens``. One model
(SmolLM2-135M-Instruct, fp32, its prefix cache on) on one CPU device with every core of this
process and ``--memory`` of budget.

The replay is ``prism bench``'s (live_run.py ``run_live``): prompts of token ids built so that equal
hashes are equal blocks, so the live engine meets exactly the sharing the trace records; its hit rate
is the cached prompt tokens each response reported (``usage.prompt_tokens_details.cached_tokens``)
over all prompt tokens. The simulator replays the same arrivals (and the live warm-up) on the same
deployment (sim_mirror.py: the same budget, block size, engine limits, the machine's CPU profile)
and reports its own hit rate and what one unbounded cache per model would hold
(``prefix_hit_rate_infinite``: every earlier prompt's blocks, at the engine's block size).

Prints live, simulated and unbounded hit rates, the two differences in points, and the run's
latencies; writes result.json (every request's record) to ``--out``.

    python benchmarks/prefix_mooncake.py --out results/prefix-mooncake
    python benchmarks/prefix_mooncake.py --memory 2GiB --out results/pm-2g   # a cache that evicts
    python benchmarks/prefix_mooncake.py --duration 120 --out /tmp/pm   # the trace's first 120 s (scaled)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import common  # noqa: E402
from live_run import run_live  # noqa: E402
from prism_serve.config import parse_config  # noqa: E402
from prism_serve.workload.builder import WorkloadSpec, build_workload  # noqa: E402
from prism_serve.workload.format import write_jsonl  # noqa: E402
from sim_mirror import REAL_SOURCE, run_sim, sim_deployment, with_warmup  # noqa: E402

MODEL = "smollm2"
TARGET_SIM_POINTS = 3.0  # live within this many points of the simulator
TARGET_INFINITE_POINTS = 5.0  # and of an unbounded cache


def config_text(memory: str, block_size: int, cores: str, ttft_slo: float, tpot_slo: float) -> str:
    return (
        f'devices:\n  - {{name: "cpu:0", memory: {memory}, cores: "{cores}", workers: 2}}\n'
        f"models:\n  - {{name: {MODEL}, source: {REAL_SOURCE}, dtype: float32, ttft_slo: {ttft_slo}, "
        f"tpot_slo: {tpot_slo}, block_size: {block_size}}}\n"
        "policy: {name: prism}\n"
        "server: {max_waiting_requests: 4096, request_timeout_s: 600}\n"
    )


def live_hit_rate(requests: list[dict]) -> tuple[float | None, int]:
    """Cached over prompt tokens of the requests whose usage reported both; how many did not."""
    told = [r for r in requests if r["usage_cached_tokens"] is not None and r["usage_prompt_tokens"]]
    prompt = sum(r["usage_prompt_tokens"] for r in told)
    rate = sum(r["usage_cached_tokens"] for r in told) / prompt if prompt else None
    return rate, len(requests) - len(told)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-tokens", type=int, default=2, help="tokens per hashed block after scaling")
    ap.add_argument("--engine-block", type=int, default=16, help="the engine's KV block size")
    ap.add_argument("--total-rate", type=float, default=6.0, help="requests per second after scaling")
    ap.add_argument("--duration", type=float, default=None, help="seconds of the scaled trace (default all)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1792)
    ap.add_argument("--max-output-tokens", type=int, default=8)
    ap.add_argument("--memory", default="6GiB", help="the device's budget (weights and KV)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    machine = common.machine_info()
    print(f"machine: {machine['line']}", flush=True)
    spec = WorkloadSpec(
        (MODEL,),
        source="mooncake",
        duration_s=args.duration if args.duration is not None else 1e9,
        total_rate=args.total_rate,
        block_tokens=args.block_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    workload = build_workload(spec)
    write_jsonl(workload, args.out / "workload.jsonl")
    affinity = sorted(os.sched_getaffinity(0))
    cores = f"{affinity[0]}-{affinity[-1]}" if len(affinity) > 1 else str(affinity[0])
    # SLOs wide enough that nothing is refused for lateness: this measures hits, not attainment
    text = config_text(args.memory, args.engine_block, cores, ttft_slo=60.0, tpot_slo=5.0)
    (args.out / "deployment.yaml").write_text(text)
    cfg = parse_config(text, "prefix_mooncake")
    print(
        f"workload: {len(workload)} requests over {workload.duration:.0f} s, "
        f"{int(workload.prompt_tokens.sum())} prompt tokens (mean {workload.prompt_tokens.mean():.0f}), "
        f"hashed blocks of {args.block_tokens} tokens, engine blocks of {args.engine_block}; "
        f"device {args.memory} on cores {cores}",
        flush=True,
    )

    live = asyncio.run(run_live(cfg, workload, args.out, "0", args.timeout))
    live_rate, untold = live_hit_rate(live["requests"])
    print(f"live: {live['wall_s']} s, errors {live['errors'] or 'none'}", flush=True)

    dep = sim_deployment(cfg)
    sim_wl = with_warmup(workload, live["warmup"], 0.0)
    sim = run_sim(dep, sim_wl, len(live["warmup"]))
    sim_rate, inf_rate = sim["summary"]["prefix_hit_rate"], sim["summary"]["prefix_hit_rate_infinite"]

    lm, sm = live["models"]["(all)"], sim["models"]["(all)"]
    print(f"\n{'':<28}{'live':>10}{'sim':>10}{'unbounded':>11}")
    print(f"{'prefix hit rate':<28}{live_rate:>10.1%}{sim_rate:>10.1%}{inf_rate:>11.1%}")
    for key in ("ttft_p50_s", "ttft_p95_s"):
        print(f"{key:<28}{lm[key]:>10.3f}{sm[key]:>10.3f}")
    d_sim, d_inf = 100 * (live_rate - sim_rate), 100 * (live_rate - inf_rate)
    ok_sim, ok_inf = abs(d_sim) <= TARGET_SIM_POINTS, abs(d_inf) <= TARGET_INFINITE_POINTS
    print(
        f"\nlive - sim: {d_sim:+.1f} points (target within {TARGET_SIM_POINTS:g}: "
        f"{'met' if ok_sim else 'MISSED'})"
        f"\nlive - unbounded: {d_inf:+.1f} points (target within {TARGET_INFINITE_POINTS:g}: "
        f"{'met' if ok_inf else 'MISSED'})"
    )
    if untold:
        print(f"warning: {untold} responses did not report cached tokens (counted out)")
    result = {
        "machine": machine,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "deployment": text,
        "hit_rate": {"live": live_rate, "sim": sim_rate, "unbounded": inf_rate},
        "live": live,
        "sim": sim,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
