"""The ``prism`` command: ``serve``, ``generate``, ``memory``, ``sim`` and ``workload`` (sim/cli.py),
``bench`` (bench/cli.py)."""

from __future__ import annotations

import argparse
import sys
import time

from prism_serve.errors import InvalidRequestError, PrismError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    # Unset flags leave EngineConfig's defaults (engine/config.py), their one home.
    p.add_argument(
        "--model",
        help="smollm2-135m-instruct (default, real weights), random:<preset> (synthetic), "
        "a .gguf file, or an HF-layout directory",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        help="default auto: bfloat16 where the CPU has native bf16 matmuls (AVX512_BF16, AMX), else float32",
    )
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens (default 2048)")


def _engine_knobs(args: argparse.Namespace) -> dict:
    """The engine flags given on the command line, as EngineConfig keyword arguments."""
    knobs = {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len}
    return {k: v for k, v in knobs.items() if v is not None}


def _cmd_generate(args: argparse.Namespace) -> int:
    from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
    from prism_serve.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or [],
    )
    elastic = None
    if args.elastic_kv:
        from prism_serve.memory.kv_pool import PoolConfig

        elastic = PoolConfig(device=args.device)
    engine = LLMEngine(EngineConfig(seed=args.seed or 0, elastic_kv=elastic, **_engine_knobs(args)))
    if engine.synthetic:
        print(f"[synthetic weights: {engine.weights_source}; the text is meaningless]", file=sys.stderr)
    prompt = args.prompt
    if not args.raw and engine.tokenizer.chat_template:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine.add_request(prompt, params)
    start = time.perf_counter()
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    if out is not None and args.verbose:
        print(
            f"[{out.num_output_tokens} tokens in {elapsed:.2f}s, "
            f"{out.num_output_tokens / elapsed:.1f} tok/s, "
            f"finish_reason={out.finish_reason}]",
            file=sys.stderr,
        )
    engine.close()
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from prism_serve.api.server import run_server
    from prism_serve.config import default_config, load_config
    from prism_serve.runtime.build import device_specs

    config = load_config(args.config) if args.config else default_config()
    config = config.with_overrides(
        host=args.host, port=args.port, policy=args.policy, ray_address=args.ray, request_log=args.request_log
    )
    server = config.server
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    devices = ", ".join(d.describe() for d in device_specs(config))
    if config.ray is not None:
        devices = f"every node of the Ray cluster at {config.ray.address} ({devices} on each)"
    print(
        f"prism serve: {len(config.models)} models on {devices}; policy {config.policy.name}", file=sys.stderr
    )
    for m in config.models:
        kind = (
            f"adapter of {m.base}" if m.is_adapter
            else "synthetic weights" if m.source.startswith("random:") else m.source
        )  # fmt: skip
        print(
            f"  {m.name:<28} {kind:<28} TTFT SLO {m.ttft_slo:g}s  TPOT SLO {m.tpot_slo:g}s", file=sys.stderr
        )
    print(f"  OpenAI endpoint: http://{server.host}:{server.port}/v1", file=sys.stderr)
    if server.request_log:
        print(f"  request log: {server.request_log}", file=sys.stderr)
    run_server(config, log_level=args.log_level)
    return 0


def _render_ledgers(namespace: str | None, only: str | None) -> str:
    """The ledger of device ``only``, or of every device with one in ``namespace``, as a table."""
    import datetime

    from prism_serve.memory.ledger import DeviceLedger, ledger_path
    from prism_serve.memory.vmm import format_size

    devices = [only] if only else DeviceLedger.list_devices(namespace)
    if not devices:
        return f"no memory ledgers in namespace {namespace or '(default)'} (no engine has run)\n"
    lines = []
    for device in devices:
        ledger = DeviceLedger(device, namespace=namespace)
        try:
            snap = ledger.snapshot()
        finally:
            ledger.close()
        pct = 100 * snap.used_bytes / snap.budget_bytes if snap.budget_bytes else 0.0
        lines.append(
            f"{device}  budget {format_size(snap.budget_bytes)}  used {format_size(snap.used_bytes)} "
            f"({pct:.1f}%)  free {format_size(snap.free_bytes)}"
            + (f"  spare {format_size(snap.spare_bytes)} (reclaimable)" if snap.spare_bytes else "")
            + (f"  cached KV {format_size(snap.cached_bytes)} (reclaimable)" if snap.cached_bytes else "")
            + f"  [{ledger_path(device, namespace)}]"
        )
        lines.append(
            f"  {'SLOT':>4}  {'PID':>7}  {'ENGINE':<28} {'MAPPED':>11} {'PEAK':>11} {'LIMIT':>11}  SINCE"
        )
        for e in snap.entries:
            limit = "-" if e.limit_bytes is None else format_size(e.limit_bytes)
            since = datetime.datetime.fromtimestamp(e.registered).strftime("%H:%M:%S")
            lines.append(
                f"  {e.slot:>4}  {e.pid:>7}  {e.name[:28]:<28} {format_size(e.mapped_bytes):>11} "
                f"{format_size(e.peak_bytes):>11} {limit:>11}  {since}"
            )
        if not snap.entries:
            lines.append("  (no engines)")
    return "\n".join(lines) + "\n"


def _cmd_memory(args: argparse.Namespace) -> int:
    from prism_serve.memory.ledger import DeviceLedger
    from prism_serve.memory.vmm import parse_size

    ns = args.namespace
    if args.set_budget is not None or args.set_limit is not None:
        if not args.device:
            raise InvalidRequestError("--set-budget and --set-limit need --device")
        ledger = DeviceLedger(args.device, namespace=ns)
        try:
            if args.set_budget is not None:
                ledger.set_budget(parse_size(args.set_budget))
            if args.set_limit is not None:
                name, _, size = args.set_limit.rpartition("=")
                slots = ledger.find(name)
                if not name or not slots:
                    raise InvalidRequestError(
                        f"no live engine called {name!r} on {args.device} (ENGINE=SIZE)"
                    )
                for slot in slots:
                    ledger.set_limit(slot, None if size.lower() == "none" else parse_size(size))
        finally:
            ledger.close()
    if args.watch is None:
        sys.stdout.write(_render_ledgers(ns, args.device))
        return 0
    while True:  # like `watch`: redraw until Ctrl-C
        sys.stdout.write(
            "\x1b[H\x1b[2J"
            + time.strftime("%H:%M:%S  ")
            + "prism memory\n"
            + _render_ledgers(ns, args.device)
        )
        sys.stdout.flush()
        time.sleep(args.watch)


def _cmd_hash_key(args: argparse.Namespace) -> int:
    from prism_serve.api.tenants import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        print("prism: error: no key on standard input", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism", description="prism-serve: many LLMs on few accelerators")
    sub = parser.add_subparsers(dest="command", required=True)
    sv = sub.add_parser(
        "serve",
        help="serve every configured model behind one OpenAI-compatible endpoint",
        description="Without --config: the built-in default (2 CPU devices, real SmolLM2-135M-Instruct "
        "under three names, two synthetic-weight models). See prism_serve/config.py for the YAML format.",
    )
    sv.add_argument("--config", help="deployment YAML (devices, models, policy, server)")
    sv.add_argument("--host", help="override server.host")
    sv.add_argument("--port", type=int, help="override server.port")
    sv.add_argument("--policy", help="override policy.name (its knobs then take their defaults)")
    sv.add_argument(
        "--request-log", metavar="PATH", help="override server.request_log: a JSON line per request"
    )
    sv.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="serve on every node of this Ray cluster (auto, or host:port); each node runs the "
        "configured devices",
    )
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sv.set_defaults(func=_cmd_serve)

    g = sub.add_parser("generate", help="print a completion of one prompt (streams to stdout)")
    g.add_argument("prompt")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print token count and speed to stderr")
    g.add_argument("--elastic-kv", action="store_true", help="map KV pages on demand under the device ledger")
    g.add_argument("--device", default="cpu:0", help="device whose ledger the elastic KV pool uses")
    g.set_defaults(func=_cmd_generate)

    m = sub.add_parser(
        "memory",
        help="show (and limit) device memory per engine from the shared ledgers",
        description="Prints each device's budget and every engine's mapped bytes, peak and limit. "
        "Ledgers live in /dev/shm, one per device and namespace ($PRISM_LEDGER_NAMESPACE).",
    )
    m.add_argument("--device", help="only this device (cpu:0, cuda:1, ...)")
    m.add_argument("--namespace", help="ledger namespace (default: $PRISM_LEDGER_NAMESPACE or uid<N>)")
    m.add_argument(
        "--watch", nargs="?", type=float, const=1.0, metavar="SECONDS", help="redraw every SECONDS (1)"
    )
    m.add_argument(
        "--set-budget", metavar="SIZE", help="change the device budget, e.g. 8GiB (needs --device)"
    )
    m.add_argument(
        "--set-limit",
        metavar="ENGINE=SIZE",
        help="cap an engine, e.g. llama=2GiB, or llama=none (needs --device)",
    )
    m.set_defaults(func=_cmd_memory)

    hk = sub.add_parser(
        "hash-key",
        help="print how a keys file stores an API key (sha256:...)",
        description="Reads the key from standard input (one line), so it stays out of the shell's "
        "history, and prints the line to put in a tenant's keys (server.keys_file).",
    )
    hk.set_defaults(func=_cmd_hash_key)

    from prism_serve.bench.cli import add_bench_parser
    from prism_serve.ops_cli import add_ops_parsers
    from prism_serve.sim.cli import add_sim_parser, add_workload_parser
    from prism_serve.sim.plan_cli import add_fit_parser, add_plan_parser

    add_sim_parser(sub)
    add_plan_parser(sub)
    add_fit_parser(sub)
    add_workload_parser(sub)
    add_bench_parser(sub)
    add_ops_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PrismError as e:
        print(f"prism: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
