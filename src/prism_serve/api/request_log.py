"""The request log: one JSON line per finished completion request, for ``prism plan``
(workload/traffic.py reads it) and for the operator. Never a prompt or an output text.

Each line::

    {"arrival": 1764251234.512, "model": "chat", "prompt_tokens": 812, "output_tokens": 95,
     "max_tokens": 256, "n": 1, "stream": true, "status": 200, "ttft_s": 0.141, "tpot_s": 0.021,
     "e2e_s": 2.13, "cold": false, "device": "cpu:1", "replica": "chat"}

- ``arrival``: wall-clock seconds when the server received the request;
- ``prompt_tokens``: summed over the request's prompts (null when it was refused before
  tokenization); ``output_tokens``: summed over its ``n`` choices;
- ``status``: the HTTP status it got, or for a stream the error status it ended with (499: the
  client went away);
- ``ttft_s`` (first token), ``tpot_s`` (mean time per output token after the first), ``e2e_s``:
  seconds, null where the request got no token;
- ``cold``: no replica of the model was active when the request arrived (it waited for an
  activation); ``device`` and ``replica``: what served its first choice;
- ``task`` (embed and score requests only): ``embed`` or ``score``; ``n`` is then its inputs (texts,
  or query-document pairs), each answered by its one output, and ``prompt_tokens`` their sum;
- ``tenant`` (with a keys file): the caller's tenant, never its key; ``priority``: its tenant's
  class when not ``standard``; ``lane``: ``batch`` for a line of the batch lane. ``prism plan``
  simulates each request in its class (workload/format.py);
- ``block_hashes`` and ``block_tokens`` (only on requests with one prompt, where the server filled
  them in): ``prompt_block_hashes`` of the prompt's token ids, one 63-bit integer per full block of
  ``block_tokens`` (``LOG_BLOCK_TOKENS``, 64) tokens, chained, so two requests have equal hashes up to
  the first block where their prompts differ and different ones from there on. They tell
  ``prism plan`` which requests share a prefix (its simulated engines cache prefixes); the prompt
  cannot be read back from them. 64 tokens keep a line short (a 100,000-token prompt adds about
  31 KB) while finding shared prefixes to within 64 tokens.

Lines go through a queue to a writer thread (never the event loop), which writes them as they
come and flushes them to the file at least every ``FLUSH_INTERVAL_S``: a server killed at any
moment loses at most the lines of the last interval. A file over ``max_bytes`` is rotated:
``requests.jsonl`` becomes ``requests.jsonl.1`` (older ones shift up, ``keep`` are kept).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_serve.engine.prefix_cache import block_keys

__all__ = ["FLUSH_INTERVAL_S", "LOG_BLOCK_TOKENS", "LogEntry", "RequestLog", "prompt_block_hashes"]

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.5
LOG_BLOCK_TOKENS = 64  # tokens per hashed prompt block in the log
_STOP = object()
_HASH_MASK = (1 << 63) - 1  # a hash fits a signed 64-bit integer wherever the log is read


def prompt_block_hashes(token_ids: Sequence[int], block_tokens: int = LOG_BLOCK_TOKENS) -> list[int]:
    """One hash per full ``block_tokens``-token block of ``token_ids``: the prefix cache's chained
    key (engine/prefix_cache.py's ``block_keys``, 8 bytes, no salt) as a 63-bit integer. The same
    in every process and on every machine (no ``hash()``, no byte order)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    keys = block_keys(token_ids, block_tokens, b"", [], digest_size=8)  # the engine's own chaining
    return [int.from_bytes(k, "little") & _HASH_MASK for k in keys]


@dataclass(slots=True)
class LogEntry:
    """One request's line, filled in as it goes."""

    arrival: float
    model: str
    stream: bool
    n: int
    max_tokens: int | None
    status: int = 200
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    cold: bool | None = None
    device: str | None = None
    replica: str | None = None
    block_hashes: list[int] | None = None  # prompt_block_hashes of its one prompt
    block_tokens: int = LOG_BLOCK_TOKENS
    tenant: str | None = None  # the caller's tenant (api/tenants.py), never its key
    lane: str | None = None  # "batch" for a batch line (api/batches.py); unset: interactive
    priority: str | None = None  # its tenant's class, when not "standard"
    task: str | None = None  # "embed" or "score": n inputs sharing prompt_tokens; unset: generation

    def served(self, runs: list[Any], prompt_tokens: int, started: float) -> None:
        """What the request's choices (api/choices.py ``Choice``) got; ``started``: its arrival on
        their clock (perf_counter)."""
        self.prompt_tokens = prompt_tokens
        self.output_tokens = sum(r.num_output for r in runs)
        firsts = [r.first_at for r in runs if r.first_at]
        if firsts:
            self.ttft_s = min(firsts) - started
            self.e2e_s = max(r.last_at for r in runs) - started
            decoded = [(r.last_at - r.first_at, r.num_output - 1) for r in runs if r.num_output > 1]
            if decoded:
                self.tpot_s = sum(t for t, _ in decoded) / sum(k for _, k in decoded)
        last = runs[0].last if runs else None
        if last is not None:
            self.cold, self.device, self.replica = last.cold, last.device, last.replica

    def line(self) -> str:
        hashes = (
            {"block_hashes": self.block_hashes, "block_tokens": self.block_tokens}
            if self.block_hashes is not None
            else {}
        )
        return json.dumps(
            {
                "arrival": round(self.arrival, 6),
                "model": self.model[:256],
                "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens,
                "max_tokens": self.max_tokens,
                "n": self.n,
                "stream": self.stream,
                "status": self.status,
                "ttft_s": _round(self.ttft_s),
                "tpot_s": _round(self.tpot_s),
                "e2e_s": _round(self.e2e_s),
                "cold": self.cold,
                "device": self.device,
                "replica": self.replica,
                **({"task": self.task} if self.task is not None else {}),
                **({"tenant": self.tenant} if self.tenant is not None else {}),
                **({"priority": self.priority} if self.priority is not None else {}),
                **({"lane": self.lane} if self.lane is not None else {}),
                **hashes,
            },
            separators=(", ", ": "),
        )


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class RequestLog:
    def __init__(self, path: str | Path, max_bytes: int = 64 * 2**20, keep: int = 5) -> None:
        if max_bytes <= 0 or keep < 0:
            raise ValueError("the request log needs max_bytes > 0 and keep >= 0")
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.keep = keep
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._file = self.path.open("a", encoding="utf-8")
        self._thread = threading.Thread(target=self._run, name="prism-request-log", daemon=True)
        self._thread.start()

    def write(self, entry: LogEntry) -> None:
        """Queue ``entry``'s line (never blocks)."""
        self._queue.put(entry.line())

    def close(self) -> None:
        """Write what is queued, then stop."""
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        last_flush = time.monotonic()
        dirty = False
        while True:
            timeout = max(0.0, last_flush + FLUSH_INTERVAL_S - time.monotonic()) if dirty else None
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            try:
                if item is _STOP:
                    self._file.close()
                    return
                if item is not None:
                    self._file.write(item + "\n")
                    dirty = True
                    if self._file.tell() >= self.max_bytes:
                        self._rotate()
                        dirty = False
                if dirty and time.monotonic() - last_flush >= FLUSH_INTERVAL_S:
                    self._file.flush()
                    last_flush, dirty = time.monotonic(), False
            except OSError:  # a full disk must not stop the server; the next line tries again
                logger.exception("writing the request log %s failed", self.path)

    def _rotate(self) -> None:
        self._file.close()
        if self.keep == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._file = self.path.open("a", encoding="utf-8")
