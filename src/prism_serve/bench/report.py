"""What a bench run measured (one RequestRecord per request) and the numbers it reports.

- **TTFT**: from sending the request to the first SSE chunk with a choice. Servers stream one
  /v1/completions chunk per engine step that produced tokens (vLLM and prism serve skip steps without
  one), and its text may be empty: a partial UTF-8 character, a held-back stop string, or a synthetic
  model's tokens that decode to nothing. Waiting for text would count those as latency.
- **E2E**: from sending the request to ``data: [DONE]``.
- **TPOT**: (E2E - TTFT) / (output tokens - 1); undefined for a one-token output.
- **Attainment** is over *all* requests of a model, as in the simulator (sim/metrics.py): a request
  attains TTFT if it succeeded and TTFT <= its model's TTFT SLO; TPOT likewise, where a one-token
  output attains TPOT once it succeeded. A failed request attains neither.
- **Percentiles** (numpy's linear interpolation) are over succeeded requests only: a failure has no
  latency, and counting it as infinite would hide how fast the others were.
- **Throughput** is over the run's duration: the first send to the last request's end.
- **Send lag**: how late the generator sent requests after their scheduled time. A large lag means the
  client (not the endpoint) could not keep up, or that --max-concurrency held requests back.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from prism_serve.bench.settings import BenchSettings, SLOTarget

__all__ = ["BenchResult", "RequestError", "RequestRecord", "format_table", "percentile", "summarize"]


@dataclass(slots=True)
class RequestError:
    kind: str  # "http_<status>", "timeout", "connect", "stream_error", "protocol", "no_output"
    message: str = ""
    status: int | None = None
    type: str | None = None  # the OpenAI error "type" the endpoint answered with
    retry_after: str | None = None  # the Retry-After header of a 429/503, as sent


@dataclass(slots=True)
class RequestRecord:
    index: int  # position in the (trimmed) workload
    model: str  # the workload's name; stats and SLOs are keyed by it
    served_model: str  # the name sent (after --model-map)
    scheduled_s: float  # workload timestamp / rate scale
    prompt_tokens: int  # as the workload asked (what was sent with --prompt ids)
    max_tokens: int
    sent_s: float | None = None  # seconds from the bench start; None if never sent
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0  # from the usage chunk, else the number of text chunks
    usage_reported: bool = False
    usage_prompt_tokens: int | None = None  # the endpoint's own count of the prompt
    # of those, what it found in its prefix cache (usage.prompt_tokens_details.cached_tokens; None
    # where the endpoint does not say)
    usage_cached_tokens: int | None = None
    finish_reason: str | None = None
    token_times_s: list[float] = field(default_factory=list)  # each completion chunk, from the send
    error: RequestError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def attains(self, slo: SLOTarget) -> tuple[bool, bool]:
        """(TTFT attained, TPOT attained)."""
        if not self.ok:
            return False, False
        ttft_ok = self.ttft_s is not None and self.ttft_s <= slo.ttft_s
        tpot = self.tpot_s
        return ttft_ok, self.output_tokens <= 1 or (tpot is not None and tpot <= slo.tpot_s)

    def to_json(self, token_times: bool = False) -> dict:
        out = {
            "index": self.index,
            "model": self.model,
            "served_model": self.served_model,
            "scheduled_s": self.scheduled_s,
            "sent_s": self.sent_s,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "output_tokens": self.output_tokens,
            "usage_reported": self.usage_reported,
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "usage_cached_tokens": self.usage_cached_tokens,
            "finish_reason": self.finish_reason,
            "error": None if self.error is None else asdict(self.error),
        }
        if token_times:
            out["token_times_s"] = self.token_times_s
        return out


def percentile(values: Iterable[float], q: float) -> float | None:
    a = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(a, q)) if len(a) else None


def _stats(records: list[RequestRecord], slos: Mapping[str, SLOTarget], duration_s: float) -> dict:
    ok = [r for r in records if r.ok]
    ttft_hits = tpot_hits = both_hits = 0
    for r in records:
        t, p = r.attains(slos[r.model])
        ttft_hits += t
        tpot_hits += p
        both_hits += t and p
    n = len(records)
    out_tokens = sum(r.output_tokens for r in ok)
    series = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
        "e2e": [r.e2e_s for r in ok],
    }
    out: dict = {
        "requests": n,
        "succeeded": len(ok),
        "failed": n - len(ok),
        "errors": dict(sorted(Counter(r.error.kind for r in records if r.error is not None).items())),
        # 1.0 for no requests, as the simulator reports it: nothing was missed
        "ttft_attainment": ttft_hits / n if n else 1.0,
        "tpot_attainment": tpot_hits / n if n else 1.0,
        "slo_attainment": both_hits / n if n else 1.0,
    }
    for name, vals in series.items():
        out[f"{name}_mean_s"] = float(np.mean(vals)) if vals else None
        for q in (50, 95, 99):
            out[f"{name}_p{q}_s"] = percentile(vals, q)
    lags = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    # the endpoint's prefix cache: cached prompt tokens over the prompt tokens of the requests whose
    # usage said both (None where none did)
    told = [r for r in ok if r.usage_cached_tokens is not None and r.usage_prompt_tokens]
    prompt = sum(r.usage_prompt_tokens for r in told)
    out.update(
        prefix_hit_rate=sum(r.usage_cached_tokens for r in told) / prompt if prompt else None,
        output_tokens=out_tokens,
        # the endpoint ignored ignore_eos or max_tokens if its outputs came back shorter
        short_outputs=sum(1 for r in ok if r.output_tokens < r.max_tokens),
        throughput_requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        throughput_output_tokens_per_s=out_tokens / duration_s if duration_s > 0 else 0.0,
        send_lag_p99_s=percentile(lags, 99),
        send_lag_max_s=max(lags) if lags else None,
    )
    return out


def summarize(records: list[RequestRecord], slos: Mapping[str, SLOTarget], duration_s: float) -> dict:
    """``{"overall": stats, "models": {model: stats + its SLO}}`` (see the module docstring)."""
    by: dict[str, list[RequestRecord]] = {m: [] for m in slos}
    for r in records:
        by.setdefault(r.model, []).append(r)
    models = {}
    for m, rs in sorted(by.items()):
        slo = slos[m]
        models[m] = {
            "ttft_slo_s": slo.ttft_s,
            "tpot_slo_s": slo.tpot_s,
            "slo_source": slo.source,
            **_stats(rs, slos, duration_s),
        }
    return {"overall": _stats(records, slos, duration_s), "models": models}


@dataclass(slots=True)
class BenchResult:
    url: str
    settings: BenchSettings
    slos: dict[str, SLOTarget]
    records: list[RequestRecord]
    started_at: str  # ISO 8601, UTC
    started_unix: float  # the wall clock (seconds since the epoch) at which scheduled_s is 0
    duration_s: float  # first send to the last request's end
    peak_in_flight: int
    machine: dict  # the client's machine: the endpoint may be elsewhere
    extra: dict = field(default_factory=dict)  # anything a caller wants echoed (argv, workload path)

    def summary(self) -> dict:
        return summarize(self.records, self.slos, self.duration_s)

    def to_json(self, token_times: bool = False) -> dict:
        return {
            "url": self.url,
            "started_at": self.started_at,
            "started_unix": self.started_unix,
            "duration_s": self.duration_s,
            "peak_in_flight": self.peak_in_flight,
            "machine": self.machine,
            "settings": _jsonable(asdict(self.settings)),
            **self.extra,
            "slos": {m: asdict(s) for m, s in self.slos.items()},
            **self.summary(),
            "requests": [r.to_json(token_times) for r in self.records],
        }

    def write_json(self, path: str | Path, token_times: bool = False) -> None:
        Path(path).write_text(json.dumps(self.to_json(token_times), indent=1) + "\n")


def _jsonable(obj):
    if isinstance(obj, tuple | list):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    return obj


def _ms(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{1000 * v:.1f}" if v < 0.01 else f"{1000 * v:.0f}"  # TPOTs are often a few ms


def format_table(summary: dict) -> str:
    """A plain-text table: one row per model and one for all, latencies in milliseconds."""
    head = (
        f"{'model':<24} {'reqs':>6} {'fail':>5} {'TTFT att':>8} {'TPOT att':>8} "
        f"{'TTFT p50/p95/p99 ms':>21} {'TPOT p50/p99':>12} {'E2E p50/p99 ms':>15} {'out tok/s':>9}"
    )
    lines = [head, "-" * len(head)]
    rows = [*summary["models"].items(), ("(all)", summary["overall"])]
    for name, s in rows:
        lines.append(
            f"{name[:24]:<24} {s['requests']:>6} {s['failed']:>5} {s['ttft_attainment']:>8.1%} "
            f"{s['tpot_attainment']:>8.1%} "
            f"{_ms(s['ttft_p50_s']) + '/' + _ms(s['ttft_p95_s']) + '/' + _ms(s['ttft_p99_s']):>21} "
            f"{_ms(s['tpot_p50_s']) + '/' + _ms(s['tpot_p99_s']):>12} "
            f"{_ms(s['e2e_p50_s']) + '/' + _ms(s['e2e_p99_s']):>15} "
            f"{s['throughput_output_tokens_per_s']:>9.1f}"
        )
    hit = summary["overall"].get("prefix_hit_rate")
    if hit is not None:
        lines.append(f"prefix cache: {hit:.1%} of prompt tokens were served from the endpoint's cache")
    errors = summary["overall"]["errors"]
    if errors:
        lines.append("errors: " + ", ".join(f"{k} {v}" for k, v in errors.items()))
    return "\n".join(lines)
