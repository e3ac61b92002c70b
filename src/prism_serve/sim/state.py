"""What the simulator knows of one model (or replica slot): its SLOs, costs, placement, engine and
the counters the live controller's measured profile is built from."""

from __future__ import annotations

from dataclasses import dataclass, field

from prism_serve.control import EngineSnapshot, ModelProfile, ModelState
from prism_serve.control.profiles import StepSums
from prism_serve.engine.kv_cache import KVGroups
from prism_serve.sim.config import ModelSLO
from prism_serve.sim.engine import SimEngine
from prism_serve.sim.models import ServedModel

__all__ = ["SimModel"]


@dataclass(slots=True)
class SimModel:
    served: ServedModel
    slo: ModelSLO
    profile: ModelProfile
    prefill_speed: float
    state: ModelState = ModelState.EVICTED
    placement: tuple[str, ...] = ()
    engine: SimEngine | None = None
    activation_version: int = 0
    pending: bool = False  # activation waiting for memory
    copying: int = 0  # busy units its activation's copy holds on its devices (activation_threads)
    num_queued: int = 0  # in a device queue or deferred
    num_running: int = 0  # dispatched to its engine
    quota: dict[str, int | None] = field(default_factory=dict)
    placed_at: float | None = None  # when the current placement was decided (ModelSnapshot.placed_at)
    activated_at: float | None = None  # idle time counts from here too, as in the live controller
    engine_snapshot: EngineSnapshot | None = None  # cached; rebuilt when the engine is dirty
    # engine step seconds (as stretched by sharing), the same steps alone (the live worker's
    # CPU-timed busy_seconds), and requests served, over every activation: the live controller's
    # measured profile (SimConfig.profiles == "live") is built from the alone seconds
    step_seconds: float = 0.0
    busy_seconds: float = 0.0
    num_served: int = 0
    step_started: float | None = None
    steps: StepSums = field(default_factory=StepSums)  # its decode steps (measured_profile's fit)
    kv_groups: KVGroups | None = None  # how its engine splits its layers' KV (engine/kv_cache.py)
