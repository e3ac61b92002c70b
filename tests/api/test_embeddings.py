"""``/v1/embeddings``, ``/v1/rerank`` and ``/v1/score`` live: a real `prism serve` process with the
real SmolLM2 weights served as two embedding models (one pooling as its sentence-transformers files
say, one as the config overrides), a reranker (task: score, Qwen3-Reranker's prompt; SmolLM2 reads
the same ChatML markers) and three chat models, on one CPU device whose budget holds two of the six
at once. Clients: the official `openai` client, plain HTTP, LangChain's ``OpenAIEmbeddings``,
LlamaIndex's ``OpenAILikeEmbedding`` and Cohere's SDK (its rerank call, as RAG frameworks make it)."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from prism_serve.engine.config import PoolingTask
from prism_serve.engine.sources import write_embedding_files
from prism_serve.engine.weights import save_hf_dir
from tests.api.conftest import API_KEY, LedgerWatch, start_server, stop_clean
from tests.engine.test_embeddings import DOCUMENTS, QUERY, TEXTS, hf_next_logits, hf_pooled

# 1.4 GiB: two of the six models' fp32 weights (0.54 GB each) and their KV, not three; a model idle
# for 2 s may be evicted (the default, 30 s, would make each turn below wait that long)
CONFIG = """
devices:
  - {{name: "cpu:0", memory: 1.4GiB, workers: 1}}
models:
  - {{name: embedder, source: "{st_dir}", task: embed, dtype: float32, max_model_len: 512,
     latency_slo: 30.0}}
  - {{name: embed-last, source: "{st_dir}", task: embed, pooling: last, normalize: false, dtype: float32,
     max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: reranker, task: score, dtype: float32, max_model_len: 512, latency_slo: 30.0}}
  - {{name: smol, dtype: float32, max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: chat-b, dtype: float32, max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: chat-c, dtype: float32, max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
policy: {{name: prism, knobs: {{idle_threshold_s: 2.0}}}}
server:
  api_keys: [{api_key}]
  namespace: "{{namespace}}"
  request_log: "{{state_dir}}/requests.jsonl"
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
    stop_clean(srv)


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


def post(server, body: dict, route: str = "/v1/embeddings") -> httpx.Response:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server.url}{route}", json=body, headers=auth, timeout=180)


def hf_scores(smollm, pairs: list[tuple[str, str]], instruction: str | None = None) -> list[float]:
    """transformers' probability of yes against no after each pair's prompt (Qwen3-Reranker's)."""
    task, tok = PoolingTask("score"), smollm.tokenizer
    tokens = [tok.one_token(t) for t in task.tokens]
    out = []
    for query, doc in pairs:
        no, yes = hf_next_logits(smollm, tok.encode(task.prompt(query, doc, instruction)), tokens).double()
        out.append(float(torch.sigmoid(yes - no)))
    return out


@pytest.fixture(scope="module")
def rerank_expected(smollm) -> list[float]:
    return hf_scores(smollm, [(QUERY, d) for d in DOCUMENTS])


def test_rerank_orders_documents_as_transformers_scores_them(server, rerank_expected):
    """Jina's and Cohere's form: results best first with their index and text, the scores
    transformers' yes-against-no probabilities; top_n cuts, return_documents false leaves the
    texts out, documents may come as {"text": ...} objects."""
    r = post(server, {"model": "reranker", "query": QUERY, "documents": DOCUMENTS}, "/v1/rerank")
    assert r.status_code == 200, r.text
    body = r.json()
    want_order = sorted(range(len(DOCUMENTS)), key=lambda i: -rerank_expected[i])
    assert [x["index"] for x in body["results"]] == want_order and body["model"] == "reranker"
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(rerank_expected[x["index"]], abs=1e-3)
        assert x["document"] == {"text": DOCUMENTS[x["index"]]}
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 50 * len(DOCUMENTS)
    r = post(server, {"model": "reranker", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
                      "top_n": 2, "return_documents": False}, "/rerank")  # fmt: skip
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == want_order[:2]
    assert all("document" not in x for x in r.json()["results"])


def test_score_pairs_one_against_many_and_many_against_many(server, smollm, rerank_expected):
    """vLLM's /score: one query against each document, then pairs in order (under another pair of
    names), and an instruction of the request's own."""
    r = post(server, {"model": "reranker", "text_1": QUERY, "text_2": DOCUMENTS}, "/score")
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(DOCUMENTS))) and data[0]["object"] == "score"
    assert [d["score"] for d in data] == pytest.approx(rerank_expected, abs=1e-3)
    pairs = [("Where is the Eiffel Tower?", DOCUMENTS[2]), (QUERY, DOCUMENTS[0])]
    instruction = "Judge whether the document answers the question"
    body = {"model": "reranker", "queries": [q for q, _ in pairs], "documents": [d for _, d in pairs]}
    r = post(server, {**body, "instruction": instruction}, "/v1/score")
    assert r.status_code == 200, r.text
    got = [d["score"] for d in r.json()["data"]]
    assert got == pytest.approx(hf_scores(smollm, pairs, instruction), abs=1e-3)


def test_cohere_and_llamaindex_clients(server, expected, rerank_expected):
    """Cohere's SDK reranks as RAG frameworks call it (/v2/rerank); LlamaIndex embeds through its
    OpenAI-like embedding (text inputs, batched)."""
    import cohere
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    co = cohere.ClientV2(api_key=API_KEY, base_url=server.url, timeout=180)
    r = co.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [x.index for x in r.results] == sorted(range(4), key=lambda i: -rerank_expected[i])[:3]
    assert r.results[0].relevance_score == pytest.approx(max(rerank_expected), abs=1e-3)
    emb = OpenAILikeEmbedding(model_name="embedder", api_base=server.base_url, api_key=API_KEY,
                              embed_batch_size=2, max_retries=0)  # fmt: skip
    got = emb.get_text_embedding_batch(TEXTS)
    assert len(got) == len(TEXTS)
    for vector, want in zip(got, expected["embedder"], strict=True):
        assert _cosine(vector, want) >= 0.9999


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
        ({"model": "reranker", "input": "hi"}, 400, "model"),  # a reranker does not embed
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
        "reranker",
    ],
)
def test_bad_embedding_requests_get_openai_errors(server, body, status, param):
    r = post(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("/v1/rerank", {"model": "smol", "query": "q", "documents": ["d"]}, 400, "model"),
        ("/v1/rerank", {"model": "embedder", "query": "q", "documents": ["d"]}, 400, "model"),
        ("/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]}, 404, None),
        ("/v1/rerank", {"model": "reranker", "query": "q", "documents": []}, 400, "documents"),
        ("/v1/rerank", {"model": "reranker", "query": "", "documents": ["d"]}, 400, "query"),
        ("/v1/rerank", {"model": "reranker", "query": "q", "documents": ["word " * 600]}, 400, "documents"),
        ("/v1/rerank", {"model": "reranker", "query": "q", "documents": ["d"], "top_n": -1}, 400, "top_n"),
        ("/v1/score", {"model": "reranker", "queries": ["a", "b"], "documents": ["x", "y", "z"]}, 400, None),
        ("/v1/score", {"model": "reranker", "text_1": "a"}, 400, None),
        ("/v1/score", {"model": "reranker", "text_1": "a", "text_2": ["x", ""]}, 400, None),
    ],
    ids=[
        "chat-model",
        "embedder",
        "unknown",
        "no-documents",
        "empty-query",
        "too-long",
        "negative-top-n",
        "uneven-sides",
        "one-side",
        "empty-text",
    ],
)
def test_bad_rerank_and_score_requests_get_openai_errors(server, route, body, status, param):
    r = post(server, body, route)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error


def test_max_tokens_per_doc_cuts_a_document_too_long_for_the_model(server):
    body = {"model": "reranker", "query": "q", "documents": ["word " * 600, "short"]}
    body["max_tokens_per_doc"] = 64
    r = post(server, body, "/v1/rerank")
    assert r.status_code == 200, r.text
    assert sorted(x["index"] for x in r.json()["results"]) == [0, 1]


@pytest.mark.parametrize("model, match", [("embedder", "embedding model"), ("reranker", "reranker")])
def test_a_chat_request_to_an_embedder_or_a_reranker_is_refused(client, model, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])


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


def test_chat_models_embedders_and_a_reranker_take_turns_in_a_budget_that_holds_two(
    server, client, expected, rerank_expected
):
    """Six models of 0.54 GB of weights each on 1.4 GiB (three chat models, two embedders, a
    reranker): asked in turn, each is activated (the policy evicts another), every route answers
    right, and the ledger never grants more than the budget."""
    chats = ("smol", "chat-b", "chat-c")
    turns = ("smol", "embedder", "chat-b", "reranker", "embed-last", "chat-c", "smol")
    before = _counts(server)
    with LedgerWatch(server):  # asserts the budget at every sample
        for model in turns:
            if model in chats:
                chat = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                    max_tokens=8, temperature=0,
                )  # fmt: skip
                assert chat.choices[0].message.content
            elif model == "reranker":
                r = post(server, {"model": model, "query": QUERY, "documents": DOCUMENTS[:2]}, "/v1/rerank")
                scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
                assert scores == pytest.approx(dict(enumerate(rerank_expected[:2])), abs=1e-3)
            else:
                r = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
                assert _cosine(r.data[0].embedding, expected[model][0]) >= 0.9999
    after = _counts(server)
    # two resident at most: of six models asked one after another, at most two were resident at
    # the start, and smol, asked again after five others, had been evicted
    activations = {m: after[m][0] - before[m][0] for m in after}
    assert sum(activations.values()) >= 5 and activations["smol"] >= 1, activations
    # each input or pair counts as a request in /metrics, its latency as its time to first token
    served = {m: after[m][1] - before[m][1] for m in after}
    assert served == {"smol": 2, "chat-b": 1, "chat-c": 1, "embedder": 1, "embed-last": 1, "reranker": 2}


def _counts(server) -> dict[str, tuple[int, int]]:
    """Each model's (activations, requests with a first token) as /v1/models and /metrics say."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    cards = httpx.get(f"{server.base_url}/models", headers=auth).json()["data"]
    ttft = {
        s.labels["model_name"]: int(s.value)
        for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
        for s in f.samples
        if s.name == "vllm:time_to_first_token_seconds_count"
    }
    return {c["id"]: (c["num_activations"], ttft.get(c["id"], 0)) for c in cards}


def test_a_score_token_that_is_not_one_token_stops_the_server_at_start(smollm):
    """The served table is built once the controller has started; a reranker whose answer token is
    several tokens of its vocabulary fails that, naming it, instead of scoring with a wrong id."""
    from types import SimpleNamespace

    from prism_serve.api.serving import Served as _Served
    from prism_serve.config import ConfigError

    tok = smollm.tokenizer
    status = SimpleNamespace(
        model="r", ttft_slo=1.0, tpot_slo=0.1, max_model_len=512, vocab_size=tok.vocab_size, sampling=(),
        hidden_size=576, pooled=PoolingTask("score"),
    )  # fmt: skip
    assert _Served.of(status, tok).score_ids == (tok.one_token("no"), tok.one_token("yes"))
    status.pooled = PoolingTask("score", tokens=("no", "not at all"))
    with pytest.raises(ConfigError, match="model r: score token 'not at all' is not one token"):
        _Served.of(status, tok)
    status.pooled = PoolingTask("embed", "mean", True)
    assert _Served.of(status, tok).score_ids == ()


def test_a_pooled_request_is_judged_once_by_its_latency_and_logged_as_its_inputs(server, client):
    """An embedder's or reranker's SLO kind is the latency of the whole request (every input
    answered, ``latency_slo``): /metrics judges each request once under slo="latency", none of its
    inputs under ttft or tpot; the request log marks the line with its task, and ``prism plan``
    reads it as one prompt-only request per input, each with its share of the prompt tokens."""
    from prism_serve.workload.traffic import read_traffic

    def judged() -> dict[tuple[str, str], float]:
        return {
            (s.labels["model_name"], s.labels["slo"]): s.value
            for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
            for s in f.samples
            if s.name == "prism_slo_requests_total"
        }

    before = judged()
    texts = ["one short text", "a second, somewhat longer text to embed", "three"]
    out = client.embeddings.create(model="embedder", input=texts)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "reranker", "query": QUERY, "documents": DOCUMENTS[:2]}
    httpx.post(f"{server.base_url}/rerank", headers=auth, json=body, timeout=180).raise_for_status()
    after = judged()
    for model in ("embedder", "reranker"):
        assert after[(model, "latency")] - before.get((model, "latency"), 0) == 1
        assert (model, "ttft") not in after and (model, "tpot") not in after
    log = server.log.parent / "state" / "requests.jsonl"
    deadline = time.monotonic() + 10  # the log's writer flushes within a second
    while time.monotonic() < deadline and '"task": "score"' not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    embed = [line for line in lines if line["model"] == "embedder" and line["n"] == 3][-1]
    assert embed["task"] == "embed" and embed["prompt_tokens"] == out.usage.prompt_tokens
    assert any(line["task"] == "score" and line["n"] == 2 for line in lines if line["model"] == "reranker")
    w = read_traffic(log, None).workload
    rows = [(int(p), int(o)) for m, p, o in zip(w.model_index, w.prompt_tokens, w.output_tokens, strict=True)
            if w.models[m] == "embedder"]  # fmt: skip
    assert rows.count((round(out.usage.prompt_tokens / 3), 1)) >= 3
    # the line's three inputs are one group: the plan judges them once, as /metrics did
    share = round(out.usage.prompt_tokens / 3)
    embedder = w.model_index == w.models.index("embedder")
    threes = [
        members for gid in set(w.groups[embedder].tolist()) - {-1}
        if len(members := np.flatnonzero(w.groups == gid)) == 3 and set(w.prompt_tokens[members]) == {share}
    ]  # fmt: skip
    assert threes and all(int(w.judged()[members].sum()) == 1 for members in threes)
    assert all(len(set(w.timestamps[members].tolist())) == 1 for members in threes)
