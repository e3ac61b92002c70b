"""Token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prism_serve.engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [N, vocab] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> list[int]:
    greedy = [p.greedy for p in params]
    argmax = logits.argmax(dim=-1)
    if all(greedy):
        return argmax.tolist()

    _n, vocab = logits.shape
    temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)])
    logits = logits / temps.unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _filter_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p))
    probs = torch.softmax(logits, dim=-1)

    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a sample from p. Rows with a seed
    # draw their noise from their own generator, so their tokens do not depend on the batch.
    noise = torch.empty_like(probs)
    shared_rows = [i for i, g in enumerate(generators) if g is None]
    if shared_rows:
        shared = torch.empty(len(shared_rows), vocab).exponential_(generator=default_generator)
        noise[shared_rows] = shared
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(torch.tensor(greedy), argmax, sampled).tolist()


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1]).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
