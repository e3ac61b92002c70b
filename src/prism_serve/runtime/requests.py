"""A request's path through the controller, top to bottom: ``stream`` submits it (tokenized and
checked, then handed to the control loop, which queues it, routes it to a replica or activates the
model), the loop's ``dispatch`` sends it to the worker of the replica it chose, the worker's
``StepOutputs`` stream its tokens back (``on_outputs``), and it leaves with its last token, a
failure, or the client going away (which aborts it on its worker and frees its KV).

``Requests`` holds every request in flight; the activation, the node set and the controller fail
requests only through it, so none is left registered or waiting when its model or worker goes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from prism_serve.control import PREFIX_BLOCK_TOKENS, ModelState, RejectReason, Request
from prism_serve.control.loop import ControlLoop
from prism_serve.control.types import DEFAULT_ORIGIN, Origin
from prism_serve.engine.prefix_cache import block_keys
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.validation import check_prompt
from prism_serve.errors import (
    DuplicateRequestError,
    InternalError,
    InvalidSamplingParamsError,
    PrismError,
    PromptTooLongError,
    WorkerDiedError,
    error_class,
)
from prism_serve.runtime import messages as msg
from prism_serve.runtime.adapters import AdapterSpec
from prism_serve.runtime.models import ActivationError, ModelTooLargeError, UnknownModelError
from prism_serve.runtime.state import ModelEntry, ModelTable
from prism_serve.runtime.workers import WorkerHandle, WorkerPool

__all__ = ["DeadlineMissError", "RequestEntry", "RequestTimeoutError", "Requests", "prefix_keys"]

logger = logging.getLogger(__name__)


class RequestTimeoutError(PrismError):
    """The request's first token did not come within its timeout (e.g. a long activation queue)."""

    status_code = 504
    error_type = "timeout"


class DeadlineMissError(PrismError):
    """Admission dropped the request: its TTFT deadline can no longer be met (abort_on_miss)."""

    status_code = 429
    error_type = "rate_limit_exceeded"


REJECT_ERRORS: dict[RejectReason, type[PrismError]] = {
    RejectReason.DEADLINE_MISS: DeadlineMissError,
    RejectReason.NO_CAPACITY: ModelTooLargeError,
    RejectReason.UNKNOWN_MODEL: UnknownModelError,
    RejectReason.PROMPT_TOO_LONG: PromptTooLongError,
}


_KEY_MASK = (1 << 63) - 1  # a key as the request log writes one: a 63-bit integer


def prefix_keys(token_ids: Sequence[int], name: str) -> tuple[int, ...]:
    """The control plane's prefix keys of a prompt (``Request.prefix_keys``): one per full
    ``PREFIX_BLOCK_TOKENS``-token block, the prefix cache's chained keys (engine/prefix_cache.py's
    ``block_keys``, 8 bytes, as the request log's ``prompt_block_hashes``) salted by ``name``, the
    served model or LoRA adapter the prompt runs with: two adapters on one replica never match."""
    salt = hashlib.blake2b(name.encode(), digest_size=16).digest()
    keys = block_keys(token_ids, PREFIX_BLOCK_TOKENS, salt, [], digest_size=8)
    return tuple(int.from_bytes(k, "little") & _KEY_MASK for k in keys)


@dataclass(eq=False)
class RequestEntry:
    req_id: str
    model: str
    payload: bytes  # the encoded AddRequest, sent as is when the request is dispatched
    control: Request
    stream: asyncio.Queue = field(default_factory=asyncio.Queue)
    worker: WorkerHandle | None = None
    done: bool = False
    replica: str | None = None  # the replica it was dispatched to (control/replicas.py)
    cold: bool = False  # no replica of its model was active when it arrived
    adapter: str | None = None  # the LoRA adapter it runs with (``model`` is then its base)
    output_tokens: int = 0  # generated so far (its tenant's fair share is charged them when it leaves)
    first_token: float | None = None  # when its first token came (clock time), for the fair share

    @classmethod
    def build(
        cls, req_id: str, m: ModelEntry, prompt: str | list[int], params: SamplingParams, now: float,
        adapter: AdapterSpec | None = None, prefixes: bool = False, ttft_slo: float | None = None,
        origin: Origin = DEFAULT_ORIGIN,
    ) -> RequestEntry:  # fmt: skip
        """Tokenize and check the prompt, and encode the AddRequest once, here: a bad value set on a
        SamplingParams after it was built (out of range, or an int beyond 64 bits the wire cannot
        carry) is this request's 400 before anything of it is registered. ``prefixes``: the control
        request carries the prompt's prefix keys (a prefix-aware policy routes and admits by them).
        ``ttft_slo``: this request's own first-token deadline (the batch lane's: its batch's
        window), in place of the model's or adapter's. ``origin``: its tenant, class and weight
        (control/fairness.py)."""
        ids = m.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # on the loop: the ids are scanned off it (worker); a pooled input generates no token
        check_prompt(ids, None, m.max_model_len, 0 if params.pooling is not None else None)
        params.validate()  # a field set after construction; the worker's decoder would refuse it
        try:
            payload = msg.encode(msg.AddRequest(req_id, ids, params, adapter.name if adapter else None))
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as e:
            raise InvalidSamplingParamsError(f"the request cannot be sent to a worker: {e}") from None
        # an adapter's request is its base's load, queued by the adapter's own deadline
        keys = prefix_keys(ids, adapter.name if adapter else m.spec.name) if prefixes else ()
        if ttft_slo is None:
            ttft_slo = adapter.ttft_slo if adapter else m.spec.ttft_slo
        control = Request(req_id, m.spec.name, now, len(ids), ttft_slo, keys, origin=origin)
        return cls(req_id, m.spec.name, payload, control, adapter=adapter.name if adapter else None)

    @property
    def engine_model(self) -> str:
        """The replica (a model or replica slot name) whose engine runs it, once dispatched."""
        return self.replica or self.model


class Requests:
    """Every request in flight, by id, from submit to its last token (see the module docstring)."""

    def __init__(
        self, models: ModelTable, loop: ControlLoop, pool: WorkerPool, clock: Callable[[], float]
    ) -> None:
        self._models = models
        self._loop = loop
        self._pool = pool
        self._clock = clock
        self._by_id: dict[str, RequestEntry] = {}
        self._ids = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def in_flight(self) -> list[RequestEntry]:
        return list(self._by_id.values())

    # ---- in -----------------------------------------------------------------------------------

    async def stream(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams,
        req_id: str | None = None,
        timeout_s: float | None = None,
        ttft_slo: float | None = None,
        origin: Origin = DEFAULT_ORIGIN,
    ) -> AsyncIterator[msg.TokenDelta]:
        """``model``'s output for ``prompt``: one ``TokenDelta`` per engine step, the last with
        ``finished``. Raises a PrismError (404 unknown model, 400 bad prompt, 503 worker or model
        gone, 504 no first token within ``timeout_s``). Leaving the loop early aborts the request."""
        r = self.submit(model, prompt, params, req_id, ttft_slo, origin)
        first = True
        try:
            while True:
                if first and timeout_s is not None:
                    try:
                        item = await asyncio.wait_for(r.stream.get(), timeout_s)
                    except TimeoutError:
                        raise RequestTimeoutError(
                            f"no token from {model} within {timeout_s} s (still queued or activating)"
                        ) from None
                else:
                    item = await r.stream.get()
                first = False
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not r.done:
                self._abort(r)

    def submit(
        self, model: str, prompt: str | list[int], params: SamplingParams, req_id: str | None = None,
        ttft_slo: float | None = None, origin: Origin = DEFAULT_ORIGIN,
    ) -> RequestEntry:  # fmt: skip
        """Register a request and hand it to the control loop (which may dispatch it at once)."""
        m = self._models.served(model)  # an adapter's name gives its base
        adapter = self._models.adapters.get(model)
        if req_id is None:
            self._ids += 1
            req_id = f"r{self._ids}"
        if req_id in self._by_id:
            raise DuplicateRequestError(f"request id {req_id!r} is already in flight")
        now = self._clock()
        # 400s: nothing registered yet
        r = RequestEntry.build(
            req_id, m, prompt, params, now, adapter, self._loop.prefix_aware, ttft_slo, origin
        )
        r.cold = all(slot.state is not ModelState.ACTIVE for slot in self._models.slots(m.spec.name))
        self._by_id[req_id] = r
        try:
            self._loop.arrival(r.control, now)
        except BaseException:
            # Whatever failed (a policy, a queue), nothing of this request may stay registered.
            logger.exception("routing %s failed", req_id)
            self._abort(r)
            raise
        return r

    # ---- the control loop's effects -------------------------------------------------------------

    def dispatch(self, request: Request) -> bool:
        """Send the request to the worker of the replica the loop routed it to."""
        r = self._by_id.get(request.req_id)
        if r is None or r.done:
            return False
        m = self._models.entry(request.model)
        if m.worker is None or m.state is not ModelState.ACTIVE:
            self.fail(r, ActivationError(f"{request.model} is not active"))
            return False
        r.worker, r.replica = m.worker, request.model
        m.worker.in_flight.add(r.req_id)
        m.num_running += 1
        if not self._pool.try_send(
            m.worker, r.payload
        ):  # it must not stay booked on a worker that never got it
            self.fail(r, InternalError("could not hand the request to its worker"))
            return False
        return True

    def reject(self, request: Request, reason: RejectReason, detail: str) -> None:
        r = self._by_id.get(request.req_id)
        if r is not None:
            self.fail(r, REJECT_ERRORS[reason](detail))

    # ---- out: the workers' reports ------------------------------------------------------------

    def on_outputs(self, outputs: Iterable[msg.TokenDelta]) -> bool:
        """One engine step's tokens to their streams; True if a request finished."""
        finished = False
        for d in outputs:
            r = self._by_id.get(d.req_id)
            if r is None:
                continue
            r.output_tokens = d.num_output_tokens
            if r.first_token is None and d.num_output_tokens:
                r.first_token = self._clock()
                self._loop.first_token(r.req_id, r.first_token)
            if d.finished:
                worker = r.worker
                d = msgspec.structs.replace(
                    d, cold=r.cold, device=worker.device.name if worker else None, replica=r.replica
                )
                self._finish(r)
                finished = True
            r.stream.put_nowait(d)
        return finished

    def on_failed(self, req_id: str, error: str, message: str) -> bool:
        """The worker failed one request (``RequestFailed``); True if it was still in flight."""
        r = self._by_id.get(req_id)
        if r is None:
            return False
        self.fail(r, error_class(error)(message))
        return True

    # ---- leaving ------------------------------------------------------------------------------

    def fail(self, r: RequestEntry, error: BaseException) -> None:
        if r.done:
            return
        self._finish(r)
        r.stream.put_nowait(error)

    def fail_ids(self, req_ids: Iterable[str], error: Callable[[RequestEntry], BaseException]) -> None:
        """Fail each request still in flight among ``req_ids`` with ``error(request)``."""
        for req_id in list(req_ids):
            r = self._by_id.get(req_id)
            if r is not None:
                self.fail(r, error(r))

    def fail_on(self, handle: WorkerHandle, why: Callable[[str], str]) -> None:
        """Fail every request on ``handle`` with ``WorkerDiedError`` (503), saying ``why(its model)``."""
        self.fail_ids(handle.in_flight, lambda r: WorkerDiedError(why(r.model)))

    def _abort(self, r: RequestEntry) -> None:
        """The client went away: drop the request wherever it is and free its KV."""
        worker = r.worker
        self._finish(r)
        if worker is not None:
            with contextlib.suppress(WorkerDiedError):
                self._pool.send(worker, msg.AbortRequest(r.req_id))

    def _finish(self, r: RequestEntry) -> None:
        """The request leaves the controller and the loop, wherever it is."""
        r.done = True
        self._by_id.pop(r.req_id, None)
        if r.worker is not None:
            r.worker.in_flight.discard(r.req_id)
            served = self._models.entry(r.engine_model)
            served.num_running -= 1
            served.num_served += 1
            self._loop.request_left(r.req_id, r.output_tokens, self._clock(), r.first_token)
        else:
            self._loop.abort(r.req_id)
