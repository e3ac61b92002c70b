"""The simulator's named errors."""

from __future__ import annotations

from prism_serve.errors import PrismError

__all__ = ["SimConfigError", "SimError", "SimStateError"]


class SimError(PrismError):
    """Base class of the simulator's errors."""


class SimConfigError(SimError, ValueError):
    """A simulation setup is invalid: unknown hardware or model, bad knob, TP wider than the cluster."""


class SimStateError(SimError, RuntimeError):
    """A policy returned an action the simulator cannot apply (a bug in the policy or the simulator)."""
