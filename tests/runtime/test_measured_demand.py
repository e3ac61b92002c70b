"""What the live controller takes as a model's compute demand: each engine step as it would take
alone (the worker's CPU-timed busy seconds), not its wall time, which on a shared core also holds
the slices its neighbours ran in (the policies add that contention for a placement themselves)."""

from __future__ import annotations

import pytest

from prism_serve.control.profiles import MIN_SERVED_FOR_PROFILE, size_prior
from prism_serve.control.types import ModelProfile, ModelSnapshot
from prism_serve.runtime import messages as msg
from prism_serve.runtime.models import ModelSpec
from prism_serve.runtime.state import ModelEntry


def _stats(step_s: float, busy_s: float) -> msg.EngineStats:
    return msg.EngineStats(
        num_running=0, num_waiting=0, used_kv_bytes=0, mapped_kv_bytes=0, weight_bytes=0,
        step_seconds=step_s, cpu_seconds=busy_s, busy_seconds=busy_s,
    )  # fmt: skip


def test_the_profile_counts_steps_as_they_take_alone_over_every_activation():
    entry = ModelEntry(ModelSpec("m", max_model_len=1024), cached=None, tokenizer=None, max_model_len=1024)
    # first activation: 6 s of wall time in steps, of which the engine had its core for 3 s
    first = [_stats(2.0, 1.0), _stats(6.0, 3.0)]
    entry.count_engine_time(None, first[0])
    entry.count_engine_time(first[0], first[1])
    # a second activation starts its counters again from zero
    entry.count_engine_time(None, _stats(2.0, 2.0))
    entry.num_served = 2 * MIN_SERVED_FOR_PROFILE
    assert entry.step_seconds == 8.0 and entry.busy_seconds == 5.0
    assert entry.profile().busy_s_per_request == 5.0 / entry.num_served


def test_before_it_is_measured_a_model_costs_in_proportion_to_its_weights():
    """The prior scales the defaults by weight bytes over the deployment's mean: a model with four
    times the weights is predicted four times as busy at the same rate, until its engine has served
    enough requests to be measured, when the measurement replaces the prior."""
    mean = 500e6
    small, large = size_prior(250_000_000, mean), size_prior(1_000_000_000, mean)
    assert large.service_s == pytest.approx(4 * small.service_s)
    assert size_prior(500_000_000, mean) == ModelProfile()  # the mean model keeps the defaults
    rate = 0.02  # one request in the rate window, as after a warm-up
    big = ModelSnapshot("big", rate, 1.0, 0.2, 1_000_000_000, 1000, profile=large)
    little = ModelSnapshot("little", rate, 1.0, 0.2, 250_000_000, 1000, profile=small)
    assert big.busy > 3 * little.busy
    entry = ModelEntry(ModelSpec("m", max_model_len=1024), cached=None, tokenizer=None, max_model_len=1024)
    assert entry.profile(large) is large  # nothing measured yet
    entry.count_engine_time(None, _stats(2.0, 2.0))
    entry.num_served = MIN_SERVED_FOR_PROFILE
    assert entry.profile(large).busy_s_per_request == 2.0 / MIN_SERVED_FOR_PROFILE
