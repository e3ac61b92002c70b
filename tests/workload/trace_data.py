"""The traces the tests read: the full copies when this machine has them, else the excerpts
committed in tests/data/traces (see its README.md), with what each set is known to contain."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prism_serve.workload.traces import default_traces_dir

EXCERPTS_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"


@dataclass(frozen=True, slots=True)
class TraceSet:
    root: Path
    full: bool
    azure_requests: tuple[int, int]  # (code, conv), from the set's README
    azure_span_s: tuple[tuple[float, float], tuple[float, float]]  # first to last arrival, bounds
    min_sharegpt_rows: int
    mooncake_requests: int


FULL = dict(
    azure_requests=(8819, 19366),
    azure_span_s=((55 * 60, 60 * 60),) * 2,
    min_sharegpt_rows=30000,
    mooncake_requests=3993,
)
EXCERPTS = dict(
    azure_requests=(200, 200),
    azure_span_s=((199.0, 199.2), (61.2, 61.4)),
    min_sharegpt_rows=200,
    mooncake_requests=200,
)


def find_traces() -> TraceSet:
    root = default_traces_dir()
    if root.exists():
        return TraceSet(root, True, **FULL)
    return TraceSet(EXCERPTS_DIR, False, **EXCERPTS)
