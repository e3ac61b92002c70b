"""The control plane: pure placement and admission policy (no I/O, no clock, no threads).

See README.md in this directory for the layers, the KVPR formula and how the runtime and the
simulator call it.
"""

from prism_serve.control.admission import DeadlineQueue, moore_hodgson
from prism_serve.control.forecast import RateEstimator, idle_threshold_from_gaps
from prism_serve.control.placement import DeviceBudget, Part, PlacementResult, kvpr, place_parts
from prism_serve.control.policies import POLICIES, Knobs, Policy, PolicyMemo, get_policy, knobs_for
from prism_serve.control.prefix_index import PrefixIndex
from prism_serve.control.queues import FifoQueue, GroupQueue, RequestQueue, RoundRobinQueue
from prism_serve.control.types import (
    PREFIX_BLOCK_TOKENS,
    Action,
    Activate,
    ClusterSnapshot,
    ControlError,
    Defer,
    DeviceSnapshot,
    Dispatch,
    EngineSnapshot,
    Enqueue,
    Evict,
    InvalidKnobError,
    InvalidSnapshotError,
    Migrate,
    ModelProfile,
    ModelSnapshot,
    ModelState,
    Origin,
    Priority,
    Reject,
    RejectReason,
    Request,
    SetKVQuota,
    UnknownPolicyError,
)

__all__ = [
    "POLICIES",
    "PREFIX_BLOCK_TOKENS",
    "Action",
    "Activate",
    "ClusterSnapshot",
    "ControlError",
    "DeadlineQueue",
    "Defer",
    "DeviceBudget",
    "DeviceSnapshot",
    "Dispatch",
    "EngineSnapshot",
    "Enqueue",
    "Evict",
    "FifoQueue",
    "GroupQueue",
    "InvalidKnobError",
    "InvalidSnapshotError",
    "Knobs",
    "Migrate",
    "ModelProfile",
    "ModelSnapshot",
    "ModelState",
    "Origin",
    "Part",
    "PlacementResult",
    "Policy",
    "PolicyMemo",
    "PrefixIndex",
    "Priority",
    "RateEstimator",
    "Reject",
    "RejectReason",
    "Request",
    "RequestQueue",
    "RoundRobinQueue",
    "SetKVQuota",
    "UnknownPolicyError",
    "get_policy",
    "idle_threshold_from_gaps",
    "knobs_for",
    "kvpr",
    "moore_hodgson",
    "place_parts",
]
