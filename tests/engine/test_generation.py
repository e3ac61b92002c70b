"""End-to-end generation on the real SmolLM2: batching, chunking and preemption leave greedy
outputs unchanged; sampling parameters and stop conditions behave as documented."""

from __future__ import annotations

import pytest

from prism_serve.engine.llm import LLM
from prism_serve.engine.sampling_params import SamplingParams
from tests.conftest import run_to_completion

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "hi",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "What is 12 plus 30?",
    "List the planets of the solar system in order from the sun, separated by commas.",
    "Translate 'good morning' into Spanish.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:
    tok = smollm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def generate(engine, prompts, params=GREEDY) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    final = run_to_completion(engine)
    return [final[i] for i in ids]


@pytest.fixture(scope="module")
def alone(make_engine, prompts) -> list[list[int]]:
    """Each prompt run on its own: the reference."""
    engine = make_engine(max_num_seqs=1, num_kv_blocks=64)
    return [generate(engine, [p])[0].token_ids for p in prompts]


def test_prompts_have_mixed_lengths(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert lengths[-1] - lengths[0] >= 15


def test_batch_of_eight_matches_alone(make_engine, prompts, alone):
    engine = make_engine(max_num_seqs=8, num_kv_blocks=128)
    outs = generate(engine, prompts)
    assert [o.token_ids for o in outs] == alone


def test_chunked_prefill_of_16_matches_alone(make_engine, prompts, alone):
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=128)
    assert all(len(p) > 16 for p in prompts), "every prompt must need several chunks"
    outs = generate(engine, prompts)
    assert [o.token_ids for o in outs] == alone


def test_preemption_under_tiny_block_budget_keeps_outputs(make_engine, prompts, alone):
    # 10 blocks of 8 tokens: any two requests together overflow it, so the scheduler preempts.
    engine = make_engine(max_num_seqs=8, block_size=8, num_kv_blocks=10)
    outs = generate(engine, prompts)
    assert [o.token_ids for o in outs] == alone
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    engine.drop_cached()  # prefix-cached blocks no request holds: nothing else may be left
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks


def test_paris(engine):
    out = LLM(engine=engine).chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_paris_in_bf16(make_engine):
    engine = make_engine(dtype="bfloat16", num_kv_blocks=32)
    out = LLM(engine=engine).chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert "Paris" in out.text


def test_max_tokens_gives_length(engine, prompts):
    out = generate(engine, [prompts[2]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=16)
    engine = make_engine(max_num_seqs=8, num_kv_blocks=128)
    solo = generate(engine, [prompts[2]], params)[0].token_ids
    batch = generate(engine, prompts, params)
    assert batch[2].token_ids == solo
    other_seed = generate(engine, [prompts[2]], SamplingParams(temperature=1.0, seed=99, max_tokens=16))[0]
    assert other_seed.token_ids != solo


def test_top_k_one_is_greedy(engine, prompts, alone):
    out = generate(engine, [prompts[0]], SamplingParams(temperature=0.8, top_k=1, max_tokens=24))[0]
    assert out.token_ids == alone[0]


def test_tiny_top_p_is_greedy(engine, prompts, alone):
    out = generate(engine, [prompts[1]], SamplingParams(temperature=1.5, top_p=1e-6, seed=5, max_tokens=24))[
        0
    ]
    assert out.token_ids == alone[1]


def test_stop_string_cuts_output(engine, prompts, alone):
    full = engine.tokenizer.decode(alone[6])
    stop = full[10:14]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    out = generate(engine, [prompts[6]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    kept = generate(
        engine,
        [prompts[6]],
        SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stop_token_id(engine, prompts, alone):
    stop_id = alone[4][3]
    out = generate(
        engine, [prompts[4]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert out.token_ids == alone[4][: alone[4].index(stop_id) + 1]
    # as in vLLM, the stop token's text is left out unless include_stop_str_in_output
    with_it = SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[stop_id], include_stop_str_in_output=True
    )
    kept = generate(engine, [prompts[4]], with_it)[0]
    assert kept.text == out.text + engine.tokenizer.decode([stop_id]) and engine.tokenizer.decode([stop_id])


def test_eos_ends_request_and_ignore_eos_continues(engine, prompts):
    out = generate(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text
    # nor with special tokens kept (tool-call markers are special tokens in some vocabularies)
    kept = generate(
        engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    )[0]
    assert kept.token_ids == out.token_ids and kept.text == out.text
    longer = generate(
        engine,
        [prompts[0]],
        SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 5, ignore_eos=True),
    )[0]
    assert longer.finish_reason == "length"
    assert longer.token_ids[: len(out.token_ids)] == out.token_ids


def test_streamed_deltas_add_up_to_final_text(engine, prompts, alone):
    stop = engine.tokenizer.decode(alone[6])[10:14]
    engine.add_request(prompts[6], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    deltas, ids, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.delta_text)
            ids.extend(out.delta_token_ids)
            final = out
    assert "".join(deltas) == final.text
    assert ids == final.token_ids
    assert stop not in "".join(deltas), "text that became a stop string must never be streamed"


def test_context_cap_finishes_with_length(make_engine, prompts):
    engine = make_engine(max_model_len=len(prompts[0]) + 3, num_kv_blocks=64)
    out = generate(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 3
