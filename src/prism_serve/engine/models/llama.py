"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 via ``attention_bias``, Qwen3 via
``qk_norm``, Qwen3-MoE and Qwen2-MoE via ``num_experts``, Phi-3, Gemma 2 and 3 via ``gemma``) over
a paged KV cache.

Plain tensors rather than nn.Modules: the forward pass is a short loop and module call overhead is
measurable at one token per step on a CPU. Q/K/V and gate/up projections are fused into single
matmuls. Numerics follow HF ``LlamaForCausalLM`` (RMSNorm in fp32, RoPE cos/sin computed in fp32
then cast), which the tests check logit by logit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from prism_serve.engine import cpu_kernels
from prism_serve.engine.attention import AttentionMetadata, paged_attention
from prism_serve.engine.kv_cache import KVCache
from prism_serve.engine.lora import LoraRows
from prism_serve.engine.models.config import ArchConfig, RopeScaling, parameter_shapes
from prism_serve.errors import CorruptWeightsError


def _onednn_linear():
    """torch's oneDNN linear (``mkldnn._linear_pointwise``, the kernel torch's own compiler emits for
    CPU linears) where this torch build has it, else None. fp32 matmuls go through it unless
    ``PRISM_CPU_GEMM=blas``: the BLAS path (``x @ W``, MKL) runs AVX2 kernels on AMD CPUs, and on an
    AVX-512 EPYC oneDNN was 2-3x faster at 8-256 rows and 0.96-1.14x at one row
    (docs/results.md, "The engine alone and its CPU kernels"). The results differ from BLAS only in
    summation order (about 1e-4 absolute on this model's activations)."""
    choice = os.environ.get("PRISM_CPU_GEMM", "auto")
    if choice not in ("auto", "onednn", "blas"):
        raise ValueError(f"PRISM_CPU_GEMM must be auto, onednn or blas, got {choice!r}")
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if choice == "blas" or not torch.backends.mkldnn.is_available() or op is None:
        if choice == "onednn":
            raise RuntimeError("PRISM_CPU_GEMM=onednn, but this torch build has no oneDNN linear")
        return None
    return op


_ONEDNN_LINEAR = _onednn_linear()


class Linear:
    """y = x W^T + b. In fp32 the weight is stored transposed ([in, out]): with torch's BLAS
    kernels a one-row matmul against that layout is up to 2x faster for wide outputs (the
    49152-row lm_head: 4.8 vs 9.7 ms) and about equal at 8+ rows, and oneDNN reads the same
    buffer through a transposed view at its full speed. bf16 keeps the usual [out, in] layout,
    where F.linear (oneDNN already) is the faster kernel."""

    __slots__ = ("bias", "transposed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.transposed = dtype == torch.float32
        weight = weight.to(dtype)
        self.weight = weight.t().contiguous() if self.transposed else weight.contiguous()
        self.bias = None if bias is None else bias.to(dtype).contiguous()

    @classmethod
    def laid_out(cls, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> Linear:
        """Wrap tensors already in this class's layout (no copy): activation from a weight cache."""
        lin = cls.__new__(cls)
        lin.transposed, lin.weight, lin.bias = transposed, weight, bias
        return lin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        if _ONEDNN_LINEAR is not None and x.dtype == torch.float32 and x.is_cpu and not x.requires_grad:
            return _ONEDNN_LINEAR(x, self.weight.t(), self.bias, "none", [], "")
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)

    @property
    def out_features(self) -> int:
        return self.weight.shape[1] if self.transposed else self.weight.shape[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel instead of seven ops
    # Lower precision: normalise in fp32, round, then scale in the input dtype, as HF does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm_weight(w: torch.Tensor, config: ArchConfig, dtype: torch.dtype) -> torch.Tensor:
    """An RMSNorm's weight as the forward pass multiplies by it: Gemma's checkpoints store w for a
    scale of 1 + w (added in fp32, as transformers does, then cast)."""
    return (w.float() + 1.0 if config.gemma else w).to(dtype).contiguous()


def rope_inv_freq(
    config: ArchConfig, freq_factors: torch.Tensor | None = None, local: bool = False
) -> torch.Tensor:
    """RoPE's frequencies; ``local``: those of the windowed layers where their base differs
    (Gemma 3's, which are never scaled)."""
    dim = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if local:
        return inv_freq
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    if config.rope_linear_factor != 1.0:
        inv_freq = inv_freq / config.rope_linear_factor
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 long-context RoPE: long wavelengths are slowed by ``factor``, short ones kept,
    and the band between is interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float, kernel: bool
) -> torch.Tensor:
    """``x += y`` in place (the residual add; x unchanged when y is None), then ``rms_norm(x)``:
    with ``kernel`` one pass of the CPU kernel (cpu_kernels.add_rms_norm), else torch ops."""
    if kernel:
        return cpu_kernels.add_rms_norm(x, y, weight, eps)
    if y is not None:
        x.add_(y)
    return rms_norm(x, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation (HF's rotate_half): dim i pairs with i + head_dim/2. cos/sin: [T, 1, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


_LAYER_LINEARS = ("qkv", "o_proj", "gate_up", "down")
_LAYER_NORMS = ("input_norm", "post_norm")
_OUTPUT_NORMS = ("attn_out_norm", "mlp_out_norm")  # Gemma's, of the attention's and MLP's outputs
_HEAD_NORMS = ("q_norm", "k_norm")  # Qwen3 (ArchConfig.qk_norm); None elsewhere
_EXPERTS = ("experts_gate_up", "experts_down")  # a mixture of experts (ArchConfig.num_experts)
# a mixture of experts' router, and Qwen2-MoE's shared expert's gate (its MLP is gate_up and down)
_MOE_LINEARS = ("router", "shared_gate")


class DecoderLayer:
    __slots__ = ("attn_out_norm", "down", "experts_down", "experts_gate_up", "gate_up", "input_norm",
                 "k_norm", "mlp_out_norm", "o_proj", "post_norm", "q_norm", "qkv", "router",
                 "shared_gate")  # fmt: skip

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str, config: ArchConfig, dtype: torch.dtype):
        def t(name: str) -> torch.Tensor:
            return tensors[prefix + name]

        def norm(name: str) -> torch.Tensor:
            return norm_weight(t(name), config, dtype)

        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat(
                [t("self_attn.q_proj.bias"), t("self_attn.k_proj.bias"), t("self_attn.v_proj.bias")]
            )
        self.qkv = Linear(
            torch.cat(
                [t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"), t("self_attn.v_proj.weight")]
            ),
            qkv_bias,
            dtype,
        )
        self.o_proj = Linear(t("self_attn.o_proj.weight"), None, dtype)
        self.gate_up = self.down = self.router = self.experts_gate_up = self.experts_down = None
        self.shared_gate = None
        if config.num_experts:  # stacked [expert, out, in]; in fp32 each expert transposed as Linear's
            self.router = Linear(t("mlp.gate.weight"), None, dtype)
            fp32 = dtype == torch.float32
            for name, key in (("experts_gate_up", "gate_up_proj"), ("experts_down", "down_proj")):
                w = t(f"mlp.experts.{key}").to(dtype)
                setattr(self, name, (w.transpose(1, 2) if fp32 else w).contiguous())
            if config.shared_expert_intermediate_size:  # Qwen2-MoE: the MLP every token goes through
                shared = "mlp.shared_expert."
                self.gate_up = Linear(
                    torch.cat([t(shared + "gate_proj.weight"), t(shared + "up_proj.weight")]), None, dtype
                )
                self.down = Linear(t(shared + "down_proj.weight"), None, dtype)
                self.shared_gate = Linear(t("mlp.shared_expert_gate.weight"), None, dtype)
        else:
            self.gate_up = Linear(
                torch.cat([t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")]), None, dtype
            )
            self.down = Linear(t("mlp.down_proj.weight"), None, dtype)
        self.input_norm = norm("input_layernorm.weight")
        self.attn_out_norm = self.mlp_out_norm = None
        if config.gemma:  # the norm before the MLP is Gemma's pre_feedforward_layernorm
            self.post_norm = norm("pre_feedforward_layernorm.weight")
            self.attn_out_norm = norm("post_attention_layernorm.weight")
            self.mlp_out_norm = norm("post_feedforward_layernorm.weight")
        else:
            self.post_norm = norm("post_attention_layernorm.weight")
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = norm("self_attn.q_norm.weight")
            self.k_norm = norm("self_attn.k_norm.weight")


class LlamaForCausalLM:
    """The decoder. Built from HF-named checkpoint tensors (``__init__``: fuses and re-lays them out),
    or from tensors already in its own layout (``from_packed``: no copy, for activation)."""

    encoder = False  # (models/bert.py's encoders are True)

    def __init__(
        self,
        config: ArchConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        rope_freq_factors: torch.Tensor | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        check_shapes(config, tensors)
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.attention_scale
        embed = tensors["model.embed_tokens.weight"]
        # In fp32 the (tied) embedding is kept only as the lm_head's transposed matrix; a token
        # lookup then reads a column, which costs nothing next to the matmul it saves.
        self.lm_head = Linear(tensors.get("lm_head.weight", embed), None, dtype)
        self.embed: torch.Tensor | None
        if not c.tie_word_embeddings:
            self.embed = embed.to(dtype).contiguous()
        else:
            self.embed = None if self.lm_head.transposed else self.lm_head.weight  # one copy
        self.layers = [DecoderLayer(tensors, f"model.layers.{i}.", c, dtype) for i in range(c.num_layers)]
        self.norm = norm_weight(tensors["model.norm.weight"], c, dtype)
        # tensor parallel: the in-place sum over the ranks of a partial output (tensor_parallel.py)
        self.reduce: Callable[[torch.Tensor], None] | None = None
        self._init_rope(max_positions, rope_freq_factors)

    def _init_rope(self, max_positions: int | None, rope_freq_factors: torch.Tensor | None) -> None:
        """cos and sin of every position, and each layer's: Gemma 3's windowed layers rotate with
        their own base. Also the embedding's scale and the layers' windows, which ``from_packed``
        needs as much as ``__init__``."""
        c = self.config
        self.rope_freq_factors = rope_freq_factors
        num_pos = max_positions or c.max_position_embeddings
        factors = None if rope_freq_factors is None else rope_freq_factors.cpu()
        positions = torch.arange(num_pos, dtype=torch.float32)

        def table(local: bool) -> tuple[torch.Tensor, ...]:
            freqs = torch.outer(positions, rope_inv_freq(c, factors, local))
            # computed on the host (the same values on every device), then kept beside the weights
            return tuple(f.to(self.dtype).to(self.norm.device) for f in (freqs.cos(), freqs.sin()))

        self.cos, self.sin = table(False)
        # the (cos, sin) tables, and which one each layer rotates with
        self.rope_tables = [(self.cos, self.sin)]
        self.layer_table = [0] * c.num_layers
        if c.rope_local_theta is not None:
            self.rope_tables.append(table(True))
            self.layer_table = [0 if c.layer_window(i) is None else 1 for i in range(c.num_layers)]
        self.windows = c.layer_windows(num_pos)
        # Gemma multiplies the embedding by sqrt(hidden) rounded to the model's dtype
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=self.dtype).item() if c.gemma else None

    @property
    def plain_attention(self) -> bool:
        """Every layer attends to its whole context with unbounded scores: what the CUDA kernels
        compute (a sliding window or soft cap takes the SDPA path there)."""
        return self.config.attn_softcap is None and not any(self.windows)

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the forward pass reads, in its final layout (fused, transposed in fp32), by a
        stable name. ``from_packed`` rebuilds the model over such tensors without copying them; the
        runtime's host weight cache stores this so an activation is a plain memory copy."""
        out = {"lm_head": self.lm_head.weight, "norm": self.norm}
        if self.embed is not None and self.embed is not self.lm_head.weight:
            out["embed"] = self.embed
        if self.rope_freq_factors is not None:
            out["rope_freq_factors"] = self.rope_freq_factors.float().contiguous()
        for i, layer in enumerate(self.layers):
            for name in (*_LAYER_LINEARS, *_MOE_LINEARS):
                lin = getattr(layer, name)
                if lin is None:
                    continue
                out[f"layers.{i}.{name}"] = lin.weight
                if lin.bias is not None:
                    out[f"layers.{i}.{name}.bias"] = lin.bias
            for name in _LAYER_NORMS + _OUTPUT_NORMS + _HEAD_NORMS + _EXPERTS:
                if getattr(layer, name) is not None:
                    out[f"layers.{i}.{name}"] = getattr(layer, name)
        return out

    @classmethod
    def from_packed(
        cls,
        config: ArchConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_positions: int | None = None,
    ) -> LlamaForCausalLM:
        """The model over ``packed_tensors()``-style tensors, used in place (no copy, no check of
        values: the cache that wrote them built them with ``__init__``)."""
        needed = ("lm_head", "norm", "layers.0.qkv", *(("layers.0.q_norm",) if config.qk_norm else ()))
        missing = [n for n in needed if n not in tensors]
        mlp = ".experts_down" if config.num_experts else ".down"
        if missing or len([n for n in tensors if n.endswith(mlp)]) != config.num_layers:
            raise CorruptWeightsError(f"packed weights lack {missing or 'layers'} for this config")
        self = cls.__new__(cls)
        self.config, self.dtype = config, dtype
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        transposed = dtype == torch.float32
        self.lm_head = Linear.laid_out(tensors["lm_head"], None, transposed)
        self.embed = tensors.get("embed", None if transposed else self.lm_head.weight)
        self.norm = tensors["norm"]
        self.reduce = None
        self.layers = []
        used = ["qkv", "o_proj", *(("router",) if config.num_experts else ("gate_up", "down"))]
        if config.shared_expert_intermediate_size:
            used += ["gate_up", "down", "shared_gate"]
        for i in range(config.num_layers):
            layer = DecoderLayer.__new__(DecoderLayer)
            for name in (*_LAYER_LINEARS, *_MOE_LINEARS):
                key = f"layers.{i}.{name}"
                lin = (
                    Linear.laid_out(tensors[key], tensors.get(f"{key}.bias"), transposed)
                    if name in used
                    else None
                )
                setattr(layer, name, lin)
            for name in _LAYER_NORMS:
                setattr(layer, name, tensors[f"layers.{i}.{name}"])
            for name in _HEAD_NORMS:
                setattr(layer, name, tensors[f"layers.{i}.{name}"] if config.qk_norm else None)
            for name in _OUTPUT_NORMS:
                setattr(layer, name, tensors[f"layers.{i}.{name}"] if config.gemma else None)
            for name in _EXPERTS:
                setattr(layer, name, tensors[f"layers.{i}.{name}"] if config.num_experts else None)
            self.layers.append(layer)
        self._init_rope(max_positions, tensors.get("rope_freq_factors"))
        return self

    def to(self, device: torch.device) -> LlamaForCausalLM:
        """The same model with every tensor copied to ``device`` (the packed layout, so no re-fusing)."""
        if self.norm.device == device:
            return self
        max_positions = self.cos.shape[0]
        packed = {name: t.to(device) for name, t in self.packed_tensors().items()}
        return LlamaForCausalLM.from_packed(self.config, packed, self.dtype, max_positions)

    def tensors(self) -> Iterator[torch.Tensor]:
        yield self.lm_head.weight
        if self.embed is not None and self.embed is not self.lm_head.weight:
            yield self.embed
        yield self.norm
        for layer in self.layers:
            for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down, layer.router, layer.shared_gate):
                if lin is None:
                    continue
                yield lin.weight
                if lin.bias is not None:
                    yield lin.bias
            for t in (layer.input_norm, layer.post_norm, layer.attn_out_norm, layer.mlp_out_norm,
                      layer.q_norm, layer.k_norm, layer.experts_gate_up, layer.experts_down):  # fmt: skip
                if t is not None:
                    yield t

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            return self.lm_head.weight.index_select(1, input_ids).t()
        return self.embed.index_select(0, input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: KVCache,
        lora: LoraRows | None = None,  # each row's adapter (engine/lora.py); None: the base alone
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        c = self.config
        eps = c.rms_norm_eps
        num_tokens = input_ids.shape[0]
        # the residual stream, added to in place (a fresh tensor: the lookup's own, or its copy)
        x = self.embed_tokens(input_ids).contiguous()
        if self.embed_scale is not None:
            x.mul_(self.embed_scale)
        kernel = meta.kernels  # decided once by the runner (a CPU cache, the kernels built)
        if not kernel:  # torch ops: the rows of cos and sin for these positions, once per pass
            rope_rows = [
                (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)) for cos, sin in self.rope_tables
            ]
        caches = zip(kv_cache.layers, kv_cache.layer_rows, strict=True)
        group_of = kv_cache.groups.group_of  # each layer's KV group: its block tables in ``meta``
        h = add_rms_norm(x, None, self.layers[0].input_norm, eps, kernel)
        for i, (layer, ((k_cache, v_cache), rows)) in enumerate(zip(self.layers, caches, strict=True)):
            qkv = layer.qkv(h)
            if lora is not None:
                lora.apply(i, "qkv", h, qkv)
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # Q and K heads sit side by side in the fused output: rotate them in one pass.
            qk = qk.view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:  # Qwen3: each head normed over head_dim, before RoPE
                qk = torch.cat(
                    (rms_norm(qk[:, : c.num_heads], layer.q_norm, eps),
                     rms_norm(qk[:, c.num_heads :], layer.k_norm, eps)), dim=1,
                )  # fmt: skip
            # the kernel rotates in place, looking cos and sin up by position
            if kernel:
                qk = cpu_kernels.rope(qk, *self.rope_tables[self.layer_table[i]], positions)
            else:
                qk = apply_rope(qk, *rope_rows[self.layer_table[i]])
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
            m = meta.for_layer(group_of[i])
            attn = paged_attention(
                q, k, v, k_cache, v_cache, rows, m, self.scale, self.windows[i], c.attn_softcap
            )
            o = layer.o_proj(attn)
            if lora is not None:
                lora.apply(i, "o_proj", attn.reshape(num_tokens, -1), o)
            if self.reduce is not None:  # a rank's heads' part of the sum
                self.reduce(o)
            if layer.attn_out_norm is not None:  # Gemma: the whole output normed, then added
                o = rms_norm(o, layer.attn_out_norm, eps)
            h = add_rms_norm(x, o, layer.post_norm, eps, kernel)
            if layer.experts_gate_up is not None:
                down = self._experts(layer, h)
                if layer.shared_gate is not None:  # Qwen2-MoE's shared expert, gated per token
                    gate, up = layer.gate_up(h).chunk(2, dim=-1)
                    shared = layer.down(F.silu(gate, inplace=True).mul_(up))
                    down = down + torch.sigmoid(layer.shared_gate(h)) * shared
            else:
                gate_up = layer.gate_up(h)
                if lora is not None:
                    lora.apply(i, "gate_up", h, gate_up)
                gate, up = gate_up.chunk(2, dim=-1)
                if c.gemma:  # GeGLU
                    mid = F.gelu(gate, approximate="tanh").mul_(up)
                else:
                    mid = F.silu(gate, inplace=True).mul_(up)
                down = layer.down(mid)
                if lora is not None:
                    lora.apply(i, "down", mid, down)
            if self.reduce is not None:  # a rank's intermediate columns' part of the sum
                self.reduce(down)
            if layer.mlp_out_norm is not None:
                down = rms_norm(down, layer.mlp_out_norm, eps)
            # the MLP's output is added, then normed for the next layer (or the final norm)
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h = add_rms_norm(x, down, after, eps, kernel)
        return h

    def _experts(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        """A mixture-of-experts MLP: the router's top experts for each token, their softmax weights
        (renormalised over the chosen ones with ``norm_topk_prob``), each expert run once over all
        the tokens that chose it (grouped by a sort, not a loop over tokens), the weighted outputs
        summed per token in expert order (as transformers sums them)."""
        c = self.config
        probs = torch.softmax(layer.router(h), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(c.experts_per_token, dim=-1)
        if c.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype).flatten()
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=c.num_experts).tolist()
        tokens = order // c.experts_per_token
        transposed = self.dtype == torch.float32  # each expert's weights laid out as Linear's
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pairs = order[start : start + n]
            rows = tokens[start : start + n]
            gate_up = Linear.laid_out(layer.experts_gate_up[e], None, transposed)(h.index_select(0, rows))
            gate, up = gate_up.chunk(2, dim=-1)
            y = Linear.laid_out(layer.experts_down[e], None, transposed)(F.silu(gate).mul_(up))
            out.index_add_(0, rows, y.mul_(weights[pairs].unsqueeze(1)))
            start += n
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2: logits soft-capped
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits


def check_shapes(config: ArchConfig, tensors: dict[str, torch.Tensor]) -> None:
    for name, shape in parameter_shapes(config).items():
        t = tensors.get(name)
        if t is None:
            raise CorruptWeightsError(f"weights lack tensor {name}")
        if tuple(t.shape) != shape:
            raise CorruptWeightsError(f"tensor {name} has shape {tuple(t.shape)}, the config implies {shape}")
