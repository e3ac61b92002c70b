from __future__ import annotations

import pytest
import torch

from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.models.config import PRESETS
from prism_serve.engine.models.llama import LlamaForCausalLM
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.weights import load_weights, random_weights, save_hf_dir
from tests.conftest import run_to_completion


def test_default_model_is_the_real_smollm2(smollm):
    assert not smollm.synthetic
    assert smollm.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    c = smollm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings
    assert 134e6 < c.num_params < 136e6


def test_hf_layout_round_trip_gives_identical_outputs(tmp_path, smollm, engine):
    save_hf_dir(smollm, tmp_path / "smollm")
    loaded = load_weights(str(tmp_path / "smollm"))
    assert loaded.config == smollm.config
    assert loaded.tokenizer.eos_token_ids == smollm.tokenizer.eos_token_ids
    assert loaded.tokenizer.encode("Hello world 123") == smollm.tokenizer.encode("Hello world 123")
    hf_engine = LLMEngine(EngineConfig(num_kv_blocks=32, dtype="float32"), weights=loaded)
    params = SamplingParams(temperature=0, max_tokens=10)
    prompt = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    ra = engine.add_request(prompt, params)
    out_a = run_to_completion(engine)[ra]
    rb = hf_engine.add_request(prompt, params)
    out_b = run_to_completion(hf_engine)[rb]
    assert out_a.token_ids == out_b.token_ids


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_describe_real_sizes(preset):
    expected_params = {
        "smollm2-135m": 134.5e6,
        "smollm2-360m": 361.8e6,
        "qwen2.5-0.5b": 494.0e6,
        "qwen3-0.6b": 596.0e6,
        "qwen3-8b": 8190.7e6,
        "qwen3-30b-a3b": 30532.1e6,
        "qwen1.5-moe-a2.7b": 14.3e9,  # its model card: 14.3B in all, 2.7B active
        "gemma-3-1b": 999.9e6,
        "gemma-2-2b": 2614.3e6,
        "llama-3.2-1b": 1235.8e6,
        "llama-3.2-3b": 3212.7e6,
        "llama-3.1-8b": 8030.3e6,
        "qwen2.5-14b": 14770.0e6,
        "qwen2.5-32b": 32764.0e6,
        "llama-3.1-70b": 70553.7e6,
    }[preset]
    assert PRESETS[preset].num_params == pytest.approx(expected_params, rel=0.01)


def test_random_weights_are_seeded_labelled_and_run(tmp_path):
    a = load_weights("random:smollm2-135m", seed=1)
    b = load_weights("random:smollm2-135m", seed=1)
    c = load_weights("random:smollm2-135m", seed=2)
    assert a.synthetic and "random:" in a.source
    name = "model.layers.3.mlp.up_proj.weight"
    assert torch.equal(a.tensors[name], b.tensors[name]) and not torch.equal(a.tensors[name], c.tensors[name])
    engine = LLMEngine(EngineConfig(model="random:smollm2-135m", num_kv_blocks=16))
    assert engine.synthetic
    req = engine.add_request("any text", SamplingParams(temperature=0, max_tokens=4))
    assert len(run_to_completion(engine)[req].token_ids) == 4


def test_bf16_weights_take_half_the_bytes():
    w = random_weights(PRESETS["smollm2-135m"], dtype=torch.bfloat16)
    m16 = LlamaForCausalLM(w.config, w.tensors, torch.bfloat16, max_positions=64)
    m32 = LlamaForCausalLM(w.config, w.tensors, torch.float32, max_positions=64)
    assert m16.weight_bytes * 2 == m32.weight_bytes
    assert m32.weight_bytes == 4 * w.config.num_params
