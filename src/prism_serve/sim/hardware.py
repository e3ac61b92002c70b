"""Hardware profiles the cost model reads: one frozen record per device kind, in a registry.

The GPU rows are **synthetic**: vendor datasheet peaks (dense bf16 FLOP/s, HBM bandwidth, host link
and NVLink bandwidth per direction) times efficiency factors we chose, not measurements of ours.
The efficiency factors are typical of a well-tuned serving engine (decode reaching ~90% of HBM
bandwidth, prefill ~60% of peak FLOP/s) and put activation of an 8B model near the 0.7 s the Prism
paper reports for H100 (its Figure 9). The ``cpu-smollm2`` row is meant to be **fitted** to this
project's own engine (SmolLM2-135M, fp32, 2 cores) by ``benchmarks/fit_cpu_profile.py``; the values
below are NOT yet fitted: they are rough guesses from docs/benchmarks.md (decode ~24 tok/s at batch 1,
prefill ~560 tok/s), marked ``synthetic=True`` until the script's output replaces them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prism_serve.sim.errors import SimConfigError

__all__ = ["HARDWARE", "HardwareProfile", "get_hardware"]

GB = 1e9
GIB = 1 << 30


@dataclass(slots=True, frozen=True)
class HardwareProfile:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (for the CPU profile: the fitted effective rate)
    mem_bandwidth: float  # bytes/s of device memory
    host_bandwidth: float  # bytes/s host -> device, one direction (model activation)
    link_bandwidth: float  # bytes/s device <-> device, one direction (tensor-parallel all-reduce)
    memory_bytes: int  # device memory
    usable_fraction: float = 0.9  # of memory_bytes models may map (weights + KV); the rest is runtime
    flops_efficiency: float = 0.6
    mem_efficiency: float = 0.9
    host_efficiency: float = 0.5  # pageable host memory, as Prism loads from
    step_overhead_s: float = 2e-4  # per engine step: launch and scheduling, not hidden by the roofline
    allreduce_latency_s: float = 1e-5  # per all-reduce (two per layer under TP)
    activation_overhead_s: float = 0.2  # engine start / page mapping before weights stream in
    overlap: bool = True  # True: step = max(compute, memory) (GPU); False: their sum (fitted CPU)
    synthetic: bool = True  # constants from datasheets and assumptions, not measured here

    def __post_init__(self) -> None:
        positive = ("peak_flops", "mem_bandwidth", "host_bandwidth", "link_bandwidth", "memory_bytes")
        for name in positive:
            if not getattr(self, name) > 0:
                raise SimConfigError(f"hardware {self.name}: {name} must be > 0")
        for name in ("usable_fraction", "flops_efficiency", "mem_efficiency", "host_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise SimConfigError(f"hardware {self.name}: {name} must be in (0, 1]")
        for name in ("step_overhead_s", "allreduce_latency_s", "activation_overhead_s"):
            if getattr(self, name) < 0:
                raise SimConfigError(f"hardware {self.name}: {name} must be >= 0")

    @property
    def capacity_bytes(self) -> int:
        """What DeviceSnapshot.capacity_bytes reports: memory models may use."""
        return int(self.memory_bytes * self.usable_fraction)

    @property
    def label(self) -> str:
        return (
            f"{self.name} ({'synthetic datasheet profile' if self.synthetic else 'fitted on this machine'})"
        )


HARDWARE: Mapping[str, HardwareProfile] = MappingProxyType(
    {
        p.name: p
        for p in (
            # H100 SXM5 80GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, PCIe Gen5 x16, NVLink 4 (450 GB/s/dir)
            HardwareProfile("h100", 989e12, 3.35e12, 64 * GB, 450 * GB, 80 * GIB),
            # H200 SXM 141GB: the H100's compute, 4.8 TB/s HBM3e
            HardwareProfile("h200", 989e12, 4.8e12, 64 * GB, 450 * GB, 141 * GB),
            # A100 SXM4 80GB: 312 TFLOP/s dense bf16, 2.04 TB/s HBM2e, PCIe Gen4 x16, NVLink 3
            HardwareProfile("a100", 312e12, 2.039e12, 32 * GB, 300 * GB, 80 * GIB),
            # To be fitted by benchmarks/fit_cpu_profile.py (placeholders until then, see above):
            # "bandwidth" and "FLOP/s" are effective rates, so the efficiencies are 1.
            HardwareProfile(
                "cpu-smollm2",
                peak_flops=5.46e10,
                mem_bandwidth=1.06e10,
                host_bandwidth=2.0 * GB,
                link_bandwidth=2.0 * GB,
                memory_bytes=8 * GIB,
                usable_fraction=1.0,
                flops_efficiency=1.0,
                mem_efficiency=1.0,
                host_efficiency=1.0,
                step_overhead_s=4.0e-3,
                activation_overhead_s=0.5,
                overlap=False,
                synthetic=True,
            ),
        )
    }
)


def get_hardware(name: str) -> HardwareProfile:
    try:
        return HARDWARE[name]
    except KeyError:
        raise SimConfigError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE)}") from None
