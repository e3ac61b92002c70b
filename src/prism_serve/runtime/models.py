"""What the runtime serves: one ``ModelSpec`` per model (the deployment config fills these)."""

from __future__ import annotations

from dataclasses import dataclass

from prism_serve.engine.config import DEFAULT_MODEL, DTYPE_NAMES, ENGINE_DEFAULTS, EngineConfig
from prism_serve.engine.machine import resolve_dtype
from prism_serve.errors import InvalidRequestError, PrismError

_E = ENGINE_DEFAULTS


class ModelTooLargeError(InvalidRequestError):
    """The model's weights (plus the minimum KV room) fit no configured device's budget."""


class UnknownModelError(PrismError):
    """No model is configured under this name."""

    status_code = 404
    error_type = "model_not_found"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # what clients ask for
    source: str = DEFAULT_MODEL  # weights: default model, random:<preset>, .gguf, HF dir
    dtype: str = _E.dtype
    seed: int = _E.seed  # random weights
    ttft_slo: float = 1.0  # s
    tpot_slo: float = 0.2  # s
    pinned: bool = False  # never evicted by the policy
    # engine knobs (EngineConfig's fields, with its defaults)
    max_model_len: int | None = _E.max_model_len
    max_num_seqs: int = _E.max_num_seqs
    max_num_batched_tokens: int = _E.max_num_batched_tokens
    block_size: int = _E.block_size
    kv_limit_bytes: int | None = None  # cap on its KV pages in the device ledger (PoolConfig.limit_bytes)
    keep_alive_s: float | None = None  # evicted after this long idle; negative: never; None: the policy's
    engine: str = "builtin"  # builtin, or vllm (vLLM's engine in a vLLM worker; source: an HF directory)

    def __post_init__(self) -> None:
        if not self.name or self.name.strip() != self.name:
            raise InvalidRequestError(f"bad model name {self.name!r}: empty or surrounded by spaces")
        if self.dtype not in DTYPE_NAMES:
            raise InvalidRequestError(f"{self.name}: dtype must be one of {sorted(DTYPE_NAMES)}")
        # auto becomes what this machine runs fast, once, so status and the weight cache show it
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        if not (self.ttft_slo > 0 and self.tpot_slo > 0):
            raise InvalidRequestError(f"{self.name}: SLOs must be positive")
        if self.engine not in ("builtin", "vllm"):
            raise InvalidRequestError(f"{self.name}: engine must be builtin or vllm, got {self.engine!r}")

    def engine_config(self) -> EngineConfig:
        """What the worker's engine runs with (it sets the KV reservation, kv_cache_bytes, itself)."""
        return EngineConfig(
            model=self.name,
            dtype=self.dtype,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            seed=self.seed,
        )
