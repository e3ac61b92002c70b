"""Loading weights into a built vLLM engine by a checked plan (engine/vllm_load.py) instead of
vLLM's reload: with vLLM's real CPU build (the environment scripts/vllm-server-env.sh makes) and
the real SmolLM2-135M weights in fp32.

Checked in one vLLM process (eager, dummy weights at build, as a pooled worker builds it):
- a plan exists for SmolLM2's checkpoint (fused QKV and gate-up from their shards, a tied head);
- ``verify`` finds it equal to vLLM's reload, and the greedy completions after a plan load are
  the ones after vLLM's reload;
- synthetic tensors made from the files' headers have the real checkpoint's signature, and the
  plan checked on them loads the real weights right;
- a wrong plan (gate and up stacked the other way round) fails ``verify``, which leaves vLLM's
  own load in place (the completions are still right);
- a tensor the plan cannot place, or a missing one, gives no plan."""

from __future__ import annotations

from pathlib import Path

from tests.engine.vllm_script import run_vllm_script

SCRIPT = r"""
import json, os, sys
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR", HF_HUB_OFFLINE="1",
                  VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
import torch
from safetensors.torch import load_file
from vllm import LLM, SamplingParams
from prism_serve.engine.vllm_load import checkpoint_signature, make_plan, synthetic_checkpoint, verify

hf = sys.argv[1]
llm = LLM(model=hf, dtype="float32", enforce_eager=True, max_model_len=512, load_format="dummy", seed=0)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
model = runner.get_model()
real = load_file(os.path.join(hf, "model.safetensors"))
def with_head(named):
    return {**named, "lm_head.weight": named["model.embed_tokens.weight"]}
def reload(named):
    runner.reload_weights(weights_iterator=iter(named.items()), is_checkpoint_format=True)
def greedy():
    outs = llm.generate(["The capital of France is", "def fib(n):"],
                        SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].text for o in outs]
out = {}
named = with_head(real)
reload(named)
out["reload"] = greedy()
synth = synthetic_checkpoint(hf, torch.float32)
out["same_signature"] = checkpoint_signature(synth) == checkpoint_signature(real)
out["synthetic_distinct"] = not torch.equal(synth["model.layers.0.mlp.gate_proj.weight"],
                                            synth["model.layers.0.mlp.up_proj.weight"])
plan = make_plan(model, with_head(synth), tied_head=True)
out["plan"] = plan is not None and [len(plan.params), len(plan.linears)]
out["fused"] = sorted({n.rsplit(".", 1)[-1] for n, src in plan.linears if len(src) > 1})
synth = with_head(synth)
out["verified_synthetic"] = verify(plan, model, synth, lambda: reload(synth), torch.float32)
plan.apply(model, named)  # the plan checked on synthetic tensors, now with the real weights
out["plan_greedy"] = greedy()
out["verified_real"] = verify(plan, model, named, lambda: reload(named), torch.float32)
out["after_verify"] = greedy()
# gate and up the other way round: the stacked weight differs from what vLLM's loader makes
swapped = dict(model.packed_modules_mapping)
swapped["gate_up_proj"] = list(reversed(swapped["gate_up_proj"]))
model.packed_modules_mapping = swapped
wrong = make_plan(model, named, tied_head=True)
out["wrong_plan_made"] = wrong is not None
out["wrong_verified"] = verify(wrong, model, named, lambda: reload(named), torch.float32)
out["after_wrong"] = greedy()
del model.packed_modules_mapping  # the class's own again
out["extra_tensor_plan"] = make_plan(model, {**named, "model.extra.weight": torch.zeros(3)}, True) is not None
missing = dict(named)
del missing["model.layers.1.self_attn.k_proj.weight"]
out["missing_tensor_plan"] = make_plan(model, missing, True) is not None
print("RESULT " + json.dumps(out))
"""


def test_a_checked_plan_loads_what_vllms_reload_loads_and_a_wrong_one_is_refused(smollm_hf: Path) -> None:
    out = run_vllm_script(SCRIPT, str(smollm_hf))
    assert out["same_signature"] and out["synthetic_distinct"]
    # 30 layers x 2 norms, the final norm, the embedding; 30 x 4 linears, the embedding's packed head
    assert out["plan"] == [62, 122], out
    assert out["fused"] == ["gate_up_proj", "qkv_proj"]
    assert out["verified_synthetic"] and out["verified_real"]
    assert out["reload"][0].startswith(" Paris")
    assert out["plan_greedy"] == out["reload"] == out["after_verify"]
    assert out["wrong_plan_made"] and not out["wrong_verified"]
    assert out["after_wrong"] == out["reload"]  # verify put vLLM's own load back
    assert not out["extra_tensor_plan"] and not out["missing_tensor_plan"]


def test_shards_back_to_back_in_the_host_cache_stack_without_a_copy() -> None:
    import torch

    from prism_serve.engine.vllm_load import stacked
    from prism_serve.runtime.weight_cache import cache_layout, shards_together

    g = torch.Generator().manual_seed(0)
    ckpt = {  # checkpoint order: alphabetical, q/k/v apart
        f"model.layers.0.{n}.weight": torch.randn(rows, 64, generator=g)
        for n, rows in [("mlp.down_proj", 64), ("mlp.gate_proj", 128), ("mlp.up_proj", 128),
                        ("self_attn.k_proj", 32), ("self_attn.o_proj", 64), ("self_attn.q_proj", 64),
                        ("self_attn.v_proj", 32)]
    }  # fmt: skip
    ordered = shards_together(ckpt)
    assert list(ordered) == [f"model.layers.0.{n}.weight" for n in (
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    )]  # fmt: skip
    entries, total = cache_layout(ordered)
    flat = torch.zeros(total, dtype=torch.uint8)
    views = {}
    for e, t in zip(entries, ordered.values(), strict=True):
        flat[e.offset : e.offset + e.nbytes].copy_(t.view(-1).view(torch.uint8))
        views[e.name] = flat[e.offset : e.offset + e.nbytes].view(torch.float32).view(t.shape)
    qkv = [views[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
    w = stacked(qkv)
    assert torch.equal(w, torch.cat([ckpt[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]))
    assert w.data_ptr() == qkv[0].data_ptr()  # a view of the cache: no copy
    down, o = views["model.layers.0.mlp.down_proj.weight"], views["model.layers.0.self_attn.o_proj.weight"]
    apart = stacked([down, o])
    assert apart.data_ptr() != down.data_ptr()  # not adjacent: copied
    assert torch.equal(apart, torch.cat([ckpt["model.layers.0.mlp.down_proj.weight"],
                                         ckpt["model.layers.0.self_attn.o_proj.weight"]]))  # fmt: skip
    # a tensor with no shards of its group in the checkpoint stays where it was
    lone = {"a.q_proj.weight": torch.zeros(2, 2), "a.norm.weight": torch.zeros(2)}
    assert list(shards_together(lone)) == list(lone)
