"""``prism bench``: argument parsing and the handler (cli.py only registers it).

    prism bench --workload w.jsonl --url http://localhost:8000 --out results/bench
    prism bench --workload w.jsonl --url http://gpu-box:8000/v1 --rate-scale 2 --duration 600 \\
        --slos results/sim-8/slos.json --slo-scale 5 --model-map llama-3.2-1b-00=meta-llama/Llama-3.2-1B

Outputs of ``--out DIR``: bench.json (settings, SLOs, per-model and overall statistics, every request)
and bench.png. A table is printed either way.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["add_bench_parser"]


def _raise_open_file_limit() -> None:
    """Every request in flight holds a socket; 1024 descriptors run out in a burst."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass  # not fatal: a request that cannot open a socket is recorded as a "connect" error


def _cmd_bench(args: argparse.Namespace) -> int:
    import asyncio

    from prism_serve.bench.plot import plot_result
    from prism_serve.bench.replay import replay
    from prism_serve.bench.report import format_table
    from prism_serve.bench.settings import BenchSettings, parse_model_map, parse_token_range
    from prism_serve.workload.traffic import TrafficOptions, read_traffic

    settings = BenchSettings(
        rate_scale=args.rate_scale,
        duration_s=args.duration,
        model_map=parse_model_map(args.model_map or ()),
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout,
        prompt=args.prompt,
        token_range=parse_token_range(args.token_range),
        seed=args.seed,
        slo_scale=args.slo_scale,
        tpot_scale=args.tpot_scale,
        ttft_slo_s=args.ttft_slo,
        tpot_slo_s=args.tpot_slo,
    )
    # a workload JSONL, prism serve's request log or a CSV export: whatever prism plan reads
    options = TrafficOptions(format=args.traffic_format, start_s=args.start)
    workload = read_traffic(args.workload, None, options).workload
    slos = None
    if args.slos is not None:
        from prism_serve.sim.slo import load_slos  # imports the simulator: only when asked

        slos = load_slos(args.slos)
    _raise_open_file_limit()
    result = asyncio.run(
        replay(
            workload,
            args.url,
            settings,
            slos=slos,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
            progress=not args.no_progress,
            extra={"argv": sys.argv[1:], "workload": str(args.workload)},
        )
    )
    summary = result.summary()
    print(format_table(summary))
    sources = sorted({s.source for s in result.slos.values()})
    print(
        f"{summary['overall']['succeeded']} of {len(result.records)} requests succeeded in "
        f"{result.duration_s:.1f} s; SLOs from {', '.join(sources)}",
        file=sys.stderr,
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result.write_json(args.out / "bench.json", token_times=args.token_times)
        plot_result(result, args.out / "bench.png")
        print(f"report in {args.out}/ (bench.json, bench.png)", file=sys.stderr)
    # nothing succeeded: most likely a wrong URL, model names or key, which a script should notice
    return 0 if summary["overall"]["succeeded"] or not result.records else 1


def add_bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="replay a workload against an OpenAI-compatible endpoint; report latency and SLO attainment",
        description="Sends each workload request (POST /v1/completions, streamed, ignore_eos) at its "
        "timestamp and reports per-model TTFT/TPOT attainment, p50/p95/p99 of TTFT, TPOT and E2E "
        "latency, throughput and errors by kind. SLOs come from --slos, else from the endpoint's "
        "/v1/models (ttft_slo, tpot_slo fields), else from --ttft-slo/--tpot-slo.",
    )
    b.add_argument(
        "--workload", type=Path, required=True,
        help="a workload JSONL (prism workload --out) or prism serve's request log (--request-log): its "
        "requests again, with the prompt and output lengths the server counted",
    )  # fmt: skip
    b.add_argument("--traffic-format", default="auto", choices=["auto", "log", "jsonl"])
    b.add_argument("--start", type=float, default=0.0, metavar="S", help="from S s after the first arrival")
    b.add_argument("--url", required=True, help="endpoint root, e.g. http://localhost:8000 (or .../v1)")
    b.add_argument("--out", type=Path, help="directory for bench.json and bench.png")
    b.add_argument(
        "--rate-scale", type=float, default=1.0, help="divide timestamps by this (2: twice the rate)"
    )
    b.add_argument(
        "--duration", type=float, default=None, metavar="S", help="only the workload's first S seconds"
    )
    b.add_argument(
        "--model-map",
        action="append",
        metavar="WORKLOAD=SERVED",
        help="send a workload model under another name (repeatable or comma-separated)",
    )
    b.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    b.add_argument("--timeout", type=float, default=600.0, help="per request, seconds (600)")
    b.add_argument("--slos", type=Path, help="SLO file written by prism sim (unscaled)")
    b.add_argument(
        "--slo-scale",
        type=float,
        default=None,
        help="SLO multiplier (default 5 with --slos, as prism sim; else 1)",
    )
    b.add_argument(
        "--tpot-scale", type=float, default=None, help="TPOT SLO multiplier (default: --slo-scale)"
    )
    b.add_argument("--ttft-slo", type=float, default=1.0, help="default TTFT SLO, s (1.0)")
    b.add_argument("--tpot-slo", type=float, default=0.1, help="default TPOT SLO, s (0.1)")
    b.add_argument(
        "--prompt",
        choices=["ids", "text"],
        default="ids",
        help="ids: a token-id array of the exact length (default); text: words, about that many tokens",
    )
    b.add_argument("--token-range", default="1000:8000", metavar="LO:HI", help="prompt token ids [LO, HI)")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompt contents")
    b.add_argument("--api-key", default=None, help="Bearer key (default $OPENAI_API_KEY)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "--token-times", action="store_true", help="store each request's chunk times in bench.json"
    )
    b.set_defaults(func=_cmd_bench)
