from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ imported as a module (registered under its name, as the scripts import
    each other)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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
