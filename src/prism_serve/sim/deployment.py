"""A deployment config (the YAML ``prism serve`` reads) as the simulator serves it.

Every model entry becomes a ``ServedModel``: its shape read from its weights' metadata
(sim/shapes.py), at its dtype (``auto``: bf16 on the GPU profiles, this machine's choice on the
CPU ones) and its ``tp``; its SLOs are the entry's ``ttft_slo`` and ``tpot_slo``. The engine knobs
come from the models' ``EngineConfig`` (the simulator has one for every engine: the models must
agree on them, else the first model's are used and a warning says so; on GPU profiles the batch
knobs the config leaves unset are a GPU engine's, ``GPU_ENGINE_DEFAULTS``, not the CPU server's),
the policy and its knobs from the config's ``policy``.

The evaluation setups of the Prism paper are such configs, shipped as presets
(sim/presets/*.yaml): ``prism sim --setup paper-58`` and ``prism plan --config paper-58`` read the
same file through this module.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import msgspec

from prism_serve.config import ConfigError, DeploymentConfig, ModelConfig, load_config, parse_config
from prism_serve.control.types import PLACEMENT_COALESCE_S
from prism_serve.engine.config import GPU_ENGINE_DEFAULTS, EngineConfig
from prism_serve.engine.machine import resolve_dtype
from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.sources import json_object
from prism_serve.memory.kept import default_kept_prefix_bytes
from prism_serve.sim.config import ModelSLO, SimConfig
from prism_serve.sim.errors import SimConfigError
from prism_serve.sim.models import ServedModel
from prism_serve.sim.shapes import shape_of

__all__ = ["PRESETS", "SimDeployment", "deployment_config", "get_setup", "sim_deployment"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_GPU_BATCH = ("max_num_seqs", "max_num_batched_tokens")  # engine/config.py GPU_ENGINE_DEFAULTS
PRESETS = ("paper-8", "paper-18", "paper-58", "cpu-2")


@dataclass(slots=True, frozen=True)
class SimDeployment:
    models: list[ServedModel]
    slos: dict[str, ModelSLO]  # the config's, per model
    engine: EngineConfig  # every simulated engine's knobs
    policy: str
    knobs: tuple[tuple[str, object], ...]
    warnings: tuple[str, ...] = ()
    # LoRA adapters: each adapter's name and its base's. An adapter's requests are its base's load,
    # judged by its base's SLOs (its own TTFT SLO orders the live queue; not modelled here)
    aliases: dict[str, str] = field(default_factory=dict)
    kept_prefix_bytes: int = 0  # the config's policy.kept_prefix_bytes (unset: this host's default)
    placement_coalesce_s: float = PLACEMENT_COALESCE_S  # the config's policy.placement_coalesce_s

    def sim_config(self, num_devices: int, hardware: str, policy: str | None = None) -> SimConfig:
        """A simulation of this deployment on ``num_devices`` of ``hardware``: its engine knobs and
        its policy settings, and its policy's knobs when ``policy`` is its own (None: the
        simulator's default policy, with the deployment's knobs)."""
        return SimConfig(
            num_devices=num_devices, hardware=hardware, engine=self.engine,
            **({} if policy is None else {"policy": policy}),
            knobs=self.knobs if policy is None or policy == self.policy else (),
            kept_prefix_bytes=self.kept_prefix_bytes, placement_coalesce_s=self.placement_coalesce_s,
        )  # fmt: skip


def deployment_config(name_or_path: str | Path) -> DeploymentConfig:
    """A preset's config by name (``paper-58``), else a YAML file's."""
    if str(name_or_path) in PRESETS:
        text = resources.files("prism_serve.sim").joinpath(f"presets/{name_or_path}.yaml").read_text()
        return parse_config(text, f"preset {name_or_path}")
    return load_config(name_or_path)


def sim_deployment(config: DeploymentConfig, gpu: bool = True) -> SimDeployment:
    """``config``'s models, SLOs, engine knobs and policy for simulated devices (``gpu``: a GPU
    profile, where ``dtype: auto`` is bf16; else a CPU profile, where it is what this machine
    runs fast)."""
    models, slos, warnings, aliases = [], {}, [], {}
    by_base = config.adapters_by_base()
    for m in config.served_models():
        dtype = resolve_dtype(m.dtype, "cuda" if gpu else "cpu")
        shape = shape_of(m.name, m.source, _DTYPE_BYTES[dtype])
        adapters = by_base.get(m.name, [])
        slots = config.max_loras(m, by_base)
        if slots:
            params = [_adapter_params(shape.config, a, m.max_lora_rank, warnings) for a in adapters]
            shape = dataclasses.replace(
                shape,
                adapter_slot_bytes=slots * m.max_lora_rank * shape.config.lora_params_per_rank()
                * _DTYPE_BYTES[dtype],
                adapter_params=max(params, default=0),
            )  # fmt: skip
        aliases.update((a.name, m.name) for a in adapters)
        models.append(ServedModel(m.name, shape, m.tp, m.expected_rate))
        slos[m.name] = ModelSLO(m.ttft_slo, m.tpot_slo)
    first = config.models[0]
    engine = first.engine_config("cuda" if gpu else "cpu")
    if gpu:  # a batch knob the config leaves unset is a GPU engine's, as the GPU profiles model it
        unset = [k for k in _GPU_BATCH if k not in first.model_fields_set]
        engine = msgspec.structs.replace(engine, **{k: getattr(GPU_ENGINE_DEFAULTS, k) for k in unset})
    for knob in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        values = sorted({getattr(m, knob) for m in config.served_models()})
        if len(values) > 1:
            warnings.append(f"models differ in {knob} ({values}); the simulator uses {getattr(engine, knob)}")
    knobs = tuple(sorted((k, _hashable(v)) for k, v in config.policy.knobs.items()))
    kept = config.policy.kept_prefix_bytes
    if kept is None:
        kept = default_kept_prefix_bytes()
    return SimDeployment(
        models, slos, engine, config.policy.name, knobs, tuple(warnings), aliases, kept,
        config.policy.placement_coalesce_s,
    )  # fmt: skip


def get_setup(name: str) -> list[ServedModel]:
    """A preset's models, on GPUs (``cpu-2``: on CPUs)."""
    if name not in PRESETS:
        raise SimConfigError(f"unknown setup {name!r}; choose one of {', '.join(PRESETS)}")
    try:
        return sim_deployment(deployment_config(name), gpu=not name.startswith("cpu")).models
    except ConfigError as e:  # a preset that does not parse is a bug of this package
        raise SimConfigError(str(e)) from None


def _hashable(v: object) -> object:
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


def _adapter_params(config: ArchConfig, adapter: ModelConfig, max_rank: int, warnings: list[str]) -> int:
    """One adapter's weights, from its adapter_config.json (rank, target modules); where that is
    not readable here, the most its base's slots allow (max_lora_rank on every projection)."""
    try:
        cfg = json_object(Path(adapter.adapter).expanduser() / "adapter_config.json", ValueError)
        rank = int(cfg["r"])
        targets = cfg.get("target_modules") or ["q_proj", "v_proj"]
        named = targets.__contains__ if isinstance(targets, list) else lambda m: re.search(targets, m)
        modules = [m for m in config.projection_shapes() if named(m)]
        return rank * config.lora_params_per_rank(modules or None)
    except (OSError, ValueError, KeyError, TypeError, re.error):
        warnings.append(
            f"adapter {adapter.name}: its adapter_config.json is not readable here; costed at "
            f"rank {max_rank} on every projection"
        )
        return max_rank * config.lora_params_per_rank()
