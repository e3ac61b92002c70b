"""Engine steps as they ran, for fitting the simulator's step-time profile to live runs.

A worker started with ``PRISM_STEP_TRACE=DIR`` in its environment appends one JSON line per engine
step to ``DIR/<worker id>.jsonl`` (``/`` in the id becomes ``_``): the model, the step's start
(``time.time()``), its wall seconds, the CPU seconds of the stepping thread, and its batch as
``[new tokens, cached tokens before them, samples]`` per scheduled request (the simulator's view of
a step, sim/engine.py). On a device of one
core the CPU seconds are what the step costs alone; wall seconds above them are time the core gave
to other processes. ``benchmarks/fit_cpu_profile.py --trace DIR`` fits a profile to these steps.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

__all__ = ["ENV_VAR", "StepRecord", "StepTrace", "read_step_traces"]

ENV_VAR = "PRISM_STEP_TRACE"


class StepRecord(msgspec.Struct, array_like=False):
    model: str
    t: float  # wall clock (time.time()) at the step's start
    dt: float  # wall seconds
    cpu: float  # CPU seconds of the thread that stepped
    batch: list[tuple[int, int, bool]]  # (new tokens, cached tokens before them, samples) per request


class StepTrace:
    """Appends StepRecords to one file; opened only when the environment asks for a trace."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab", buffering=1 << 16)
        self._encoder = msgspec.json.Encoder()

    @classmethod
    def from_env(cls, name: str) -> StepTrace | None:
        where = os.environ.get(ENV_VAR)
        return cls(Path(where) / f"{name.replace('/', '_')}.jsonl") if where else None

    def write(self, record: StepRecord) -> None:
        self._file.write(self._encoder.encode(record) + b"\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_step_traces(paths: Iterable[Path]) -> Iterator[StepRecord]:
    """Every record of the given files, or of every ``*.jsonl`` under the given directories."""
    decoder = msgspec.json.Decoder(StepRecord)
    for p in paths:
        files = sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
        for f in files:
            with f.open("rb") as fh:
                for line in fh:
                    if line.strip():
                        yield decoder.decode(line)
