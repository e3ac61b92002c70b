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

__all__ = ["ServerStartError", "free_port", "start_server_process", "stop_server_process", "wait_answering"]


class ServerStartError(PrismError):
    """The server process exited or did not become healthy in time (the message has its log tail)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(
    config: Path,
    port: int,
    log: Path,
    *,
    log_level: str = "warning",
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``prism serve --config config --port port`` (output to ``log``, ``env`` added to this
    process's environment) and return once ``/health`` answers 200."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prism_serve.cli", "serve", "--config", str(config), "--port", str(port),
         "--log-level", log_level],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )  # fmt: skip
    why = wait_answering(proc, f"http://127.0.0.1:{port}/health", timeout_s)
    if why is None:
        return proc
    proc.kill()
    raise ServerStartError(f"prism serve {why}:\n{log.read_text()[-4000:]}")


def wait_answering(proc: subprocess.Popen, url: str, timeout_s: float) -> str | None:
    """Poll ``url`` until it answers 200 (None), or say why not: the server process exited, or it
    did not answer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return f"did not answer {url} in {timeout_s} s"


def stop_server_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM, then wait: uvicorn shuts down gracefully and re-raises the signal, so a clean stop
    returns 0 or -SIGTERM. Killed (and TimeoutExpired raised) if it does not end in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
