"""The policy registry: the runtime and the simulator pick a policy by name from the config.

    policy = get_policy("prism", migration_threshold=0.1)
    queues = {d: policy.new_queue(d) for d in devices}

``POLICIES`` maps each name to its class; ``knobs_for(name)`` is the typed dataclass the config layer
maps its YAML onto.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from prism_serve.control.policies.base import Knobs, Policy, PolicyMemo
from prism_serve.control.policies.dedicated import DedicatedKnobs, DedicatedPolicy
from prism_serve.control.policies.muxserve import MuxServeKnobs, MuxServePolicy
from prism_serve.control.policies.prism import PrismKnobs, PrismPolicy
from prism_serve.control.policies.qlm import QLMKnobs, QLMPolicy
from prism_serve.control.policies.static_partition import StaticPartitionKnobs, StaticPartitionPolicy
from prism_serve.control.types import InvalidKnobError, UnknownPolicyError

__all__ = [
    "POLICIES",
    "DedicatedKnobs",
    "DedicatedPolicy",
    "Knobs",
    "MuxServeKnobs",
    "MuxServePolicy",
    "Policy",
    "PolicyMemo",
    "PrismKnobs",
    "PrismPolicy",
    "QLMKnobs",
    "QLMPolicy",
    "StaticPartitionKnobs",
    "StaticPartitionPolicy",
    "get_policy",
    "knobs_for",
]

POLICIES: Mapping[str, type[Policy]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (PrismPolicy, DedicatedPolicy, StaticPartitionPolicy, MuxServePolicy, QLMPolicy)
    }
)


def knobs_for(name: str) -> type[Knobs]:
    return _lookup(name).knobs_type


def get_policy(name: str, **knobs: object) -> Policy:
    """The policy registered as ``name`` with ``knobs`` (every other knob at its default)."""
    cls = _lookup(name)
    try:
        typed = cls.knobs_type(**knobs)
    except TypeError as exc:
        known = ", ".join(f.name for f in cls.knobs_type.__dataclass_fields__.values())
        raise InvalidKnobError(f"policy {name!r}: {exc}; its knobs are: {known}") from exc
    return cls(typed)


def _lookup(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
