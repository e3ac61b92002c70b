"""A user's own traffic as a workload: what ``prism plan`` plans for.

Three formats, told apart by the file (``format="auto"``) or named:

- ``log``: the request log ``prism serve --request-log`` writes (api/request_log.py), one JSON
  object per finished request. Its arrival times are wall-clock seconds; the prompt and output
  lengths are what the server counted. A request the server answered with an error after reading
  it (429, 503, 504: overload, no activation in time) is still demand: its output length is its
  ``max_tokens``, or the model's median output when it had none. A request refused as invalid
  (other statuses) or without a prompt length is not traffic and is left out (counted). A line's
  ``tenant`` and ``priority`` become the request's (workload/format.py), and a line of the batch
  lane (``"lane": "batch"``) is a ``batch`` request: the simulation runs it on what the other
  classes leave, and the plan's attainment judges the others (counted). A line's
  ``block_hashes`` (the hashes of its prompt's full blocks) become the request's block hashes, so the
  simulated engines cache the prefixes the requests share.
- ``jsonl``: the simulator's workload file (workload/format.py), block hashes, tenants and
  priorities included.
- ``csv``: a table with a header, one row per request: arrival time, model, input tokens and output
  tokens under the column names ``CsvColumns`` gives (a gateway's or billing export, as it is).
  Times are seconds (any origin) or ISO-8601 date-times.

Then, in this order: ``map`` renames models (several old names onto one merges them), the window
(``start_s`` after the first arrival, ``duration_s`` long) is cut, and ``rate_scale`` compresses
time (2: the same requests twice as fast). Times are made relative to the window's start.

Bad input never gives a traceback: a malformed line or row is a ``TrafficError`` naming the file
and the line (with ``skip_bad`` it is counted and skipped), a model the deployment does not serve
is named (with ``ignore_unknown`` its requests are dropped and counted), and an empty result says
why.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from prism_serve.workload.format import (
    FIELDS,
    HASH_FIELDS,
    NO_ORIGIN,
    ORIGIN_FIELDS,
    Workload,
    WorkloadError,
    check_origin,
    parse_hashes,
)

__all__ = ["CsvColumns", "Traffic", "TrafficError", "TrafficOptions", "read_traffic"]

FORMATS = ("auto", "log", "jsonl", "csv")
_RETRIED_STATUSES = {429, 503, 504}  # read, then refused for load: demand all the same


class TrafficError(WorkloadError):
    """The traffic cannot be read or selected (the message names the file and line)."""


@dataclass(slots=True, frozen=True)
class CsvColumns:
    time: str = "timestamp"
    model: str = "model"
    input_tokens: str = "input_tokens"
    output_tokens: str = "output_tokens"


@dataclass(slots=True, frozen=True)
class TrafficOptions:
    format: str = "auto"
    columns: CsvColumns = field(default_factory=CsvColumns)
    start_s: float = 0.0  # the window starts this long after the first arrival
    duration_s: float | None = None  # None: to the end
    rate_scale: float = 1.0
    map: Mapping[str, str] = field(default_factory=dict)  # old name -> new name (merges)
    skip_bad: bool = False
    ignore_unknown: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise TrafficError(f"unknown traffic format {self.format!r}; one of {', '.join(FORMATS)}")
        if not (self.rate_scale > 0 and math.isfinite(self.rate_scale)):
            raise TrafficError(f"rate scale must be a positive number, got {self.rate_scale}")
        if self.start_s < 0 or (self.duration_s is not None and not self.duration_s > 0):
            raise TrafficError("the window needs start >= 0 and duration > 0")


@dataclass(slots=True)
class Traffic:
    workload: Workload
    source: str
    format: str
    span_s: float  # the window's length (time-scaled)
    skipped_bad: int = 0  # malformed lines skipped (skip_bad)
    dropped_unknown: Counter = field(default_factory=Counter)  # requests of models not served
    dropped_invalid: int = 0  # log lines of requests refused as invalid, not traffic
    batch: int = 0  # requests of the batch class (batch-lane log lines among them): run, not judged


@dataclass(slots=True)
class _Row:
    time: float
    model: str
    prompt: int
    output: int | None  # None: fill in from the model's other requests (a failed log line)
    hashes: tuple[int, ...] = ()  # its prompt's block hashes, of blocks of block_tokens tokens
    block_tokens: int = 0
    origin: tuple[str, str] = NO_ORIGIN  # (tenant, priority)
    group: int = -1  # an embed or score line's inputs share one (Workload.groups); -1: alone


def read_traffic(
    path: str | Path, served: Sequence[str] | None, options: TrafficOptions | None = None
) -> Traffic:
    """``path``'s requests for the models ``served`` (every one is in the workload, with requests
    or without), as the options select them; ``served=None``: every model the window names, in the
    order of their first request."""
    opts = options or TrafficOptions()
    path = Path(path)
    if not path.is_file():
        raise TrafficError(f"{path}: no such traffic file")
    fmt = _detect(path) if opts.format == "auto" else opts.format
    bad: list[str] = []

    def fail(line: int, why: str) -> None:
        if not opts.skip_bad:
            raise TrafficError(f"{path}:{line}: {why} (--skip-bad skips such lines)")
        bad.append(why)

    invalid = 0
    if fmt == "csv":
        rows = list(_csv_rows(path, opts.columns, fail))
    else:
        rows = []
        for line, obj in _json_lines(path, fail):
            try:
                got = _log_rows(obj, line) if fmt == "log" else [_jsonl_row(obj)]
            except (KeyError, TypeError, ValueError) as e:
                fail(line, f"not a {fmt} record: {e}")
                continue
            if not got:
                invalid += 1
            rows.extend(got)
    for r in rows:
        r.model = opts.map.get(r.model, r.model)
    _fill_outputs(rows)
    if not rows:
        raise TrafficError(f"{path}: no requests in the file ({fmt})")
    t0 = min(r.time for r in rows) + opts.start_s
    end = math.inf if opts.duration_s is None else t0 + opts.duration_s
    window = [r for r in rows if t0 <= r.time < end]
    if not window:
        last = max(r.time for r in rows) - min(r.time for r in rows)
        raise TrafficError(
            f"{path}: no request in the window (start {opts.start_s} s, duration {opts.duration_s} s); "
            f"the traffic spans {last:.1f} s"
        )
    if served is None:
        served = list(dict.fromkeys(r.model for r in window))
    known = set(served)
    unknown = Counter(r.model for r in window if r.model not in known)
    if unknown and not opts.ignore_unknown:
        names = ", ".join(f"{m} ({n} requests)" for m, n in unknown.most_common(5))
        raise TrafficError(
            f"{path}: the traffic names models the deployment does not serve: {names}"
            f"{' and more' if len(unknown) > 5 else ''} (--map old=new renames, --ignore-unknown drops them)"
        )
    window = [r for r in window if r.model in known]
    if not window:
        raise TrafficError(f"{path}: no request in the window is for a model the deployment serves")
    index = {m: i for i, m in enumerate(served)}
    span = (opts.duration_s or (max(r.time for r in window) - t0)) / opts.rate_scale
    sizes = {r.block_tokens for r in window if r.hashes}
    if len(sizes) > 1:
        raise TrafficError(f"{path}: prompt block hashes of different block sizes {sorted(sizes)}")
    workload = Workload(
        np.array([(r.time - t0) / opts.rate_scale for r in window]),
        np.array([index[r.model] for r in window]),
        np.array([r.prompt for r in window]),
        np.array([r.output for r in window]),
        list(served),
        [r.hashes for r in window] if sizes else None,
        sizes.pop() if sizes else 0,
        [r.origin for r in window] if any(r.origin != NO_ORIGIN for r in window) else None,
        [r.group for r in window] if any(r.group >= 0 for r in window) else None,
    )
    batch = sum(r.origin[1] == "batch" for r in window)
    return Traffic(workload, str(path), fmt, span, len(bad), unknown, invalid, batch)


# ---- formats -------------------------------------------------------------------------------------


def _detect(path: Path) -> str:
    if path.suffix.lower() == ".csv":
        return "csv"
    with path.open(errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise TrafficError(
                        f"{path}: neither JSON lines nor .csv; name the format (--traffic-format)"
                    ) from None
                return "log" if isinstance(obj, dict) and "arrival" in obj else "jsonl"
    raise TrafficError(f"{path}: the file is empty")


def _json_lines(path: Path, fail) -> Iterator[tuple[int, Any]]:
    with path.open(errors="replace") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except ValueError as e:
                fail(line, f"not JSON ({e})")


def _number(value: Any, what: str, minimum: float = 0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value!r}")
    return float(value)


def _jsonl_row(obj: Any) -> _Row:
    keys = set(obj) - set(ORIGIN_FIELDS) if isinstance(obj, dict) else None
    if keys not in (set(FIELDS), set(FIELDS + HASH_FIELDS)):
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(
            f"expected the keys {', '.join(FIELDS)} (and {' and '.join(HASH_FIELDS)}; "
            f"{' and '.join(ORIGIN_FIELDS)} optional), got {keys}"
        )
    return _Row(
        _number(obj["timestamp"], "timestamp"),
        _model(obj["model"]),
        int(_number(obj["prompt_tokens"], "prompt_tokens", 1)),
        int(_number(obj["output_tokens"], "output_tokens", 1)),
        *_hashes(obj),
        _origin(obj.get("tenant") or "", obj.get("priority") or NO_ORIGIN[1]),
    )


def _origin(tenant: object, priority: object) -> tuple[str, str]:
    try:
        check_origin(tenant, priority, "the line")
    except WorkloadError as e:
        raise ValueError(str(e)) from None
    return (tenant, priority)  # type: ignore[return-value]


def _hashes(obj: dict) -> tuple[tuple[int, ...], int]:
    """A line's prompt block hashes and their block size; ((), 0) where it has none."""
    if obj.get("block_hashes") is None:
        return (), 0
    try:
        return parse_hashes(obj["block_hashes"], obj.get("block_tokens"), "block_hashes")
    except WorkloadError as e:
        raise ValueError(str(e)) from None


def _log_rows(obj: Any, line: int = -1) -> list[_Row]:
    """A request log line's requests: ``n`` choices are ``n`` sequences of the engine, each with
    the prompt and its share of the output tokens; an embed or score line's ``n`` inputs are ``n``
    requests of one output token, each with its share of the prompt tokens (their sum), one group
    (``line``: the client waits for all of them, and its SLO judges them together); none for a
    request refused as invalid."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected an object, got {type(obj).__name__}")
    status = int(_number(obj.get("status", 200), "status"))
    prompt = obj.get("prompt_tokens")
    if prompt is None or prompt < 1 or (status != 200 and status not in _RETRIED_STATUSES):
        return []  # refused as invalid, or never tokenized: not traffic
    n = int(_number(obj.get("n") or 1, "n", 1))
    output = obj.get("output_tokens") or 0
    per_choice = None
    if status == 200 and output >= 1:
        per_choice = max(1, round(_number(output, "output_tokens") / n))
    elif obj.get("max_tokens") is not None:  # what it asked for; else like the model's other requests
        per_choice = int(_number(obj["max_tokens"], "max_tokens", 1))
    arrival, model = _number(obj["arrival"], "arrival"), _model(obj["model"])
    prompt = int(_number(prompt, "prompt_tokens", 1))
    group = -1
    if obj.get("task") in ("embed", "score"):  # n inputs, their prompt tokens summed
        prompt, per_choice = max(1, round(prompt / n)), 1
        group = line if n > 1 and line >= 0 else -1
    hashes, block_tokens = _hashes(obj)
    # a batch-lane line runs in the batch class, whatever its tenant's
    priority = "batch" if obj.get("lane") == "batch" else (obj.get("priority") or NO_ORIGIN[1])
    origin = _origin(obj.get("tenant") or "", priority)
    return [_Row(arrival, model, prompt, per_choice, hashes, block_tokens, origin, group) for _ in range(n)]


def _csv_rows(path: Path, columns: CsvColumns, fail) -> Iterable[_Row]:
    with path.open(newline="", errors="replace") as f:
        reader = csv.DictReader(f)
        names = [columns.time, columns.model, columns.input_tokens, columns.output_tokens]
        missing = [c for c in names if c not in (reader.fieldnames or ())]
        if missing:
            raise TrafficError(
                f"{path}: no column {', '.join(repr(c) for c in missing)} in the header "
                f"({', '.join(reader.fieldnames or ())}); name the columns with --time-column, "
                "--model-column, --input-column, --output-column"
            )
        for row in reader:
            line = reader.line_num
            try:
                yield _Row(
                    _time(row[columns.time]),
                    _model(row[columns.model]),
                    int(_number(float(row[columns.input_tokens]), columns.input_tokens, 1)),
                    int(_number(float(row[columns.output_tokens]), columns.output_tokens, 1)),
                )
            except (TypeError, ValueError) as e:
                fail(line, f"bad row: {e}")


def _time(text: str | None) -> float:
    if text is None or not text.strip():
        raise ValueError("no time")
    try:
        return _number(float(text), "time", -math.inf)
    except ValueError:
        stamp = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        return stamp.timestamp()


def _model(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"model must be a non-empty string, got {value!r}")
    return value.strip()


def _fill_outputs(rows: list[_Row]) -> None:
    """Requests without an output length (a failed log line with no ``max_tokens``) get their
    model's median output; with none known, the median over all."""
    if all(r.output is not None for r in rows):
        return
    by_model: dict[str, list[int]] = {}
    for r in rows:
        if r.output is not None:
            by_model.setdefault(r.model, []).append(r.output)
    everything = [o for outs in by_model.values() for o in outs]
    fallback = int(statistics.median(everything)) if everything else 256
    for r in rows:
        if r.output is None:
            outs = by_model.get(r.model)
            r.output = int(statistics.median(outs)) if outs else fallback
