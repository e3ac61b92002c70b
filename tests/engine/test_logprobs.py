"""Logprobs on the real SmolLM2: output and prompt logprobs are the model's raw log_softmax at each
position, whatever the sampling, the prefill chunking or preemption; and they cross the worker
boundary intact."""

from __future__ import annotations

import math

import pytest
import torch

from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.errors import InvalidSamplingParamsError
from prism_serve.runtime import messages as msg
from tests.engine.test_generation import QUESTIONS
from tests.engine.test_model_vs_hf import our_logits


def collect(engine) -> dict[str, list]:
    """Step until idle; every RequestOutput of each request, in order."""
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.req_id, []).append(out)
    return outs


def reference(engine, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of one full forward over ``token_ids`` (a single prefill, fp32)."""
    return torch.log_softmax(our_logits(engine, token_ids, chunk=10_000), dim=-1)


def assert_entry_matches(entry, token_id: int, lp_row: torch.Tensor, k: int) -> None:
    assert entry.token_id == token_id
    assert math.isclose(entry.logprob, lp_row[token_id].item(), abs_tol=1e-4)
    values, ids = lp_row.topk(k)
    assert [t for t, _ in entry.top] == ids.tolist()
    assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:
    tok = smollm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def test_greedy_logprobs_are_the_max_of_the_raw_distribution(engine, prompts):
    req = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=10, logprobs=5))
    outs = collect(engine)[req]
    entries = [e for o in outs for e in o.logprobs]
    for o in outs:
        assert len(o.logprobs) == len(o.delta_token_ids)
    tokens = outs[-1].token_ids
    assert [e.token_id for e in entries] == tokens
    lp = reference(engine, prompts[0] + tokens)[len(prompts[0]) - 1 : -1]
    for entry, token, row in zip(entries, tokens, lp, strict=True):
        assert math.isclose(entry.logprob, row.max().item(), abs_tol=1e-4)
        assert entry.top[0] == (token, pytest.approx(entry.logprob, abs=1e-6))
        assert_entry_matches(entry, token, row, 5)


def test_sampled_logprobs_are_raw_not_tempered(engine, prompts):
    p = SamplingParams(temperature=1.7, top_k=20, seed=3, max_tokens=8, logprobs=0, ignore_eos=True)
    req = engine.add_request(prompts[2], p)
    outs = collect(engine)[req]
    entries = [e for o in outs for e in o.logprobs]
    tokens = outs[-1].token_ids
    lp = reference(engine, prompts[2] + tokens)[len(prompts[2]) - 1 : -1]
    for entry, token, row in zip(entries, tokens, lp, strict=True):
        assert entry.top == []
        assert_entry_matches(entry, token, row, 0)


def test_no_logprobs_unless_asked(engine, prompts):
    req = engine.add_request(prompts[3], SamplingParams(temperature=0, max_tokens=3))
    for o in collect(engine)[req]:
        assert o.logprobs is None and o.prompt_logprobs is None


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7], ids=["one-chunk", "chunks-of-7"])
def test_prompt_logprobs_match_a_full_forward(make_engine, prompts, max_num_batched_tokens):
    engine = make_engine(num_kv_blocks=64, max_num_batched_tokens=max_num_batched_tokens)
    prompt = prompts[4]
    assert len(prompt) > 3 * 7, "the prompt must need several chunks of 7"
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    outs = collect(engine)[req]
    first, rest = outs[0], outs[1:]
    assert first.delta_token_ids, "prompt logprobs come with the first output, which carries a token"
    assert all(o.prompt_logprobs is None for o in rest)
    entries = first.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    lp = reference(engine, prompt)
    for i in range(1, len(prompt)):
        assert_entry_matches(entries[i], prompt[i], lp[i - 1], 3)
    assert all(math.isfinite(e.logprob) for e in entries[1:])


def test_prompt_logprobs_survive_preemption_without_duplicates(make_engine, engine, prompts):
    # 10 blocks of 8 tokens and chunks of 16: requests preempt each other, some mid-prefill.
    tight = make_engine(max_num_seqs=8, block_size=8, num_kv_blocks=10, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, logprobs=1)
    ids = [tight.add_request(p, params) for p in prompts]
    outs = collect(tight)
    assert sum(outs[i][-1].metrics.num_preemptions for i in ids) > 0
    for req, prompt in zip(ids, prompts, strict=True):
        entries = outs[req][0].prompt_logprobs
        assert len(entries) == len(prompt)
        lp = reference(engine, prompt)  # the shared engine, never preempted: one full prefill
        for i in range(1, len(prompt)):
            assert_entry_matches(entries[i], prompt[i], lp[i - 1], 1)
        out_entries = [e for o in outs[req] for e in o.logprobs]
        assert [e.token_id for e in out_entries] == outs[req][-1].token_ids


def test_one_token_prompt_has_only_the_empty_entry(engine):
    first = engine.tokenizer.encode("Hello")[:1]
    req = engine.add_request(first, SamplingParams(max_tokens=1, prompt_logprobs=2))
    (out,) = collect(engine)[req]
    assert out.prompt_logprobs == [None]


def test_logit_bias_beyond_the_vocabulary_is_refused_at_add_time(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidSamplingParamsError, match=f"logit_bias token id {vocab}"):
        engine.add_request("hi", SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished_requests()


def test_token_delta_round_trips_with_logprobs():
    entries = [msg.TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)]), msg.TokenLogprob(7, -3.0)]
    prompt = [None, msg.TokenLogprob(2, -9999.0, [(1, -0.01)])]
    delta = msg.TokenDelta("r1", "ab", [5, 7], False, None, 2, 2, entries, prompt)
    stats = msg.EngineStats(1, 0, 0, 0, 0)
    decoded = msg.from_worker_decoder().decode(msg.encode(msg.StepOutputs([delta], stats)))
    assert decoded.outputs == [delta]
    assert decoded.outputs[0].logprobs[0].top == [(5, -0.25), (9, -1.5)]
    plain = msg.TokenDelta("r2", "", [1], True, "stop", 1, 1)
    assert msg.from_worker_decoder().decode(msg.encode(msg.StepOutputs([plain], stats))).outputs == [plain]
