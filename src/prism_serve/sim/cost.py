"""Step time of one engine iteration from a hardware profile (a roofline with efficiency factors).

For a batch with ``P`` prefill tokens and ``D`` decoding requests on ``tp`` devices:

    compute = (2 * matmul_params * (P + D) + 4 * L * H * d * attention_pairs) / tp / (peak * eff_f)
    memory  = (weight_bytes + kv_bytes_per_token * (context read + tokens written)) / tp / (bw * eff_m)
    step    = max(compute, memory) + overhead     (GPU profiles; a fitted CPU profile sums them)
            + 2 * L * (allreduce latency + (P + D) * hidden * dtype * 2 (tp-1)/tp / link bw)   if tp > 1

``attention_pairs`` counts (query, key) pairs: a decode reads its whole context, a prefill chunk of
``c`` tokens after ``b`` computed ones attends to ``b + (c + 1) / 2`` keys on average. Weights are
read once per step whatever the batch, which is why decoding in large batches is cheap.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from prism_serve.sim.hardware import HardwareProfile
from prism_serve.sim.models import ModelSpec

__all__ = ["COST_MODELS", "RooflineCostModel"]


class RooflineCostModel:
    """Per (model shape, tp) constants are folded once; the hot calls are a few float operations."""

    def __init__(self, hw: HardwareProfile) -> None:
        self.hw = hw
        self._flops_rate = hw.peak_flops * hw.flops_efficiency
        self._mem_rate = hw.mem_bandwidth * hw.mem_efficiency
        self._consts: dict[tuple[str, int, int], tuple[float, float, float, float, float, float]] = {}

    def _c(self, spec: ModelSpec, tp: int) -> tuple[float, float, float, float, float, float]:
        key = (spec.name, spec.dtype_bytes, tp)
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
            c = (
                spec.matmul_flops_per_token / tp / self._flops_rate,  # s per token, compute
                spec.attn_flops_per_pair / tp / self._flops_rate,  # s per attention pair
                spec.weight_bytes / tp / self._mem_rate,  # s to stream the weights once
                spec.kv_bytes_per_token / tp / self._mem_rate,  # s per KV token read or written
                hw.step_overhead_s + comm_fixed,
                comm_per_token,
            )
            self._consts[key] = c
        return c

    def step_time(self, spec: ModelSpec, tp: int, tokens: int, attn_pairs: float, kv_read: float) -> float:
        """One step: ``tokens`` fed (prefill chunks plus one per decode), ``attn_pairs`` as above,
        ``kv_read`` KV tokens read (every decode's context plus earlier chunks of prefills)."""
        f_tok, f_pair, w, kv, fixed, comm = self._c(spec, tp)
        compute = f_tok * tokens + f_pair * attn_pairs
        memory = w + kv * (kv_read + tokens)
        body = max(compute, memory) if self.hw.overlap else compute + memory
        return body + fixed + comm * tokens

    def decode_steps(self, spec: ModelSpec, tp: int, num_seqs: int, context: int, k: int) -> np.ndarray:
        """Durations of ``k`` consecutive decode-only steps of ``num_seqs`` requests whose contexts
        sum to ``context`` at the first step (every step adds ``num_seqs`` tokens)."""
        f_tok, f_pair, w, kv, fixed, comm = self._c(spec, tp)
        ctx = context + num_seqs * np.arange(k, dtype=np.float64)
        compute = f_tok * num_seqs + f_pair * ctx
        memory = w + kv * (ctx + num_seqs)
        body = np.maximum(compute, memory) if self.hw.overlap else compute + memory
        return body + (fixed + comm * num_seqs)

    def prefill_time(self, spec: ModelSpec, tp: int, prompt_tokens: int) -> float:
        """One request's whole prompt in one step, alone (what admission's speed estimate means)."""
        p = prompt_tokens
        return self.step_time(spec, tp, p, p * (p + 1) / 2, 0)

    def prefill_tokens_per_s(self, spec: ModelSpec, tp: int, prompt_tokens: int) -> float:
        p = max(1, int(prompt_tokens))
        return p / self.prefill_time(spec, tp, p)

    def activation_time(self, spec: ModelSpec, tp: int) -> float:
        """Load one TP rank's weights from host memory (ranks load in parallel over their own links)."""
        hw = self.hw
        return hw.activation_overhead_s + spec.weight_bytes / tp / (hw.host_bandwidth * hw.host_efficiency)


COST_MODELS: Mapping[str, type[RooflineCostModel]] = MappingProxyType({"roofline": RooflineCostModel})
