"""The Mooncake trace (``mooncake_synthetic.jsonl``): requests with the hashes of their prompt blocks.

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids":
[...]}``, with one id per 512-token block of the prompt (the last one possibly partial); equal ids
mean equal block contents, so the requests that share a prefix are known. The ids are chained (an
id always follows the same id), as a prefix cache's keys are.

``scale_mooncake`` fits the trace to a small machine without changing who shares what: every
512-token block becomes a ``block_tokens``-token block and every prompt shrinks by the same factor
(rounded up, so it keeps its number of blocks and its ids), timestamps are multiplied by
``time_scale``, and caps cut prompts (with their ids) and outputs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from prism_serve.workload.format import WorkloadError

__all__ = ["MOONCAKE_BLOCK_TOKENS", "MOONCAKE_FILE", "MooncakeTrace", "read_mooncake", "scale_mooncake"]

MOONCAKE_FILE = "mooncake_synthetic.jsonl"
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(slots=True, frozen=True)
class MooncakeTrace:
    arrivals: np.ndarray  # seconds from the first request, ascending
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_ids: tuple[tuple[int, ...], ...]  # per request, one id per block of the prompt
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def duration(self) -> float:
        return float(self.arrivals[-1]) if len(self) else 0.0


def read_mooncake(path: Path) -> MooncakeTrace:
    """The trace file, sorted by arrival (stably), times in seconds from the first request."""
    if not path.exists():
        raise WorkloadError(f"trace file {path} not found (set $PRISM_TRACES or --traces)")
    times, prompt, output, ids = [], [], [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                t, p, o, h = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
                if not (isinstance(p, int) and p >= 1 and isinstance(o, int) and o >= 1):
                    raise ValueError("lengths must be integers >= 1")
                if len(h) != -(-p // MOONCAKE_BLOCK_TOKENS) or not all(isinstance(x, int) for x in h):
                    raise ValueError(f"{len(h)} hash_ids for {p} tokens")
            except (ValueError, KeyError, TypeError) as e:
                raise WorkloadError(f"{path}:{lineno}: not a Mooncake record: {e}") from None
            times.append(float(t) / 1000.0)
            prompt.append(p)
            output.append(o)
            ids.append(tuple(h))
    if not times:
        raise WorkloadError(f"{path}: no requests")
    order = np.argsort(np.array(times), kind="stable")
    t = np.array(times)[order]
    return MooncakeTrace(
        t - t[0],
        np.array(prompt, dtype=np.int64)[order],
        np.array(output, dtype=np.int64)[order],
        tuple(ids[i] for i in order.tolist()),
    )


def scale_mooncake(
    trace: MooncakeTrace,
    *,
    block_tokens: int | None = None,
    time_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> MooncakeTrace:
    """The trace with blocks of ``block_tokens`` (prompts scaled alike, rounded up, so each keeps its
    ids), times times ``time_scale``, and prompts (with their ids) and outputs capped."""
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise WorkloadError(f"time_scale must be a positive number, got {time_scale}")
    bt = trace.block_tokens if block_tokens is None else block_tokens
    if bt < 1:
        raise WorkloadError(f"block_tokens must be >= 1, got {bt}")
    prompt = -(-trace.prompt_tokens * bt // trace.block_tokens)  # ceil: (n - 1) * bt < p' <= n * bt
    if max_prompt_tokens is not None:
        prompt = np.minimum(prompt, max_prompt_tokens)
    output = trace.output_tokens
    if max_output_tokens is not None:
        output = np.minimum(output, max_output_tokens)
    ids = tuple(h[: -(-p // bt)] for h, p in zip(trace.hash_ids, prompt.tolist(), strict=True))
    return replace(
        trace,
        arrivals=trace.arrivals * time_scale,
        prompt_tokens=prompt,
        output_tokens=output,
        hash_ids=ids,
        block_tokens=bt,
    )
