"""Bad input raises a named error with a clear message, and the engine keeps serving."""

from __future__ import annotations

import shutil

import pytest

from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.weights import default_gguf_path, load_weights, save_hf_dir
from prism_serve.errors import (
    CorruptWeightsError,
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    UnsupportedModelError,
    WeightsNotFoundError,
)
from tests.conftest import run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def solo(engine: LLMEngine, prompt, params=GREEDY):
    req_id = engine.add_request(prompt, params)
    return run_to_completion(engine)[req_id]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidSamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_raise_and_other_requests_keep_serving(make_engine):
    engine = make_engine(num_kv_blocks=64, max_model_len=256)
    reference = make_engine(num_kv_blocks=64, max_model_len=256)
    good = ["The capital of France is", "One, two, three,"]
    expected = [solo(reference, p).token_ids for p in good]

    ids = [engine.add_request(p, GREEDY) for p in good]
    engine.step()
    engine.step()
    with pytest.raises(EmptyPromptError, match="empty"):
        engine.add_request("", GREEDY)
    with pytest.raises(EmptyPromptError):
        engine.add_request([], GREEDY)
    with pytest.raises(PromptTooLongError, match="at most 255"):
        engine.add_request("word " * 400, GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([1, 2, 10**9], GREEDY)
    with pytest.raises(DuplicateRequestError):
        engine.add_request("again", GREEDY, req_id=ids[0])
    final = run_to_completion(engine)
    assert [final[i].token_ids for i in ids] == expected
    engine.drop_cached()  # prefix-cached blocks no request holds: nothing else may be left
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks


def test_prompt_larger_than_the_whole_kv_cache_is_refused(make_engine):
    engine = make_engine(num_kv_blocks=2, block_size=4)  # 8 tokens of KV in total
    with pytest.raises(PromptTooLongError, match="KV cache has 2 blocks"):
        engine.add_request("a fairly long prompt that needs more than eight tokens of cache", GREEDY)
    out = solo(engine, "Hi", SamplingParams(temperature=0, max_tokens=50))
    assert out.finish_reason == "length" and out.num_prompt_tokens + out.num_output_tokens == 8


def test_missing_weights():
    with pytest.raises(WeightsNotFoundError, match="not found"):
        load_weights("/nonexistent/model.gguf")
    with pytest.raises(WeightsNotFoundError):
        LLMEngine(EngineConfig(model="/nonexistent/dir"))


def test_corrupt_gguf_files(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(CorruptWeightsError, match="not a readable GGUF"):
        load_weights(str(garbage))
    truncated = tmp_path / "truncated.gguf"
    with open(default_gguf_path(), "rb") as src:
        truncated.write_bytes(src.read(3_000_000))
    with pytest.raises(CorruptWeightsError):
        load_weights(str(truncated))


def test_corrupt_hf_dirs(tmp_path, smollm):
    model_dir = tmp_path / "m"
    save_hf_dir(smollm, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptWeightsError, match=r"model\.safetensors"):
        load_weights(str(model_dir))
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(WeightsNotFoundError, match="safetensors"):
        load_weights(str(model_dir))
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(CorruptWeightsError, match=r"config\.json"):
        load_weights(str(model_dir))


def test_shape_mismatch_is_reported_by_tensor_name(tmp_path, smollm):
    model_dir = tmp_path / "m"
    save_hf_dir(smollm, model_dir)
    cfg = (
        (model_dir / "config.json")
        .read_text()
        .replace('"intermediate_size": 1536', '"intermediate_size": 1000')
    )
    (model_dir / "config.json").write_text(cfg)
    with pytest.raises(CorruptWeightsError, match=r"gate_proj\.weight has shape"):
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=4))


def test_unsupported_models(tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"llama-3\.2-1b"):
        load_weights("random:gpt-17")
    other = tmp_path / "model.bin"
    shutil.copy(__file__, other)
    with pytest.raises(UnsupportedModelError, match=r"\.gguf"):
        load_weights(str(other))
