"""From the deployment config (config.py, user-facing pydantic) to the runtime's own types.

config.py validates what the user wrote and knows nothing of the runtime; this module is the one
place that turns it into ``DeviceSpec``s, ``ModelSpec``s and a ``Controller``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from prism_serve.config import ConfigError, DeploymentConfig, DeviceConfig, DeviceGroup, ModelConfig
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.devices import DeviceSpec, cpu_devices, parse_cores
from prism_serve.runtime.models import ModelSpec

__all__ = ["build_controller", "device_specs", "model_spec", "model_specs"]


def device_specs(config: DeploymentConfig) -> list[DeviceSpec]:
    """The configured devices; a device group splits this machine's cores evenly."""
    return local_devices(config.devices)


def local_devices(devices: list[DeviceConfig] | DeviceGroup) -> list[DeviceSpec]:
    """A ``devices`` section as the machine that runs this builds it (on a Ray cluster every node
    agent calls this on its own machine)."""
    if isinstance(devices, DeviceGroup):
        return cpu_devices(devices.count, devices.memory, devices.workers)
    return [
        DeviceSpec(d.name, d.memory, parse_cores(d.cores) if d.cores is not None else (), d.workers)
        for d in devices
    ]


def model_spec(m: ModelConfig, device_kind: str = "cpu", max_loras: int = 0) -> ModelSpec:
    """One configured model as the runtime serves it (``dtype: auto`` resolved for ``device_kind``:
    bf16 on GPUs, the CPU's fast type on CPU devices; ``max_loras`` adapter slots). What the live
    runtime cannot serve (prism plan and prism sim still can) is a ConfigError naming the model."""
    if m.tp > 1 and m.engine == "vllm":
        raise ConfigError(
            f"model {m.name}: tp: {m.tp} with engine: vllm: vLLM's tensor parallel executor runs its "
            "own workers and memory, not prism's; use tp: 1, or the built-in engine"
        )
    if m.tp > 1 and max_loras:
        raise ConfigError(f"model {m.name}: a tensor parallel model cannot have LoRA adapters yet")
    return ModelSpec(
        name=m.name, source=m.source, engine=m.engine_config(device_kind, max_loras), ttft_slo=m.ttft_slo,
        tpot_slo=m.tpot_slo, pinned=m.pinned, kv_limit_bytes=m.kv_limit, keep_alive_s=m.keep_alive,
        engine_kind=m.engine, sampling=tuple(sorted(m.sampling_defaults().items())), tp=m.tp,
        pooled=m.pooling_task(), expected_rate=m.expected_rate,
    )  # fmt: skip


def model_specs(config: DeploymentConfig) -> list[ModelSpec]:
    """The configured models; on a deployment of GPUs alone ``dtype: auto`` is bf16 (the host cache
    holds one copy per model, so a deployment that mixes CPUs and GPUs resolves it for the CPUs)."""
    devices = device_specs(config)
    kind = "cuda" if devices and all(d.is_cuda for d in devices) else "cpu"
    bases = config.adapters_by_base()
    return [model_spec(m, kind, config.max_loras(m, bases)) for m in config.served_models()]


def vllm_python(config: DeploymentConfig) -> str | None:
    """The Python vLLM workers start with, when some model runs on vLLM: ``vllm_python`` from the
    config, else $PRISM_VLLM_PYTHON, else ``.venv-vllm-server/bin/python`` here (what
    scripts/vllm-server-env.sh makes). None when no model needs one."""
    if not any(m.engine == "vllm" for m in config.models):
        return None
    for candidate in (config.vllm_python, os.environ.get("PRISM_VLLM_PYTHON")):
        if candidate:
            if not Path(candidate).expanduser().is_file():
                raise ConfigError(f"vllm_python: {candidate} is not a file")
            return str(Path(candidate).expanduser())
    default = Path(".venv-vllm-server/bin/python")
    if default.is_file():
        return str(default.absolute())
    raise ConfigError(
        "a model has engine: vllm, but no Python with vLLM is configured: set vllm_python (or "
        "PRISM_VLLM_PYTHON), or run scripts/vllm-server-env.sh to make .venv-vllm-server"
    )


def build_controller(config: DeploymentConfig) -> Controller:
    """The controller that serves ``config`` (not started). With ``ray`` set it joins the Ray
    cluster and starts a node agent on every node first (runtime/cluster.py)."""
    nodes, devices = None, None
    if config.ray is not None:
        from prism_serve.runtime.cluster import RayNodes

        nodes = RayNodes(
            config.ray.address,
            functools.partial(local_devices, config.devices),
            config.server.namespace,
            poll_interval_s=config.ray.poll_interval_s,
        )
        devices = nodes.connect()
    return Controller(
        devices if devices is not None else device_specs(config),
        model_specs(config),
        config.policy,
        namespace=config.server.namespace,
        nodes=nodes,
        vllm_python=vllm_python(config),
        vllm_compile=config.vllm_compile,
        adapters=[(a.name, a.base, a.adapter, a.ttft_slo, a.tpot_slo) for a in config.adapters()],
    )
