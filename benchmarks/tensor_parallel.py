"""Tensor parallelism on CPU: what splitting one model over two ranks costs and gains here.

The same model and requests, on the same cores, three ways:

* TP 1: one engine, ``--cores`` threads;
* TP 2: two ranks (processes), each an engine over its shard with ``--cores`` / 2 threads pinned to
  its own cores as the runtime pins devices (engine/tensor_parallel.py; rank 0 leads, the other
  follows), their partial sums added through shared memory (``ShmAllReduce``, what the runtime's
  CPU ranks use) and, for comparison, through gloo's all-reduce (TCP loopback);
* the all-reduces alone: TP 2's step time less the same steps with the sums left out (each rank
  then computes on its partial sums: wrong tokens, the same work), which is their cost.

Measured for each batch size of ``--batches``: the steps that prefill the batch's prompts of
``--prompt-len`` tokens (summed: the first ceil(batch x prompt-len / 512) steps, the token budget of
one step), and the median decode step at that batch size (``--steps`` of them), greedy, fp32 by
default.
Prints the machine line, the median step times and the ratios to TP 1. Run from the repository
root::

    python benchmarks/tensor_parallel.py                 # the real SmolLM2-135M
    python benchmarks/tensor_parallel.py --model random:llama-3.2-1b   # a larger shape (synthetic)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import common

RUN = r"""
import json, statistics, sys, time
import torch
model, dtype, rank, world, threads, init, batch, prompt_len, steps, sums = sys.argv[1:11]
rank, world, threads, batch, prompt_len, steps = map(int, (rank, world, threads, batch, prompt_len, steps))
torch.set_num_threads(threads)
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.llm_engine import LLMEngine, DTYPES
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.tensor_parallel import (
    Leader, ShmAllReduce, all_reduce_over, follow, shard_plan, shard_weights)
from prism_serve.engine.weights import load_weights
weights = load_weights(model, dtype=DTYPES[dtype])
reduce = None
if world > 1:
    import torch.distributed as dist
    element = torch.empty((), dtype=DTYPES[dtype]).element_size()
    path, slot = init.removeprefix("file://") + ".ar", max(512, batch) * weights.config.hidden_size * element
    if rank == 0 and sums == "shm":
        ShmAllReduce.create(path, world, slot)  # before any rank opens it
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    weights = shard_weights(weights, shard_plan(weights.config, world)[rank])
    import os
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[rank * threads : (rank + 1) * threads])  # as the runtime pins devices
    if sums == "gloo":
        reduce = all_reduce_over(None)
    elif sums == "shm":  # what the runtime's CPU ranks use, sized as it sizes it
        reduce = ShmAllReduce(path, rank, world, slot)
        dist.barrier()
        reduce.connect()
    else:
        reduce = lambda t: None
blocks = batch * (prompt_len + steps + 32) // 16 + 8
config = EngineConfig(dtype=dtype, max_num_seqs=batch, num_kv_blocks=blocks)
engine = LLMEngine(config, weights=weights, reduce=reduce)
if world > 1 and rank > 0:
    follow(engine)
    dist.destroy_process_group()
    sys.exit(0)
if world > 1:
    engine = Leader(engine)
g = torch.Generator().manual_seed(0)
params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
def one_round():
    for i in range(batch):
        engine.add_request(torch.randint(100, 10000, (prompt_len,), generator=g).tolist(), params)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times
one_round()  # warm-up
times = one_round()
# with the default token budget a batch's prompts take ceil(batch * prompt_len / budget) steps
prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
out = {"prefill_s": sum(times[:prefill_steps]), "decode_s": statistics.median(times[prefill_steps:])}
if world > 1:
    engine.close()
    dist.destroy_process_group()
print(json.dumps(out))
"""


def run(args, world: int, sums: str = "shm") -> dict:
    threads = args.cores // world
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        env = {**os.environ, "PYTHONPATH": str(common.REPO_ROOT)}
        procs = []
        for rank in range(world):
            cmd = [sys.executable, "-c", RUN, args.model, args.dtype, str(rank), str(world), str(threads),
                   init, str(args.batch), str(args.prompt_len), str(args.steps),
                   sums]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))  # fmt: skip
        outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(err[-3000:])
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    print(common.machine_info()["line"], flush=True)
    print(f"{args.model} {args.dtype}, {args.cores} cores: TP 1 with {args.cores} threads, TP 2 with "
          f"{args.cores // 2} per rank; prompts of {args.prompt_len} tokens", flush=True)  # fmt: skip
    rows = []
    for batch in map(int, args.batches.split(",")):
        args.batch = batch
        common.wait_quiet(30, 0.2)
        tp1 = run(args, 1)
        tp2 = {kind: run(args, 2, kind) for kind in ("shm", "gloo", "none")}
        rows.append({"batch": batch, "tp1": tp1, "tp2": tp2})
        for phase in ("decode_s", "prefill_s"):
            line = f"batch {batch:>3} {phase[:-2]:<8} TP 1 {tp1[phase] * 1e3:8.2f} ms"
            for kind in ("shm", "gloo"):
                step, sums = tp2[kind][phase], tp2[kind][phase] - tp2["none"][phase]
                line += (f" | TP 2, {kind} sums {step * 1e3:8.2f} ms ({step / tp1[phase]:.2f}x; the "
                         f"sums {sums * 1e3:6.2f} ms)")  # fmt: skip
            print(line, flush=True)
    if args.out:
        args.out.write_text(json.dumps({"machine": common.machine_info(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
