"""Embedding requests in the built-in engine (``SamplingParams.pooling``): the real SmolLM2's final
hidden states pooled as HF transformers computes them, whatever the chunking, the batch around
them or the prefix cache."""

from __future__ import annotations

import pytest
import torch

from prism_serve.engine.hf_reference import build_hf_model
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.errors import InvalidSamplingParamsError
from tests.conftest import run_to_completion

TEXTS = [
    "The capital of France is Paris.",
    "A paged KV cache keeps each request's keys and values in fixed-size blocks.",
    "Embeddings map text to vectors; similar texts land near each other. " * 6,
    "Hi",
]
# a query and documents for the rerankers (decoder here, cross-encoders in test_encoders.py)
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Bananas are yellow and grow in bunches.",
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower stands in Paris.",
    "A paged KV cache keeps keys and values in fixed-size blocks.",
]


_HF_MODELS: dict[int, torch.nn.Module] = {}  # by id of the weights: built once per session


def _hf_model(smollm) -> torch.nn.Module:
    model = _HF_MODELS.get(id(smollm))
    if model is None:
        model = _HF_MODELS[id(smollm)] = build_hf_model(smollm, torch.float32)
    return model


def hf_pooled(smollm, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden states (after the final norm) of ``ids``, pooled."""
    with torch.inference_mode():
        hidden = _hf_model(smollm).model(torch.tensor([ids])).last_hidden_state[0]
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]


def hf_next_logits(smollm, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits of ``tokens`` as the token after ``ids``."""
    with torch.inference_mode():
        return _hf_model(smollm)(torch.tensor([ids])).logits[0, -1, tokens]


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:
    return [smollm.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(smollm, prompts) -> dict[str, list[torch.Tensor]]:
    return {p: [hf_pooled(smollm, ids, p) for ids in prompts] for p in ("last", "mean", "cls")}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("chunk", [2048, 16])
def test_pooled_hidden_states_match_transformers(make_engine, prompts, reference, pooling, chunk):
    """Every input in one batch beside a request that generates, prefilled whole or in chunks of
    16 tokens (the mean sums across chunks): each vector is transformers' to cosine 0.9999 and
    its length, and the generating request is untouched by them."""
    engine = make_engine(max_num_batched_tokens=chunk, num_kv_blocks=64, prefix_caching=False)
    gen = engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=8), "gen")
    for i, ids in enumerate(prompts):
        engine.add_request(ids, SamplingParams(max_tokens=1, pooling=pooling), f"e{i}")
    out = run_to_completion(engine)
    for i, want in enumerate(reference[pooling]):
        o = out[f"e{i}"]
        assert o.finished and o.finish_reason == "stop" and o.token_ids == [] and o.embedding is not None
        assert o.embedding.dtype == torch.float32 and o.embedding.shape == want.shape
        assert _cosine(o.embedding, want) >= 0.9999, (pooling, chunk, i)
        torch.testing.assert_close(o.embedding, want, atol=2e-3, rtol=1e-3)
    alone = make_engine(num_kv_blocks=64)
    alone.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=8), "gen")
    assert out[gen].token_ids == run_to_completion(alone)["gen"].token_ids
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks  # nothing held


def test_last_token_pooling_reads_through_the_prefix_cache(make_engine, smollm, prompts, reference):
    """A prompt whose leading blocks are cached computes only its tail, and pools the same; mean
    pooling, which reads every position, does not take cached blocks."""
    engine = make_engine(num_kv_blocks=64, block_size=16, prefix_caching=True)
    long = prompts[2]
    engine.add_request(long, SamplingParams(temperature=0, max_tokens=1), "warm")
    run_to_completion(engine)
    engine.add_request(long, SamplingParams(max_tokens=1, pooling="last"), "last")
    engine.add_request(long, SamplingParams(max_tokens=1, pooling="mean"), "mean")
    out = run_to_completion(engine)
    assert out["last"].num_cached_tokens >= 16 and out["mean"].num_cached_tokens == 0
    assert _cosine(out["last"].embedding, reference["last"][2]) >= 0.9999
    assert _cosine(out["mean"].embedding, reference["mean"][2]) >= 0.9999


def test_an_embedding_request_refuses_what_only_generation_has():
    with pytest.raises(InvalidSamplingParamsError, match="pooling must be one of"):
        SamplingParams(pooling="max")
    with pytest.raises(InvalidSamplingParamsError, match="no logprobs"):
        SamplingParams(pooling="last", logprobs=2)


def test_score_tokens_are_the_next_tokens_logits_as_transformers_computes_them(make_engine, smollm, prompts):
    """A reranker's pairs (``score_tokens``: no and yes) prefilled in chunks of 16 in one batch with
    an embedding of the same prompt: each answers the two logits of transformers at its last
    position, so the scores sigmoid(yes - no) come out in transformers' order."""
    tokens = [smollm.tokenizer.one_token("no"), smollm.tokenizer.one_token("yes")]
    engine = make_engine(max_num_batched_tokens=16, num_kv_blocks=64)
    engine.add_request(prompts[1], SamplingParams(max_tokens=1, pooling="last"), "embed")
    for i, ids in enumerate(prompts):
        engine.add_request(ids, SamplingParams(max_tokens=1, pooling="last", score_tokens=tokens), f"s{i}")
    out = run_to_completion(engine)
    wants = [hf_next_logits(smollm, ids, tokens) for ids in prompts]
    for i, want in enumerate(wants):
        assert out[f"s{i}"].embedding is not None and out[f"s{i}"].token_ids == []
        torch.testing.assert_close(out[f"s{i}"].embedding, want, atol=2e-3, rtol=1e-3)
    assert _cosine(out["embed"].embedding, hf_pooled(smollm, prompts[1], "last")) >= 0.9999

    def order(logits: list[torch.Tensor]) -> list[int]:
        return sorted(range(len(logits)), key=lambda i: -float(logits[i][1] - logits[i][0]))

    assert order([out[f"s{i}"].embedding for i in range(len(prompts))]) == order(wants)
    with pytest.raises(InvalidSamplingParamsError, match="need pooling last"):
        SamplingParams(pooling="mean", score_tokens=tokens)
