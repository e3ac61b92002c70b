from __future__ import annotations

import torch

from prism_serve.engine.sampler import sample
from prism_serve.engine.sampling_params import SamplingParams

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])


def draw(params: SamplingParams, n: int = 4000, probs: torch.Tensor = PROBS) -> torch.Tensor:
    logits = probs.log().expand(n, -1).clone()
    tokens = sample(logits, [params] * n, [None] * n, torch.Generator().manual_seed(0))
    return torch.bincount(torch.tensor(tokens), minlength=len(probs)).float() / n


def test_temperature_one_follows_the_distribution():
    freq = draw(SamplingParams(temperature=1.0))
    assert torch.allclose(freq, PROBS, atol=0.03)


def test_temperature_sharpens_and_flattens():
    sharp = draw(SamplingParams(temperature=0.5))
    expect = PROBS**2 / (PROBS**2).sum()
    assert torch.allclose(sharp, expect, atol=0.03)
    flat = draw(SamplingParams(temperature=100.0))
    assert torch.allclose(flat, torch.full((4,), 0.25), atol=0.03)


def test_top_k_and_top_p_restrict_the_support():
    top2 = draw(SamplingParams(top_k=2))
    assert top2[2:].sum() == 0
    assert torch.allclose(top2[:2], torch.tensor([0.4, 0.3]) / 0.7, atol=0.03)
    nucleus = draw(SamplingParams(top_p=0.5))  # 0.4 < 0.5, so 0.3 is still needed; 0.2 is not
    assert nucleus[2:].sum() == 0 and nucleus[1] > 0.3
    exact = draw(SamplingParams(top_p=0.7))  # the first two reach 0.7 exactly
    assert exact[2:].sum() == 0


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    tokens = sample(logits, params, [None] * 6, torch.Generator().manual_seed(0))
    assert tokens[0::2] == logits.argmax(-1)[0::2].tolist()


def test_seeded_rows_do_not_depend_on_batch_position():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[3:4], [p], [torch.Generator().manual_seed(42)], torch.Generator().manual_seed(0))
    gens = [None, None, None, torch.Generator().manual_seed(42), None]
    batch = sample(logits, [p] * 5, gens, torch.Generator().manual_seed(7))
    assert batch[3] == alone[0]
