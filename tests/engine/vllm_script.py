"""Running a test's script in vLLM's own environment (.venv-vllm-server: vLLM cannot share the
test venv) with this checkout's source on its path, and reading back the one result it prints."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.api.test_vllm_server import VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[2]


def run_vllm_script(script: str, *args: str, timeout_s: float = 600) -> dict:
    """Run ``script`` under vLLM's Python with ``args``; the JSON of its last ``RESULT `` line."""
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: run scripts/vllm-server-env.sh"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))
