"""What a simulation run measured, and the summary numbers the CLI prints and plots.

- **TTFT attainment**: share of all requests whose first token came within their TTFT SLO. Rejected
  requests and requests unfinished when the run stopped count as misses. The inputs of one embed or
  score request (``SimRequest.group``, from ``Workload.groups``) are judged once, together: met
  only if every one of them is, as the live server judges the request by its latency. Counts of
  judged requests count such a group once.
- **TPOT attainment**: share of all requests that finished with (finish - first token) /
  (output tokens - 1) within their TPOT SLO (a one-token output counts as met once it finished).
- **TTFT misses, cold and warm**: a miss is *cold* when the request's model had no ready engine at
  its arrival (evicted or still activating: the request waited for an activation), *warm* otherwise
  (it waited in a queue or behind colocated work). Prewarming can only remove cold misses.
- **Throughput**: output tokens per second of *busy* time, where busy time is the union of the
  intervals in which at least one request was in the system (the paper excludes idle periods).
- **Prefix hit rate** (workloads with block hashes): prompt tokens found in the engine's prefix
  cache when the request was first scheduled, over all prompt tokens (requests never scheduled count
  as misses); ``prefix_hit_rate_infinite`` is what one unbounded cache per model that never evicts,
  filled as requests arrive, would give on the same requests.
- **Classes and tenants** (workloads that name them, workload/format.py): attainment counts the
  requests of the ``interactive`` and ``standard`` classes (all of them when every request is
  ``batch``). ``batch`` requests run on what the others leave, by their window: the summary reports
  how many finished (``batch``), and each class's and each tenant's attainment apart
  (``by_class``, ``by_tenant``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from prism_serve.control.types import DEFAULT_ORIGIN, Priority
from prism_serve.sim.engine import SimRequest

__all__ = ["SimResult", "attainment", "judged_requests", "judged_units"]


def _ttft_met(r: SimRequest) -> bool:
    return r.first_token is not None and r.first_token - r.arrival <= r.ttft_slo


def _tpot_met(r: SimRequest) -> bool:
    return r.finish is not None and (r.output_tokens <= 1 or r.tpot <= r.tpot_slo)


def judged_requests(requests: list[SimRequest]) -> list[SimRequest]:
    """The requests attainment counts: all but the batch class's (all when there is nothing else)."""
    judged = [r for r in requests if r.control.origin.priority is not Priority.BATCH]
    return judged if judged or not requests else requests


def _units(requests: list[SimRequest]) -> list[list[SimRequest]]:
    """``requests`` as the units attainment judges: a group's inputs together (in the order of
    its first), every other request on its own."""
    out: list[list[SimRequest]] = []
    groups: dict[int, list[SimRequest]] = {}
    for r in requests:
        if r.group < 0:
            out.append([r])
        elif r.group in groups:
            groups[r.group].append(r)
        else:
            groups[r.group] = [r]
            out.append(groups[r.group])
    return out


def _unit_attainment(requests: list[SimRequest]) -> tuple[float, float]:
    """(TTFT, TPOT) attainment of ``requests``' units, all of them judged (1.0 for none)."""
    if all(r.group < 0 for r in requests):  # the common case, without building units
        n = len(requests)
        return (sum(map(_ttft_met, requests)) / n, sum(map(_tpot_met, requests)) / n) if n else (1.0, 1.0)
    return _attainment_of(_units(requests))


def _attainment_of(units: list[list[SimRequest]]) -> tuple[float, float]:
    """(TTFT, TPOT) attainment of ``units`` (1.0 for none): a unit meets an SLO if every input does."""
    n = len(units)
    if not n:
        return 1.0, 1.0
    return sum(all(map(_ttft_met, u)) for u in units) / n, sum(all(map(_tpot_met, u)) for u in units) / n


def judged_units(requests: list[SimRequest]) -> int:
    """How many judgements attainment makes over ``requests`` (a group counts once), batch
    requests left out unless they are all there is."""
    judged = judged_requests(requests)
    return len(judged) if all(r.group < 0 for r in judged) else len(_units(judged))


def attainment(requests: list[SimRequest]) -> tuple[float, float]:
    """(TTFT, TPOT) attainment over ``requests`` (1.0 for an empty list), batch requests left out
    unless they are all there is, a group's inputs judged once together."""
    return _unit_attainment(judged_requests(requests))


def _missed(units: list[list[SimRequest]]) -> list[SimRequest]:
    """The ``units`` that missed their TTFT SLO, each by its first request."""
    return [u[0] for u in units if not all(map(_ttft_met, u))]


def _pct(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q)) if len(a) else None


def _unit_ttft(unit: list[SimRequest]) -> float | None:
    """A unit's TTFT: its last input's (None until every one has its first token)."""
    if any(r.first_token is None for r in unit):
        return None
    return max(r.first_token - r.arrival for r in unit)


@dataclass(slots=True)
class SimResult:
    requests: list[SimRequest]
    end_time: float  # simulated seconds when the run stopped
    busy_time: float  # seconds with at least one request in the system
    in_system_integral: float  # integral over time of the number of requests in the system
    counters: Counter = field(default_factory=Counter)  # activations, evictions, migrations, ...
    labels: dict = field(default_factory=dict)  # config echo: hardware, policy, devices, synthetic marks
    colocated: dict[str, list[str]] = field(default_factory=dict)  # models ever resident together
    # prefix caching (labels["prefix_caching"]): per model, the prompt tokens an unbounded cache
    # would have held on the same requests
    infinite_cached: dict[str, int] = field(default_factory=dict)
    # per served model, each finished activation's (decision time, seconds from the decision to a
    # ready engine, waiting for memory included), as a live server's prism_activation_seconds
    # measures it
    activation_s: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @property
    def prefix_caching(self) -> bool:
        return bool(self.labels.get("prefix_caching"))

    def _prefix(self, reqs: list[SimRequest], infinite: int) -> dict:
        prompt = sum(r.prompt_tokens for r in reqs)
        cached = sum(r.cached_tokens or 0 for r in reqs)
        return {
            "prefix_cached_tokens": cached,
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "prefix_hit_rate_infinite": infinite / prompt if prompt else 0.0,
        }

    @property
    def mean_in_system(self) -> float:
        """Time-average number of requests in the system (queued, deferred or running)."""
        return self.in_system_integral / self.end_time if self.end_time > 0 else 0.0

    def per_model(self) -> dict[str, dict]:
        by: dict[str, list[SimRequest]] = {}
        for r in self.requests:
            by.setdefault(r.model, []).append(r)
        out = {}
        for m, rs in sorted(by.items()):
            ttft, tpot = attainment(rs)
            served: dict[str, int] = {}
            for r in rs:
                if r.replica:
                    served[r.replica] = served.get(r.replica, 0) + 1
            units = _units(rs)
            missed = _missed(units)
            cold = sum(1 for r in missed if r.cold)
            ttfts = np.array([t for u in units if (t := _unit_ttft(u)) is not None])
            tpots = np.array([r.tpot for r in rs if r.output_tokens > 1 and r.tpot is not None])
            out[m] = {
                "requests": len(rs),
                "ttft_attainment": ttft,
                "tpot_attainment": tpot,
                # as prism bench reports a live run's, to compare them model by model
                "ttft_p50_s": _pct(ttfts, 50),
                "ttft_p95_s": _pct(ttfts, 95),
                "tpot_p50_s": _pct(tpots, 50),
                "tpot_p95_s": _pct(tpots, 95),
                "ttft_misses": len(missed),
                "ttft_misses_cold": cold,  # its model had no ready engine when it arrived
                "ttft_misses_warm": len(missed) - cold,
                "by_replica": served,  # requests each replica (model or slot name) last served
                "colocated": self.colocated.get(m, []),  # the models it shared a device with
                "activations": len(took := [t for _, t in self.activation_s.get(m, [])]),
                "activation_mean_s": float(np.mean(took)) if took else None,
            }
            if self.prefix_caching:
                out[m].update(self._prefix(rs, self.infinite_cached.get(m, 0)))
        return out

    def summary(self) -> dict:
        reqs = self.requests
        units = _units(judged_requests(reqs))  # what attainment judges, each once
        ttft, tpot = _attainment_of(units)
        done = [r for r in reqs if r.finish is not None]
        ttfts = np.array([t for u in units if (t := _unit_ttft(u)) is not None])
        missed = _missed(units)
        out_tokens = sum(r.output_tokens for r in done)
        pct = _pct
        return {
            **self.labels,
            "num_requests": len(reqs),
            # the judgements attainment makes (batch left out, a group of inputs once)
            "num_judged": len(units),
            "num_finished": len(done),
            "num_rejected": sum(1 for r in reqs if r.rejected is not None),
            "num_unfinished": sum(1 for r in reqs if r.finish is None and r.rejected is None),
            "ttft_attainment": ttft,
            "tpot_attainment": tpot,
            "throughput_tokens_per_s": out_tokens / self.busy_time if self.busy_time > 0 else 0.0,
            "throughput_requests_per_s": len(done) / self.busy_time if self.busy_time > 0 else 0.0,
            "ttft_p50_s": pct(ttfts, 50),
            "ttft_p95_s": pct(ttfts, 95),
            "ttft_p99_s": pct(ttfts, 99),
            "ttft_misses_cold": sum(1 for r in missed if r.cold),
            "ttft_misses_warm": sum(1 for r in missed if not r.cold),
            "activations": self.counters["activations"],
            "replica_activations": self.counters["replica_activations"],  # of replica slots >= 1
            "requests_on_replicas": sum(1 for r in reqs if r.replica and r.replica != r.model),
            "evictions": self.counters["evictions"],
            "migrations": self.counters["migrations"],
            "migrations_skipped": self.counters["migrations_skipped"],  # the model was busy
            # prefix-cache blocks kept at an eviction and restored at the next activation
            "restored_prefix_blocks": self.counters["restored_prefix_blocks"],
            "preemptions": sum(r.num_preemptions for r in reqs),
            "restarts": sum(r.num_restarts for r in reqs),
            "simulated_s": self.end_time,
            "busy_s": self.busy_time,
            **(self._prefix(reqs, sum(self.infinite_cached.values())) if self.prefix_caching else {}),
            **self._origins(reqs),
        }

    @staticmethod
    def _origins(reqs: list[SimRequest]) -> dict:
        """Per class and per tenant, when the workload names them (the module's docstring)."""
        if all(r.control.origin == DEFAULT_ORIGIN for r in reqs):
            return {}
        by_class: dict[str, list[SimRequest]] = {}
        by_tenant: dict[str, list[SimRequest]] = {}
        for r in reqs:
            by_class.setdefault(r.control.origin.priority.name.lower(), []).append(r)
            by_tenant.setdefault(r.control.origin.tenant, []).append(r)

        def part(rs: list[SimRequest]) -> dict:
            ttft, tpot = _unit_attainment(rs)
            return {"requests": len(rs), "finished": sum(r.finish is not None for r in rs),
                    "ttft_attainment": ttft, "tpot_attainment": tpot}  # fmt: skip

        batch = by_class.get("batch", [])
        return {
            "batch": {"requests": len(batch), "finished": sum(r.finish is not None for r in batch)},
            "by_class": {c: part(rs) for c, rs in sorted(by_class.items())},
            "by_tenant": {t: part(rs) for t, rs in sorted(by_tenant.items())},
        }
