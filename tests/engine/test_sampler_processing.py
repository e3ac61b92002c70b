"""The sampler's logit processing on hand-built logits: each feature does what its definition says,
only to the rows that asked for it, and validation names the bad field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from prism_serve.engine.sampler import process_logits, sample, token_logprobs
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.errors import InvalidSamplingParamsError

EOS = 3


@dataclass
class History:
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


def greedy(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> list[int]:
    n = len(params)
    return sample(logits, params, [None] * n, torch.Generator().manual_seed(0), histories, (EOS,))


def draw(params: SamplingParams, probs: list[float], n: int = 4000) -> torch.Tensor:
    logits = torch.tensor(probs).log().expand(n, -1).clone()
    tokens = sample(logits, [params] * n, [None] * n, torch.Generator().manual_seed(0))
    return torch.bincount(torch.tensor(tokens), minlength=len(probs)).float() / n


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    h = History(prompt=[0, 1], output=[4])  # prompt and output both count
    out = process_logits(logits, [SamplingParams(repetition_penalty=2.0)], [h])
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, -1.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -0.5]], "the raw logits stay untouched"


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    h = History(prompt=[0, 0, 1], output=[2, 2, 4])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, [p], [h])
    # token 2: twice -> 2 * 0.25 + 0.5; token 4: once -> 0.25 + 0.5; prompt tokens 0, 1 untouched
    assert out.tolist() == [[0.0, 0.0, -1.0, 0.0, -0.75]]
    negative = process_logits(logits, [SamplingParams(presence_penalty=-1.0)], [h])
    assert negative.tolist() == [[0.0, 0.0, 1.0, 0.0, 1.0]]


def test_logit_bias_adds_and_plus_100_forces_the_token_under_greedy():
    logits = torch.tensor([[5.0, 1.0, 0.0, 2.0, -3.0]])
    out = process_logits(logits, [SamplingParams(logit_bias={1: 2.5, 4: -1.0})], [History()])
    assert out.tolist() == [[5.0, 3.5, 0.0, 2.0, -4.0]]
    assert greedy(logits, [SamplingParams(temperature=0, logit_bias={4: 100.0})], [History()]) == [4]
    assert greedy(logits, [SamplingParams(temperature=0, logit_bias={0: -100.0})], [History()]) == [3]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 0.5, 8.0]])  # EOS (3) is the argmax, then 5
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])
    assert greedy(logits, [p], [History(prompt=[1], output=[2])]) == [2]  # 3 and 5 masked
    assert greedy(logits, [p], [History(prompt=[1], output=[2, 2, 2])]) == [EOS]  # reached: free again
    assert greedy(logits, [SamplingParams(temperature=0, min_tokens=3)], [History(output=[2])]) == [5]
    # ignore_eos: EOS does not end the output, so min_tokens has no reason to mask it
    ignoring = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    assert greedy(logits, [ignoring], [History(output=[2])]) == [EOS]


def test_min_tokens_wins_over_a_bias_towards_eos():
    logits = torch.zeros(1, 6)
    p = SamplingParams(temperature=0, min_tokens=2, logit_bias={EOS: 100.0})
    out = process_logits(logits, [p], [History()], eos_token_ids=(EOS,))
    assert out[0, EOS] == float("-inf")


def test_min_p_cuts_exactly_the_tokens_below_the_threshold():
    probs = [0.5, 0.3, 0.12, 0.08]
    freq = draw(SamplingParams(min_p=0.2), probs)  # threshold 0.1: only 0.08 goes
    assert freq[3] == 0
    assert torch.allclose(freq[:3], torch.tensor(probs[:3]) / 0.92, atol=0.03)
    assert draw(SamplingParams(min_p=0.5), probs)[2:].sum() == 0  # threshold 0.25
    # min_p compares probabilities after temperature: at T=2 they flatten to 0.375/0.291/0.184/0.150,
    # so the last (0.4 of the top) survives min_p 0.3, which cuts it (0.16 of the top) at T=1
    assert draw(SamplingParams(min_p=0.3), probs)[3] == 0
    assert draw(SamplingParams(min_p=0.3, temperature=2.0), probs)[3] > 0


def test_min_p_one_keeps_only_the_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    n = len(logits)
    params = [SamplingParams(temperature=1.5, min_p=1.0)] * n
    tokens = sample(logits, params, [None] * n, torch.Generator().manual_seed(0))
    assert tokens == logits.argmax(-1).tolist()


def test_processing_touches_only_the_rows_that_ask_for_it():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    plain = SamplingParams(temperature=0)
    params = [plain, SamplingParams(temperature=0, repetition_penalty=3.0), plain, plain]
    argmax = logits.argmax(-1).tolist()
    histories = [History(prompt=[t]) for t in argmax]  # every row's argmax has been seen
    out = process_logits(logits, params, histories)
    assert torch.equal(out[[0, 2, 3]], logits[[0, 2, 3]])
    assert not torch.equal(out[1], logits[1])
    tokens = greedy(logits, params, histories)
    assert [tokens[i] for i in (0, 2, 3)] == [argmax[i] for i in (0, 2, 3)]
    assert tokens[1] == out[1].argmax().item()


def test_seeded_row_with_penalties_does_not_depend_on_the_batch():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(temperature=1.0, seed=7, frequency_penalty=1.5, min_p=0.05)
    h = History(prompt=[1, 2], output=[3, 3, 9])
    alone = sample(logits[1:2], [p], [torch.Generator().manual_seed(7)], torch.Generator(), [h])
    mixed = [SamplingParams(temperature=0.7), p, SamplingParams(temperature=0, repetition_penalty=1.3)]
    gens = [None, torch.Generator().manual_seed(7), None]
    batch = sample(logits, mixed, gens, torch.Generator().manual_seed(1), [History(), h, History([4])])
    assert batch[1] == alone[0]


def test_token_logprobs_are_the_raw_log_softmax_with_a_sorted_top_list():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, -1.0]])
    entries = token_logprobs(logits, [2, 3], [3, 0])
    lp = torch.log_softmax(logits, -1)
    assert entries[0].token_id == 2 and math.isclose(entries[0].logprob, lp[0, 2].item(), rel_tol=1e-6)
    assert [t for t, _ in entries[0].top] == [1, 2, 0]
    assert [v for _, v in entries[0].top] == sorted((v for _, v in entries[0].top), reverse=True)
    assert entries[1].top == [] and math.isclose(entries[1].logprob, lp[1, 3].item(), rel_tol=1e-6)


def test_logprobs_are_floored_to_finite_values():
    logits = torch.tensor([[0.0, float("-inf"), 1e4]])
    (entry,) = token_logprobs(logits, [1], [3])
    assert entry.logprob == -9999.0
    assert all(math.isfinite(v) for _, v in entry.top)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # above the default max_tokens of 16
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
    ],
)
def test_bad_processing_params_name_the_field(kwargs, match):
    with pytest.raises(InvalidSamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_good_processing_params_pass():
    p = SamplingParams(
        max_tokens=8,
        min_tokens=8,
        repetition_penalty=0.5,
        presence_penalty=-2,
        frequency_penalty=2,
        min_p=1,
        logit_bias={0: -100, 7: 100.0},
        logprobs=20,
        prompt_logprobs=0,
    )
    assert p.processes_logits
    assert not SamplingParams(min_p=0.5, logprobs=3).processes_logits
