"""BERT-family encoders in the built-in engine (models/bert.py): embedders (BERT, XLM-RoBERTa; CLS
and mean pooling) and cross-encoders, against sentence-transformers on the same weights.

Real small encoder weights are not reachable from these machines, so each model is a tiny one of
seeded random weights (SYNTHETIC), written by transformers itself with a WordPiece tokenizer and
sentence-transformers' files (``hf_reference.write_synthetic_encoder``); the reference is
sentence-transformers' ``SentenceTransformer.encode`` and ``CrossEncoder.predict`` reading that
directory, the engine reads it through its own loader."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from prism_serve.config import ConfigError, ModelConfig
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.hf_reference import write_synthetic_encoder
from prism_serve.engine.llm_engine import LLMEngine
from prism_serve.engine.models import build_model, model_from_packed
from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.sources import encoder_head, hf_config
from prism_serve.engine.weights import load_weights
from prism_serve.errors import InvalidRequestError, PromptTooLongError, UnsupportedModelError
from prism_serve.sim.shapes import shape_of
from tests.conftest import run_to_completion
from tests.engine.gguf_export import write_encoder_gguf, write_unigram_xlmr
from tests.engine.test_embeddings import DOCUMENTS as RERANKED
from tests.engine.test_embeddings import QUERY

TEXTS = [
    "The capital of France is Paris.",
    "A paged KV cache keeps each request's keys and values in fixed-size blocks.",
    "hi",
    "Embeddings map text to vectors; similar texts land near each other. " * 2,
]
DOCUMENTS = [*RERANKED, "capital"]


def _engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": str(path), "dtype": "float32", **overrides}))


@pytest.fixture(scope="module")
def embedders(tmp_path_factory) -> dict[tuple[str, str], object]:
    root = tmp_path_factory.mktemp("encoders")
    return {
        (arch, pooling): write_synthetic_encoder(root / f"{arch}-{pooling}", arch, pooling=pooling, seed=3)
        for arch in ("bert", "roberta")
        for pooling in ("cls", "mean")
    }


@pytest.fixture(scope="module")
def cross_encoders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("cross")
    return {
        arch: write_synthetic_encoder(root / arch, arch, num_labels=1, seed=5, init_std=0.3)
        for arch in ("bert", "roberta")
    }


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


@pytest.mark.parametrize("arch", ["bert", "roberta"])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_embeddings_match_sentence_transformers(embedders, arch, pooling):
    """Four inputs of 3-40 tokens under a step budget of 24 tokens: no input is split (an encoder
    reads it whole: the budget grows to the longest input), none takes a KV block, and each vector,
    normalised as the model's files say, is sentence-transformers' to cosine 0.9999."""
    path = embedders[arch, pooling]
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    engine = _engine(path, max_num_batched_tokens=24)
    engine.record_step_batches = True
    free = engine.allocator.num_free_blocks
    assert engine.prefix_cache is None
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, prompts)) > 24
    for i, ids in enumerate(prompts):
        engine.add_request(ids, SamplingParams(max_tokens=1, pooling=pooling), f"e{i}")
    out, steps = {}, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id] = o
        steps.append(engine.last_step_batch)
        assert engine.allocator.num_free_blocks == free
    fed = sorted(n for step in steps for n, cached, _ in step if cached == 0)
    assert fed == sorted(map(len, prompts)), steps  # each input in one piece
    for i in range(len(prompts)):
        o = out[f"e{i}"]
        assert o.finished and o.token_ids == [] and o.embedding.shape == (64,)
        assert _cosine(o.embedding, want[i]) >= 0.9999, (arch, pooling, i)


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_cross_encoder_scores_and_their_order_match_sentence_transformers(cross_encoders, arch):
    """Each (query, document) pair as the tokenizer joins it ([CLS] q [SEP] d [SEP], the document's
    tokens of type 1; RoBERTa's <s> q </s></s> d </s>): the sigmoid of the head's output is
    CrossEncoder.predict's within 1e-5, so the documents' order is its order."""
    path = cross_encoders[arch]
    pairs = [(QUERY, d) for d in DOCUMENTS]
    want = torch.tensor(CrossEncoder(str(path), device="cpu").predict(pairs), dtype=torch.float64)
    engine = _engine(path)
    for i, (q, d) in enumerate(pairs):
        ids, start = engine.tokenizer.encode_pair(q, d)
        assert (start is None) == (arch == "roberta")
        params = SamplingParams(max_tokens=1, pooling="cls", pair_start=start)
        engine.add_request(ids, params, f"p{i}")
    out = run_to_completion(engine)
    got = torch.tensor(
        [torch.sigmoid(out[f"p{i}"].embedding.double()).item() for i in range(len(pairs))],
        dtype=torch.float64,
    )
    assert all(out[f"p{i}"].embedding.shape == (1,) for i in range(len(pairs)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float(want.max() - want.min()) > 0.05  # spread enough that the order means something
    assert got.argsort().tolist() == want.argsort().tolist()
    if arch == "bert":  # the segment matters: the same pair read as one segment scores otherwise
        ids, start = engine.tokenizer.encode_pair(*pairs[1])
        engine.add_request(ids, SamplingParams(max_tokens=1, pooling="cls"), "one-segment")
        assert abs(torch.sigmoid(run_to_completion(engine)["one-segment"].embedding).item() - got[1]) > 1e-4


def test_the_packed_layout_the_runtime_activates_computes_the_same(cross_encoders, embedders):
    """The host weight cache stores ``packed_tensors()`` and a worker rebuilds the model over them
    with ``model_from_packed``: the same hidden states and head outputs, no copy."""
    from prism_serve.engine.attention import AttentionMetadata, PrefillChunk

    for path in (cross_encoders["bert"], embedders["roberta", "mean"]):
        w = load_weights(str(path))
        model = build_model(w.config, w.tensors, torch.float32)
        packed = model.packed_tensors()
        again = model_from_packed(w.config, packed, torch.float32)
        assert all(a is b for a, b in zip(again.tensors(), model.tensors(), strict=True))
        ids = torch.tensor(w.tokenizer.encode(TEXTS[0]))
        empty = torch.empty(0, dtype=torch.long)
        meta = AttentionMetadata(empty, prefills=[PrefillChunk(0, len(ids), len(ids), empty, None)])
        h1 = model.forward(ids, torch.arange(len(ids)), meta)
        torch.testing.assert_close(again.forward(ids, torch.arange(len(ids)), meta), h1, rtol=0, atol=0)
        assert model.weight_bytes == 4 * w.config.num_params


def test_shapes_and_heads_from_config_json(cross_encoders, embedders):
    """The config readers: RoBERTa's positions start past its padding index (its table's first rows
    unused), a classifier's head size, the parameter count transformers has."""
    import transformers

    bert = ArchConfig.from_hf_config(hf_config(cross_encoders["bert"]))
    assert bert.encoder and bert.num_labels == 1 and bert.position_offset == 0 and bert.type_vocab_size == 2
    roberta = ArchConfig.from_hf_config(hf_config(embedders["roberta", "cls"]))
    assert roberta.architecture == "roberta" and roberta.position_offset == 2
    assert roberta.max_position_embeddings == 128 and roberta.num_labels == 0
    hf = transformers.AutoModel.from_pretrained(str(embedders["roberta", "cls"]), add_pooling_layer=False)
    assert roberta.num_params == sum(p.numel() for p in hf.parameters())
    assert (
        encoder_head(str(cross_encoders["roberta"])) == 1 and encoder_head(str(embedders["bert", "cls"])) == 0
    )
    assert encoder_head("random:smollm2-135m") is None


def test_what_an_encoder_cannot_do_is_refused_and_it_keeps_serving(embedders):
    """A request to generate text, an input past the positions: named errors at add time; the
    longest input that fits is served (a pooled input needs no room for a token)."""
    engine = _engine(embedders["bert", "cls"])
    with pytest.raises(InvalidRequestError, match="encoder"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), "gen")
    with pytest.raises(PromptTooLongError):
        engine.add_request([5] * 129, SamplingParams(max_tokens=1, pooling="cls"), "long")
    engine.add_request([5] * 128, SamplingParams(max_tokens=1, pooling="cls"), "fits")
    assert run_to_completion(engine)["fits"].embedding.shape == (64,)


def test_the_config_checks_an_encoders_task(embedders, cross_encoders):
    """task: embed pools as the sentence-transformers files say (an encoder without them: cls);
    a cross-encoder serves task: score with its head; any other pairing is a ConfigError at start."""
    emb, cross = str(embedders["roberta", "mean"]), str(cross_encoders["bert"])
    task = ModelConfig(name="e", source=emb, task="embed").pooling_task()
    assert (task.task, task.pooling, task.normalize) == ("embed", "mean", True)
    task = ModelConfig(name="c", source=cross, task="score").pooling_task()
    assert task.classifier and task.pooling == "cls"
    for source, kind, match in (
        (emb, "generate", "cannot generate"),
        (cross, "generate", "cannot generate"),
        (cross, "embed", "it scores pairs"),
        (emb, "score", "no classification head"),
    ):
        with pytest.raises(ConfigError, match=match):
            ModelConfig(name="m", source=source, task=kind).pooling_task()
    with pytest.raises(ConfigError, match="a decoder reranker's"):
        ModelConfig(name="m", source=cross, task="score", score_tokens=("no", "yes")).pooling_task()


def test_sentence_transformers_files_cap_the_input_and_refuse_what_is_not_applied(tmp_path):
    """An embedder's ``max_seq_length`` caps the inputs it reads unless the entry sets
    ``max_model_len``; a module the server does not apply (a Dense projection after pooling) is a
    ConfigError naming it, rather than vectors that silently differ from sentence-transformers'."""
    import json

    path = write_synthetic_encoder(tmp_path / "st", "bert", pooling="mean")
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    assert ModelConfig(name="e", source=str(path), task="embed").engine_config().max_model_len == 32
    entry = ModelConfig(name="e", source=str(path), task="embed", max_model_len=100)
    assert entry.engine_config().max_model_len == 100
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(
        2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="module Dense is not applied"):
        ModelConfig(name="e", source=str(path), task="embed").pooling_task()


# -- from GGUF files, as llama.cpp's converter writes them --------------------------------------------


@pytest.fixture(scope="module")
def gguf_embedders(embedders, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("gguf-encoders")
    return {
        pooling: write_encoder_gguf(embedders["bert", pooling], root / f"bert-{pooling}.gguf", pooling)
        for pooling in ("cls", "mean")
    }


def test_a_bert_gguf_files_wordpiece_tokenizes_as_the_models_own(embedders, gguf_embedders):
    """The vocabulary read back from llama.cpp's phantom-space form gives the HF tokenizer's ids:
    mixed case, accents, punctuation, characters outside the vocabulary ([UNK]) and pairs with
    their token types."""
    from tokenizers import Tokenizer as HFTokenizer

    want = HFTokenizer.from_file(str(embedders["bert", "cls"] / "tokenizer.json"))
    got = load_weights(str(gguf_embedders["cls"])).tokenizer
    texts = [*TEXTS, "Crème Brûlée, S.V.P.!", "naïve café: 3.14 — ok?", "日本 emoji 🙂 [SEP] x", ""]
    for text in texts:
        assert got.encode(text) == want.encode(text).ids, text
    pair = want.encode(QUERY, DOCUMENTS[0])
    ids, start = got.encode_pair(QUERY, DOCUMENTS[0])
    assert ids == pair.ids and start == pair.type_ids.index(1)
    assert got.eos_token_ids == () and got.chat_template is None


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_bert_embedders_from_gguf_match_sentence_transformers(embedders, gguf_embedders, pooling):
    """The GGUF file of a BERT embedder: its shape from the header (positions, token types from the
    table), the pooling its header names (the config's default for task: embed, normalised as
    llama.cpp serves it), and the same vectors as sentence-transformers on the HF directory."""
    path = gguf_embedders[pooling]
    w = load_weights(str(path))
    assert w.config.encoder and w.config.type_vocab_size == 2 and w.config.num_labels == 0
    assert w.config.max_position_embeddings == 128 and w.config.position_offset == 0
    task = ModelConfig(name="e", source=str(path), task="embed").pooling_task()
    assert (task.pooling, task.normalize) == (pooling, True)
    assert encoder_head(str(path)) == 0
    shape = shape_of("e", str(path), 4)  # the planner's reading of the same header: no KV kept
    assert shape.config == w.config and shape.engine_kv_bytes_per_token == 0
    with pytest.raises(ConfigError, match="cannot generate"):
        ModelConfig(name="e", source=str(path)).pooling_task()
    want = SentenceTransformer(str(embedders["bert", pooling]), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    engine = _engine(path)
    for i, text in enumerate(TEXTS):
        engine.add_request(
            engine.tokenizer.encode(text), SamplingParams(max_tokens=1, pooling=pooling), f"e{i}"
        )
    out = run_to_completion(engine)
    for i in range(len(TEXTS)):
        assert _cosine(out[f"e{i}"].embedding, want[i]) >= 0.9999, (pooling, i)


def test_gguf_encoders_the_engine_cannot_serve_right_are_refused_by_name(cross_encoders, tmp_path):
    """llama.cpp's converter drops a BERT cross-encoder's pooler (dense and tanh before the
    classifier), so the file cannot give the model's scores: refused at config time and at load,
    saying so, rather than served wrong; so is a RoBERTa file's byte-level BPE vocabulary."""
    path = write_encoder_gguf(cross_encoders["bert"], tmp_path / "cross.gguf")
    with pytest.raises(ConfigError, match="without its pooler"):
        ModelConfig(name="c", source=str(path), task="score").pooling_task()
    with pytest.raises(UnsupportedModelError, match="without its pooler"):
        load_weights(str(path))
    # RoBERTa's byte-level BPE vocabulary in a bert file: no rule here would add <s> and </s>
    with pytest.raises(UnsupportedModelError, match="'gpt2' vocabulary"):
        ArchConfig.from_gguf_metadata({"general.architecture": "bert", "tokenizer.ggml.model": "gpt2"})


@pytest.fixture(scope="module")
def gguf_xlmr(tmp_path_factory) -> dict[str, tuple[object, object]]:
    """XLM-RoBERTa's embedder and cross-encoder with a unigram vocabulary (bge-m3's and
    bge-reranker-v2-m3's kind), each as an HF directory and as llama.cpp's GGUF file of it."""
    root = tmp_path_factory.mktemp("gguf-xlmr")
    emb = write_unigram_xlmr(root / "emb", pooling="mean", seed=7)
    cross = write_unigram_xlmr(root / "cross", num_labels=1, seed=8)
    return {
        "embed": (emb, write_encoder_gguf(emb, root / "emb.gguf", "mean")),
        "score": (cross, write_encoder_gguf(cross, root / "cross.gguf")),
    }


def test_an_xlm_roberta_gguf_files_unigram_vocabulary_tokenizes_as_its_own(gguf_xlmr):
    """The t5 (SentencePiece unigram) vocabulary with its scores and precompiled NFKC map gives the
    HF tokenizer's ids: runs of spaces, full-width and circled characters folded, characters it
    lacks as <unk>, its special tokens in the text, and pairs joined as RoBERTa joins them."""
    from tokenizers import Tokenizer as HFTokenizer

    hf_dir, path = gguf_xlmr["embed"]
    want = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    got = load_weights(str(path)).tokenizer
    texts = [*TEXTS, "Hello  World, naïve café! ＡＢＣ ①", "  lead  and trail  ", "<unk> <mask> x", ""]
    for text in texts:
        assert got.encode(text) == want.encode(text).ids, text
    ids, start = got.encode_pair(QUERY, DOCUMENTS[0])
    assert ids == want.encode(QUERY, DOCUMENTS[0]).ids and start is None


def test_xlm_roberta_from_gguf_embeds_and_scores_as_sentence_transformers(gguf_xlmr):
    """bge-m3's kind (mean pooling from the header) gives sentence-transformers' vectors; the
    cross-encoder's head (RoBERTa's dense, tanh and output projection, which the converter keeps)
    gives CrossEncoder.predict's scores within 1e-5 and its order."""
    hf_dir, path = gguf_xlmr["embed"]
    w = load_weights(str(path))
    assert w.config.position_offset == 0 and w.config.max_position_embeddings == 128
    assert w.config.type_vocab_size == 1
    task = ModelConfig(name="e", source=str(path), task="embed").pooling_task()
    assert (task.pooling, task.normalize) == ("mean", True)
    want = SentenceTransformer(str(hf_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)
    engine = _engine(path)
    for i, text in enumerate(TEXTS):
        engine.add_request(
            engine.tokenizer.encode(text), SamplingParams(max_tokens=1, pooling="mean"), f"e{i}"
        )
    out = run_to_completion(engine)
    for i in range(len(TEXTS)):
        assert _cosine(out[f"e{i}"].embedding, want[i]) >= 0.9999, i

    hf_dir, path = gguf_xlmr["score"]
    assert encoder_head(str(path)) == 1
    assert ModelConfig(name="c", source=str(path), task="score").pooling_task().classifier
    pairs = [(QUERY, d) for d in DOCUMENTS]
    want = torch.tensor(CrossEncoder(str(hf_dir), device="cpu").predict(pairs), dtype=torch.float64)
    engine = _engine(path)
    for i, (q, d) in enumerate(pairs):
        ids, start = engine.tokenizer.encode_pair(q, d)
        engine.add_request(ids, SamplingParams(max_tokens=1, pooling="cls", pair_start=start), f"p{i}")
    out = run_to_completion(engine)
    got = torch.tensor(
        [torch.sigmoid(out[f"p{i}"].embedding.double()).item() for i in range(len(pairs))],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float(want.max() - want.min()) > 0.05 and got.argsort().tolist() == want.argsort().tolist()
