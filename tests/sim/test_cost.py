"""The cost model against hand-computed roofline estimates from public datasheet numbers."""

from __future__ import annotations

import pytest

from prism_serve.sim import HARDWARE, RooflineCostModel, SimConfigError, model_shape
from prism_serve.sim.hardware import HardwareProfile

H100_HBM = 3.35e12  # bytes/s, H100 SXM datasheet
H100_BF16 = 989e12  # dense FLOP/s


@pytest.mark.parametrize("batch, context", [(1, 1024), (32, 1024), (128, 2048)])
def test_8b_decode_step_on_h100_is_within_20_percent_of_the_roofline(batch, context):
    spec = model_shape("llama-3.1-8b")
    # Llama-3.1-8B in bf16: ~16.06 GB of weights read once per step, 128 KiB of KV per context token
    weights = spec.num_params * 2
    assert weights == pytest.approx(16.06e9, rel=0.01)
    kv = 2 * 32 * 8 * 128 * 2
    memory_s = (weights + kv * batch * (context + 1)) / H100_HBM
    compute_s = 2 * 8.03e9 * batch / H100_BF16
    roofline = max(memory_s, compute_s)
    step = RooflineCostModel(HARDWARE["h100"]).decode_steps(spec, 1, batch, batch * context, 1)[0]
    assert roofline <= step <= 1.2 * roofline


def test_prefill_is_compute_bound_and_scales_with_tokens():
    cm = RooflineCostModel(HARDWARE["h100"])
    spec = model_shape("llama-3.1-8b")
    t1, t4 = cm.prefill_time(spec, 1, 1024), cm.prefill_time(spec, 1, 4096)
    assert 2 * 8e9 * 1024 / 989e12 < t1 < 0.05
    assert 4 < t4 / t1 < 5  # linear in tokens plus the quadratic attention term


def test_decode_runs_equal_their_steps_one_by_one():
    cm = RooflineCostModel(HARDWARE["a100"])
    spec = model_shape("llama-3.2-3b")
    run = cm.decode_steps(spec, 1, 7, 7 * 300, 5)
    for j in range(5):
        ctx = 7 * 300 + 7 * j
        assert run[j] == pytest.approx(cm.step_time(spec, 1, 7, ctx, ctx, 7))


@pytest.mark.parametrize("hw", ["h100", "a100", "cpu-smollm2", "cpu-smollm2-avx512bf16"])
@pytest.mark.parametrize("shape, tp", [("llama-3.2-3b", 1), ("llama-3.1-70b", 4), ("smollm2-135m", 1)])
def test_decode_run_is_the_running_sum_of_the_steps_exactly(hw, shape, tp):
    # the simulator's decode runs use decode_run; its ends must be numpy's running sum bit for bit
    import numpy as np

    cm = RooflineCostModel(HARDWARE[hw])
    spec = model_shape(shape)
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, k = int(rng.integers(1, 256)), int(rng.integers(1, 40))
        context = int(rng.integers(n, n * 20000))
        steps = cm.decode_steps(spec, tp, n, context, k)
        assert cm.decode_run(spec, tp, n, context, k) == np.cumsum(steps).tolist()


@pytest.mark.parametrize("shape, tp", [("llama-3.2-3b", 1), ("llama-3.1-70b", 4), ("smollm2-135m", 1)])
def test_decode_runs_across_the_roofline_ridge_are_the_running_sum_exactly(shape, tp):
    """Runs whose steps go from memory-bound to compute-bound (or stay within a hair of the ridge):
    decode_run sums each step's side of the ridge, as numpy's maximum picks it."""
    import numpy as np

    cm = RooflineCostModel(HARDWARE["h100"])
    spec = model_shape(shape)
    f_tok, f_pair, w, kv, *_ = cm._c(spec, tp)
    for n in (1, 7, 64, 200, 256):
        if kv == f_pair:
            continue
        ridge = (f_tok * n - w - kv * n) / (kv - f_pair)  # the context where compute == memory
        for k in (1, 2, 5, 32):
            for offset in (-n * k, -n * k // 2, -1, 0, 1):
                context = int(ridge) + offset
                if context < n:
                    continue
                steps = cm.decode_steps(spec, tp, n, context, k)
                assert cm.decode_run(spec, tp, n, context, k) == np.cumsum(steps).tolist()


def test_tensor_parallelism_divides_the_work_and_adds_communication():
    cm = RooflineCostModel(HARDWARE["h100"])
    spec = model_shape("llama-3.1-70b")
    one, four = cm.decode_steps(spec, 1, 8, 8000, 1)[0], cm.decode_steps(spec, 4, 8, 8000, 1)[0]
    assert one / 4 < four < one / 2
    assert cm.activation_time(spec, 8) < cm.activation_time(spec, 1)


def test_activation_of_an_8b_model_is_near_the_papers_figure():
    # Prism's Figure 9: 1B-8B models activate within 0.7 s on H100
    assert cm_act("llama-3.1-8b") == pytest.approx(0.7, abs=0.1)


def cm_act(shape: str) -> float:
    return RooflineCostModel(HARDWARE["h100"]).activation_time(model_shape(shape), 1)


def test_bad_profile_is_a_named_error():
    with pytest.raises(SimConfigError):
        HardwareProfile("x", 0, 1, 1, 1, 1)
    with pytest.raises(SimConfigError, match="step_seconds must be 'wall' or 'cpu'"):
        HardwareProfile("x", 1, 1, 1, 1, 1, step_seconds="thread")


def test_profiles_name_the_seconds_their_steps_were_fitted_to():
    """The CPU profiles fitted to live steps' CPU seconds say so; a datasheet and a fit of steps
    timed in a process of their own (sim/fit.py profile_from) price wall seconds."""
    import numpy as np

    from prism_serve.sim.fit import profile_from

    assert [HARDWARE[n].step_seconds for n in ("cpu-smollm2", "cpu-smollm2-avx512bf16")] == ["cpu", "cpu"]
    assert HARDWARE["h100"].step_seconds == "wall"
    coef = np.array([0.0, 1e-10, 1e-11, 0.0, 0.0, 1e-11, 1e-10])
    assert profile_from(coef, HARDWARE["cpu-smollm2"]).step_seconds == "wall"
    assert profile_from(coef, HARDWARE["h100"], step_seconds="cpu").step_seconds == "cpu"


# -- the fitted CPU profile (benchmarks/fit_cpu_profile.py) -------------------------------------------

CPU = HARDWARE["cpu-smollm2"]
SMOLLM = model_shape("smollm2-135m", dtype_bytes=4)


def test_cpu_profile_is_fitted_and_labelled_so():
    assert not CPU.synthetic and "fitted on this machine" in CPU.label
    assert all(HARDWARE[g].synthetic for g in ("h100", "h200", "a100"))


# Step times the fit measured (2026-11-24, AVX2 EPYC, one core, one thread, the engine of that
# day, minimum of 6 steps over 2 rounds; benchmarks/fit_cpu_profile.py), recorded here as data:
# this checks the summed CPU form and its constants together, it times nothing. (kind, batch of
# (new tokens, cached tokens), measured s). Every decode here has one context, so grouping pads
# nothing.
RECORDED = [
    ("decode b=1 ctx=16", [(1, 15)], 0.0420),
    ("decode b=8 ctx=512", [(1, 511)] * 8, 0.1469),
    ("decode b=32 ctx=1024 (held out)", [(1, 1023)] * 32, 0.6702),
    ("prefill 512", [(512, 0)], 1.8118),
    ("prefill 128 after 1024", [(128, 1024)], 0.6245),
    ("prefill 128 + 8 decodes ctx=256 (held out)", [(128, 0)] + [(1, 256)] * 8, 0.5141),
]


@pytest.mark.parametrize("name, batch, measured", RECORDED, ids=[r[0] for r in RECORDED])
def test_cpu_profile_reproduces_recorded_engine_steps(name, batch, measured):
    cm = RooflineCostModel(CPU)
    tokens = sum(n for n, _ in batch)
    pairs = sum(n * (b + (n + 1) / 2) for n, b in batch)
    predicted = cm.step_time(SMOLLM, 1, tokens, pairs, sum(b for _, b in batch), len(batch))
    assert predicted == pytest.approx(measured, rel=0.15)


def test_cpu_form_small_batches_and_the_lm_head():
    cm = RooflineCostModel(CPU)
    one, two, eight = (cm.decode_steps(SMOLLM, 1, b, b * 16, 1)[0] for b in (1, 2, 8))
    # one or two rows stream the weights per row; from three on they are packed once
    assert 1.3 * one < two < 2 * one and eight < 4 * one
    # a 64-token prefill samples once, 64 decodes sample 64 times (LM head, sampling)
    assert cm.prefill_time(SMOLLM, 1, 64) < cm.decode_steps(SMOLLM, 1, 64, 64 * 32, 1)[0]
    # the GPU roofline ignores sampled sequences (its seq_overhead_s is 0)
    h100 = RooflineCostModel(HARDWARE["h100"])
    spec = model_shape("llama-3.1-8b")
    assert h100.step_time(spec, 1, 64, 64 * 32, 64 * 31, 1) == h100.step_time(
        spec, 1, 64, 64 * 32, 64 * 31, 64
    )


@pytest.mark.parametrize(("prompts", "padded"), [((200, 300), True), ((16, 300), False)])
def test_cpu_decodes_pay_for_the_longest_context_of_their_group(prompts, padded):
    """As the engine's attention (engine/grouping.py): decodes of similar contexts are padded to
    the longest of them; a context under 0.6 of it is attended in its own group, unpadded."""
    from prism_serve.sim import ServedModel
    from prism_serve.sim.engine import SimEngine, SimRequest
    from prism_serve.sim.memory import SimDevice

    cm = RooflineCostModel(CPU)
    dev = SimDevice("cpu0", 1 << 30, 2 << 20)
    e = SimEngine(
        ServedModel("m", SMOLLM),
        [dev],
        cm,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_run_steps=4,
    )
    for i, prompt in enumerate(prompts):
        e.add(SimRequest(str(i), "m", 0.0, prompt, 50, 1.0, 1.0, control=None))
    t = 0.0
    while (end := e.start_step(t)) is not None and e._run_k == 0:  # prefill steps
        e.finish_step(end)
        t = end
    assert e._run_k > 0  # a decode run of both requests
    contexts = [s.num_computed for s in e.running]
    exact = cm.decode_steps(SMOLLM, 1, 2, sum(contexts), e._run_k)
    want = cm.decode_steps(SMOLLM, 1, 2, 2 * max(contexts), e._run_k) if padded else exact
    assert end - t == pytest.approx(want.sum())
    assert (want[0] > exact[0]) == padded


def test_row_bandwidth_needs_the_summed_form():
    with pytest.raises(SimConfigError, match="row_bandwidth"):
        HardwareProfile("x", 1e12, 1e12, 1e9, 1e9, 1 << 30, row_bandwidth=1e10)
    with pytest.raises(SimConfigError, match="kv_bandwidth"):
        HardwareProfile("x", 1e12, 1e12, 1e9, 1e9, 1 << 30, kv_bandwidth=0.0)
