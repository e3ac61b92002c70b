"""Live load generator: replay a workload against any OpenAI-compatible endpoint (see README.md)."""

from prism_serve.bench.replay import replay
from prism_serve.bench.report import BenchResult, RequestError, RequestRecord, summarize
from prism_serve.bench.settings import BenchError, BenchSettings, SLOTarget

__all__ = [
    "BenchError",
    "BenchResult",
    "BenchSettings",
    "RequestError",
    "RequestRecord",
    "SLOTarget",
    "replay",
    "summarize",
]
