"""Operator commands against a running server: ``prism ps``, ``prism load|unload|pin|unpin MODEL``,
``prism tenants``, ``prism batches`` and the adapter commands.

They speak the server's HTTP API (GET /v1/models, POST /v1/admin/models/{name}/...), so they work
against any prism server the operator can reach, local or not. The URL and keys come from flags or
the environment: PRISM_URL (default http://127.0.0.1:8000), PRISM_API_KEY (or OPENAI_API_KEY) for
``ps``, PRISM_ADMIN_KEY for the admin commands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from prism_serve.errors import PrismError

__all__ = ["add_ops_parsers"]


class ServerError(PrismError):
    """The server could not be reached or answered with an error."""


def _request(args: argparse.Namespace, method: str, path: str, key: str | None, body: dict | None = None):
    import httpx

    url = args.url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, url, headers=headers, json=body, timeout=args.timeout)
    except httpx.HTTPError as e:
        raise ServerError(
            f"cannot reach {args.url}: {e or type(e).__name__} (is `prism serve` running?)"
        ) from None
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise ServerError(f"{method} {path}: HTTP {r.status_code}: {message}")
    return r.json()


_SHORT = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "rep", "presence_penalty": "pres", "frequency_penalty": "freq",
          "max_tokens": "max"}  # fmt: skip


def _sampling(defaults: dict) -> str:
    """A model's sampling defaults, short: temp=0.2,top_p=0.9 (``-``: OpenAI's)."""
    return ",".join(f"{_SHORT.get(k, k)}={v:g}" for k, v in defaults.items()) or "-"


def _table(cards: list[dict]) -> str:
    from prism_serve.memory.vmm import format_size

    rows = [("MODEL", "STATE", "DEVICE", "WEIGHTS", "KV", "RUN", "WAIT", "REPLICAS", "PINNED", "SAMPLING",
             "SOURCE")]  # fmt: skip
    for c in cards:
        if c.get("parent"):  # a LoRA adapter: it runs in its base's engine
            rows.append((
                c["id"], c["state"], c.get("device") or "-", format_size(c["adapter"]["bytes"]),
                "-", "-", "-", "-", "", _sampling(c.get("sampling_defaults") or {}),
                f"adapter of {c['parent']} (rank {c['adapter']['rank']}, {c.get('root', '')})",
            ))  # fmt: skip
            continue
        replicas = c.get("replicas") or []
        devices = ",".join(r["device"] for r in replicas if r.get("device")) or (c.get("device") or "-")
        rows.append((
            c["id"], c["state"], devices, format_size(c["weight_bytes"]),
            format_size(c["used_kv_bytes"]) if c.get("used_kv_bytes") is not None else "-",
            str(c["num_running"]), str(c["num_queued"]), str(len(replicas)),
            "yes" if c["pinned"] else "", _sampling(c.get("sampling_defaults") or {}), c.get("root", ""),
        ))  # fmt: skip
    return _columns(rows)


def _columns(rows: list[tuple[str, ...]]) -> str:
    """Rows of cells as left-aligned columns, a header row first."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return (
        "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows) + "\n"
    )


def _show(args: argparse.Namespace, data: list[dict], table: Callable[[list[dict]], str]) -> int:
    """A listing as JSON (``--json``) or as the columns ``table`` makes of it."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n" if args.json else table(data))
    return 0


def _cmd_ps(args: argparse.Namespace) -> int:
    return _show(args, _request(args, "GET", "/v1/models", args.api_key)["data"], _table)


def _cmd_admin(args: argparse.Namespace) -> int:
    body: dict | None = None
    if args.action == "load" and args.device:
        body = {"device": args.device}
    elif args.action == "unload":
        body = {"force": args.force}
    card = _request(args, "POST", f"/v1/admin/models/{args.model}/{args.action}", args.admin_key, body)
    if args.json:
        sys.stdout.write(json.dumps(card, indent=2) + "\n")
        return 0
    loaded = f"activated in {card['activation_s']['total']:.2f} s" if card.get("activated") else None
    done = {
        "load": loaded or "already active",
        "unload": "evicted" if card.get("evicted") else "not evicted (not resident, or still busy)",
        "pin": "pinned", "unpin": "unpinned",
    }[args.action]  # fmt: skip
    print(
        f"{card['id']}: {done}; state {card['state']}"
        + (f" on {card['device']}" if card.get("device") else "")
    )
    return 0 if args.action != "unload" or card.get("evicted") else 1


def _cmd_adapter(args: argparse.Namespace) -> int:
    if args.action == "load-adapter":
        body = {"lora_name": args.name, "lora_path": args.path}
        if args.base:
            body["base_model_name"] = args.base
        card = _request(args, "POST", "/v1/load_lora_adapter", args.admin_key, body)
        done = f"loaded over {card['parent']} (rank {card['adapter']['rank']})"
    else:
        card = _request(args, "POST", "/v1/unload_lora_adapter", args.admin_key,
                        {"lora_name": args.name, "force": args.force})  # fmt: skip
        done = f"unloaded ({card['in_flight']} requests were in flight)"
    sys.stdout.write(json.dumps(card, indent=2) + "\n" if args.json else f"{args.name}: {done}\n")
    return 0


def _cmd_tenants(args: argparse.Namespace) -> int:
    return _show(args, _request(args, "GET", "/v1/admin/tenants", args.admin_key)["data"], _tenant_table)


def _tenant_table(tenants: list[dict]) -> str:
    def used(n: int, limit: int | None) -> str:
        return f"{n}/{limit}" if limit is not None else "-"

    def share(x: float | None) -> str:
        return f"{100 * x:.1f}%" if x is not None else "-"

    rows = [("TENANT", "IN FLIGHT", "REQUESTS/MIN", "TOKENS/MIN", "ADMITTED", "TOKENS", "429s",
             "TTFT/TPOT MET", "SLO x", "MODELS")]  # fmt: skip
    for t in tenants:
        lim, limited = t["limits"], t["rate_limited"]
        rows.append((
            t["tenant"], used(t["in_flight"], lim["concurrent_requests"]),
            used(t["requests_last_minute"], lim["requests_per_minute"]),
            used(t["tokens_last_minute"], lim["tokens_per_minute"]), str(t["admitted"]),
            str(t["tokens_used"]), ",".join(f"{k}={v}" for k, v in limited.items() if v) or "0",
            f"{share(t['slo_attainment']['ttft'])}/{share(t['slo_attainment']['tpot'])}",
            f"{t['slo_scale']:g}", ",".join(t["models"]),
        ))  # fmt: skip
    return _columns(rows)


def _cmd_batches(args: argparse.Namespace) -> int:
    return _show(args, _request(args, "GET", "/v1/batches?limit=100", args.api_key)["data"], _batch_table)


def _batch_table(batches: list[dict]) -> str:
    import time

    rows = [("BATCH", "STATUS", "ENDPOINT", "DONE", "FAILED", "TOTAL", "CREATED", "OUTPUT")]
    for b in batches:
        counts = b["request_counts"]
        rows.append((
            b["id"], b["status"], b["endpoint"], str(counts["completed"]), str(counts["failed"]),
            str(counts["total"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b["created_at"])),
            b["output_file_id"] or "-",
        ))  # fmt: skip
    return _columns(rows)


def add_ops_parsers(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser, key: str) -> None:
        p.add_argument("--url", default=os.environ.get("PRISM_URL", "http://127.0.0.1:8000"),
                       help="the server (default $PRISM_URL or http://127.0.0.1:8000)")  # fmt: skip
        if key == "api":
            key_env = os.environ.get("PRISM_API_KEY") or os.environ.get("OPENAI_API_KEY")
            p.add_argument("--api-key", default=key_env,
                           help="API key (default $PRISM_API_KEY or $OPENAI_API_KEY)")  # fmt: skip
        else:
            p.add_argument("--admin-key", default=os.environ.get("PRISM_ADMIN_KEY"),
                           help="admin key (default $PRISM_ADMIN_KEY)")  # fmt: skip
        p.add_argument("--json", action="store_true", help="print the server's JSON")
        p.add_argument("--timeout", type=float, default=300.0, help="seconds (an unload may drain first)")

    ps = sub.add_parser("ps", help="models of a running server: state, device, memory, replicas")
    common(ps, "api")
    ps.set_defaults(func=_cmd_ps)
    helps = {
        "load": "activate a model now (where the policy would, or --device)",
        "unload": "evict a model (its requests in flight finish first unless --force)",
        "pin": "never evict a model",
        "unpin": "let the policy evict a model again",
    }
    for action, text in helps.items():
        p = sub.add_parser(action, help=text)
        p.add_argument("model")
        common(p, "admin")
        if action == "load":
            p.add_argument("--device", help="e.g. cpu:1")
        if action == "unload":
            p.add_argument("--force", action="store_true", help="end its requests in flight now")
        p.set_defaults(func=_cmd_admin, action=action)
    p = sub.add_parser("batches", help="the batch lane's batches, newest first: status and progress")
    common(p, "api")
    p.set_defaults(func=_cmd_batches)
    p = sub.add_parser("tenants", help="tenants of a running server: limits, use, 429s (admin key)")
    common(p, "admin")
    p.set_defaults(func=_cmd_tenants)
    p = sub.add_parser("load-adapter", help="serve a LoRA adapter (a PEFT directory) over a base model")
    p.add_argument("name")
    p.add_argument("path", help="the adapter's directory on the server's machine")
    p.add_argument("--base", help="the base model (needed where several have adapter slots)")
    common(p, "admin")
    p.set_defaults(func=_cmd_adapter, action="load-adapter")
    p = sub.add_parser("unload-adapter", help="stop serving a LoRA adapter (its requests finish first)")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="fail its requests in flight now")
    common(p, "admin")
    p.set_defaults(func=_cmd_adapter, action="unload-adapter")
