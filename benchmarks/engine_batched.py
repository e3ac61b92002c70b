"""The built-in engine alone on the batched workload of serve_throughput.py, against the engine of
another commit in the same run, and whether their greedy outputs are identical.

Workload: 64 requests of random token ids (prompts 8-512 tokens, 4-128 output tokens, seeded),
greedy with ignore_eos, all queued at once, 32 in a batch; SmolLM2-135M-Instruct fp32. Each
``--baseline REV`` is checked out in a temporary git worktree and runs the same workload in a
child process (its own ``prism_serve``); runs alternate (current, baseline, current, ...) so drift
on a shared machine hits both.

    python benchmarks/engine_batched.py --baseline 3b1c5ff          # before oneDNN and the C++ kernels
    python benchmarks/engine_batched.py --baseline 22788fe --current 5640236 --repeats 2
    python benchmarks/engine_batched.py --profile                   # torch profiler table, current
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

REPO_ROOT = common.REPO_ROOT


def workload(seed: int = 0, n: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 49000) for _ in range(rng.randint(8, 512))], rng.randint(4, 128))
        for _ in range(n)
    ]


def run_here(profile: bool = False) -> dict:
    """One run in this process (whatever prism_serve is importable here)."""
    from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
    from prism_serve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", dtype="float32", max_model_len=2048,
                                    max_num_seqs=32, kv_cache_bytes=2 * 2**30))  # fmt: skip
    reqs = workload()
    for i, (prompt, n_out) in enumerate(reqs):
        engine.add_request(
            prompt, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True), f"r{i}"
        )
    outputs: dict[str, list[int]] = {}
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        prof = torch_profile(activities=[ProfilerActivity.CPU])
        prof.__enter__()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outputs[o.req_id] = list(o.token_ids)
        steps += 1
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr)
    tokens = sum(len(p) + o for p, o in reqs)
    return {"wall_s": wall, "steps": steps, "total_tok_s": tokens / wall, "outputs": outputs}


def run_rev(rev: str, worktrees: dict[str, Path], tmp: Path) -> dict:
    """One run of commit ``rev``'s engine in a child process."""
    if rev not in worktrees:
        path = tmp / f"rev-{len(worktrees)}"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO_ROOT, check=True,
                       capture_output=True)  # fmt: skip
        worktrees[rev] = path
    env = {**os.environ, "PYTHONPATH": f"{worktrees[rev] / 'src'}:{Path(__file__).parent}"}
    out = tmp / "result.json"
    subprocess.run([sys.executable, __file__, "--child", str(out)], env=env, check=True, cwd=tmp)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", help="commit whose engine is the baseline")
    p.add_argument("--current", help="commit to measure instead of this checkout")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.child.write_text(json.dumps(run_here()))
        return
    print(common.machine_info()["line"])
    if not args.baseline:
        r = run_here(args.profile)
        print(f"wall {r['wall_s']:.1f} s, {r['steps']} steps, {r['total_tok_s']:.1f} tok/s")
        return
    worktrees: dict[str, Path] = {}
    runs: dict[str, list[dict]] = {"current": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="prism-engine-ab-") as t:
        try:
            for _ in range(args.repeats):
                for name, rev in (("current", args.current), ("baseline", args.baseline)):
                    common.wait_quiet(30, 0.3)
                    r = run_rev(rev, worktrees, Path(t)) if rev else run_rev_here(Path(t))
                    runs[name].append(r)
                    print(f"{name:>8} ({rev or 'this checkout'}): wall {r['wall_s']:.1f} s, "
                          f"{r['total_tok_s']:.1f} tok/s")  # fmt: skip
        finally:
            for path in worktrees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO_ROOT)
    cur, base = (statistics.mean(r["total_tok_s"] for r in runs[k]) for k in ("current", "baseline"))
    same = sum(runs["current"][0]["outputs"][k] == v for k, v in runs["baseline"][0]["outputs"].items())
    print(f"throughput current / baseline: {cur / base:.3f}x (mean of {args.repeats} runs each)")
    print(f"identical greedy outputs: {same}/{len(runs['baseline'][0]['outputs'])}")


def run_rev_here(tmp: Path) -> dict:
    """This checkout, in a child process too (the same conditions as the baseline's)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT / 'src'}:{Path(__file__).parent}"}
    out = tmp / "result.json"
    subprocess.run([sys.executable, __file__, "--child", str(out)], env=env, check=True, cwd=tmp)
    return json.loads(out.read_text())


if __name__ == "__main__":
    main()
