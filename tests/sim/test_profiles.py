"""What the simulated policies know of a model's compute demand (SimConfig.profiles): the cost
model's profile, or the live controller's rule (control.profiles.measured_profile over the simulated engine's
step seconds and requests served, the default profile before)."""

from __future__ import annotations

import numpy as np
import pytest

from prism_serve.control import ModelProfile
from prism_serve.control.profiles import MIN_SERVED_FOR_PROFILE, measured_profile
from prism_serve.sim import SimConfig
from prism_serve.sim.errors import SimConfigError
from prism_serve.sim.simulator import Simulator
from prism_serve.workload import Workload

from .helpers import loose, served


def _sim(profiles: str, n: int) -> Simulator:
    """``n`` requests of one model, 10 s apart: each alone on an engine that is already loaded."""
    ms = [served("a", "llama-3.2-1b")]
    w = Workload(np.arange(n) * 10.0, np.zeros(n, int), np.full(n, 300), np.full(n, 20), ["a"])
    cfg = SimConfig(num_devices=1, policy="static-partition", profiles=profiles)
    sim = Simulator(ms, w, loose(ms), cfg)
    sim.requests = sim.run().requests
    return sim


def test_measured_profile_replaces_the_prior_after_enough_requests():
    prior = ModelProfile(mean_prompt_tokens=100.0, max_rate=3.0)
    assert measured_profile(prior, 5.0, MIN_SERVED_FOR_PROFILE - 1) is prior
    assert measured_profile(prior, 0.0, 10) is prior
    p = measured_profile(prior, 2.0, 8)
    assert p.busy_s_per_request == 0.25 and p.max_rate == 4.0 and p.mean_prompt_tokens == 100.0


def test_live_profiles_measure_the_simulated_engine():
    sim = _sim("live", 6)
    m = sim.models["a"]
    assert m.num_served == 6
    # each request ran alone: the engine stepped from its arrival to its finish
    assert m.step_seconds == pytest.approx(sum(r.finish - r.arrival for r in sim.requests), rel=1e-6)
    profile = sim.snapshots.model(m, 100.0).profile
    assert profile.busy_s_per_request == pytest.approx(m.step_seconds / 6)
    # every decode step had one sequence: how the step grows with the batch is unknown, and so is
    # what one replica could serve by batching (no replica is asked for on that evidence)
    assert m.steps.steps > 0 and m.steps.batch == m.steps.steps and m.steps.fit() is None
    assert profile.max_rate is None


def test_live_profiles_fit_the_step_time_of_a_batching_engine_and_credit_the_batching():
    """Requests that overlap batch their decode steps: the fit of step time against the batch
    follows the cost model, and the capacity a replica is judged by is above the step-seconds
    floor (requests served per second of stepping) by the batching the TPOT SLO leaves room for."""
    ms = [served("a", "llama-3.2-1b")]
    n = 24
    w = Workload(np.arange(n) * 0.02, np.zeros(n, int), np.full(n, 300), np.full(n, 100), ["a"])
    cfg = SimConfig(num_devices=1, policy="static-partition", profiles="live")
    sim = Simulator(ms, w, loose(ms), cfg)
    sim.run()
    m = sim.models["a"]
    fit = m.steps.fit()
    assert fit is not None and m.steps.batch > m.steps.steps  # it batched
    t1, p = fit
    spec = ms[0].spec
    for b in (1, 4):  # the power law is close to the cost model's steps over the batches it saw
        ctx = b * 350
        assert t1 * b**p == pytest.approx(float(sim.cost.decode_steps(spec, 1, b, ctx, 1)[0]), rel=0.25)
    profile = sim.snapshots.model(m, 100.0).profile
    assert profile.max_rate > m.num_served / m.step_seconds


def test_live_profiles_start_from_the_default_and_cost_model_profiles_never_measure():
    few = _sim("live", MIN_SERVED_FOR_PROFILE - 1)
    assert few.snapshots.model(few.models["a"], 100.0).profile == ModelProfile()
    cm = _sim("cost-model", 6)
    m = cm.models["a"]
    assert m.step_seconds > 0  # measured all the same, but the policies see the cost model's
    assert cm.snapshots.model(m, 100.0).profile is m.profile
    assert m.profile.busy_s_per_request is None and m.profile.max_rate is not None


def test_unknown_profiles_are_refused():
    with pytest.raises(SimConfigError, match="profiles"):
        SimConfig(num_devices=1, profiles="oracle")


def test_live_profiles_count_steps_alone_when_engines_share_a_device():
    """Two busy models on one device: each engine's steps stretch by the compute sharing, and the
    measured demand (what a policy adds contention to) is the steps as they take alone."""
    ms = [served("a", "llama-3.2-1b"), served("b", "llama-3.2-1b")]
    n = 40
    w = Workload(np.arange(n) * 0.05, np.arange(n) % 2, np.full(n, 300), np.full(n, 100), ["a", "b"])
    runs = {}
    for sharing in (True, False):
        cfg = SimConfig(num_devices=1, policy="static-partition", profiles="live", compute_sharing=sharing)
        sim = Simulator(ms, w, loose(ms), cfg)
        sim.run()
        runs[sharing] = sim
    shared, apart = runs[True].models["a"], runs[False].models["a"]
    assert shared.step_seconds > 1.5 * shared.busy_seconds  # stretched by its busy neighbour
    assert apart.step_seconds == pytest.approx(apart.busy_seconds)
    profile = runs[True].snapshots.model(shared, 100.0).profile
    assert profile.busy_s_per_request == pytest.approx(shared.busy_seconds / shared.num_served)
