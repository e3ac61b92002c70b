"""Multi-model workloads: trace readers, the builder, the JSONL format and per-model statistics.

See README.md in this directory. SLO assignment runs the simulator, so it lives there (sim/slo.py);
this package imports nothing of sim/.
"""

from prism_serve.workload.builder import LENGTH_FILES, SOURCES, WorkloadSpec, build_workload
from prism_serve.workload.format import (
    FIELDS,
    Workload,
    WorkloadError,
    WorkloadRequest,
    read_jsonl,
    write_jsonl,
)
from prism_serve.workload.stats import ModelStats, format_stats, model_stats

__all__ = [
    "FIELDS",
    "LENGTH_FILES",
    "SOURCES",
    "ModelStats",
    "Workload",
    "WorkloadError",
    "WorkloadRequest",
    "WorkloadSpec",
    "build_workload",
    "format_stats",
    "model_stats",
    "read_jsonl",
    "write_jsonl",
]
