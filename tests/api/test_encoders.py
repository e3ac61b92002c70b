"""BERT-family encoders live: a real `prism serve` process with two embedders (BERT pooling its
[CLS] state, XLM-RoBERTa its mean), two cross-encoders (BERT and XLM-RoBERTa) and the real SmolLM2
as a chat model, on one CPU device. Each encoder is a tiny model of random weights (SYNTHETIC,
written by transformers: no real encoder weights are reachable here); the reference is
sentence-transformers reading the same directories. Clients: the official `openai` client, plain
HTTP and Cohere's SDK."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from sentence_transformers import CrossEncoder, SentenceTransformer

from prism_serve.engine.hf_reference import write_synthetic_encoder
from tests.api.conftest import API_KEY, start_server, stop_clean
from tests.engine.gguf_export import write_encoder_gguf, write_unigram_xlmr
from tests.engine.test_encoders import DOCUMENTS, QUERY, TEXTS

CONFIG = """
devices:
  - {{name: "cpu:0", memory: 2GiB, workers: 1}}
models:
  - {{name: bge, source: "{bge}", task: embed, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: e5, source: "{e5}", task: embed, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: bge-gguf, source: "{bge_gguf}", task: embed, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: cross, source: "{cross}", task: score, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: xcross, source: "{xcross}", task: score, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: m3-gguf, source: "{m3_gguf}", task: score, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: smol, dtype: float32, max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
server:
  api_keys: [{api_key}]
  namespace: "{{namespace}}"
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoder-models")
    bge = write_synthetic_encoder(root / "bge", "bert", pooling="cls", seed=11)
    m3 = write_unigram_xlmr(root / "m3", num_labels=1, seed=15)  # bge-reranker-v2-m3's kind
    return {
        "m3": str(m3),
        "m3_gguf": str(write_encoder_gguf(m3, root / "m3.gguf")),
        "bge": str(bge),
        "bge_gguf": str(write_encoder_gguf(bge, root / "bge.gguf", "cls")),  # as llama.cpp converts it
        "e5": str(write_synthetic_encoder(root / "e5", "roberta", pooling="mean", seed=12)),
        "cross": str(write_synthetic_encoder(root / "cross", "bert", num_labels=1, seed=13, init_std=0.3)),
        "xcross": str(
            write_synthetic_encoder(root / "xcross", "roberta", num_labels=1, seed=14, init_std=0.3)
        ),
    }


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("encoders-server")
    srv = start_server(tmp, CONFIG.format(api_key=API_KEY, **dirs))
    yield srv
    stop_clean(srv)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def post(server, body: dict, route: str) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120)  # fmt: skip


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("model", ["bge", "e5", "bge-gguf"])
def test_the_openai_client_gets_sentence_transformers_vectors(client, dirs, model):
    """base64 (the client's default), in input order, normalised as the model's files say, and
    the usage counts the tokens with the tokenizer's [CLS] and [SEP]. bge-gguf is bge's GGUF file
    as llama.cpp's converter writes it: the same vectors as bge's directory."""
    st = SentenceTransformer(dirs["bge" if model == "bge-gguf" else model], device="cpu")
    want = st.encode(TEXTS)
    r = client.embeddings.create(model=model, input=TEXTS)
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    for d, w in zip(r.data, want, strict=True):
        assert len(d.embedding) == 64 and _cosine(d.embedding, w) >= 0.9999
        assert np.linalg.norm(d.embedding) == pytest.approx(1.0, abs=1e-5)
    assert r.usage.prompt_tokens == sum(len(st.tokenizer(t)["input_ids"]) for t in TEXTS)


@pytest.mark.parametrize("model", ["cross", "xcross", "m3-gguf"])
def test_rerank_and_score_read_the_cross_encoders_head(server, dirs, model):
    """/v1/rerank orders the documents as CrossEncoder.predict scores them, with its scores; /v1/score
    pairs them one against many; Cohere's SDK gets the same order. m3-gguf is an XLM-RoBERTa
    cross-encoder with a unigram vocabulary as llama.cpp's GGUF file of it; the reference reads
    its HF directory."""
    import cohere

    want = (
        CrossEncoder(dirs["m3" if model == "m3-gguf" else model], device="cpu")
        .predict([(QUERY, d) for d in DOCUMENTS])
        .astype(float)
    )
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    r = post(server, {"model": model, "query": QUERY, "documents": DOCUMENTS}, "/v1/rerank")
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == order
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
    r = post(server, {"model": model, "text_1": QUERY, "text_2": DOCUMENTS}, "/v1/score")
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(list(want), abs=1e-5)
    co = cohere.ClientV2(api_key=API_KEY, base_url=server.url, timeout=120)
    assert [
        x.index for x in co.rerank(model=model, query=QUERY, documents=DOCUMENTS, top_n=2).results
    ] == order[:2]


def test_limits_and_wrong_routes_get_openai_errors_and_the_models_keep_serving(server, client, dirs):
    """The longest input that fits the positions is served (a pooled input needs no room for a
    token); one more is a 400 naming input; a chat request to an encoder and an embedding request to
    a cross-encoder are 400s naming the routes that serve them; the chat model still chats."""
    ids = [7] * 128
    r = post(server, {"model": "bge", "input": [ids], "encoding_format": "float"}, "/v1/embeddings")
    assert r.status_code == 200, r.text
    r = post(server, {"model": "bge", "input": [[*ids, 7]]}, "/v1/embeddings")
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    with pytest.raises(openai.BadRequestError, match="ask /v1/embeddings"):
        client.chat.completions.create(model="e5", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    r = post(server, {"model": "cross", "input": "hi"}, "/v1/embeddings")
    assert r.status_code == 400 and "/v1/rerank" in r.json()["error"]["message"], r.text
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert chat.choices[0].message.content
    r = client.embeddings.create(model="bge", input="still here")
    assert len(r.data[0].embedding) == 64
