"""Replay a workload against an OpenAI-compatible endpoint (vLLM, prism serve, ...) and time every
request: POST /v1/completions with stream=true, one task per request, sent at its timestamp.

The client adds as little as it can to what it measures: a request's body (its prompt included) is
built and JSON-encoded before its send time, and the clock starts just before the POST. SSE is parsed
line by line here rather than through an SDK, so the first text chunk is seen as soon as it arrives.

A workload with prompt block hashes (the Mooncake trace, a request log) is sent so that equal hashes
are equal token blocks: with ``--prompt ids`` each hash maps to a fixed pseudo-random block of ids
(``hashed_prompt``), so the requests share exactly the prefixes the workload says they share and a
server's prefix cache can serve them. Text prompts cannot keep block boundaries (tokenization merges
words across them), so ``--prompt text`` sends random words as for any workload.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Mapping

import httpx
import numpy as np

from prism_serve.bench.report import BenchResult, RequestError, RequestRecord
from prism_serve.bench.settings import BenchError, BenchSettings, resolve_slos
from prism_serve.workload.format import Workload

__all__ = ["build_prompt", "fetch_server_slos", "hashed_prompt", "normalize_url", "replay"]

# Common English words that are one token each in the usual BPE vocabularies (GPT-2, Llama, SmolLM2)
# when preceded by a space, so --prompt text gets close to the intended length. Drawn at random
# rather than repeated, so a prefix cache cannot serve one request from another.
# fmt: off
_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
    "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
    "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more",
    "when", "will", "would", "who", "so", "no", "she", "other", "its", "may", "these", "about", "time",
    "into", "only", "some", "could", "them", "than", "then", "now", "over",
)
# fmt: on


def normalize_url(url: str) -> str:
    """The server root: accepts ``http://host:8000`` and the OpenAI-style ``http://host:8000/v1``."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise BenchError(f"--url must start with http:// or https://, got {url!r}")
    return base.removesuffix("/v1")


def build_prompt(num_tokens: int, settings: BenchSettings, rng: np.random.Generator) -> list[int] | str:
    """Token ids drawn from ``settings.token_range`` (exact length), or words (about that many tokens)."""
    if settings.prompt == "ids":
        lo, hi = settings.token_range
        return rng.integers(lo, hi, size=num_tokens).tolist()
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=num_tokens).tolist())


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a fixed bijection of uint64 that scatters neighbouring inputs."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hashed_prompt(
    num_tokens: int,
    block_hashes: tuple[int, ...],
    block_tokens: int,
    settings: BenchSettings,
    rng: np.random.Generator,
) -> list[int]:
    """Token ids whose ``i``-th block of ``block_tokens`` is the one block hash ``block_hashes[i]``
    stands for: ids in ``settings.token_range``, a function of the hash, the position in the block
    and ``settings.seed`` only, so equal hashes give equal blocks in every request and run. Tokens
    past the hashed blocks are drawn from ``rng`` (the request's own)."""
    lo, hi = settings.token_range
    n = min(num_tokens, len(block_hashes) * block_tokens)
    with np.errstate(over="ignore"):
        ids = np.array(block_hashes, dtype=np.int64).astype(np.uint64)
        seeded = _mix64(ids ^ _mix64(np.array([settings.seed], dtype=np.uint64)))
        pos = np.arange(block_tokens, dtype=np.uint64)
        x = _mix64(seeded[:, None] + pos[None, :]).ravel()[:n]
    out = (lo + (x % np.uint64(hi - lo)).astype(np.int64)).tolist()
    if n < num_tokens:
        out += rng.integers(lo, hi, size=num_tokens - n).tolist()
    return out


def _encode(
    rec: RequestRecord,
    settings: BenchSettings,
    rng: np.random.Generator,
    block_hashes: tuple[int, ...] = (),
    block_tokens: int = 0,
) -> bytes:
    if block_hashes and settings.prompt == "ids":
        prompt = hashed_prompt(rec.prompt_tokens, block_hashes, block_tokens, settings, rng)
    else:
        prompt = build_prompt(rec.prompt_tokens, settings, rng)
    body = {
        "model": rec.served_model,
        "prompt": prompt,
        "max_tokens": rec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # vLLM's extension (prism serve accepts it): outputs get the intended length
    }
    return json.dumps(body, separators=(",", ":")).encode()


async def fetch_server_slos(client: httpx.AsyncClient, base: str) -> dict[str, tuple[float, float]]:
    """``{served name: (ttft_s, tpot_s)}`` from /v1/models entries that carry ``ttft_slo`` and
    ``tpot_slo`` (prism serve does; other servers do not, and that is not an error)."""
    try:
        resp = await client.get(f"{base}/v1/models", timeout=30.0)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}
    out = {}
    for e in data:
        if not isinstance(e, dict) or not isinstance(e.get("id"), str):
            continue
        ttft, tpot = e.get("ttft_slo"), e.get("tpot_slo")
        if all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in (ttft, tpot)):
            out[e["id"]] = (float(ttft), float(tpot))
    return out


def _http_error(resp: httpx.Response) -> RequestError:
    message, type_ = resp.text[:500], None
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        # OpenAI nests {"error": {...}}; vLLM has answered {"object": "error", ...}; FastAPI {"detail"}
        err = body["error"] if isinstance(body.get("error"), dict) else body
        message = str(err.get("message") or err.get("detail") or message)
        type_ = err.get("type") if isinstance(err.get("type"), str) else None
    return RequestError(
        f"http_{resp.status_code}", message, resp.status_code, type_, resp.headers.get("retry-after")
    )


def _apply_event(obj: dict, rec: RequestRecord, now: float) -> RequestError | None:
    """Record one SSE event's completion chunks and usage; an error event ends the request."""
    if obj.get("error") or obj.get("object") == "error":
        err = obj["error"] if isinstance(obj.get("error"), dict) else obj
        return RequestError("stream_error", str(err.get("message", err)), None, err.get("type"))
    for choice in obj.get("choices") or ():
        # A completion chunk is one engine step's tokens, even when they decode to no text yet (a
        # partial UTF-8 character, a held-back stop string, a synthetic model's non-text tokens):
        # the first one is the first token.
        if rec.ttft_s is None:
            rec.ttft_s = now
        rec.token_times_s.append(now)
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    usage = obj.get("usage")
    if isinstance(usage, dict):
        rec.usage_reported = True
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.usage_prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        rec.usage_cached_tokens = cached if isinstance(cached, int) and not isinstance(cached, bool) else None
    return None


async def _read_stream(resp: httpx.Response, rec: RequestRecord, sent: float) -> None:
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, event:/id: fields
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        now = time.perf_counter() - sent
        try:
            obj = json.loads(data)
            if not isinstance(obj, dict):
                raise TypeError("not an object")
            rec.error = _apply_event(obj, rec, now)
        except (AttributeError, TypeError, ValueError) as exc:  # the endpoint's bug, not ours
            rec.error = RequestError("protocol", f"bad SSE event ({exc}): {data[:200]!r}")
        if rec.error is not None:
            return
    end = time.perf_counter() - sent
    if not done:
        rec.error = RequestError("protocol", "the stream ended without data: [DONE]")
    elif rec.ttft_s is None:
        rec.error = RequestError("no_output", "the stream carried no completion chunk")
    else:
        if not rec.usage_reported:
            rec.output_tokens = len(rec.token_times_s)
        rec.e2e_s = end


async def _send(
    client: httpx.AsyncClient, base: str, rec: RequestRecord, content: bytes, timeout_s: float, t0: float
) -> None:
    sent = time.perf_counter()
    rec.sent_s = sent - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                "POST",
                f"{base}/v1/completions",
                content=content,
                headers={"content-type": "application/json"},
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    rec.error = _http_error(resp)
                    return
                await _read_stream(resp, rec, sent)
    except (TimeoutError, httpx.TimeoutException):
        rec.error = RequestError("timeout", f"no complete response within {timeout_s:g} s")
    except httpx.ConnectError as exc:
        rec.error = RequestError("connect", str(exc) or type(exc).__name__)
    except httpx.NetworkError as exc:  # e.g. the server closed the connection mid-stream
        rec.error = RequestError("network", str(exc) or type(exc).__name__)
    except httpx.HTTPError as exc:
        rec.error = RequestError("protocol", str(exc) or type(exc).__name__)


def machine_info() -> dict:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


async def replay(
    workload: Workload,
    url: str,
    settings: BenchSettings | None = None,
    *,
    slos: Mapping | None = None,
    api_key: str | None = None,
    progress: bool = False,
    extra: dict | None = None,
) -> BenchResult:
    """Send every request of ``workload`` to ``url`` at its timestamp and measure it.

    ``slos``: unscaled per-model SLOs keyed by workload name (``sim.slo.load_slos``), scaled by
    ``settings.slo_scale`` (default 5, as in ``prism sim``). Without it, SLOs come from the endpoint's
    /v1/models where its entries carry them, else from ``settings.ttft_slo_s`` / ``tpot_slo_s``.
    ``extra`` is echoed in the JSON report. Failed requests are recorded, never raised.
    """
    from tqdm import tqdm

    settings = settings or BenchSettings()
    base = normalize_url(url)
    if settings.duration_s is not None:
        workload = workload.head(settings.duration_s)
    if len(workload) == 0:
        raise BenchError("the workload has no requests to send (check --duration)")
    unknown = sorted(a for a, _ in settings.model_map if a not in workload.models)
    if unknown:
        raise BenchError(f"--model-map names models the workload does not have: {unknown}")
    rows = list(workload.rows())
    records = [
        RequestRecord(
            i,
            r.model,
            settings.served_name(r.model),
            r.timestamp / settings.rate_scale,
            r.prompt_tokens,
            r.output_tokens,
        )
        for i, r in enumerate(rows)
    ]
    models = sorted({r.model for r in records})
    cap = settings.max_concurrency
    client = httpx.AsyncClient(
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        # without a cap every request may be in flight at once: the pool must not queue them
        limits=httpx.Limits(max_connections=cap, max_keepalive_connections=cap),
        timeout=httpx.Timeout(settings.timeout_s),
    )
    async with client:
        server = {} if slos is not None else await fetch_server_slos(client, base)
        targets = resolve_slos(models, settings, file_slos=slos, server_slos=server)
        rng = np.random.default_rng(settings.seed)
        gate = asyncio.Semaphore(cap) if cap is not None else None
        bar = tqdm(total=len(records), desc="bench", unit="req", file=sys.stderr, disable=not progress)
        in_flight = peak = num_failed = 0

        async def one(rec: RequestRecord, content: bytes) -> None:
            nonlocal in_flight, peak, num_failed
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await _send(client, base, rec, content, settings.timeout_s, t0)
            finally:
                in_flight -= 1
                if gate is not None:
                    gate.release()
                if rec.error is not None:
                    num_failed += 1
                    bar.set_postfix(failed=num_failed, refresh=False)
                bar.update()

        started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        t0, started_unix = time.perf_counter(), time.time()
        tasks = []
        for rec, row in zip(records, rows, strict=True):
            # before the wait, so it does not delay the send
            content = _encode(rec, settings, rng, row.block_hashes, row.block_tokens)
            delay = t0 + rec.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is not None:
                await gate.acquire()
            tasks.append(asyncio.create_task(one(rec, content)))
        await asyncio.gather(*tasks)
        end = time.perf_counter() - t0
        bar.close()
    first = min((r.sent_s for r in records if r.sent_s is not None), default=end)
    return BenchResult(
        url=base,
        settings=settings,
        slos=targets,
        records=records,
        started_at=started_at,
        started_unix=started_unix,
        duration_s=end - first,
        peak_in_flight=peak,
        machine=machine_info(),
        extra=dict(extra or {}),
    )
