"""What the runtime serves: one ``ModelSpec`` per model (the deployment config builds these)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from prism_serve.control.types import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S
from prism_serve.engine.config import DEFAULT_MODEL, ENGINE_DEFAULTS, EngineConfig, PoolingTask
from prism_serve.engine.machine import resolve_dtype
from prism_serve.errors import InvalidRequestError, PrismError

ENGINE_KINDS = ("builtin", "vllm")


class ModelTooLargeError(InvalidRequestError):
    """The model's weights (plus the minimum KV room) fit no configured device's budget."""


class ActivationError(PrismError):
    """A model could not be activated (it fits no device now, or its worker failed)."""

    status_code = 503
    error_type = "service_unavailable"


class UnknownModelError(PrismError):
    """No model is configured under this name."""

    status_code = 404
    error_type = "model_not_found"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model: its name, weights, engine knobs, SLOs and residency settings.

    ``engine`` is the ``EngineConfig`` its worker's engine runs with (the worker sets the KV
    reservation and the device itself); its ``dtype: auto`` is resolved for this machine when the
    spec is made, and its ``model`` is the served name. ``engine_kind`` says which engine."""

    name: str  # what clients ask for
    source: str = DEFAULT_MODEL  # weights: default model, random:<preset>, .gguf, HF dir
    engine: EngineConfig = ENGINE_DEFAULTS
    ttft_slo: float = DEFAULT_TTFT_SLO_S  # s
    tpot_slo: float = DEFAULT_TPOT_SLO_S  # s
    pinned: bool = False  # never evicted by the policy
    kv_limit_bytes: int | None = None  # cap on its KV pages in the device ledger (PoolConfig.limit_bytes)
    keep_alive_s: float | None = None  # evicted after this long idle; negative: never; None: the policy's
    expected_rate: float | None = None  # requests/s expected (the rate estimator's prior); None: none
    engine_kind: str = "builtin"  # builtin, or vllm (vLLM's engine in a vLLM worker; source: an HF directory)
    # sampling settings for requests that leave them out (ModelConfig.sampling_defaults), sorted pairs
    sampling: tuple[tuple[str, float | int], ...] = ()
    # tensor parallel degree: the built-in engine over ``tp`` workers, one per device of the group the
    # placement chose (engine/tensor_parallel.py); its KV is fixed at activation, the same on every rank
    tp: int = 1
    # a model that answers with vectors or scores, not text (task: embed or score,
    # ModelConfig.pooling_task); None: a model that generates
    pooled: PoolingTask | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name.strip() != self.name:
            raise InvalidRequestError(f"bad model name {self.name!r}: empty or surrounded by spaces")
        # auto becomes what this machine runs fast, once, so status and the weight cache show it
        dtype = resolve_dtype(self.engine.dtype)
        if (dtype, self.name) != (self.engine.dtype, self.engine.model):
            object.__setattr__(
                self, "engine", msgspec.structs.replace(self.engine, dtype=dtype, model=self.name)
            )
        if not (self.ttft_slo > 0 and self.tpot_slo > 0):
            raise InvalidRequestError(f"{self.name}: SLOs must be positive")
        if self.engine_kind not in ENGINE_KINDS:
            raise InvalidRequestError(
                f"{self.name}: engine must be builtin or vllm, got {self.engine_kind!r}"
            )
        if self.tp < 1:
            raise InvalidRequestError(f"{self.name}: tp must be at least 1, got {self.tp}")
        if self.tp > 1 and self.engine_kind != "builtin":
            raise InvalidRequestError(
                f"{self.name}: tp: {self.tp} with engine: {self.engine_kind}: vLLM's tensor parallel "
                "executor runs its own workers and memory, not prism's; serve it with tp: 1 or on the "
                "built-in engine"
            )
        if self.tp > 1 and self.engine.max_loras:
            raise InvalidRequestError(f"{self.name}: a tensor parallel model cannot have LoRA adapters yet")
