"""Shape of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma 2 and 3) or a
BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa: embedders and cross-encoders), read from GGUF
metadata, an HF config.json, or a named preset."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prism_serve.errors import CorruptWeightsError, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency scaling (``rope_type: llama3`` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """A checkpoint's architecture (the HF ``config.json`` / GGUF metadata): what the engine builds.
    Not the deployment's model entry, which is ``prism_serve.config.ModelConfig``."""

    # "llama", "qwen2" (q/k/v bias), "qwen3" (per-head q/k RMSNorm, no bias), "qwen3_moe" (Qwen3's
    # attention, a mixture of experts in every layer), "qwen2_moe" (Qwen2's attention, experts and
    # a shared expert in every layer), "phi3" (Llama's layers; its checkpoints
    # fuse q/k/v and gate/up, which the loaders split into Llama's names), "gemma2" or "gemma3"
    # (GeGLU, norms around attention and MLP both, norm weights as 1 + w, the embedding scaled by
    # sqrt(hidden); Gemma 3 adds Qwen3's head norms); "bert" or "roberta" (an encoder: learned
    # absolute positions, token types, LayerNorm after each residual add, GELU MLP, every linear
    # with a bias, attention over the whole input both ways; rms_norm_eps is its LayerNorm's eps)
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    # A query attends to at most this many tokens (itself and the window - 1 before it) in every
    # layer (Mistral 7B v0.1, Phi-3) or in every layer but ``global_layers`` (Gemma 2 and 3, which
    # alternate windowed and global layers); None: every layer attends to the whole context.
    sliding_window: int | None = None
    global_layers: tuple[int, ...] = ()
    # A mixture of experts instead of the MLP in every layer (num_experts > 0): a router picks
    # experts_per_token of num_experts SwiGLU experts of moe_intermediate_size per token, weighted
    # by their softmax probabilities (renormalised over the chosen ones with norm_topk_prob).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE's shared expert beside the routed ones (0: none): a SwiGLU MLP of this width that
    # every token goes through, its output scaled by sigmoid(a per-token gate) and added
    shared_expert_intermediate_size: int = 0
    # RoPE: the base of the windowed layers where it differs from rope_theta (Gemma 3's local
    # layers); positions divided by rope_linear_factor (``rope_type: linear``) in the other layers
    rope_local_theta: float | None = None
    rope_linear_factor: float = 1.0
    # Gemma: the attention scale is query_pre_attn_scalar ** -0.5 (None: head_dim's), and scores
    # and logits may be soft-capped (x -> cap * tanh(x / cap); Gemma 2's 50 and 30)
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # An encoder's (``encoder``): token types (segments A and B of a pair; 0: no table), where
    # positions start in the position table (RoBERTa's padding index + 1), and the classification
    # head a cross-encoder adds on the first token (num_labels outputs; 0: none, an embedder)
    type_vocab_size: int = 0
    position_offset: int = 0
    num_labels: int = 0

    @property
    def encoder(self) -> bool:
        """A BERT-family encoder: it reads a whole input at once and pools it, and keeps no KV."""
        return self.architecture in ENCODERS

    @property
    def qk_norm(self) -> bool:
        """RMSNorm of each query and key head (over head_dim, one weight shared by the heads) before
        RoPE: Qwen3's, dense and mixture of experts, and Gemma 3's."""
        return self.architecture in ("qwen3", "qwen3_moe", "gemma3")

    @property
    def gemma(self) -> bool:
        """Gemma's layer: GeGLU (tanh-approximated GELU) instead of SwiGLU, RMSNorm weights stored as
        w for a scale of 1 + w, the attention's and the MLP's outputs normed before the residual
        add, and the embedding scaled by sqrt(hidden_size)."""
        return self.architecture in ("gemma2", "gemma3")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention, None for the whole context."""
        return None if layer in self.global_layers else self.sliding_window

    def layer_windows(self, max_positions: int | None = None) -> list[int | None]:
        """Each layer's window as served up to ``max_positions`` (the model's own maximum when
        None): a window no shorter than that never hides a key, so it is none."""
        limit = max_positions or self.max_position_embeddings
        windows = map(self.layer_window, range(self.num_layers))
        return [w if w is not None and w < limit else None for w in windows]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 and not self.encoder:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")
        if any(not 0 <= i < self.num_layers for i in self.global_layers):
            raise UnsupportedModelError(
                f"global_layers {self.global_layers} outside {self.num_layers} layers"
            )

    @property
    def num_params(self) -> int:
        if self.encoder:
            return sum(math.prod(shape) for shape in parameter_shapes(self).values())
        d, h = self.hidden_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += h * (self.num_heads + 2 * self.num_kv_heads)
        if self.num_experts:
            mlp = self.num_experts * (3 * d * self.moe_intermediate_size + d)  # experts and router
            if self.shared_expert_intermediate_size:  # its MLP and its gate
                mlp += 3 * d * self.shared_expert_intermediate_size + d
        else:
            mlp = 3 * d * self.intermediate_size
        layer = attn + mlp + (4 if self.gemma else 2) * d + (2 * h if self.qk_norm else 0)
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + d

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of a decoder layer, by its checkpoint name (what
        a LoRA adapter's modules are: engine/lora.py)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, m = self.hidden_size, self.intermediate_size
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.num_experts:  # adapters of the experts are not supported: attention only
            return attention
        return {**attention, "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}

    def lora_params_per_rank(self, modules: Iterable[str] | None = None) -> int:
        """A LoRA adapter's weights per unit of rank on ``modules`` (None: every projection) of every
        layer: in + out each."""
        shapes = self.projection_shapes()
        return self.num_layers * sum(sum(shapes[m]) for m in (shapes if modules is None else modules))

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(
        cls, meta: dict[str, Any], any_architecture: bool = False, tied: bool = False
    ) -> ArchConfig:
        """The built-in engine's shape of a GGUF header. ``any_architecture``: only the shape of
        whatever architecture llama.cpp wrote (the planner's cost model); ``tied``: the file has no
        ``output.weight`` (the loader, which sees the tensors, ties the head itself)."""
        arch = meta.get("general.architecture")
        if arch == "bert":
            return _gguf_encoder(meta)
        if arch not in BUILT_IN_GGUF and not any_architecture:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported ({', '.join(BUILT_IN_GGUF)})"
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise CorruptWeightsError(f"GGUF metadata lacks {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens") or [])
        # Qwen3's heads are wider than hidden / heads (key_length says so); a llama file without
        # key_length rotates whole heads (its rotary dimension is the head's); Phi's may rotate part.
        rotary = meta.get(f"{arch}.rope.dimension_count")
        head_dim = meta.get(f"{arch}.attention.key_length") or (
            hidden // heads if arch == "phi3" else rotary or hidden // heads
        )
        if rotary is not None and int(rotary) != int(head_dim) and not any_architecture:
            raise UnsupportedModelError(
                f"rotary dimension {rotary} of {head_dim}-wide heads: partial rotary embeddings are not "
                "supported by the built-in engine (serve this model with engine: vllm)"
            )
        return cls(
            architecture=_GGUF_ARCHITECTURES.get(arch, arch),
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            max_position_embeddings=int(get("context_length")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings=tied,
            attention_bias=arch in ("qwen2", "qwen2moe"),
            sliding_window=_window(meta.get(f"{arch}.attention.sliding_window")),
            **(_gguf_experts(meta, arch) if arch in _GGUF_ARCHITECTURES and not any_architecture else {}),
            **(
                _gguf_gemma(meta, arch, hidden // heads, int(head_dim))
                if arch in ("gemma2", "gemma3")
                else {}
            ),
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], any_architecture: bool = False) -> ArchConfig:
        """The built-in engine's shape of an HF config.json. ``any_architecture``: only the shape
        (layers, heads, sizes) of a model another engine runs (vLLM), whatever its type; a
        multimodal config's ``text_config`` gives the language model's."""
        if (any_architecture or cfg.get("model_type") == "gemma3") and isinstance(
            cfg.get("text_config"), dict
        ):
            # Gemma 3's multimodal checkpoints: the language model's config
            cfg = {
                **cfg,
                **cfg["text_config"],
                "model_type": cfg["text_config"].get("model_type", "gemma3_text"),
            }
        model_type = cfg.get("model_type", "llama")
        if model_type in _ENCODER_OF and not any_architecture:
            return _hf_encoder(cfg, _ENCODER_OF[model_type])
        if model_type not in BUILT_IN_HF and not any_architecture:
            raise UnsupportedModelError(
                f"HF model_type {model_type!r} is not supported ({', '.join(BUILT_IN_HF)})"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            scaling, linear = None, 1.0
            # transformers 5 writes the RoPE settings as one ``rope_parameters`` dict
            rope = cfg.get("rope_parameters") or {}
            rope = rope.get("full_attention") or rope  # Gemma 3's, by layer type
            rope_theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
            rs = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            partial = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
            if partial != 1.0 and not any_architecture:
                raise UnsupportedModelError(
                    f"partial_rotary_factor {partial}: partial rotary embeddings are not supported by "
                    "the built-in engine (serve this model with engine: vllm)"
                )
            if rs is not None:
                kind = rs.get("rope_type", rs.get("type"))
                if kind == "llama3":
                    scaling = RopeScaling(
                        factor=float(rs["factor"]),
                        low_freq_factor=float(rs["low_freq_factor"]),
                        high_freq_factor=float(rs["high_freq_factor"]),
                        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                    )
                elif kind == "linear":
                    linear = float(rs["factor"])
                elif kind != "default" and not any_architecture:
                    raise UnsupportedModelError(
                        f"rope_scaling type {kind!r} is not supported (llama3, linear)"
                    )
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            layers = int(cfg["num_hidden_layers"])
            gemma = model_type in ("gemma2", "gemma3_text") and not any_architecture
            return cls(
                architecture=model_type if any_architecture else _ARCHITECTURE_OF.get(model_type, model_type),
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                rope_theta=rope_theta,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(
                    cfg.get("qkv_bias", True)
                    if model_type == "qwen2_moe"
                    else cfg.get("attention_bias", model_type == "qwen2")
                ),
                rope_scaling=scaling,
                rope_linear_factor=linear,
                **(_hf_experts(cfg) if model_type in _MOE_HF and not any_architecture else {}),
                # Qwen2/3 configs name a window they do not use unless use_sliding_window is set
                sliding_window=_window(cfg.get("sliding_window"))
                if model_type in ("mistral", "phi3", "gemma2", "gemma3_text") or cfg.get("use_sliding_window")
                else None,
                **(_hf_gemma(cfg, model_type.removesuffix("_text"), layers, head_dim) if gemma else {}),
            )
        except KeyError as e:
            raise CorruptWeightsError(f"config.json lacks {e.args[0]!r}") from None

    @property
    def hf_model_type(self) -> str:
        """The HF model_type of this shape: Llama's layers with a sliding window are Mistral's."""
        if self.architecture == "llama" and self.sliding_window is not None:
            return "mistral"
        return "gemma3_text" if self.architecture == "gemma3" else self.architecture

    def to_hf_config(self) -> dict[str, Any]:
        """The same shape as an HF config.json dict (used to save checkpoints and build references)."""
        if self.encoder:
            return _encoder_hf_config(self)
        cfg: dict[str, Any] = {
            "model_type": self.hf_model_type,
            "architectures": [_HF_CLASSES[self.hf_model_type]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "gelu_pytorch_tanh" if self.gemma else "silu",
            "pad_token_id": None,  # Phi3Config's default (32000) is past a small vocabulary
        }
        if self.architecture == "qwen2_moe":
            cfg["qkv_bias"] = self.attention_bias
        elif self.architecture != "qwen2":  # Qwen2's config has no such key: its q/k/v always have one
            cfg["attention_bias"] = self.attention_bias
        if self.hf_model_type == "llama":
            cfg["mlp_bias"] = False
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.num_experts:
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
            if self.architecture == "qwen2_moe":
                cfg["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if self.rope_linear_factor != 1.0:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_linear_factor}
        if self.gemma:
            cfg.update(
                hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=_number(self.query_pre_attn_scalar or self.head_dim),
                attn_logit_softcapping=self.attn_softcap,
                final_logit_softcapping=self.final_softcap,
                sliding_window=self.sliding_window,
                layer_types=[
                    "full_attention" if self.layer_window(i) is None else "sliding_attention"
                    for i in range(self.num_layers)
                ],
            )
            if self.architecture == "gemma3":  # transformers 5's RoPE settings by layer type
                full = {"rope_type": "default", "rope_theta": self.rope_theta}
                if self.rope_linear_factor != 1.0:
                    full.update(rope_type="linear", factor=self.rope_linear_factor)
                local = {"rope_type": "default", "rope_theta": self.rope_local_theta or self.rope_theta}
                cfg["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
                cfg.pop("rope_theta"), cfg.pop("rope_scaling", None)
        elif self.architecture in ("phi3", "llama"):  # the key their config classes read
            cfg["sliding_window"] = self.sliding_window
        elif self.sliding_window is not None:
            cfg.update(sliding_window=self.sliding_window, use_sliding_window=True, max_window_layers=0)
        return cfg


def _hf_encoder(cfg: dict[str, Any], architecture: str) -> ArchConfig:
    """A BERT-family encoder's shape from its config.json: an embedder (``BertModel``,
    ``XLMRobertaModel``) or a cross-encoder (``...ForSequenceClassification``: a head of
    ``num_labels`` outputs on the first token)."""
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise UnsupportedModelError(f"an encoder with activation {act!r}: the built-in engine runs gelu")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(
            f"position_embedding_type {cfg['position_embedding_type']!r}: the built-in engine's encoders "
            "have absolute positions"
        )
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        # RoBERTa numbers positions from its padding index + 1: the table's first rows are unused
        offset = int(cfg.get("pad_token_id", 1)) + 1 if architecture == "roberta" else 0
        classifier = any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or ())
        labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2) if classifier else 0
        return ArchConfig(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)) - offset,
            rms_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            position_offset=offset,
            num_labels=labels,
        )
    except KeyError as e:
        raise CorruptWeightsError(f"config.json lacks {e.args[0]!r}") from None


def _gguf_encoder(meta: dict[str, Any]) -> ArchConfig:
    """A BERT-family encoder's shape from a GGUF header as llama.cpp's converter writes it
    (architecture ``bert``: BERT with its WordPiece vocabulary, XLM-RoBERTa with its unigram one):
    its positions start at 0 (the converter cuts off XLM-RoBERTa's unused leading rows), and a
    classifier's outputs are its ``classifier.output_labels`` (the loader, which sees the
    ``cls.output`` tensor, reads them from its shape)."""

    def get(key: str) -> Any:
        value = meta.get(f"bert.{key}")
        if value is None:
            raise CorruptWeightsError(f"GGUF metadata lacks bert.{key}")
        return value

    vocabulary = meta.get("tokenizer.ggml.model")
    if vocabulary not in ("bert", "t5"):  # RoBERTa's byte-level BPE: no rule here adds <s> and </s>
        raise UnsupportedModelError(
            f"a BERT-family GGUF file with a {vocabulary!r} vocabulary: the built-in engine reads BERT's "
            "WordPiece ('bert') and XLM-RoBERTa's unigram ('t5'); serve its HF directory instead"
        )
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = meta.get("bert.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    labels = meta.get("bert.classifier.output_labels") or ()
    return ArchConfig(
        architecture="bert",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(meta.get("bert.attention.layer_norm_epsilon", 1e-12)),
        type_vocab_size=int(meta.get("tokenizer.ggml.token_type_count", 2)),
        num_labels=len(labels),
    )


def _encoder_hf_config(c: ArchConfig) -> dict[str, Any]:
    """An encoder's config.json, as transformers' ``BertConfig`` / ``XLMRobertaConfig`` writes it."""
    head = "ForSequenceClassification" if c.num_labels else "Model"
    family = "Bert" if c.architecture == "bert" else "XLMRoberta"
    cfg: dict[str, Any] = {
        "model_type": "bert" if c.architecture == "bert" else "xlm-roberta",
        "architectures": [family + head],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "max_position_embeddings": c.max_position_embeddings + c.position_offset,
        "type_vocab_size": c.type_vocab_size,
        "layer_norm_eps": c.rms_norm_eps,
        "hidden_act": "gelu",
        "pad_token_id": max(0, c.position_offset - 1),
    }
    if c.num_labels:
        cfg["id2label"] = {str(i): f"LABEL_{i}" for i in range(c.num_labels)}
        cfg["label2id"] = {f"LABEL_{i}": i for i in range(c.num_labels)}
    return cfg


def _hf_experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture of experts of a Qwen3-MoE or Qwen2-MoE config.json (with its shared expert);
    every layer must have one."""
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError(
            "dense layers between the mixture-of-experts ones (mlp_only_layers, decoder_sparse_step) are "
            "not supported by the built-in engine (serve this model with engine: vllm)"
        )
    return {
        "num_experts": int(cfg["num_experts"]),
        "experts_per_token": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)
        if cfg.get("model_type") == "qwen2_moe"
        else 0,
    }


def _gguf_experts(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The same from a GGUF header (llama.cpp normalises Qwen3-MoE's chosen weights, not
    Qwen2-MoE's)."""
    try:
        return {
            "num_experts": int(meta[f"{arch}.expert_count"]),
            "experts_per_token": int(meta[f"{arch}.expert_used_count"]),
            "moe_intermediate_size": int(meta[f"{arch}.expert_feed_forward_length"]),
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", arch == "qwen3moe")),
            "shared_expert_intermediate_size": int(
                meta.get(f"{arch}.expert_shared_feed_forward_length") or 0
            ),
        }
    except KeyError as e:
        raise CorruptWeightsError(f"GGUF metadata lacks {e.args[0]}") from None


def _gguf_gemma(meta: dict[str, Any], arch: str, width: int, head_dim: int) -> dict[str, Any]:
    """Gemma's settings from a GGUF header, where llama.cpp's files leave most of them to its code:
    global layers every 2nd (Gemma 2) or 6th (Gemma 3) unless the file says; Gemma 3's local RoPE
    base 10000; Gemma 2's soft caps 50 and 30 unless the file says; queries scaled by
    hidden / heads instead of head_dim in the 27B models (46 and 62 layers), as llama.cpp does."""
    layers = int(meta[f"{arch}.block_count"])
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _GEMMA_GLOBAL_EVERY[arch])
    if isinstance(pattern, list | tuple):  # one flag per layer, true where it is windowed
        global_layers = tuple(i for i, windowed in enumerate(pattern) if not windowed)
    else:
        global_layers = _every(int(pattern), layers)
    out: dict[str, Any] = {"global_layers": global_layers}
    if layers == (46 if arch == "gemma2" else 62) and width != head_dim:
        out["query_pre_attn_scalar"] = float(width)
    if arch == "gemma2":
        out["attn_softcap"] = float(meta.get(f"{arch}.attn_logit_softcapping", 50.0))
        out["final_softcap"] = float(meta.get(f"{arch}.final_logit_softcapping", 30.0))
    else:
        out["rope_local_theta"] = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            out["rope_linear_factor"] = float(meta[f"{arch}.rope.scaling.factor"])
    return out


def _hf_gemma(cfg: dict[str, Any], model_type: str, layers: int, head_dim: int) -> dict[str, Any]:
    """Gemma's settings from an HF config.json: which layers are global (``layer_types``, or the
    older ``sliding_window_pattern``), the attention scale and soft caps, and Gemma 3's two RoPE
    bases (``rope_parameters`` by layer type in transformers 5, ``rope_local_base_freq`` before)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(
            f"Gemma with activation {act!r}: the built-in engine runs gelu_pytorch_tanh"
        )
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            "bidirectional attention (an embedding model) is not a causal language model"
        )
    types = cfg.get("layer_types")
    if types is None:
        global_layers = _every(
            int(cfg.get("sliding_window_pattern") or _GEMMA_GLOBAL_EVERY[model_type]), layers
        )
    elif len(types) != layers:
        raise CorruptWeightsError(f"layer_types names {len(types)} layers, the model has {layers}")
    else:
        global_layers = tuple(i for i, t in enumerate(types) if t != "sliding_attention")
    scalar = cfg.get("query_pre_attn_scalar")
    out: dict[str, Any] = {
        "global_layers": global_layers,
        "query_pre_attn_scalar": None if scalar is None or float(scalar) == head_dim else float(scalar),
        "attn_softcap": _cap(cfg.get("attn_logit_softcapping")),
        "final_softcap": _cap(cfg.get("final_logit_softcapping")),
    }
    if model_type == "gemma3":
        rope = cfg.get("rope_parameters") or {}
        local = rope.get("sliding_attention") or {}
        out["rope_local_theta"] = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
    return out


# Gemma: every how many layers one attends globally, where a file does not say
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}


def _every(pattern: int, layers: int) -> tuple[int, ...]:
    """The global layers when every ``pattern``-th one is (the others windowed)."""
    return tuple(i for i in range(layers) if i % pattern == pattern - 1)


def _number(x: float) -> int | float:
    """An int where the value is one (what config.json writes, and transformers' configs check)."""
    return int(x) if float(x).is_integer() else x


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def _window(value: Any) -> int | None:
    """A sliding window from a config (None, 0 or a negative number: none)."""
    return int(value) if value is not None and int(value) > 0 else None


# the architectures the built-in engine runs, by GGUF ``general.architecture`` and HF ``model_type``
BUILT_IN_GGUF = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "phi3", "gemma2", "gemma3")
# the mixtures of experts, by GGUF architecture (and their ArchConfig name) and by HF model_type
_GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
_MOE_HF = ("qwen3_moe", "qwen2_moe")
BUILT_IN_HF = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "phi3",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "bert",
    "roberta",
    "xlm-roberta",
)
# the encoders (ArchConfig.architecture), and the HF model_types read as each
ENCODERS = ("bert", "roberta")
_ENCODER_OF = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta"}
# HF model_type -> ArchConfig.architecture where they differ (Mistral's layers are Llama's)
_ARCHITECTURE_OF = {"mistral": "llama", "gemma3_text": "gemma3"}
_HF_CLASSES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
}  # fmt: skip

_LLAMA3_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

# Real model shapes for synthetic (random-weight) experiments. The weights are random; only the
# shapes, and so the memory and compute per token, match the named models.
PRESETS: dict[str, ArchConfig] = {
    "smollm2-135m": ArchConfig(
        "llama", 49152, 576, 1536, 30, 9, 3, 64, 8192, 100000.0, 1e-5, tie_word_embeddings=True
    ),
    "smollm2-360m": ArchConfig(
        "llama", 49152, 960, 2560, 32, 15, 5, 64, 8192, 100000.0, 1e-5, tie_word_embeddings=True
    ),
    "qwen2.5-0.5b": ArchConfig(
        "qwen2",
        151936,
        896,
        4864,
        24,
        14,
        2,
        64,
        32768,
        1000000.0,
        1e-6,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
    "qwen3-0.6b": ArchConfig(
        "qwen3",
        151936,
        1024,
        3072,
        28,
        16,
        8,
        128,
        40960,
        1000000.0,
        1e-6,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": ArchConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 40960, 1000000.0, 1e-6),
    "qwen3-30b-a3b": ArchConfig(
        "qwen3_moe",
        151936,
        2048,
        6144,
        48,
        32,
        4,
        128,
        40960,
        1000000.0,
        1e-6,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # 60 small experts (4 per token) and a shared expert 4x their width in every layer
    "qwen1.5-moe-a2.7b": ArchConfig(
        "qwen2_moe",
        151936,
        2048,
        5632,
        24,
        16,
        16,
        128,
        8192,
        1000000.0,
        1e-6,
        attention_bias=True,
        num_experts=60,
        experts_per_token=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
    ),
    # Gemma: windowed layers (every 6th global in Gemma 3, every 2nd in Gemma 2), tied embeddings
    "gemma-3-1b": ArchConfig(
        "gemma3",
        262144,
        1152,
        6912,
        26,
        4,
        1,
        256,
        32768,
        1000000.0,
        1e-6,
        tie_word_embeddings=True,
        sliding_window=512,
        global_layers=(5, 11, 17, 23),
        rope_local_theta=10000.0,
    ),
    "gemma-2-2b": ArchConfig(
        "gemma2",
        256000,
        2304,
        9216,
        26,
        8,
        4,
        256,
        8192,
        10000.0,
        1e-6,
        tie_word_embeddings=True,
        sliding_window=4096,
        global_layers=tuple(range(1, 26, 2)),
        attn_softcap=50.0,
        final_softcap=30.0,
    ),
    "llama-3.2-1b": ArchConfig(
        "llama",
        128256,
        2048,
        8192,
        16,
        32,
        8,
        64,
        131072,
        500000.0,
        1e-5,
        tie_word_embeddings=True,
        rope_scaling=_LLAMA3_SCALING,
    ),
    "llama-3.2-3b": ArchConfig(
        "llama",
        128256,
        3072,
        8192,
        28,
        24,
        8,
        128,
        131072,
        500000.0,
        1e-5,
        tie_word_embeddings=True,
        rope_scaling=_LLAMA3_SCALING,
    ),
    "llama-3.1-8b": ArchConfig(
        "llama",
        128256,
        4096,
        14336,
        32,
        32,
        8,
        128,
        131072,
        500000.0,
        1e-5,
        rope_scaling=dataclasses.replace(_LLAMA3_SCALING, factor=8.0),
    ),
    # the larger models of the Prism paper's evaluation (simulated, or served with tensor parallelism)
    "qwen2.5-14b": ArchConfig(
        "qwen2", 152064, 5120, 13824, 48, 40, 8, 128, 32768, 1000000.0, 1e-6, attention_bias=True
    ),
    "qwen2.5-32b": ArchConfig(
        "qwen2", 152064, 5120, 27648, 64, 40, 8, 128, 32768, 1000000.0, 1e-6, attention_bias=True
    ),
    "llama-3.1-70b": ArchConfig(
        "llama",
        128256,
        8192,
        28672,
        80,
        64,
        8,
        128,
        131072,
        500000.0,
        1e-5,
        rope_scaling=dataclasses.replace(_LLAMA3_SCALING, factor=8.0),
    ),
}


def encoder_shapes(config: ArchConfig) -> dict[str, tuple[int, ...]]:
    """An encoder's tensors under BERT's names without the model prefix (the loaders strip
    ``bert.`` / ``roberta.`` and name RoBERTa's classification head as BERT's pooler and
    classifier: the same two linears, tanh between)."""
    d, m = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (config.vocab_size, d),
        "embeddings.position_embeddings.weight": (config.max_position_embeddings + config.position_offset, d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
    }
    if config.type_vocab_size:
        shapes["embeddings.token_type_embeddings.weight"] = (config.type_vocab_size, d)
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense"):  # fmt: skip
            shapes[p + name + ".weight"], shapes[p + name + ".bias"] = (d, d), (d,)
        shapes[p + "intermediate.dense.weight"], shapes[p + "intermediate.dense.bias"] = (m, d), (m,)
        shapes[p + "output.dense.weight"], shapes[p + "output.dense.bias"] = (d, m), (d,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[p + norm + ".weight"], shapes[p + norm + ".bias"] = (d,), (d,)
    if config.num_labels:
        shapes["pooler.dense.weight"], shapes["pooler.dense.bias"] = (d, d), (d,)
        shapes["classifier.weight"] = (config.num_labels, d)
        shapes["classifier.bias"] = (config.num_labels,)
    return shapes


def parameter_shapes(config: ArchConfig) -> dict[str, tuple[int, ...]]:
    if config.encoder:
        return encoder_shapes(config)
    d, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if config.gemma:  # Gemma's post_attention_layernorm norms the attention's output
            shapes[p + "pre_feedforward_layernorm.weight"] = (d,)
            shapes[p + "post_feedforward_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, d)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_out)
        if config.num_experts:  # transformers' own layout: each layer's experts in one tensor
            e, m = config.num_experts, config.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (e, d)
            shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * m, d)
            shapes[p + "mlp.experts.down_proj"] = (e, d, m)
            if s := config.shared_expert_intermediate_size:
                shapes[p + "mlp.shared_expert.gate_proj.weight"] = (s, d)
                shapes[p + "mlp.shared_expert.up_proj.weight"] = (s, d)
                shapes[p + "mlp.shared_expert.down_proj.weight"] = (d, s)
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, d)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, d)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, d)
        shapes[p + "mlp.down_proj.weight"] = (d, config.intermediate_size)
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes
