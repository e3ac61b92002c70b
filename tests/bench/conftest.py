from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stub():
    """The stub OpenAI-compatible endpoint (tests/bench/stub_server.py), one per test module."""
    from .stub_server import StubEndpoint

    endpoint = StubEndpoint().start()
    try:
        yield endpoint
    finally:
        endpoint.stop()


@pytest.fixture
def fresh_stub(stub):
    stub.reset()
    return stub
