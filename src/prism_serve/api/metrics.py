"""/metrics: Prometheus text format with vLLM's metric names (so existing dashboards work) plus the
prism_* metrics only a multi-model server has.

Latency histograms and token counters are fed by the HTTP layer as requests stream (they measure
what the client sees, activation and queueing included); gauges and per-model activation counts are
read from the controller and the device ledgers at scrape time, so they are never stale.
Every metric has its own registry per server (no global state), so tests can run several servers.

The request-phase histograms carry vLLM's names and split a finished request's time as vLLM does
(queue + prefill = TTFT, prefill + decode = inference), with what a multi-model server can see:

- ``vllm:request_queue_time_seconds``: the request's arrival at the HTTP server to the first engine
  step that ran it. In vLLM this is the engine's waiting queue; here it also holds the server's own
  admission queue and, for an evicted model, its activation. Measured as the server's TTFT minus the
  engine's prefill seconds (so the IPC of the first token, well under a millisecond, counts here).
- ``vllm:request_prefill_time_seconds``: first engine step with the request to its first token, on
  the worker's clock (``RequestTimings`` in the finished Delta; a preemption's recompute
  included, as in vLLM).
- ``vllm:request_decode_time_seconds``: first token to last, on the worker's clock.
- ``vllm:request_inference_time_seconds``: prefill plus decode.

A request whose engine sent no timings (none does today) is left out of these four. vLLM's
``vllm:request_params_max_tokens`` and ``vllm:request_params_n`` are not exported: the HTTP layer
books a request from its token stream, which does not carry the request's parameters.
Bucket bounds: token counts use vLLM's 1-2-5 series (to a million tokens: one histogram serves
models of every context length); the four phases use the latency buckets prism's TTFT and e2e
histograms use (5 ms up; vLLM starts at 0.3 s, too coarse for a CPU prefill of a small model).

Scrape-time reads shared with the /dashboard page (api/dashboard.py): ``device_memory`` splits each
device's ledger by model, ``kv_usage`` is a model's KV fill, ``ServerMetrics.attainment`` and
``ServerMetrics.recent`` the SLO counts since start and over the last ``RECENT_WINDOW_S``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prism_serve.control.types import REPLICA_SEPARATOR
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.serving import ActivationPhases, ModelStatus, RequestTimings

__all__ = [
    "CONTENT_TYPE",
    "RECENT_WINDOW_S",
    "DeviceMemory",
    "MemoryUse",
    "RecentSummary",
    "ServerMetrics",
    "device_memory",
    "kv_usage",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RECENT_WINDOW_S = 60.0  # what "recent" means on the dashboard (TTFT percentiles, attainment)
_RECENT_MAX = 2048  # outcomes kept per model for the window (a bound: a busy model keeps the newest)
_SLOS = ("ttft", "tpot")

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_ACTIVATION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


def _one_two_five(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's bucket series for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


_COUNT_BUCKETS = _one_two_five(1_000_000)


class ServerMetrics:
    def __init__(self, controller: Controller) -> None:
        disable_created_metrics()  # no *_created series: half the output, and vLLM has none
        self.registry = r = CollectorRegistry()
        self.slo_counts: dict[tuple[str, str], list[int]] = {}  # (model, slo) -> [met, judged]
        # per model: (monotonic time, ttft or None for a failed request, met ttft, met tpot)
        self._recent: dict[str, deque[tuple[float, float | None, bool, bool]]] = {}
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple, labels: list[str] = label) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (queueing and activation included)",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens", _TOKEN_BUCKETS)
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per request: (e2e - ttft) / (output tokens - 1)",
            _TOKEN_BUCKETS,
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", _LATENCY_BUCKETS)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Arrival to the first engine step that ran the request (server queue, activation and the "
            "engine's waiting queue)",
            _LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "First engine step with the request to its first token (worker clock)",
            _LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "First token to last token (worker clock)", _LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", "Prefill plus decode time", _LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request", _COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request", _COUNT_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "max_tokens a request asked for (its limit when none)",
            _COUNT_BUCKETS,
        )  # fmt: skip
        self.params_n = histogram(
            "vllm:request_params_n", "Choices (n) a request asked for", (1, 2, 5, 10, 20)
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens", label, registry=r)
        # vLLM's prefix cache counters, in tokens: hits / queries is the hit rate
        self.cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", label, registry=r
        )
        self.cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", label, registry=r
        )
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", label, registry=r)
        self.success = Counter(
            "vllm:request_success", "Finished requests", [*label, "finished_reason"], registry=r
        )
        self.errors = Counter(
            "prism_request_errors",
            "Requests that ended with an error (by OpenAI error type and HTTP status)",
            [*label, "type", "status"],
            registry=r,
        )
        self.slo_met = Counter(
            "prism_slo_met",
            "Finished requests that met their SLO (their model's, times their tenant's slo_scale)",
            [*label, "slo"],
            registry=r,
        )
        self.slo_total = Counter(
            "prism_slo_requests",
            "Requests judged against their model's SLO (finished or failed)",
            [*label, "slo"],
            registry=r,
        )
        self.activation = histogram(
            "prism_activation_seconds",
            "Model activation time (decision to ready)",
            _ACTIVATION_BUCKETS,
            [*label, "device"],
        )
        self.activation_phase = Counter(
            "prism_activation_phase_seconds",
            "Activation time by phase (take, map, copy, ready)",
            [*label, "phase"],
            registry=r,
        )
        r.register(_ControllerCollector(controller, self))
        controller.activation_listeners.append(self.on_activation)

    def on_activation(self, model: str, device: str, phases: ActivationPhases) -> None:
        self.activation.labels(model, device).observe(phases.total_s)
        for phase in ("take", "map", "copy", "ready"):
            self.activation_phase.labels(model, phase).inc(getattr(phases, f"{phase}_s"))

    def on_request(self, model: str, max_tokens: int, n: int) -> None:
        """A request admitted to the engine (once, whatever its number of prompts and choices)."""
        self.params_max_tokens.labels(model).observe(max_tokens)
        self.params_n.labels(model).observe(n)

    def on_finished(
        self,
        model: str,
        reason: str | None,
        ttft: float,
        e2e: float,
        num_prompt: int,
        num_output: int,
        slos: tuple[float, float] | None,
        timings: RequestTimings | None = None,
        num_cached: int = 0,
    ) -> tuple[bool, bool] | None:
        """A finished request: ``ttft`` and ``e2e`` from its arrival at the server, ``slos`` the
        (TTFT, TPOT) SLOs it is judged by (None: not judged, a batch line), ``timings`` the
        engine's (the finished TokenDelta's), ``num_cached`` its prompt tokens the cache served.
        Whether it met each SLO, None if not judged."""
        self.ttft.labels(model).observe(ttft)
        self.cache_queries.labels(model).inc(num_prompt)
        self.cache_hits.labels(model).inc(num_cached)
        self.e2e.labels(model).observe(e2e)
        self.prompt_tokens.labels(model).inc(num_prompt)
        self.generation_tokens.labels(model).inc(num_output)
        self.request_prompt_tokens.labels(model).observe(num_prompt)
        self.request_generation_tokens.labels(model).observe(num_output)
        self.success.labels(model, reason or "unknown").inc()
        if timings is not None:
            self.queue_time.labels(model).observe(max(0.0, ttft - timings.prefill_s))
            self.prefill_time.labels(model).observe(timings.prefill_s)
            self.decode_time.labels(model).observe(timings.decode_s)
            self.inference_time.labels(model).observe(timings.prefill_s + timings.decode_s)
        tpot = (e2e - ttft) / (num_output - 1) if num_output > 1 else 0.0
        if num_output > 1:
            self.tpot.labels(model).observe(tpot)
        if slos is None:
            return None
        met_ttft, met_tpot = ttft <= slos[0], tpot <= slos[1]
        for slo, ok in zip(_SLOS, (met_ttft, met_tpot), strict=True):
            self._judge(model, slo, ok)
        self._remember(model, ttft, met_ttft, met_tpot)
        return met_ttft, met_tpot

    def on_latency(self, model: str, latency: float, slo: float) -> bool:
        """A pooled request (embed or score: every input answered) judged once by its latency SLO
        (``latency``, from its arrival to its last input's answer); whether it met it."""
        met = latency <= slo
        self._judge(model, "latency", met)
        self._remember(model, latency, met, met)
        return met

    def on_error(self, model: str, error_type: str, status: int, judged: bool, pooled: bool = False) -> None:
        """A request that failed; ``judged``: it counts against the SLOs (server-side failures and
        overload do, a client's own bad request does not); ``pooled``: against its latency SLO."""
        self.errors.labels(model, error_type, str(status)).inc()
        if judged:
            for slo in ("latency",) if pooled else _SLOS:
                self._judge(model, slo, False)
            self._remember(model, None, False, False)

    def _judge(self, model: str, slo: str, ok: bool) -> None:
        counts = self.slo_counts.setdefault((model, slo), [0, 0])
        counts[1] += 1
        self.slo_total.labels(model, slo).inc()
        if ok:
            counts[0] += 1
            self.slo_met.labels(model, slo).inc()

    def _remember(self, model: str, ttft: float | None, met_ttft: bool, met_tpot: bool) -> None:
        recent = self._recent.get(model)
        if recent is None:
            recent = self._recent[model] = deque(maxlen=_RECENT_MAX)
        recent.append((time.monotonic(), ttft, met_ttft, met_tpot))

    def attainment(self) -> dict[tuple[str, str], float]:
        """(model, slo) -> share of judged requests that met it since the server started."""
        return {key: met / judged for key, (met, judged) in sorted(self.slo_counts.items())}

    def recent(self, model: str, window_s: float = RECENT_WINDOW_S) -> RecentSummary:
        """``model``'s requests judged in the last ``window_s`` seconds: TTFT percentiles of the
        finished ones (nearest rank, exact), SLO attainment of all (failed ones count as missed)."""
        since = time.monotonic() - window_s
        outcomes = [o for o in self._recent.get(model, ()) if o[0] >= since]
        ttfts = sorted(o[1] for o in outcomes if o[1] is not None)
        n = len(outcomes)
        return RecentSummary(
            window_s=window_s,
            num_judged=n,
            num_finished=len(ttfts),
            ttft_p50=_rank(ttfts, 0.5),
            ttft_p95=_rank(ttfts, 0.95),
            ttft_attainment=sum(o[2] for o in outcomes) / n if n else None,
            tpot_attainment=sum(o[3] for o in outcomes) / n if n else None,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True, slots=True)
class RecentSummary:
    window_s: float
    num_judged: int  # finished plus failed-and-judged
    num_finished: int
    ttft_p50: float | None  # None: nothing finished in the window
    ttft_p95: float | None
    ttft_attainment: float | None  # None: nothing judged in the window
    tpot_attainment: float | None


def _rank(values: list[float], q: float) -> float | None:
    return values[max(0, math.ceil(q * len(values)) - 1)] if values else None


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """Bytes one engine has mapped on a device for one purpose (one ledger entry, or several of the
    same name summed)."""

    model: str | None  # the served model, None for an entry that is none of this server's
    replica: int  # 0: the served model's own engine, k: its replica slot k
    kind: str  # "weights", "kv", "spare" (a worker's pages no model uses), or "other" (unknown)
    name: str  # the ledger entry's name
    bytes: int


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device's budget as its ledger splits it, read at once."""

    device: str
    budget_bytes: int
    used_bytes: int  # every entry's mapped bytes
    uses: tuple[MemoryUse, ...]

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes)


def device_memory(controller: Controller) -> list[DeviceMemory]:
    """Every device's ledger, split by model and purpose. Workers name their entries
    "<engine> weights" and "<engine> kv" (runtime/worker.py), the engine being a served model or
    its replica slot "<model>#<k>"; entries the ledger flags spare are a worker's spare pages."""
    out = []
    served = controller.specs  # the served models by name
    for device, snap in controller.device_memory().items():
        summed: dict[tuple[str, bool], int] = {}
        for e in snap.entries:
            summed[e.name, e.spare] = summed.get((e.name, e.spare), 0) + e.mapped_bytes
        uses = [_memory_use(name, spare, n, served) for (name, spare), n in summed.items()]
        out.append(DeviceMemory(device, snap.budget_bytes, snap.used_bytes, tuple(uses)))
    return out


def _memory_use(name: str, spare: bool, nbytes: int, served: Mapping[str, object]) -> MemoryUse:
    if spare:  # a worker's mapped pages that no model uses (memory/spare.py): reclaimable
        return MemoryUse(None, 0, "spare", name, nbytes)
    engine, _, kind = name.rpartition(" ")
    model, _, replica = engine.partition(REPLICA_SEPARATOR)
    if kind in ("weights", "kv") and model in served and (not replica or replica.isdigit()):
        return MemoryUse(model, int(replica or 0), kind, name, nbytes)
    return MemoryUse(None, 0, "other", name, nbytes)


def kv_usage(s: ModelStatus) -> float:
    """KV in use / the most the model's engines can map (0 when none is active)."""
    return s.used_kv_bytes / s.max_kv_bytes if s.max_kv_bytes else 0.0


class _ControllerCollector(Collector):
    """Gauges and counters the controller already keeps, read at scrape time."""

    def __init__(self, controller: Controller, metrics: ServerMetrics) -> None:
        self.controller = controller
        self.metrics = metrics

    def collect(self) -> Iterator:
        c = self.controller
        if not c.running:  # not started (or stopped): nothing to report
            return
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in the model's engine", labels=["model_name"]
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Requests queued for the model (waiting for admission or activation)",
            labels=["model_name"],
        )
        kv = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV in use / the most the engine can map (0 when not active)",
            labels=["model_name"],
        )
        state = GaugeMetricFamily(
            "prism_model_state", "1 for the model's current state", labels=["model_name", "state", "device"]
        )
        acts = CounterMetricFamily("prism_model_activations", "Model activations", labels=["model_name"])
        evs = CounterMetricFamily("prism_model_evictions", "Model evictions", labels=["model_name"])
        weights = GaugeMetricFamily(
            "prism_model_weight_bytes", "Weight bytes of the model", labels=["model_name"]
        )
        cached = GaugeMetricFamily(
            "prism_model_cached_kv_bytes",
            "Prefix-cached KV of the model that no request holds (given back first when the device "
            "needs memory: reclaimable, not free)",
            labels=["model_name"],
        )
        step = CounterMetricFamily(
            "prism_engine_step_seconds",
            "Wall seconds the model's engine spent in steps",
            labels=["model_name"],
        )
        cpu = CounterMetricFamily(
            "prism_engine_cpu_seconds",
            "CPU seconds the model's worker processes used while serving it (on a CPU device, "
            "rate(cpu) / rate(step) below 1 means colocated engines took the cores)",
            labels=["model_name"],
        )
        replicas = GaugeMetricFamily(
            "prism_model_replicas",
            "Resident replicas of the model (loading or active)",
            labels=["model_name"],
        )
        replica_state = GaugeMetricFamily(
            "prism_replica_state",
            "1 for each resident replica's state and device",
            labels=["model_name", "replica", "state", "device"],
        )
        for s in c.status():
            replicas.add_metric([s.model], len(s.replicas))
            for r in s.replicas:
                replica_state.add_metric([s.model, str(r.replica), r.state, r.device or ""], 1)
            step.add_metric([s.model], s.step_seconds)
            cpu.add_metric([s.model], s.cpu_seconds)
            running.add_metric([s.model], s.num_running)
            waiting.add_metric([s.model], s.num_queued)
            kv.add_metric([s.model], kv_usage(s))
            state.add_metric([s.model, s.state, s.device or ""], 1)
            acts.add_metric([s.model], s.num_activations)
            evs.add_metric([s.model], s.num_evictions)
            weights.add_metric([s.model], s.weight_bytes)
            cached.add_metric([s.model], s.cached_kv_bytes)
        mapped = GaugeMetricFamily(
            "prism_device_mapped_bytes",
            "Bytes mapped on the device (ledger: weights and KV of every model)",
            labels=["device"],
        )
        budget = GaugeMetricFamily(
            "prism_device_budget_bytes", "The device's memory budget", labels=["device"]
        )
        for d in device_memory(c):
            mapped.add_metric([d.device], d.used_bytes)
            budget.add_metric([d.device], d.budget_bytes)
        attainment = GaugeMetricFamily(
            "prism_slo_attainment",
            "Share of judged requests that met the model's SLO since the server started",
            labels=["model_name", "slo"],
        )
        for (model, slo), share in self.metrics.attainment().items():
            attainment.add_metric([model, slo], share)
        yield from (
            running, waiting, kv, state, replicas, replica_state, acts, evs, weights, cached, step, cpu,
            mapped, budget, attainment,
        )  # fmt: skip
