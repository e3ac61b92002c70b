"""Tenants: who may call which model, and how much (``server.keys_file``).

The keys file (YAML) lists tenants. Each has its keys, stored as SHA-256 hashes
(``sha256:<64 hex digits>``; ``prism hash-key`` prints one), the models it may call (names or
globs such as ``team-a-*``, LoRA adapters included; unset: every model) and its limits:

- ``requests_per_minute``: requests admitted in any sliding 60 s;
- ``tokens_per_minute``: prompt plus output tokens in any sliding 60 s. As OpenAI counts them, a
  request reserves its prompt's tokens plus ``max_tokens`` for each choice once it is tokenized
  (refused if that would pass the limit), and each choice gives back what it did not use when it
  ends, so the tokens in a window never pass the limit (a choice that never finishes, its client
  gone or an error, keeps its whole reservation until it leaves the window);
- ``concurrent_requests``: requests in flight (a stream counts until its last chunk is sent).

``slo_scale`` (default 1) multiplies the tenant's models' TTFT and TPOT SLOs for its requests: a
tenant at 4 asks for a first token within four times the model's TTFT SLO, so deadline admission
serves a tenant at 1 first when the two compete, and /metrics judges its requests by the scaled SLOs.

``priority`` (``interactive``, ``standard``, the default, or ``batch``) is the class its requests
have in the device queues' deadline admission: under overload a batch request yields first, then a
standard one (control/admission.py). ``weight`` (default 1) is its part of its class's fair share:
when tenants of one class compete, admission drops first the requests of a tenant that has been
served (in tokens, over the last minutes) well over its weight's part of what the class was served
(control/fairness.py), so one tenant's flood costs that tenant, not the others. The batch lane's
lines (api/batches.py) are ``batch`` whatever their tenant's class.

A request over a limit gets 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers
(which every admitted request's response carries too); a model outside the tenant's list is a 404
worded as for a model that does not exist. The server reads the file at start (a bad file stops
it), again when it changes (checked at most once a second, as requests come) and on SIGHUP; a
file that no longer parses leaves the tenants as they were, and the error is logged. Counters
belong to the tenant's name, so a reload keeps them; requests in flight are never cut.

A key of the config's ``api_keys`` (the simple form) is the tenant ``default``: every model, no
limits. Everything here runs on the server's event loop.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import math
import os
import re
import time
from collections import deque
from pathlib import Path
from typing import Literal

import yaml
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prism_serve.api.errors import key_matches
from prism_serve.control.types import Origin, Priority
from prism_serve.errors import PrismError

__all__ = ["KeysFile", "RateLimitError", "Tenant", "TenantCollector", "TenantUsage", "Tenants", "hash_key"]

logger = logging.getLogger(__name__)

WINDOW_S = 60.0  # the sliding window of the per-minute limits
DEFAULT_TENANT = "default"  # the tenant of the config's plain api_keys
LIMIT_KINDS = ("requests", "tokens", "concurrency")  # what a 429 was over (prism_tenant_rate_limited)
SLO_KINDS = ("ttft", "tpot")  # as /metrics' prism_slo_* judge them
_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


def hash_key(key: str) -> str:
    """How the keys file stores ``key``."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    concurrent_requests: int | None = Field(None, ge=1)


class TenantEntry(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    keys: list[str] = Field(min_length=1)
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    limits: Limits = Limits()
    # this tenant's SLOs are its models' times this: its requests' first-token deadlines in the
    # device queues (deadline admission), and what /metrics judges them by
    slo_scale: float = Field(1.0, gt=0, le=1000)
    # its requests' class in deadline admission, and its part of the class's fair share
    priority: Literal["interactive", "standard", "batch"] = "standard"
    weight: float = Field(1.0, gt=0, le=1e6)

    @field_validator("keys")
    @classmethod
    def _hashed(cls, v: list[str]) -> list[str]:
        for key in v:
            if not _HASH.match(key):
                shown = key[:12] + "..." if len(key) > 12 else key
                raise ValueError(
                    f"keys are stored as hashes, 'sha256:' and 64 hex digits (`prism hash-key` prints "
                    f"one), got {shown!r}"
                )
        return v


class KeysFile(_Strict):
    tenants: list[TenantEntry]

    @model_validator(mode="after")
    def _unique(self) -> KeysFile:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        if DEFAULT_TENANT in names:
            raise ValueError(f"{DEFAULT_TENANT!r} is the tenant of the config's api_keys; name it otherwise")
        seen: dict[str, str] = {}
        for t in self.tenants:
            for key in t.keys:
                if key in seen:
                    raise ValueError(f"a key is listed for both {seen[key]} and {t.name}")
                seen[key] = t.name
        return self

    @classmethod
    def read(cls, path: Path) -> KeysFile:
        """The file, or ValueError saying what is wrong with it (its name first)."""
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"{path}: {e}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(file)'}: {err['msg']}" for err in e.errors()
            )
            raise ValueError(f"{path}: {problems}") from None


class RateLimitError(PrismError):
    """A tenant's limit is reached: retry after ``retry_after`` seconds."""

    status_code = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = headers


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``1m30s``, ``4s``, ``250ms``."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


class Tenant:
    """One tenant: its settings (replaced by a reload) and its counters (kept)."""

    def __init__(self, entry: TenantEntry) -> None:
        self.entry = entry
        self.digests: list[bytes] = []
        self._requests: deque[float] = deque()  # admission times in the window
        # [time, tokens, in the window] of each reservation in the window (tokens: settled or not)
        self._tokens: deque[list] = deque()
        self._token_sum = 0
        self.in_flight = 0
        # since start, for /metrics (TenantCollector): admitted, tokens used, 429s by limit
        self.admitted = 0
        self.tokens_used = 0
        self.limited = dict.fromkeys(LIMIT_KINDS, 0)
        self.slo_met = dict.fromkeys(SLO_KINDS, 0)  # its requests that met their (scaled) SLO
        self.slo_judged = dict.fromkeys(SLO_KINDS, 0)  # ... and all that were judged
        self.update(entry)

    def update(self, entry: TenantEntry) -> None:
        self.entry = entry
        self.digests = [bytes.fromhex(k.removeprefix("sha256:")) for k in entry.keys]
        # who its requests come from, as admission sees them (control/types.py)
        self.origin = Origin(entry.name, Priority[entry.priority.upper()], entry.weight)

    @property
    def name(self) -> str:
        return self.entry.name

    def may_use(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.entry.models)

    def _prune(self, now: float) -> None:
        while self._requests and self._requests[0] <= now - WINDOW_S:
            self._requests.popleft()
        while self._tokens and self._tokens[0][0] <= now - WINDOW_S:
            entry = self._tokens.popleft()
            self._token_sum -= entry[1]
            entry[2] = False  # what it settles later is no longer in any window

    def admit(self, now: float) -> dict[str, str]:
        """Count one request in, or RateLimitError naming the limit it is at; the rate headers."""
        self._prune(now)
        limits = self.entry.limits
        if limits.concurrent_requests is not None and self.in_flight >= limits.concurrent_requests:
            self._refuse(
                now,
                "concurrency",
                f"{self.in_flight} requests in flight (limit {limits.concurrent_requests})",
                1.0,
            )
        rpm = limits.requests_per_minute
        if rpm is not None and len(self._requests) >= rpm:
            wait = self._requests[len(self._requests) - rpm] + WINDOW_S - now
            self._refuse(
                now, "requests", f"{len(self._requests)} requests in the last minute (limit {rpm})", wait
            )
        tpm = limits.tokens_per_minute
        if tpm is not None and self._token_sum >= tpm:
            wait = self._token_wait(now, tpm - 1)
            self._refuse(now, "tokens", f"{self._token_sum} tokens in the last minute (limit {tpm})", wait)
        if rpm is not None:
            self._requests.append(now)
        self.in_flight += 1
        self.admitted += 1
        return self.headers(now)

    def _token_wait(self, now: float, room: int) -> float:
        """Seconds until the window's tokens are down to ``room``."""
        total = self._token_sum
        for at, n, _ in self._tokens:
            if total <= room:
                break
            total -= n
            if total <= room:
                return at + WINDOW_S - now
        return 0.0

    def _refuse(self, now: float, kind: str, what: str, wait_s: float) -> None:
        self.limited[kind] += 1
        raise RateLimitError(
            f"tenant {self.name}: {what}; retry later", max(1, math.ceil(wait_s)), self.headers(now)
        )

    def release(self) -> None:
        self.in_flight -= 1

    def reserve(self, tokens: list[int], now: float) -> list[list]:
        """Reserve each choice's tokens (its prompt's plus its ``max_tokens``), or RateLimitError
        when they would pass ``tokens_per_minute``: a handle per choice for ``settle``."""
        tpm = self.entry.limits.tokens_per_minute
        total = sum(tokens)
        if tpm is None:  # nothing to count against
            return [[now, n, False] for n in tokens]
        self._prune(now)
        if total > tpm:
            self.limited["tokens"] += 1
            raise RateLimitError(
                f"tenant {self.name}: this request may use {total} tokens (prompt and max_tokens), more "
                f"than its limit of {tpm} a minute; lower max_tokens", 60, self.headers(now),
            )  # fmt: skip
        if self._token_sum + total > tpm:
            wait = self._token_wait(now, tpm - total)
            self._refuse(now, "tokens", f"{self._token_sum} tokens in the last minute (limit {tpm})", wait)
        handles = [[now, n, True] for n in tokens]
        self._tokens.extend(handles)
        self._token_sum += total
        return handles

    def settle(self, handle: list, used: int) -> None:
        """A choice ended having used ``used`` tokens: the rest of its reservation is given back."""
        if handle[2]:
            self._token_sum += used - handle[1]
        handle[1] = used
        self.tokens_used += used

    def judge(self, met: tuple[bool, bool]) -> None:
        """One of its requests judged against its SLOs (TTFT, TPOT), as /metrics judged it."""
        for kind, ok in zip(SLO_KINDS, met, strict=True):
            self.slo_judged[kind] += 1
            self.slo_met[kind] += ok

    def attainment(self) -> dict[str, float | None]:
        """The share of its judged requests that met each SLO since the server started."""
        return {k: self.slo_met[k] / n if (n := self.slo_judged[k]) else None for k in SLO_KINDS}

    def snapshot(self, now: float) -> dict:
        """Its settings and use, for ``GET /v1/admin/tenants`` and ``prism tenants``."""
        self._prune(now)
        return {
            "tenant": self.name, "models": list(self.entry.models), "limits": self.entry.limits.model_dump(),
            "slo_scale": self.entry.slo_scale, "priority": self.entry.priority, "weight": self.entry.weight,
            "in_flight": self.in_flight,
            "requests_last_minute": len(self._requests),
            "tokens_last_minute": self._token_sum, "admitted": self.admitted, "tokens_used": self.tokens_used,
            "rate_limited": dict(self.limited), "slo_attainment": self.attainment(),
        }  # fmt: skip

    def headers(self, now: float) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits the tenant has."""
        limits, out = self.entry.limits, {}
        if limits.requests_per_minute is not None:
            used = len(self._requests)
            reset = self._requests[0] + WINDOW_S - now if self._requests else 0.0
            out["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
            out["x-ratelimit-remaining-requests"] = str(max(0, limits.requests_per_minute - used))
            out["x-ratelimit-reset-requests"] = _duration(reset)
        if limits.tokens_per_minute is not None:
            reset = self._tokens[0][0] + WINDOW_S - now if self._tokens else 0.0
            out["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
            out["x-ratelimit-remaining-tokens"] = str(max(0, limits.tokens_per_minute - self._token_sum))
            out["x-ratelimit-reset-tokens"] = _duration(reset)
        return out


class Tenants:
    """The server's tenants: the keys file's and the config's plain ``api_keys`` (``default``)."""

    def __init__(self, path: str | None, api_keys: list[str], clock=time.monotonic) -> None:
        self.path = Path(path).expanduser() if path else None
        self._clock = clock
        self._plain = list(api_keys)
        # the plain keys' tenant: every model, no limits
        self.default = (
            Tenant(TenantEntry(name=DEFAULT_TENANT, keys=[hash_key(k) for k in api_keys]))
            if api_keys
            else None
        )
        self.by_name: dict[str, Tenant] = {}
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        if self.path is not None:
            self._load(KeysFile.read(self.path))  # a bad file at start is the caller's error

    @property
    def enabled(self) -> bool:
        return self.path is not None or bool(self._plain)

    def identify(self, token: str) -> Tenant | None:
        """The tenant whose key ``token`` is, comparing against every key in constant time."""
        self._maybe_reload()
        digest = hashlib.sha256(token.encode()).digest()
        found: Tenant | None = None
        for tenant in self.by_name.values():
            for d in tenant.digests:
                if hmac.compare_digest(digest, d):
                    found = tenant
        plain = key_matches(token, self._plain)
        return found or (self.default if plain else None)

    def named(self, name: str) -> Tenant | None:
        """The tenant called ``name`` now (a batch's owner), None if the keys file dropped it."""
        if name == DEFAULT_TENANT and self.default is not None:
            return self.default
        return self.by_name.get(name)

    def all(self) -> list[Tenant]:
        """The keys file's tenants, and ``default`` if there are plain api_keys."""
        return [*self.by_name.values(), *([self.default] if self.default is not None else [])]

    def reload(self, why: str = "SIGHUP") -> bool:
        """Read the file again (on SIGHUP, or it changed): False, and the tenants as they were,
        when it does not parse."""
        if self.path is None:
            return False
        try:
            parsed = KeysFile.read(self.path)
        except ValueError as e:
            logger.error("keys file not reloaded, the tenants stay as they were: %s", e)
            return False
        self._load(parsed)
        logger.info("keys file reloaded (%s): %d tenants", why, len(self.by_name))
        return True

    def _load(self, parsed: KeysFile) -> None:
        tenants = {}
        for entry in parsed.tenants:
            tenant = self.by_name.get(entry.name) or Tenant(entry)
            tenant.update(entry)
            tenants[entry.name] = tenant
        self.by_name = tenants
        self._stamp = self._file_stamp()

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)  # type: ignore[arg-type]
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _maybe_reload(self) -> None:
        if self.path is None:
            return
        now = self._clock()
        if now - self._checked < 1.0:
            return
        self._checked = now
        if self._file_stamp() != self._stamp and not self.reload("it changed"):
            self._stamp = self._file_stamp()  # logged once, not at every request


class TenantCollector:
    """The tenants' counters in /metrics, read at scrape time: one series per configured tenant
    (and ``default`` for the plain api_keys), so the labels stay as few as the tenants."""

    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants

    def collect(self):
        requests = CounterMetricFamily(
            "prism_tenant_requests", "Requests admitted, by tenant", labels=["tenant"]
        )
        tokens = CounterMetricFamily(
            "prism_tenant_tokens",
            "Prompt and output tokens of finished choices, by tenant",
            labels=["tenant"],
        )
        limited = CounterMetricFamily(
            "prism_tenant_rate_limited",
            "Requests refused with 429 over a tenant's limit",
            labels=["tenant", "limit"],
        )
        in_flight = GaugeMetricFamily(
            "prism_tenant_requests_in_flight", "Requests in flight", labels=["tenant"]
        )
        met = CounterMetricFamily(
            "prism_tenant_slo_met",
            "Finished requests that met their SLO (their model's times the tenant's slo_scale), by tenant",
            labels=["tenant", "slo"],
        )
        judged = CounterMetricFamily(
            "prism_tenant_slo_requests",
            "Requests judged against their SLO, by tenant",
            labels=["tenant", "slo"],
        )
        for t in self.tenants.all():
            requests.add_metric([t.name], t.admitted)
            tokens.add_metric([t.name], t.tokens_used)
            in_flight.add_metric([t.name], t.in_flight)
            for kind in LIMIT_KINDS:
                limited.add_metric([t.name, kind], t.limited[kind])
            for kind in SLO_KINDS:
                met.add_metric([t.name, kind], t.slo_met[kind])
                judged.add_metric([t.name, kind], t.slo_judged[kind])
        yield from (requests, tokens, limited, in_flight, met, judged)


class TenantUsage:
    """ASGI middleware: puts the tenant's ``x-ratelimit-*`` headers (``scope["state"]``'s
    ``tenant_headers``, set when the request was admitted) on the response, and counts the
    request's end (``tenant_release``) once its last byte is sent, or it failed, or the client
    went away."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start" and state.get("tenant_headers"):
                headers = list(message.get("headers", []))
                have = {k.lower() for k, _ in headers}  # a 429's own, newer ones stay
                headers += [(k.encode(), v.encode()) for k, v in state["tenant_headers"].items()
                            if k.encode() not in have]  # fmt: skip
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, with_headers)
        finally:
            release = state.pop("tenant_release", None)
            if release is not None:
                release()
