"""EngineConfig is the one type of the engine knobs and the one home of their defaults: the
deployment config's model entries take their defaults from it and build it, the runtime's ModelSpec
holds it (and mirrors none of its fields), a worker receives it, and the simulator reads it."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from prism_serve.config import ModelConfig, parse_config
from prism_serve.engine.config import DTYPE_NAMES, ENGINE_DEFAULTS, GPU_ENGINE_DEFAULTS, EngineConfig
from prism_serve.engine.llm_engine import DTYPES, LLMEngine
from prism_serve.engine.machine import resolve_dtype
from prism_serve.errors import InvalidRequestError
from prism_serve.runtime import messages as msg
from prism_serve.runtime.build import model_specs
from prism_serve.runtime.models import ModelSpec
from prism_serve.sim.config import SimConfig

KNOBS = ("dtype", "seed", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


def test_every_layer_takes_its_engine_defaults_from_engine_config():
    yaml_entry = ModelConfig(name="m")
    for knob in KNOBS:
        assert getattr(yaml_entry, knob) == getattr(ENGINE_DEFAULTS, knob), knob
    assert yaml_entry.source == ModelSpec("m").source == ENGINE_DEFAULTS.model
    # the config builds the struct; the spec holds it, dtype auto resolved for this machine
    built = EngineConfig(model="m", dtype=resolve_dtype("auto"))
    assert yaml_entry.engine_config() == ModelSpec("m").engine == built
    assert not {f.name for f in dataclasses.fields(ModelSpec)} & set(KNOBS)  # no mirrored knob
    assert SimConfig(num_devices=1).engine == GPU_ENGINE_DEFAULTS  # simulated GPUs: a GPU engine's batch


def test_a_configured_model_reaches_the_runtime_as_one_engine_config():
    text = """
devices: [{name: "cpu:0", memory: 1GiB}]
models:
  - {name: m, dtype: float32, max_model_len: 512, max_num_seqs: 4, block_size: 32, seed: 7,
     max_num_batched_tokens: 256}
"""
    (spec,) = model_specs(parse_config(text))
    assert spec.engine == EngineConfig(
        model="m", dtype="float32", max_model_len=512, max_num_seqs=4, block_size=32, seed=7,
        max_num_batched_tokens=256,
    )  # fmt: skip


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
    config = ModelSpec("m", engine=EngineConfig(max_num_seqs=8, max_model_len=None)).engine
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


def test_hf_configs_of_each_family_read_as_their_models_compute() -> None:
    """What config.json says that changes what the model computes: a sliding window (Mistral 7B
    v0.1, Phi-3) is read, one that Qwen names but does not use is not, and neither bounds the
    context (the engine attends through the window); transformers 5's ``rope_parameters`` carry
    the RoPE base; Gemma's global layers, scale, caps and RoPE bases come from either format of its
    config; partial rotary embeddings are refused by name."""
    from prism_serve.engine.config import resolve_max_model_len
    from prism_serve.engine.models.config import ArchConfig
    from prism_serve.errors import UnsupportedModelError

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 300, "max_position_embeddings": 32768}  # fmt: skip
    mistral = ArchConfig.from_hf_config({**base, "model_type": "mistral", "sliding_window": 4096})
    assert (mistral.architecture, mistral.sliding_window) == ("llama", 4096)
    assert resolve_max_model_len(None, mistral) == 8192 and resolve_max_model_len(16384, mistral) == 16384
    assert [mistral.layer_window(i) for i in range(2)] == [4096, 4096]
    phi = ArchConfig.from_hf_config({**base, "model_type": "phi3", "sliding_window": 2047})
    assert (phi.architecture, phi.sliding_window, resolve_max_model_len(None, phi)) == ("phi3", 2047, 8192)
    # Gemma 2 as its Hub config.json writes it; Gemma 3's older config, then transformers 5's
    gemma2 = ArchConfig.from_hf_config({**base, "model_type": "gemma2", "num_hidden_layers": 4,
        "head_dim": 32, "query_pre_attn_scalar": 144, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh"})  # fmt: skip
    assert (gemma2.architecture, gemma2.gemma, gemma2.qk_norm, gemma2.global_layers) == (
        "gemma2",
        True,
        False,
        (1, 3),
    )
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.attention_scale) == (50.0, 30.0, 144**-0.5)
    assert [gemma2.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    old = {**base, "model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 512,
           "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 16}  # fmt: skip
    gemma3 = ArchConfig.from_hf_config(old)
    assert (gemma3.architecture, gemma3.qk_norm, gemma3.global_layers, gemma3.attn_softcap) == (
        "gemma3",
        True,
        (5, 11),
        None,
    )
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_linear_factor) == (1e6, 10000.0, 8.0)
    assert gemma3.query_pre_attn_scalar is None  # head_dim's, as most Gemma models have it
    assert ArchConfig.from_hf_config(gemma3.to_hf_config()) == gemma3  # transformers 5's format
    multimodal = {"model_type": "gemma3", "text_config": old, "vision_config": {"hidden_size": 1152}}
    assert ArchConfig.from_hf_config(multimodal) == gemma3
    with pytest.raises(UnsupportedModelError, match="bidirectional"):  # EmbeddingGemma
        ArchConfig.from_hf_config({**old, "use_bidirectional_attention": True})
    with pytest.raises(UnsupportedModelError, match="gelu_pytorch_tanh"):
        ArchConfig.from_hf_config({**old, "hidden_activation": "relu"})
    qwen = ArchConfig.from_hf_config({**base, "model_type": "qwen3", "sliding_window": 4096, "head_dim": 32})
    assert (qwen.sliding_window, qwen.qk_norm, qwen.head_dim, qwen.attention_bias) == (None, True, 32, False)
    assert resolve_max_model_len(None, qwen) == 8192
    v5 = ArchConfig.from_hf_config({**base, "model_type": "qwen3", "rope_parameters": {
        "rope_type": "default", "rope_theta": 1000000.0}})  # fmt: skip
    assert v5.rope_theta == 1000000.0 and v5.rope_scaling is None
    nulls = ArchConfig.from_hf_config({**base, "model_type": "qwen3", "rope_theta": None, "rope_scaling": {}})
    assert nulls.rope_theta == 10000.0  # keys present but null: the defaults
    with pytest.raises(UnsupportedModelError, match=r"partial_rotary_factor 0\.75"):
        ArchConfig.from_hf_config({**base, "model_type": "phi3", "partial_rotary_factor": 0.75})
    moe = {**base, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "norm_topk_prob": True}  # fmt: skip
    experts = ArchConfig.from_hf_config(moe)
    assert (experts.architecture, experts.num_experts, experts.experts_per_token) == ("qwen3_moe", 8, 2)
    assert experts.moe_intermediate_size == 32 and experts.norm_topk_prob and experts.qk_norm
    assert "gate_proj" not in experts.projection_shapes()  # adapters of experts: not supported
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        ArchConfig.from_hf_config({**moe, "mlp_only_layers": [0]})
    from prism_serve.engine.tensor_parallel import shard_plan

    assert len(shard_plan(experts, 1)) == 1
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        shard_plan(dataclasses.replace(experts, num_kv_heads=2), 2)
    with pytest.raises(UnsupportedModelError, match="'gpt_oss' is not supported"):
        ArchConfig.from_hf_config({**base, "model_type": "gpt_oss"})
