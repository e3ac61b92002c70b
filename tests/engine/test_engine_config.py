"""EngineConfig is the one home of the engine knobs' defaults: every layer that mirrors a knob
(deployment config, runtime ModelSpec, simulator) reads it from there."""

from __future__ import annotations

import msgspec
import pytest
import torch

from prism_serve.config import ModelConfig
from prism_serve.engine.config import DTYPE_NAMES, ENGINE_DEFAULTS, GPU_ENGINE_DEFAULTS, EngineConfig
from prism_serve.engine.llm_engine import DTYPES, LLMEngine
from prism_serve.engine.machine import resolve_dtype
from prism_serve.errors import InvalidRequestError
from prism_serve.runtime import messages as msg
from prism_serve.runtime.models import ModelSpec
from prism_serve.sim.config import SimConfig

KNOBS = ("dtype", "seed", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


def test_every_layer_takes_its_engine_defaults_from_engine_config():
    yaml_entry = ModelConfig(name="m")
    spec = ModelSpec("m")
    for knob in KNOBS:
        # the spec resolves dtype auto to what this machine runs (engine/machine.py)
        want = getattr(ENGINE_DEFAULTS, knob)
        assert getattr(yaml_entry, knob) == want, knob
        assert getattr(spec, knob) == (resolve_dtype(want) if knob == "dtype" else want), knob
    assert yaml_entry.source == spec.source == ENGINE_DEFAULTS.model
    sim = SimConfig(num_devices=1)  # simulated GPUs: a GPU engine's batch
    for knob in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        assert getattr(sim, knob) == getattr(GPU_ENGINE_DEFAULTS, knob), knob
    # what the runtime sends a worker is the same struct, filled from the spec
    assert spec.engine_config() == EngineConfig(model="m", dtype=resolve_dtype("auto"))


def test_every_dtype_name_has_a_torch_dtype():
    assert set(DTYPES) == set(DTYPE_NAMES) - {"auto"}
    assert all(resolve_dtype(name) in DTYPES for name in DTYPE_NAMES)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "fp8"}, "dtype must be one of"),
        ({"max_num_seqs": 0}, "max_num_seqs must be positive"),
        ({"block_size": -1}, "block_size must be positive"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be positive"),
    ],
)
def test_bad_knobs_are_named(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        EngineConfig(**kwargs)


def test_engine_config_travels_to_a_worker_as_itself():
    config = ModelSpec("m", max_num_seqs=8, max_model_len=None).engine_config()
    m = msg.ActivateModel("m", "/dev/shm/x", [], 0, {}, "/t", "src", False, config, 0.0)
    decoded = msg.to_worker_decoder().decode(msg.encode(m))
    assert decoded.engine == config and decoded.engine.max_model_len is None
    bad = msgspec.msgpack.encode(msgspec.structs.replace(m, engine=EngineConfig(dtype="float32")))
    bad = bad.replace(b"float32", b"float64")  # a dtype no engine has: refused when decoded
    with pytest.raises(msgspec.ValidationError, match="dtype must be one of"):
        msg.to_worker_decoder().decode(bad)


def test_device_names_are_checked_and_a_missing_gpu_is_a_named_error(smollm):
    for bad in ("gpu", "cuda:x", "cpu0", "tpu:0"):
        with pytest.raises(InvalidRequestError, match="device must be"):
            EngineConfig(device=bad)
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (cuda:0 on a CPU machine)
    with pytest.raises(InvalidRequestError, match="CUDA devices"):
        LLMEngine(EngineConfig(dtype="float32", device=absent), weights=smollm)
