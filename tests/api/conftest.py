"""A real `prism serve` process for the API tests: real SmolLM2 weights under two names plus a
synthetic-weight model, two CPU devices, API and admin keys, its own ledger/cache namespace and
batch-lane state directory."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from prism_serve.api.process import free_port, start_server_process, stop_server_process
from prism_serve.memory.ledger import DeviceLedger, LedgerSnapshot
from tests.peft_adapters import make_adapter, merged_texts

API_KEY = "sk-test-key"
ADMIN_KEY = "admin-test-key"


@dataclass
class ServerProcess:
    url: str
    namespace: str
    proc: subprocess.Popen
    log: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(tmp: Path, config_text: str, timeout_s: float = 180.0) -> ServerProcess:
    port = free_port()
    namespace = f"apitest-{uuid.uuid4().hex[:8]}"
    config = tmp / "prism.yaml"
    config.write_text(
        config_text.replace("{namespace}", namespace).replace("{state_dir}", str(tmp / "state"))
    )
    log = tmp / "server.log"
    proc = start_server_process(config, port, log, log_level="info", timeout_s=timeout_s)
    return ServerProcess(f"http://127.0.0.1:{port}", namespace, proc, log)


def ledger_snapshot(server: ServerProcess, device: str = "cpu:0") -> LedgerSnapshot:
    """The server's device ledger as it is now, read from this process (opened and closed again:
    a ledger holds a descriptor for its file and one per process in it)."""
    ledger = DeviceLedger(device, namespace=server.namespace)
    try:
        return ledger.snapshot()
    finally:
        ledger.close()


class LedgerWatch:
    """Samples the device ledger every 10 ms while a block runs: each entry's peak mapped bytes, its
    peak held bytes (mapped less what its prefix cache would give back), and the peak of all (the
    budget must hold at every sample)."""

    def __init__(self, server: ServerProcess) -> None:
        self.ledger = DeviceLedger("cpu:0", namespace=server.namespace)
        self.peak: dict[str, int] = {}
        self.peak_held: dict[str, int] = {}
        self.peak_used = 0
        self._stop = threading.Event()

    def sample(self) -> None:
        snap = self.ledger.snapshot()
        for e in snap.entries:
            self.peak[e.name] = max(self.peak.get(e.name, 0), e.mapped_bytes)
            held = e.mapped_bytes - e.reclaimable_bytes
            self.peak_held[e.name] = max(self.peak_held.get(e.name, 0), held)
        self.peak_used = max(self.peak_used, snap.used_bytes)
        self.budget = snap.budget_bytes

    def __enter__(self) -> LedgerWatch:
        def loop() -> None:
            while not self._stop.is_set():
                self.sample()
                time.sleep(0.01)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.ledger.close()
        assert self.peak_used <= self.budget, "the ledger granted more than the device's budget"


def shm_files(namespace: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if namespace in f]


# The real models run in float32: tests compare outputs across batch shapes (choice 0 of n=3 with
# n=1, streamed with not), which bf16 matmuls (dtype auto on a CPU with native bf16) do not keep equal.
CONFIG = """
devices:
  - {{name: "cpu:0", memory: 2GiB, cores: "0", workers: 1}}
  - {{name: "cpu:1", memory: 2GiB, cores: "{core1}", workers: 1}}
models:
  - {{name: smol, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: smol-b, dtype: float32, max_model_len: 8192, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: tiny, source: "random:smollm2-135m", max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0,
     sampling: {{temperature: 0.0, max_tokens: 6}}}}
policy: {{name: prism}}
server:
  api_keys: [{api_key}]
  admin_key: {admin_key}
  max_waiting_requests: 3
  max_request_bytes: 2MiB
  namespace: "{{namespace}}"
  state_dir: "{{state_dir}}"
"""


def default_test_config() -> str:
    cores = sorted(os.sched_getaffinity(0))
    return CONFIG.format(core1=cores[-1], api_key=API_KEY, admin_key=ADMIN_KEY)


def stop_clean(srv: ServerProcess) -> None:
    """Stop a test's server and check it went cleanly: a graceful exit (uvicorn re-raises SIGTERM
    after shutting down: status -15), no traceback in its log, no shared memory left behind."""
    code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()
    assert shm_files(srv.namespace) == [], "shared memory left behind after shutdown"


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tmp_path_factory.mktemp("serve"), default_test_config())
    yield srv
    stop_clean(srv)
    assert "stopped: workers ended, shared memory released" in srv.log_text()


# The adapter tests' prompt and greedy length (test_adapters.py, test_vllm_adapters.py)
LORA_PROMPT = "The three most useful things to pack for a hike are"
LORA_TOKENS = 10


@pytest.fixture(scope="package")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory, smollm_hf: Path) -> dict[str, Path]:
    """The base (the real SmolLM2 as an HF directory) and two PEFT adapters of it, ranks 8 and 16
    over different modules, made once for the package's adapter tests on both engines
    (test_adapters.py, test_vllm_adapters.py; each adds its own): each takes seconds to make."""
    root = tmp_path_factory.mktemp("adapters")
    mlp = ["gate_proj", "up_proj", "down_proj"]
    return {
        "base": smollm_hf,
        "qv": make_adapter(smollm_hf, root / "support-qv", 8, 16, ["q_proj", "v_proj"], seed=1),
        "mlp": make_adapter(smollm_hf, root / "legal-mlp", 16, 32, mlp, seed=2),
    }


@pytest.fixture(scope="package")
def lora_reference(lora_adapters: dict[str, Path], smollm) -> dict[str, str]:
    """Each of ``lora_adapters``' greedy text for LORA_PROMPT (LORA_TOKENS tokens): transformers, with
    peft's adapter merged into the weights (for the base, none); computed once for the package
    (each merge takes seconds). merged_texts checks that they differ."""
    return merged_texts(lora_adapters, smollm, LORA_PROMPT, LORA_TOKENS)
