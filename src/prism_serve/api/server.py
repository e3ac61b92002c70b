"""The OpenAI-compatible HTTP server: one endpoint for every configured model.

``PrismServer`` wires the HTTP layer: the runtime (built from the config), the state the serving
classes share (serving.py), one serving class per route family (routes.py ``Endpoints``), the
routes, middleware, the batch lane's runner, and the app's life: the runtime starts and stops with
uvicorn's event loop, so a request is a coroutine from HTTP to tokens.

A request for an evicted model activates it and waits, bounded by ``server.request_timeout_s``;
headers are sent only with the first token, so anything that goes wrong before it (unknown model,
overload, activation failure, timeout) is a proper HTTP error, not a broken stream. A client that
disconnects, while waiting or while streaming, aborts its request and frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from prism_serve.api import schema as api_schema
from prism_serve.api.admin import add_admin_routes
from prism_serve.api.batch_store import BatchStore, StateDirInUseError
from prism_serve.api.batches import BatchCollector, BatchRunner, add_batch_routes, call_app
from prism_serve.api.dashboard import add_dashboard_routes, dashboard_state
from prism_serve.api.errors import install_error_handlers
from prism_serve.api.headers import RequestIdHeader
from prism_serve.api.limits import BodySizeLimit
from prism_serve.api.metrics import ServerMetrics
from prism_serve.api.request_log import RequestLog
from prism_serve.api.routes import Endpoints, add_openai_routes
from prism_serve.api.serving import ServingState
from prism_serve.api.tenants import TenantCollector, Tenants, TenantUsage
from prism_serve.config import ConfigError, DeploymentConfig
from prism_serve.runtime.build import build_controller
from prism_serve.runtime.controller import Controller

__all__ = ["PrismServer", "create_app", "run_server"]

logger = logging.getLogger(__name__)


class PrismServer:
    """The app and what it is made of (module docstring)."""

    def __init__(self, config: DeploymentConfig, controller: Controller | None = None) -> None:
        self.config = config
        srv = config.server
        try:  # before the controller: a bad keys file stops the server before it takes any memory
            self.tenants = Tenants(srv.keys_file, srv.api_keys)
        except ValueError as e:
            raise ConfigError(f"server.keys_file: {e}") from None
        try:  # the batch lane's state (api/batch_store.py), also before any memory is taken
            self.batches = BatchStore(srv.state_dir) if srv.state_dir else None
        except (StateDirInUseError, OSError) as e:
            raise ConfigError(f"server.state_dir: {e}") from None
        self.controller = controller or build_controller(config)
        self.metrics = ServerMetrics(self.controller)
        if self.tenants.enabled:
            self.metrics.registry.register(TenantCollector(self.tenants))
        # a JSON line per finished request (api/request_log.py), if configured
        log = (
            RequestLog(srv.request_log, srv.request_log_max_bytes, srv.request_log_keep)
            if srv.request_log
            else None
        )
        self.state = ServingState(
            srv,
            self.controller,
            self.metrics,
            self.tenants,
            log,
            {m.name: m.tool_parser for m in config.models},
        )
        self.endpoints = Endpoints.over(self.state, {m.name: m.source for m in config.models})
        state = self.state
        # the batch lane (api/batches.py): the runner starts with the controller
        self.batch_runner = BatchRunner(
            self.batches, lambda path, body, http_state: call_app(self.app, path, body, http_state),
            concurrency=srv.batch_concurrency, idle_s=srv.batch_idle_s, waiting=lambda: state.num_waiting,
            last_interactive=lambda: state.last_interactive, active=self.controller.is_active,
            tenant=self.tenants.named,
        )  # fmt: skip
        if self.batches is not None:
            self.metrics.registry.register(BatchCollector(self.batch_runner))
        self.app = self._build()

    def _build(self) -> FastAPI:
        state, endpoints = self.state, self.endpoints

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI):
            await self.controller.start()
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(signal.SIGHUP, self.tenants.reload)
            try:
                state.start()
                logger.info("serving %s", ", ".join(state.served.names()))
                if self.batches is not None:
                    self.batch_runner.start()
                yield
            finally:
                await self.batch_runner.stop()
                if self.batches is not None:
                    self.batches.close()
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(signal.SIGHUP)
                await self.controller.stop()
                if state.request_log is not None:
                    state.request_log.close()
                logger.info("stopped: workers ended, shared memory released")

        app = FastAPI(title="prism-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
        install_error_handlers(app)
        api_schema.install_openapi(app)
        srv = self.config.server
        app.add_middleware(
            BodySizeLimit, max_bytes=srv.max_request_bytes,
            per_path={"/v1/files": (srv.max_file_bytes, "server.max_file_bytes")},
        )  # fmt: skip
        cors = srv.cors
        if cors is not None:
            app.add_middleware(
                CORSMiddleware, allow_origins=cors.allow_origins, allow_credentials=cors.allow_credentials,
                allow_methods=cors.allow_methods, allow_headers=cors.allow_headers,
                expose_headers=["x-request-id"],
            )  # fmt: skip
        app.add_middleware(TenantUsage)  # a tenant's rate headers, and its request's end
        app.add_middleware(RequestIdHeader)  # outermost: errors from the others carry the id too
        add_openai_routes(app, state, endpoints, self.metrics.render)
        add_batch_routes(app, self.batches, self.batch_runner, state.authorize, lambda: state.served.names())
        add_admin_routes(app, self.controller, srv, endpoints.models.cards, self.tenants)
        add_dashboard_routes(
            app,
            lambda http: dashboard_state(self.controller, self.metrics, state.tenant_cards(http)),
            state.authorize_all,
        )
        return app


def create_app(config: DeploymentConfig) -> FastAPI:
    return PrismServer(config).app


class ListenError(ConfigError):
    """``server.host``/``server.port`` cannot be bound (another process holds it, or the host is not
    this machine's)."""


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything else starts.

    uvicorn binds only after the app's start-up, and start-up launches workers, Ray agents and vLLM
    processes that open ephemeral ports of their own; a port chosen free before start-up could be
    theirs by the time uvicorn asked for it. Bound first, the port is the server's, and a port
    already taken is refused before any worker starts. The socket is not inherited by children."""
    # the address family as uvicorn chooses it (a name such as localhost binds IPv4)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:  # taken, not this machine's address, or a name that does not resolve
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_server(config: DeploymentConfig, log_level: str = "info") -> None:
    """Serve ``config`` with uvicorn until SIGINT/SIGTERM (then requests in flight fail with 503,
    workers stop and the shared memory is released). The port is bound before the runtime starts
    (``bind_listener``)."""
    import uvicorn

    sock = bind_listener(config.server.host, config.server.port)
    try:
        server = PrismServer(config)
        served = uvicorn.Server(
            uvicorn.Config(
                server.app, host=config.server.host, port=config.server.port, log_level=log_level,
                timeout_graceful_shutdown=5, access_log=log_level == "debug",
            )
        )  # fmt: skip
        with contextlib.suppress(KeyboardInterrupt):  # SIGINT, re-raised after the shutdown: done
            served.run(sockets=[sock])
    finally:
        sock.close()
    if not served.started:  # start-up failed (logged by uvicorn): exit as uvicorn.run does
        raise SystemExit(3)
