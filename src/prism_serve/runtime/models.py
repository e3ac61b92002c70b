"""What the runtime serves: one ``ModelSpec`` per model (the deployment config fills these)."""

from __future__ import annotations

from dataclasses import dataclass

from prism_serve.engine.llm_engine import DTYPES
from prism_serve.errors import InvalidRequestError, PrismError
from prism_serve.runtime.messages import EngineArgs


class ModelTooLargeError(InvalidRequestError):
    """The model's weights (plus the minimum KV room) fit no configured device's budget."""


class UnknownModelError(PrismError):
    """No model is configured under this name."""

    status_code = 404
    error_type = "model_not_found"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # what clients ask for
    source: str = "smollm2-135m-instruct"  # weights: default model, random:<preset>, .gguf, HF dir
    dtype: str = "float32"
    seed: int = 0  # random weights
    ttft_slo: float = 1.0  # s
    tpot_slo: float = 0.2  # s
    pinned: bool = False  # never evicted by the policy
    max_model_len: int | None = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name.strip() != self.name:
            raise InvalidRequestError(f"bad model name {self.name!r}: empty or surrounded by spaces")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"{self.name}: dtype must be one of {sorted(DTYPES)}")
        if not (self.ttft_slo > 0 and self.tpot_slo > 0):
            raise InvalidRequestError(f"{self.name}: SLOs must be positive")

    def engine_args(self) -> EngineArgs:
        return EngineArgs(
            dtype=self.dtype,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            seed=self.seed,
            kv_limit_bytes=self.kv_limit_bytes,
        )
