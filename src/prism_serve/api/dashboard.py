"""The /dashboard page: what is loaded where and how each device's memory is shared, updated live.

    GET /dashboard          one self-contained HTML page (inline CSS and vanilla JS; nothing is
                            fetched from elsewhere), open to anyone who can reach the server
    GET /dashboard/state    the JSON the page polls every 1.5 s (schema: api/schema.py DashboardState)

With tenants (api/tenants.py), the page also shows each tenant's load, limits, 429s and SLO
attainment: every tenant to the admin key, its own row to a tenant's key.

Keys: the page itself holds no data, so it is served without a key; its JSON needs one when
``server.api_keys`` is set (any API key or the admin key, as /v1/models). The page takes the key
from its URL fragment (``/dashboard#key=sk-...``: browsers never send a fragment to the server, so
it stays out of access logs), or asks for it in a form after a 401, keeps it in the tab's
sessionStorage and sends it as ``Authorization: Bearer``. The same numbers without a key are on
/metrics (``prism_device_*``, ``prism_model_*``), which stays open for scrapers.

Every number is read when the JSON is asked for, through the helpers /metrics uses
(api/metrics.py ``device_memory``, ``kv_usage``, ``ServerMetrics.attainment`` and ``recent``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from prism_serve import __version__
from prism_serve.api.dashboard_page import PAGE
from prism_serve.api.metrics import MemoryUse, RecentSummary, ServerMetrics, device_memory, kv_usage
from prism_serve.api.schema import DASHBOARD, DASHBOARD_STATE
from prism_serve.runtime.controller import Controller

__all__ = ["add_dashboard_routes", "dashboard_state"]

_KIND_ORDER = {"weights": 0, "kv": 1, "spare": 2, "other": 3}  # a model's weights, then its KV, in the bars


def add_dashboard_routes(
    app: FastAPI, state: Callable[[Request], dict[str, Any]], authorize: Callable[[Request], None]
) -> None:
    """The page and its JSON on ``app``: ``state`` answers the JSON (``dashboard_state``) for a
    request ``authorize`` lets through."""

    @app.get("/dashboard", response_class=HTMLResponse, responses=DASHBOARD)
    async def dashboard() -> HTMLResponse:
        # no-store: a new server version's page replaces an old one at once
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/state", responses=DASHBOARD_STATE)
    async def dashboard_json(http: Request) -> dict:
        authorize(http)
        return state(http)


def dashboard_state(
    controller: Controller, metrics: ServerMetrics, tenants: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Devices with their memory split by model, models with their state, load and recent SLO
    numbers (one read of the controller and of each device's ledger), and ``tenants``: the cards
    of ``GET /v1/admin/tenants`` the caller may see."""
    attainment = metrics.attainment()
    models = []
    for s in controller.status():
        models.append({
            "id": s.model, "state": s.state, "pinned": s.pinned, "device": s.device,
            "weight_bytes": s.weight_bytes, "used_kv_bytes": s.used_kv_bytes,
            "cached_kv_bytes": s.cached_kv_bytes, "max_kv_bytes": s.max_kv_bytes,
            "kv_usage": kv_usage(s), "num_running": s.num_running, "num_queued": s.num_queued,
            "num_activations": s.num_activations, "num_evictions": s.num_evictions,
            "ttft_slo": s.ttft_slo, "tpot_slo": s.tpot_slo,
            "replicas": [
                {"replica": r.replica, "state": r.state, "device": r.device,
                 "num_running": r.num_running, "num_queued": r.num_queued}
                for r in s.replicas
            ],
            "recent": _recent(metrics.recent(s.model)),
            "slo_attainment": {slo: v for (m, slo), v in attainment.items() if m == s.model},
        })  # fmt: skip
    devices = [
        {
            "name": d.device,
            "budget_bytes": d.budget_bytes,
            "used_bytes": d.used_bytes,
            "free_bytes": d.free_bytes,
            "uses": [
                {"model": u.model, "replica": u.replica, "kind": u.kind, "name": u.name, "bytes": u.bytes}
                for u in sorted(d.uses, key=_use_order)
            ],
        }
        for d in device_memory(controller)
    ]
    return {
        "object": "dashboard.state",
        "version": __version__,
        "created": time.time(),
        "devices": devices,
        "models": models,
        "tenants": tenants or [],
    }


def _use_order(u: MemoryUse) -> tuple:
    """In a device's bar: each model's weights then its KV (models by name, replicas in order),
    then spare pages and entries of no model."""
    return (u.model is None, u.model or "", u.replica, _KIND_ORDER[u.kind], u.name)


def _recent(r: RecentSummary) -> dict[str, Any]:
    return {
        "window_s": r.window_s,
        "num_judged": r.num_judged,
        "num_finished": r.num_finished,
        "ttft_p50": r.ttft_p50,
        "ttft_p95": r.ttft_p95,
        "ttft_attainment": r.ttft_attainment,
        "tpot_attainment": r.tpot_attainment,
    }
