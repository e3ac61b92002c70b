"""The workload file: one JSON object per line, the one format `prism sim` and `prism bench` both read.

Each line is a request::

    {"timestamp": 12.503125, "model": "llama-3.2-1b-07", "prompt_tokens": 812, "output_tokens": 95}

- ``timestamp``: arrival time in seconds from the start of the workload (>= 0, finite);
- ``model``: the name the request is addressed to (any non-empty string);
- ``prompt_tokens`` (>= 1) and ``output_tokens`` (>= 1): lengths in tokens;
- optionally ``block_hashes`` and ``block_tokens`` together: one integer per ``block_tokens``-token
  block of the prompt, from its start (a last partial block may have one too); equal hashes at the
  same position of two prompts mean the same tokens there. They tell which requests share a prefix
  (the simulator's prefix cache, workload/prefix.py); a request without them shares nothing;
- optionally ``tenant`` (a name, 1-64 characters) and ``priority`` (``interactive``, ``standard`` or
  ``batch``): who sent it and its class in admission (control/admission.py, control/fairness.py).
  A request without them is ``standard`` from no tenant. The simulator serves a ``batch`` request
  by its class (it yields to the others under overload) with its batch window as its deadline,
  and its attainment counts the other classes only (a batch request is reported apart).

Lines are written in arrival order; a reader accepts them in any order and sorts them (stably). Blank
lines are ignored; any other key is an error, so a typo never silently changes a workload.
In memory a :class:`Workload` holds the columns as numpy arrays, which is what the simulator and the
statistics want; :meth:`Workload.rows` gives per-request records for the live load generator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prism_serve.errors import PrismError

__all__ = [
    "FIELDS",
    "HASH_FIELDS",
    "NO_ORIGIN",
    "ORIGIN_FIELDS",
    "PRIORITIES",
    "Workload",
    "WorkloadError",
    "WorkloadRequest",
    "check_origin",
    "parse_hashes",
    "read_jsonl",
    "write_jsonl",
]

FIELDS = ("timestamp", "model", "prompt_tokens", "output_tokens")
HASH_FIELDS = ("block_hashes", "block_tokens")  # optional, both or neither
ORIGIN_FIELDS = ("tenant", "priority")  # optional, each alone
PRIORITIES = ("interactive", "standard", "batch")  # as control.types.Priority, in its order
NO_ORIGIN = ("", "standard")  # a request without tenant or priority


class WorkloadError(PrismError, ValueError):
    """A workload file or a workload specification is invalid."""


@dataclass(slots=True, frozen=True)
class WorkloadRequest:
    timestamp: float
    model: str
    prompt_tokens: int
    output_tokens: int
    # one hash per ``block_tokens``-token block of the prompt from its start; () shares nothing
    block_hashes: tuple[int, ...] = ()
    block_tokens: int = 0
    tenant: str = ""
    priority: str = "standard"

    @property
    def origin(self) -> tuple[str, str]:
        return (self.tenant, self.priority)


class Workload:
    """Requests as parallel columns, sorted by arrival time.

    ``models`` lists every model name the workload serves, including models that get no request
    (a model idle for the whole run still occupies memory under some policies); ``model_index[i]``
    indexes it. ``block_hashes`` (None: no request has any) holds each request's prompt block hashes,
    ``()`` for a request without, all of blocks of ``block_tokens`` tokens. ``origins`` (None: every
    request is ``NO_ORIGIN``) lists the (tenant, priority) pairs that occur; ``origin_index[i]``
    indexes it. ``groups`` (None: every request stands alone) gives each request the id of the
    client request it is part of: the inputs of one embed or score request (a request log's line
    of ``n`` inputs) share an id >= 0 and are judged together, met only if every one is; -1 stands
    alone.
    """

    __slots__ = (
        "block_hashes",
        "block_tokens",
        "groups",
        "model_index",
        "models",
        "origin_index",
        "origins",
        "output_tokens",
        "prompt_tokens",
        "timestamps",
    )

    def __init__(
        self,
        timestamps: np.ndarray,
        model_index: np.ndarray,
        prompt_tokens: np.ndarray,
        output_tokens: np.ndarray,
        models: Sequence[str],
        block_hashes: Sequence[tuple[int, ...]] | None = None,
        block_tokens: int = 0,
        origins: Sequence[tuple[str, str]] | None = None,
        groups: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """``origins``: each request's (tenant, priority), or None for none; ``groups`` as the
        class says."""
        n = len(timestamps)
        if not (len(model_index) == len(prompt_tokens) == len(output_tokens) == n):
            raise WorkloadError("workload columns differ in length")
        if block_hashes is not None and (len(block_hashes) != n or block_tokens < 1):
            raise WorkloadError("block_hashes needs one entry per request and block_tokens >= 1")
        if len(set(models)) != len(models) or not all(models):
            raise WorkloadError("model names must be unique and non-empty")
        ts = np.asarray(timestamps, dtype=np.float64)
        idx = np.asarray(model_index, dtype=np.int32)
        prompt = np.asarray(prompt_tokens, dtype=np.int64)
        out = np.asarray(output_tokens, dtype=np.int64)
        if n and (not np.all(np.isfinite(ts)) or ts.min() < 0):
            raise WorkloadError("timestamps must be finite and >= 0")
        if n and (prompt.min() < 1 or out.min() < 1):
            raise WorkloadError("prompt_tokens and output_tokens must be >= 1")
        if n and (idx.min() < 0 or idx.max() >= len(models)):
            raise WorkloadError("model index out of range")
        order = np.argsort(ts, kind="stable")
        self.timestamps = ts[order]
        self.model_index = idx[order]
        self.prompt_tokens = prompt[order]
        self.output_tokens = out[order]
        self.models = tuple(models)
        self.block_hashes: tuple[tuple[int, ...], ...] | None = None
        self.block_tokens = 0
        if block_hashes is not None and any(block_hashes):
            self.block_hashes = tuple(tuple(block_hashes[i]) for i in order.tolist())
            self.block_tokens = int(block_tokens)
        self.origins: tuple[tuple[str, str], ...] | None = None
        self.origin_index: np.ndarray | None = None
        if origins is not None:
            if len(origins) != n:
                raise WorkloadError("origins needs one (tenant, priority) per request")
            table: dict[tuple[str, str], int] = {}
            for tenant, priority in dict.fromkeys(origins):
                check_origin(tenant, priority, "workload")
                table[(tenant, priority)] = len(table)
            if set(table) - {NO_ORIGIN}:
                self.origins = tuple(table)
                self.origin_index = np.array([table[o] for o in origins], dtype=np.int32)[order]
        self.groups: np.ndarray | None = None
        if groups is not None:
            g = np.asarray(groups, dtype=np.int64)
            if len(g) != n or (n and g.min() < -1):
                raise WorkloadError("groups needs one id (>= 0, or -1: alone) per request")
            if n and g.max() >= 0:
                self.groups = g[order]

    def origin_of(self, i: int) -> tuple[str, str]:
        """Request ``i``'s (tenant, priority)."""
        return NO_ORIGIN if self.origins is None else self.origins[self.origin_index[i]]

    def judged(self) -> np.ndarray:
        """Which requests attainment counts (sim/metrics.py), one per judgement: all but the batch
        class's (all when every request is batch), and of a group's inputs only its first (the
        group is judged once, on all of them)."""
        out = np.ones(len(self), dtype=bool)
        if self.origins is not None:
            batch = np.array([p == "batch" for _, p in self.origins], dtype=bool)[self.origin_index]
            if not batch.all():
                out = ~batch
        if self.groups is not None:  # every grouped input after its group's first
            grouped = np.flatnonzero(self.groups >= 0)
            later = np.zeros(len(self), dtype=bool)
            later[grouped] = True
            later[grouped[np.unique(self.groups[grouped], return_index=True)[1]]] = False
            out &= ~later
        return out

    def origins_at(self, index: np.ndarray) -> list[tuple[str, str]] | None:
        """The origins of the requests at ``index`` (a mask or indices), for a new workload."""
        if self.origins is None:
            return None
        table = self.origins
        return [table[k] for k in self.origin_index[index].tolist()]

    def __len__(self) -> int:
        return len(self.timestamps)

    def __repr__(self) -> str:
        return f"Workload({len(self)} requests, {len(self.models)} models, {self.duration:.0f} s)"

    @property
    def duration(self) -> float:
        return float(self.timestamps[-1]) if len(self) else 0.0

    def mean_rates(self) -> dict[str, float]:
        """Requests/s of each model (every listed model, 0.0 without requests) over the span from 0
        to the last arrival (1 s for a workload of one instant)."""
        span = max(self.duration, 1.0)
        counts = np.bincount(self.model_index, minlength=len(self.models))
        return {m: float(c) / span for m, c in zip(self.models, counts.tolist(), strict=True)}

    def longest_requests(self) -> dict[str, int]:
        """Each model's longest request, prompt plus output tokens (0 without requests)."""
        tokens = np.zeros(len(self.models), dtype=np.int64)
        np.maximum.at(tokens, self.model_index, self.prompt_tokens + self.output_tokens)
        return dict(zip(self.models, tokens.tolist(), strict=True))

    def rows(self) -> Iterator[WorkloadRequest]:
        names = self.models
        hashes = self.block_hashes or ((),) * len(self)
        origins = self.origins_at(np.arange(len(self))) or (NO_ORIGIN,) * len(self)
        bt = self.block_tokens
        for t, m, p, o, h, who in zip(
            self.timestamps.tolist(),
            self.model_index.tolist(),
            self.prompt_tokens.tolist(),
            self.output_tokens.tolist(),
            hashes,
            origins,
            strict=True,
        ):
            yield WorkloadRequest(t, names[m], p, o, h, bt if h else 0, *who)

    def groups_at(self, index: np.ndarray) -> np.ndarray | None:
        """The group ids of the requests at ``index`` (a mask or indices), for a new workload."""
        return None if self.groups is None else self.groups[index]

    def _hashes_of(self, mask: np.ndarray) -> list[tuple[int, ...]] | None:
        if self.block_hashes is None:
            return None
        return [self.block_hashes[i] for i in np.flatnonzero(mask).tolist()]

    def select(self, mask: np.ndarray) -> Workload:
        """The requests where ``mask`` is true (the model list is kept whole)."""
        return Workload(
            self.timestamps[mask],
            self.model_index[mask],
            self.prompt_tokens[mask],
            self.output_tokens[mask],
            self.models,
            self._hashes_of(mask),
            self.block_tokens,
            self.origins_at(mask),
            self.groups_at(mask),
        )

    def only(self, model: str) -> Workload:
        """One model's requests, as a one-model workload."""
        return self.restrict([model])

    def restrict(self, models: Sequence[str]) -> Workload:
        """The requests of ``models`` alone, as a workload of those models (in that order)."""
        new_index = np.full(len(self.models), -1, dtype=np.int32)
        for j, m in enumerate(models):
            new_index[self.models.index(m)] = j
        mapped = new_index[self.model_index]
        mask = mapped >= 0
        return Workload(
            self.timestamps[mask],
            mapped[mask],
            self.prompt_tokens[mask],
            self.output_tokens[mask],
            list(models),
            self._hashes_of(mask),
            self.block_tokens,
            self.origins_at(mask),
            self.groups_at(mask),
        )

    def head(self, seconds: float) -> Workload:
        """Requests arriving before ``seconds``."""
        return self.select(self.timestamps < seconds)

    @classmethod
    def from_rows(cls, rows: Iterable[WorkloadRequest], models: Sequence[str] = ()) -> Workload:
        rows = list(rows)
        names = list(models)
        index = {m: i for i, m in enumerate(names)}
        for r in rows:
            if r.model not in index:
                index[r.model] = len(names)
                names.append(r.model)
        sizes = {r.block_tokens for r in rows if r.block_hashes}
        if len(sizes) > 1:
            raise WorkloadError(
                f"requests hash blocks of different sizes {sorted(sizes)}: one size per workload"
            )
        return cls(
            np.array([r.timestamp for r in rows], dtype=np.float64),
            np.array([index[r.model] for r in rows], dtype=np.int32),
            np.array([r.prompt_tokens for r in rows], dtype=np.int64),
            np.array([r.output_tokens for r in rows], dtype=np.int64),
            names,
            [r.block_hashes for r in rows] if sizes else None,
            sizes.pop() if sizes else 0,
            [r.origin for r in rows] if any(r.origin != NO_ORIGIN for r in rows) else None,
        )


def check_origin(tenant: object, priority: object, where: str) -> None:
    """A WorkloadError naming ``where`` unless ``tenant`` and ``priority`` are valid."""
    if not isinstance(tenant, str) or len(tenant) > 64:
        raise WorkloadError(f"{where}: tenant must be a string of at most 64 characters, got {tenant!r}")
    if priority not in PRIORITIES:
        raise WorkloadError(f"{where}: priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")


def write_jsonl(workload: Workload, path: str | Path) -> None:
    """Write ``workload`` in arrival order (timestamps rounded to microseconds)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in workload.rows():
            hashes = (
                f', "block_hashes": [{", ".join(map(str, r.block_hashes))}], "block_tokens": {r.block_tokens}'
                if r.block_hashes
                else ""
            )
            who = (f', "tenant": {json.dumps(r.tenant)}' if r.tenant else "") + (
                f', "priority": "{r.priority}"' if r.priority != NO_ORIGIN[1] else ""
            )
            f.write(
                f'{{"timestamp": {round(r.timestamp, 6)}, "model": {json.dumps(r.model)}, '
                f'"prompt_tokens": {r.prompt_tokens}, "output_tokens": {r.output_tokens}{hashes}{who}}}\n'
            )


def read_jsonl(path: str | Path, models: Sequence[str] = ()) -> Workload:
    """Read a workload file. ``models`` adds model names that may have no request in the file."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rows.append(_parse(line, f"{path}:{lineno}"))
    return Workload.from_rows(rows, models)


def _parse(line: str, where: str) -> WorkloadRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected an object")
    keys = set(obj) - set(ORIGIN_FIELDS)
    if keys != set(FIELDS) and keys != set(FIELDS + HASH_FIELDS):
        missing = sorted(set(FIELDS) - keys) + sorted(
            set(HASH_FIELDS) - keys if keys & set(HASH_FIELDS) else ()
        )
        extra = sorted(keys - set(FIELDS + HASH_FIELDS))
        raise WorkloadError(f"{where}: missing keys {missing}, unknown keys {extra}")
    who = (obj.get("tenant", ""), obj.get("priority", NO_ORIGIN[1]))
    check_origin(*who, where)
    t, model, p, o = (obj[k] for k in FIELDS)
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise WorkloadError(f"{where}: timestamp must be a finite number >= 0, got {t!r}")
    if not isinstance(model, str) or not model:
        raise WorkloadError(f"{where}: model must be a non-empty string")
    for name, v in (("prompt_tokens", p), ("output_tokens", o)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise WorkloadError(f"{where}: {name} must be an integer >= 1, got {v!r}")
    if "block_hashes" not in obj:
        return WorkloadRequest(float(t), model, p, o, (), 0, *who)
    return WorkloadRequest(
        float(t), model, p, o, *parse_hashes(obj["block_hashes"], obj["block_tokens"], where), *who
    )


def parse_hashes(hashes: object, block_tokens: object, where: str) -> tuple[tuple[int, ...], int]:
    """``block_hashes`` (a list of integers) and ``block_tokens`` (>= 1) as read from a JSON line;
    a WorkloadError naming ``where`` if they are not."""
    if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens < 1:
        raise WorkloadError(f"{where}: block_tokens must be an integer >= 1, got {block_tokens!r}")
    if not isinstance(hashes, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hashes
    ):
        raise WorkloadError(f"{where}: block_hashes must be a list of integers")
    return tuple(hashes), block_tokens
