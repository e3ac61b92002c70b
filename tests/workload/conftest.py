from __future__ import annotations

import pytest

from .trace_data import TraceSet, find_traces


@pytest.fixture(scope="session")
def traces() -> TraceSet:
    """The full traces when present, else the committed excerpts: these tests never skip for want
    of trace files."""
    return find_traces()
