"""Helpers every benchmark script shares: the machine line and quiet-CPU measurement.

On a shared machine other processes distort CPU timings badly (two torch threads on two cores slow
down many times over when a third process competes). Measurements wait for the CPUs to be quiet and
record the CPU time other processes used meanwhile ("other load", in cores, from /proc/stat).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from prism_serve.engine.machine import cpu_model, cpu_seconds, native_bf16, vector_flags

REPO_ROOT = Path(__file__).resolve().parents[1]


def machine_info(**extra: str) -> dict:
    """The CPU model and vector flags (whether bf16 matmuls are native: dtype auto), cores, torch and
    Python versions, and ``extra``; ``line`` is all of it on one line for a benchmark's output."""
    extra = {"flags": vector_flags(), "native bf16": "yes" if native_bf16() else "no", **extra}
    m = {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        **extra,
    }
    m["line"] = (
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
        + "".join(f"{k} {v}, " for k, v in extra.items())
        + f"Python {m['python']}"
    )
    return m


def other_load_since(start: tuple[float, float], wall: float) -> float:
    """Cores other processes kept busy since ``start`` (a ``cpu_seconds()`` reading) over ``wall`` s."""
    busy, own = cpu_seconds()
    return max(0.0, (busy - start[0] - (own - start[1])) / max(wall, 1e-9))


def wait_quiet(limit_s: float, threshold: float) -> None:
    """Wait (up to ``limit_s``) until other processes use fewer than ``threshold`` cores."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        start = cpu_seconds()
        time.sleep(0.5)
        if other_load_since(start, 0.5) < threshold:
            return


def vllm_server_python() -> Path:
    """The Python of the full vLLM CPU build's venv (.venv-vllm-server), set up first if it is
    missing or stale (scripts/vllm-server-env.sh: once, about 100 s and 3.5 GiB)."""
    import subprocess

    subprocess.run(["bash", str(REPO_ROOT / "scripts" / "vllm-server-env.sh")], check=True)
    return REPO_ROOT / ".venv-vllm-server" / "bin" / "python"
