"""Sliding-window rates and the idle-gap threshold."""

from __future__ import annotations

import pytest

from prism_serve.control import (
    InvalidKnobError,
    InvalidSnapshotError,
    RateEstimator,
    idle_threshold_from_gaps,
)
from prism_serve.control.forecast import SeasonalForecaster


def test_rate_counts_arrivals_in_the_window():
    est = RateEstimator(window_s=10.0)
    est.start("a", 0.0)
    for t in range(20):
        est.observe("a", float(t))  # 1 req/s for 20 s
    assert est.rate("a", 19.5) == pytest.approx(1.0)
    assert est.rate("a", 25.0) == pytest.approx(0.4)  # only arrivals at 16..19 remain
    assert est.rate("a", 100.0) == 0.0
    assert est.rate("never", 5.0) == 0.0


def test_moving_names_the_models_whose_rate_can_still_change():
    est = RateEstimator(window_s=10.0)
    est.start("idle", 0.0)
    est.observe("a", 1.0)
    assert est.moving() == ["a"]
    assert est.rate("a", 5.0) == pytest.approx(0.25)
    assert est.moving() == ["a"]  # at 11 s and later it reads 0.0
    assert est.rate("a", 11.0) == 0.0
    assert est.moving() == []


def test_young_history_is_not_diluted_by_the_whole_window():
    est = RateEstimator(window_s=60.0)
    for t in (0.0, 0.5, 1.0, 1.5):
        est.observe("a", t)
    assert est.rate("a", 2.0) == pytest.approx(2.0)  # 4 arrivals over the 2 s seen so far


def test_a_prior_counts_for_the_part_of_the_window_not_yet_watched():
    est = RateEstimator(window_s=60.0)
    est.start("a", 0.0)
    est.set_prior("a", 0.5)
    assert est.rate("a", 0.0) == pytest.approx(0.5)  # nothing watched: the prior alone
    est.observe("a", 1.0)  # one arrival in the first seconds is not a rate of 1/s
    assert est.rate("a", 2.0) == pytest.approx((1 + 0.5 * 58) / 60)
    for t in range(2, 30):
        est.observe("a", float(t))  # then 1 req/s
    assert est.rate("a", 30.0) == pytest.approx((29 + 0.5 * 30) / 60)
    for t in range(30, 60):
        est.observe("a", float(t))
    assert est.rate("a", 60.0) == pytest.approx(59 / 60)  # a whole window watched: arrivals alone
    assert est.rate("a", 90.0) == pytest.approx(29 / 60)
    est.set_prior("never", 0.25)
    assert est.rate("never", 5.0) == 0.25  # a model not started reads its prior
    with pytest.raises(InvalidKnobError):
        est.set_prior("a", -1.0)
    with pytest.raises(InvalidKnobError):
        est.set_prior("a", float("nan"))


def test_a_prior_keeps_a_model_moving_until_a_window_has_been_watched():
    est = RateEstimator(window_s=10.0)
    est.start("a", 0.0)
    est.start("b", 0.0)
    est.set_prior("a", 2.0)
    assert est.moving(5.0) == ["a"]  # its rate falls with time, no arrival needed
    assert est.rate("a", 5.0) == pytest.approx(1.0)
    assert est.moving() == []  # without a time, arrivals alone
    assert est.moving(10.0) == ["a"]  # its last move: the prior no longer counts
    assert est.rate("a", 10.0) == 0.0
    assert est.moving(11.0) == []


def test_idle_gaps_and_threshold():
    est = RateEstimator(window_s=60.0, min_gap_s=10.0)
    for t in (0.0, 5.0, 30.0, 31.0, 100.0):
        est.observe("a", t)
    assert est.idle_gaps("a") == [25.0, 69.0]
    assert est.last_arrival("a") == 100.0
    assert idle_threshold_from_gaps([25.0, 69.0], quantile=0.5) == pytest.approx(47.0)
    assert idle_threshold_from_gaps([], floor_s=12.0) == 12.0
    assert idle_threshold_from_gaps([1.0, 2.0], floor_s=12.0) == 12.0


def test_bad_input_raises_named_errors():
    with pytest.raises(InvalidKnobError):
        RateEstimator(window_s=0)
    with pytest.raises(InvalidKnobError):
        idle_threshold_from_gaps([1.0], quantile=2.0)
    est = RateEstimator()
    est.observe("a", 5.0)
    with pytest.raises(InvalidSnapshotError):
        est.observe("a", 4.0)


def test_seasonal_forecast_repeats_last_period_and_corrects_with_recent_errors():
    # windows of 10 s, a "day" of 4 windows: 0, 20, 0, 20 arrivals, repeated
    f = SeasonalForecaster(10.0, period_s=40.0, num_periods=2, lookback=4)
    f.start("m", 0.0)
    assert f.rate("m", 5.0) is None, "no complete window yet"
    pattern = [0, 20, 0, 20]
    for w in range(8):
        for k in range(pattern[w % 4]):
            f.observe("m", w * 10.0 + k * 0.4)
    # window 8 (t=80..90) repeats window 4 and 0 (0 arrivals); errors of the last period were 0
    assert f.rate("m", 85.0) == pytest.approx(0.0)
    # window 9 (nothing arrived in window 8, as forecast): seasonal 20, so 2 req/s, which a
    # persistence forecast (0 in window 8) would have missed
    assert f.rate("m", 95.0) == pytest.approx(2.0)


def test_forecast_reads_the_same_within_a_window():
    f = SeasonalForecaster(window_s=10.0)
    f.start("a", 0.0)
    for t in (1.0, 2.0, 12.0):
        f.observe("a", t)
    assert (f.window(19.9), f.window(20.0)) == (1, 2)
    assert f.rate("a", 20.0) == f.rate("a", 29.9)


def test_forecast_without_a_past_period_is_persistence_plus_trend():
    f = SeasonalForecaster(10.0, period_s=1000.0, lookback=3)
    f.start("m", 0.0)
    for w, n in enumerate([5, 10, 15]):
        for k in range(n):
            f.observe("m", w * 10.0 + k * 0.5)
    # seasonal fallback: the last window (15); errors of windows 1 and 2 against their own last
    # window: +5 and +5 -> correction +5, so 20 arrivals in window 3
    assert f.rate("m", 31.0) == pytest.approx(2.0)
    assert f.rate("never-seen", 31.0) is None
    with pytest.raises(InvalidKnobError):
        SeasonalForecaster(0.0)
    with pytest.raises(InvalidKnobError):
        SeasonalForecaster(10.0, period_s=5.0)


def test_history_at_a_placement_is_the_time_since_the_model_was_first_seen():
    est = RateEstimator(window_s=60.0)
    assert est.history_at("m", 5.0) == 0.0 and est.history_at("m", None) is None
    est.observe("m", 10.0)
    est.observe("m", 50.0)
    assert est.history_at("m", 40.0) == 30.0
    assert est.history_at("m", 5.0) == 0.0  # placed before it was ever seen: blind
    est.start("n", 20.0)
    assert est.history_at("n", 25.0) == 5.0
