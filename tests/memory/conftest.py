from __future__ import annotations

import uuid

import pytest

from prism_serve.memory.ledger import NAMESPACE_ENV, DeviceLedger, ledger_dir


@pytest.fixture
def namespace(monkeypatch: pytest.MonkeyPatch):
    """A ledger namespace of this test alone (also for its child processes); files removed after."""
    ns = f"test{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv(NAMESPACE_ENV, ns)
    yield ns
    for p in ledger_dir().glob(f"prism-ledger-{ns}-*"):
        p.unlink()


@pytest.fixture
def make_ledger(namespace: str):
    """Open (creating) the ledger of a device in the test's namespace; closed after the test."""
    opened: list[DeviceLedger] = []

    def make(device: str = "cpu:0", budget_bytes: int | None = None) -> DeviceLedger:
        ledger = DeviceLedger(device, budget_bytes, namespace=namespace)
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        ledger.close()
