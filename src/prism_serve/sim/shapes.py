"""A served model's shape for the cost model, read from what its deployment entry names: the
header of a GGUF file, the config.json of a Hugging Face directory (any decoder architecture,
mixture-of-experts included), a ``random:`` preset, or the default model. Only metadata is read,
never a tensor; the weights need not fit this machine.

What is read: layers, hidden size, attention heads, KV heads, head dim, the FFN width, vocabulary,
tied embeddings, and for a mixture-of-experts model the experts, the experts each token uses, the
expert FFN width, the shared experts and which layers are sparse. A multi-head latent attention
model (DeepSeek's ``kv_lora_rank``) caches one latent per token and layer, which is what its KV
bytes count. Weights are counted at the deployment's dtype (a quantized GGUF is served dequantized).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from prism_serve.engine.config import DEFAULT_MODEL
from prism_serve.engine.models.config import PRESETS, ArchConfig
from prism_serve.engine.sources import RANDOM_PREFIX, default_gguf_path, file_version, gguf_header, hf_config
from prism_serve.errors import PrismError
from prism_serve.sim.errors import SimConfigError
from prism_serve.sim.models import ModelShape, MoE

__all__ = ["ShapeError", "shape_from_gguf", "shape_from_hf", "shape_of"]


class ShapeError(SimConfigError):
    """A model's shape cannot be read (the message names the model and the file)."""


def shape_of(model: str, source: str, dtype_bytes: int) -> ModelShape:
    """The shape of deployment entry ``model`` whose weights are ``source``."""
    try:
        if source.startswith(RANDOM_PREFIX):
            preset = source.removeprefix(RANDOM_PREFIX)
            if preset not in PRESETS:
                raise ShapeError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
            return ModelShape(preset, PRESETS[preset], dtype_bytes)
        if source in (DEFAULT_MODEL, "default"):
            return _gguf_shape(DEFAULT_MODEL, default_gguf_path(), dtype_bytes)
        path = Path(source).expanduser()
        if path.suffix == ".gguf":
            return _gguf_shape(path.stem, path, dtype_bytes)
        return shape_from_hf(path.name, hf_config(path), dtype_bytes)
    except (PrismError, KeyError, TypeError, ValueError) as e:
        detail = str(e) if isinstance(e, PrismError) else f"{type(e).__name__}: {e}"
        if source not in detail and str(Path(source).expanduser()) not in detail:
            detail = f"{source}: {detail}"
        raise ShapeError(f"model {model}: cannot read its shape ({detail})") from None


def _gguf_shape(name: str, path: Path, dtype_bytes: int) -> ModelShape:
    """A GGUF file's shape, read once per file version: the gguf package parses every metadata
    field, the 49k-string vocabulary included, which takes seconds; a plan or a config check reads
    the same file for every model that names it."""
    try:
        version = file_version(path)
    except OSError:
        return shape_from_gguf(name, *gguf_header(path), dtype_bytes)  # its error names the file
    return _gguf_shape_of(name, str(path), version, dtype_bytes)


@functools.lru_cache(maxsize=64)
def _gguf_shape_of(name: str, path: str, version: tuple[int, int, int], dtype_bytes: int) -> ModelShape:
    return shape_from_gguf(name, *gguf_header(Path(path)), dtype_bytes)


_NEEDED = object()


def _first(cfg: dict[str, Any], *keys: str, default: Any = _NEEDED) -> Any:
    """The first of ``keys`` the config has; without a default, one of them must be there."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is _NEEDED:
        raise ShapeError(f"config.json has none of {', '.join(keys)}")
    return default


def shape_from_hf(name: str, cfg: dict[str, Any], dtype_bytes: int) -> ModelShape:
    """An HF config.json's shape, whatever ``model_type`` (a multimodal config's ``text_config``
    gives its language model): the engine's reading of it (``ArchConfig.from_hf_config``), with
    the experts and the latent KV it does not model."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    num_experts = int(
        _first(cfg, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", default=0)
    )
    expert_ffn = int(_first(cfg, "moe_intermediate_size", "expert_intermediate_size", default=0))
    dense = {
        "intermediate_size": _first(cfg, "intermediate_size_mlp", "intermediate_size", default=expert_ffn)
    }
    arch = ArchConfig.from_hf_config({**cfg, **dense}, any_architecture=True)
    latent = None
    if "kv_lora_rank" in cfg:  # multi-head latent attention: one latent (and its RoPE part) cached
        rope = int(cfg.get("qk_rope_head_dim", 0))
        head_dim = int(cfg.get("qk_nope_head_dim", arch.head_dim)) + rope
        arch = dataclasses.replace(arch, num_kv_heads=arch.num_heads, head_dim=head_dim + head_dim % 2)
        latent = int(cfg["kv_lora_rank"]) + rope
    moe = None
    if num_experts > 1:
        k = int(_first(cfg, "num_experts_per_tok", "experts_per_token", "moe_top_k", "num_selected_experts"))
        sparse = (
            arch.num_layers - int(cfg.get("first_k_dense_replace", 0)) - len(cfg.get("mlp_only_layers") or ())
        )
        step = int(
            _first(cfg, "decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_freq", default=1)
        )
        if step > 1:
            sparse //= step
        shared = int(_first(cfg, "shared_expert_intermediate_size", default=0))
        if not shared and cfg.get("n_shared_experts"):
            shared = int(cfg["n_shared_experts"]) * (expert_ffn or arch.intermediate_size)
        moe = MoE(num_experts, k, expert_ffn or arch.intermediate_size, sparse, shared)
    return ModelShape(name, arch, dtype_bytes, moe, latent)


def shape_from_gguf(name: str, meta: dict[str, Any], tensors: list[str], dtype_bytes: int) -> ModelShape:
    """A GGUF header's shape, any architecture llama.cpp writes: the engine's reading of it
    (``ArchConfig.from_gguf_metadata``), with the experts and the latent KV; ``tensors``: its
    tensor names (no ``output.weight``: the embeddings are tied)."""
    arch_name = str(meta["general.architecture"])

    def opt(key: str) -> int:
        return int(meta.get(f"{arch_name}.{key}") or 0)

    expert_ffn = opt("expert_feed_forward_length")
    if expert_ffn and f"{arch_name}.feed_forward_length" not in meta:
        meta = {**meta, f"{arch_name}.feed_forward_length": expert_ffn}
    arch = ArchConfig.from_gguf_metadata(meta, any_architecture=True, tied="output.weight" not in tensors)
    moe = None
    if opt("expert_count") > 1:
        shared = opt("expert_shared_feed_forward_length") or opt("expert_shared_count") * expert_ffn
        sparse = arch.num_layers - opt("leading_dense_block_count")
        moe = MoE(
            opt("expert_count"),
            opt("expert_used_count"),
            expert_ffn or arch.intermediate_size,
            sparse,
            shared,
        )
    latent = opt("attention.kv_lora_rank")
    return ModelShape(name, arch, dtype_bytes, moe, latent + opt("rope.dimension_count") if latent else None)
