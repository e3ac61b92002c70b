"""What the OpenAPI schema (``/openapi.json``) says about each route: the bodies it answers with,
every status it can send, and the streaming form.

The models here document responses; the routes build their JSON directly (one dict per stream
chunk is cheaper than a pydantic object), and the schemathesis test in tests/api checks the two
agree. FastAPI's default 422 is removed: validation errors are 400 in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from prism_serve.api.metrics import CONTENT_TYPE

__all__ = [
    "ADMIN",
    "CHAT",
    "COMPLETION",
    "DASHBOARD",
    "DASHBOARD_STATE",
    "HEALTH",
    "METRICS",
    "MODEL",
    "MODELS",
    "OPEN_PATHS",
    "RESPONSES",
    "install_openapi",
]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every non-2xx answer (and an error inside a stream, as its last event)."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache (not prefilled again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class _Function(BaseModel):
    name: str
    arguments: str  # JSON text of an object


class _ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: _Function


class _Message(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None: the answer is tool calls
    tool_calls: list[_ToolCall] | None = None


class _TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class _ChatTokenLogprob(_TopLogprob):
    top_logprobs: list[_TopLogprob]


class _ChatLogprobs(BaseModel):
    """``logprobs: true`` on a chat completion (protocol.chat_logprobs)."""

    content: list[_ChatTokenLogprob]


class _CompletionLogprobs(BaseModel):
    """``logprobs: k`` on a completion, OpenAI's legacy shape (protocol.completion_logprobs); None
    entries are the first prompt token of an ``echo``, which has no logprob."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _ChatChoice(BaseModel):
    index: int
    message: _Message
    logprobs: _ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[_ChatChoice]
    usage: Usage


class _TextChoice(BaseModel):
    index: int
    text: str
    logprobs: _CompletionLogprobs | None
    finish_reason: str | None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[_TextChoice]
    usage: Usage


class ResponseObject(BaseModel):
    """``POST /v1/responses`` (api/responses.py): OpenAI's Response object; output items are
    ``message`` (output_text parts) and ``function_call``."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")  # admin routes add what they did (activated, evicted)

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the weights' origin (HF id, synthetic preset, or file name; never a server path)
    parent: str | None
    state: Literal["active", "loading", "evicted"]
    device: str | None
    pinned: bool
    source: str
    synthetic: bool
    dtype: Literal["float32", "bfloat16"]
    max_model_len: int
    ttft_slo: float
    tpot_slo: float
    weight_bytes: int
    used_kv_bytes: int  # KV the engine(s) hold now
    cached_kv_bytes: int  # prefix-cached KV no request holds (reclaimable, not free)
    num_running: int
    num_queued: int
    num_activations: int
    num_evictions: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class _Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32s


class _EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[_Embedding]
    model: str
    usage: _EmbeddingUsage


class _RerankDocument(BaseModel):
    text: str


class _RerankResult(BaseModel):
    index: int  # the document's position in the request
    relevance_score: float  # the probability the reranker answers yes, in [0, 1]
    document: _RerankDocument | None = None  # left out with return_documents: false


class RerankList(BaseModel):
    id: str
    model: str
    results: list[_RerankResult]  # best first, top_n of them
    usage: _EmbeddingUsage


class _Score(BaseModel):
    object: Literal["score"]
    index: int
    score: float


class _ScoreUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ScoreList(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[_Score]  # pairs in the request's order
    usage: _ScoreUsage


class _TenantLimits(BaseModel):
    requests_per_minute: int | None
    tokens_per_minute: int | None
    concurrent_requests: int | None


class TenantCard(BaseModel):
    tenant: str
    models: list[str]  # names or globs it may call
    limits: _TenantLimits
    slo_scale: float  # its models' SLOs times this for its requests
    in_flight: int
    requests_last_minute: int  # counted only under a requests_per_minute limit
    tokens_last_minute: int  # reserved or used, under a tokens_per_minute limit
    admitted: int  # since start
    tokens_used: int  # since start
    rate_limited: dict[str, int]  # 429s since start, by limit: requests, tokens, concurrency
    slo_attainment: dict[str, float | None]  # ttft, tpot: share of its judged requests that met them


class TenantList(BaseModel):
    object: Literal["list"]
    data: list[TenantCard]


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class Detokenized(BaseModel):
    prompt: str


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "user_data", "batch_output", "batch_error"]
    status: Literal["processed"]
    expires_at: int | None
    status_details: str | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class _BatchError(BaseModel):
    code: str
    message: str
    param: str | None
    line: int | None


class _BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[_BatchError]


class _RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: _BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                    "cancelling", "cancelled"]  # fmt: skip
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    expires_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: _RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class Version(BaseModel):
    version: str


class Health(BaseModel):
    status: Literal["ok", "starting"]


class _MemoryUse(BaseModel):
    model: str | None  # None: a ledger entry that is none of this server's models
    replica: int
    kind: Literal["weights", "kv", "spare", "other"]
    name: str  # the ledger entry's name
    bytes: int


class _DeviceState(BaseModel):
    name: str
    budget_bytes: int
    used_bytes: int
    free_bytes: int
    uses: list[_MemoryUse]


class _ReplicaState(BaseModel):
    replica: int
    state: Literal["active", "loading"]
    device: str | None
    num_running: int
    num_queued: int


class _Recent(BaseModel):
    window_s: float
    num_judged: int
    num_finished: int
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_attainment: float | None
    tpot_attainment: float | None


class _ModelState(BaseModel):
    id: str
    state: Literal["active", "loading", "evicted"]
    pinned: bool
    device: str | None
    weight_bytes: int
    used_kv_bytes: int
    cached_kv_bytes: int
    max_kv_bytes: int | None
    kv_usage: float
    num_running: int
    num_queued: int
    num_activations: int
    num_evictions: int
    ttft_slo: float
    tpot_slo: float
    replicas: list[_ReplicaState]
    recent: _Recent
    slo_attainment: dict[str, float]  # "ttft", "tpot": since the server started (once judged)


class DashboardState(BaseModel):
    """What /dashboard shows, polled by the page (api/dashboard.py)."""

    object: Literal["dashboard.state"]
    version: str
    created: float
    devices: list[_DeviceState]
    models: list[_ModelState]
    tenants: list[TenantCard]  # the admin key: every tenant; a tenant's key: its own; no keys: none


_SSE = {
    "text/event-stream": {
        "schema": {  # one server-sent event (its data is a JSON chunk, or [DONE] at the end)
            "type": "object",
            "properties": {"data": {"type": "string"}},
            "required": ["data"],
            "description": "with stream: true: 'data: {chunk}' events (chat.completion.chunk or "
            "text_completion), an error object as the last event if the request fails after its "
            "first token, then 'data: [DONE]'",
        }
    }
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    what = {
        400: "invalid parameter or prompt (beyond the context, bad token ids, bad Unicode)",
        401: "missing or wrong API key",
        403: "the key may not use this route",
        404: "no such model (or file, or batch; or the batch lane is off)",
        409: "the model's state does not allow it (e.g. active on another device)",
        413: "request body larger than server.max_request_bytes (a file upload: server.max_file_bytes)",
        429: "too many requests waiting for their first token (Retry-After says when to retry)",
        500: "internal error (the request was released)",
        503: "the model could not be activated, or its worker died",
        504: "no first token within server.request_timeout_s",
    }
    return {c: {"model": ErrorResponse, "description": what[c]} for c in codes}


def _ok(model: type[BaseModel], stream: bool = False) -> dict[int | str, dict[str, Any]]:
    out: dict[str, Any] = {"model": model, "description": "OK"}
    if stream:
        out["content"] = dict(_SSE)
    return {200: out}


_COMPLETE = (400, 401, 404, 413, 429, 500, 503, 504)
CHAT = {**_ok(ChatCompletion, stream=True), **_errors(*_COMPLETE)}
COMPLETION = {**_ok(TextCompletion, stream=True), **_errors(*_COMPLETE)}
RESPONSES = {**_ok(ResponseObject, stream=True), **_errors(*_COMPLETE)}
EMBEDDINGS = {**_ok(EmbeddingList), **_errors(*_COMPLETE)}
RERANK = {**_ok(RerankList), **_errors(*_COMPLETE)}
SCORE = {**_ok(ScoreList), **_errors(*_COMPLETE)}
MODELS = {**_ok(ModelList), **_errors(401)}
MODEL = {**_ok(ModelCard), **_errors(401, 404)}
TOKENIZE = {**_ok(Tokenized), **_errors(400, 401, 404, 413)}
DETOKENIZE = {**_ok(Detokenized), **_errors(400, 401, 404, 413)}
FILE = {**_ok(FileObject), **_errors(400, 401, 404, 413)}
FILES = {**_ok(FileList), **_errors(400, 401, 404)}
FILE_DELETED = {**_ok(FileDeleted), **_errors(401, 404)}
FILE_CONTENT = {200: {"description": "the file's bytes", "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary"}}}}, **_errors(401, 404)}  # fmt: skip
BATCH = {**_ok(BatchObject), **_errors(400, 401, 404, 413)}
BATCHES = {**_ok(BatchList), **_errors(400, 401, 404)}
VERSION = _ok(Version)
HEALTH = {**_ok(Health), 503: {"model": Health, "description": "still starting"}}
METRICS = {200: {"description": "Prometheus text", "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}}
ADMIN = {**_ok(ModelCard), **_errors(400, 401, 403, 404, 409, 413, 500, 503)}
TENANTS = {**_ok(TenantList), **_errors(401, 403)}
DASHBOARD_STATE = {**_ok(DashboardState), **_errors(401, 403)}
DASHBOARD = {200: {"description": "the dashboard page (HTML; it asks for a key to read /dashboard/state)"}}
OPEN_PATHS = ("/health", "/metrics", "/version", "/dashboard")  # routes that need no key


def install_openapi(app: FastAPI) -> None:
    """Build the schema once: 422s out, bearer auth and the 400 error shape in."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "server.api_keys (admin "
                           "routes: server.admin_key); /health, /metrics, /version and /dashboard need none"},
            }  # fmt: skip
            metrics_ok = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
            metrics_ok.pop("application/json", None)  # FastAPI's default; /metrics is text only
            for path, item in schema["paths"].items():
                for op in item.values():
                    op["responses"].pop("422", None)
                    if path not in OPEN_PATHS:
                        op["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
