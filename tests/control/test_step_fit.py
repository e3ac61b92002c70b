"""The step-time fit behind a replica's capacity (control.profiles.StepSums, batching_gain,
measured_profile): a power law of the batch recovered from running sums, and the capacity credit it
gives an engine that ran below the batch its TPOT SLO allows."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prism_serve.control import ModelProfile
from prism_serve.control.profiles import StepSums, batching_gain, measured_profile


def sums(t1: float, p: float, batches: list[int], steps_each: int = 10) -> StepSums:
    s = StepSums()
    for b in batches:
        s = s.plus(b, steps_each * t1 * b**p, steps_each)
    return s


@given(
    t1=st.floats(1e-4, 1.0),
    p=st.floats(0.0, 1.0),
    batches=st.lists(st.integers(1, 64), min_size=2, max_size=12).filter(lambda bs: len(set(bs)) > 1),
)
def test_the_fit_recovers_a_power_law(t1: float, p: float, batches: list[int]) -> None:
    s = sums(t1, p, batches)
    fit = s.fit()
    if fit is None:  # only when the batches are too alike in log terms to tell p
        n = s.steps
        assert s.xx / n - (s.x / n) ** 2 < 0.05
        return
    assert fit[0] == pytest.approx(t1, rel=1e-6) and fit[1] == pytest.approx(p, abs=1e-6)


def test_sums_add_and_subtract_like_the_steps_they_hold() -> None:
    a, b = sums(0.01, 0.5, [1, 2]), sums(0.01, 0.5, [4, 8])
    both = sums(0.01, 0.5, [1, 2, 4, 8])
    assert (a + b).fit() == pytest.approx(both.fit())
    assert (both - a).steps == b.steps and (both - a).batch == pytest.approx(b.batch)
    assert StepSums().plus(0, 1.0) == StepSums() and StepSums().plus(2, 0.0) == StepSums()


def test_too_few_steps_or_one_batch_size_leave_the_fit_unknown() -> None:
    assert sums(0.01, 0.5, [1, 2], steps_each=7).fit() is None  # 14 steps
    assert sums(0.01, 0.5, [3], steps_each=100).fit() is None
    # p outside [0, 1] is clipped: steps that got faster with the batch read as flat
    faster = StepSums().plus(1, 20 * 0.02, 20).plus(4, 20 * 0.01, 20)
    assert faster.fit()[1] == 0.0


def test_the_gain_is_the_batching_the_tpot_slo_leaves_room_for() -> None:
    # t(B) = 0.04 * B**0.5: within 0.2 s a batch of 25; ran at batches 1 and 2
    s = sums(0.04, 0.5, [1, 1, 1, 2])
    now = s.batch / s.seconds
    assert batching_gain(s, 0.2, 256) == pytest.approx((25 / (0.04 * 5)) / now)
    assert batching_gain(s, 0.2, 8) == pytest.approx((8 / (0.04 * math.sqrt(8))) / now)  # max_num_seqs
    assert batching_gain(s, 0.03, 256) == 1.0  # even one sequence misses the SLO: no credit
    # linear steps (p = 1) gain nothing from batching
    assert batching_gain(sums(0.04, 1.0, [1, 2, 4]), 1.0, 256) == pytest.approx(1.0)
    # unknown fit: no capacity known, unless the engine already ran near its batch limit
    assert batching_gain(sums(0.04, 0.5, [1]), 0.2, 256) is None
    assert batching_gain(sums(0.04, 0.5, [6]), 0.2, 8) == 1.0
    assert batching_gain(StepSums(), 0.2, 8) is None


def test_a_nearly_flat_step_gives_the_batch_limit_instead_of_overflowing() -> None:
    """A fitted p just above 0 (steps that hardly grow with the batch, seen live on a CPU) once made
    (tpot / t1) ** (1 / p) overflow: every tick of the control loop and /metrics raised
    OverflowError. The largest batch within the SLO is then the batch limit."""
    s = sums(0.01, 0.001, [1, 2, 4, 8])
    t1, p = s.fit()
    assert 0 < p < 0.01 and t1 < 0.5
    now = s.batch / s.seconds
    assert batching_gain(s, 0.5, 256) == pytest.approx((256 / (t1 * 256**p)) / now)
    assert measured_profile(ModelProfile(), 10.0, 100, s, 0.5, 256).max_rate > 0


def test_measured_profile_scales_the_floor_by_the_gain() -> None:
    s = sums(0.04, 0.5, [1, 1, 1, 2])
    p = measured_profile(ModelProfile(), 10.0, 5, s, 0.2, 256)
    assert p.busy_s_per_request == 2.0
    assert p.max_rate == pytest.approx(batching_gain(s, 0.2, 256) / 2.0)
    assert measured_profile(ModelProfile(), 10.0, 5, sums(0.04, 0.5, [1]), 0.2, 256).max_rate is None
    assert measured_profile(ModelProfile(), 10.0, 5).max_rate == 0.5  # no sums: the floor
