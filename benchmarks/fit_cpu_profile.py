"""Fit the simulator's ``cpu-smollm2`` hardware profile to this project's engine on this machine.

Times real engine steps of SmolLM2-135M (fp32, real weights) -- prefills of several lengths alone and
decode steps at several batch sizes -- and fits, by least squares,

    step_s = overhead + flops / F + bytes / B        (the cost model's form with overlap=False)

where flops and bytes are what the cost model charges for that step. Prints the fitted F, B and
overhead (paste them into sim/hardware.py) and each point's measured vs fitted time. Waits for quiet
CPUs and prints the other load (see common.py).

    python benchmarks/fit_cpu_profile.py
"""

from __future__ import annotations

import time

import numpy as np

from common import cpu_seconds, machine_info, other_load_since, wait_quiet
from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.sim.models import model_spec


def features(spec, tokens: int, pairs: float, kv_read: float) -> tuple[float, float, float]:
    flops = spec.matmul_flops_per_token * tokens + spec.attn_flops_per_pair * pairs
    nbytes = spec.weight_bytes + spec.kv_bytes_per_token * (kv_read + tokens)
    return 1.0, flops, nbytes


def main() -> None:
    print(machine_info()["line"])
    spec = model_spec("smollm2-135m", dtype_bytes=4)
    engine = LLMEngine(EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048))
    rng = np.random.default_rng(0)
    rows, times, labels = [], [], []

    def run(prompts: list[int], max_tokens: int) -> list[float]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts:
            engine.add_request(rng.integers(17, 49152, p).tolist(), params)
        steps = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return steps

    run([32], 4)  # warm-up
    wait_quiet(60.0, 0.15)
    start, t_all = cpu_seconds(), time.perf_counter()
    for p in (64, 256, 512, 1024):
        for _ in range(3):
            t = run([p], 1)[0]
            rows.append(features(spec, p, p * (p + 1) / 2, 0))
            times.append(t)
            labels.append(f"prefill {p}")
    for batch in (1, 4, 16, 32):
        for ctx in (64, 384):
            steps = run([ctx] * batch, 9)
            # step 0 prefills every prompt; steps 1..8 decode the whole batch
            for j, t in enumerate(steps[1:], 1):
                c = batch * (ctx + j)
                rows.append(features(spec, batch, c, c))
                times.append(t)
                labels.append(f"decode b={batch} ctx={ctx}")
    load = other_load_since(start, time.perf_counter() - t_all)
    X, y = np.array(rows), np.array(times)
    # fit on relative error: small steps matter as much as big ones
    coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
    overhead, inv_f, inv_b = coef
    fitted = X @ coef
    print(f"other load during the measurement: {load:.2f} cores")
    print(f"fit: step_overhead_s={overhead:.3e}  peak_flops={1 / inv_f:.3e}  mem_bandwidth={1 / inv_b:.3e}")
    for label in dict.fromkeys(labels):
        idx = [i for i, lb in enumerate(labels) if lb == label]
        m, f = np.median(y[idx]), np.median(fitted[idx])
        print(f"  {label:<22} measured {m * 1e3:8.2f} ms  fitted {f * 1e3:8.2f} ms  ({f / m - 1:+.0%})")
    engine.close()


if __name__ == "__main__":
    main()
