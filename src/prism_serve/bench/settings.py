"""What one bench run is told: the knobs (BenchSettings), how model names map to served names, and
where each model's SLO comes from (an SLO file, the endpoint's /v1/models, or the defaults)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prism_serve.errors import PrismError

__all__ = [
    "BenchError",
    "BenchSettings",
    "SLOTarget",
    "parse_model_map",
    "parse_token_range",
    "resolve_slos",
]

# The scale an SLO file gets when none is given: the same default as `prism sim --slo-scale`, because
# the file holds unscaled measurements (P95 alone on dedicated devices), not targets.
FILE_SLO_SCALE = 5.0


class BenchError(PrismError, ValueError):
    """A bench setting, SLO source or model mapping is invalid."""


@dataclass(slots=True, frozen=True)
class SLOTarget:
    ttft_s: float
    tpot_s: float
    source: str  # "file", "server" or "default"


@dataclass(slots=True, frozen=True)
class BenchSettings:
    """Every knob of one replay (echoed in the JSON report; the API key is not a setting on purpose)."""

    rate_scale: float = 1.0  # workload timestamps are divided by this
    duration_s: float | None = None  # only requests in the workload's first duration_s seconds (unscaled)
    model_map: tuple[tuple[str, str], ...] = ()  # (workload name, name sent to the endpoint)
    max_concurrency: int | None = None  # requests in flight at most; later ones wait (client-side queue)
    timeout_s: float = 600.0  # per request, from send to the end of the stream
    prompt: Literal["ids", "text"] = "ids"
    token_range: tuple[int, int] = (1000, 8000)  # prompt token ids are drawn from [lo, hi)
    seed: int = 0
    slo_scale: float | None = None  # None: FILE_SLO_SCALE for an SLO file, 1 for other sources
    tpot_scale: float | None = None  # None: the SLO scale
    ttft_slo_s: float = 1.0  # defaults for models that neither the SLO file nor the server covers
    tpot_slo_s: float = 0.1

    def __post_init__(self) -> None:
        if not self.rate_scale > 0:
            raise BenchError(f"rate_scale must be > 0, got {self.rate_scale}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise BenchError(f"duration_s must be > 0, got {self.duration_s}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise BenchError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.prompt not in ("ids", "text"):
            raise BenchError(f"prompt must be 'ids' or 'text', got {self.prompt!r}")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise BenchError(f"token_range must satisfy 0 <= lo < hi, got {lo}:{hi}")
        for name in ("slo_scale", "tpot_scale"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise BenchError(f"{name} must be > 0, got {v}")
        if not (self.ttft_slo_s > 0 and self.tpot_slo_s > 0):
            raise BenchError("default SLOs must be > 0")
        sources = [a for a, _ in self.model_map]
        if len(set(sources)) != len(sources):
            raise BenchError(f"a model is mapped twice in {self.model_map}")

    def served_name(self, model: str) -> str:
        return dict(self.model_map).get(model, model)


def parse_model_map(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``["a=b", "c=d,e=f"]`` -> ``(("a", "b"), ("c", "d"), ("e", "f"))``."""
    out = []
    for item in items:
        for pair in item.split(","):
            if not pair.strip():
                continue
            src, sep, dst = pair.partition("=")
            if not sep or not src.strip() or not dst.strip():
                raise BenchError(f"--model-map expects WORKLOAD_NAME=SERVED_NAME, got {pair!r}")
            out.append((src.strip(), dst.strip()))
    return tuple(out)


def parse_token_range(text: str) -> tuple[int, int]:
    """``"1000:8000"`` -> ``(1000, 8000)``."""
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(lo), int(hi)
    except ValueError:
        raise BenchError(f"--token-range expects LO:HI (integers), got {text!r}") from None


def resolve_slos(
    models: Iterable[str],
    settings: BenchSettings,
    *,
    file_slos: Mapping | None = None,
    server_slos: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, SLOTarget]:
    """Each workload model's scaled SLO.

    ``file_slos`` (e.g. ``sim.slo.load_slos(path)``: objects with ``ttft_s`` and ``tpot_s``) is
    keyed by workload name, as the simulator wrote it; a model missing from it is an error, since a
    partial SLO file is more likely the wrong file than a wish. ``server_slos`` is keyed by the served
    name (what /v1/models lists); models it lacks take the defaults.
    """
    out = {}
    missing = []
    for m in models:
        served = settings.served_name(m)
        if file_slos is not None:
            s = file_slos.get(m) or file_slos.get(served)
            if s is None:
                missing.append(m)
                continue
            ttft, tpot, source = s.ttft_s, s.tpot_s, "file"
        elif server_slos and served in server_slos:
            (ttft, tpot), source = server_slos[served], "server"
        else:
            ttft, tpot, source = settings.ttft_slo_s, settings.tpot_slo_s, "default"
        scale = settings.slo_scale
        if scale is None:
            scale = FILE_SLO_SCALE if source == "file" else 1.0
        tpot_scale = scale if settings.tpot_scale is None else settings.tpot_scale
        out[m] = SLOTarget(float(ttft) * scale, float(tpot) * tpot_scale, source)
    if missing:
        raise BenchError(f"the SLO file has no SLO for {sorted(missing)}")
    return out
