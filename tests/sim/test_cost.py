"""The cost model against hand-computed roofline estimates from public datasheet numbers."""

from __future__ import annotations

import pytest

from prism_serve.sim import HARDWARE, RooflineCostModel, SimConfigError, model_spec
from prism_serve.sim.hardware import HardwareProfile

H100_HBM = 3.35e12  # bytes/s, H100 SXM datasheet
H100_BF16 = 989e12  # dense FLOP/s


@pytest.mark.parametrize("batch, context", [(1, 1024), (32, 1024), (128, 2048)])
def test_8b_decode_step_on_h100_is_within_20_percent_of_the_roofline(batch, context):
    spec = model_spec("llama-3.1-8b")
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
    spec = model_spec("llama-3.1-8b")
    t1, t4 = cm.prefill_time(spec, 1, 1024), cm.prefill_time(spec, 1, 4096)
    assert 2 * 8e9 * 1024 / 989e12 < t1 < 0.05
    assert 4 < t4 / t1 < 5  # linear in tokens plus the quadratic attention term


def test_decode_runs_equal_their_steps_one_by_one():
    cm = RooflineCostModel(HARDWARE["a100"])
    spec = model_spec("llama-3.2-3b")
    run = cm.decode_steps(spec, 1, 7, 7 * 300, 5)
    for j in range(5):
        ctx = 7 * 300 + 7 * j
        assert run[j] == pytest.approx(cm.step_time(spec, 1, 7, ctx, ctx))


def test_tensor_parallelism_divides_the_work_and_adds_communication():
    cm = RooflineCostModel(HARDWARE["h100"])
    spec = model_spec("llama-3.1-70b")
    one, four = cm.decode_steps(spec, 1, 8, 8000, 1)[0], cm.decode_steps(spec, 4, 8, 8000, 1)[0]
    assert one / 4 < four < one / 2
    assert cm.activation_time(spec, 8) < cm.activation_time(spec, 1)


def test_activation_of_an_8b_model_is_near_the_papers_figure():
    # Prism's Figure 9: 1B-8B models activate within 0.7 s on H100
    assert cm_act("llama-3.1-8b") == pytest.approx(0.7, abs=0.1)


def cm_act(shape: str) -> float:
    return RooflineCostModel(HARDWARE["h100"]).activation_time(model_spec(shape), 1)


def test_bad_profile_is_a_named_error():
    with pytest.raises(SimConfigError):
        HardwareProfile("x", 0, 1, 1, 1, 1)
