from __future__ import annotations

import pytest

from ..workload.trace_data import TraceSet, find_traces


@pytest.fixture(scope="session")
def traces() -> TraceSet:
    """The full traces when present, else the committed excerpts (tests/data/traces)."""
    return find_traces()
