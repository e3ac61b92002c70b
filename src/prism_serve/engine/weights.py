"""Weight loading: GGUF (dequantized with the ``gguf`` package), HF layout (config.json +
safetensors + tokenizer.json), and seeded random weights for any preset Llama-family shape.

Every loader returns tensors under HF ``LlamaForCausalLM`` parameter names, so the model and the
reference tests see one naming scheme whatever the source.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from prism_serve.engine.config import DEFAULT_MODEL
from prism_serve.engine.gguf_file import read_gguf
from prism_serve.engine.models.config import PRESETS, ArchConfig, parameter_shapes
from prism_serve.engine.sources import RANDOM_PREFIX, default_gguf_path, missing_pooler
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.errors import CorruptWeightsError, UnsupportedModelError, WeightsNotFoundError

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v in one matrix
    "ffn_gate_inp": "mlp.gate",  # Qwen3-MoE's router, and its experts (3-D: expert, out, in)
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's norms in llama.cpp's files: its ffn_norm is the norm before the MLP, and the attention's
# and the MLP's outputs have their own
_GGUF_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(slots=True)
class LoadedWeights:
    config: ArchConfig
    tensors: dict[str, torch.Tensor]  # HF names, float32 or the requested dtype
    tokenizer: Tokenizer
    source: str  # where the weights came from, for logs and /v1/models
    synthetic: bool  # True for random weights: shown as synthetic wherever they appear
    rope_freq_factors: torch.Tensor | None = None  # GGUF llama3 files store scaled RoPE as factors


def load_weights(model: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedWeights:
    """Load ``model``: ``smollm2-135m-instruct`` (the default), ``random:<preset>``, a .gguf file,
    or a directory in HF layout."""
    if model in (DEFAULT_MODEL, "default"):
        return load_gguf(default_gguf_path())
    if model.startswith(RANDOM_PREFIX):
        preset = model.removeprefix(RANDOM_PREFIX)
        if preset not in PRESETS:
            raise UnsupportedModelError(
                f"unknown synthetic preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}"
            )
        return random_weights(PRESETS[preset], dtype=dtype, seed=seed, name=preset)
    path = Path(model).expanduser()
    if not path.exists():
        raise WeightsNotFoundError(f"model weights not found: {path}")
    if path.is_dir():
        return load_hf_dir(path)
    if path.suffix == ".gguf":
        return load_gguf(path)
    raise UnsupportedModelError(f"{path}: expected a .gguf file or a directory with config.json")


# ---- GGUF ------------------------------------------------------------------------------------


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores a ``llama`` file's Q/K rows so that RoPE rotates adjacent pairs; HF's
    rotate_half pairs dimension i with i + head_dim/2. Reorder the rows of each head back to the
    half-split layout. (Qwen2 and Qwen3 files keep HF's order: llama.cpp runs them with the
    half-split rotation itself.)"""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(rows, *w.shape[1:])


def load_gguf(path: Path) -> LoadedWeights:
    from gguf import quants

    path = Path(path)
    if not path.is_file():
        raise WeightsNotFoundError(f"GGUF file not found: {path}")
    try:
        meta, gguf_tensors = read_gguf(path)
    except Exception as e:  # ValueError, struct.error, IndexError, ... from a file that is not one
        raise CorruptWeightsError(f"{path} is not a readable GGUF file: {e}") from e
    config = ArchConfig.from_gguf_metadata(meta)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    tensors: dict[str, torch.Tensor] = {}
    freq_factors = None
    try:
        for t in gguf_tensors:
            array = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            expected = tuple(reversed(t.shape))
            if array.size != int(np.prod(expected)):
                raise CorruptWeightsError(f"{path}: tensor {t.name} has {array.size} values, not {expected}")
            array = array.reshape(expected) if len(expected) > 1 else array.reshape(-1)
            if t.name == "rope_freqs.weight":
                freq_factors = torch.from_numpy(array.copy())
                continue
            if config.encoder:
                tensors[_gguf_encoder_name(t.name)] = torch.from_numpy(np.array(array, dtype=np.float32))
                continue
            name = _gguf_to_hf_name(t.name, config.gemma)
            if config.gemma and name.endswith("norm.weight"):
                array = array - 1.0  # llama.cpp's converter stores Gemma's norm weights as 1 + w
            if name.endswith("mlp.shared_expert_gate.weight"):
                array = array.reshape(1, -1)  # llama.cpp's files may keep it as one row or a vector
            if config.architecture == "phi3" and name.endswith("mlp.up_proj.weight"):
                name = name.replace("up_proj", "gate_up_proj")  # Phi-3's ffn_up is gate and up
            if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                array = _unpermute_rope(array, config.num_heads)
            elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                array = _unpermute_rope(array, config.num_kv_heads)
            tensors[name] = torch.from_numpy(
                np.array(array, dtype=np.float32, order="C")
            )  # own, writable copy
    except (CorruptWeightsError, UnsupportedModelError):
        raise
    except Exception as e:
        raise CorruptWeightsError(f"{path}: cannot read tensor data: {e}") from e
    if config.encoder:
        return LoadedWeights(_encoder_config(path, config, tensors), tensors, tokenizer, str(path), False)
    if "lm_head.weight" not in tensors:
        config = dataclasses.replace(config, tie_word_embeddings=True)
    return LoadedWeights(config, engine_names(config, tensors), tokenizer, str(path), False, freq_factors)


# A checkpoint's fused projections (Phi-3) and the Llama projections they hold, in row order.
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}  # fmt: skip


def engine_names(config: ArchConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the names ``models.config.parameter_shapes`` lists: fused
    projections split (Phi-3), experts stacked (Qwen3-MoE)."""
    return stack_experts(config, split_fused(config, tensors))


def stack_experts(config: ArchConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's experts as transformers keeps them (``mlp.experts.gate_up_proj`` [experts,
    2 x intermediate, hidden], ``mlp.experts.down_proj`` [experts, hidden, intermediate]), from a
    checkpoint's one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``) or
    GGUF's one per projection (``mlp.experts.gate_proj.weight``, 3-D). Already stacked: unchanged."""
    if not config.num_experts:
        return tensors
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer, projection) -> expert -> tensor
    for name, t in tensors.items():
        layer, sep, rest = name.partition(".mlp.experts.")
        if not sep or rest in ("gate_up_proj", "down_proj"):
            out[name] = t
            continue
        fields = rest.split(".")  # [e, proj, "weight"] or [proj, "weight"]
        if len(fields) == 3 and fields[0].isdigit():
            parts.setdefault((layer, fields[1]), {})[int(fields[0])] = t
        elif len(fields) == 2 and t.dim() == 3:
            parts.setdefault((layer, fields[0]), {}).update(enumerate(t.unbind(0)))
        else:
            raise CorruptWeightsError(f"unexpected expert tensor {name!r}")

    def stacked(layer: str, proj: str) -> torch.Tensor:
        per = parts.pop((layer, proj), {})
        if sorted(per) != list(range(config.num_experts)):
            raise CorruptWeightsError(
                f"{layer}: {proj} of {len(per)} experts, the config has {config.num_experts}"
            )
        return torch.stack([per[e] for e in range(config.num_experts)])

    for layer in sorted({layer for layer, _ in parts}):
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat(
            [stacked(layer, "gate_proj"), stacked(layer, "up_proj")], dim=1
        )
        out[f"{layer}.mlp.experts.down_proj"] = stacked(layer, "down_proj")
    if parts:
        raise CorruptWeightsError(f"unexpected expert tensors: {sorted(proj for _, proj in parts)}")
    return out


def split_fused(config: ArchConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each fused projection (Phi-3's ``qkv_proj``, ``gate_up_proj``) split into
    the Llama names the engine reads (rows; copies, so the fused tensors can be freed)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, kind = name.rpartition(".")  # model.layers.{i}.{fused}, weight
        fused = next((f for f in _FUSED if module.endswith("." + f)), None)
        if fused is None:
            out[name] = t
            continue
        shapes = config.projection_shapes()  # (in, out) by projection: its rows are out
        rows = [shapes[part.rpartition(".")[2]][1] for part in _FUSED[fused]]
        if t.shape[0] != sum(rows):
            raise CorruptWeightsError(f"tensor {name} has {t.shape[0]} rows, the config implies {sum(rows)}")
        layer = module.removesuffix("." + fused)
        for part, piece in zip(_FUSED[fused], t.split(rows), strict=True):
            out[f"{layer}.{part}.{kind}"] = piece.clone()
    return out


def fused_checkpoint(config: ArchConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_fused` for an architecture whose checkpoints fuse (Phi-3):
    ``tensors`` under the checkpoint's own names (to save an HF directory, build a reference)."""
    if config.architecture != "phi3":
        return dict(tensors)
    out = {n: t for n, t in tensors.items() if not any(f".{p}." in n for ps in _FUSED.values() for p in ps)}
    for i in range(config.num_layers):
        for fused, parts in _FUSED.items():
            out[f"model.layers.{i}.{fused}.weight"] = torch.cat(
                [tensors[f"model.layers.{i}.{p}.weight"] for p in parts]
            )
    return out


def _gguf_to_hf_name(name: str, gemma: bool = False) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    names = {**_GGUF_LAYER_NAMES, **_GGUF_GEMMA_NAMES} if gemma else _GGUF_LAYER_NAMES
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")


# llama.cpp's names of a BERT-family encoder's tensors (architecture ``bert``) -> BERT's
_GGUF_ENCODER_GLOBAL = {
    "token_embd": "embeddings.word_embeddings", "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings", "token_embd_norm": "embeddings.LayerNorm",
    "cls": "pooler.dense", "cls.output": "classifier",
}  # fmt: skip
_GGUF_ENCODER_LAYER = {
    "attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm",
}  # fmt: skip


def _gguf_encoder_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base in _GGUF_ENCODER_GLOBAL:
        return f"{_GGUF_ENCODER_GLOBAL[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_ENCODER_LAYER:
        return f"encoder.layer.{parts[1]}.{_GGUF_ENCODER_LAYER[parts[2]]}.{kind}"
    raise UnsupportedModelError(f"unexpected tensor {name!r} in a BERT GGUF file")


def _encoder_config(path: Path, config: ArchConfig, tensors: dict[str, torch.Tensor]) -> ArchConfig:
    """An encoder's shape as its tensors give what its header may not: the token types (rows of
    ``token_types``) and a classifier's outputs (rows of ``cls.output``). llama.cpp's converter
    drops BERT's pooler (a dense layer and tanh before the classifier) from a cross-encoder it
    writes, so such a file cannot give the scores the model was trained to give: refused."""
    types = tensors.get("embeddings.token_type_embeddings.weight")
    head = tensors.get("classifier.weight")
    if head is not None and "pooler.dense.weight" not in tensors:
        raise missing_pooler(path)
    return dataclasses.replace(
        config,
        type_vocab_size=0 if types is None else types.shape[0],
        num_labels=0 if head is None else head.shape[0],
    )


# ---- HF layout -------------------------------------------------------------------------------


def load_hf_dir(path: Path) -> LoadedWeights:
    """A directory in HF layout for the built-in engine (models.config.BUILT_IN_HF), in float32."""
    w = _read_hf_dir(path, any_architecture=False, cast=lambda t: t.float() if t.is_floating_point() else t)
    if w.config.encoder:
        return dataclasses.replace(w, tensors=encoder_names(w.tensors))
    config, tensors = headless(w.config, language_model(w.tensors))
    return dataclasses.replace(w, config=config, tensors=engine_names(config, tensors))


# a sequence classifier's model prefix, and RoBERTa's classification head under BERT's names
_ENCODER_PREFIXES = ("bert.", "roberta.")
_ENCODER_HEAD = {"classifier.dense.": "pooler.dense.", "classifier.out_proj.": "classifier."}


def encoder_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An encoder checkpoint's tensors under ``models.config.encoder_shapes``' names: the model
    prefix of a ``...ForSequenceClassification`` checkpoint stripped, RoBERTa's head renamed."""
    out = {}
    for name, t in tensors.items():
        for prefix in _ENCODER_PREFIXES:
            name = name.removeprefix(prefix)
        for old, new in _ENCODER_HEAD.items():
            if name.startswith(old):
                name = new + name.removeprefix(old)
        out[name] = t
    return out


def headless(
    config: ArchConfig, tensors: dict[str, torch.Tensor]
) -> tuple[ArchConfig, dict[str, torch.Tensor]]:
    """A checkpoint of the decoder alone (transformers' ``Qwen3Model`` and the like, as embedding
    models such as Qwen3-Embedding ship): its tensors under the causal LM's names, and the embedding
    as the LM head it lacks (tied), which an embedding request never reads."""
    if "model.embed_tokens.weight" in tensors or "embed_tokens.weight" not in tensors:
        return config, tensors
    tensors = {n if n.startswith("lm_head.") else "model." + n: t for n, t in tensors.items()}
    if "lm_head.weight" not in tensors and not config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=True)
    return config, tensors


# Where multimodal checkpoints (Gemma 3's) keep the language model: under the first name in
# transformers 4.5x and later, the second before; the vision tower and projector are left out.
_LANGUAGE_MODEL = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."))  # fmt: skip
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def language_model(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's language model under a text model's names; others unchanged."""
    if not any(n.startswith(("model.language_model.", "language_model.")) for n in tensors):
        return tensors
    out = {}
    for name, t in tensors.items():
        if name.startswith(_VISION):
            continue
        for old, new in _LANGUAGE_MODEL:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        out[name] = t
    return out


# the checkpoint dtypes load_checkpoint casts to the model's dtype (others, quantized weights, stay)
CHECKPOINT_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def load_checkpoint(path: Path, dtype: torch.dtype) -> LoadedWeights:
    """A directory another engine (vLLM) loads, read as it is: every safetensors tensor under its own
    name (floating ones in ``dtype``, others such as quantized weights untouched), the shape of any
    architecture from config.json, and the tokenizer."""
    return _read_hf_dir(
        path, any_architecture=True, cast=lambda t: t.to(dtype) if t.dtype in CHECKPOINT_FLOATS else t
    )


def _read_hf_dir(path: Path, any_architecture: bool, cast) -> LoadedWeights:
    """config.json, every *.safetensors file (each tensor through ``cast``) and the tokenizer."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise WeightsNotFoundError(f"{path} has no config.json")
    try:
        config = ArchConfig.from_hf_config(
            json.loads(cfg_file.read_text()), any_architecture=any_architecture
        )
    except json.JSONDecodeError as e:
        raise CorruptWeightsError(f"cannot parse {cfg_file}: {e}") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsNotFoundError(f"{path} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update((k, cast(v)) for k, v in load_file(str(f)).items())
        except (SafetensorError, OSError, ValueError) as e:
            raise CorruptWeightsError(f"cannot read {f}: {e}") from e
    return LoadedWeights(config, tensors, Tokenizer.from_hf_dir(path), str(path), False)


def save_hf_dir(weights: LoadedWeights, path: Path) -> None:
    """Write weights in HF layout (used to test the HF loader and to export GGUF models)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(weights.config.to_hf_config(), indent=2))
    tensors = fused_checkpoint(weights.config, weights.tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    tok = weights.tokenizer
    tok.backend.save(str(path / "tokenizer.json"))
    tok_cfg: dict[str, Any] = {"chat_template": tok.chat_template}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    gen = {"eos_token_id": list(tok.eos_token_ids), "bos_token_id": tok.bos_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen))


# ---- random (synthetic) -----------------------------------------------------------------------

_SYNTHETIC_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> Tokenizer:
    """A 256-token byte-level tokenizer for synthetic models: any text encodes, and ids outside the
    byte range (a random model samples them) decode to nothing."""
    # Token id == byte value. Byte-level BPE shows printable bytes as themselves and shifts the
    # others to U+0100 and up, in byte order.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    backend = HFTokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(
        backend, bos_token_id=None, eos_token_ids=(), add_bos=False, chat_template=_SYNTHETIC_CHAT_TEMPLATE
    )


def random_weights(
    config: ArchConfig, dtype: torch.dtype = torch.float32, seed: int = 0, name: str = "custom"
) -> LoadedWeights:
    """Seeded N(0, 0.02) weights of ``config``'s shape (norm weights 1). SYNTHETIC: realistic memory
    and compute per token, meaningless text."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for pname, shape in parameter_shapes(config).items():
        if pname.endswith(("norm.weight", "LayerNorm.weight")):
            tensors[pname] = torch.ones(shape, dtype=dtype)
        elif pname.endswith("LayerNorm.bias"):
            tensors[pname] = torch.zeros(shape, dtype=dtype)
        else:
            tensors[pname] = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=gen)
    return LoadedWeights(config, tensors, byte_tokenizer(), f"random:{name} seed={seed}", True)
