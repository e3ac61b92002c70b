"""The model classes the built-in engine runs, and the one place that picks between them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from prism_serve.engine.models.bert import BertModel
    from prism_serve.engine.models.config import ArchConfig
    from prism_serve.engine.models.llama import LlamaForCausalLM

    Model = LlamaForCausalLM | BertModel

__all__ = ["build_model", "model_from_packed"]


def build_model(
    config: ArchConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
    max_positions: int | None = None, rope_freq_factors: torch.Tensor | None = None,
) -> Model:  # fmt: skip
    """The model of ``config`` over a checkpoint's tensors: a decoder, or an encoder (BERT family)."""
    if config.encoder:
        from prism_serve.engine.models.bert import BertModel

        return BertModel(config, tensors, dtype, max_positions)
    from prism_serve.engine.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(config, tensors, dtype, max_positions, rope_freq_factors)


def model_from_packed(
    config: ArchConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int | None = None
) -> Model:
    """The model over tensors in its own packed layout (``packed_tensors()``), used in place."""
    if config.encoder:
        from prism_serve.engine.models.bert import BertModel

        return BertModel.from_packed(config, tensors, dtype, max_positions)
    from prism_serve.engine.models.llama import LlamaForCausalLM

    return LlamaForCausalLM.from_packed(config, tensors, dtype, max_positions)
