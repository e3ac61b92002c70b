"""Our logits against HF transformers' implementation built from the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prism_serve.engine.hf_reference import build_hf_model
from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.models.config import PRESETS, ArchConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.scheduler import ScheduledSeq
from prism_serve.engine.weights import LoadedWeights, random_weights


def our_logits(engine: LLMEngine, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, computed through the paged cache in chunks of ``chunk`` tokens
    (chunk=1 is pure decode: every token after the first attends only to cached keys)."""
    seq = engine.make_sequence(token_ids, SamplingParams(max_tokens=1))
    bs = engine.config.block_size
    seq.block_table = engine.allocator.allocate(-(-len(token_ids) // bs))
    rows = []
    try:
        with torch.inference_mode():
            while seq.num_computed_tokens < len(token_ids):
                n = min(chunk, len(token_ids) - seq.num_computed_tokens)
                ids, pos, meta, _ = engine.runner._prepare([ScheduledSeq(seq, n)])
                hidden = engine.model.forward(ids, pos, meta, engine.kv_cache)
                rows.append(engine.model.compute_logits(hidden))
                seq.num_computed_tokens += n
    finally:
        engine.allocator.free(seq.block_table)
    return torch.cat(rows)


def hf_logits(weights: LoadedWeights, token_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    model = build_hf_model(weights, dtype)
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module")
def prompt_ids(smollm: LoadedWeights) -> list[int]:
    tok = smollm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Write one sentence about the sea."}])
    return tok.encode(text)


@pytest.fixture(scope="module")
def hf_fp32(smollm, prompt_ids) -> torch.Tensor:
    return hf_logits(smollm, prompt_ids, torch.float32)


@pytest.mark.parametrize("chunk", [1000, 16, 1])
def test_smollm_logits_match_hf_fp32(make_engine, hf_fp32, prompt_ids, chunk):
    ours = our_logits(make_engine(num_kv_blocks=16), prompt_ids, chunk)
    ref = hf_fp32
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm_logits_match_hf_bf16(smollm, prompt_ids):
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_kv_blocks=16), weights=smollm)
    ours = our_logits(engine, prompt_ids, 1000)
    ref = hf_logits(smollm, prompt_ids, torch.bfloat16)
    # bf16 has ~3 significant digits and the two implementations fuse matmuls differently.
    err = (ours - ref).abs()
    assert err.mean() < 0.05 * ref.abs().mean()
    top_agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    assert top_agree >= 0.9


TINY = ArchConfig("llama", 300, 64, 128, 2, 4, 2, 16, 512, 10000.0, 1e-5, tie_word_embeddings=False)


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        dataclasses.replace(TINY, tie_word_embeddings=True, num_kv_heads=4),
        dataclasses.replace(TINY, rope_scaling=PRESETS["llama-3.2-1b"].rope_scaling, rope_theta=500000.0),
        dataclasses.replace(TINY, architecture="qwen2", attention_bias=True, num_kv_heads=1),
    ],
    ids=["llama-gqa", "tied-mha", "llama3-rope", "qwen2-bias"],
)
def test_synthetic_shapes_match_hf(config):
    weights = random_weights(config, seed=3)
    # Biases from N(0, 0.02) are near zero; make them large enough to matter.
    for name, t in weights.tensors.items():
        if name.endswith("bias"):
            t.normal_(0, 1.0)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = LLMEngine(EngineConfig(block_size=4, num_kv_blocks=64, dtype="float32"), weights=weights)
    ref = hf_logits(weights, ids, torch.float32)
    for chunk in (40, 7, 1):
        torch.testing.assert_close(our_logits(engine, ids, chunk), ref, atol=1e-4, rtol=1e-4)


def test_gguf_dequantization_matches_transformers_own_gguf_loader(smollm):
    """transformers reads the same GGUF with its own dequantizer and Q/K un-permutation: an
    independent check of our loader (a wrong permutation would still agree with build_hf_model)."""
    import transformers

    from prism_serve.engine.weights import default_gguf_path

    path = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    theirs = hf.state_dict()
    for name, ours in smollm.tensors.items():
        torch.testing.assert_close(ours, theirs[name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
