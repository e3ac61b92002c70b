"""A lower bound on the devices any placement policy needs for a workload (``prism sim --find-gpus``).

The bound is the largest of three counts; each is a floor on devices under the assumptions stated
with it, so a policy's GPUs-needed divided by the bound says how far it is from the best possible.

**Memory.** Cut the run into windows of ``memory_window_s`` by arrival time (``[k W, (k+1) W)``,
``W = memory_window_s``, timestamps in seconds from 0). A model with at least one arrival in a window
needs its weights plus the KV of its largest request of the window (``kv_bytes_per_token * (prompt +
output - 1)``: the last sampled token is never fed; a model whose sliding-window layers sit beside
full-context ones, as Gemma's, holds at least the window's tokens in those: ``KVGroups.kv_split``);
the window needs the sum over those models, and the memory count is ``ceil(max over windows of that
sum / hw.capacity_bytes)`` (devices are bins of ``capacity_bytes``; packing whole models into them
needs at least as many).
Assumption that makes it a bound: every model with a request in a window is resident, with room for
its largest request of the window, at one common instant of the window. A policy breaks it only by
taking turns inside a window: serving one model, evicting it and loading another in its place, which
puts an activation (0.2 s plus the weight copy: 0.7 s for an 8B model on h100) into the latency of
the requests that wait for it, once per turn. Windows shorter than an activation leave little room
for such turns; at the default 10 s the assumption is about policies that meet TTFT SLOs of a second or
two (a few turns per window at most), not a theorem, and a policy that takes turns faster could
need fewer devices than the memory count. Pages, claims and the KV of concurrent requests only add,
so they are left out.

**Compute.** Per model and window, the largest of three device-second floors of the requests of that
model arriving in the window (a TP model's device-seconds are ``tp`` times one rank's), summed over
the models; the compute count is ``ceil(max over windows of compute_s / compute_window_s)``.

- *FLOPs* (``RooflineCostModel.request_floor``): each request's FLOPs at the compute rates (its prompt
  once, ``output - 1`` decodes, the attention pairs of that schedule), summed. A prefill step reads
  the weights too, but prefills batch, so prompts count only their FLOPs. With prompt block hashes
  (``prefix_block_size``), a request's prompt counts less the tokens an unbounded prefix cache of its
  model, filled in arrival order, would hold (``workload.prefix.infinite_cache_hits``): no engine's
  cache holds more (this assumes a request never reuses the prefix of one arriving after it).
- *Weight reads of decoding, given the SLOs* (``slos``): a request of ``O`` output tokens samples
  them in ``O`` distinct steps of its model's engine (a step samples at most one token per request)
  and every step reads the model's weights at least once (``w``: the weight stream time, the floor
  of one step). All ``O`` steps fall in the request's feasible interval ``[a, a + ttft + (O - 1) *
  tpot]`` (arrival; first token by the TTFT SLO, last by the TPOT SLO, which the simulator measures
  as ``(finish - first token) / (O - 1)``), so requests whose intervals are pairwise disjoint never
  share a step: the model needs ``w`` times the largest sum of ``O`` over a set of pairwise-disjoint
  feasible intervals (weighted interval scheduling, O(n log n)). Requests spaced far apart add up
  (sum of ``O``); requests arriving together may share every step (the largest ``O``). This is
  what limits a many-model workload: most models have a few requests at a time, and colocated
  engines time-share a device (sim/hardware.py ``share_slowdown`` is at least processor sharing),
  so their weight reads add up.
- *Weight reads with perfect batching*: each sampled token carries ``1 / max_num_seqs`` of a read.
  Larger than the SLO term only for a model with more than a few concurrent requests; the only
  weight-read term when no SLOs are given.

A step costs at least both its FLOPs and its weight read (the GPU roofline is their max, the CPU
form their sum), so the max of the three is a floor. With SLOs the count is a bound for a policy
that serves **every** request within both its SLOs (the scaled ones the simulation uses); a target of
99% attainment lets a policy drop the costliest 1% (and the default ``--find-gpus`` metric, TTFT
attainment, does not check TPOT at all), so a policy can come in under the figure, which is the
bound for serving every request in SLO. Assumption: the work of requests arriving in a window is done
within a window's length. Strictly it may spill into the next window (its requests arrived before
that window ended, but may still be decoding), so a burst at a window's end is spread over up to
the window plus the longest request's latency; with 60 s windows and latencies of seconds that is a
small fraction of the window, but not zero. Compute sharing only slows steps, preemption only adds
recomputation, so neither lowers the floor.

**Tensor parallelism.** A model of ``tp_size`` ranks needs that many devices: the count is the
largest ``tp_size`` among models with requests.

``devices`` is the largest of the three, and at least 1. Everything here comes from the simulator's
cost model and hardware profile, so the bound is as synthetic as the simulation it is compared with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from prism_serve.engine.kv_cache import KVGroups
from prism_serve.sim.config import ModelSLO
from prism_serve.sim.cost import RooflineCostModel
from prism_serve.sim.errors import SimConfigError
from prism_serve.sim.hardware import HardwareProfile
from prism_serve.sim.models import ServedModel
from prism_serve.workload.format import Workload
from prism_serve.workload.prefix import infinite_cache_hits

__all__ = ["DeviceBound", "lower_bound"]


@dataclass(slots=True, frozen=True)
class DeviceBound:
    """The bound and its three parts, with the windows where the memory and compute parts peak."""

    devices: int
    memory_devices: int
    compute_devices: int
    tp_devices: int
    memory_peak_bytes: int  # the fullest memory window's bytes
    memory_peak_start_s: float  # start of that window (arrival time, s)
    compute_peak_s: float  # device-seconds of the busiest compute window
    compute_peak_start_s: float
    memory_window_s: float
    compute_window_s: float

    def as_dict(self) -> dict:
        return asdict(self)

    def ratio(self, devices: int | None) -> float | None:
        """``devices`` over the bound; None when the policy found no answer."""
        return None if devices is None else devices / self.devices


def lower_bound(
    models: list[ServedModel],
    workload: Workload,
    hw: HardwareProfile,
    cost: RooflineCostModel,
    *,
    max_num_seqs: int,
    slos: Mapping[str, ModelSLO] | None = None,
    memory_window_s: float = 10.0,
    compute_window_s: float = 60.0,
    prefix_block_size: int | None = None,
) -> DeviceBound:
    """The devices any policy needs for ``workload`` on ``hw`` (module docstring for the definition).

    ``slos`` are the SLOs the simulation runs with (already scaled, as sweep.run_point passes them to
    simulate); with them the compute part counts the weight reads that requests too far apart in time
    to share a step need, and is a bound for policies that meet every request's SLOs. Without them
    the compute part assumes perfect batching (``max_num_seqs`` tokens per weight read).
    ``prefix_block_size``: the engines' block size where they cache prefixes (None: they do not)."""
    for name, value in (("memory_window_s", memory_window_s), ("compute_window_s", compute_window_s)):
        if not (value > 0 and math.isfinite(value)):
            raise SimConfigError(f"{name} must be a positive number, got {value}")
    if max_num_seqs < 1:
        raise SimConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    by_name = {m.name: m for m in models}
    used = np.unique(workload.model_index) if len(workload) else np.array([], dtype=np.int32)
    missing = [workload.models[i] for i in used if workload.models[i] not in by_name]
    if missing:
        raise SimConfigError(f"workload addresses models not served: {', '.join(missing[:5])}")
    served = [by_name[workload.models[i]] for i in used]
    if slos is not None:
        unknown = [m.name for m in served if m.name not in slos]
        if unknown:
            raise SimConfigError(f"no SLOs for models with requests: {', '.join(unknown[:5])}")
    if not served:
        return DeviceBound(1, 0, 0, 0, 0, 0.0, 0.0, 0.0, memory_window_s, compute_window_s)

    ts, idx = workload.timestamps, workload.model_index
    prompt, output = workload.prompt_tokens, workload.output_tokens
    cached = (
        infinite_cache_hits(workload, prefix_block_size)
        if prefix_block_size is not None
        else np.zeros(len(workload), dtype=np.int64)
    )
    # column j of the per-window tables is served[j]
    col = np.full(len(workload.models), -1, dtype=np.int64)
    col[used] = np.arange(len(used))
    j = col[idx]

    # memory: per (window, model) the largest request; a model with none there contributes nothing
    mw = (ts // memory_window_s).astype(np.int64)
    largest = np.zeros((int(mw.max()) + 1, len(served)), dtype=np.int64)
    np.maximum.at(largest, (mw, j), prompt + output - 1)
    weights = np.array([m.spec.weight_bytes for m in served], dtype=np.float64)
    # (full-context bytes per token, (window, windowed bytes per token)): a query reads at least the
    # window's tokens of the windowed layers (chunk 1, no block rounding)
    splits = [KVGroups.of(m.spec.config).kv_split(m.spec.engine_kv_bytes_per_token, 1, 0) for m in served]
    kv = np.array([full for full, _ in splits], dtype=np.float64)
    window = np.array([w[0] if w else 0 for _, w in splits], dtype=np.int64)
    kv_window = np.array([w[1] if w else 0 for _, w in splits], dtype=np.float64)
    held = largest * kv + np.minimum(largest, window) * kv_window
    mem_bytes = ((largest > 0) * weights + held).sum(axis=1)
    mem_peak = int(np.argmax(mem_bytes))
    memory_devices = _ceil(mem_bytes[mem_peak] / hw.capacity_bytes)

    # compute: per (window, model) the three floors, then max per model
    cw = (ts // compute_window_s).astype(np.int64)
    flops = np.zeros((int(cw.max()) + 1, len(served)))
    batched = np.zeros_like(flops)
    serial = np.zeros_like(flops)
    for k, m in enumerate(served):
        mine = np.flatnonzero(j == k)
        p, o = prompt[mine], output[mine]
        f, r = cost.request_floor(m.spec, m.tp_size, p, o, max_num_seqs, cached[mine])
        np.add.at(flops, (cw[mine], k), f)
        np.add.at(batched, (cw[mine], k), r)
        if slos is not None:
            # a request's weight reads when it shares no step: one read per sampled token
            alone = cost.request_floor(m.spec, m.tp_size, p, o, 1)[1]
            slo = slos[m.name]
            start = ts[mine]
            end = start + slo.ttft_s + np.maximum(o - 1, 0) * slo.tpot_s
            # mine is in arrival order, so each window's requests are one contiguous run
            windows, first = np.unique(cw[mine], return_index=True)
            for c, lo, hi in zip(windows, first, [*first[1:], len(mine)], strict=True):
                serial[c, k] = _disjoint_weight(start[lo:hi], end[lo:hi], alone[lo:hi])
    compute_s = np.maximum(np.maximum(flops, batched), serial).sum(axis=1)
    compute_peak = int(np.argmax(compute_s))
    compute_devices = _ceil(compute_s[compute_peak] / compute_window_s)

    tp_devices = max(m.tp_size for m in served)
    return DeviceBound(
        devices=max(1, memory_devices, compute_devices, tp_devices),
        memory_devices=memory_devices,
        compute_devices=compute_devices,
        tp_devices=tp_devices,
        memory_peak_bytes=int(mem_bytes[mem_peak]),
        memory_peak_start_s=float(mem_peak * memory_window_s),
        compute_peak_s=float(compute_s[compute_peak]),
        compute_peak_start_s=float(compute_peak * compute_window_s),
        memory_window_s=memory_window_s,
        compute_window_s=compute_window_s,
    )


def _disjoint_weight(start: np.ndarray, end: np.ndarray, weight: np.ndarray) -> float:
    """The largest total weight of intervals ``[start, end]`` that are pairwise disjoint (touching
    ends count as disjoint: a step has a positive length, so it cannot lie inside both), by weighted
    interval scheduling: by end, each interval either joins the best set of those ending by its start
    or is left out."""
    order = np.argsort(end, kind="stable")
    s, e, w = start[order], end[order], weight[order]
    # before[i]: how many intervals (in end order) end at or before interval i starts
    before = np.minimum(np.searchsorted(e, s, side="right"), np.arange(len(e)))
    best = [0.0] * (len(e) + 1)
    for i in range(len(e)):
        best[i + 1] = max(best[i], w[i] + best[before[i]])
    return best[-1]


def _ceil(x: float) -> int:
    # a sum of floats a hair above an integer must not add a device to a lower bound
    return math.ceil(x * (1 - 1e-12))
