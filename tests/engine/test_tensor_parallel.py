"""Tensor parallelism in the built-in engine (engine/tensor_parallel.py): a model split over two
ranks, each a real process with one CPU thread running an engine over its shard, joined by gloo
all-reduces, gives the greedy tokens of the whole model in one engine (fp32), for the real
SmolLM2-135M (9 query heads on 3 KV heads: split unevenly, 6+3 on 2+1) and for a synthetic shape
whose head counts divide by 2 (labelled: random weights), with requests arriving between steps, a
seeded sampled one and one aborted mid-way; the other rank, following rank 0's commands, produces
the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.llm_engine import LLMEngine
from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.tensor_parallel import shard_config, shard_plan, shard_weights
from prism_serve.engine.weights import load_weights, random_weights
from prism_serve.errors import UnsupportedModelError

ROOT = Path(__file__).resolve().parents[2]
N = 16
SYNTHETIC = ArchConfig("llama", 384, 256, 512, 3, 8, 4, 32, 512, tie_word_embeddings=False)
PROMPTS = {
    "smol": ["The capital of France is", "def fibonacci(n):", "Memory bandwidth limits decoding because"],
    "synthetic": ["abc", "hello there", "0123456789"],
}

RANK = r"""
import json, sys
import torch
torch.set_num_threads(1)
import torch.distributed as dist
from tests.engine.test_tensor_parallel import engine_for, scripted, weights_of
from prism_serve.engine.tensor_parallel import Leader, all_reduce_over, follow, shard_plan, shard_weights
which, rank, world, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
weights = weights_of(which)
engine = engine_for(shard_weights(weights, shard_plan(weights.config, world)[rank]), all_reduce_over(None))
if rank == 0:
    leader = Leader(engine)
    out = scripted(which, leader)
    leader.close()
else:
    out, step = {}, engine.step
    def recording_step():
        outs = step()
        out.update({o.req_id: o.token_ids for o in outs})
        return outs
    engine.step = recording_step
    follow(engine)
    out.pop("doomed", None)  # as rank 0's record leaves it out (its tokens until the abort)
print(json.dumps(out))
dist.destroy_process_group()
"""


def weights_of(which: str):
    if which == "smol":
        return load_weights("smollm2-135m-instruct")
    return random_weights(SYNTHETIC, seed=3, name="tp-test")


def engine_for(weights, reduce=None) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", max_num_seqs=4, num_kv_blocks=64), weights=weights,
                     reduce=reduce)  # fmt: skip


def scripted(which: str, engine) -> dict[str, list[int]]:
    """Requests that arrive between steps, one sampled with a seed, one aborted mid-way: each
    request's tokens by id."""
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=N, ignore_eos=True)
    enc = engine.tokenizer.encode
    a, b, c = PROMPTS[which]
    out: dict[str, list[int]] = {}

    def step() -> None:
        out.update({o.req_id: o.token_ids for o in engine.step()})

    engine.add_request(enc(a), greedy, "a")
    step()
    step()
    engine.add_request(enc(b), greedy, "b")
    engine.add_request(enc(c), sampled, "c")
    step()
    engine.add_request(enc(a + b), greedy, "doomed")
    step()
    engine.abort_request("doomed")
    while engine.has_unfinished_requests():
        step()
    out.pop("doomed", None)
    return out


def run_ranks(which: str, world: int, tmp_path: Path) -> list[dict[str, list[int]]]:
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = []
    for r in range(world):
        cmd = [sys.executable, "-c", RANK, which, str(r), str(world), init]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


@pytest.mark.parametrize("which", ["smol", "synthetic"])
def test_two_ranks_give_the_whole_models_tokens(which, tmp_path):
    torch.set_num_threads(1)
    whole = scripted(which, engine_for(weights_of(which)))
    assert sorted(whole) == ["a", "b", "c"] and all(len(t) == N for t in whole.values())
    leader, follower = run_ranks(which, 2, tmp_path)
    assert leader == whole
    assert follower == whole  # in lockstep: the same requests, steps and sampled tokens


def test_shards_split_heads_by_kv_group_and_the_mlp_by_columns():
    smol = load_weights("smollm2-135m-instruct").config  # 9 heads on 3 KV heads, 1536 intermediate
    plan = shard_plan(smol, 2)
    assert [(s.q_start, s.q_heads, s.kv_start, s.kv_heads) for s in plan] == [(0, 6, 0, 2), (6, 3, 2, 1)]
    assert [(s.mlp_start, s.mlp_size) for s in plan] == [(0, 768), (768, 768)]
    c = shard_config(smol, plan[1])
    assert (c.num_heads, c.num_kv_heads, c.intermediate_size) == (3, 1, 768)
    w = shard_weights(random_weights(SYNTHETIC), shard_plan(SYNTHETIC, 2)[1])
    t = w.tensors
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 256)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 256)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (256, 4 * 32)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (256, 256)
    assert t["model.embed_tokens.weight"].shape == (384, 256)  # whole on every rank
    with pytest.raises(UnsupportedModelError, match="above the model's 3 KV heads"):
        shard_plan(smol, 4)


SUMS = r"""
import json, os, sys, datetime
import torch
torch.set_num_threads(1)
import torch.distributed as dist
from prism_serve.engine.tensor_parallel import ShmAllReduce
rank, path, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if rank == 0:
    ShmAllReduce.create(path + ".ar", 2, 8 * 64 * 4)  # before any rank can open it
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
shm = ShmAllReduce(path + ".ar", rank, 2, 8 * 64 * 4)
dist.barrier()
shm.connect()
if mode == "exit":  # rank 1 leaves without summing: rank 0's sum must raise, not wait forever
    if rank == 1:
        os._exit(0)
    try:
        shm(torch.ones(4))
    except RuntimeError as e:
        print(json.dumps({"raised": str(e)}))
    sys.exit(0)
g = torch.Generator().manual_seed(rank)
out = []
for shape in [(1, 64), (8, 64), (3, 5), (9, 64)]:  # the last is above a slot: summed through gloo
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(*shape, generator=g).to(dtype)
        a, b = x.clone(), x.clone()
        shm(a)
        dist.all_reduce(b)
        out.append([torch.equal(a, b), a.float().sum().item()])
shm.close()
print(json.dumps({"sums": out, "file_left": os.path.exists(path + ".ar")}))
dist.destroy_process_group()
"""


def _sum_ranks(tmp_path: Path, mode: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    path = str(tmp_path / "rendezvous")
    procs = [
        subprocess.Popen([sys.executable, "-c", SUMS, str(r), path, mode], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]  # fmt: skip
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        lines = stdout.strip().splitlines()
        outs.append(json.loads(lines[-1]) if lines else {})
    return outs


def test_shared_memory_sums_equal_gloos_on_every_rank(tmp_path):
    """The sums the runtime's CPU ranks use (ShmAllReduce) equal gloo's all-reduce, bit for bit,
    in fp32 and bf16, on both ranks; a tensor above a slot goes through gloo; the file is gone."""
    a, b = _sum_ranks(tmp_path, "sums")
    assert all(equal for equal, _ in a["sums"]) and all(equal for equal, _ in b["sums"])
    assert [s for _, s in a["sums"]] == [s for _, s in b["sums"]]
    assert not a["file_left"] and not b["file_left"]


def test_a_shared_memory_sum_raises_when_another_rank_is_gone(tmp_path):
    first, _ = _sum_ranks(tmp_path, "exit")
    assert "exited" in first["raised"]
