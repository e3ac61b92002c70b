"""Sampling features on the real SmolLM2: min_tokens, logit_bias, penalties and min_p change the
output the way their definitions say (the math itself is tested in test_sampler_processing.py)."""

from __future__ import annotations

import msgspec
import pytest

from prism_serve.engine.sampler import process_logits
from prism_serve.engine.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.engine.test_generation import QUESTIONS
from tests.engine.test_model_vs_hf import our_logits
from tests.engine.test_sampler_processing import History


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:
    tok = smollm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def solo(engine, prompt, params):
    req = engine.add_request(prompt, params)
    return run_to_completion(engine)[req]


def test_min_tokens_keeps_generating_past_eos(engine, prompts):
    base = solo(engine, prompts[0], SamplingParams(temperature=0, max_tokens=64))
    eos = engine.tokenizer.eos_token_ids
    assert base.finish_reason == "stop" and base.token_ids[-1] in eos
    n = len(base.token_ids)
    out = solo(engine, prompts[0], SamplingParams(temperature=0, max_tokens=n + 8, min_tokens=n + 3))
    assert len(out.token_ids) >= n + 3
    assert not set(out.token_ids[: n + 3]) & set(eos)
    assert out.token_ids[: n - 1] == base.token_ids[: n - 1]  # the same text until EOS was due


def test_min_tokens_ignores_stop_strings_before_it(engine, prompts):
    planets = prompts[6]  # the answer lists planets separated by commas
    early = solo(engine, planets, SamplingParams(temperature=0, max_tokens=40, stop=[","]))
    assert early.finish_reason == "stop" and "," not in early.text
    out = solo(engine, planets, SamplingParams(temperature=0, max_tokens=40, stop=[","], min_tokens=12))
    assert len(out.token_ids) >= 12
    assert out.text.startswith(early.text + ",")
    if out.finish_reason == "stop":  # the comma that ended it came after min_tokens
        assert out.text.count(",") >= 1


def test_logit_bias_forces_a_token_under_greedy(engine, prompts):
    paris = engine.tokenizer.encode(" Paris")[-1]
    out = solo(engine, prompts[1], SamplingParams(temperature=0, max_tokens=5, logit_bias={paris: 100.0}))
    assert out.token_ids == [paris] * 5
    base = solo(engine, prompts[0], SamplingParams(temperature=0, max_tokens=6))
    banned = solo(
        engine, prompts[0], SamplingParams(temperature=0, max_tokens=6, logit_bias={base.token_ids[0]: -100})
    )
    assert banned.token_ids[0] != base.token_ids[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.6),
        SamplingParams(temperature=0, max_tokens=16, frequency_penalty=1.5, presence_penalty=0.5),
    ],
    ids=["repetition", "frequency-presence"],
)
def test_greedy_with_penalties_takes_the_argmax_of_the_penalized_logits(engine, prompts, params):
    prompt = prompts[2]  # the haiku: plain greedy repeats "a moment of stillness"
    plain = solo(engine, prompt, SamplingParams(temperature=0, max_tokens=16))
    out = solo(engine, prompt, params)
    assert out.token_ids != plain.token_ids, "the penalty must change this output"
    tokens = out.token_ids
    logits = our_logits(engine, prompt + tokens, chunk=10_000)[len(prompt) - 1 : -1]
    for t, token in enumerate(tokens):
        row = process_logits(logits[t : t + 1], [params], [History(prompt, tokens[:t])])
        assert token == row.argmax().item(), f"step {t}"


def test_penalties_reduce_repetition(engine, prompts):
    def repeats(ids: list[int]) -> int:
        return len(ids) - len(set(ids))

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = solo(engine, prompts[2], params)
    penalized = solo(engine, prompts[2], msgspec.structs.replace(params, frequency_penalty=2.0))
    assert repeats(penalized.token_ids) < repeats(plain.token_ids)


def test_min_p_one_is_greedy_even_at_high_temperature(engine, prompts):
    greedy = solo(engine, prompts[2], SamplingParams(temperature=0, max_tokens=16))
    sampled = solo(engine, prompts[2], SamplingParams(temperature=3.0, min_p=1.0, seed=11, max_tokens=16))
    assert sampled.token_ids == greedy.token_ids
    loose = solo(engine, prompts[2], SamplingParams(temperature=3.0, seed=11, max_tokens=16))
    assert loose.token_ids != greedy.token_ids


def test_a_featureless_batch_is_unchanged_by_a_neighbour_with_features(make_engine, prompts):
    """Requests that use no feature give the same tokens whether or not a batch neighbour does."""
    greedy = SamplingParams(temperature=0, max_tokens=12)
    engine = make_engine(max_num_seqs=8, num_kv_blocks=128)
    alone = [solo(engine, p, greedy).token_ids for p in prompts[:3]]
    noisy = SamplingParams(
        temperature=0, max_tokens=12, repetition_penalty=1.5, logprobs=2, prompt_logprobs=1
    )
    ids = [engine.add_request(p, greedy) for p in prompts[:3]]
    engine.add_request(prompts[3], noisy)
    final = run_to_completion(engine)
    assert [final[i].token_ids for i in ids] == alone
