"""``/v1/embeddings`` live: a real `prism serve` process with the real SmolLM2 weights served as
two embedding models (one pooling as its sentence-transformers files say, one as the config
overrides) beside a chat model, on one CPU device whose budget cannot hold all three at once; the
official `openai` client, plain HTTP and LangChain's ``OpenAIEmbeddings`` as clients."""

from __future__ import annotations

import base64
import signal
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prism_serve.api.process import stop_server_process
from prism_serve.engine.sources import write_embedding_files
from prism_serve.engine.weights import save_hf_dir
from tests.api.conftest import API_KEY, LedgerWatch, shm_files, start_server
from tests.engine.test_embeddings import TEXTS, hf_pooled

# 1.4 GiB: two of the three models' fp32 weights (0.54 GB each) and their KV, not all three
CONFIG = """
devices:
  - {{name: "cpu:0", memory: 1.4GiB, workers: 1}}
models:
  - {{name: embedder, source: "{st_dir}", task: embed, dtype: float32, max_model_len: 512,
     ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: embed-last, source: "{st_dir}", task: embed, pooling: last, normalize: false, dtype: float32,
     max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: smol, dtype: float32, max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
policy: {{name: prism}}
server:
  api_keys: [{api_key}]
  namespace: "{{namespace}}"
"""


def write_sentence_transformers(weights, path: Path) -> Path:
    """The weights as an HF directory with the files sentence-transformers writes beside them:
    mean pooling, then a Normalize module."""
    save_hf_dir(weights, path)
    write_embedding_files(path, "mean", True, weights.config.hidden_size)
    return path


@pytest.fixture(scope="module")
def server(smollm, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("embeddings")
    st_dir = write_sentence_transformers(smollm, tmp / "smol-embed")
    srv = start_server(tmp, CONFIG.format(st_dir=st_dir, api_key=API_KEY))
    yield srv
    code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()
    assert shm_files(srv.namespace) == [], "shared memory left behind after shutdown"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def expected(smollm) -> dict[str, list[np.ndarray]]:
    """transformers' vectors: mean-pooled and normalised (embedder), last token raw (embed-last)."""
    out: dict[str, list[np.ndarray]] = {"embedder": [], "embed-last": []}
    for text in TEXTS:
        ids = smollm.tokenizer.encode(text)
        mean = hf_pooled(smollm, ids, "mean")
        out["embedder"].append((mean / mean.norm()).numpy())
        out["embed-last"].append(hf_pooled(smollm, ids, "last").numpy())
    return out


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def post(server, body: dict) -> httpx.Response:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server.base_url}/embeddings", json=body, headers=auth, timeout=180)


def test_the_openai_client_gets_each_inputs_vector_as_transformers_computes_it(client, smollm, expected):
    """The client asks for base64 by default and decodes it; the vectors are in input order,
    mean-pooled and normalised as the checkpoint's sentence-transformers files say."""
    r = client.embeddings.create(model="embedder", input=TEXTS)
    assert (
        r.object == "list" and r.model == "embedder" and [d.index for d in r.data] == list(range(len(TEXTS)))
    )
    for d, want in zip(r.data, expected["embedder"], strict=True):
        assert len(d.embedding) == 576
        assert _cosine(d.embedding, want) >= 0.9999
        assert np.linalg.norm(d.embedding) == pytest.approx(1.0, abs=1e-5)
    assert (
        r.usage.prompt_tokens == r.usage.total_tokens == sum(len(smollm.tokenizer.encode(t)) for t in TEXTS)
    )


def test_floats_token_ids_dimensions_and_the_configs_own_pooling(server, smollm, expected):
    ids = [smollm.tokenizer.encode(t) for t in TEXTS[:2]]
    r = post(server, {"model": "embedder", "input": ids, "encoding_format": "float", "dimensions": 64})
    assert r.status_code == 200, r.text
    for d, want in zip(r.json()["data"], expected["embedder"][:2], strict=True):
        cut = want[:64] / np.linalg.norm(want[:64])  # truncated, then normalised again
        assert len(d["embedding"]) == 64 and _cosine(d["embedding"], cut) >= 0.9999
        assert np.linalg.norm(d["embedding"]) == pytest.approx(1.0, abs=1e-5)
    # the config's pooling: last and normalize: false over the same directory's files
    r = post(server, {"model": "embed-last", "input": TEXTS[0], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    want = expected["embed-last"][0]
    assert _cosine(vector, want) >= 0.9999 and np.linalg.norm(vector) == pytest.approx(
        np.linalg.norm(want), rel=1e-3
    )


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "smol", "input": "hi"}, 400, "model"),  # a chat model does not embed
        ({"model": "nope", "input": "hi"}, 404, None),
        ({"model": "embedder", "input": ""}, 400, "input"),
        ({"model": "embedder", "input": ["ok", ""]}, 400, "input"),
        ({"model": "embedder", "input": [[1, 2], []]}, 400, "input"),
        ({"model": "embedder", "input": [49152]}, 400, "input"),  # past the vocabulary
        ({"model": "embedder", "input": "word " * 600}, 400, "input"),  # past max_model_len
        ({"model": "embedder", "input": "hi", "dimensions": 577}, 400, "dimensions"),
        ({"model": "embedder", "input": "hi", "dimensions": 0}, 400, "dimensions"),
        ({"model": "embedder", "input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ],
    ids=[
        "chat-model",
        "unknown",
        "empty",
        "empty-in-list",
        "empty-ids",
        "bad-id",
        "too-long",
        "too-wide",
        "zero-dims",
        "bad-format",
    ],
)
def test_bad_embedding_requests_get_openai_errors(server, body, status, param):
    r = post(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error


def test_a_chat_request_to_an_embedding_model_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model="embedder", messages=[{"role": "user", "content": "hi"}])


def test_langchain_embeds_documents_and_queries(server, expected):
    """LangChain's OpenAIEmbeddings as a RAG pipeline sets it up for a server that is not OpenAI:
    text inputs (no tiktoken ids), in chunks."""
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="embedder", base_url=server.base_url, api_key=API_KEY,
                           check_embedding_ctx_length=False, chunk_size=2, max_retries=0)  # fmt: skip
    docs = emb.embed_documents(TEXTS)
    assert len(docs) == len(TEXTS)
    for got, want in zip(docs, expected["embedder"], strict=True):
        assert _cosine(got, want) >= 0.9999
    assert _cosine(emb.embed_query(TEXTS[1]), expected["embedder"][1]) >= 0.9999


def test_embedders_and_a_chat_model_take_turns_in_a_budget_that_holds_two(server, client, expected):
    """Three models of 0.54 GB of weights each on 1.4 GiB: asked in turn, each is activated (the
    policy evicts another), every answer is right, and the ledger never grants more than the budget."""
    with LedgerWatch(server):  # asserts the budget at every sample
        for model in ("smol", "embedder", "embed-last", "smol"):
            if model == "smol":
                chat = client.chat.completions.create(
                    model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
                    max_tokens=8, temperature=0,
                )  # fmt: skip
                assert chat.choices[0].message.content
                continue
            r = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
            assert _cosine(r.data[0].embedding, expected[model][0]) >= 0.9999
    cards = {
        c["id"]: c
        for c in httpx.get(
            f"{server.base_url}/models", headers={"Authorization": f"Bearer {API_KEY}"}
        ).json()["data"]
    }
    # at most two resident at once: the chat model, asked again after both embedders, comes back
    assert sum(cards[m]["num_activations"] for m in ("smol", "embedder", "embed-last")) >= 4, cards
    # each input counts as a request in /metrics, its latency as its time to first token
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    ttft = {
        s.labels["model_name"]: s.value
        for f in families
        for s in f.samples
        if s.name == "vllm:time_to_first_token_seconds_count"
    }
    assert ttft["embedder"] >= 2 and ttft["embed-last"] >= 2 and ttft["smol"] >= 2, ttft
