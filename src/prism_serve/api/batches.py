"""The batch lane: OpenAI's Files and Batches APIs, run on the capacity interactive traffic leaves.

Routes (on when ``server.state_dir`` is set; else each answers 404 saying how to turn it on):
``POST /v1/files`` (multipart ``file`` and ``purpose``: ``batch`` or ``user_data``), ``GET
/v1/files``, ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``;
``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``), ``GET
/v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``. Each file and batch
belongs to the caller's tenant (api/tenants.py): a tenant sees only its own, the admin key every
one. The state lives in api/batch_store.py's database, so a restart resumes every batch.

A batch's input file is checked whole when the batch is created: each line a JSON object with a
unique ``custom_id``, ``method`` POST, ``url`` the batch's endpoint (``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses`` or ``/v1/embeddings``) and a ``body`` naming a model the
tenant may call, not streamed. A file with any bad line makes the batch ``failed`` with one error
per line (OpenAI's ``errors.data``: code, message, line); a good one is ``in_progress`` at once.
Models may differ between lines.

:class:`BatchRunner` runs the lines. Each line is one request to the server's own route, made in
process (an ASGI call, through every middleware, as the batch's tenant, with no rate limits), its
answer (status and body, any status) the line's output line; 2xx answers go to the output file,
the rest to the error file, both in input order. Lines run in the ``batch`` lane:

- at most ``server.batch_concurrency`` at once, over all batches, oldest batch first, and only
  one while interactive requests come (one has come within ``server.batch_idle_s``);
- none starts while an interactive request waits for its first token;
- a line's first-token deadline is its batch's expiry, not the model's TTFT SLO, so the device
  queue's deadline admission (control/admission.py) serves every interactive request first, and a
  line waits without the server's first-token timeout;
- lines of models with an active replica go first; a line whose model is not active starts only
  when no interactive request has come for ``server.batch_idle_s``, or half its batch's window is
  gone, so the lane does not evict a model interactive traffic is using to load its own;
- a line answered 429 or 503 (the server full, a model that could not be placed) is tried again
  later, not recorded.

A batch past its window is ``expired``: lines not run get OpenAI's ``batch_expired`` error. A
cancelled batch stops its running lines and settles the rest with ``batch_cancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from prism_serve.api import schema as api_schema
from prism_serve.api.batch_store import BatchStore, FileRecord, LineSpec, new_object_id
from prism_serve.api.errors import error_body
from prism_serve.errors import InvalidRequestError, PrismError, quoted

if TYPE_CHECKING:
    from prism_serve.api.tenants import Tenant

__all__ = ["BatchCall", "BatchCollector", "BatchRunner", "add_batch_routes", "window_seconds"]

logger = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
PURPOSES = ("batch", "user_data")
MAX_LINES = 50_000  # OpenAI's limit on one batch's requests
MAX_ERRORS = 100  # line errors a failed batch lists
_RETRY = (429, 503)  # the server full, or no room for the model now: the line runs again later
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class NotFoundError(PrismError):
    """No such file or batch (or not the caller's)."""

    status_code = 404
    error_type = "not_found_error"


def window_seconds(window: str) -> float:
    """``24h`` (OpenAI's one value) and the like: a count and s, m, h or d, up to 30 days."""
    m = _WINDOW.match(window)
    if m is None or int(m[1]) * _UNIT_S[m[2]] > 30 * 86400:
        raise InvalidRequestError(
            f"completion_window {quoted(window)}: a duration such as '24h' (s, m, h or d; at most 30 days)",
            param="completion_window",
        )
    return float(int(m[1]) * _UNIT_S[m[2]])


@dataclass(frozen=True)
class BatchCall:
    """What a batch line's in-process request carries in its ASGI scope's state (``batch``): only
    the runner can put it there, so it stands in for an API key."""

    batch_id: str
    ttft_slo: float  # s: the time left in the batch's window


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(min_length=1, max_length=256)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)


def _page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor list: ``after`` an id of the previous page."""
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}  # fmt: skip


def check_lines(
    raw: bytes, endpoint: str, may_call: Callable[[str], bool]
) -> tuple[list[LineSpec], list[dict[str, Any]]]:
    """A batch input file's lines, and OpenAI-style errors for the bad ones (line numbers from 1)."""
    specs: list[LineSpec] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def bad(line: int, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": line})

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [{"code": "invalid_file", "message": f"the file is not UTF-8: {e}", "param": None,
                     "line": None}]  # fmt: skip
    lines = [(n, s) for n, s in enumerate(text.splitlines(), 1) if s.strip()]
    if not lines:
        return [], [{"code": "empty_file", "message": "the file has no requests", "param": None,
                     "line": None}]  # fmt: skip
    if len(lines) > MAX_LINES:
        return [], [{"code": "too_many_requests", "message": f"{len(lines)} requests; at most {MAX_LINES}",
                     "param": None, "line": None}]  # fmt: skip
    for n, s in lines:
        try:
            obj = json.loads(s)
        except ValueError:
            bad(n, "invalid_json_line", "this line is not a JSON object")
            continue
        if not isinstance(obj, dict):
            bad(n, "invalid_json_line", "this line is not a JSON object")
            continue
        cid, body = obj.get("custom_id"), obj.get("body")
        if not isinstance(cid, str) or not cid:
            bad(n, "missing_required_parameter", "custom_id: a non-empty string is required", "custom_id")
        elif cid in seen:
            bad(n, "duplicate_custom_id", f"custom_id {quoted(cid)} is on an earlier line", "custom_id")
        elif obj.get("method") != "POST":
            bad(n, "invalid_method", f"method must be 'POST', got {quoted(obj.get('method'))}", "method")
        elif obj.get("url") != endpoint:
            bad(n, "mismatched_endpoint", f"url {quoted(obj.get('url'))} is not the batch's endpoint "
                f"{endpoint}", "url")  # fmt: skip
        elif not isinstance(body, dict):
            bad(n, "missing_required_parameter", "body: a JSON object is required", "body")
        elif not isinstance(body.get("model"), str):
            bad(n, "missing_required_parameter", "body.model: a model name is required", "body.model")
        elif body.get("stream"):
            bad(n, "invalid_request", "body.stream: a batch line's answer is not streamed", "body.stream")
        elif not may_call(body["model"]):
            bad(n, "model_not_found", f"model {quoted(body['model'])} is not served here; see /v1/models",
                "body.model")  # fmt: skip
        else:
            specs.append(LineSpec(cid, body["model"], body))
        if isinstance(cid, str) and cid:
            seen.add(cid)
        if len(errors) >= MAX_ERRORS:
            break
    return specs, errors


class BatchRunner:
    """Runs the lines of every batch in progress (see the module docstring for the rules).

    ``call(path, body, state)``: one in-process request, answered (status, headers, body).
    ``waiting()``: interactive requests waiting for a first token; ``last_interactive()``: when
    the last one came (monotonic); ``active(model)``: whether the model has an active replica;
    ``tenant(owner)``: the tenant of a batch's owner (None for the admin's batches).
    """

    def __init__(
        self, store: BatchStore, call, *, concurrency: int, idle_s: float,
        waiting: Callable[[], int], last_interactive: Callable[[], float],
        active: Callable[[str], bool], tenant: Callable[[str], Tenant | None],
    ) -> None:  # fmt: skip
        self.store = store
        self._call = call
        self.concurrency = concurrency
        self.idle_s = idle_s
        self._waiting = waiting
        self._last_interactive = last_interactive
        self._active = active
        self._tenant = tenant
        self._running: dict[tuple[str, int], asyncio.Task] = {}
        self._retry_at: dict[str, float] = {}  # model -> when its lines may be tried again
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.finished = {"completed": 0, "failed": 0}  # lines this process ran to an answer

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-runner")

    async def stop(self) -> None:
        """Stop running lines (they run again after a restart: none was marked done)."""
        tasks = [t for t in [self._task, *self._running.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()

    def wake(self) -> None:
        self._wake.set()

    @property
    def running(self) -> int:
        return len(self._running)

    async def _run(self) -> None:
        while True:
            try:
                self._pass()
            except Exception:  # a database error, a bug: logged, and the next pass tries again
                logger.exception("batch runner pass failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.5)

    # ---- one pass -------------------------------------------------------------------------------

    def _pass(self) -> None:
        now = time.time()
        for b in self.store.running():
            batch_id, status = b["id"], b["status"]
            mine = [key for key in self._running if key[0] == batch_id]
            if status == "finalizing":
                self.store.finalize(batch_id, "completed", "completed_at")
            elif status == "cancelling" or now >= b["expires_at"]:
                if mine:  # stop its running lines; their ends wake the next pass
                    for key in mine:
                        self._running[key].cancel()
                    continue
                if status == "cancelling":
                    self.store.settle_rest(batch_id, "batch_cancelled", "the batch was cancelled before "
                                           "this request ran")  # fmt: skip
                    self.store.finalize(batch_id, "cancelled", "cancelled_at")
                else:
                    self.store.settle_rest(batch_id, "batch_expired", "this request could not be executed "
                                           "before the completion window expired")  # fmt: skip
                    self.store.finalize(batch_id, "expired", "expired_at")
            else:
                todo = self.store.todo_models(batch_id)
                if not todo and not mine:
                    self.store.set_status(batch_id, "finalizing", "finalizing_at")
                    self.store.finalize(batch_id, "completed", "completed_at")
                elif todo:
                    self._start(b, todo, now)

    def _start(self, b, todo: dict[str, int], now: float) -> None:
        """Start this batch's lines while the lane has room: active models' first."""
        if self._waiting() > 0:
            return
        batch_id = b["id"]
        half_gone = now >= (b["created_at"] + b["expires_at"]) / 2
        mono = time.monotonic()
        idle = mono - self._last_interactive() >= self.idle_s
        # the whole lane when interactive traffic is idle; one line at a time while it flows
        width = self.concurrency if idle else 1
        active = {m: self._safe_active(m) for m in todo}
        for model in sorted(todo, key=lambda m: not active[m]):
            free = width - len(self._running)
            if free <= 0:
                return
            if self._retry_at.get(model, 0.0) > mono:
                continue
            if not active[model] and not (idle or half_gone):
                continue
            skip = {idx for (bid, idx) in self._running if bid == batch_id}
            for row in self.store.todo_of(batch_id, model, free, skip):
                key = (batch_id, row["idx"])
                call = BatchCall(batch_id, max(1.0, b["expires_at"] - now))
                self._running[key] = asyncio.get_running_loop().create_task(
                    self._line(key, b, row, call), name=f"batch-line-{batch_id}-{row['idx']}"
                )
            if not active[model]:
                return  # one cold model at a time: its lines' arrival is what activates it

    def _safe_active(self, model: str) -> bool:
        try:
            return self._active(model)
        except PrismError:  # removed from the server since: its lines answer 404 when they run
            return True

    async def _line(self, key: tuple[str, int], b, row, call: BatchCall) -> None:
        batch_id, idx = key
        try:
            tenant = self._tenant(b["owner"]) if b["owner"] else None
            if b["owner"] and tenant is None:  # the keys file dropped it: its lines must not run as admin
                status, headers = 401, {}
                answer = json.dumps(error_body(f"tenant {b['owner']} is no longer in the keys file",
                                               "authentication_error", 401)).encode()  # fmt: skip
            else:
                state: dict[str, Any] = {"batch": call, "tenant": tenant}
                status, headers, answer = await self._call(b["endpoint"], row["body"].encode(), state)
            if status in _RETRY:
                retry = float(headers.get("retry-after", "1") or 1)
                self._retry_at[row["model"]] = time.monotonic() + min(max(retry, 0.5), 30.0)
                return
            try:
                parsed = json.loads(answer)
            except ValueError:
                text = answer.decode(errors="replace")[:1000]
                parsed = {"error": {"message": text, "type": "internal_error"}}
            result = {
                "id": new_object_id("batch_req"), "custom_id": row["custom_id"],
                "response": {"status_code": status, "request_id": headers.get("x-request-id"),
                             "body": parsed},
                "error": None,
            }  # fmt: skip
            failed = not 200 <= status < 300
            self.store.finish_line(batch_id, idx, result, failed=failed)
            self.finished["failed" if failed else "completed"] += 1
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s line %d failed to run; it runs again", batch_id, idx)
        finally:
            self._running.pop(key, None)
            self._wake.set()


class BatchCollector:
    """The batch lane in /metrics, read at scrape time: batches by status, lines waiting and running,
    and lines answered by this process (2xx: completed, else failed)."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner

    def collect(self):
        statuses = GaugeMetricFamily("prism_batches", "Batches by status (the batch lane)", labels=["status"])
        for status, n in sorted(self.runner.store.status_counts().items()):
            statuses.add_metric([status], n)
        pending = GaugeMetricFamily(
            "prism_batch_lines_pending", "Lines of running batches not yet answered (running ones included)"
        )
        pending.add_metric([], self.runner.store.pending_lines())
        running = GaugeMetricFamily("prism_batch_lines_running", "Batch lines running now")
        running.add_metric([], self.runner.running)
        finished = CounterMetricFamily(
            "prism_batch_lines_finished",
            "Batch lines answered, by outcome (completed: 2xx)",
            labels=["outcome"],
        )
        for outcome, n in self.runner.finished.items():
            finished.add_metric([outcome], n)
        yield from (statuses, pending, running, finished)


async def call_app(app, path: str, body: bytes, state: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    """One POST to ``app`` in this process, as an HTTP client's would go (every middleware)."""
    sent = False
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the caller never goes away; cancelling the task ends the request
        return {"type": "http.disconnect"}

    status, headers, chunks = 500, {}, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("batch-lane", 0), "server": ("prism", 0), "state": state,
    }  # fmt: skip
    await app(scope, receive, send)
    return status, headers, b"".join(chunks)


# ---- routes ---------------------------------------------------------------------------------------


def add_batch_routes(
    app: FastAPI, batches: BatchStore | None, runner: BatchRunner, authorize: Callable[[Request], None],
    served: Callable[[], list[str]],
) -> None:  # fmt: skip
    """Files and Batches routes over ``batches`` (None: the lane is off), run by ``runner``;
    ``authorize`` finds the caller's tenant (api/serving.py), ``served`` names the models served now."""

    def store(http: Request, query: tuple[str, ...] = ()) -> tuple[BatchStore, str, str | None]:
        """The store, the caller's owner name, and the owner filter (None: the admin sees all).
        ``query``: the route's query parameters; another, or one given twice, is a 400 (FastAPI
        would ignore the one and take the last of the other)."""
        authorize(http)
        for name in set(http.query_params):
            if name not in query:
                raise InvalidRequestError(f"unknown query parameter {quoted(name)}", param=name)
            if len(http.query_params.getlist(name)) > 1:
                raise InvalidRequestError(f"query parameter {name} is given more than once", param=name)
        if batches is None:
            raise NotFoundError(
                "the batch lane is off: set server.state_dir in the config to keep files and batches"
            )
        tenant = getattr(http.state, "tenant", None)
        name = tenant.name if tenant is not None else ""
        return batches, name, (name if tenant is not None else None)

    def own_file(st: BatchStore, owner: str | None, file_id: str) -> FileRecord:
        """The file ``owner`` (None: the admin) may see, else a 404."""
        record = st.file(file_id, owner)
        if record is None:
            raise NotFoundError(f"no file {quoted(file_id)}", param="file_id")
        return record

    def own_batch(http: Request, batch_id: str) -> tuple[BatchStore, dict[str, Any]]:
        st, _, owner = store(http)
        card = st.batch(batch_id, owner)
        if card is None:
            raise NotFoundError(f"no batch {quoted(batch_id)}", param="batch_id")
        return st, card

    @app.post("/v1/files", responses=api_schema.FILE)
    async def upload(
        http: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
    ) -> dict:
        st, owner, _ = store(http)
        if purpose not in PURPOSES:
            raise InvalidRequestError(
                f"purpose {quoted(purpose)}: this server keeps files for {', '.join(PURPOSES)}",
                param="purpose",
            )

        def chunks():
            file.file.seek(0)
            while chunk := file.file.read(1 << 20):
                yield chunk

        name = file.filename or "upload.jsonl"
        file_id, size = await asyncio.to_thread(st.write_file, chunks())
        record = st.add_file(file_id, size, owner, purpose, name)
        return record.card()

    @app.get("/v1/files", responses=api_schema.FILES)
    async def list_files(
        http: Request, purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000),
        after: str | None = None, order: Literal["asc", "desc"] = "desc",
    ) -> dict:  # fmt: skip
        st, _, owner = store(http, ("purpose", "limit", "after", "order"))
        cards = [f.card() for f in st.files(owner, purpose)]
        if order == "asc":
            cards.reverse()
        return _page(cards, limit, after)

    @app.get("/v1/files/{file_id}", responses=api_schema.FILE)
    async def get_file(file_id: str, http: Request) -> dict:
        st, _, owner = store(http)
        return own_file(st, owner, file_id).card()

    @app.get("/v1/files/{file_id}/content", responses=api_schema.FILE_CONTENT)
    async def file_content(file_id: str, http: Request) -> Response:
        st, _, owner = store(http)
        record = own_file(st, owner, file_id)
        return FileResponse(st.file_path(record.id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", responses=api_schema.FILE_DELETED)
    async def delete_file(file_id: str, http: Request) -> dict:
        st, _, owner = store(http)
        record = own_file(st, owner, file_id)
        st.delete_file(record.id)
        return {"id": record.id, "object": "file", "deleted": True}

    @app.post("/v1/batches", responses=api_schema.BATCH)
    async def create_batch(body: CreateBatch, http: Request) -> dict:
        st, owner, visible = store(http)
        if body.endpoint not in ENDPOINTS:
            raise InvalidRequestError(
                f"endpoint {quoted(body.endpoint)}: one of {', '.join(ENDPOINTS)}", param="endpoint"
            )
        window_s = window_seconds(body.completion_window)
        record = own_file(st, visible, body.input_file_id)
        if record.purpose != "batch":
            raise InvalidRequestError(
                f"file {record.id} has purpose {record.purpose!r}; a batch's input needs purpose 'batch'",
                param="input_file_id",
            )
        tenant = getattr(http.state, "tenant", None)
        names = set(served())

        def may_call(model: str) -> bool:
            return model in names and (tenant is None or tenant.may_use(model))

        raw = await asyncio.to_thread(st.file_path(record.id).read_bytes)
        lines, errors = await asyncio.to_thread(check_lines, raw, body.endpoint, may_call)
        batch_id = st.add_batch(owner, body.endpoint, record.id, body.completion_window, window_s,
                                body.metadata, None if errors else lines, errors or None)  # fmt: skip
        runner.wake()
        return st.batch(batch_id)

    @app.get("/v1/batches", responses=api_schema.BATCHES)
    async def list_batches(
        http: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None
    ) -> dict:
        st, _, owner = store(http, ("limit", "after"))
        return _page(st.batches(owner), limit, after)

    @app.get("/v1/batches/{batch_id}", responses=api_schema.BATCH)
    async def get_batch(batch_id: str, http: Request) -> dict:
        return own_batch(http, batch_id)[1]

    @app.post("/v1/batches/{batch_id}/cancel", responses=api_schema.BATCH)
    async def cancel_batch(batch_id: str, http: Request) -> dict:
        st, card = own_batch(http, batch_id)
        if card["status"] in ("in_progress", "validating"):
            st.set_status(batch_id, "cancelling", "cancelling_at")
            runner.wake()
        elif card["status"] != "cancelling":
            raise InvalidRequestError(
                f"batch {batch_id} is {card['status']}; only a running batch can be cancelled"
            )
        return st.batch(batch_id)
