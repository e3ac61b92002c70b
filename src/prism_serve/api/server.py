"""The OpenAI-compatible HTTP server: one endpoint for every configured model.

Routes: POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models[/{id}],
/health, /metrics, and the admin routes (api/admin.py). The controller runs on uvicorn's event
loop (started and stopped by the app's lifespan), so a request is a coroutine from HTTP to tokens.

A request for an evicted model activates it and waits, bounded by ``server.request_timeout_s``;
headers are sent only with the first token, so anything that goes wrong before it (unknown model,
overload, activation failure, timeout) is a proper HTTP error, not a broken stream. A client that
disconnects, while waiting or while streaming, aborts its request and frees its KV.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import math
import signal
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from prism_serve import __version__
from prism_serve.api import schema as api_schema
from prism_serve.api.admin import add_admin_routes
from prism_serve.api.batch_store import BatchStore, StateDirInUseError
from prism_serve.api.batches import BatchCall, BatchCollector, BatchRunner, add_batch_routes, call_app
from prism_serve.api.cards import adapter_cards, model_cards
from prism_serve.api.choices import (
    Choice,
    ChoiceOutput,
    ClientDisconnected,
    gather_or_cancel,
    merged,
    sse_event,
    unless_disconnected,
)
from prism_serve.api.dashboard import add_dashboard_routes, dashboard_state
from prism_serve.api.errors import (
    AuthenticationError,
    OverloadedError,
    PermissionDeniedError,
    bearer_token,
    error_body,
    install_error_handlers,
    key_matches,
    validation_message,
)
from prism_serve.api.headers import RequestIdHeader
from prism_serve.api.limits import BodySizeLimit
from prism_serve.api.metrics import CONTENT_TYPE, ServerMetrics
from prism_serve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    ToolSetup,
    chat_choice,
    chat_chunk,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_response,
    new_id,
    usage,
)
from prism_serve.api.request_log import LogEntry, RequestLog, prompt_block_hashes
from prism_serve.api.responses import ResponseEvents, to_chat, to_response
from prism_serve.api.tenants import RateLimitError, Tenant, TenantCollector, Tenants, TenantUsage
from prism_serve.api.tools import (
    MARKERS,
    CallStream,
    ToolChoice,
    ToolFormat,
    parse_calls,
    parse_constrained,
    parser_for_template,
    render_conversation,
)
from prism_serve.config import ConfigError, DeploymentConfig
from prism_serve.control.types import DEFAULT_ORIGIN, Priority
from prism_serve.engine.config import DEFAULT_MODEL, DEFAULT_MODEL_HF_ID, PoolingTask
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.errors import InternalError, InvalidRequestError, PrismError, PromptTooLongError, quoted
from prism_serve.runtime import messages as msg
from prism_serve.runtime.adapters import AdapterTable
from prism_serve.runtime.build import build_controller
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.models import UnknownModelError
from prism_serve.runtime.state import ModelStatus

__all__ = ["PrismServer", "create_app"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Served:
    """A served model's fixed facts, taken from its ModelStatus once the controller has started:
    the request path reads them without building a status (which reads every device's ledger)."""

    ttft_slo: float
    tpot_slo: float
    max_model_len: int
    vocab_size: int
    sampling: dict[str, float | int]  # defaults for requests that leave a setting out
    pooled: PoolingTask | None  # an embedder's or a reranker's task; None: it generates
    hidden_size: int  # an embedding's length
    score_ids: tuple[int, ...] = ()  # a reranker's answer tokens (no, yes) in its vocabulary

    @classmethod
    def of(cls, st: ModelStatus, tokenizer: Tokenizer) -> _Served:
        """``tokenizer`` finds a reranker's answer tokens: a ConfigError where one is not one token."""
        ids: list[int] = []
        task = st.pooled
        for text in task.tokens if task is not None and task.task == "score" else ():
            found = tokenizer.one_token(text)
            if found is None:
                raise ConfigError(
                    f"model {st.model}: score token {text!r} is not one token of its vocabulary; set "
                    "score_tokens to its no and yes tokens"
                )
            ids.append(found)
        return cls(st.ttft_slo, st.tpot_slo, st.max_model_len, st.vocab_size, dict(st.sampling), task,
                   st.hidden_size, tuple(ids))  # fmt: skip

    def refuse(self, model: str, task: str) -> None:
        """A 400 naming the routes that serve this model, unless it serves ``task``."""
        mine = self.pooled.task if self.pooled is not None else "generate"
        if mine == task:
            return
        routes = {
            "generate": "it generates text (task: generate): ask /v1/chat/completions, /v1/completions or "
            "/v1/responses",
            "embed": "it is an embedding model (task: embed): ask /v1/embeddings",
            "score": "it is a reranker (task: score): ask /v1/rerank or /v1/score",
        }  # fmt: skip
        raise InvalidRequestError(f"model {model!r} cannot answer this: {routes[mine]}", param="model")


def _tenant(http: Request) -> Tenant | None:
    """The caller's tenant, as ``PrismServer.authorize`` found it (None: the admin key, or no keys)."""
    return getattr(http.state, "tenant", None)


def _tenant_scale(http: Request) -> float:
    """The caller's tenant's ``slo_scale`` (1 without a tenant)."""
    tenant = _tenant(http)
    return tenant.entry.slo_scale if tenant is not None else 1.0


def _batch(http: Request) -> BatchCall | None:
    """The batch line this request runs (api/batches.py), None for a client's own request."""
    return getattr(http.state, "batch", None)


class _ServedTable(Mapping[str, _Served]):
    """The served models' fixed facts by name, and each LoRA adapter's (its base's, with its own
    SLOs): adapters come and go at run time (runtime/adapters.py)."""

    def __init__(self, models: dict[str, _Served], adapters: AdapterTable) -> None:
        self._models, self._adapters = models, adapters

    def __getitem__(self, name: str) -> _Served:
        if name in self._models:
            return self._models[name]
        a = self._adapters.by_name.get(name)  # also while unloading: its requests are finishing
        if a is None or a.base not in self._models:
            raise KeyError(name)
        return dataclasses.replace(self._models[a.base], ttft_slo=a.ttft_slo, tpot_slo=a.tpot_slo)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def names(self) -> list[str]:
        return [*self._models, *(a for a in self._adapters.by_name if a in self._adapters)]


class PrismServer:
    """The app plus the state its routes share (controller, metrics, the waiting-request bound)."""

    def __init__(self, config: DeploymentConfig, controller: Controller | None = None) -> None:
        self.config = config
        try:  # before the controller: a bad keys file stops the server before it takes any memory
            self.tenants = Tenants(config.server.keys_file, config.server.api_keys)
        except ValueError as e:
            raise ConfigError(f"server.keys_file: {e}") from None
        try:  # the batch lane's state (api/batch_store.py), also before any memory is taken
            state_dir = config.server.state_dir
            self.batches = BatchStore(state_dir) if state_dir else None
        except (StateDirInUseError, OSError) as e:
            raise ConfigError(f"server.state_dir: {e}") from None
        self.controller = controller or build_controller(config)
        self.metrics = ServerMetrics(self.controller)
        if self.tenants.enabled:
            self.metrics.registry.register(TenantCollector(self.tenants))
        self.served = _ServedTable({}, self.controller.models.adapters)  # filled once the controller started
        self.num_waiting = 0  # requests admitted by the server that have no first token yet
        self._finished_at: deque[float] = deque(maxlen=512)
        self._ignored: set[str] = set()  # unknown request fields already logged
        self._roots = {m.name: public_source(m.source) for m in config.models}
        self._tool_parsers = {m.name: m.tool_parser for m in config.models}
        srv = config.server  # a JSON line per finished request (api/request_log.py), if configured
        self.request_log = (
            RequestLog(srv.request_log, srv.request_log_max_bytes, srv.request_log_keep)
            if srv.request_log
            else None
        )
        # the batch lane (api/batches.py): the runner starts with the controller
        self.last_interactive = 0.0  # monotonic: when the last request not of the batch lane came
        self.batch_runner = BatchRunner(
            self.batches, lambda path, body, state: call_app(self.app, path, body, state),
            concurrency=srv.batch_concurrency, idle_s=srv.batch_idle_s, waiting=lambda: self.num_waiting,
            last_interactive=lambda: self.last_interactive, active=self.controller.is_active,
            tenant=self.tenants.named,
        )  # fmt: skip
        if self.batches is not None:
            self.metrics.registry.register(BatchCollector(self.batch_runner))
        self.app = self._build()

    # ---- app ----------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI):
            await self.controller.start()
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(signal.SIGHUP, self.tenants.reload)
            try:
                tokenizer = self.controller.models.tokenizer
                self.served = _ServedTable(
                    {st.model: _Served.of(st, tokenizer(st.model)) for st in self.controller.status()},
                    self.controller.models.adapters,
                )
                logger.info("serving %s", ", ".join(self.served.names()))
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
                if self.request_log is not None:
                    self.request_log.close()
                logger.info("stopped: workers ended, shared memory released")

        app = FastAPI(title="prism-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
        install_error_handlers(app)
        api_schema.install_openapi(app)
        app.add_middleware(
            BodySizeLimit, max_bytes=self.config.server.max_request_bytes,
            per_path={"/v1/files": (self.config.server.max_file_bytes, "server.max_file_bytes")},
        )  # fmt: skip
        cors = self.config.server.cors
        if cors is not None:
            app.add_middleware(
                CORSMiddleware, allow_origins=cors.allow_origins, allow_credentials=cors.allow_credentials,
                allow_methods=cors.allow_methods, allow_headers=cors.allow_headers,
                expose_headers=["x-request-id"],
            )  # fmt: skip
        app.add_middleware(TenantUsage)  # a tenant's rate headers, and its request's end
        app.add_middleware(RequestIdHeader)  # outermost: errors from the others carry the id too
        s = self

        @app.post("/v1/chat/completions", responses=api_schema.CHAT)
        async def chat(body: ChatCompletionRequest, http: Request) -> Response:
            s.authorize(http)
            return await s.complete(http, body, chat=True)

        @app.post("/v1/responses", responses=api_schema.RESPONSES)
        async def responses(http: Request) -> Response:
            s.authorize(http)
            return await s.respond(http)

        @app.post("/v1/completions", responses=api_schema.COMPLETION)
        async def completions(body: CompletionRequest, http: Request) -> Response:
            s.authorize(http)
            return await s.complete(http, body, chat=False)

        @app.post("/v1/embeddings", responses=api_schema.EMBEDDINGS)
        async def embeddings(body: EmbeddingRequest, http: Request) -> Response:
            s.authorize(http)
            return await s.embed(http, body)

        async def rerank(body: RerankRequest, http: Request) -> Response:
            s.authorize(http)
            return await s.score(http, body)

        async def score(body: ScoreRequest, http: Request) -> Response:
            s.authorize(http)
            return await s.score(http, body)

        # vLLM's paths for both (/v2/rerank: Cohere's client); the schema shows the /v1 ones
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.post(path, responses=api_schema.RERANK, include_in_schema=path == "/v1/rerank")(rerank)
        for path in ("/v1/score", "/score"):
            app.post(path, responses=api_schema.SCORE, include_in_schema=path == "/v1/score")(score)

        @app.get("/v1/models", responses=api_schema.MODELS)
        async def models(http: Request) -> dict:
            s.authorize(http)
            return {"object": "list", "data": s.model_cards(http)}

        @app.get("/v1/models/{model:path}", responses=api_schema.MODEL)
        async def model(model: str, http: Request) -> dict:
            s.authorize(http)
            s._visible(http, model)
            s.controller.models.tokenizer(model)  # UnknownModelError (404) for a name not served
            return next(c for c in s.model_cards() if c["id"] == model)

        @app.post("/tokenize", responses=api_schema.TOKENIZE)
        async def tokenize(body: TokenizeRequest, http: Request) -> dict:
            s.authorize(http)
            s._visible(http, body.model)
            ids = await asyncio.to_thread(s._tokenize_only, body)
            return {"count": len(ids), "max_model_len": s.served[body.model].max_model_len, "tokens": ids}

        @app.post("/detokenize", responses=api_schema.DETOKENIZE)
        async def detokenize(body: DetokenizeRequest, http: Request) -> dict:
            s.authorize(http)
            s._visible(http, body.model)
            tok = s.controller.models.tokenizer(body.model)
            s._check_vocab(body.model, body.tokens, "tokens")
            return {"prompt": await asyncio.to_thread(tok.decode, body.tokens, False)}

        @app.get("/version", responses=api_schema.VERSION)
        async def version() -> dict:
            return {"version": __version__}

        @app.get("/health", responses=api_schema.HEALTH)
        async def health() -> Response:
            ok = s.controller.running
            return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

        @app.get("/metrics", responses=api_schema.METRICS)
        async def metrics() -> Response:
            return Response(s.metrics.render(), media_type=CONTENT_TYPE)

        add_batch_routes(app, self)
        add_admin_routes(app, self.controller, self.config.server, self.model_cards, self.tenants)
        add_dashboard_routes(
            app,
            lambda http: dashboard_state(s.controller, s.metrics, s._tenant_cards(http)),
            self._authorize_all,
        )
        return app

    def authorize(self, http: Request) -> None:
        """A 401 unless the request carries a key: the admin key (every model, no limits), or a
        tenant's (api/tenants.py), which ``http.state.tenant`` then names. A batch line's in-process
        request (api/batches.py) carries its batch's tenant there already."""
        if not self.tenants.enabled or _batch(http) is not None:
            return
        token = bearer_token(http)
        if token is None:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        if key_matches(token, [self.config.server.admin_key]):
            return
        tenant = self.tenants.identify(token)
        if tenant is None:
            raise AuthenticationError("invalid API key")
        http.state.tenant = tenant

    def _authorize_all(self, http: Request) -> None:
        """``authorize``, and a 403 for a tenant limited to some models: the dashboard shows all."""
        self.authorize(http)
        tenant = _tenant(http)
        if tenant is not None and "*" not in tenant.entry.models:
            raise PermissionDeniedError(
                f"tenant {tenant.name} may call only some models; the dashboard shows every model"
            )

    def _tenant_cards(self, http: Request) -> list[dict[str, Any]]:
        """The tenants' cards the caller may see: every one for the admin key, else its own."""
        if not self.tenants.enabled:
            return []
        mine, now = _tenant(http), time.monotonic()
        return [t.snapshot(now) for t in self.tenants.all() if mine is None or t is mine]

    def _visible(self, http: Request, model: str) -> None:
        """A 404, worded as for a model not served, for a model outside the caller's tenant."""
        tenant = _tenant(http)
        if tenant is not None and not tenant.may_use(model):
            raise UnknownModelError(f"model {quoted(model)} is not served here; see /v1/models")

    def _admit(self, http: Request, model: str) -> None:
        """Count this request against the caller's tenant's limits (429 over one): its rate
        headers go on the response, and TenantUsage counts its end."""
        self._visible(http, model)
        if _batch(http) is not None:
            return  # the batch lane has no rate limits: it runs on what interactive traffic leaves
        self.last_interactive = time.monotonic()
        tenant = _tenant(http)
        if tenant is not None:
            http.state.tenant_headers = tenant.admit(time.monotonic())
            http.state.tenant_release = tenant.release

    def _reserve(self, http: Request, tokens: list[int]) -> list[tuple[Tenant, list] | None]:
        """Each choice's tokens reserved against the caller's tenant's tokens a minute (429 past
        it): (tenant, handle) per choice, settled when the choice ends; Nones without a tenant."""
        tenant = _tenant(http)
        if tenant is None or _batch(http) is not None:
            return [None] * len(tokens)
        now = time.monotonic()
        handles = tenant.reserve(tokens, now)
        http.state.tenant_headers = tenant.headers(now)  # the response shows the reservation
        return [(tenant, h) for h in handles]

    def model_cards(self, http: Request | None = None) -> list[dict[str, Any]]:
        """Every served model's card, or those the request's tenant may call."""
        cards = model_cards(self.controller.status(), self._roots)
        cards += adapter_cards(self.controller.models.adapters.by_name.values(), cards)
        tenant = _tenant(http) if http is not None else None
        return [c for c in cards if tenant is None or tenant.may_use(c["id"])]

    # ---- completions --------------------------------------------------------------------------

    async def complete(
        self, http: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool
    ) -> Response:
        """One completion request, its line in the request log written when it ends."""
        self._admit(http, body.model)
        entry = None
        if self.request_log is not None:
            entry = self._log_entry(http, body.model, body.stream, body.n, body.requested_max_tokens())
        return await self._logged(entry, self._complete(http, body, chat, entry))

    def _log_entry(self, http: Request, model: str, stream: bool, n: int, max_tokens: int | None) -> LogEntry:
        """A request's line in the request log, begun as it is admitted."""
        tenant = _tenant(http)
        lane = "batch" if _batch(http) is not None else None
        priority = tenant.entry.priority if tenant is not None else "standard"
        return LogEntry(
            time.time(), model, stream, n, max_tokens, tenant=tenant.name if tenant else None, lane=lane,
            priority=priority if priority != "standard" else None,
        )  # fmt: skip

    async def _logged(self, entry: LogEntry | None, work: Awaitable[Response]) -> Response:
        """``work``'s response, and ``entry``'s line in the request log once it ends: its status, or
        the error's (499: the client went away). A stream's line is written when its last chunk has
        gone, in ``_sse``."""
        if entry is None or self.request_log is None:
            return await work
        try:
            response = await work
        except BaseException as e:
            disconnected = isinstance(e, asyncio.CancelledError)
            entry.status = e.status_code if isinstance(e, PrismError) else 499 if disconnected else 500
            self.request_log.write(entry)
            raise
        if not isinstance(response, StreamingResponse):
            entry.status = response.status_code
            self.request_log.write(entry)
        return response

    async def _complete(
        self,
        http: Request,
        body: ChatCompletionRequest | CompletionRequest,
        chat: bool,
        entry: LogEntry | None,
    ) -> Response:
        arrival = time.perf_counter()
        model = body.model
        self._note_ignored(body)
        try:
            tok = self.controller.models.tokenizer(model)  # 404 before any work
            self.served[model].refuse(model, "generate")
            tools = body.tool_setup() if chat else None  # 400s naming the tool or message
            # Templates and tokenization run in a thread: a long prompt must not stall the event
            # loop (every other request, /health, token streams) while it is encoded.
            prompts = await asyncio.to_thread(self._tokenize, body, chat)
            if entry is not None:
                entry.prompt_tokens = sum(len(ids) for ids in prompts)
                if len(prompts) == 1:  # which prefixes repeat, for prism plan (~0.1 ms for 8k tokens)
                    entry.block_hashes = prompt_block_hashes(prompts[0])
            runs = await self._open(http, body, prompts, arrival)
            self.metrics.on_request(model, runs[0].max_tokens, body.n)
        except ClientDisconnected:
            return Response(status_code=499)
        except PrismError as e:
            self._count_error(model, e, http)
            raise
        texts = [None] if chat else body.prompts
        outs = [ChoiceOutput(tok, body, prompts[run.prompt], texts[run.prompt]) for run in runs]
        if body.stream:
            return StreamingResponse(
                self._sse(runs, body, chat, outs, prompts, entry),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            await unless_disconnected(http, gather_or_cancel(self._drain(run) for run in runs))
        except ClientDisconnected:
            return Response(status_code=499)
        except PrismError as e:
            self._count_error(model, e, http)
            raise
        finally:
            for run in runs:
                await run.stream.aclose()
            if entry is not None:
                entry.served(runs, sum(len(ids) for ids in prompts), arrival)
        use = self._usage(runs, prompts, outs[0].score_only)
        if chat:
            choices = []
            for run, out in zip(runs, outs, strict=True):
                text, finish, calls = "".join(run.text), run.last.finish_reason, None
                if tools is not None and tools.active:
                    text, calls, finish = self._read_calls(model, tools, text, finish)
                choices.append(chat_choice(run.index, text, finish, out.chat(run.logprobs), calls))
            return JSONResponse(chat_response(runs[0].rid, model, choices, use))
        choices = [
            completion_choice(run.index, out.echo + ("" if out.score_only else "".join(run.text)),
                              run.last.finish_reason, out.completion(run.logprobs, run.prompt_logprobs))
            for run, out in zip(runs, outs, strict=True)
        ]  # fmt: skip
        return JSONResponse(completion_response(runs[0].rid, model, choices, use))

    async def respond(self, http: Request) -> Response:
        """``POST /v1/responses`` (api/responses.py): the request as a chat completion, its answer
        (or its stream) as a Response object (or Responses events)."""
        try:
            body = await http.json()
        except ValueError:
            raise InvalidRequestError("the body is not valid JSON") from None
        chat_body = to_chat(body)
        try:
            request = ChatCompletionRequest.model_validate_json(json.dumps(chat_body))
        except ValidationError as e:
            message, param = validation_message(e)
            raise InvalidRequestError(message, param=_RESPONSES_PARAMS.get(param, param)) from None
        response = await self.complete(http, request, chat=True)
        if isinstance(response, StreamingResponse):
            return StreamingResponse(
                _response_events(body, response.body_iterator),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        if response.status_code != 200:
            return response
        return JSONResponse(to_response(body, json.loads(response.body)))

    def _tool_parser(self, model: str) -> str:
        adapter = self.controller.models.adapters.get(model)  # an adapter reads calls as its base
        return self._tool_parsers.get(adapter.base if adapter else model) or parser_for_template(
            self.controller.models.tokenizer(model).chat_template
        )

    def _tool_format(self, model: str) -> ToolFormat:
        family = self._tool_parser(model)
        return ToolFormat(family, self.controller.models.tokenizer(model).special_ids(MARKERS[family]))

    def _read_calls(
        self, model: str, tools: ToolSetup, text: str, finish: str | None
    ) -> tuple[str | None, list[dict] | None, str | None]:
        """(content, tool_calls, finish_reason) of a whole answer that may call tools."""
        if tools.constrained:
            calls = parse_constrained(text) if finish != "length" else []
            content = None if calls else text
        else:
            content, calls = parse_calls(text, self._tool_parser(model), tools.tools)
        return content, [c.as_openai() for c in calls] or None, _call_finish(tools, calls, finish)

    def _note_ignored(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        """Unknown fields are accepted and ignored (vLLM's leniency); each name is logged once."""
        new = [f for f in body.unknown_fields() if f not in self._ignored]
        if new and len(self._ignored) < 1024:  # bounded: names come from clients
            self._ignored.update(new)
            logger.warning("ignoring unknown request field(s): %s", ", ".join(f[:64] for f in new))

    @staticmethod
    def _usage(runs: list[Choice], prompts: list[list[int]], score_only: bool) -> dict[str, Any]:
        """Each prompt counted once (as OpenAI does, whatever ``n``), each choice's tokens. A
        prompt's cached tokens are its first choice's (the others may hit what it computed)."""
        generated = 0 if score_only else sum(run.num_output for run in runs)
        cached = {run.prompt: run.num_cached for run in reversed(runs)}
        return usage(sum(len(ids) for ids in prompts), generated, sum(cached.values()))

    def _tokenize(self, body: ChatCompletionRequest | CompletionRequest, chat: bool) -> list[list[int]]:
        """The token ids of each prompt (one, or several for completions), checked against the
        model's vocabulary and context (400s)."""
        if chat:
            return [self._prompt_ids(body, self._render(body.model, body.messages, tools=body.tool_setup()))]
        return [self._prompt_ids(body, p) for p in body.prompts]

    def _prompt_ids(
        self, body: ChatCompletionRequest | CompletionRequest, prompt: str | list[int]
    ) -> list[int]:
        tok = self.controller.models.tokenizer(body.model)  # 404 for a model not served
        served = self.served[body.model]
        max_len = served.max_model_len
        wanted = body.requested_max_tokens()
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"

        def too_long(num_tokens: str) -> PrismError:
            return PromptTooLongError(
                f"this model's maximum context length is {max_len} tokens; the prompt has {num_tokens} tokens"
                + (f" and max_tokens is {wanted}" if wanted else ""), param=param,
            )  # fmt: skip

        if isinstance(prompt, str):
            at_least = tok.min_tokens(prompt)
            if at_least + (wanted or 1) > max_len:
                raise too_long(f"at least {at_least}")  # known without tokenizing it
            ids = tok.encode(prompt)
        else:
            ids = prompt
        self._check_vocab(body.model, ids, param)
        if len(ids) + (wanted or 1) > max_len:
            raise too_long(str(len(ids)))
        return ids

    def _render(
        self, model: str, messages: list, add_generation_prompt: bool = True, tools: ToolSetup | None = None
    ) -> str:
        """Chat messages (and the tools the model may call, api/tools.py) as the model's prompt
        text: its template, or a plain transcript for a checkpoint without one, as some HF
        directories are."""
        tok = self.controller.models.tokenizer(model)
        choice = tools.choice if tools is not None else ToolChoice("none")
        family = self._tool_parser(model) if tools is not None and tools.active else "hermes"
        plain, shown = render_conversation(
            messages, tools.tools if tools else [], choice, tok.chat_template, family
        )
        if tok.chat_template:
            return tok.apply_chat_template(plain, add_generation_prompt, shown)
        transcript = "".join(f"{m['role']}: {m['content']}\n" for m in plain)
        return transcript + ("assistant:" if add_generation_prompt else "")

    def _check_vocab(self, model: str, ids: list[int], param: str) -> None:
        vocab = self.served[model].vocab_size
        if any(t >= vocab for t in ids):
            raise InvalidRequestError(f"token ids must be below the vocabulary size {vocab}", param=param)

    def _tokenize_only(self, body: TokenizeRequest) -> list[int]:
        """/tokenize: the ids a completion would see for this prompt or these messages."""
        tok = self.controller.models.tokenizer(body.model)  # 404 for a model not served
        if body.messages is not None:
            # encoded as the chat route encodes it, so the count is what a completion will see
            return tok.encode(self._render(body.model, body.messages, body.add_generation_prompt))
        return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)

    async def _open(
        self,
        http: Request,
        body: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        arrival: float,
    ) -> list[Choice]:
        """Submit ``n`` choices of every prompt and wait for the first token of each (or a
        disconnect, or an error: then every choice is aborted)."""
        served = self.served[body.model]
        max_len, default_max = served.max_model_len, served.sampling.get("max_tokens")
        wanted = body.requested_max_tokens()
        if default_max and not body.model_fields_set & {"max_tokens", "max_completion_tokens"}:
            wanted = None  # the model's default, not the endpoint's (completions: 16)
        n = body.n * len(prompts)
        self._check_waiting(http, n)
        chat = isinstance(body, ChatCompletionRequest)
        rid = new_id("chatcmpl" if chat else "cmpl")
        # the model's tool-call format, only for a request that may call a tool (it reads the template)
        tool_format = self._tool_format(body.model) if chat and body.tool_setup().active else None
        choices = []
        for p, ids in enumerate(prompts):
            for j in range(body.n):
                room = max_len - len(ids)  # a model's default max_tokens is capped by the context
                max_tokens = wanted or (min(default_max, room) if default_max else room)
                choices.append((p, j, ids, body.sampling_params(max_tokens, j, served.sampling, tool_format)))
        quotas = self._reserve(http, [len(ids) + params.max_tokens for _, _, ids, params in choices])
        runs, slos = [], self._slos(http, served)
        for (p, j, ids, params), quota in zip(choices, quotas, strict=True):
            i = p * body.n + j
            stream = self._generate(http, body.model, ids, params, rid if n == 1 else f"{rid}-{i}", slos)
            runs.append(Choice(rid, body.model, arrival, stream, index=i, prompt=p,
                               max_tokens=params.max_tokens, num_prompt=len(ids),
                               slos=slos, quota=quota))  # fmt: skip

        await self._first_deltas(http, runs)
        return runs

    def _generate(
        self, http: Request, model: str, ids: list[int], params: SamplingParams, req_id: str,
        slos: tuple[float, float] | None,
    ) -> AsyncIterator[msg.TokenDelta]:  # fmt: skip
        """One request to the runtime: a client's waits ``request_timeout_s`` at most for its first
        token, by the deadline of its ``slos`` (``_slos``); a batch line's first-token deadline is
        its batch's window, and it has no timeout. Admission sees the caller's tenant, its class
        and weight (a batch line's class is ``batch``)."""
        batch, tenant = _batch(http), _tenant(http)
        origin = tenant.origin if tenant is not None else DEFAULT_ORIGIN
        if batch is not None:
            origin = dataclasses.replace(origin, priority=Priority.BATCH)
            return self.controller.generate(
                model, ids, params, req_id=req_id, ttft_slo=batch.ttft_slo, origin=origin
            )
        return self.controller.generate(
            model, ids, params, req_id=req_id, timeout_s=self.config.server.request_timeout_s,
            ttft_slo=slos[0] if _tenant_scale(http) != 1.0 else None, origin=origin,
        )  # fmt: skip

    @staticmethod
    def _slos(http: Request, served: _Served) -> tuple[float, float] | None:
        """The SLOs a request is held to (its first-token deadline, and /metrics' judging): its
        model's, times its tenant's ``slo_scale``; a batch line's none (its deadline is its window)."""
        if _batch(http) is not None:
            return None
        scale = _tenant_scale(http)
        return (served.ttft_slo * scale, served.tpot_slo * scale)

    def _check_waiting(self, http: Request, n: int) -> None:
        """429 for ``n`` more requests waiting for their first token beyond the server's limit (a
        request of many choices or inputs goes alone). The batch lane bounds its own."""
        if _batch(http) is not None:
            return
        limit = self.config.server.max_waiting_requests
        if self.num_waiting and self.num_waiting + n > limit:
            raise OverloadedError(
                f"{self.num_waiting} requests are waiting for their first token (limit {limit}); retry later",
                self._retry_after(),
            )

    async def _first_deltas(self, http: Request, runs: list[Choice]) -> None:
        """Wait for the first delta of every run (or a disconnect, or an error: then every run is
        aborted), counted as waiting meanwhile."""

        async def first(run: Choice) -> None:
            d = await anext(run.stream)
            run.first_at = run.last_at = time.perf_counter()
            self._take(run, d)

        waiting = 0 if _batch(http) is not None else len(runs)  # interactive requests only
        self.num_waiting += waiting
        try:
            await unless_disconnected(http, gather_or_cancel(first(run) for run in runs))
        except BaseException:
            for run in runs:
                await run.stream.aclose()
            raise
        finally:
            self.num_waiting -= waiting

    # ---- embeddings ---------------------------------------------------------------------------

    async def embed(self, http: Request, body: EmbeddingRequest) -> Response:
        """``POST /v1/embeddings``: each input one request to the model's engine (batched there with
        the model's others), its vector pooled there, cut to ``dimensions`` and normalised here."""
        self._admit(http, body.model)
        self._note_ignored(body)
        entry = None
        if self.request_log is not None:  # max_tokens 1: prism plan reads it as a prompt-only request
            entry = self._log_entry(http, body.model, False, len(body.inputs), 1)
        return await self._logged(entry, self._embed(http, body, time.perf_counter(), entry))

    async def _embed(
        self, http: Request, body: EmbeddingRequest, arrival: float, entry: LogEntry | None
    ) -> Response:
        model = body.model
        done = await self._pooled(
            http, model, "embed", lambda: self._embedding_inputs(body),
            lambda served: SamplingParams(max_tokens=1, temperature=0.0, pooling=served.pooled.pooling),
            arrival, entry,
        )  # fmt: skip
        if done is None:
            return Response(status_code=499)
        prompts, pooled = done
        served = self.served[model]
        assert served.pooled is not None
        data = []
        for i, raw in enumerate(pooled):
            vector = np.frombuffer(raw, dtype="<f4")[: body.dimensions]
            if served.pooled.normalize:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
            vector = vector.astype("<f4")
            shown = (
                base64.b64encode(vector.tobytes()).decode()
                if body.encoding_format == "base64"
                else vector.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": shown})
        num_prompt = sum(len(ids) for ids in prompts)
        return JSONResponse(
            {"object": "list", "data": data, "model": model,
             "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}}
        )  # fmt: skip

    async def _pooled(
        self, http: Request, model: str, task: str, inputs: Callable[[], list[list[int]]],
        params: Callable[[_Served], SamplingParams], arrival: float, entry: LogEntry | None,
    ) -> tuple[list[list[int]], list[bytes]] | None:  # fmt: skip
        """An embed or score request (``task``): ``inputs`` tokenized in a thread, then each one
        request to the model's engine (batched there with the model's others), answered by its one
        delta: the pooled vector, or the score tokens' logits (float32 bytes). None: the client
        went away."""
        try:
            self.controller.models.tokenizer(model)  # 404 before any work
            served = self.served[model]
            served.refuse(model, task)
            prompts = await asyncio.to_thread(inputs)
            sampling = params(served)
            num_prompt = sum(len(ids) for ids in prompts)
            if entry is not None:
                entry.prompt_tokens = num_prompt
            self._check_waiting(http, len(prompts))
            rid = new_id("embd" if task == "embed" else task)
            runs, slos = [], self._slos(http, served)
            quotas = self._reserve(http, [len(ids) for ids in prompts])
            for i, (ids, quota) in enumerate(zip(prompts, quotas, strict=True)):
                req_id = rid if len(prompts) == 1 else f"{rid}-{i}"
                stream = self._generate(http, model, ids, sampling, req_id, slos)
                runs.append(Choice(rid, model, arrival, stream, index=i, prompt=i, max_tokens=1,
                                   num_prompt=len(ids), slos=slos, quota=quota))  # fmt: skip
            try:
                await self._first_deltas(http, runs)
            finally:
                for run in runs:
                    await run.stream.aclose()
                if entry is not None:
                    entry.served(runs, num_prompt, arrival)
            self.metrics.on_request(model, 1, len(prompts))
            out = []
            for run in runs:
                if run.last is None or run.last.embedding is None:  # an engine that does not pool
                    raise InternalError(f"model {model!r} answered without its pooled output")
                out.append(run.last.embedding)
        except ClientDisconnected:
            return None
        except PrismError as e:
            self._count_error(model, e, http)
            raise
        return prompts, out

    # ---- rerank and score -----------------------------------------------------------------------

    async def score(self, http: Request, body: RerankRequest | ScoreRequest) -> Response:
        """``POST /v1/rerank`` and ``/v1/score``: each (query, document) pair's prompt (the model's
        template) one request to the model's engine; its score the probability of the yes token
        against the no token as the next one."""
        self._admit(http, body.model)
        self._note_ignored(body)
        entry = None
        if self.request_log is not None:
            entry = self._log_entry(http, body.model, False, len(body.pairs()), 1)
        return await self._logged(entry, self._score(http, body, time.perf_counter(), entry))

    async def _score(
        self, http: Request, body: RerankRequest | ScoreRequest, arrival: float, entry: LogEntry | None
    ) -> Response:
        model = body.model
        done = await self._pooled(
            http, model, "score", lambda: self._score_inputs(body),
            lambda served: SamplingParams(max_tokens=1, temperature=0.0, pooling="last",
                                          score_tokens=served.score_ids),
            arrival, entry,
        )  # fmt: skip
        if done is None:
            return Response(status_code=499)
        prompts, pooled = done
        scores = []
        for raw in pooled:
            no, yes = np.frombuffer(raw, dtype="<f4").astype(np.float64)
            scores.append(1.0 / (1.0 + math.exp(min(no - yes, 700.0))))  # sigmoid(yes - no)
        num_prompt = sum(len(ids) for ids in prompts)
        if isinstance(body, ScoreRequest):
            return JSONResponse(
                {"id": new_id("score"), "object": "list", "created": int(time.time()), "model": model,
                 "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(scores)],
                 "usage": usage(num_prompt, 0)}
            )  # fmt: skip
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
        texts = body.texts
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return JSONResponse(
            {"id": new_id("rerank"), "model": model, "results": results,
             "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}}
        )  # fmt: skip

    def _score_inputs(self, body: RerankRequest | ScoreRequest) -> list[list[int]]:
        """Each pair's prompt as token ids (a document cut to ``max_tokens_per_doc`` first), checked
        against the model's context (400s)."""
        tok = self.controller.models.tokenizer(body.model)
        served = self.served[body.model]
        task = served.pooled
        assert task is not None
        out = []
        for query, document in body.pairs():
            if body.max_tokens_per_doc:
                kept = tok.encode(document, add_special_tokens=False)[: body.max_tokens_per_doc]
                document = tok.decode(kept)
            ids = tok.encode(task.prompt(query, document, body.instruction))
            if len(ids) + 1 > served.max_model_len:
                raise PromptTooLongError(
                    f"this model's maximum context length is {served.max_model_len} tokens; a query and "
                    f"document make {len(ids)} tokens (max_tokens_per_doc cuts documents)", param="documents",
                )  # fmt: skip
            out.append(ids)
        return out

    def _embedding_inputs(self, body: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids, checked against the model's vocabulary and context (400s)."""
        tok = self.controller.models.tokenizer(body.model)
        served = self.served[body.model]
        if body.dimensions is not None and body.dimensions > served.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be at most the model's {served.hidden_size}", param="dimensions"
            )
        out = []
        for text in body.inputs:
            ids = tok.encode(text) if isinstance(text, str) else text
            self._check_vocab(body.model, ids, "input")
            if len(ids) + 1 > served.max_model_len:
                raise PromptTooLongError(
                    f"this model's maximum context length is {served.max_model_len} tokens; an input has "
                    f"{len(ids)} tokens", param="input",
                )  # fmt: skip
            if not ids:
                raise InvalidRequestError("an input encodes to no tokens", param="input")
            out.append(ids)
        return out

    def _take(self, run: Choice, d: msg.TokenDelta) -> None:
        """Book one delta: text, token counts, inter-token latency; metrics when it is the last."""
        now = time.perf_counter()
        if run.last is not None and d.token_ids:
            gap = (now - run.last_at) / len(d.token_ids)
            for _ in d.token_ids:
                self.metrics.itl.labels(run.model).observe(gap)
        run.last, run.last_at = d, now
        run.text.append(d.text)
        if d.logprobs:
            run.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            run.prompt_logprobs = d.prompt_logprobs
        run.num_output = d.num_output_tokens
        run.num_prompt = d.num_prompt_tokens or run.num_prompt
        run.num_cached = d.num_cached_tokens or run.num_cached
        if d.finished:
            if run.quota is not None:  # what the choice did not use of its reservation goes back
                tenant, handle = run.quota
                tenant.settle(handle, run.num_prompt + run.num_output)
            met = self.metrics.on_finished(
                run.model, d.finish_reason, run.first_at - run.arrival, now - run.arrival,
                run.num_prompt, run.num_output, run.slos, d.timings, run.num_cached,
            )  # fmt: skip
            if met is not None and run.quota is not None:
                run.quota[0].judge(met)
            self._finished_at.append(now)

    async def _drain(self, run: Choice) -> None:
        while not run.last.finished:
            self._take(run, await anext(run.stream))

    async def _sse(
        self, runs: list[Choice], body: ChatCompletionRequest | CompletionRequest, chat: bool,
        outs: list[ChoiceOutput], prompts: list[list[int]], entry: LogEntry | None = None,
    ):  # fmt: skip
        created, rid, model = int(time.time()), runs[0].rid, runs[0].model
        with_usage = body.include_usage
        null_usage = None  # OpenAI sends "usage": null on every chunk but the last when usage is on
        tools = body.tool_setup() if chat else None
        calls: dict[int, CallStream] = {}  # per choice, where the model may call a tool
        if tools is not None and tools.active:
            family = self._tool_parser(model)
            calls = {run.index: CallStream(family, tools.tools, tools.constrained) for run in runs}

        def chunk(run: Choice, text: str | None, finish: str | None, d: msg.TokenDelta | None = None) -> str:
            out, i = outs[run.index], run.index
            if chat:
                delta = {} if text is None else {"content": text}
                cs = calls.get(i)
                if cs is not None:  # text may be a call: content and tool-call deltas from it
                    content, made = cs.feed(text) if text else ("", [])
                    if finish is not None:
                        more, rest = cs.finish()
                        content, made = content + more, made + rest
                        finish = _call_finish(tools, cs.calls, finish)
                    delta = ({"content": content} if content else {}) | ({"tool_calls": made} if made else {})
                    if not delta and finish is None and not (d is not None and d.logprobs):
                        return ""
                logprobs = out.chat(d.logprobs or []) if d is not None else None
                data = chat_chunk(rid, model, created, delta, finish, null_usage, logprobs, i)
            else:
                logprobs = out.completion(d.logprobs or [], d.prompt_logprobs) if d is not None else None
                text = out.take_echo() + ("" if out.score_only else (text or ""))
                data = completion_chunk(rid, model, created, text, finish, null_usage, logprobs, i)
            if with_usage:
                data["usage"] = None
            return sse_event(data)

        def chunks(run: Choice, d: msg.TokenDelta) -> str:
            sse = chunk(run, d.text, None, d) if d.text or d.token_ids else ""  # one per engine step
            return sse + (chunk(run, None, d.finish_reason) if d.finished else "")

        try:
            sse = ""
            for run in runs:
                if chat:
                    role = chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None,
                                      index=run.index)  # fmt: skip
                    if with_usage:
                        role["usage"] = None
                    sse += sse_event(role)
                sse += chunks(run, run.last)
            left = sum(not run.last.finished for run in runs)
            if left:
                yield sse
                sse = ""
                async with contextlib.aclosing(merged(runs, self._take)) as deltas:
                    async for run, d in deltas:
                        sse = chunks(run, d)
                        left -= d.finished
                        if not left:
                            break  # the last chunk goes out with the usage and [DONE]
                        if sse:
                            yield sse
                            sse = ""
            if with_usage:
                build = chat_chunk if chat else completion_chunk
                use = self._usage(runs, prompts, outs[0].score_only)
                sse += sse_event(build(rid, model, created, None, None, use))
            yield sse + "data: [DONE]\n\n"
            status = 200
        except PrismError as e:
            status = e.status_code
            self._count_error(model, e, tenant=runs[0].quota[0] if runs[0].quota else None)
            yield sse_event(error_body(str(e), e.error_type, e.status_code)) + "data: [DONE]\n\n"
        except BaseException:
            status = 499  # a disconnect cancels this generator
            raise
        finally:
            for run in runs:  # a disconnect cancels this generator: the requests are aborted
                await run.stream.aclose()
            if entry is not None and self.request_log is not None:
                entry.served(runs, sum(len(ids) for ids in prompts), runs[0].arrival)
                entry.status = status
                self.request_log.write(entry)

    def _count_error(
        self, model: str, e: PrismError, http: Request | None = None, tenant: Tenant | None = None
    ) -> None:
        """A failed request in /metrics; judged against the SLOs when the server failed it, not when
        the client's request was wrong, its tenant over its own limit, or it was a batch line."""
        if model in self.served:
            lane = http is not None and _batch(http) is not None
            judged = e.status_code >= 429 and not isinstance(e, RateLimitError) and not lane
            self.metrics.on_error(model, e.error_type, e.status_code, judged=judged)
            tenant = tenant or (_tenant(http) if http is not None else None)
            if judged and tenant is not None:
                tenant.judge((False, False))

    def _retry_after(self) -> int:
        """Seconds until the waiting requests have likely drained, from the recent finish rate."""
        now = time.perf_counter()
        recent = [t for t in self._finished_at if now - t <= 30.0]
        rate = len(recent) / 30.0
        return int(min(60, max(1, math.ceil(self.num_waiting / rate)))) if rate > 0 else 5


# a chat parameter's name in a Responses request
_RESPONSES_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}


async def _response_events(body: dict, chunks) -> Any:
    """A chat completion's SSE stream as Responses events."""
    events = ResponseEvents(body)
    yield events.start()
    async for piece in chunks:
        text = piece.decode() if isinstance(piece, bytes) else piece
        out = ""
        for block in text.split("\n\n"):
            if block.startswith("data: ") and block != "data: [DONE]":
                out += events.chunk(json.loads(block[len("data: ") :]))
        if out:
            yield out
    yield events.end()


def _call_finish(tools: ToolSetup, calls: list, finish: str | None) -> str | None:
    """The finish_reason of an answer that called tools: tool_calls (OpenAI's stop for a named
    function); a cut by max_tokens stays length."""
    if calls and finish == "stop":
        return "stop" if tools.choice.mode == "named" else "tool_calls"
    return finish


def public_source(source: str) -> str:
    """Where a model's weights come from, as /v1/models shows it: the Hugging Face id of the default
    model, a synthetic preset as configured, a file or directory by its name only (an absolute path
    tells clients about the server's filesystem and nothing they can use)."""
    if source == DEFAULT_MODEL:
        return DEFAULT_MODEL_HF_ID
    if source.startswith("random:"):
        return source
    return Path(source).name or source


def create_app(config: DeploymentConfig) -> FastAPI:
    return PrismServer(config).app


def run_server(config: DeploymentConfig, log_level: str = "info") -> None:
    """Serve ``config`` with uvicorn until SIGINT/SIGTERM (then requests in flight fail with 503,
    workers stop and the shared memory is released)."""
    import uvicorn

    server = PrismServer(config)
    uvicorn.run(
        server.app, host=config.server.host, port=config.server.port, log_level=log_level,
        timeout_graceful_shutdown=5, access_log=log_level == "debug",
    )  # fmt: skip
