"""The policy registry: names, typed knobs, named errors."""

from __future__ import annotations

import dataclasses

import pytest

from prism_serve.control import (
    POLICIES,
    InvalidKnobError,
    Policy,
    RequestQueue,
    UnknownPolicyError,
    get_policy,
    knobs_for,
)
from prism_serve.control.policies import PrismKnobs, PrismPolicy
from prism_serve.errors import PrismError


def test_every_policy_of_the_issue_is_registered():
    assert set(POLICIES) == {"prism", "dedicated", "static-partition", "muxserve", "qlm"}
    for name, cls in POLICIES.items():
        policy = get_policy(name)
        assert isinstance(policy, cls) and isinstance(policy, Policy) and policy.name == name
        assert isinstance(policy.new_queue("d0"), RequestQueue)
        assert dataclasses.is_dataclass(knobs_for(name)) and isinstance(policy.knobs, knobs_for(name))


def test_knobs_are_typed_frozen_and_validated():
    p = get_policy("prism", migration_threshold=0.2, abort_on_miss=True)
    assert isinstance(p, PrismPolicy) and p.knobs == PrismKnobs(migration_threshold=0.2, abort_on_miss=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.knobs.migration_threshold = 1.0  # type: ignore[misc]
    with pytest.raises(InvalidKnobError, match="migration_threshold"):
        get_policy("prism", migration_threshold=-1.0)
    with pytest.raises(InvalidKnobError, match="its knobs are"):
        get_policy("qlm", no_such_knob=1)
    with pytest.raises(InvalidKnobError):
        get_policy("muxserve", low_util=0.9, high_util=0.5)
    with pytest.raises(InvalidKnobError):
        PrismPolicy(knobs_for("qlm")())


def test_unknown_policy_is_a_named_error():
    with pytest.raises(UnknownPolicyError, match="choose one of") as err:
        get_policy("round-robin")
    assert isinstance(err.value, PrismError)


def test_registry_cannot_be_modified():
    with pytest.raises(TypeError):
        POLICIES["mine"] = PrismPolicy  # type: ignore[index]
