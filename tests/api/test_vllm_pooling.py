"""Embeddings and cross-encoder scores on vLLM's engine (``engine: vllm`` with ``task: embed`` or
``task: score``), for an architecture the built-in engine does not read (ModernBERT), through
`prism serve` and the official clients, against sentence-transformers and transformers on the same
weights; a decoder embedder (SmolLM2 as an embedding model) on vLLM against the same model on the
built-in engine, both served at once; and SmolLM2 as a decoder reranker on vLLM against
transformers' yes/no logits.

The ModernBERT checkpoints are SYNTHETIC: transformers' random initialisation (seeded), two layers,
saved in fp32 with the SmolLM2 tokenizer; the embedder carries sentence-transformers' files (mean
pooling, normalised), the cross-encoder a one-output classification head. SmolLM2 is the real
SmolLM2-135M-Instruct."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI

from prism_serve.engine.config import PoolingTask
from prism_serve.engine.sources import write_embedding_files
from prism_serve.engine.tokenizer import Tokenizer
from tests.api.conftest import ServerProcess, ledger_snapshot, start_server, stop_clean
from tests.api.test_vllm_server import VLLM_PYTHON

TEXTS = [
    "The capital of France is Paris.",
    "A cat sat on the mat and watched the birds outside.",
    "hello",
    "Paged attention keeps the KV cache in fixed-size blocks.",
]
QUERY = "Which city is the capital of France?"


def _modernbert_config(**extra):
    from transformers import ModernBertConfig

    return ModernBertConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, global_attn_every_n_layers=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, **extra,
    )  # fmt: skip


def _with_tokenizer(path: Path, smol: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, path / name)
    return path


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory, smollm_hf: Path) -> dict[str, Path]:
    from transformers import ModernBertForSequenceClassification, ModernBertModel

    root = tmp_path_factory.mktemp("modernbert")
    torch.manual_seed(0)
    embedder = root / "mbert-embed"
    ModernBertModel(_modernbert_config()).eval().save_pretrained(embedder)
    write_embedding_files(embedder, "mean", True, 128)
    torch.manual_seed(1)
    reranker = root / "mbert-rerank"
    ModernBertForSequenceClassification(_modernbert_config(num_labels=1)).eval().save_pretrained(reranker)
    return {"embed": _with_tokenizer(embedder, smollm_hf), "rerank": _with_tokenizer(reranker, smollm_hf)}


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, encoders: dict[str, Path], smollm_hf: Path
) -> ServerProcess:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: run scripts/vllm-server-env.sh"
    config = f"""
devices:
  - {{name: "cpu:0", memory: 2GiB, workers: 1}}
models:
  - {{name: mb-embed, engine: vllm, task: embed, source: "{encoders["embed"]}", dtype: float32}}
  - {{name: mb-rerank, engine: vllm, task: score, source: "{encoders["rerank"]}", dtype: float32}}
  - {{name: smol-vllm, engine: vllm, task: embed, source: "{smollm_hf}", dtype: float32, max_model_len: 512}}
  - {{name: smol-builtin, task: embed, source: "{smollm_hf}", dtype: float32, max_model_len: 512}}
  - {{name: smol-rerank, engine: vllm, task: score, source: "{smollm_hf}", dtype: float32,
     max_model_len: 512}}
policy: {{name: prism, activation_timeout_s: 240}}
vllm_python: "{VLLM_PYTHON}"
server: {{namespace: "{{namespace}}"}}
"""
    srv = start_server(tmp_path_factory.mktemp("vllm-pooling"), config, timeout_s=300)
    yield srv
    stop_clean(srv)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", timeout=240, max_retries=0)


def test_an_encoder_embedder_on_vllm_matches_sentence_transformers(client, encoders) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(encoders["embed"]), device="cpu")
    st.tokenizer.pad_token = "<|endoftext|>"  # SmolLM2's tokenizer names no pad token
    expected = np.stack([st.encode([t])[0] for t in TEXTS])  # one at a time: nothing padded
    r = client.embeddings.create(model="mb-embed", input=TEXTS)
    got = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
    assert got.shape == expected.shape == (len(TEXTS), 128)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999, cosine
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # its Normalize module
    # dimensions cuts before the normalisation, as for the built-in engine
    cut = client.embeddings.create(model="mb-embed", input=TEXTS[0], dimensions=32).data[0].embedding
    part = got[0][:32] / np.linalg.norm(got[0][:32])
    assert len(cut) == 32 and np.allclose(cut, part, atol=1e-5)


def check_rerank(server: ServerProcess, model: str, expected: list[float], tolerance: float) -> None:
    """/v1/rerank of QUERY against TEXTS: ``expected``'s order, each score within ``tolerance``."""
    body = {"model": model, "query": QUERY, "documents": TEXTS}
    r = httpx.post(f"{server.base_url}/rerank", json=body, timeout=240)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=tolerance)


def test_a_cross_encoder_on_vllm_scores_pairs_as_transformers_does(server, encoders) -> None:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(encoders["rerank"], dtype=torch.float32).eval()
    ours = Tokenizer.from_hf_dir(encoders["rerank"])  # the pair as the server joins it
    expected = []
    with torch.no_grad():
        for doc in TEXTS:
            ids, _ = ours.encode_pair(QUERY, doc)
            logit = float(model(torch.tensor([ids])).logits[0, 0])
            expected.append(1.0 / (1.0 + np.exp(-logit)))
    check_rerank(server, "mb-rerank", expected, 1e-5)
    s = httpx.post(
        f"{server.base_url}/score", json={"model": "mb-rerank", "text_1": QUERY, "text_2": TEXTS}, timeout=240
    )
    assert s.status_code == 200, s.text
    assert [d["score"] for d in s.json()["data"]] == pytest.approx(expected, abs=1e-5)


def test_a_decoder_reranker_on_vllm_scores_with_its_yes_and_no_logits(server, smollm_hf) -> None:
    """SmolLM2 with Qwen3-Reranker's prompt (the default): vLLM runs it as a one-output classifier
    whose weight is the head's yes row less its no row; the score is transformers'
    sigmoid(logit(yes) - logit(no)) at the prompt's last position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_hf, dtype=torch.float32).eval()
    tok = Tokenizer.from_hf_dir(smollm_hf)
    no, yes = tok.one_token("no"), tok.one_token("yes")
    task = PoolingTask("score")
    expected = []
    with torch.no_grad():
        for doc in TEXTS:
            logits = model(torch.tensor([tok.encode(task.prompt(QUERY, doc))])).logits[0, -1]
            expected.append(float(torch.sigmoid(logits[yes] - logits[no])))
    check_rerank(server, "smol-rerank", expected, 1e-4)
    cards = httpx.get(f"{server.base_url}/models", timeout=60).json()["data"]
    loaded = {c["id"]: c["weights_loaded_by"] for c in cards}
    assert loaded["smol-rerank"] == "plan", loaded  # its score weight made at load, then the plan


def test_a_decoder_embedder_on_vllm_gives_the_builtin_engines_vectors(client) -> None:
    on_vllm = client.embeddings.create(model="smol-vllm", input=TEXTS)
    builtin = client.embeddings.create(model="smol-builtin", input=TEXTS)
    a = np.array([d.embedding for d in sorted(on_vllm.data, key=lambda d: d.index)])
    b = np.array([d.embedding for d in sorted(builtin.data, key=lambda d: d.index)])
    assert a.shape == b.shape == (len(TEXTS), 576)
    assert (a * b).sum(1).min() >= 0.9999  # both normalised: the last token's state, as configured
    assert on_vllm.usage.prompt_tokens == builtin.usage.prompt_tokens
    # its weights came in by the checked load plan: the LM head vLLM's embedding model never
    # calls is neither loaded nor kept
    card = {m.id: m for m in client.models.list().data}["smol-vllm"].model_extra
    assert card["weights_loaded_by"] == "plan", card


def test_the_encoders_hold_no_kv_and_answer_only_their_routes(server, client) -> None:
    snap = ledger_snapshot(server)
    assert snap.used_bytes <= snap.budget_bytes
    kv = {e.name: e.mapped_bytes for e in snap.entries if e.name.endswith(" kv")}
    # vLLM gives an encoder no KV cache, and the ledger no KV pages; the decoder embedder has some
    assert kv.get("mb-embed kv", 0) == 0 and kv.get("mb-rerank kv", 0) == 0, kv
    assert kv.get("smol-vllm kv", 0) > 0, kv
    r = httpx.post(f"{server.base_url}/completions", json={"model": "mb-embed", "prompt": "x"}, timeout=60)
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/embeddings", json={"model": "mb-rerank", "input": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    # the engines still answer afterwards
    assert len(client.embeddings.create(model="mb-embed", input="still here").data[0].embedding) == 128


def test_an_evicted_pooled_model_comes_back_with_the_same_answers(server, client) -> None:
    """Unloaded by hand, an encoder on vLLM gives back its weights' pages (the ledger holds nothing
    under its name); its next request activates it again, and the vectors are the same."""
    before = np.array([d.embedding for d in client.embeddings.create(model="mb-embed", input=TEXTS[:2]).data])
    activations = {m.id: m.model_extra["num_activations"] for m in client.models.list().data}
    r = httpx.post(f"{server.base_url}/admin/models/mb-embed/unload", json={}, timeout=240)
    assert r.status_code == 200, r.text
    held = {e.name: e.mapped_bytes for e in ledger_snapshot(server).entries}
    assert held.get("mb-embed weights", 0) == 0 and held.get("mb-embed kv", 0) == 0, held
    after = np.array([d.embedding for d in client.embeddings.create(model="mb-embed", input=TEXTS[:2]).data])
    assert np.allclose(after, before, atol=1e-6)
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards["mb-embed"]["num_activations"] == activations["mb-embed"] + 1
    assert cards["mb-embed"]["state"] == "active"
