"""`prism serve` as a child process, for tests, benchmarks and scripts that need a real server:
pick a free port, start it, wait until /health answers, stop it with SIGTERM (graceful)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from prism_serve.errors import PrismError

__all__ = ["ServerStartError", "free_port", "start_server_process", "stop_server_process"]


class ServerStartError(PrismError):
    """The server process exited or did not become healthy in time (the message has its log tail)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(
    config: Path, port: int, log: Path, *, log_level: str = "warning", timeout_s: float = 300.0
) -> subprocess.Popen:
    """Start ``prism serve --config config --port port`` (output to ``log``) and return once
    ``/health`` answers 200."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prism_serve.cli", "serve", "--config", str(config), "--port", str(port),
         "--log-level", log_level],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"prism serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise ServerStartError(f"prism serve did not become healthy in {timeout_s} s:\n{log.read_text()[-4000:]}")


def stop_server_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM, then wait: uvicorn shuts down gracefully and re-raises the signal, so a clean stop
    returns 0 or -SIGTERM. Killed (and TimeoutExpired raised) if it does not end in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
