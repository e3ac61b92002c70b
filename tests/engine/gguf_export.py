"""Write loaded weights as a GGUF file the way llama.cpp's converter does (gguf-py's writer): the
metadata keys of the architecture, llama.cpp's tensor names (Phi-3's fused q/k/v and gate/up as one
tensor each; Gemma's norms as 1 + w), and for ``llama`` files the Q/K rows permuted for its
adjacent-pair rotation (the others keep HF's order). Test fixtures for architectures the repository
has no real file of; the byte-level tokenizer of synthetic weights is written as a ``gpt2``
vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from prism_serve.engine.weights import LoadedWeights, fused_checkpoint

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",  # Qwen3-MoE's router and experts (3-D tensors)
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",  # Qwen2-MoE's shared expert and its gate
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA = {  # Gemma's four norms a layer
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's half-split rows of each head to llama.cpp's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str, gemma: bool = False) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, i, rest = name.split(".", 3)  # model.layers.{i}.{module}.{kind}
    module, _, kind = rest.rpartition(".")
    return f"blk.{i}.{(_GEMMA if gemma and module in _GEMMA else _LAYER)[module]}.{kind}"


def _gguf_tensors(weights: LoadedWeights) -> dict:
    """The checkpoint's tensors, and each layer's stacked experts as llama.cpp stores them: one
    3-D tensor per projection (gate and up apart)."""
    c = weights.config
    out = {}
    for name, t in fused_checkpoint(c, weights.tensors).items():
        layer, sep, proj = name.partition(".mlp.experts.")
        if sep and proj == "gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            out[f"{layer}.mlp.experts.gate_proj.weight"] = gate
            out[f"{layer}.mlp.experts.up_proj.weight"] = up
        elif sep:
            out[f"{layer}.mlp.experts.down_proj.weight"] = t
        elif name.endswith("mlp.shared_expert_gate.weight"):
            out[name] = t.reshape(-1)  # a vector in llama.cpp's files ({n_embd})
        else:
            out[name] = t
    return out


def write_gguf(weights: LoadedWeights, path: Path, tokenizer: dict | None = None) -> Path:
    """``tokenizer``: the file's tokenizer keys (``tokenizer.ggml.*``) in place of the weights'
    byte-level vocabulary written as gpt2 (a SentencePiece vocabulary, say)."""
    c = weights.config
    arch = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}.get(c.architecture, c.architecture)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_layers)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if c.sliding_window is not None:
        w.add_sliding_window(c.sliding_window)
    if c.gemma:  # llama.cpp's code knows the global layers and the attention scale
        if c.attn_softcap is not None:
            w.add_attn_logit_softcapping(c.attn_softcap)
        if c.final_softcap is not None:
            w.add_final_logit_softcapping(c.final_softcap)
        if c.rope_local_theta is not None:
            w.add_rope_freq_base_swa(c.rope_local_theta)
        if c.rope_linear_factor != 1.0:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(c.rope_linear_factor)
    if c.num_experts:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.experts_per_token)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_weights_norm(c.norm_topk_prob)
        if c.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if tokenizer is not None:
        for key, value in tokenizer.items():
            if key.startswith("tokenizer."):
                (w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int)
                 else w.add_string if isinstance(value, str) else w.add_array)(key, value)  # fmt: skip
    else:
        backend = weights.tokenizer.backend
        vocab = backend.get_vocab()
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_pad_token_id(0)  # else transformers' reader keeps its config class's default pad id
    if weights.tokenizer.chat_template:
        w.add_chat_template(weights.tokenizer.chat_template)
    for name, t in _gguf_tensors(weights).items():
        array = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _permute(array, c.num_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _permute(array, c.num_kv_heads)
        elif c.gemma and name.endswith("norm.weight"):
            array = array + 1.0  # as llama.cpp's converter stores Gemma's norms
        w.add_tensor(gguf_name(name, c.gemma), np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# text the synthetic unigram vocabulary is trained on (fixed, so the vocabulary is the same every run)
_UNIGRAM_TEXT = [
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "A paged KV cache keeps each request's keys and values in fixed-size blocks.",
    "Embeddings map text to vectors; similar texts land near each other.",
    "Rerankers score a query against each document and sort the documents by relevance.",
    "Models are activated when requests arrive and evicted when they idle, sharing one device.",
    "Prefill reads the whole prompt at once; decode then adds one token a step.",
    "Numbers like 3.14, 2026 and 42 appear in text, as do names such as Ada and Linus.",
]


def write_unigram_xlmr(path: Path, num_labels: int = 0, pooling: str = "mean", seed: int = 0) -> Path:
    """An XLM-RoBERTa model of seeded random weights (SYNTHETIC, ``write_synthetic_encoder``) whose
    tokenizer is what XLM-RoBERTa's is: a SentencePiece unigram vocabulary trained here (NFKC rules
    compiled in, its pieces after XLM-R's <s> <pad> </s> <unk>, <mask> last), saved by
    transformers' ``XLMRobertaTokenizer``. The model's embedding table is at least as large."""
    import io

    import sentencepiece as spm
    import transformers
    from sentencepiece import sentencepiece_model_pb2

    from prism_serve.engine.hf_reference import write_synthetic_encoder

    write_synthetic_encoder(path, "roberta", num_labels=num_labels, pooling=pooling, seed=seed,
                            init_std=0.3 if num_labels else 0.02)  # fmt: skip
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_UNIGRAM_TEXT * 4), model_writer=buf, vocab_size=100, model_type="unigram",
        character_coverage=1.0, normalization_rule_name="nmt_nfkc", hard_vocab_limit=False,
        pad_id=-1, bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )  # fmt: skip
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buf.getvalue())
    pieces = [(p.piece, p.score) for p in proto.pieces[1:]]  # its <unk> is XLM-R's fourth token
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces, ("<mask>", 0.0)]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    charsmap = list(proto.normalizer_spec.precompiled_charsmap)
    tok = transformers.XLMRobertaTokenizer(  # XLM-R's own tokenizer_config cleans up spaces
        vocab=vocab, _spm_precompiled_charsmap=charsmap, model_max_length=128,
        clean_up_tokenization_spaces=True,
    )  # fmt: skip
    tok.save_pretrained(str(path))
    assert len(vocab) <= transformers.AutoConfig.from_pretrained(str(path)).vocab_size
    return path


def write_encoder_gguf(hf_dir: Path, path: Path, pooling: str | None = None) -> Path:
    """A BERT-family model's HF directory as llama.cpp's converter writes it (architecture ``bert``):
    - BERT: the WordPiece vocabulary in its phantom-space form (a word's first piece after U+2581,
      a ``##`` piece without its ``##``, control tokens as they are);
    - XLM-RoBERTa (``write_unigram_xlmr``): the unigram vocabulary as ``t5``, pieces with their
      scores and types, padded with unused tokens to the model's table, the tokenizer's prefix
      space, whitespace cleaning and precompiled normalisation map; its positions' unused leading
      rows (the padding index and before) cut off, and its context shortened by as many;
    - the special tokens gguf-py's ``SpecialVocab`` finds, the tensors under gguf-py's own BERT
      names with the model prefix stripped and the pooler left out, BERT's ``classifier`` renamed
      to the output projection (RoBERTa's head maps as it is), as the converter does; ``pooling``
      (mean or cls) as ``bert.pooling_type``."""
    import base64

    import transformers
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    specials = {t["id"] for t in tok["added_tokens"] if t["special"]}
    unigram = tok["model"]["type"] == "Unigram"
    offset = cfg["pad_token_id"] + 1 if unigram else 0
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_context_length(cfg["max_position_embeddings"] - offset)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    if pooling is not None:
        w.add_pooling_type({"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}[pooling])
    w.add_token_type_count(cfg.get("type_vocab_size", 1))
    if unigram:
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
        n = max(cfg["vocab_size"], len(tok["model"]["vocab"]))
        tokens = [f"[PAD{i}]" for i in range(n)]
        scores = [-10000.0] * n
        types = [gguf.TokenType.UNUSED] * n
        for i, (piece, score) in enumerate(tok["model"]["vocab"]):
            tokens[i], scores[i] = piece, score
            types[i] = (
                gguf.TokenType.UNKNOWN if i == tok["model"]["unk_id"]
                else gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
            )  # fmt: skip
        w.add_tokenizer_model("t5")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_add_space_prefix(hf_tok.add_prefix_space)
        w.add_remove_extra_whitespaces(hf_tok.clean_up_tokenization_spaces)
        w.add_precompiled_charsmap(base64.b64decode(tok["normalizer"]["precompiled_charsmap"]))
    else:
        words = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
        types = [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for _, i in words]
        tokens = [
            t if kind == gguf.TokenType.CONTROL else t[2:] if t.startswith("##") else "\u2581" + t
            for (t, _), kind in zip(words, types, strict=True)
        ]
        w.add_tokenizer_model("bert")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg["num_hidden_layers"])
    for name, array in load_file(str(hf_dir / "model.safetensors")).items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith(("pooler.", "embeddings.position_ids")):
            continue
        if name in ("classifier.weight", "classifier.bias"):  # BERT's head: one linear
            name = name.replace("classifier.", "classifier.out_proj.")
        if name == "embeddings.position_embeddings.weight":
            array = array[offset:]
        gguf_name_ = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name_ is not None, name
        w.add_tensor(gguf_name_, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
