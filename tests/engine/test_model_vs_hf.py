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
from prism_serve.errors import CorruptWeightsError


def our_logits(engine: LLMEngine, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, computed through the paged cache in chunks of ``chunk`` tokens
    (chunk=1 is pure decode: every token after the first attends only to cached keys). Blocks come
    and go as the scheduler's do: a sliding window's old blocks are freed as the chunks pass."""
    seq = engine.make_sequence(token_ids, SamplingParams(max_tokens=1))
    scheduler = engine.scheduler
    free = engine.allocator.num_free_blocks + engine.num_cached_blocks  # the cache's unheld blocks too
    rows = []
    try:
        with torch.inference_mode():
            while seq.num_computed_tokens < len(token_ids):
                n = min(chunk, len(token_ids) - seq.num_computed_tokens)
                assert scheduler._grow(seq, seq.num_computed_tokens + n)
                ids, pos, meta, _ = engine.runner._prepare([ScheduledSeq(seq, n)])
                hidden = engine.model.forward(ids, pos, meta, engine.kv_cache)
                rows.append(engine.model.compute_logits(hidden))
                seq.num_computed_tokens += n
    finally:
        scheduler._release(seq)
    assert engine.allocator.num_free_blocks + engine.num_cached_blocks == free
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
        # heads wider than hidden / heads, as Qwen3's are
        dataclasses.replace(TINY, architecture="qwen3", head_dim=32),
        dataclasses.replace(TINY, architecture="phi3", sliding_window=64),
        dataclasses.replace(
            TINY,
            architecture="qwen3_moe",
            num_experts=6,
            experts_per_token=3,
            moe_intermediate_size=24,
        ),
        # a window shorter than the prompt beside a global layer; a query scale, soft caps that bind
        dataclasses.replace(
            TINY,
            architecture="gemma2",
            sliding_window=9,
            global_layers=(1,),
            query_pre_attn_scalar=24.0,
            attn_softcap=2.0,
            final_softcap=0.3,
        ),
        # Gemma 3: head norms, the windowed layers' own RoPE base, linear scaling in the global one
        dataclasses.replace(
            TINY,
            architecture="gemma3",
            sliding_window=9,
            global_layers=(1,),
            rope_local_theta=100.0,
            rope_linear_factor=2.0,
            tie_word_embeddings=True,
        ),
        dataclasses.replace(
            TINY,
            architecture="qwen2_moe",
            attention_bias=True,
            num_experts=4,
            experts_per_token=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
        ),
        dataclasses.replace(TINY, sliding_window=9),  # Mistral v0.1's window in every layer
    ],
    ids=[
        "llama-gqa",
        "tied-mha",
        "llama3-rope",
        "qwen2-bias",
        "qwen3-qk-norm",
        "phi3",
        "qwen3-moe",
        "gemma2",
        "gemma3",
        "qwen2-moe",
        "mistral-window",
    ],
)
def test_synthetic_shapes_match_hf(config):
    weights = _matters(random_weights(config, seed=3))
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = LLMEngine(EngineConfig(block_size=4, num_kv_blocks=64, dtype="float32"), weights=weights)
    ref = hf_logits(weights, ids, torch.float32)
    for chunk in (40, 7, 1):
        torch.testing.assert_close(our_logits(engine, ids, chunk), ref, atol=1e-4, rtol=1e-4)


def _matters(weights: LoadedWeights) -> LoadedWeights:
    """Biases from N(0, 0.02) are near zero, the q/k head norms' weights are ones, and queries and
    keys so small that attention is near uniform (positions barely matter): draw them so that
    getting any of them wrong shows."""
    for name, t in weights.tensors.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t.normal_(0, 0.5)
        elif name.endswith("bias"):
            t.normal_(0, 1.0)
        elif weights.config.gemma and name.endswith("norm.weight"):
            # a scale of 1 + w: w about 0, in steps of 2^-10 so that a GGUF file's 1 + w is exact
            t.normal_(0.0, 0.5).mul_(1024).round_().div_(1024)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            t.normal_(1.0, 0.5)
    return weights


# One tiny model of each architecture the built-in engine reads, with the family's distinguishing
# parts (GQA; Qwen2's q/k/v bias; Qwen3's head norms and heads wider than hidden / heads), a vocab
# of the byte tokenizer's 256 so that the GGUF file carries the whole vocabulary. SYNTHETIC weights.
_BYTE_TINY = dataclasses.replace(TINY, vocab_size=256)
ARCHITECTURES = {
    "llama": _BYTE_TINY,
    "qwen2": dataclasses.replace(_BYTE_TINY, architecture="qwen2", attention_bias=True),
    # transformers' GGUF reader takes Qwen3's head_dim from its default (128), not the file
    "qwen3": dataclasses.replace(_BYTE_TINY, architecture="qwen3", head_dim=128),
    # fused q/k/v and gate/up in its files; a sliding window longer than the prompts
    "phi3": dataclasses.replace(_BYTE_TINY, architecture="phi3", sliding_window=100),
    # Gemma 2: every other layer windowed (shorter than most prompts), soft caps that bind;
    # Gemma 3: 6 layers, so that llama.cpp's pattern makes the last global, with its two RoPE bases
    "gemma2": dataclasses.replace(
        _BYTE_TINY,
        architecture="gemma2",
        sliding_window=16,
        global_layers=(1,),
        attn_softcap=2.0,
        final_softcap=0.25,
        tie_word_embeddings=True,
    ),
    "gemma3": dataclasses.replace(
        _BYTE_TINY,
        architecture="gemma3",
        num_layers=6,
        sliding_window=16,
        global_layers=(5,),
        rope_theta=1e6,
        rope_local_theta=1e4,
        rope_linear_factor=8.0,
        tie_word_embeddings=True,
    ),
    # 8 experts, 2 per token, renormalised as llama.cpp's files assume; transformers' GGUF reader
    # also takes the experts' width from its default (768), not the file
    "qwen3_moe": dataclasses.replace(
        _BYTE_TINY,
        architecture="qwen3_moe",
        head_dim=128,
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # Qwen2-MoE: Qwen2's biased attention, 8 experts, 2 per token (not renormalised, as its configs
    # say), and the shared expert every token goes through, gated per token; transformers' GGUF
    # reader takes both widths from its defaults (1408 and 5632), not the file
    "qwen2_moe": dataclasses.replace(
        _BYTE_TINY,
        architecture="qwen2_moe",
        attention_bias=True,
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
    ),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_each_architecture_reads_from_gguf_and_hf_as_transformers_reads_it(arch, tmp_path):
    """The same weights written as a GGUF file (llama.cpp's names and layout: only ``llama`` files
    have their Q/K rows permuted) and as an HF directory: both loaders give back the tensors and the
    shape written, and transformers' own GGUF reader (independent code) finds the same tensors."""
    import transformers

    from prism_serve.engine.weights import fused_checkpoint, load_gguf, load_hf_dir, save_hf_dir
    from tests.engine.gguf_export import write_gguf

    config = ARCHITECTURES[arch]
    weights = _matters(random_weights(config, seed=1))
    path = write_gguf(weights, tmp_path / f"{arch}.gguf")
    save_hf_dir(weights, tmp_path / "hf")
    for loaded in (load_gguf(path), load_hf_dir(tmp_path / "hf")):
        # GGUF stores the epsilon as float32
        assert dataclasses.replace(loaded.config, rms_norm_eps=config.rms_norm_eps) == config
        assert loaded.config.rms_norm_eps == pytest.approx(config.rms_norm_eps)
        assert loaded.tensors.keys() == weights.tensors.keys()
        for name, t in weights.tensors.items():
            assert torch.equal(loaded.tensors[name], t), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    for name, t in fused_checkpoint(config, weights.tensors).items():  # under transformers' names
        assert torch.equal(theirs[name], t), name


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_each_architecture_generates_hf_transformers_greedy_tokens(arch, tmp_path):
    """16 prompts of 3-60 tokens, 24 greedy tokens each, batched in one engine with chunked
    prefill, from the GGUF file: every token equals transformers' greedy choice on the same weights."""
    from prism_serve.engine.llm import LLM
    from prism_serve.engine.weights import load_gguf
    from tests.engine.gguf_export import write_gguf

    weights = _matters(random_weights(ARCHITECTURES[arch], seed=2))
    loaded = load_gguf(write_gguf(weights, tmp_path / f"{arch}.gguf"))
    gen = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(0, 256, (int(n),), generator=gen).tolist()
        for n in torch.randint(3, 61, (16,), generator=gen)
    ]
    llm = LLM(weights=loaded, block_size=4, num_kv_blocks=512, max_num_batched_tokens=64, dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, greedy)]
    hf = build_hf_model(weights, torch.float32)
    # all 16 in one batch, left-padded: the mask, not the pad id (which prompts contain), says where
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)  # fmt: skip
    assert ours == out[:, longest:].tolist()


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


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_each_architecture_rebuilds_from_its_packed_tensors(arch):
    """An activation rebuilds the model over ``packed_tensors()`` copied to the device's pages
    (``from_packed``): every tensor the forward pass reads is in it, the Qwen3 head norms too."""
    from prism_serve.engine.models.llama import LlamaForCausalLM

    weights = _matters(random_weights(ARCHITECTURES[arch], seed=4))
    built = LlamaForCausalLM(weights.config, weights.tensors, torch.float32, 64)
    copies = {name: t.clone() for name, t in built.packed_tensors().items()}
    rebuilt = LlamaForCausalLM.from_packed(weights.config, copies, torch.float32, 64)
    assert [t.data_ptr() for t in rebuilt.tensors()] != [t.data_ptr() for t in built.tensors()]
    for name, t in built.packed_tensors().items():
        assert torch.equal(rebuilt.packed_tensors()[name], t), name
    assert rebuilt.weight_bytes == built.weight_bytes
    if weights.config.qk_norm:
        assert all(layer.q_norm is not None and layer.k_norm is not None for layer in rebuilt.layers)
    gone = "layers.0.q_norm" if weights.config.qk_norm else "layers.0.qkv"
    with pytest.raises(CorruptWeightsError, match=gone):
        LlamaForCausalLM.from_packed(
            weights.config, {n: t for n, t in copies.items() if n != gone}, torch.float32, 64
        )


def test_a_checkpoint_of_one_tensor_per_expert_reads_as_the_stacked_one(tmp_path):
    """Hub checkpoints of Qwen3-MoE name each expert's projections apart
    (``mlp.experts.{e}.gate_proj.weight``); the loader stacks them as transformers does."""
    from safetensors.torch import save_file

    from prism_serve.engine.weights import load_hf_dir, save_hf_dir

    config = ARCHITECTURES["qwen3_moe"]
    weights = random_weights(dataclasses.replace(config, moe_intermediate_size=16), seed=6)
    save_hf_dir(weights, tmp_path)
    per_expert = {}
    for name, t in weights.tensors.items():
        layer, sep, proj = name.partition(".mlp.experts.")
        if not sep:
            per_expert[name] = t
            continue
        for e in range(t.shape[0]):
            if proj == "gate_up_proj":
                gate, up = t[e].chunk(2)
                per_expert[f"{layer}.mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                per_expert[f"{layer}.mlp.experts.{e}.up_proj.weight"] = up.contiguous()
            else:
                per_expert[f"{layer}.mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
    save_file(per_expert, str(tmp_path / "model.safetensors"))
    loaded = load_hf_dir(tmp_path)
    assert loaded.tensors.keys() == weights.tensors.keys()
    for name, t in weights.tensors.items():
        assert torch.equal(loaded.tensors[name], t), name
    del per_expert["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(per_expert, str(tmp_path / "model.safetensors"))
    with pytest.raises(CorruptWeightsError, match="up_proj of 7 experts"):
        load_hf_dir(tmp_path)


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_a_multimodal_gemma3_checkpoint_reads_as_its_language_model(prefix, tmp_path):
    """Gemma 3 4B and up ship as image-text models: config.json's text_config and the language
    model's tensors under a prefix (transformers 5's, or the older one), beside a vision tower the
    built-in engine leaves out."""
    import json

    from safetensors.torch import save_file

    from prism_serve.engine.weights import load_hf_dir, save_hf_dir

    weights = _matters(random_weights(ARCHITECTURES["gemma3"], seed=7))
    save_hf_dir(weights, tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {prefix + n.removeprefix("model."): t for n, t in weights.tensors.items()}
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    tensors["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_hf_dir(tmp_path)
    assert loaded.config == weights.config
    assert loaded.tensors.keys() == weights.tensors.keys()
    for name, t in weights.tensors.items():
        assert torch.equal(loaded.tensors[name], t), name


def test_a_windowed_model_keeps_its_global_layers_and_one_window_of_the_others(tmp_path):
    """Gemma 3's shape (1 global layer of 6, a 16-token window): a request's KV grows like the global
    layer alone; the windowed layers hold their window and a step's chunk, so a 100-token request
    holds 25 + 5 x 5 blocks near its end where one group of all layers held 6 x 25. With the
    prefix cache on, a second request over the same prompt takes its prefix from the cache (the
    windowed blocks it reads came back from the cache's unheld ones) and gives the same tokens, as
    does a new engine the cached blocks were kept for and restored into."""
    from prism_serve.engine.kv_cache import KVGroups

    config = ARCHITECTURES["gemma3"]
    weights = _matters(random_weights(config, seed=6))
    groups = KVGroups.of(config, 4096)
    assert groups.windowed == (False, True, True, True, True, True) and groups.layers_per_group == 1
    prompt = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = []
    for caching in (False, True):
        engine = LLMEngine(
            EngineConfig(block_size=4, num_kv_blocks=400, max_num_batched_tokens=8, dtype="float32",
                         prefix_caching=caching), weights=weights,
        )  # fmt: skip
        assert engine.kv_groups == groups
        for _ in range(2 if caching else 1):
            rid = engine.add_request(prompt, greedy)
            held = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs.append((out.token_ids, out.num_cached_tokens))
                        break
                else:
                    held.append(engine.allocator.num_total_blocks - engine.allocator.num_free_blocks)
            assert rid
            if not caching:  # the last step but one computed position 97, windowed over 82..97
                assert held[-1] == 25 + 5 * (97 // 4 - 82 // 4 + 1)
                assert max(held) <= groups.max_blocks(100, 4, 8) < 6 * 25
    (tokens, cached), *rest = outputs
    assert cached == 0 and all(t == tokens for t, _ in rest)
    assert [c for _, c in rest] == [0, 56]  # the second request: 14 of the prompt's 15 blocks
    # the cached prefix kept across an eviction (engine/kept_prefixes.py): every group's blocks go to
    # the file and come back into a new engine, where the same prompt hits as it did before
    from prism_serve.engine.kept_prefixes import restore_prefixes, save_prefixes

    path = tmp_path / "kept.kv"
    assert save_prefixes(engine.prefix_cache, engine.kv_cache, path, 2**30, "gemma") > 0
    fresh = LLMEngine(
        EngineConfig(block_size=4, num_kv_blocks=400, max_num_batched_tokens=8, dtype="float32"),
        weights=weights,
    )
    assert restore_prefixes(fresh.prefix_cache, fresh.kv_cache, path, "gemma") > 0
    rid = fresh.add_request(prompt, greedy)
    done = {}
    while fresh.has_unfinished_requests():
        done.update({o.req_id: o for o in fresh.step() if o.finished})
    assert (done[rid].token_ids, done[rid].num_cached_tokens) == (tokens, 56)
