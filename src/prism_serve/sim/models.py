"""Model shapes the simulator serves: what memory and compute one token of a model costs.

Shapes are the real models' (layer counts, widths, heads, vocabularies); weights never exist here,
only their byte counts. Named shapes are the engine's presets (``engine.models.config.PRESETS``);
sim/shapes.py reads any other from a model's weights' metadata, and sim/deployment.py makes a
deployment config's models of them (the paper's setups are such configs: sim/presets/).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prism_serve.engine.models.config import PRESETS, ArchConfig
from prism_serve.sim.errors import SimConfigError

__all__ = ["MODEL_SHAPES", "MoE", "ModelShape", "ServedModel", "model_shape"]


@dataclass(slots=True, frozen=True)
class MoE:
    """A mixture-of-experts model's feed-forward: in ``num_layers`` of its layers each token goes to
    ``experts_per_token`` of ``num_experts`` experts (each ``expert_ffn`` wide) plus the shared
    experts (``shared_ffn`` wide in all); its other layers have the dense ``ArchConfig``'s FFN."""

    num_experts: int
    experts_per_token: int
    expert_ffn: int
    num_layers: int
    shared_ffn: int = 0

    def __post_init__(self) -> None:
        ok = 0 < self.experts_per_token <= self.num_experts and self.expert_ffn > 0 and self.num_layers > 0
        if not ok:
            raise SimConfigError(f"bad mixture-of-experts shape: {self}")


@dataclass(slots=True, frozen=True)
class ModelShape:
    """A model shape at a dtype: what memory and compute one token costs (the cost model's view of a
    model; what the live runtime serves is ``runtime.models.ModelSpec``). A mixture-of-experts
    model (``moe``) holds every expert in memory but computes with the few each token is routed to."""

    name: str
    config: ArchConfig
    dtype_bytes: int = 2  # bf16
    moe: MoE | None = None
    # elements cached per token and layer when not a K and a V per KV head: multi-head latent
    # attention caches one latent vector (and its RoPE part)
    latent_kv: int | None = None
    # LoRA adapters over this model (runtime/adapters.py): the slots beside its weights (memory
    # only), and the weights of one adapter, which a step reads and each token computes with
    adapter_slot_bytes: int = 0
    adapter_params: int = 0

    @property
    def num_params(self) -> int:
        """Every weight (what memory holds)."""
        return self.config.num_params + self._moe_params(self.moe.num_experts if self.moe else 0)

    @property
    def active_params(self) -> int:
        """The weights one token is computed with."""
        return self.config.num_params + self._moe_params(self.moe.experts_per_token if self.moe else 0)

    @property
    def expert_params(self) -> int:
        """The routed experts' weights (0 for a dense model): a step reads those its tokens chose."""
        m = self.moe
        return 0 if m is None else 3 * self.config.hidden_size * m.expert_ffn * m.num_experts * m.num_layers

    def _moe_params(self, experts: int) -> int:
        """What the MoE layers change against the dense config: their dense FFN replaced by
        ``experts`` routed experts, the shared experts and the router."""
        m = self.moe
        if m is None:
            return 0
        d = self.config.hidden_size
        dense_ffn = 3 * d * self.config.intermediate_size
        moe_ffn = 3 * d * (m.expert_ffn * experts + m.shared_ffn) + d * m.num_experts
        return m.num_layers * (moe_ffn - dense_ffn)

    @property
    def weight_bytes(self) -> int:
        """What a device holds for it besides KV: the weights and any adapter slots."""
        return self.num_params * self.dtype_bytes + self.adapter_slot_bytes

    @property
    def step_read_bytes(self) -> int:
        """The weights one step streams (a dense model's; a MoE model's experts are apart): the
        base's and one adapter's, not the empty slots."""
        return (self.num_params - self.expert_params + self.adapter_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        if self.latent_kv is not None:
            return self.config.num_layers * self.latent_kv * self.dtype_bytes
        return self.config.kv_bytes_per_token(self.dtype_bytes)

    @property
    def engine_kv_bytes_per_token(self) -> int:
        """What its engine keeps for a token: ``kv_bytes_per_token``, but nothing for an encoder,
        which reads each input whole and pools it (the live control plane's ``ModelEntry.encoder``)."""
        return 0 if self.config.encoder else self.kv_bytes_per_token

    @property
    def matmul_flops_per_token(self) -> float:
        """2 FLOPs per weight used in a matmul; the input embedding is a lookup, not a matmul."""
        c = self.config
        lookup = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        return 2.0 * (self.active_params + self.adapter_params - lookup)

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query token, context token) pair over all layers: QK^T and PV."""
        c = self.config
        return 4.0 * c.num_layers * c.num_heads * c.head_dim

    def experts_read(self, tokens: float) -> float:
        """The share of the routed experts a step of ``tokens`` tokens reads (each token picks its
        experts independently of the others): 1 - (1 - k / E) ** tokens; 0 for a dense model."""
        m = self.moe
        return 0.0 if m is None else 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** tokens


@dataclass(slots=True, frozen=True)
class ServedModel:
    """One model of a deployment: a name requests address, its shape and its tensor-parallel size."""

    name: str
    spec: ModelShape
    tp_size: int = 1
    expected_rate: float | None = None  # the config's expected_rate (the rate estimator's prior)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.tp_size & (self.tp_size - 1):
            raise SimConfigError(f"{self.name}: tp_size must be a power of two, got {self.tp_size}")
        if self.expected_rate is not None and not (0 <= self.expected_rate < float("inf")):
            raise SimConfigError(f"{self.name}: expected_rate must be finite and >= 0")


MODEL_SHAPES: Mapping[str, ArchConfig] = MappingProxyType(dict(PRESETS))


def model_shape(shape: str, dtype_bytes: int = 2) -> ModelShape:
    try:
        return ModelShape(shape, MODEL_SHAPES[shape], dtype_bytes)
    except KeyError:
        raise SimConfigError(
            f"unknown model shape {shape!r}; choose one of {', '.join(MODEL_SHAPES)}"
        ) from None
