"""LoRA adapters made by ``peft`` on the real SmolLM2 (fp32): greedy tokens of each adapter's
requests inside one mixed batch (base rows and rows of several adapters together) equal
transformers + peft's merged model; the CPU kernel equals the grouped torch ops; slots are reused;
bad adapters are refused naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from prism_serve.engine import cpu_kernels
from prism_serve.engine.lora import (
    AdapterInUseError,
    InvalidAdapterError,
    LoraSlots,
    _apply_grouped,
    read_adapter,
)
from prism_serve.engine.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.peft_adapters import make_adapter, merged_greedy

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about rain."]
N = 12
# (rank, alpha, target modules, rsLoRA): ranks 8, 16 and 64 over different modules
ADAPTERS = {
    "qv-r8": (8, 16, ["q_proj", "v_proj"], False),
    "mlp-r16": (16, 8, ["gate_proj", "up_proj", "down_proj"], False),
    "all-r64": (64, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, smollm_hf) -> dict[str, Path]:
    """PEFT adapters with non-zero B (a random LoRA is not a no-op), saved as PEFT saves them."""
    return {
        name: make_adapter(smollm_hf, tmp_path_factory.mktemp("lora") / name, r, alpha, targets, 100 + i,
                           rslora, b_scale=0.1 if rslora else 0.5)
        for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items())
    }  # fmt: skip


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:
    tok = smollm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(smollm_hf, adapters, prompts) -> dict[str | None, list[list[int]]]:
    ref = {name: merged_greedy(smollm_hf, path, prompts, N) for name, path in adapters.items()}
    ref[None] = merged_greedy(smollm_hf, None, prompts, N)
    return ref


def test_adapters_change_the_answers(reference):
    answers = {tuple(map(tuple, v)) for v in reference.values()}
    assert len(answers) == len(reference), "an adapter that changes nothing proves nothing"


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_a_mixed_batch_gives_each_adapters_merged_model_tokens(
    make_engine, adapters, prompts, reference, kernels, monkeypatch
):
    monkeypatch.setenv("PRISM_CPU_KERNELS", kernels)
    engine = make_engine(max_num_seqs=16, num_kv_blocks=256, max_loras=4, max_lora_rank=64)
    for name, path in adapters.items():
        engine.add_lora(path, name)
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    ids = {}
    for name in [None, *adapters]:  # every prompt under every adapter and the base, in one batch
        for j, p in enumerate(prompts):
            ids[name, j] = engine.add_request(p, greedy, adapter=name)
    final = run_to_completion(engine)
    for (name, j), rid in ids.items():
        assert final[rid].token_ids == reference[name][j], (name, j)
    assert engine.adapters.loads == len(adapters)  # each copied into a slot once


def test_the_kernel_equals_the_grouped_torch_ops(smollm):
    torch.manual_seed(0)
    cfg = smollm.config
    slots = LoraSlots(cfg, num_slots=5, max_rank=16, dtype=torch.float32)
    for key in slots.a:
        slots.a[key].normal_()
        slots.b[key].normal_()
    slots.ranks[:] = torch.tensor([16, 8, 0, 3, 16])  # a slot's rank may be below the maximum, or 0
    x = torch.randn(37, cfg.hidden_size)
    rows = torch.tensor([(i * 7) % 6 - 1 for i in range(37)])  # -1: the base, and every slot, unsorted
    for module in ("q_proj", "down_proj"):
        a, b = slots.a[0, module], slots.b[0, module]
        xin = x if module == "q_proj" else torch.randn(37, cfg.intermediate_size)
        y0 = torch.randn(37, 3 * b.shape[2])[:, 5 : 5 + b.shape[2]]  # a column range of a wider output
        want, got = y0.clone(), y0.clone()
        _apply_grouped(xin, want, a, b, rows, slots.ranks[0, 0])
        cpu_kernels.lora_apply(xin, got, a, b, rows, slots.ranks[0, 0])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        assert not torch.equal(want, y0)


def test_slots_are_reused_least_recently_used_first_and_wait_when_all_are_held(
    make_engine, adapters, prompts
):
    engine = make_engine(max_num_seqs=8, num_kv_blocks=128, max_loras=2, max_lora_rank=64)
    for name, path in adapters.items():
        engine.add_lora(path, name)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    names = list(adapters)
    rids = [engine.add_request(prompts[0], greedy, adapter=n) for n in names]  # 3 adapters, 2 slots
    engine.step()
    running = {s.adapter for s in engine.scheduler.running}
    assert running == set(names[:2]) and engine.scheduler.waiting[0].adapter == names[2]
    final = run_to_completion(engine)
    assert all(final[r].finish_reason == "length" for r in rids)
    assert engine.adapters.loads == 3 and engine.adapters._refs == [0, 0]


def test_removing_an_adapter_waits_for_its_requests_unless_forced(make_engine, adapters, prompts):
    engine = make_engine(max_num_seqs=8, num_kv_blocks=128, max_loras=2, max_lora_rank=64)
    engine.add_lora(adapters["qv-r8"], "a")
    rid = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=8), adapter="a")
    engine.step()
    with pytest.raises(AdapterInUseError, match="1 requests"):
        engine.remove_lora("a")
    assert engine.remove_lora("a", force=True) == [rid]
    assert engine.adapters._refs == [0, 0] and engine.adapters.slots.names == [None, None]
    with pytest.raises(InvalidAdapterError, match="not registered"):
        engine.add_request(prompts[0], SamplingParams(max_tokens=2), adapter="a")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_adapters_are_refused_naming_the_problem(tmp_path, smollm, adapters):
    cfg = smollm.config
    good = adapters["mlp-r16"]
    with pytest.raises(InvalidAdapterError, match="rank 64 is above this base's max_lora_rank 16"):
        read_adapter(adapters["all-r64"], cfg, max_rank=16)
    with pytest.raises(InvalidAdapterError, match=r"no adapter_config\.json"):
        read_adapter(tmp_path / "nowhere", cfg, max_rank=64)
    bad = _copy(good, tmp_path / "corrupt")
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(InvalidAdapterError, match=r"cannot read adapter_model\.safetensors"):
        read_adapter(bad, cfg, max_rank=64)
    dora = _copy(good, tmp_path / "dora")
    conf = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(InvalidAdapterError, match="DoRA"):
        read_adapter(dora, cfg, max_rank=64)
    from dataclasses import replace

    other = replace(cfg, intermediate_size=cfg.intermediate_size * 2)  # an adapter for another base shape
    with pytest.raises(InvalidAdapterError, match="another base"):
        read_adapter(good, other, max_rank=64)


def test_a_rank_zero_adapter_or_a_bad_pattern_is_named_not_a_crash(tmp_path, smollm):
    from safetensors.torch import save_file

    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(0, 576), f"{key}.lora_B.weight": torch.zeros(576, 0)},
              str(tmp_path / "adapter_model.safetensors"))  # fmt: skip
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "alpha_pattern": {"([": 3}}))
    with pytest.raises(InvalidAdapterError, match="needs A"):
        read_adapter(tmp_path, smollm.config, max_rank=16)


def test_an_adapter_never_reuses_the_bases_cached_blocks(make_engine, adapters, prompts, reference):
    """The prefix cache keys blocks by adapter: the base's cached prompt is a miss for an adapter
    (its KV differs), the adapter's own is a hit, and both give the merged model's tokens."""
    engine = make_engine(max_loras=2, max_lora_rank=64, block_size=4)
    name = "qv-r8"
    engine.add_lora(adapters[name], name)
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    runs = [None, name, name, None]
    got = []
    for adapter in runs:
        rid = engine.add_request(prompts[0], greedy, adapter=adapter)
        got.append(run_to_completion(engine)[rid])
    assert [o.num_cached_tokens > 0 for o in got] == [False, False, True, True]
    for adapter, out in zip(runs, got, strict=True):
        assert out.token_ids == reference[adapter][0], adapter
    # re-registered under the same name: another adapter as far as the cache knows
    engine.remove_lora(name)
    engine.add_lora(adapters[name], name)
    rid = engine.add_request(prompts[0], greedy, adapter=name)
    assert run_to_completion(engine)[rid].num_cached_tokens == 0
