"""/metrics: Prometheus text format with vLLM's metric names (so existing dashboards work) plus the
prism_* metrics only a multi-model server has.

Latency histograms and token counters are fed by the HTTP layer as requests stream (they measure
what the client sees, activation and queueing included); gauges and per-model activation counts are
read from the controller and the device ledgers at scrape time, so they are never stale.
Every metric has its own registry per server (no global state), so tests can run several servers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prism_serve.runtime import messages as msg
from prism_serve.runtime.controller import Controller

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_ACTIVATION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, controller: Controller) -> None:
        disable_created_metrics()  # no *_created series: half the output, and vLLM has none
        self.registry = r = CollectorRegistry()
        self.slo_counts: dict[tuple[str, str], list[int]] = {}  # (model, slo) -> [met, judged]
        label = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (queueing and activation included)",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens",
            label,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per request: (e2e - ttft) / (output tokens - 1)",
            label,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to last token",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens", label, registry=r)
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
            "prism_slo_met", "Finished requests that met their model's SLO", [*label, "slo"], registry=r
        )
        self.slo_total = Counter(
            "prism_slo_requests",
            "Requests judged against their model's SLO (finished or failed)",
            [*label, "slo"],
            registry=r,
        )
        self.activation = Histogram(
            "prism_activation_seconds",
            "Model activation time (decision to ready)",
            [*label, "device"],
            buckets=_ACTIVATION_BUCKETS,
            registry=r,
        )
        self.activation_phase = Counter(
            "prism_activation_phase_seconds",
            "Activation time by phase (take, map, copy, ready)",
            [*label, "phase"],
            registry=r,
        )
        r.register(_ControllerCollector(controller, self.slo_counts))
        controller.activation_listeners.append(self.on_activation)

    def on_activation(self, model: str, device: str, phases: msg.ActivationPhases) -> None:
        self.activation.labels(model, device).observe(phases.total_s)
        for phase in ("take", "map", "copy", "ready"):
            self.activation_phase.labels(model, phase).inc(getattr(phases, f"{phase}_s"))

    def on_finished(
        self,
        model: str,
        reason: str | None,
        ttft: float,
        e2e: float,
        num_prompt: int,
        num_output: int,
        ttft_slo: float,
        tpot_slo: float,
    ) -> None:
        self.ttft.labels(model).observe(ttft)
        self.e2e.labels(model).observe(e2e)
        self.prompt_tokens.labels(model).inc(num_prompt)
        self.generation_tokens.labels(model).inc(num_output)
        self.success.labels(model, reason or "unknown").inc()
        tpot = (e2e - ttft) / (num_output - 1) if num_output > 1 else 0.0
        if num_output > 1:
            self.tpot.labels(model).observe(tpot)
        for slo, ok in (("ttft", ttft <= ttft_slo), ("tpot", tpot <= tpot_slo)):
            self._judge(model, slo, ok)

    def on_error(self, model: str, error_type: str, status: int, judged: bool) -> None:
        """A request that failed; ``judged``: it counts against the SLOs (server-side failures and
        overload do, a client's own bad request does not)."""
        self.errors.labels(model, error_type, str(status)).inc()
        if judged:
            for slo in ("ttft", "tpot"):
                self._judge(model, slo, False)

    def _judge(self, model: str, slo: str, ok: bool) -> None:
        counts = self.slo_counts.setdefault((model, slo), [0, 0])
        counts[1] += 1
        self.slo_total.labels(model, slo).inc()
        if ok:
            counts[0] += 1
            self.slo_met.labels(model, slo).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ControllerCollector(Collector):
    """Gauges and counters the controller already keeps, read at scrape time."""

    def __init__(self, controller: Controller, slo_counts: dict[tuple[str, str], list[int]]) -> None:
        self.controller = controller
        self.slo_counts = slo_counts

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
            kv.add_metric([s.model], s.used_kv_bytes / s.max_kv_bytes if s.max_kv_bytes else 0.0)
            state.add_metric([s.model, s.state, s.device or ""], 1)
            acts.add_metric([s.model], s.num_activations)
            evs.add_metric([s.model], s.num_evictions)
            weights.add_metric([s.model], s.weight_bytes)
        mapped = GaugeMetricFamily(
            "prism_device_mapped_bytes",
            "Bytes mapped on the device (ledger: weights and KV of every model)",
            labels=["device"],
        )
        budget = GaugeMetricFamily(
            "prism_device_budget_bytes", "The device's memory budget", labels=["device"]
        )
        for name in c.devices:
            snap = c.ledger(name).snapshot()
            mapped.add_metric([name], snap.used_bytes)
            budget.add_metric([name], snap.budget_bytes)
        attainment = GaugeMetricFamily(
            "prism_slo_attainment",
            "Share of judged requests that met the model's SLO since the server started",
            labels=["model_name", "slo"],
        )
        for (model, slo), (met, judged) in sorted(self.slo_counts.items()):
            attainment.add_metric([model, slo], met / judged)
        yield from (
            running, waiting, kv, state, replicas, replica_state, acts, evs, weights, step, cpu, mapped,
            budget, attainment,
        )  # fmt: skip
