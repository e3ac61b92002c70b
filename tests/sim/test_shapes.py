"""Model shapes for the cost model read from what a deployment names (sim/shapes.py): the real GGUF
header, HF config.json files of dense and mixture-of-experts models, a GGUF header of a MoE model,
presets; and a shape that cannot be read names the model and the file."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from prism_serve.engine.models.config import PRESETS
from prism_serve.sim.cost import RooflineCostModel
from prism_serve.sim.hardware import HARDWARE
from prism_serve.sim.models import ModelShape
from prism_serve.sim.shapes import ShapeError, shape_from_hf, shape_of

MIXTRAL = {
    "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
}  # fmt: skip
QWEN3_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
}  # fmt: skip


def test_the_default_model_is_read_from_its_gguf_header() -> None:
    s = shape_of("chat", "smollm2-135m-instruct", 4)
    preset = ModelShape("smollm2-135m", PRESETS["smollm2-135m"], 4)
    assert (s.num_params, s.kv_bytes_per_token, s.config.tie_word_embeddings) == (
        preset.num_params, preset.kv_bytes_per_token, True,
    )  # fmt: skip
    assert s.weight_bytes == 4 * 134_515_008
    assert shape_of("x", "random:llama-3.1-70b", 2).num_params == pytest.approx(70.55e9, rel=1e-3)


def test_hf_configs_of_any_architecture_and_mixtures_of_experts(tmp_path: Path) -> None:
    mixtral = shape_from_hf("mixtral", MIXTRAL, 2)
    # the published sizes: 46.7B parameters, 12.9B of them used per token
    assert mixtral.num_params == pytest.approx(46.7e9, rel=0.01)
    assert mixtral.active_params == pytest.approx(12.9e9, rel=0.01)
    assert mixtral.weight_bytes == 2 * mixtral.num_params
    assert mixtral.matmul_flops_per_token < 0.3 * 2 * mixtral.num_params  # computes with 2 of 8 experts
    qwen = shape_from_hf("qwen3", QWEN3_MOE, 2)
    assert qwen.num_params == pytest.approx(30.5e9, rel=0.02) and qwen.active_params == pytest.approx(
        3.3e9, rel=0.05
    )
    d = tmp_path / "qwen3-moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_MOE))
    assert shape_of("q", str(d), 2) == shape_from_hf("qwen3-moe", QWEN3_MOE, 2)  # named for its directory
    latent = shape_from_hf("mla", {**MIXTRAL, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, 2)
    assert latent.kv_bytes_per_token == 32 * (512 + 64) * 2  # one latent per token and layer


def test_a_moe_step_reads_only_the_experts_its_tokens_chose() -> None:
    cost = RooflineCostModel(HARDWARE["h100"])
    moe = shape_from_hf("mixtral", MIXTRAL, 2)
    dense = shape_from_hf("dense", {**MIXTRAL, "num_local_experts": 0, "intermediate_size": 14336 * 8}, 2)
    assert dense.num_params == pytest.approx(moe.num_params, rel=0.01)  # the same bytes in memory
    one = cost.decode_steps(moe, 1, 1, 512, 1)[0]
    assert one < 0.5 * cost.decode_steps(dense, 1, 1, 512, 1)[0]  # batch 1: 2 of 8 experts read
    assert moe.experts_read(1) == pytest.approx(0.25) and moe.experts_read(64) == pytest.approx(1.0)
    many = cost.decode_steps(moe, 1, 64, 64 * 512, 1)[0]
    assert many == pytest.approx(cost.decode_steps(dense, 1, 64, 64 * 512, 1)[0], rel=0.1)  # all read


def test_a_gguf_header_of_a_mixture_of_experts(tmp_path: Path) -> None:
    path = tmp_path / "tiny-moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    for key, value in [("block_count", 4), ("embedding_length", 256), ("feed_forward_length", 512),
                       ("attention.head_count", 8), ("attention.head_count_kv", 2), ("context_length", 4096),
                       ("expert_count", 16), ("expert_used_count", 4), ("expert_feed_forward_length", 128),
                       ("expert_shared_feed_forward_length", 256), ("vocab_size", 1000)]:  # fmt: skip
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"qwen2moe.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((1000, 256), dtype=np.float32))
    w.add_tensor("output.weight", np.zeros((1000, 256), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    s = shape_of("tiny", str(path), 2)
    assert s.moe is not None and (s.moe.num_experts, s.moe.experts_per_token, s.moe.expert_ffn) == (
        16,
        4,
        128,
    )
    assert (s.moe.num_layers, s.moe.shared_ffn, s.config.num_kv_heads) == (4, 256, 2)
    assert not s.config.tie_word_embeddings  # it has an output.weight


def test_an_unreadable_shape_names_the_model_and_the_file(tmp_path: Path) -> None:
    with pytest.raises(ShapeError, match=r"model m: cannot read its shape \(.*nowhere\.gguf: no such file\)"):
        shape_of("m", str(tmp_path / "nowhere.gguf"), 2)
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{")
    with pytest.raises(
        ShapeError, match=r"model b: cannot read its shape \(.*broken/config\.json: not readable JSON"
    ):
        shape_of("b", str(d), 2)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ShapeError, match=r"model b: .*broken: config\.json lacks 'num_attention_heads'"):
        shape_of("b", str(d), 2)
    with pytest.raises(ShapeError, match="unknown preset 'gpt-9'"):
        shape_of("r", "random:gpt-9", 2)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ShapeError, match="not a readable GGUF file"):
        shape_of("g", str(bad), 2)
