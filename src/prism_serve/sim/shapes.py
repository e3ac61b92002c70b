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

from pathlib import Path
from typing import Any

from prism_serve.engine.config import DEFAULT_MODEL
from prism_serve.engine.models.config import PRESETS, ArchConfig
from prism_serve.engine.sources import RANDOM_PREFIX, default_gguf_path, gguf_header, hf_config
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
            return shape_from_gguf(DEFAULT_MODEL, *gguf_header(default_gguf_path()), dtype_bytes)
        path = Path(source).expanduser()
        if path.suffix == ".gguf":
            return shape_from_gguf(path.stem, *gguf_header(path), dtype_bytes)
        return shape_from_hf(path.name, hf_config(path), dtype_bytes)
    except (PrismError, KeyError, TypeError, ValueError) as e:
        detail = str(e) if isinstance(e, PrismError) else f"{source}: {type(e).__name__}: {e}"
        raise ShapeError(f"model {model}: cannot read its shape ({detail})") from None


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
    gives its language model)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    layers = int(_first(cfg, "num_hidden_layers", "n_layer", "num_layers"))
    hidden = int(_first(cfg, "hidden_size", "n_embd", "d_model"))
    heads = int(_first(cfg, "num_attention_heads", "n_head"))
    kv_heads = int(_first(cfg, "num_key_value_heads", "num_kv_heads", default=heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // heads))
    num_experts = int(
        _first(cfg, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", default=0)
    )
    expert_ffn = int(_first(cfg, "moe_intermediate_size", "expert_intermediate_size", default=0))
    dense_ffn = int(
        _first(cfg, "intermediate_size_mlp", "intermediate_size", "n_inner", "ffn_dim", default=0)
    )
    if not dense_ffn:
        dense_ffn = expert_ffn or 4 * hidden
    if "kv_lora_rank" in cfg:  # multi-head latent attention: one latent (and its RoPE part) cached
        head_dim = int(cfg.get("qk_nope_head_dim", head_dim)) + int(cfg.get("qk_rope_head_dim", 0))
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))
        kv_heads, cached = heads, latent
    else:
        cached = None
    arch = ArchConfig(
        str(cfg.get("model_type", "decoder")),
        int(_first(cfg, "vocab_size", "padded_vocab_size")),
        hidden,
        dense_ffn,
        layers,
        heads,
        kv_heads,
        head_dim + head_dim % 2,
        int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
    )
    moe = None
    if num_experts > 1:
        k = int(_first(cfg, "num_experts_per_tok", "experts_per_token", "moe_top_k", "num_selected_experts"))
        sparse = layers - int(cfg.get("first_k_dense_replace", 0)) - len(cfg.get("mlp_only_layers") or ())
        step = int(
            _first(cfg, "decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_freq", default=1)
        )
        if step > 1:
            sparse //= step
        shared = int(_first(cfg, "shared_expert_intermediate_size", default=0))
        if not shared and cfg.get("n_shared_experts"):
            shared = int(cfg["n_shared_experts"]) * (expert_ffn or dense_ffn)
        moe = MoE(num_experts, k, expert_ffn or dense_ffn, sparse, shared)
    return _shape(name, arch, dtype_bytes, moe, cached)


def shape_from_gguf(name: str, meta: dict[str, Any], tensors: list[str], dtype_bytes: int) -> ModelShape:
    """A GGUF header's shape (``<arch>.block_count``, ``.embedding_length`` and so on, any
    architecture llama.cpp writes); ``tensors``: its tensor names (no ``output.weight``: the
    embeddings are tied)."""
    arch_name = str(meta["general.architecture"])

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch_name}.{key}", default)
        if value is None:
            raise ShapeError(f"the GGUF header lacks {arch_name}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch_name}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    layers = int(get("block_count"))
    head_dim = int(
        meta.get(f"{arch_name}.attention.key_length") or get("rope.dimension_count", hidden // heads)
    )
    num_experts = int(meta.get(f"{arch_name}.expert_count") or 0)
    expert_ffn = int(meta.get(f"{arch_name}.expert_feed_forward_length") or 0)
    dense_ffn = int(get("feed_forward_length", expert_ffn or 4 * hidden))
    tied = "output.weight" not in tensors
    arch = ArchConfig(
        arch_name,
        int(vocab),
        hidden,
        dense_ffn,
        layers,
        heads,
        int(get("attention.head_count_kv", heads)),
        head_dim + head_dim % 2,
        int(get("context_length", 4096)),
        tie_word_embeddings=tied,
        attention_bias=arch_name == "qwen2",
    )
    moe = None
    if num_experts > 1:
        k = int(get("expert_used_count"))
        sparse = layers - int(meta.get(f"{arch_name}.leading_dense_block_count") or 0)
        shared_count = int(meta.get(f"{arch_name}.expert_shared_count") or 0)
        shared = (
            int(meta.get(f"{arch_name}.expert_shared_feed_forward_length") or 0) or shared_count * expert_ffn
        )
        moe = MoE(num_experts, k, expert_ffn or dense_ffn, sparse, shared)
    latent = meta.get(f"{arch_name}.attention.kv_lora_rank")
    cached = int(latent) + int(meta.get(f"{arch_name}.rope.dimension_count") or 0) if latent else None
    return _shape(name, arch, dtype_bytes, moe, cached)


def _shape(name: str, arch: ArchConfig, dtype_bytes: int, moe: MoE | None, cached: int | None) -> ModelShape:
    return ModelShape(name, arch, dtype_bytes, moe, cached)
