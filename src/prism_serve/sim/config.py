"""The simulator's configuration: every knob of one run, and the per-model SLOs it measures against."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prism_serve.control.loop import RATE_WINDOW_S
from prism_serve.control.types import PLACEMENT_COALESCE_S
from prism_serve.engine.config import GPU_ENGINE_DEFAULTS, EngineConfig
from prism_serve.memory.vmm import DEFAULT_PAGE_SIZE
from prism_serve.sim.cost import COST_MODELS
from prism_serve.sim.errors import SimConfigError
from prism_serve.sim.hardware import get_hardware

__all__ = ["ModelSLO", "SimConfig"]


@dataclass(slots=True, frozen=True)
class ModelSLO:
    ttft_s: float
    tpot_s: float

    def scaled(self, ttft_scale: float, tpot_scale: float | None = None) -> ModelSLO:
        return ModelSLO(
            self.ttft_s * ttft_scale, self.tpot_s * (ttft_scale if tpot_scale is None else tpot_scale)
        )


@dataclass(slots=True, frozen=True)
class SimConfig:
    """Every simulator knob. ``engine`` holds the knobs of every simulated engine, as the live
    runtime's ``EngineConfig`` (block_size, max_num_seqs, max_num_batched_tokens are read), with the
    defaults of a GPU engine (engine/config.py GPU_ENGINE_DEFAULTS: the hardware profiles are GPUs; a
    run that mirrors the live CPU server passes the live models' config); the page is the ledger's
    (memory.vmm.DEFAULT_PAGE_SIZE). ``engine.prefix_caching`` turns the simulated engines' prefix
    cache on where the workload carries prompt block hashes (sim/engine.py)."""

    num_devices: int
    hardware: str = "h100"
    policy: str = "prism"
    knobs: tuple[tuple[str, object], ...] = ()  # policy knobs, as get_policy keyword arguments
    cost_model: str = "roofline"
    tick_s: float = 1.0  # period of policy.place()
    # the placement after a finished activation waits this long, and activations finishing meanwhile
    # share it (live: policy.placement_coalesce_s); a tick in between makes it unneeded; 0: at once
    placement_coalesce_s: float = PLACEMENT_COALESCE_S
    engine: EngineConfig = GPU_ENGINE_DEFAULTS
    page_size: int = DEFAULT_PAGE_SIZE
    max_run_steps: int = 32  # decode steps stretched into one event (engine.py)
    rate_window_s: float = RATE_WINDOW_S
    drain_s: float = 600.0  # after the last arrival, stop at the latest this much later
    warmup_s: float = 5.0  # the workload starts this late: up-front loading is not charged to requests
    # engines with work on one device share its compute (hardware.share_slowdown); False: each steps
    # as if alone (the simulator without compute sharing, kept to compare)
    compute_sharing: bool = True
    # every engine step this many times as long as the hardware profile says (HardwareProfile.slowed):
    # a measured correction for a live setup, such as live engine step seconds over simulated ones
    step_scale: float = 1.0
    # what the policies know of each model's compute demand (ModelSnapshot.profile): "cost-model",
    # the profile the cost model gives for the workload's mean request (and its max_rate); "live",
    # what the live controller knows: control.profiles.measured_profile over the simulated engine's step
    # seconds and requests served, the default ModelProfile before (benchmarks/sim_vs_live.py)
    profiles: str = "cost-model"
    # stop the run once this many requests missed their TTFT SLO: the point's TTFT attainment is
    # below the target that allowed fewer misses (the planner's failing points end early); None: run
    # to the end
    stop_after_ttft_misses: int | None = None
    # simulate only the workload's requests first..end - 1, the first of them at warmup_s (the other
    # requests still set each model's mean request); None: all. The planner's busy-window screen
    span: tuple[int, int] | None = None
    # requests before this index are a warm-up: served, but not counted toward stop_after_ttft_misses
    count_from: int = 0
    # host memory for evicted models' hottest cached prefixes, restored at their next activation
    # (live: policy.kept_prefix_bytes; memory/kept.py's rule); 0 keeps none
    kept_prefix_bytes: int = 0
    # a ``batch`` request's first-token deadline (the live batch lane's: its batch's window), and
    # the tenants' weights in their class's fair share (control/fairness.py; unnamed tenants: 1)
    batch_window_s: float = 86400.0
    tenant_weights: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.profiles not in ("cost-model", "live"):
            raise SimConfigError(f"profiles must be 'cost-model' or 'live', got {self.profiles!r}")
        if not (self.step_scale > 0 and math.isfinite(self.step_scale)):
            raise SimConfigError(f"step_scale must be a positive number, got {self.step_scale}")
        if self.num_devices < 1:
            raise SimConfigError("num_devices must be >= 1")
        if not (self.batch_window_s > 0 and math.isfinite(self.batch_window_s)):
            raise SimConfigError(f"batch_window_s must be a positive number, got {self.batch_window_s}")
        for tenant, weight in self.tenant_weights:
            if not (weight > 0 and math.isfinite(weight)):
                raise SimConfigError(f"tenant {tenant!r}: weight must be a positive number, got {weight}")
        if self.cost_model not in COST_MODELS:
            raise SimConfigError(f"unknown cost model {self.cost_model!r}")
        get_hardware(self.hardware)
        for name in ("page_size", "max_run_steps"):
            if getattr(self, name) < 1:
                raise SimConfigError(f"{name} must be >= 1")
        if not (self.tick_s > 0 and self.rate_window_s > 0 and self.drain_s >= 0 and self.warmup_s >= 0):
            raise SimConfigError("tick_s and rate_window_s must be > 0, drain_s and warmup_s >= 0")
        if not (self.placement_coalesce_s >= 0 and math.isfinite(self.placement_coalesce_s)):
            raise SimConfigError(f"placement_coalesce_s must be >= 0, got {self.placement_coalesce_s}")
