"""HardwareProfile.share_slowdown: how much slower each engine steps while n engines on one device
are busy. GPU profiles: processor sharing. The CPU profile: the form fitted by
benchmarks/cpu_sharing.py (docs/results.md, "The CPU profiles")."""

from __future__ import annotations

import itertools

import pytest

from prism_serve.sim import HARDWARE, SimConfigError
from prism_serve.sim.hardware import HardwareProfile
from prism_serve.sim.sharing import Interference, _median_excess, fit_interference

NS = range(0, 9)


@pytest.mark.parametrize("name", ["h100", "h200", "a100"])
def test_gpu_profiles_are_exactly_processor_sharing(name):
    hw = HARDWARE[name]
    assert hw.share_interference == 0.0
    assert [hw.share_slowdown(n) for n in NS] == [1.0, 1.0] + [float(n) for n in NS[2:]]


def test_cpu_profile_follows_its_fitted_form():
    hw = HARDWARE["cpu-smollm2"]
    a = hw.share_interference
    assert a > 0  # measured: sharing one core costs more than time slicing alone
    slow = [hw.share_slowdown(n) for n in NS]
    assert slow[0] == slow[1] == 1.0
    assert all(s >= n for n, s in zip(NS, slow, strict=True))
    assert all(x < y for x, y in itertools.pairwise(slow[1:]))  # monotone from one engine on
    for n in (2, 3, 5):
        assert hw.share_slowdown(n) == pytest.approx(n * (1 + a * (n - 1)))


# The one-core slowdowns benchmarks/cpu_sharing.py measured (2026-11-24; median over decode 1,
# decode 8 and prefill 256 of n x the CPU time per step shared / alone), recorded here as data.
MEASURED_ONE_CORE = {2: 2.10, 3: 3.32}


@pytest.mark.parametrize("n, measured", MEASURED_ONE_CORE.items())
def test_cpu_profile_reproduces_the_measured_one_core_slowdown(n, measured):
    assert HARDWARE["cpu-smollm2"].share_slowdown(n) == pytest.approx(measured, rel=0.03)


def test_negative_interference_is_a_named_error():
    with pytest.raises(SimConfigError, match="share_interference"):
        HardwareProfile("x", 1e12, 1e12, 1e9, 1e9, 1 << 30, share_interference=-0.1)


def test_the_form_fitted_to_slowdowns_recovers_its_constant():
    a = 0.07
    assert fit_interference({n: n * (1 + a * (n - 1)) for n in (2, 3)}) == pytest.approx(a)
    # two engines alone: 2 x the CPU-time ratio is the slowdown, so a is the ratio's excess over 1
    assert fit_interference({2: 2 * 1.03}) == pytest.approx(0.03)


def test_measured_ratios_become_constants_without_noise_below_zero_or_missing_points():
    assert _median_excess({"a": 1.02, "b": 1.05, "c": 1.10}) == pytest.approx(0.05)
    assert _median_excess({"a": 0.98, "b": 0.99}) == 0.0  # faster together is noise: no negative term
    assert _median_excess({"a": float("nan"), "b": 1.04}) == pytest.approx(0.04)  # a point with no step
    assert _median_excess({}) is None and _median_excess({"a": float("nan")}) is None
    report = Interference(0.03, None, {"decode": 1.03}).report()
    assert "two on one core 2.06x" in report and "two cores" not in report


def test_decode_terms_interpolate_by_rows_and_other_steps_take_the_profile_terms():
    hw = HardwareProfile(
        "x", 1e12, 1e12, 1e9, 1e9, 1 << 30, share_interference=0.05, cross_interference=0.02,
        decode_interference=((1, 0.2, 0.3), (8, 0.06, 0.1)),
    )  # fmt: skip
    assert hw.interference(0) == (0.05, 0.02)  # a step with a prefill chunk
    assert hw.interference(1) == (0.2, 0.3)
    assert hw.interference(8) == pytest.approx((0.06, 0.1))
    assert hw.interference(32) == pytest.approx((0.06, 0.1))  # the nearest entry outside
    s, c = hw.interference(4)  # 3/7 of the way from one row to eight
    assert s == pytest.approx(0.2 + 3 / 7 * (0.06 - 0.2)) and c == pytest.approx(0.3 + 3 / 7 * (0.1 - 0.3))
    assert hw.share_slowdown(2, 1) == pytest.approx(2 * 1.2) and hw.share_slowdown(2) == pytest.approx(2.1)
    assert hw.cross_slowdown(1, 1) == pytest.approx(1.3) and hw.cross_slowdown(1) == pytest.approx(1.02)
    plain = HardwareProfile("y", 1e12, 1e12, 1e9, 1e9, 1 << 30, share_interference=0.05)
    assert plain.interference(1) == (0.05, 0.0)  # none measured: the profile's terms for every step


@pytest.mark.parametrize(
    "table",
    [((2, 0.1, 0.1), (1, 0.1, 0.1)), ((1, 0.1, 0.1), (1, 0.2, 0.1)), ((0, 0.1, 0.1),),
     ((1, -0.1, 0.1),), ((1, 0.1, float("nan")),), ((1, 0.1),), ((1.5, 0.1, 0.1),), "x"],
)  # fmt: skip
def test_bad_decode_terms_are_a_named_error(table):
    with pytest.raises(SimConfigError, match="decode_interference"):
        HardwareProfile("x", 1e12, 1e12, 1e9, 1e9, 1 << 30, decode_interference=table)


def test_measured_decode_shapes_become_the_profiles_decode_terms():
    found = Interference(
        0.05, 0.04, {"decode 1 @256": 1.13, "decode 8 @256": 0.99, "prefill 256": 1.09},
        {"decode 1 @256": 1.26, "decode 8 @256": float("nan"), "prefill 256": 1.06},
    )  # fmt: skip
    # below 1 reads as 0; a cross point with no step in its window takes the given term
    (one, share1, cross1), (eight, share8, cross8) = found.decode_terms(0.04)
    assert (one, eight, share8, cross8) == (1, 8, 0.0, 0.04)
    assert share1 == pytest.approx(0.13) and cross1 == pytest.approx(0.26)
    assert Interference(None, None).decode_terms(0.1) == ()
