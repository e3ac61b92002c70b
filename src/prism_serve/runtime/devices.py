"""Devices the runtime places models on: CUDA GPUs, or CPU "devices" (cpu:0, cpu:1, ...) that each
own a memory budget and a set of cores, so multi-device placement runs for real on one CPU machine.

A CPU device's workers are pinned to its cores (``sched_setaffinity``) with one torch thread per
core, so two devices' engines do not fight over the same cores (OpenMP barriers make a step 5-30x
slower when another process competes for its cores).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from prism_serve.control.placement import node_of
from prism_serve.engine.machine import pin_to_cores
from prism_serve.errors import InvalidRequestError
from prism_serve.memory.vmm import format_size, parse_size

# "cpu:0", "cuda:1", or on a multi-node deployment "<node>/cpu:0" (runtime/cluster.py)
_DEVICE_RE = re.compile(r"^(?:([A-Za-z0-9_.-]+)/)?(cpu|cuda):(\d+)$")


class DeviceConfigError(InvalidRequestError):
    """A device name, budget or core list is invalid."""


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str  # "cpu:0" or "cuda:0"; "<node>/cpu:0" for a device of another node (runtime/cluster.py)
    memory_bytes: int  # the budget every model on the device shares (weights + KV)
    cores: tuple[int, ...]  # CPU devices: the cores its workers run on; () = all
    num_workers: int  # pre-started engine processes (the engine pool; the config's default: 2)

    def __post_init__(self) -> None:
        if not _DEVICE_RE.match(self.name):
            raise DeviceConfigError(f"device name {self.name!r} must look like cpu:0 or cuda:0")
        if self.memory_bytes <= 0:
            raise DeviceConfigError(f"{self.name}: memory budget must be positive")
        if self.num_workers < 1:
            raise DeviceConfigError(f"{self.name}: num_workers must be >= 1")
        if self.is_cuda and self.cores:
            raise DeviceConfigError(f"{self.name}: cores apply to cpu devices only")
        if self.node:
            return  # another machine's cores: its node agent checked them there
        available = os.sched_getaffinity(0)
        bad = [c for c in self.cores if c not in available]
        if bad:
            raise DeviceConfigError(
                f"{self.name}: cores {bad} are not available to this process (have {sorted(available)})"
            )

    @property
    def node(self) -> str:
        """The node this device belongs to ("" for a device of this machine's own deployment)."""
        return node_of(self.name)

    @property
    def local_name(self) -> str:
        """The name on its own machine ("cpu:0"): what its workers, ledger and torch call it."""
        return self.name.rpartition("/")[2]

    @property
    def is_cuda(self) -> bool:
        return self.local_name.startswith("cuda")

    @property
    def num_threads(self) -> int:
        return len(self.cores) or len(os.sched_getaffinity(0))

    def describe(self) -> str:
        cores = f", cores {','.join(map(str, self.cores))}" if self.cores else ""
        return f"{self.name} ({format_size(self.memory_bytes)}{cores}, {self.num_workers} workers)"


def parse_cores(value: str | Sequence[int]) -> tuple[int, ...]:
    """``"0-3,6"`` or ``[0, 1]`` -> (0, 1, 2, 3, 6)."""
    if not isinstance(value, str):
        return tuple(int(c) for c in value)
    cores: list[int] = []
    for part in filter(None, value.replace(" ", "").split(",")):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise DeviceConfigError(f"bad core list {value!r}; use e.g. 0-3,6")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cores)


def cpu_devices(num_devices: int, memory_per_device: int | str, num_workers: int) -> list[DeviceSpec]:
    """``num_devices`` CPU devices splitting this process's cores evenly (a device gets at least one
    core; with more devices than cores, devices share cores round-robin)."""
    if num_devices < 1:
        raise DeviceConfigError("need at least one device")
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // num_devices)
    out = []
    for i in range(num_devices):
        mine = cores[i * share : (i + 1) * share] if len(cores) >= num_devices else [cores[i % len(cores)]]
        out.append(DeviceSpec(f"cpu:{i}", parse_size(memory_per_device), tuple(mine), num_workers))
    return out


def pin_process(spec: DeviceSpec) -> None:
    """Run this process on ``spec``'s cores with one torch thread per core (CPU devices), or make
    its GPU current (CUDA devices)."""
    import torch

    if spec.is_cuda:
        torch.cuda.set_device(torch.device(spec.local_name))
        return
    if spec.cores:
        pin_to_cores(spec.cores)
    else:
        torch.set_num_threads(spec.num_threads)
