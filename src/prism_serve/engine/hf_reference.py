"""HF transformers models built from our loaded weights: the reference our logits are tested
against and the baseline the throughput benchmark compares with. transformers is a test/bench
dependency only, imported here lazily."""

from __future__ import annotations

from typing import Any

import torch

from prism_serve.engine.weights import LoadedWeights, fused_checkpoint


def build_hf_model(weights: LoadedWeights, dtype: torch.dtype = torch.float32) -> Any:
    """An HF ``LlamaForCausalLM`` (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``,
    ``Phi3ForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``) holding exactly
    ``weights.tensors`` (under the checkpoint's names: Phi-3's fused)."""
    import transformers

    cfg_dict = weights.config.to_hf_config()
    cls_name = cfg_dict["architectures"][0]
    kwargs = {k: v for k, v in cfg_dict.items() if k not in ("model_type", "architectures")}
    config = transformers.AutoConfig.for_model(cfg_dict["model_type"], **kwargs)
    # SDPA cannot soft-cap scores: transformers computes Gemma 2's attention eagerly
    config._attn_implementation = "eager" if weights.config.attn_softcap else "sdpa"
    model = getattr(transformers, cls_name)(config)
    state = {k: v.to(dtype) for k, v in fused_checkpoint(weights.config, weights.tensors).items()}
    if weights.config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise RuntimeError(f"HF model does not match our weights: missing={missing} unexpected={unexpected}")
    return model.to(dtype).eval()
