"""BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa): embedders such as bge, gte and e5, and
cross-encoders (a classification head on the first token: bge-reranker, ms-marco MiniLM).

An encoder reads its whole input at once, every token attending to every other, so the engine
schedules an encoder's request whole, in one step, and keeps no KV for it (the scheduler gives it
no blocks). A step's inputs are packed one after another, as a decoder's prefill chunks are; each
attends within itself (one SDPA call per input). Plain tensors, as the decoder (models/llama.py):
q/k/v fused into one matmul, numerics as transformers' ``BertModel`` in fp32 (LayerNorm after each
residual add, exact GELU), which tests/engine/test_encoders.py checks against sentence-transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from prism_serve.engine.attention import AttentionMetadata
from prism_serve.engine.kv_cache import KVCache
from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.models.llama import Linear, check_shapes
from prism_serve.errors import CorruptWeightsError, UnsupportedModelError

_LINEARS = ("qkv", "attn_out", "up", "down")
_NORMS = ("attn_norm", "out_norm")  # each a (weight, bias) pair


class EncoderLayer:
    __slots__ = ("attn_norm", "attn_out", "down", "out_norm", "qkv", "up")


class BertModel:
    """The encoder. Built from checkpoint tensors (``__init__``: names of ``encoder_shapes``), or
    from tensors already in its own layout (``from_packed``: no copy, for activation)."""

    encoder = True
    plain_attention = False  # bidirectional: the CUDA decode/prefill kernels are causal

    def __init__(
        self,
        config: ArchConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
    ) -> None:
        check_shapes(config, tensors)
        packed: dict[str, torch.Tensor] = {}
        lin: dict[str, Linear] = {}

        def linear(name: str, *parts: str) -> None:
            w = torch.cat([tensors[p + ".weight"] for p in parts])
            b = torch.cat([tensors[p + ".bias"] for p in parts])
            lin[name] = Linear(w, b, dtype)

        for i in range(config.num_layers):
            p = f"encoder.layer.{i}."
            linear(f"layers.{i}.qkv", *(p + f"attention.self.{n}" for n in ("query", "key", "value")))
            linear(f"layers.{i}.attn_out", p + "attention.output.dense")
            linear(f"layers.{i}.up", p + "intermediate.dense")
            linear(f"layers.{i}.down", p + "output.dense")
            for name, src in (("attn_norm", "attention.output.LayerNorm"), ("out_norm", "output.LayerNorm")):
                packed[f"layers.{i}.{name}"] = tensors[p + src + ".weight"].to(dtype).contiguous()
                packed[f"layers.{i}.{name}.bias"] = tensors[p + src + ".bias"].to(dtype).contiguous()
        if config.num_labels:
            linear("pooler", "pooler.dense")
            linear("classifier", "classifier")
        for name, layer in lin.items():
            packed[name] = layer.weight
            packed[name + ".bias"] = layer.bias  # type: ignore[assignment]
        for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
            key = f"embeddings.{name}.weight"
            if key in tensors:
                packed[name] = tensors[key].to(dtype).contiguous()
        packed["embed_norm"] = tensors["embeddings.LayerNorm.weight"].to(dtype).contiguous()
        packed["embed_norm.bias"] = tensors["embeddings.LayerNorm.bias"].to(dtype).contiguous()
        self._build(config, packed, dtype, max_positions)

    def _build(
        self, config: ArchConfig, t: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int | None
    ) -> None:
        self.config, self.dtype = config, dtype
        self.reduce: Callable[[torch.Tensor], None] | None = None
        self.scale = config.head_dim**-0.5
        self.max_positions = min(
            max_positions or config.max_position_embeddings, config.max_position_embeddings
        )
        transposed = dtype == torch.float32
        self.word, self.position = t["word_embeddings"], t["position_embeddings"]
        self.token_type = t.get("token_type_embeddings")
        self.embed_norm = (t["embed_norm"], t["embed_norm.bias"])
        self.norm = self.embed_norm[0]  # where the model lives (the engine reads its device)
        self.layers = []
        for i in range(config.num_layers):
            layer = EncoderLayer()
            for name in _LINEARS:
                key = f"layers.{i}.{name}"
                setattr(layer, name, Linear.laid_out(t[key], t[key + ".bias"], transposed))
            for name in _NORMS:
                key = f"layers.{i}.{name}"
                setattr(layer, name, (t[key], t[key + ".bias"]))
            self.layers.append(layer)
        self.pooler = self.classifier = None
        if config.num_labels:
            self.pooler = Linear.laid_out(t["pooler"], t["pooler.bias"], transposed)
            self.classifier = Linear.laid_out(t["classifier"], t["classifier.bias"], transposed)

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the forward pass reads, in its final layout, by a stable name (what
        ``from_packed`` takes; the runtime's host weight cache stores this)."""
        out = {"word_embeddings": self.word, "position_embeddings": self.position,
               "embed_norm": self.embed_norm[0], "embed_norm.bias": self.embed_norm[1]}  # fmt: skip
        if self.token_type is not None:
            out["token_type_embeddings"] = self.token_type
        for i, layer in enumerate(self.layers):
            for name in _LINEARS:
                out[f"layers.{i}.{name}"] = getattr(layer, name).weight
                out[f"layers.{i}.{name}.bias"] = getattr(layer, name).bias
            for name in _NORMS:
                out[f"layers.{i}.{name}"], out[f"layers.{i}.{name}.bias"] = getattr(layer, name)
        for name in ("pooler", "classifier"):
            if getattr(self, name) is not None:
                out[name], out[name + ".bias"] = getattr(self, name).weight, getattr(self, name).bias
        return out

    @classmethod
    def from_packed(
        cls, config: ArchConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
        max_positions: int | None = None,
    ) -> BertModel:  # fmt: skip
        needed = ["word_embeddings", "position_embeddings", "embed_norm"]
        needed += [f"layers.{i}.{n}" for i in range(config.num_layers) for n in _LINEARS + _NORMS]
        needed += ["pooler", "classifier"] if config.num_labels else []
        missing = [n for n in needed if n not in tensors]
        if missing:
            raise CorruptWeightsError(f"packed encoder weights lack {missing[:3]} for this config")
        self = cls.__new__(cls)
        self._build(config, tensors, dtype, max_positions)
        return self

    def to(self, device: torch.device) -> BertModel:
        if self.norm.device == device:
            return self
        packed = {name: t.to(device) for name, t in self.packed_tensors().items()}
        return BertModel.from_packed(self.config, packed, self.dtype, self.max_positions)

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.packed_tensors().values()

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]: the step's inputs one after another
        positions: torch.Tensor,  # [T]: each token's place in its input, from 0
        meta: AttentionMetadata,  # ``prefills``: one chunk per input, each its whole input
        kv_cache: KVCache | None = None,  # unused: an encoder keeps no KV
        lora: object = None,
    ) -> torch.Tensor:
        """The last layer's hidden states, [T, hidden]."""
        if lora is not None:
            raise UnsupportedModelError("LoRA adapters of an encoder are not supported")
        c = self.config
        eps = c.rms_norm_eps
        x = self.word.index_select(0, input_ids) + self.position.index_select(
            0, positions + c.position_offset
        )
        if self.token_type is not None:
            types = meta.token_types if meta.token_types is not None else torch.zeros_like(input_ids)
            x += self.token_type.index_select(0, types)
        x = F.layer_norm(x, x.shape[-1:], *self.embed_norm, eps)
        heads, hd = c.num_heads, c.head_dim
        for layer in self.layers:
            q, k, v = layer.qkv(x).view(-1, 3, heads, hd).unbind(1)
            attn = torch.empty_like(q)
            for chunk in meta.prefills:
                rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
                # [1, heads, n, hd]: every token of the input attends to all of it
                qc, kc, vc = (t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                out = F.scaled_dot_product_attention(qc, kc, vc, scale=self.scale)
                attn[rows] = out.squeeze(0).transpose(0, 1)
            x = F.layer_norm(
                x + layer.attn_out(attn.view(-1, heads * hd)), x.shape[-1:], *layer.attn_norm, eps
            )
            h = F.gelu(layer.up(x))
            x = F.layer_norm(x + layer.down(h), x.shape[-1:], *layer.out_norm, eps)
        return x

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's outputs for first-token hidden states [n, hidden]: [n, num_labels]."""
        if self.pooler is None or self.classifier is None:
            raise UnsupportedModelError("this encoder has no classification head")
        x = first.to(self.dtype)
        return self.classifier(torch.tanh(self.pooler(x))).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise UnsupportedModelError("an encoder has no language-model head: it embeds or scores")
