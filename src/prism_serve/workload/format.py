"""The workload file: one JSON object per line, the one format `prism sim` and `prism bench` both read.

Each line is a request::

    {"timestamp": 12.503125, "model": "llama-3.2-1b-07", "prompt_tokens": 812, "output_tokens": 95}

- ``timestamp``: arrival time in seconds from the start of the workload (>= 0, finite);
- ``model``: the name the request is addressed to (any non-empty string);
- ``prompt_tokens`` (>= 1) and ``output_tokens`` (>= 1): lengths in tokens.

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

__all__ = ["FIELDS", "Workload", "WorkloadError", "WorkloadRequest", "read_jsonl", "write_jsonl"]

FIELDS = ("timestamp", "model", "prompt_tokens", "output_tokens")


class WorkloadError(PrismError, ValueError):
    """A workload file or a workload specification is invalid."""


@dataclass(slots=True, frozen=True)
class WorkloadRequest:
    timestamp: float
    model: str
    prompt_tokens: int
    output_tokens: int


class Workload:
    """Requests as parallel columns, sorted by arrival time.

    ``models`` lists every model name the workload serves, including models that get no request
    (a model idle for the whole run still occupies memory under some policies); ``model_index[i]``
    indexes it.
    """

    __slots__ = ("model_index", "models", "output_tokens", "prompt_tokens", "timestamps")

    def __init__(
        self,
        timestamps: np.ndarray,
        model_index: np.ndarray,
        prompt_tokens: np.ndarray,
        output_tokens: np.ndarray,
        models: Sequence[str],
    ) -> None:
        n = len(timestamps)
        if not (len(model_index) == len(prompt_tokens) == len(output_tokens) == n):
            raise WorkloadError("workload columns differ in length")
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

    def __len__(self) -> int:
        return len(self.timestamps)

    def __repr__(self) -> str:
        return f"Workload({len(self)} requests, {len(self.models)} models, {self.duration:.0f} s)"

    @property
    def duration(self) -> float:
        return float(self.timestamps[-1]) if len(self) else 0.0

    def rows(self) -> Iterator[WorkloadRequest]:
        names = self.models
        for t, m, p, o in zip(
            self.timestamps.tolist(),
            self.model_index.tolist(),
            self.prompt_tokens.tolist(),
            self.output_tokens.tolist(),
            strict=True,
        ):
            yield WorkloadRequest(t, names[m], p, o)

    def select(self, mask: np.ndarray) -> Workload:
        """The requests where ``mask`` is true (the model list is kept whole)."""
        return Workload(
            self.timestamps[mask],
            self.model_index[mask],
            self.prompt_tokens[mask],
            self.output_tokens[mask],
            self.models,
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
        return cls(
            np.array([r.timestamp for r in rows], dtype=np.float64),
            np.array([index[r.model] for r in rows], dtype=np.int32),
            np.array([r.prompt_tokens for r in rows], dtype=np.int64),
            np.array([r.output_tokens for r in rows], dtype=np.int64),
            names,
        )


def write_jsonl(workload: Workload, path: str | Path) -> None:
    """Write ``workload`` in arrival order (timestamps rounded to microseconds)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in workload.rows():
            f.write(
                f'{{"timestamp": {round(r.timestamp, 6)}, "model": {json.dumps(r.model)}, '
                f'"prompt_tokens": {r.prompt_tokens}, "output_tokens": {r.output_tokens}}}\n'
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
    if set(obj) != set(FIELDS):
        missing = sorted(set(FIELDS) - set(obj))
        extra = sorted(set(obj) - set(FIELDS))
        raise WorkloadError(f"{where}: missing keys {missing}, unknown keys {extra}")
    t, model, p, o = (obj[k] for k in FIELDS)
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise WorkloadError(f"{where}: timestamp must be a finite number >= 0, got {t!r}")
    if not isinstance(model, str) or not model:
        raise WorkloadError(f"{where}: model must be a non-empty string")
    for name, v in (("prompt_tokens", p), ("output_tokens", o)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise WorkloadError(f"{where}: {name} must be an integer >= 1, got {v!r}")
    return WorkloadRequest(float(t), model, p, o)
