"""A CPU hardware profile fitted to this machine: ``prism fit-hardware`` and ``prism plan --hardware fit``.

The fitted profile prices this project's own engine on ONE core with ONE torch thread, the way a
live CPU device of one core runs (runtime/devices.py). Measured, on the spot:

- real engine steps (``LLMEngine.step``: schedule, model, sampling, postprocess) of SmolLM2-135M
  (fp32, the real weights when the package has them, else a synthetic model of the same shape:
  step times do not depend on weight values): prefills alone, prefill chunks after a cached
  prefix, and decode batches of 1-32 requests at contexts 16-2048. Contexts are *allocated, not
  computed*: a request is given its KV blocks and marked as having computed its prefix, so its next
  step attends over that many cached tokens (KV contents do not change a step's time);
- the weight pass: one thread streaming one row through fp32 weights far larger than the caches,
  with the engine's own linear (``engine/models/llama.py``). Steps of one model cannot separate a
  per-step constant from its weight pass (both are the same seconds in every step), so the pass is
  fixed at this rate and the fit prices a model of another size by its bytes.

Each point is summarized by the minimum of its steps (other processes only ever add time). The fit
is a non-negative least squares on relative error of the cost model's summed CPU form
(sim/cost.py, ``overlap=False``).

**Engines at once** (sim/sharing.py ``with_sharing``, which ``prism fit-hardware`` runs on the fit
unless ``--no-sharing``): one engine's steps cannot show what other engines cost it, so real engines
in their own processes are then timed alone, two on the fit's core, and one there with one on
another core (about 40 s): the profile's ``share_interference`` (two engines on one core take
2 x (1 + it) a step alone) and ``cross_interference`` (an engine slows by 1 + it while another
core steps) are this machine's, from the CPU time per step, which other processes barely change;
the one-row and eight-row decodes' own terms go in ``decode_interference`` (a one-row decode pays
the most).
A host of the registered AVX-512 profile's CPU model measured 0.027-0.057 and 0.000-0.013 on
2026-12-01, where that profile has 0.090 and 0.146.

What the fit does not measure is kept from the base profile (the registered profile of this CPU's
vector class, else ``cpu-smollm2``): the serving path's per-request overhead and its share of the
cores once every device is busy (``serving_share``, measured on live step traces), and the
activation copy. ``benchmarks/fit_cpu_profile.py`` adds held-out points, other shapes and fits to
live step traces.

**The deployment's own shapes** (``fit_this_machine(shapes=...)``, ``prism fit-hardware --shapes``,
and ``prism plan --hardware fit`` with the config's models): one core streams and multiplies the
matrices of another model at other rates than SmolLM2-135M's (on the AVX-512 host Qwen2.5-0.5B's
896/4,864-wide matmuls ran at 136 GFLOP/s against 89, while the larger models' small decodes were
11-20% slower than its weight pass prices them). So each other model (a ``random:<preset>``
source, a GGUF file, an HF directory) gets three training steps of its own, a one-row decode, a
256-token prefill and a long-context decode batch (``SHAPE_TRAIN``), which give its memory, compute
and attention factors on the fitted rates (``shape_factors``; the profile's ``shape_scales``, which
sim/cost.py applies to that shape: the weight pass, the matmuls, and the KV traffic and attention
FLOPs; another head size and grouping runs attention at other rates than SmolLM2-135M's). The
same quick held-out points are then measured on its weights and predicted from its shape at its
factors; they are not fitted to: they say how far the profile is off on the models it will price,
per shape and step kind in the report, and the profile keeps them by shape (``shape_errors``):
``prism plan --confidence`` draws each draw's step error from the fitted model's errors and those
of the shapes its deployment serves.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from prism_serve.sim.hardware import HardwareProfile

__all__ = [
    "FitResult",
    "best_fit",
    "fit_points",
    "fit_this_machine",
    "format_constants",
    "measure_points",
    "predict",
    "profile_from",
    "shape_factors",
    "step_kind",
    "step_parts",
    "step_points",
    "weight_pass_rate",
]

FIT_MODEL = "smollm2-135m"  # the shape every point is measured on (sim/models.py)

# (kind, params, held_out). Decode: (batch, context). Prefill: (new tokens, cached prefix).
# Mixed: (prefill tokens, prefix, decodes, decode context). Ragged: decode contexts.
TRAIN_DECODE = [(b, c) for b in (1, 2, 4, 8, 16, 32) for c in (16, 512, 2048) if b * c <= 32 * 1024]
HELD_DECODE = [(b, c) for b in (3, 6, 12, 24) for c in (128, 1024)] + [(1, 4096), (5, 64), (32, 1024)]
TRAIN_PREFILL = [(p, 0) for p in (1, 4, 16, 64, 256, 512)] + [(512, 512), (512, 2048), (128, 1024)]
HELD_PREFILL = [(p, 0) for p in (2, 8, 32, 128, 384)] + [(512, 1024), (512, 3584), (200, 300)]
HELD_MIXED = [(128, 0, 8, 256), (480, 512, 16, 512), (32, 0, 2, 64), (256, 0, 4, 1024)]
HELD_RAGGED = [(64, 256, 512, 1024), tuple(range(64, 2048 + 1, 128))]
# a few held-out points of each kind: what ``prism fit-hardware`` reports its error on
QUICK_HELD = [
    ("decode", (3, 128)), ("decode", (12, 1024)), ("decode", (5, 64)), ("prefill", (32, 0)),
    ("prefill", (384, 0)), ("prefill", (200, 300)), ("mixed", (128, 0, 8, 256)), ("mixed", (32, 0, 2, 64)),
]  # fmt: skip


# each other shape's own training steps: a one-row decode (almost all weight pass), a 256-token
# prefill (almost all matmul FLOPs) and eight decodes at 1,024 tokens of context (the most attention
# of the three), from which its memory, compute and attention factors are solved
# (HardwareProfile.shape_scales); its quick held-out points then measure the scaled prediction
SHAPE_TRAIN = [("decode", (1, 16)), ("prefill", (256, 0)), ("decode", (8, 1024))]


def step_points(held_out: str = "all") -> list[dict]:
    """The points to measure: the training points and ``held_out`` ones (``all``, ``quick``: a few of
    each kind, or ``none``)."""
    out = [{"kind": "decode", "args": list(r), "held_out": False} for r in TRAIN_DECODE]
    out += [{"kind": "prefill", "args": list(r), "held_out": False} for r in TRAIN_PREFILL]
    if held_out == "all":
        for kind, rows in (("decode", HELD_DECODE), ("prefill", HELD_PREFILL), ("mixed", HELD_MIXED),
                           ("ragged", HELD_RAGGED)):  # fmt: skip
            out += [{"kind": kind, "args": list(r), "held_out": True} for r in rows]
    elif held_out == "quick":
        out += [{"kind": k, "args": list(a), "held_out": True} for k, a in QUICK_HELD]
    elif held_out != "none":
        raise ValueError(f"held_out must be all, quick or none, got {held_out!r}")
    return out


def label(p: dict) -> str:
    a = p["args"]
    if p["kind"] == "decode":
        return f"decode b={a[0]} ctx={a[1]}"
    if p["kind"] == "prefill":
        return f"prefill {a[0]}" + (f" after {a[1]}" if a[1] else "")
    if p["kind"] == "mixed":
        return f"prefill {a[0]}" + (f" after {a[1]}" if a[1] else "") + f" + {a[2]} decodes ctx={a[3]}"
    return f"ragged decode b={len(a)} ctx {min(a)}..{max(a)}"


# -- measurement ------------------------------------------------------------------------------------


def fit_source() -> str:
    """SmolLM2-135M's real weights where the package is installed, else its shape with random weights."""
    from prism_serve.engine.sources import default_gguf_path
    from prism_serve.errors import WeightsNotFoundError

    try:
        default_gguf_path()
    except WeightsNotFoundError:
        return f"random:{FIT_MODEL}"
    return "smollm2-135m-instruct"


class StepBench:
    """One engine of the fitted model, whose steps are timed point by point."""

    def __init__(
        self, reps: int, model: str | None = None, dtype: str = "float32", kv_cache_bytes: int = 4 << 30
    ) -> None:
        from prism_serve.engine.llm_engine import EngineConfig, LLMEngine

        # room for 32 x 2048 and contexts up to 4096 (the default caps at 2048); every point's
        # tokens computed as asked (its repetitions would otherwise find their prompts cached)
        config = EngineConfig(
            model=model or fit_source(), dtype=dtype, max_num_seqs=64, kv_cache_bytes=kv_cache_bytes,
            max_model_len=None, prefix_caching=False,
        )  # fmt: skip
        self.engine = LLMEngine(config)
        self.rng = np.random.default_rng(0)
        self.reps = reps
        # (new tokens, cached tokens before them, samples) per scheduled request, as the simulator
        # sees a step
        self.engine.record_step_batches = True

    def add(self, prompt: int, cached: int, max_tokens: int) -> None:
        from prism_serve.engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine = self.engine
        vocab = min(49152, engine.model_config.vocab_size)
        req = engine.add_request(self.rng.integers(17, vocab, prompt).tolist(), params)
        if cached:
            seq = engine._requests[req]
            if not engine.scheduler._grow(seq, cached):
                raise RuntimeError("KV cache too small for the point")
            seq.num_computed_tokens = cached

    def step(self) -> tuple[float, list]:
        t0 = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - t0, self.engine.last_step_batch

    def measure(self, p: dict) -> list[tuple[float, list]]:
        """(seconds, batch) of each measured step of point ``p`` (``reps`` of them)."""
        kind, a = p["kind"], p["args"]
        out = []
        if kind == "prefill":
            for _ in range(self.reps):
                self.add(a[1] + a[0], a[1], 1)
                out.append(self.step())
                self.engine.abort_all()
        elif kind in ("decode", "ragged"):
            contexts = [a[1]] * a[0] if kind == "decode" else list(a)
            for c in contexts:  # the last prompt token is the first step's decode input
                self.add(c, c - 1, self.reps + 1)
            out = [self.step() for _ in range(self.reps)]
            self.engine.abort_all()
        else:  # mixed: one prefill chunk joins running decodes
            for _ in range(self.reps):
                for _ in range(a[2]):
                    self.add(a[3], a[3] - 1, 4)
                self.step()  # the decodes are now running
                self.add(a[1] + a[0], a[1], 1)
                out.append(self.step())
                self.engine.abort_all()
        return out

    def close(self) -> None:
        self.engine.close()

    @property
    def decode_attention(self) -> str:
        return "kernel" if self.engine.runner.kernels else "sdpa"


def pin_one_core(core: int | None = None) -> int:
    """Run this process on one core (default: the last one it may use) with one torch thread, as a
    live CPU device of one core does. Returns the core."""
    from prism_serve.engine.machine import pin_to_cores

    core = max(os.sched_getaffinity(0)) if core is None else core
    pin_to_cores({core})
    return core


def weight_pass_rate(budget_s: float = 1.0, nbytes: int = 1 << 29) -> float:
    """Bytes/s at which one thread streams one row through ``nbytes`` of fp32 weights (far larger than
    the caches) with the engine's fp32 linear: what a decode step's weight pass reads at."""
    import torch

    from prism_serve.engine.models.llama import Linear

    k = 576  # SmolLM2-135M's hidden size; the weight is [out, in] = [n, k]
    n = nbytes // (4 * k)
    lin = Linear(torch.randn(n, k), None, torch.float32)
    x = torch.randn(1, k)
    for _ in range(2):
        lin(x)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s or count < 3:
        lin(x)
        count += 1
    return n * k * 4 * count / (time.perf_counter() - t0)


def measure_points(
    points: list[dict],
    rounds: int = 1,
    reps: int = 3,
    model: str | None = None,
    between_rounds: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Time every point ``reps`` steps per round, ``rounds`` times (in this process, which should be
    pinned: ``pin_one_core``). Returns the raw measurements: the points with their step times and
    the batch of their first step (as the simulator counts it), the engine's decode attention,
    the date. ``between_rounds(r)`` runs before round r (e.g. a wait for quiet CPUs); ``progress(1)``
    after each point."""
    bench = StepBench(reps, model)
    try:
        bench.measure({"kind": "decode", "args": [4, 64]})  # warm-up
        pts = [dict(p, times=[], batch=None) for p in points]
        for r in range(rounds):
            if between_rounds is not None:
                between_rounds(r)
            for p in pts:
                for t, batch in bench.measure(p):
                    p["times"].append(t)
                    if p["batch"] is None:
                        p["batch"] = batch  # the first step: the smallest context of the point
                if progress is not None:
                    progress(1)
        attention = bench.decode_attention
    finally:
        bench.close()
    return {"date": time.strftime("%Y-%m-%d"), "points": pts, "decode_attention": attention}


# -- fit --------------------------------------------------------------------------------------------


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set; a has few columns)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max() <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def counts(batch: list, pad: bool) -> tuple[int, int, float, float]:
    """(tokens, sampling sequences, attention pairs, KV tokens read) of a step as the simulator
    counts them (sim/engine.py): with ``pad``, decodes padded to the longest context of their
    group, as the engine's gathered SDPA attention groups them (engine/grouping.py); without, each
    decode reads its own context (the paged decode kernel)."""
    from prism_serve.engine.grouping import padded_decode_context

    decodes = [b + 1 for n, b, _ in batch if n == 1]
    padded = padded_decode_context(decodes) if pad else sum(decodes)
    tokens = sum(n for n, _, _ in batch)
    seqs = sum(1 for _, _, s in batch if s)
    pairs = padded + sum(n * (b + (n + 1) / 2) for n, b, _ in batch if n != 1)
    kv_read = padded - len(decodes) + sum(b for n, b, _ in batch if n != 1)
    return tokens, seqs, pairs, kv_read


def features(spec, batch: list, crossover: float, pad: bool) -> np.ndarray:
    """The summed CPU form of sim/cost.py as a linear model in 1/rates (one row per step):
    [1, weight passes, matmul FLOPs, small-batch weight rows, sampled sequences, attention FLOPs,
    KV bytes]. The LM head runs only for sequences that sample, the body for every token; a matmul
    group of more than ``crossover`` rows is taken as packed, else as streamed per row."""
    from prism_serve.sim.cost import split_matmul

    tokens, seqs, pairs, kv_read = counts(batch, pad)
    body_b, body_f, head_b, head_f = split_matmul(spec)
    passes = rows = flops = 0.0
    for m, nbytes, f in ((tokens, body_b, body_f), (seqs, head_b, head_f)):
        if m > crossover:
            passes, flops = passes + nbytes, flops + f * m
        elif m:
            rows += nbytes * m
    return np.array(
        [
            1.0,
            passes,
            flops,
            rows,
            seqs,
            spec.attn_flops_per_pair * pairs,
            spec.kv_bytes_per_token * (kv_read + tokens),
        ]
    )


def profile_from(coef: np.ndarray, base: HardwareProfile, step_seconds: str = "wall") -> HardwareProfile:
    """``base`` with the fitted step constants, fitted to ``step_seconds`` ("wall": steps timed in
    a process of their own, as the measured points are; "cpu": live steps' CPU seconds); its other
    fields (memory, activation, compute sharing) are kept."""
    overhead, inv_b, inv_f, inv_row, per_seq, inv_attn, inv_kv = coef
    big = 1e15  # a coefficient of 0 means that cost is not visible at this machine's noise
    return dataclasses.replace(
        base,
        step_overhead_s=float(overhead),
        mem_bandwidth=1 / inv_b if inv_b > 0 else big,
        peak_flops=1 / inv_f if inv_f > 0 else big,
        row_bandwidth=1 / inv_row if inv_row > 0 else None,  # None: no small-batch regime
        seq_overhead_s=float(per_seq),
        attn_flops=1 / inv_attn if inv_attn > 0 else big,
        kv_bandwidth=1 / inv_kv if inv_kv > 0 else big,
        synthetic=False,
        step_seconds=step_seconds,
    )


def _sources(points: list[dict]) -> list[str]:
    """The sources of the other models among ``points`` (those with a ``shape``), in order."""
    return list(dict.fromkeys(p["shape"] for p in points if p.get("shape") is not None))


PARTS = ("mem_bandwidth", "peak_flops", "kv_bandwidth", "attn_flops")  # step_parts' columns, in order


def step_parts(hw: HardwareProfile, spec, batches: list[list]) -> tuple[np.ndarray, np.ndarray]:
    """How ``hw`` prices each of ``batches`` (steps of ``spec``, its shape factors left out), part by
    part: (fixed seconds per step, [steps x 4] seconds of its weight pass, matmul FLOPs, KV traffic
    and attention FLOPs, the rates of ``PARTS``). The CPU form's step is their sum."""
    from prism_serve.sim.cost import RooflineCostModel

    free = 1e30  # a rate no step notices: that part priced at 0
    # None (attention at the weights' and matmuls' rates) made explicit, so that each part is apart
    hw = dataclasses.replace(
        hw,
        shape_scales=(),
        kv_bandwidth=hw.kv_bandwidth or hw.mem_bandwidth * hw.mem_efficiency,
        attn_flops=hw.attn_flops or hw.peak_flops * hw.flops_efficiency,
    )
    at_fixed, *alone = [
        RooflineCostModel(dataclasses.replace(hw, **{k: free for k in PARTS if k != kept}))
        for kept in (None, *PARTS)
    ]
    fixed = np.array([predict(at_fixed, spec, batch) for batch in batches])
    parts = np.array([[predict(cm, spec, batch) for cm in alone] for batch in batches]).reshape(
        -1, len(PARTS)
    )
    return fixed, parts - fixed[:, None]


# shape_factors' factors as the step_parts columns each scales: weight pass, matmuls, attention
SHAPE_GROUPS = ((0,), (1,), (2, 3))


def shape_factors(
    hw: HardwareProfile,
    spec,
    steps: list[tuple[list, float]],
    groups: tuple[tuple[int, ...], ...] = SHAPE_GROUPS,
) -> tuple[float, ...] | None:
    """(memory, compute, attention factors) that price ``steps`` ((batch, measured seconds) of
    ``spec``) on ``hw`` at the shape's own rates: each step's time apart from its fixed costs is
    a x its weight pass + b x its matmul FLOPs + c x its attention (KV traffic and attention FLOPs)
    as ``hw`` prices them (``step_parts``; the CPU form is a sum); three steps give a, b and c (more:
    least squares). None without three such steps, or where they do not separate the three (a
    factor outside [1/4, 4] is clamped: a step that small in one part cannot tell it).
    ``groups``: other factors, each over the ``step_parts`` columns it names (one per factor)."""
    if len(steps) < len(groups) or hw.overlap:
        return None
    fixed, parts = step_parts(hw, spec, [batch for batch, _ in steps])
    a = np.column_stack([parts[:, list(g)].sum(axis=1) for g in groups])
    b = np.array([seconds for _, seconds in steps]) - fixed
    scale = np.abs(a).max(axis=0)
    if not (scale > 0).all() or np.linalg.matrix_rank(a / scale, tol=1e-6) < len(groups):
        return None
    factors = np.linalg.lstsq(a, b, rcond=None)[0]
    return tuple(float(f) for f in np.clip(factors, 0.25, 4.0))


def predict(cm, spec, batch: list) -> float:
    tokens, seqs, pairs, kv_read = counts(batch, cm.hw.pad_decode_context)
    return cm.step_time(spec, 1, tokens, pairs, kv_read, seqs)


def best_fit(
    spec,
    batches: list,
    y: np.ndarray,
    train: np.ndarray,
    base: HardwareProfile,
    weights: np.ndarray | None = None,
    mem_bandwidth: float | None = None,
) -> tuple[float, np.ndarray, np.ndarray]:
    """(small-batch crossover, coefficients, predictions of every step) of the fit with the lowest
    mean (weighted) relative error on the training steps, the crossover chosen by grid search.

    ``mem_bandwidth`` fixes the weight pass instead of fitting it: every step reads the weights once
    at that rate, whatever its rows (crossover 0.5, so no small-batch regime). Steps of one model
    cannot tell a per-step constant from its weight pass (both are the same seconds in every step),
    and a fit of them may put the whole pass into ``step_overhead_s``, which then prices a model of
    another size as if it had SmolLM2-135M's weights."""
    from prism_serve.sim.cost import RooflineCostModel

    w = np.sqrt(np.ones(len(y)) if weights is None else weights)[train]
    best = None
    grid = [0.5] if mem_bandwidth else np.arange(1.5, 12.6, 1.0)
    for crossover in grid:
        x = np.array([features(spec, b, crossover, base.pad_decode_context) for b in batches])
        # relative error: a 40 ms decode step matters as much as a 3 s prefill
        if mem_bandwidth:
            fixed = x[:, 1] / mem_bandwidth
            free = [0, 2, 3, 4, 5, 6]
            sub = nnls(x[train][:, free] / y[train, None] * w[:, None], (1 - fixed[train] / y[train]) * w)
            coef = np.insert(sub, 1, 1 / mem_bandwidth)
        else:
            coef = nnls(x[train] / y[train, None] * w[:, None], w)
        cm = RooflineCostModel(profile_from(coef, base))
        pred = np.array([predict(cm, spec, b) for b in batches])
        err = np.average(np.abs(pred[train] / y[train] - 1), weights=w**2)
        if best is None or err < best[0]:
            best = (err, crossover, coef, pred)
    return best[1], best[2], best[3]


CONSTANTS = ("step_overhead_s", "mem_bandwidth", "peak_flops", "row_bandwidth", "seq_overhead_s",
             "attn_flops", "kv_bandwidth")  # fmt: skip


def format_constants(hw: HardwareProfile) -> str:
    lines = [f"fitted {hw.name} step constants:"]
    for name in CONSTANTS:
        value = getattr(hw, name)
        lines.append(f"  {name}={value:.3e}," if value is not None else f"  {name}=None,")
    return "\n".join(lines)


def step_kind(batch: list) -> str:
    if all(n == 1 for n, _, _ in batch):
        return "decode"
    return "prefill" if all(n > 1 for n, _, _ in batch) else "mixed"


@dataclass(slots=True, frozen=True)
class FitResult:
    profile: HardwareProfile
    crossover: float
    points: list[dict]  # the raw points, each with "measured_s" and "predicted_s" added
    mem_bandwidth: float | None  # the fixed weight pass, bytes/s (None: fitted)
    notes: tuple[str, ...] = ()  # more lines for the report (sim/sharing.py: what sharing measured)

    def shapes(self) -> list[str]:
        """The sources of the other models measured (points with a ``shape``), in measured order."""
        return _sources(self.points)

    def errors(self, held_out: bool, kind: str | None = None, shape: str | bool | None = True) -> np.ndarray:
        """predicted / measured - 1 of the points ``held_out`` or not (of ``kind``; of ``shape``: a
        source of the other models, None for the fitted model's own, True for every model's)."""
        return np.array(
            [
                p["predicted_s"] / p["measured_s"] - 1
                for p in self.points
                if p["held_out"] == held_out
                and (kind is None or p["kind"] == kind)
                and (shape is True or p.get("shape") == shape)
            ]
        )

    def report(self) -> str:
        lines = [format_constants(self.profile)]
        if self.mem_bandwidth is not None:
            lines.append(f"weight pass fixed at the measured {self.mem_bandwidth / 1e9:.1f} GB/s")
        else:
            lines.append(f"small-batch crossover {self.crossover:g} rows")
        for held in (False, True):
            e = np.abs(self.errors(held, shape=None))
            if len(e):
                lines.append(
                    f"{'held-out' if held else 'training'} points: mean |error| {e.mean():.1%}, max "
                    f"{e.max():.1%} ({len(e)} points)"
                )
        for shape in self.shapes():
            e = self.errors(True, shape=shape)
            # by kind: a shape's compute rate and its weight pass can be off in opposite directions
            # (prefills priced slow, decodes fast), which the mean over its points hides
            kinds = dict.fromkeys(p["kind"] for p in self.points if p.get("shape") == shape and p["held_out"])
            by_kind = ", ".join(f"{k} {self.errors(True, k, shape).mean():+.1%}" for k in kinds)
            lines.append(
                f"held-out points of {shape}: mean |error| {np.abs(e).mean():.1%}, mean {e.mean():+.1%} "
                f"(predicted / measured - 1; {by_kind}), max |error| {np.abs(e).max():.1%} ({len(e)} points)"
            )
        lines += self.notes
        return "\n".join(lines)


def fit_points(
    raw: dict,
    base: HardwareProfile,
    mem_bandwidth: float | None = None,
    quantile: float = 0.0,
    shapes: Mapping[str, object] | None = None,
) -> FitResult:
    """Fit ``raw`` (``measure_points``'s result) on ``base``: its step constants replaced by the fit,
    ``pad_decode_context`` set from the engine's decode attention the points ran with. Points with a
    ``shape`` (a source of ``shapes``, which gives its ModelShape) are other models': their training
    points give that shape's factors (``shape_factors``, the profile's ``shape_scales``), their
    held-out points are predicted from their own shape at them; the fit is on the fitted model's
    training points alone."""
    from prism_serve.sim.cost import RooflineCostModel
    from prism_serve.sim.models import model_shape

    base = dataclasses.replace(base, pad_decode_context=raw.get("decode_attention", "sdpa") == "sdpa")
    spec = model_shape(FIT_MODEL, dtype_bytes=4)
    pts = raw["points"]
    measured = [float(np.quantile(p["times"], quantile)) for p in pts]
    own = [i for i, p in enumerate(pts) if p.get("shape") is None]
    y = np.array([measured[i] for i in own])
    train = np.array([not pts[i]["held_out"] for i in own])
    batches = [pts[i]["batch"] for i in own]
    crossover, coef, _ = best_fit(spec, batches, y, train, base, None, mem_bandwidth)
    hw = profile_from(coef, base)
    # each other shape's memory, compute and attention factors, from its own training steps
    scales = []
    for source in _sources(pts):
        steps = [
            (p["batch"], m)
            for p, m in zip(pts, measured, strict=True)
            if p.get("shape") == source and not p["held_out"]
        ]
        factors = shape_factors(hw, shapes[source], steps)
        if factors is not None:
            scales.append((shapes[source].name, *factors))
    hw = dataclasses.replace(hw, shape_scales=tuple(scales))
    cm = RooflineCostModel(hw)
    out = []
    for p, m in zip(pts, measured, strict=True):
        shape = spec if p.get("shape") is None else (shapes or {})[p["shape"]]
        out.append(dict(p, measured_s=m, predicted_s=float(predict(cm, shape, p["batch"]))))
    result = FitResult(hw, float(crossover), out, mem_bandwidth)
    # the profile carries its error where it was not fitted (the training points' where none is held
    # out), the fitted model's and each other shape's apart: a plan draws those of its own models
    errors = result.errors(held_out=True, shape=None)
    if not len(errors):
        errors = result.errors(held_out=False, shape=None)
    by_shape = tuple(
        (shapes[source].name, tuple(result.errors(True, shape=source).tolist())) for source in result.shapes()
    )
    profile = dataclasses.replace(hw, step_errors=tuple(errors.tolist()), shape_errors=by_shape)
    return dataclasses.replace(result, profile=profile)


def fit_this_machine(
    base: HardwareProfile | None = None,
    name: str = "cpu-fitted",
    rounds: int = 1,
    reps: int = 3,
    held_out: str = "quick",
    core: int | None = None,
    progress: Callable[[int], None] | None = None,
    shapes: Mapping[str, object] | None = None,
) -> FitResult:
    """Measure and fit this machine's one-core CPU profile (see the module docstring). ``base``:
    the profile whose unmeasured fields are kept (default: the registered one for this CPU's
    vector class). ``shapes``: other models (engine source -> its ModelShape) whose quick held-out
    points are measured too (one round each) and predicted by the fit. Runs in this process,
    pinned to ``core`` for the duration and unpinned after. Compute sharing is measured apart, on
    the result (sim/sharing.py ``with_sharing``)."""
    import torch

    from prism_serve.sim.hardware import get_hardware, host_cpu_profile

    base = base or get_hardware(host_cpu_profile())
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    pin_one_core(core)
    try:
        rate = weight_pass_rate()
        if progress is not None:
            progress(1)
        raw = measure_points(step_points(held_out), rounds, reps, progress=progress)
        held = [p for p in step_points("quick") if p["held_out"]]
        own = [{"kind": k, "args": list(a), "held_out": False} for k, a in SHAPE_TRAIN]
        for source in shapes or {}:
            other = measure_points(own + held, 1, reps, model=source, progress=progress)
            raw["points"] += [dict(p, shape=source) for p in other["points"]]
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    return fit_points(raw, dataclasses.replace(base, name=name), mem_bandwidth=rate, shapes=shapes)
