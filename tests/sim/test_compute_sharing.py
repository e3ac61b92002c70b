"""Compute shared between engines on one device (simulator.py _sync_busy, SimEngine.rescale):
processor sharing is exact for the step in flight, with staggered starts, and for a whole run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prism_serve.sim import HARDWARE, SimConfig, simulate
from prism_serve.sim.errors import SimConfigError
from prism_serve.workload import Workload

from .helpers import loose, served

PROMPT = 4096  # several prefill chunks: the requests' steps interleave


def _run(
    arrivals: list[tuple[float, int]],
    *,
    devices: int = 1,
    sharing: bool = True,
    output: int = 1,
    hardware: str = "h100",
    models: int = 2,
):
    ms = [served(n, "llama-3.2-1b") for n in "abc"[:models]]
    times = np.array([t for t, _ in arrivals], dtype=float)
    w = Workload(times, np.array([i for _, i in arrivals]), np.full(len(arrivals), PROMPT),
                 np.full(len(arrivals), output), [m.name for m in ms])  # fmt: skip
    cfg = SimConfig(
        num_devices=devices, policy="static-partition", compute_sharing=sharing, hardware=hardware
    )
    return simulate(ms, w, loose(ms, ttft=100.0), cfg).requests


def _alone() -> float:
    (r,) = _run([(0.0, 0)])
    return r.ttft


def test_gpu_profiles_are_processor_sharing():
    hw = HARDWARE["h100"]
    assert [hw.share_slowdown(n) for n in (0, 1, 2, 3, 5)] == [1.0, 1.0, 2.0, 3.0, 5.0]


def test_two_engines_busy_together_each_take_twice_as_long():
    t = _alone()
    a, b = _run([(0.0, 0), (0.0, 1)])
    assert a.ttft == pytest.approx(2 * t, rel=1e-9) and b.ttft == pytest.approx(2 * t, rel=1e-9)


def test_a_late_neighbour_slows_the_step_already_in_flight():
    t = _alone()
    a, b = _run([(0.0, 0), (t / 2, 1)])
    # a: half its work alone, the other half at half speed; b: then alone for its last half
    assert a.ttft == pytest.approx(1.5 * t, rel=1e-6)
    assert b.ttft == pytest.approx(1.5 * t, rel=1e-6)


def test_engines_on_different_devices_or_with_sharing_off_do_not_slow_each_other():
    t = _alone()
    for kw in ({"devices": 2}, {"sharing": False}):
        a, b = _run([(0.0, 0), (0.0, 1)], **kw)
        assert a.ttft == pytest.approx(t, rel=1e-9) and b.ttft == pytest.approx(t, rel=1e-9), kw


def test_decode_runs_are_rescaled_too():
    # long outputs: the engines sit in coalesced decode runs while the other starts and stops
    (alone,) = _run([(0.0, 0)], output=300)
    d = alone.finish - alone.arrival
    a, b = _run([(0.0, 0), (0.0, 1)], output=300)
    assert a.finish - a.arrival == pytest.approx(2 * d, rel=1e-6)
    a, b = _run([(0.0, 0), (d / 2, 1)], output=300)
    assert a.finish - a.arrival == pytest.approx(1.5 * d, rel=1e-6)
    assert b.finish - b.arrival == pytest.approx(1.5 * d, rel=1e-6)


@pytest.mark.parametrize("name", ["cpu-smollm2", "h100"])
def test_a_slowed_profile_stretches_every_step_and_not_the_activation(name):
    from prism_serve.sim import RooflineCostModel
    from prism_serve.sim.models import model_shape

    hw = HARDWARE[name]
    base, slow = RooflineCostModel(hw), RooflineCostModel(hw.slowed(1.5))
    spec = model_shape("smollm2-135m", 4)
    for args in [(1, 16.0, 0, 1), (512, 512 * 256.0, 0, 1), (40, 8000.0, 4000, 8)]:
        expected = 1.5 * base.step_time(spec, 1, *args)
        assert slow.step_time(spec, 1, *args) == pytest.approx(expected, rel=1e-12)
    assert list(slow.decode_steps(spec, 1, 8, 2048, 4)) == pytest.approx(
        [1.5 * x for x in base.decode_steps(spec, 1, 8, 2048, 4)], rel=1e-12
    )
    assert slow.activation_time(spec, 1) == base.activation_time(spec, 1)


def test_a_profile_slowed_apart_prices_memory_and_compute_by_their_own_factors():
    """cpu-smollm2-avx512bf16 sums compute and memory time (overlap=False): a batch-1 decode step is
    nearly all weight read, a 512-token prefill nearly all FLOPs, so each follows its own factor."""
    from prism_serve.sim import RooflineCostModel
    from prism_serve.sim.models import model_shape

    hw = HARDWARE["cpu-smollm2-avx512bf16"]
    both = hw.slowed(1.2, compute_factor=0.9)
    assert both.mem_bandwidth == pytest.approx(hw.mem_bandwidth / 1.2)
    assert both.kv_bandwidth == pytest.approx(hw.kv_bandwidth / 1.2)
    assert both.peak_flops == pytest.approx(hw.peak_flops / 0.9)
    assert both.attn_flops == pytest.approx(hw.attn_flops / 0.9)
    base, slow = RooflineCostModel(hw), RooflineCostModel(both)
    spec = model_shape("smollm2-135m", 4)
    decode_step, prefill_step = (1, 16.0, 16, 1), (512, 512 * 256.0, 0, 1)
    decode = slow.step_time(spec, 1, *decode_step) / base.step_time(spec, 1, *decode_step)
    prefill = slow.step_time(spec, 1, *prefill_step) / base.step_time(spec, 1, *prefill_step)
    assert 1.15 < decode <= 1.2 and 0.9 <= prefill < 0.97
    same = hw.slowed(1.3, compute_factor=1.3)  # one factor for both: slowed(1.3) under another name
    assert same == dataclasses.replace(hw.slowed(1.3), name=same.name)
    with pytest.raises(SimConfigError):
        hw.slowed(1.0, compute_factor=0.0)


def test_step_scale_in_the_config_slows_the_run():
    t = _alone()
    ms = [served("a", "llama-3.2-1b")]
    w = Workload(np.array([0.0]), np.array([0]), np.array([PROMPT]), np.array([1]), ["a"])
    (r,) = simulate(ms, w, loose(ms, ttft=100.0), SimConfig(num_devices=1, policy="static-partition",
                                                         step_scale=2.0)).requests  # fmt: skip
    assert r.ttft == pytest.approx(2 * t, rel=1e-9)


def test_on_a_cpu_device_an_activations_copy_shares_the_core_with_the_engines_there(tmp_path):
    """cpu-smollm2 (activation_threads 4): b's activation runs on the core where a decodes: its
    copy as 4 threads beside a's one, the time around it (O: taking the job, mapping pages,
    building the engine) as one. The activation then takes O * (1 + 1) + C * (1 + 4) / 4 (C: the
    copy alone), a steps share(1 + 4) times slower meanwhile, so a loses that long times
    (1 - 1 / share(5)) of progress, and b's first token comes O + C / 4 later than with 0 threads
    (the GPU profiles' DMA copy), where the activation leaves a alone."""
    import dataclasses

    from prism_serve.sim import RooflineCostModel
    from prism_serve.sim.hardware import dump_hardware
    from prism_serve.sim.models import ServedModel, model_shape

    hw = HARDWARE["cpu-smollm2"]
    assert hw.activation_threads == 4 and HARDWARE["h100"].activation_threads == 0
    dma = tmp_path / "dma.json"
    dump_hardware(dataclasses.replace(hw, name="cpu-dma", activation_threads=0), dma)
    ms = [ServedModel(n, model_shape("smollm2-135m", 4)) for n in ("a", "b")]  # fp32, as fitted
    w = Workload(np.array([0.0, 1.0]), np.array([0, 1]), np.array([64, 64]), np.array([400, 2]), ["a", "b"])

    def run(hardware: str):
        cfg = SimConfig(num_devices=1, hardware=hardware, policy="prism", knobs=(("prewarm", False),),
                        warmup_s=0.0)  # fmt: skip
        return {r.model: r for r in simulate(ms, w, loose(ms, ttft=100.0, tpot=100.0), cfg).requests}

    shared, apart = run("cpu-smollm2"), run(str(dma))
    around, copy = RooflineCostModel(hw).activation_parts(ms[1].spec, 1)
    assert around > 0 and copy > 0
    took = around * 2 + copy * 5 / 4
    assert apart["a"].finish > 2.0 and apart["a"].first_token < 1.0  # a decodes through b's activation
    lost = took * (1 - 1 / hw.share_slowdown(5))
    assert shared["a"].finish - apart["a"].finish == pytest.approx(lost, rel=1e-6)
    assert shared["b"].first_token - apart["b"].first_token == pytest.approx(took - around - copy, rel=1e-6)


def _host_shared(tmp_path, cross: float, serving: float = 0.0) -> str:
    """The h100 profile with devices that share one memory system (as CPU cores do) and, with
    ``serving``, whose cores the serving path takes a share of once they are all busy."""
    import dataclasses

    from prism_serve.sim.hardware import dump_hardware

    path = tmp_path / "shared-host.json"
    hw = dataclasses.replace(
        HARDWARE["h100"], name="shared-host", cross_interference=cross, serving_share=serving
    )
    dump_hardware(hw, path)
    return str(path)


def test_gpu_profiles_have_independent_devices():
    assert all(hw.cross_interference == 0.0 for name, hw in HARDWARE.items() if not name.startswith("cpu"))
    assert HARDWARE["h100"].cross_slowdown(3) == 1.0


def test_devices_sharing_a_host_slow_each_other_by_the_cross_term(tmp_path):
    """Two devices busy at once: each step 1 + c times as long; with sharing off, as alone."""
    hw = _host_shared(tmp_path, 0.25)
    (alone,) = _run([(0.0, 0)], devices=2, hardware=hw)
    assert alone.ttft == pytest.approx(_alone(), rel=1e-9)  # alone, the term costs nothing
    a, b = _run([(0.0, 0), (0.0, 1)], devices=2, hardware=hw)
    assert a.ttft == pytest.approx(1.25 * alone.ttft, rel=1e-9)
    assert b.ttft == pytest.approx(1.25 * alone.ttft, rel=1e-9)
    a, b = _run([(0.0, 0), (0.0, 1)], devices=2, hardware=hw, sharing=False)
    assert a.ttft == pytest.approx(alone.ttft, rel=1e-9) and b.ttft == pytest.approx(alone.ttft, rel=1e-9)


def test_a_device_that_starts_work_slows_the_step_in_flight_elsewhere(tmp_path):
    """b starts on the other device halfway through a's step: a's second half runs 1 + c slower;
    b's first half too, then b runs alone."""
    c = 0.25
    hw = _host_shared(tmp_path, c)
    (alone,) = _run([(0.0, 0)], devices=2, hardware=hw)
    t = alone.ttft
    a, b = _run([(0.0, 0), (t / 2, 1)], devices=2, hardware=hw)
    assert a.ttft == pytest.approx(t / 2 + (1 + c) * t / 2, rel=1e-6)
    # b: while a runs (c * t / 2 more of wall), b does c*t/2 / (1 + c) of its work at the slow rate
    overlap = (1 + c) * t / 2
    assert b.ttft == pytest.approx(overlap + (t - overlap / (1 + c)), rel=1e-6)


def test_the_cross_term_counts_devices_not_engines(tmp_path):
    """a and b on device 0 (processor sharing: 2x), c on device 1: a and b take 2 * (1 + c), c
    takes (1 + c) while they run; two engines on one device count as one other busy device."""
    cross = 0.25
    hw = _host_shared(tmp_path, cross)
    (alone,) = _run([(0.0, 0)], devices=2, hardware=hw, models=3)
    t = alone.ttft
    reqs = {r.model: r for r in _run([(0.0, 0), (0.0, 1), (0.0, 2)], devices=2, hardware=hw, models=3)}
    pair = [m for m in "abc" if reqs[m].ttft > 1.5 * t]
    single = [m for m in "abc" if m not in pair]
    assert len(pair) == 2 and len(single) == 1, {m: r.ttft / t for m, r in reqs.items()}
    # the single one runs at 1 + cross while the pair is busy (the whole of its step)
    assert reqs[single[0]].ttft == pytest.approx((1 + cross) * t, rel=1e-6)
    # the pair: (1 + cross) * 2 slower until the single one ends, then 2x
    done = (1 + cross) * t / ((1 + cross) * 2)  # work each of the pair did by then
    assert reqs[pair[0]].ttft == pytest.approx((1 + cross) * t + 2 * (t - done), rel=1e-6)


def test_the_serving_share_slows_steps_only_while_every_device_is_busy(tmp_path):
    """Serving share s, no cross term: one device of two busy, its step as alone (the serving path
    has the idle core); both busy, each 1 + s; one device of one busy, 1 + s already."""
    s = 0.1
    hw = _host_shared(tmp_path, 0.0, serving=s)
    t = _alone()
    (alone,) = _run([(0.0, 0)], devices=2, hardware=hw)
    assert alone.ttft == pytest.approx(t, rel=1e-9)
    a, b = _run([(0.0, 0), (0.0, 1)], devices=2, hardware=hw)
    assert a.ttft == pytest.approx((1 + s) * t, rel=1e-9) and b.ttft == pytest.approx((1 + s) * t, rel=1e-9)
    (only,) = _run([(0.0, 0)], devices=1, hardware=hw)
    assert only.ttft == pytest.approx((1 + s) * t, rel=1e-9)
    # with compute sharing off, as alone
    a, b = _run([(0.0, 0), (0.0, 1)], devices=2, hardware=hw, sharing=False)
    assert a.ttft == pytest.approx(t, rel=1e-9) and b.ttft == pytest.approx(t, rel=1e-9)


def test_the_serving_share_starts_when_the_last_device_turns_busy(tmp_path):
    """b starts on the other device halfway through a's step: a's second half runs 1 + s slower;
    b runs at 1 + s until a ends, then alone; with the cross term too, both factors multiply."""
    s, c = 0.1, 0.25
    t = _alone()
    a, b = _run([(0.0, 0), (t / 2, 1)], devices=2, hardware=_host_shared(tmp_path, 0.0, serving=s))
    assert a.ttft == pytest.approx(t / 2 + (1 + s) * t / 2, rel=1e-6)
    overlap = (1 + s) * t / 2
    assert b.ttft == pytest.approx(overlap + (t - overlap / (1 + s)), rel=1e-6)
    a, b = _run([(0.0, 0), (0.0, 1)], devices=2, hardware=_host_shared(tmp_path, c, serving=s))
    assert a.ttft == pytest.approx((1 + c) * (1 + s) * t, rel=1e-9)


def test_the_serving_share_is_a_named_error_when_negative():
    from prism_serve.sim.hardware import HardwareProfile

    with pytest.raises(SimConfigError, match="serving_share"):
        HardwareProfile("x", 1e12, 1e12, 1e9, 1e9, 1 << 30, serving_share=-0.01)
    assert all(hw.serving_share == 0.0 for name, hw in HARDWARE.items() if not name.startswith("cpu"))
    assert HARDWARE["h100"].serving_slowdown(True) == 1.0


def _by_shape(tmp_path, share: float, table, cross: float = 0.0) -> str:
    """The h100 profile with ``share`` (and ``cross``) for steps with a prefill and ``table``
    (``decode_interference``) for decode steps."""
    import dataclasses

    from prism_serve.sim.hardware import dump_hardware

    path = tmp_path / "by-shape.json"
    hw = dataclasses.replace(
        HARDWARE["h100"], name="by-shape", share_interference=share, cross_interference=cross,
        decode_interference=table,
    )  # fmt: skip
    dump_hardware(hw, path)
    return str(path)


def test_decode_steps_share_a_device_by_their_own_measured_term(tmp_path):
    """Two one-row decodes on one device: each step 2 x (1 + the table's term at one row), while
    their prefills, stepping together before, take the profile's own term."""
    hw = _by_shape(tmp_path, 0.1, ((1, 0.3, 0.0), (8, 0.05, 0.0)))
    (alone,) = _run([(0.0, 0)], output=20, hardware=hw)
    a, b = _run([(0.0, 0), (0.0, 1)], output=20, hardware=hw)
    for r in (a, b):
        assert r.ttft == pytest.approx(2 * 1.1 * alone.ttft, rel=1e-6)
        assert r.tpot == pytest.approx(2 * 1.3 * alone.tpot, rel=1e-6)
    # with sharing off the table does nothing either
    a, _ = _run([(0.0, 0), (0.0, 1)], output=20, hardware=hw, sharing=False)
    assert a.tpot == pytest.approx(alone.tpot, rel=1e-9)


def test_a_decode_step_slows_by_the_cross_term_of_its_rows(tmp_path):
    """One one-row decode on each of two devices of one host: each step 1 + the table's cross term
    at one row; the profile's own cross term prices their prefills."""
    hw = _by_shape(tmp_path, 0.0, ((1, 0.0, 0.4),), cross=0.1)
    (alone,) = _run([(0.0, 0)], devices=2, output=20, hardware=hw)
    a, b = _run([(0.0, 0), (0.0, 1)], devices=2, output=20, hardware=hw)
    for r in (a, b):
        assert r.ttft == pytest.approx(1.1 * alone.ttft, rel=1e-6)
        assert r.tpot == pytest.approx(1.4 * alone.tpot, rel=1e-6)
