"""Model shapes the simulator serves, and the paper's evaluation setups built from them.

Shapes are the real models' (layer counts, widths, heads, vocabularies); weights never exist here,
only their byte counts. The engine's presets (``engine.models.config.PRESETS``) supply the small
models; the larger ones are added below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prism_serve.engine.models.config import PRESETS, ArchConfig
from prism_serve.sim.errors import SimConfigError

__all__ = ["MODEL_SHAPES", "SETUPS", "ModelShape", "ServedModel", "get_setup", "model_shape"]


@dataclass(slots=True, frozen=True)
class ModelShape:
    """A model shape at a dtype: what memory and compute one token costs (the cost model's view of a
    model; what the live runtime serves is ``runtime.models.ModelSpec``)."""

    name: str
    config: ArchConfig
    dtype_bytes: int = 2  # bf16

    @property
    def num_params(self) -> int:
        return self.config.num_params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token(self.dtype_bytes)

    @property
    def matmul_flops_per_token(self) -> float:
        """2 FLOPs per weight used in a matmul; the input embedding is a lookup, not a matmul."""
        c = self.config
        lookup = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        return 2.0 * (self.num_params - lookup)

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query token, context token) pair over all layers: QK^T and PV."""
        c = self.config
        return 4.0 * c.num_layers * c.num_heads * c.head_dim


@dataclass(slots=True, frozen=True)
class ServedModel:
    """One model of a deployment: a name requests address, its shape and its tensor-parallel size."""

    name: str
    spec: ModelShape
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.tp_size & (self.tp_size - 1):
            raise SimConfigError(f"{self.name}: tp_size must be a power of two, got {self.tp_size}")


def _cfg(arch, vocab, hidden, inter, layers, heads, kv, head_dim, tied=False, bias=False) -> ArchConfig:
    return ArchConfig(
        arch,
        vocab,
        hidden,
        inter,
        layers,
        heads,
        kv,
        head_dim,
        32768,
        tie_word_embeddings=tied,
        attention_bias=bias,
    )


MODEL_SHAPES: Mapping[str, ArchConfig] = MappingProxyType(
    {
        **PRESETS,
        "qwen2.5-14b": _cfg("qwen2", 152064, 5120, 13824, 48, 40, 8, 128, bias=True),
        "qwen2.5-32b": _cfg("qwen2", 152064, 5120, 27648, 64, 40, 8, 128, bias=True),
        "llama-3.1-70b": _cfg("llama", 128256, 8192, 28672, 80, 64, 8, 128),
    }
)


def model_shape(shape: str, dtype_bytes: int = 2) -> ModelShape:
    try:
        return ModelShape(shape, MODEL_SHAPES[shape], dtype_bytes)
    except KeyError:
        raise SimConfigError(
            f"unknown model shape {shape!r}; choose one of {', '.join(MODEL_SHAPES)}"
        ) from None




def _family(shape: str, count: int, tp: int = 1, start: int = 0) -> list[ServedModel]:
    spec = model_shape(shape)
    return [ServedModel(f"{shape}-{i:02d}", spec, tp) for i in range(start, start + count)]


def _setup_8() -> list[ServedModel]:
    """Section 7.3, first and second rows of Figure 7: eight models on two GPUs."""
    return [*_family("llama-3.2-1b", 3), *_family("llama-3.2-3b", 3), *_family("llama-3.1-8b", 2)]


def _setup_18() -> list[ServedModel]:
    """Section 7.3, last row of Figure 7: 18 models of 1B to 8B, each fits one GPU."""
    return [*_family("llama-3.2-1b", 8), *_family("llama-3.2-3b", 6), *_family("llama-3.1-8b", 4)]


def _setup_58() -> list[ServedModel]:
    """Section 7.5 / Table 4: 43 models of 1-3B, 8 of 4-8B, 3 of 9-30B, 4 of 31-70B (32B at TP=4,
    70B at TP=4 and TP=8)."""
    return [
        *_family("llama-3.2-1b", 22),
        *_family("llama-3.2-3b", 21),
        *_family("llama-3.1-8b", 8),
        *_family("qwen2.5-14b", 3),
        *_family("qwen2.5-32b", 2, tp=4),
        *_family("llama-3.1-70b", 1, tp=4),
        *_family("llama-3.1-70b", 1, tp=8, start=1),
    ]


def _setup_cpu() -> list[ServedModel]:
    """Two copies of the project's CPU model (fp32), to check the simulator against a live CPU run."""
    spec = model_shape("smollm2-135m", dtype_bytes=4)
    return [ServedModel(f"smollm2-135m-{i:02d}", spec) for i in range(2)]


SETUPS: Mapping[str, Callable[[], list[ServedModel]]] = MappingProxyType(
    {"paper-8": _setup_8, "paper-18": _setup_18, "paper-58": _setup_58, "cpu-2": _setup_cpu}
)


def get_setup(name: str) -> list[ServedModel]:
    try:
        return SETUPS[name]()
    except KeyError:
        raise SimConfigError(f"unknown setup {name!r}; choose one of {', '.join(SETUPS)}") from None
