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


# The WordPiece vocabulary of synthetic encoders: BERT's special tokens, then single characters and
# their ## continuations (any lowercase ASCII text encodes), then a few whole words.
_ENCODER_WORDS = ("the", "paris", "capital", "france", "cache", "block", "query", "document", "model")


def write_synthetic_encoder(
    path: Any, architecture: str = "bert", num_labels: int = 0, pooling: str = "cls", normalize: bool = True,
    seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4, init_std: float = 0.02,
    max_positions: int = 128,
) -> Any:  # fmt: skip
    """A BERT-family model of seeded random weights (SYNTHETIC) written by transformers itself as an
    HF directory: ``BertModel`` / ``XLMRobertaModel``, or with ``num_labels`` a
    ``...ForSequenceClassification`` (a cross-encoder); a WordPiece ``tokenizer.json`` whose
    post-processor adds [CLS]/[SEP] (BERT) or <s>/</s> (RoBERTa) to single inputs and pairs; and for
    an embedder sentence-transformers' files (``pooling``, ``normalize``). ``init_std``: the weights'
    spread (transformers' ``initializer_range``; wider spreads a cross-encoder's scores). Returns
    the directory."""
    import json
    from pathlib import Path

    import transformers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    from prism_serve.engine.sources import write_embedding_files

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bert = architecture == "bert"
    cls_tok, sep, pad, unk, mask = (
        ("[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]")
        if bert
        else ("<s>", "</s>", "<pad>", "<unk>", "<mask>")
    )
    specials = [pad, unk, cls_tok, sep, mask] if bert else [cls_tok, pad, sep, unk, mask]
    chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    vocab_list = [*specials, *chars, *("##" + c for c in chars if c.isalnum()), *_ENCODER_WORDS]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(vocab_list))}
    backend = HFTokenizer(models.WordPiece(vocab=vocab, unk_token=unk))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    ids = {t: vocab[t] for t in (cls_tok, sep)}
    if bert:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls_tok}:0 $A:0 {sep}:0", pair=f"{cls_tok}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=list(ids.items()),
        )  # fmt: skip
    else:  # RoBERTa's pairs: <s> A </s></s> B </s>, all of type 0
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls_tok} $A {sep}", pair=f"{cls_tok} $A {sep} {sep} $B {sep}",
            special_tokens=list(ids.items()),
        )  # fmt: skip
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, cls_token=cls_tok, sep_token=sep, pad_token=pad, unk_token=unk,
        mask_token=mask, model_max_length=max_positions,
        model_input_names=["input_ids", *(["token_type_ids"] if bert else []), "attention_mask"],
    )  # fmt: skip
    fast.save_pretrained(str(path))
    common = dict(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, intermediate_size=4 * hidden, hidden_act="gelu",
                  initializer_range=init_std)  # fmt: skip
    if bert:
        config = transformers.BertConfig(
            max_position_embeddings=max_positions, type_vocab_size=2, pad_token_id=0, **common
        )
    else:
        config = transformers.XLMRobertaConfig(
            max_position_embeddings=max_positions + 2, type_vocab_size=1, pad_token_id=vocab[pad], **common
        )
    family = "Bert" if bert else "XLMRoberta"
    if num_labels:
        config.num_labels = num_labels
    torch.manual_seed(seed)
    kind = "ForSequenceClassification" if num_labels else "Model"
    model = getattr(transformers, family + kind)(config)
    if not num_labels and bert:  # BertModel adds a pooler an embedder does not use
        model = transformers.BertModel(config, add_pooling_layer=False)
    model.eval().save_pretrained(str(path))
    if not num_labels:
        write_embedding_files(path, pooling, normalize, hidden)
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_positions}))
    return path
