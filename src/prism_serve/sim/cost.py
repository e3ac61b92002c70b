"""Step time of one engine iteration from a hardware profile (a roofline with efficiency factors).

For a batch with ``P`` prefill tokens and ``D`` decoding requests on ``tp`` devices, GPU profiles
(``overlap=True``):

    compute = (2 * matmul_params * (P + D) + 4 * L * H * d * attention_pairs) / tp / (peak * eff_f)
    memory  = (weight_bytes + kv_bytes_per_token * (context read + tokens written)) / tp / (bw * eff_m)
    step    = max(compute, memory) + overhead + seq_overhead * sampled sequences
            + 2 * L * (allreduce latency + (P + D) * hidden * dtype * 2 (tp-1)/tp / link bw)   if tp > 1

``attention_pairs`` counts (query, key) pairs: a decode reads its whole context, a prefill chunk of
``c`` tokens after ``b`` computed ones attends to ``b + (c + 1) / 2`` keys on average. Weights are
read once per step whatever the batch, which is why decoding in large batches is cheap. A
mixture-of-experts model reads its dense part once per step and, of its routed experts, the share
the step's tokens chose: ``1 - (1 - k / E) ** tokens`` (``ModelShape.experts_read``); its FLOPs
are those of the experts each token uses.

The fitted CPU profile (``overlap=False``) sums the terms instead, because one CPU thread does one
thing at a time, and splits the matmuls the way this project's engine runs them: the body for every
token fed, the LM head only for the sequences that sample a token (a prefill chunk samples at most
once). Each matmul group of ``m`` rows costs

    min(m * bytes / row_bw,  bytes / bw + flops * m / peak)

because CPU GEMM kernels pick their method by row count: a few rows stream the weights again per
row (``row_bandwidth``), many rows pack them once and then run at the compute rate (measured at one
thread: a SmolLM2 decode of 2 sequences costs 1.6x one of 1, of 8 2.5x, of 32 4.7x). Attention has
its own rate (``attn_flops``) and KV traffic its own bandwidth (``kv_bandwidth``: the engine gathers
the cached blocks before attending), all as fitted by benchmarks/fit_cpu_profile.py. Where the
profile says ``pad_decode_context``, the caller counts every decode at the longest context of its
group (engine/grouping.py: the engine's decode attention pads each group of similar contexts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import accumulate
from types import MappingProxyType

import numpy as np

from prism_serve.sim.hardware import HardwareProfile
from prism_serve.sim.models import ModelShape

__all__ = ["COST_MODELS", "RooflineCostModel", "split_matmul"]

# a roofline step this far (relative) from its ridge at both ends of a decode run is on the same side
# at every step between: compute and memory time are both affine in the context, and a float's
# rounding (1e-16 relative) cannot close a gap of this size
_RIDGE_MARGIN = 1e-9

ArrayOrInt = int | np.ndarray
ArrayOrFloat = float | np.ndarray


def split_matmul(spec: ModelShape) -> tuple[float, float, float, float]:
    """(body bytes, body FLOPs per token, LM-head bytes, LM-head FLOPs per sampled sequence)."""
    c = spec.config
    head = c.vocab_size * c.hidden_size
    body_flops = spec.matmul_flops_per_token - 2.0 * head
    return body_flops / 2 * spec.dtype_bytes, body_flops, float(head * spec.dtype_bytes), 2.0 * head


class RooflineCostModel:
    """Per (model shape, tp) constants are folded once; the hot calls are a few float operations."""

    def __init__(self, hw: HardwareProfile) -> None:
        self.hw = hw
        self._flops_rate = hw.peak_flops * hw.flops_efficiency
        self._mem_rate = hw.mem_bandwidth * hw.mem_efficiency
        # None: attention and KV traffic run at the matmuls' rates (the datasheet profiles)
        self._attn_rate = hw.attn_flops or self._flops_rate
        self._kv_rate = hw.kv_bandwidth or self._mem_rate
        self._consts: dict[tuple[str, int, int, int], tuple] = {}

    def _c(self, spec: ModelShape, tp: int) -> tuple:
        key = (spec.name, spec.dtype_bytes, tp, spec.adapter_params)
        c = self._consts.get(key)
        if c is None:
            hw = self.hw
            comm_fixed = comm_per_token = 0.0
            if tp > 1:
                layers = spec.config.num_layers
                comm_fixed = 2 * layers * hw.allreduce_latency_s
                comm_per_token = (
                    2 * layers * spec.config.hidden_size * spec.dtype_bytes * 2 * (tp - 1) / tp
                ) / hw.link_bandwidth
            groups = None
            # this shape's own rates where the profile measured them (HardwareProfile.shape_scales)
            mem, comp, attn = hw.scales_for(spec.name)
            if not hw.overlap:
                # (pass, per row when packed, per row when streamed) for the body, then the LM head
                row = hw.row_bandwidth or 0.0
                groups = tuple(
                    (
                        mem * nbytes / tp / self._mem_rate,
                        comp * flops / tp / self._flops_rate,
                        mem * nbytes / tp / row if row else math.inf,
                    )
                    for nbytes, flops in zip(split_matmul(spec)[::2], split_matmul(spec)[1::2], strict=True)
                )
            c = (
                comp * spec.matmul_flops_per_token / tp / self._flops_rate,  # s per token, compute
                attn * spec.attn_flops_per_pair / tp / self._attn_rate,  # s per attention pair
                # s to stream the weights once (a MoE model's dense part: its experts are the last)
                mem * spec.step_read_bytes / tp / self._mem_rate,
                attn * spec.kv_bytes_per_token / tp / self._kv_rate,  # s per KV token read or written
                hw.step_overhead_s + comm_fixed,
                comm_per_token,
                hw.seq_overhead_s,
                groups,
                mem * spec.expert_params * spec.dtype_bytes / tp / self._mem_rate,  # s to stream every expert
            )
            self._consts[key] = c
        return c

    @staticmethod
    def _matmuls(groups: tuple, tokens: int, num_seqs: int) -> float:
        total = 0.0
        for (w, f, row), m in zip(groups, (tokens, num_seqs), strict=True):
            if m > 0:
                total += min(row * m, w + f * m)
        return total

    def step_time(
        self, spec: ModelShape, tp: int, tokens: int, attn_pairs: float, kv_read: float, num_seqs: int
    ) -> float:
        """One step: ``tokens`` fed (prefill chunks plus one per decode), ``attn_pairs`` as above,
        ``kv_read`` KV tokens read (every decode's context plus earlier chunks of prefills),
        ``num_seqs`` requests that sample a token (decodes and prefills whose last chunk this is)."""
        f_tok, f_pair, w, kv, fixed, comm, per_seq, groups, experts = self._c(spec, tp)
        if experts:
            w += experts * spec.experts_read(tokens)
        if groups is None:
            body = max(f_tok * tokens + f_pair * attn_pairs, w + kv * (kv_read + tokens))
        else:
            body = self._matmuls(groups, tokens, num_seqs) + f_pair * attn_pairs + kv * (kv_read + tokens)
        return body + fixed + comm * tokens + per_seq * num_seqs

    def decode_steps(self, spec: ModelShape, tp: int, num_seqs: int, context: int, k: int) -> np.ndarray:
        """Durations of ``k`` consecutive decode-only steps of ``num_seqs`` requests whose contexts
        sum to ``context`` at the first step (every step adds ``num_seqs`` tokens)."""
        f_tok, f_pair, w, kv, fixed, comm, per_seq, groups, experts = self._c(spec, tp)
        if experts:
            w += experts * spec.experts_read(num_seqs)
        ctx = context + num_seqs * np.arange(k, dtype=np.float64)
        if groups is None:
            body = np.maximum(f_tok * num_seqs + f_pair * ctx, w + kv * (ctx + num_seqs))
        else:
            body = self._matmuls(groups, num_seqs, num_seqs) + f_pair * ctx + kv * (ctx + num_seqs)
        return body + (fixed + comm * num_seqs + per_seq * num_seqs)

    def decode_run(self, spec: ModelShape, tp: int, num_seqs: int, context: int, k: int) -> list[float]:
        """``np.cumsum(decode_steps(...))`` as a list: when each of the ``k`` steps ends, from the
        start of the first. The same floats, operation for operation (numpy's elementwise operations
        and its running sum are those below), without numpy's cost per call, which a run of a few
        steps pays many times over (the simulator asks for one at every decode run)."""
        f_tok, f_pair, w, kv, fixed, comm, per_seq, groups, experts = self._c(spec, tp)
        if experts:
            w += experts * spec.experts_read(num_seqs)
        extra = fixed + comm * num_seqs + per_seq * num_seqs
        out: list[float] = []
        append = out.append
        total = 0.0
        # each step's summed context as an int: a float times an int is the float times the int's
        # exact float value, as numpy's float64 context array gives it
        contexts = range(context, context + num_seqs * k, num_seqs)
        if groups is None:
            tok = f_tok * num_seqs
            first, last = context, context + num_seqs * (k - 1)
            c0, m0 = tok + f_pair * first, w + kv * (first + num_seqs)
            c1, m1 = tok + f_pair * last, w + kv * (last + num_seqs)
            # one side of the ridge for the whole run: each step's time is one term, summed in order
            # (accumulate adds left to right as the loop below does; its first sum is the term itself)
            if m0 - c0 > _RIDGE_MARGIN * m0 and m1 - c1 > _RIDGE_MARGIN * m1:
                return list(accumulate([w + kv * (ctx + num_seqs) + extra for ctx in contexts]))
            if c0 - m0 > _RIDGE_MARGIN * c0 and c1 - m1 > _RIDGE_MARGIN * c1:
                return list(accumulate([tok + f_pair * ctx + extra for ctx in contexts]))
            for ctx in contexts:
                compute, memory = tok + f_pair * ctx, w + kv * (ctx + num_seqs)
                total += (compute if compute >= memory else memory) + extra
                append(total)
            return out
        mm = self._matmuls(groups, num_seqs, num_seqs)
        return list(accumulate([mm + f_pair * ctx + kv * (ctx + num_seqs) + extra for ctx in contexts]))

    def request_floor(
        self,
        spec: ModelShape,
        tp: int,
        prompt: ArrayOrInt,
        output: ArrayOrInt,
        max_num_seqs: int,
        cached: ArrayOrInt = 0,
    ) -> tuple[ArrayOrFloat, ArrayOrFloat]:
        """Device-seconds (all ``tp`` ranks) that one request's steps cost at least, as two floors
        that each hold alone: (its FLOPs at the compute rates, its share of the weight reads).

        FLOPs: the fewest tokens any schedule feeds (the prompt once, then ``output - 1`` decodes;
        the last sampled token is never fed) and attention pairs ``P(P+1)/2`` for the prompt plus
        ``P + k - 1`` for the k-th decode (decode_steps' count, one below step_time's). Weights: every
        step that samples reads them once and samples at most ``max_num_seqs`` tokens, so each of
        the ``output`` sampled tokens carries ``1 / max_num_seqs`` of a weight read. Overheads,
        KV traffic and all-reduces only add, so they are left out. Works elementwise on arrays.

        The summed CPU form prices a matmul group of ``m`` rows at ``min(m * row, w + m * f)``, which
        is at least ``m * min(row, f)`` and, for ``m >= 1``, at least ``min(row, w)``; its LM head runs
        only for sampled tokens, so the body and head are floored separately.

        ``cached``: prompt tokens a prefix cache can hold at most (never fed; their attention pairs
        ``C(C+1)/2`` are not computed either)."""
        f_tok, f_pair, w, _, _, _, _, groups, experts = self._c(spec, tp)
        if experts:  # a full step's tokens read this share of the experts
            w += experts * spec.experts_read(max_num_seqs)
        p, o, c = prompt, output, cached
        fed = p - c + o - 1
        pairs = p * (p + 1) / 2 - c * (c + 1) / 2 + (o - 1) * p + (o - 1) * (o - 2) / 2
        if groups is None:
            flops, per_step = f_tok * fed, w
        else:
            (body_w, body_f, body_row), (head_w, head_f, head_row) = groups
            flops = min(body_row, body_f) * fed + min(head_row, head_f) * o
            per_step = min(body_row, body_w) + min(head_row, head_w)
        return tp * (flops + f_pair * pairs), tp * o * per_step / max_num_seqs

    def prefill_time(self, spec: ModelShape, tp: int, prompt_tokens: int) -> float:
        """One request's whole prompt in one step, alone (what admission's speed estimate means)."""
        p = prompt_tokens
        return self.step_time(spec, tp, p, p * (p + 1) / 2, 0, 1)

    def prefill_tokens_per_s(self, spec: ModelShape, tp: int, prompt_tokens: int) -> float:
        p = max(1, int(prompt_tokens))
        return p / self.prefill_time(spec, tp, p)

    def activation_time(self, spec: ModelShape, tp: int) -> float:
        """Load one TP rank's weights from host memory (ranks load in parallel over their own links),
        at this shape's measured activation cost where the profile has one (``activation_for``)."""
        return sum(self.activation_parts(spec, tp))

    def activation_parts(self, spec: ModelShape, tp: int) -> tuple[float, float]:
        """``activation_time`` as (the time around the copy, the copy): one worker thread does the
        first (take the job, grant and map pages, build the engine), the loader threads the second."""
        seconds, rate = self.hw.activation_for(spec.name)
        return seconds, spec.weight_bytes / tp / rate


COST_MODELS: Mapping[str, type[RooflineCostModel]] = MappingProxyType({"roofline": RooflineCostModel})
