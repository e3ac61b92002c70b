"""Admin routes: load, unload, pin and unpin a model by hand (behind the admin key).

    POST /v1/admin/models/{name}/load     {"device": "cpu:1"}   (body optional: the policy picks)
    POST /v1/admin/models/{name}/unload   {"force": true}       (default: requests in flight finish first)
    POST /v1/admin/models/{name}/pin      never evicted by the policy
    POST /v1/admin/models/{name}/unpin

Each answers the model's card (as in /v1/models) plus what happened. With ``server.admin_key`` set,
only ``Authorization: Bearer <admin_key>`` passes; without it the routes are open only when the
server has no API keys at all (a local, unauthenticated deployment), and refused otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from prism_serve.api.errors import AuthenticationError, PermissionDeniedError, bearer_token, key_matches
from prism_serve.api.protocol import Text
from prism_serve.api.schema import ADMIN, TENANTS
from prism_serve.api.tenants import Tenants
from prism_serve.config import ServerConfig
from prism_serve.runtime.controller import Controller

__all__ = ["add_admin_routes"]


class LoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    device: Text | None = None  # one of the configured devices (400 otherwise)


class LoadAdapterBody(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body, and the base to run it over where several
    models have adapter slots."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: Text
    lora_path: Text
    base_model_name: Text | None = None
    ttft_slo: float | None = Field(None, gt=0)
    tpot_slo: float | None = Field(None, gt=0)


class UnloadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # vLLM's lora_int_id is accepted, unused
    lora_name: Text
    force: bool = False  # True: its requests in flight fail now (503); else they finish first


class UnloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # False: requests in flight finish first (up to server.request_timeout_s); True: they end now
    force: bool = False


def add_admin_routes(
    app: FastAPI, c: Controller, settings: ServerConfig, cards: Callable[[], list[dict[str, Any]]],
    keys: Tenants,
) -> None:  # fmt: skip
    """The routes above on ``app``, over controller ``c``; ``cards``: the model cards of /v1/models;
    ``keys``: the server's API keys (a known key that is not the admin key gets 403, not 401)."""

    def authorize(http: Request) -> None:
        admin_key = settings.admin_key
        token = bearer_token(http)
        if admin_key is None:
            if keys.enabled:
                raise PermissionDeniedError("admin routes are disabled: set server.admin_key in the config")
            return
        if token is None:
            raise AuthenticationError("admin routes need 'Authorization: Bearer <admin key>'")
        if not key_matches(token, [admin_key]):
            raise (PermissionDeniedError if keys.identify(token) is not None else AuthenticationError)(
                "this key may not use the admin routes"
            )

    def card(name: str, **extra: object) -> dict:
        out = next(m for m in cards() if m["id"] == name)
        out.update(extra)
        return out

    @app.post("/v1/admin/models/{name:path}/load", responses=ADMIN)
    async def load(name: str, http: Request, body: LoadBody | None = None) -> dict:
        authorize(http)
        phases = await c.load(name, body.device if body else None)
        extra = {"activated": phases is not None}
        if phases is not None:
            extra["activation_s"] = {
                "total": phases.total_s, "take": phases.take_s, "map": phases.map_s,
                "copy": phases.copy_s, "ready": phases.ready_s,
            }  # fmt: skip
            extra["engine_compiled"] = phases.compiled
            extra["weights_loaded_by"] = phases.load_path
            extra["weight_pages"] = {"reused": phases.reused_pages, "created": phases.created_pages}
        return card(name, **extra)

    @app.post("/v1/admin/models/{name:path}/unload", responses=ADMIN)
    async def unload(name: str, http: Request, body: UnloadBody | None = None) -> dict:
        authorize(http)
        force = body.force if body else False
        evicted = await c.unload(name, force=force, drain_s=settings.request_timeout_s)
        return card(name, evicted=evicted)

    @app.post("/v1/load_lora_adapter", responses=ADMIN)
    async def load_lora_adapter(body: LoadAdapterBody, http: Request) -> dict:
        """Register a LoRA adapter (vLLM's route): checked against its base, then served by name."""
        authorize(http)
        await c.load_adapter(
            body.lora_name, body.lora_path, body.base_model_name, body.ttft_slo, body.tpot_slo
        )
        return card(body.lora_name)

    @app.post("/v1/unload_lora_adapter", responses=ADMIN)
    async def unload_lora_adapter(body: UnloadAdapterBody, http: Request) -> dict:
        """Remove a LoRA adapter (vLLM's route): its requests in flight finish first, unless force."""
        authorize(http)
        in_flight = await c.unload_adapter(body.lora_name, force=body.force)
        return {"id": body.lora_name, "object": "model", "unloaded": True, "in_flight": in_flight}

    @app.get("/v1/admin/tenants", responses=TENANTS)
    async def tenants(http: Request) -> dict:
        """Each tenant of the keys file (and ``default``): its models, limits and use."""
        authorize(http)
        now = time.monotonic()
        return {"object": "list", "data": [t.snapshot(now) for t in keys.all()]}

    @app.post("/v1/admin/models/{name:path}/pin", responses=ADMIN)
    async def pin(name: str, http: Request) -> dict:
        authorize(http)
        c.pin(name, True)
        return card(name)

    @app.post("/v1/admin/models/{name:path}/unpin", responses=ADMIN)
    async def unpin(name: str, http: Request) -> dict:
        authorize(http)
        c.pin(name, False)
        return card(name)
