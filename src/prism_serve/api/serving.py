"""What every endpoint family does to a request, over the state they share.

``ServingState`` is that state: the runtime's face (runtime/serving.py), /metrics, the tenants and
the request log, the served models' fixed facts, and the count of requests waiting for a first
token. It also answers who the caller is (``authorize``). ``Serving`` is the base of the serving
classes (serving_text.py, serving_chat.py, serving_pooled.py, serving_tokens.py, serving_models.py):
one request's admission against its tenant's models and limits, its line in the request log, the
prompt checks (engine/validation.py), its choices handed to the runtime and their first tokens
awaited, each delta booked into /metrics and the tenant's usage, and failures counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from prism_serve.api.batches import BatchCall
from prism_serve.api.choices import Choice, gather_or_cancel, unless_disconnected
from prism_serve.api.errors import (
    AuthenticationError,
    OverloadedError,
    PermissionDeniedError,
    bearer_token,
    key_matches,
)
from prism_serve.api.metrics import ServerMetrics
from prism_serve.api.request_log import LogEntry, RequestLog
from prism_serve.api.tenants import RateLimitError, Tenant, Tenants
from prism_serve.config import ServerConfig, score_token_ids
from prism_serve.control.types import DEFAULT_ORIGIN, Priority
from prism_serve.engine.config import PoolingTask
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.engine.validation import check_prompt, prompt_too_long
from prism_serve.errors import InvalidRequestError, PrismError, quoted
from prism_serve.runtime.serving import Delta, ModelStatus, ServingRuntime, UnknownModelError

__all__ = ["Served", "ServedTable", "Serving", "ServingState", "batch_of", "tenant_of"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Served:
    """A served model's fixed facts, taken from its ModelStatus once the runtime has started: the
    request path reads them without building a status (which reads every device's ledger)."""

    ttft_slo: float
    tpot_slo: float
    max_model_len: int
    vocab_size: int
    sampling: dict[str, float | int]  # defaults for requests that leave a setting out
    pooled: PoolingTask | None  # an embedder's or a reranker's task; None: it generates
    hidden_size: int  # an embedding's length
    score_ids: tuple[int, ...] = ()  # a reranker's answer tokens (no, yes) in its vocabulary

    @classmethod
    def of(cls, st: ModelStatus, tokenizer: Tokenizer) -> Served:
        """``tokenizer`` finds a reranker's answer tokens: a ConfigError where one is not one token."""
        task = st.pooled
        scored = task is not None and task.task == "score" and not task.classifier
        ids = score_token_ids(st.model, task, tokenizer) if scored else ()
        return cls(st.ttft_slo, st.tpot_slo, st.max_model_len, st.vocab_size, dict(st.sampling), task,
                   st.hidden_size, ids)  # fmt: skip

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


class ServedTable(Mapping[str, Served]):
    """The served models' fixed facts by name, and each LoRA adapter's (its base's, with its own
    SLOs): adapters come and go at run time (runtime/adapters.py)."""

    def __init__(self, models: dict[str, Served], runtime: ServingRuntime) -> None:
        self._models, self._runtime = models, runtime

    @classmethod
    def of(cls, runtime: ServingRuntime) -> ServedTable:
        """Every model the (started) runtime serves."""
        return cls({st.model: Served.of(st, runtime.tokenizer(st.model)) for st in runtime.status()}, runtime)

    def __getitem__(self, name: str) -> Served:
        if name in self._models:
            return self._models[name]
        a = self._runtime.adapter(name, finishing=True)  # also while unloading: its requests finish
        if a is None or a.base not in self._models:
            raise KeyError(name)
        return dataclasses.replace(self._models[a.base], ttft_slo=a.ttft_slo, tpot_slo=a.tpot_slo)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def names(self) -> list[str]:
        return [*self._models, *(a.name for a in self._runtime.adapters() if self._runtime.adapter(a.name))]


def tenant_of(http: Request) -> Tenant | None:
    """The caller's tenant, as ``ServingState.authorize`` found it (None: the admin key, or no keys)."""
    return getattr(http.state, "tenant", None)


def batch_of(http: Request) -> BatchCall | None:
    """The batch line this request runs (api/batches.py), None for a client's own request."""
    return getattr(http.state, "batch", None)


def _tenant_scale(http: Request) -> float:
    """The caller's tenant's ``slo_scale`` (1 without a tenant)."""
    tenant = tenant_of(http)
    return tenant.entry.slo_scale if tenant is not None else 1.0


@dataclass(eq=False)
class ServingState:
    """What the serving classes share: handed to each, never a server object they reach back into."""

    settings: ServerConfig
    runtime: ServingRuntime
    metrics: ServerMetrics
    tenants: Tenants
    request_log: RequestLog | None
    tool_parsers: dict[str, str | None]  # a model's configured tool-call parser (None: from its template)
    served: ServedTable = field(init=False)  # filled once the runtime has started (``start``)
    num_waiting: int = 0  # requests admitted by the server that have no first token yet
    last_interactive: float = 0.0  # monotonic: when the last request not of the batch lane came
    finished_at: deque[float] = field(default_factory=lambda: deque(maxlen=512))
    ignored: set[str] = field(default_factory=set)  # unknown request fields already logged

    def __post_init__(self) -> None:
        self.served = ServedTable({}, self.runtime)

    def start(self) -> None:
        """The served models' facts, read once the runtime has started."""
        self.served = ServedTable.of(self.runtime)

    # ---- who is calling ------------------------------------------------------------------------

    def authorize(self, http: Request) -> None:
        """A 401 unless the request carries a key: the admin key (every model, no limits), or a
        tenant's (api/tenants.py), which ``http.state.tenant`` then names. A batch line's in-process
        request (api/batches.py) carries its batch's tenant there already."""
        if not self.tenants.enabled or batch_of(http) is not None:
            return
        token = bearer_token(http)
        if token is None:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        if key_matches(token, [self.settings.admin_key]):
            return
        tenant = self.tenants.identify(token)
        if tenant is None:
            raise AuthenticationError("invalid API key")
        http.state.tenant = tenant

    def authorize_all(self, http: Request) -> None:
        """``authorize``, and a 403 for a tenant limited to some models: the dashboard shows all."""
        self.authorize(http)
        tenant = tenant_of(http)
        if tenant is not None and "*" not in tenant.entry.models:
            raise PermissionDeniedError(
                f"tenant {tenant.name} may call only some models; the dashboard shows every model"
            )

    def tenant_cards(self, http: Request) -> list[dict[str, Any]]:
        """The tenants' cards the caller may see: every one for the admin key, else its own."""
        if not self.tenants.enabled:
            return []
        mine, now = tenant_of(http), time.monotonic()
        return [t.snapshot(now) for t in self.tenants.all() if mine is None or t is mine]

    def visible(self, http: Request, model: str) -> None:
        """A 404, worded as for a model not served, for a model outside the caller's tenant."""
        tenant = tenant_of(http)
        if tenant is not None and not tenant.may_use(model):
            raise UnknownModelError(f"model {quoted(model)} is not served here; see /v1/models")

    def retry_after(self) -> int:
        """Seconds until the waiting requests have likely drained, from the recent finish rate."""
        now = time.perf_counter()
        recent = [t for t in self.finished_at if now - t <= 30.0]
        rate = len(recent) / 30.0
        return int(min(60, max(1, math.ceil(self.num_waiting / rate)))) if rate > 0 else 5


class Serving:
    """The steps every endpoint family takes with a request (see the module docstring)."""

    def __init__(self, state: ServingState) -> None:
        self.state = state
        self.runtime = state.runtime
        self.metrics = state.metrics

    # ---- admission ---------------------------------------------------------------------------

    def admit(self, http: Request, model: str) -> None:
        """Count this request against the caller's tenant's limits (429 over one): its rate
        headers go on the response, and TenantUsage counts its end."""
        self.state.visible(http, model)
        if batch_of(http) is not None:
            return  # the batch lane has no rate limits: it runs on what interactive traffic leaves
        self.state.last_interactive = time.monotonic()
        tenant = tenant_of(http)
        if tenant is not None:
            http.state.tenant_headers = tenant.admit(time.monotonic())
            http.state.tenant_release = tenant.release

    def reserve(self, http: Request, tokens: list[int]) -> list[tuple[Tenant, list] | None]:
        """Each choice's tokens reserved against the caller's tenant's tokens a minute (429 past
        it): (tenant, handle) per choice, settled when the choice ends; Nones without a tenant."""
        tenant = tenant_of(http)
        if tenant is None or batch_of(http) is not None:
            return [None] * len(tokens)
        now = time.monotonic()
        handles = tenant.reserve(tokens, now)
        http.state.tenant_headers = tenant.headers(now)  # the response shows the reservation
        return [(tenant, h) for h in handles]

    def check_waiting(self, http: Request, n: int) -> None:
        """429 for ``n`` more requests waiting for their first token beyond the server's limit (a
        request of many choices or inputs goes alone). The batch lane bounds its own."""
        if batch_of(http) is not None:
            return
        limit, waiting = self.state.settings.max_waiting_requests, self.state.num_waiting
        if waiting and waiting + n > limit:
            raise OverloadedError(
                f"{waiting} requests are waiting for their first token (limit {limit}); retry later",
                self.state.retry_after(),
            )

    def note_ignored(self, body: Any) -> None:
        """Unknown fields are accepted and ignored (vLLM's leniency); each name is logged once."""
        ignored = self.state.ignored
        new = [f for f in body.unknown_fields() if f not in ignored]
        if new and len(ignored) < 1024:  # bounded: names come from clients
            ignored.update(new)
            logger.warning("ignoring unknown request field(s): %s", ", ".join(f[:64] for f in new))

    # ---- the request log ------------------------------------------------------------------------

    def log_entry(
        self, http: Request, model: str, stream: bool, n: int, max_tokens: int | None, task: str | None = None
    ) -> LogEntry | None:
        """A request's line in the request log, begun as it is admitted (None: no log); ``task``:
        embed or score (``n`` inputs, one output each)."""
        if self.state.request_log is None:
            return None
        tenant = tenant_of(http)
        lane = "batch" if batch_of(http) is not None else None
        priority = tenant.entry.priority if tenant is not None else "standard"
        return LogEntry(
            time.time(), model, stream, n, max_tokens, tenant=tenant.name if tenant else None, lane=lane,
            priority=priority if priority != "standard" else None, task=task,
        )  # fmt: skip

    async def logged(self, entry: LogEntry | None, work: Awaitable[Any]) -> Any:
        """``work``'s response, and ``entry``'s line in the request log once it ends: its status, or
        the error's (499: the client went away). A stream's line is written when its last chunk has
        gone (serving_text.py)."""
        log = self.state.request_log
        if entry is None or log is None:
            return await work
        try:
            response = await work
        except BaseException as e:
            disconnected = isinstance(e, asyncio.CancelledError)
            entry.status = e.status_code if isinstance(e, PrismError) else 499 if disconnected else 500
            log.write(entry)
            raise
        if not isinstance(response, StreamingResponse):
            entry.status = response.status_code
            log.write(entry)
        return response

    def write_log(self, entry: LogEntry | None, runs: list[Choice], num_prompt: int, status: int) -> None:
        """A stream's line in the request log, once its last chunk has gone."""
        if entry is not None and self.state.request_log is not None:
            entry.served(runs, num_prompt, runs[0].arrival)
            entry.status = status
            self.state.request_log.write(entry)

    # ---- the one place a prompt is checked ------------------------------------------------------

    def prompt_ids(
        self, model: str, prompt: str | list[int], max_tokens: int | None, param: str
    ) -> list[int]:
        """``prompt``'s token ids, checked (engine/validation.py) against ``model``'s vocabulary and
        its context with ``max_tokens`` (None: one) after it; a text prompt too long whatever its
        tokens is refused before it is tokenized."""
        tok = self.runtime.tokenizer(model)  # 404 for a model not served
        served = self.state.served[model]
        if isinstance(prompt, str):
            at_least = tok.min_tokens(prompt)
            if at_least + (max_tokens or 1) > served.max_model_len:
                raise prompt_too_long(served.max_model_len, f"at least {at_least}", max_tokens, param)
            prompt = tok.encode(prompt)
        check_prompt(prompt, served.vocab_size, served.max_model_len, max_tokens, param)
        return prompt

    # ---- the runtime ----------------------------------------------------------------------------

    def slos(self, http: Request, served: Served) -> tuple[float, float] | None:
        """The SLOs a request is held to (its first-token deadline, and /metrics' judging): its
        model's, times its tenant's ``slo_scale``; a batch line's none (its deadline is its window)."""
        if batch_of(http) is not None:
            return None
        scale = _tenant_scale(http)
        return (served.ttft_slo * scale, served.tpot_slo * scale)

    def generate(
        self, http: Request, model: str, ids: list[int], params: SamplingParams, req_id: str,
        slos: tuple[float, float] | None,
    ) -> AsyncIterator[Delta]:  # fmt: skip
        """One request to the runtime: a client's waits ``request_timeout_s`` at most for its first
        token, by the deadline of its ``slos``; a batch line's first-token deadline is its batch's
        window, and it has no timeout. Admission sees the caller's tenant, its class and weight (a
        batch line's class is ``batch``)."""
        batch, tenant = batch_of(http), tenant_of(http)
        origin = tenant.origin if tenant is not None else DEFAULT_ORIGIN
        if batch is not None:
            origin = dataclasses.replace(origin, priority=Priority.BATCH)
            return self.runtime.generate(
                model, ids, params, req_id=req_id, ttft_slo=batch.ttft_slo, origin=origin
            )
        return self.runtime.generate(
            model, ids, params, req_id=req_id, timeout_s=self.state.settings.request_timeout_s,
            ttft_slo=slos[0] if slos is not None and _tenant_scale(http) != 1.0 else None, origin=origin,
        )  # fmt: skip

    async def first_deltas(self, http: Request, runs: list[Choice]) -> None:
        """Wait for the first delta of every run (or a disconnect, or an error: then every run is
        aborted), counted as waiting meanwhile."""

        async def first(run: Choice) -> None:
            d = await anext(run.stream)
            run.first_at = run.last_at = time.perf_counter()
            self.take(run, d)

        waiting = 0 if batch_of(http) is not None else len(runs)  # interactive requests only
        self.state.num_waiting += waiting
        try:
            await unless_disconnected(http, gather_or_cancel(first(run) for run in runs))
        except BaseException:
            for run in runs:
                await run.stream.aclose()
            raise
        finally:
            self.state.num_waiting -= waiting

    def take(self, run: Choice, d: Delta) -> None:
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
            self.state.finished_at.append(now)

    async def drain(self, run: Choice) -> None:
        while not run.last.finished:
            self.take(run, await anext(run.stream))

    def count_error(
        self, model: str, e: PrismError, http: Request | None = None, tenant: Tenant | None = None
    ) -> None:
        """A failed request in /metrics; judged against the SLOs when the server failed it, not when
        the client's request was wrong, its tenant over its own limit, or it was a batch line."""
        if model in self.state.served:
            lane = http is not None and batch_of(http) is not None
            judged = e.status_code >= 429 and not isinstance(e, RateLimitError) and not lane
            pooled = self.state.served[model].pooled is not None
            self.metrics.on_error(model, e.error_type, e.status_code, judged=judged, pooled=pooled)
            tenant = tenant or (tenant_of(http) if http is not None else None)
            if judged and tenant is not None:
                tenant.judge((False, False))
